"""Functions run on every rank by tests/_dist.py for the remote-dataset tests."""
from __future__ import annotations


def loader_epochs(url: str, cache_dir: str, cache_limit: int | None, epochs: list, batch_size: int,
                  window: int, seed: int) -> dict:
    """One Loader per rank over a remote URL, sharing the node's cache directory; what it read
    (global indices per batch) and its download counters."""
    import fastload

    with fastload.Loader(url, batch_size=batch_size, seed=seed, shuffle_mode="window", window=window,
                         device="cpu", prefetch=2, threads=1, cache_dir=cache_dir, cache_limit=cache_limit) as lo:
        out = []
        per_epoch = []
        for e in epochs:
            lo.set_epoch(e)
            for b in lo:
                out.append(b["index"].tolist())
            per_epoch.append(lo.stats()["downloads"])
        c = lo.dataset.cache
    downloads, self_fetches, evictions = c.downloads, c.self_fetches, c.evictions  # after close: all in
    return {"index": out, "downloads": downloads, "per_epoch": per_epoch, "self_fetches": self_fetches,
            "evictions": evictions}

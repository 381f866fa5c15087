"""Copy-on-write memory growth of DataLoader workers over one epoch.

A Dataset holding a Python list of per-sample objects makes forked DataLoader workers grow:
reading an entry (and the garbage collector walking the list) writes its refcount / GC
header, so the worker gets a private copy of every page it touches. This measures each
worker's USS and PSS after the first few batches and again at the end of the epoch (summed
over workers), for a per-sample Python list, fastload.Dataset in the same DataLoader, and
fastload.Loader (no worker processes: the main process's growth is reported instead).

    python bench/bench_cow.py [--samples 1000000] [--smoke]
"""
from __future__ import annotations

import argparse
import gc
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import torch

from fastload.bench.report import headline, system_info

BATCH, WORKERS, EARLY = 256, 2, 4  # EARLY: batches delivered before the first memory sample


class ListDataset(torch.utils.data.Dataset):
    """The usual pattern: a Python list of (path, label), one entry per sample."""

    def __init__(self, n: int):
        self.samples = [(f"/data/train/{i % 1000:04d}/{i:08d}.jpg", i % 1000) for i in range(n)]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        path, label = self.samples[i]
        return torch.full((16,), float(len(path) + label)), label


def _private_dirty(pid: int) -> int:
    """Private_Dirty bytes: pages this process wrote (copy-on-write copies, its own heap), as
    opposed to the clean file pages of mapped shards, which USS also counts when unshared."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Private_Dirty:"))
    except (OSError, StopIteration):
        return 0


def _mem(procs: list[psutil.Process]) -> np.ndarray:
    """(USS, PSS, private dirty) bytes summed over ``procs``."""
    out = np.zeros(3, np.int64)
    for p in procs:
        m = p.memory_full_info()
        out += (m.uss, m.pss, _private_dirty(p.pid))
    return out


def _wait_children(timeout: float = 30.0) -> None:
    gc.collect()
    _, alive = psutil.wait_procs(psutil.Process().children(), timeout=timeout)
    if alive:
        raise RuntimeError(f"worker processes still alive: {[p.pid for p in alive]}")


def run_dataloader(ds) -> tuple[np.ndarray, float, int]:
    """One epoch; returns (end - early memory of the workers, epoch seconds, worker count)."""
    dl = torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=WORKERS,
                                     persistent_workers=False)
    nb = len(dl)
    t0 = time.perf_counter()
    it = iter(dl)
    try:
        for _ in range(min(EARLY, nb)):
            next(it)
        workers = psutil.Process().children()
        early = _mem(workers)
        for _ in range(nb - min(EARLY, nb)):
            next(it)
        end = _mem(workers)  # workers are still alive: the iterator is not yet exhausted
        for _ in it:
            raise RuntimeError("DataLoader delivered more batches than len(dl)")
        secs = time.perf_counter() - t0
    finally:
        del it
        _wait_children()
    return end - early, secs, len(workers)


def run_loader(path) -> tuple[np.ndarray, float]:
    import fastload

    me = psutil.Process()
    loader = fastload.Loader(path, batch_size=BATCH, device="cpu")
    try:
        t0 = time.perf_counter()
        early = None
        for i, _ in enumerate(loader):
            if i + 1 == EARLY:
                early = _mem([me])
        end = _mem([me])
        secs = time.perf_counter() - t0
    finally:
        loader.close()
    return end - (early if early is not None else end), secs


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    if a.smoke:
        a.samples = 20_000
    import fastload

    n = a.samples
    tmp = Path(tempfile.mkdtemp(prefix="fastload-bench-cow-"))
    results: dict[str, dict] = {}

    def record(name, kind, growth, secs, note):
        uss, pss, dirty = (int(v) for v in growth)
        results[name] = {"kind": kind, "uss_growth_mb": uss / 2**20, "pss_growth_mb": pss / 2**20,
                         "dirty_growth_mb": dirty / 2**20, "bytes_per_sample": uss / n,
                         "seconds": secs, "note": f"{note}; private dirty {dirty / 2**20:+.1f} MB"}

    try:
        _wait_children()
        ds = ListDataset(n)
        growth, secs, nw = run_dataloader(ds)
        del ds
        record(f"Dataset with a Python list of paths, DataLoader(num_workers={WORKERS})", "dataloader",
               growth, secs, f"sum over {nw} workers")

        path = tmp / "ds"
        with fastload.ShardWriter(path, {"x": "float32[16]", "label": "int64"}, label="label",
                                  shard_size="16MB") as w:
            rng = np.random.default_rng(0)
            for s in range(0, n, 100_000):
                k = min(100_000, n - s)
                w.write_batch({"x": rng.standard_normal((k, 16), dtype=np.float32),
                               "label": np.arange(s, s + k) % 1000})
        fds = fastload.Dataset(path)
        shards = fds.num_shards
        growth, secs, nw = run_dataloader(fds)
        del fds
        record(f"fastload.Dataset in a DataLoader(num_workers={WORKERS})", "ours", growth, secs,
               f"sum over {nw} workers")

        growth, secs = run_loader(path)
        record("fastload Loader (no workers)", "ours", growth, secs, "main process (C++ threads)")

        print(f"copy-on-write growth over one epoch: {n:,} samples, batch {BATCH}, shuffle, "
              f"{shards} fastload shards; growth = end of epoch - after {EARLY} batches")
        print(system_info())
        headers = ["system", "USS growth MB", "PSS growth MB", "bytes/sample", "epoch s", "note"]
        table = [[k, f"{r['uss_growth_mb']:.1f}", f"{r['pss_growth_mb']:.1f}",
                  f"{r['bytes_per_sample']:.1f}", f"{r['seconds']:.2f}", r["note"]]
                 for k, r in results.items()]
        widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(headers)]
        print("  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip())
        print("  ".join("-" * w for w in widths))
        for row in table:
            print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) if i < 5 else c
                            for i, (c, w) in enumerate(zip(row, widths))))
        names = list(results)
        base, ours, loader = (results[k] for k in names)
        headline(f"DataLoader worker memory growth (USS, {WORKERS} workers) over a {n:,}-sample epoch",
                 script="bench_cow.py", unit="MB", lower_is_better=True, smoke=a.smoke,
                 ours=("fastload.Dataset in DataLoader", round(ours["uss_growth_mb"], 1)),
                 baseline=("Python list of paths", base["uss_growth_mb"]) if base["uss_growth_mb"] > 0 else None,
                 note=f"one run (memory, not time); fastload Loader (no workers): {loader['uss_growth_mb']:+.1f} MB")
        return results
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Raw-tensor gather benchmark: the fastload ring vs torch DataLoader vs the memory limit.

    .venv/bin/python bench/bench_tensor.py            # full run (about a minute on 2 cores)
    .venv/bin/python bench/bench_tensor.py --smoke    # tiny sizes, one repeat (seconds)
    .venv/bin/python bench/bench_tensor.py --sweep    # threads x slots grid (sets defaults)

Cases (all shuffled; each number is a median over several repeats after a warm-up):
  * MNIST: 60,000 x 784 float32 + int64 labels, batch 300. The fastload Ring is fed the
    batches of a fresh random permutation each epoch (the whole epoch with submit_many(), or
    batch by batch with submit() keeping 8 in flight), sources in one shard and in 8 shards;
    torch DataLoader over a TensorDataset (batch_size=300, shuffle=True) with num_workers 0
    and 2; limits: a numpy take of the same rows into a preallocated batch, and memcpy of the
    same bytes as whole contiguous batches (the "limit" column).
  * Large samples: 2,000 x 3x224x224 uint8 + int64 labels, batch 64 (DataLoader cut short).
  * Hand-off overhead: 1-row batches of one int64; microseconds per batch through the ring.

The ring rows and the limit rows are measured round-robin (ring, ring, take, memcpy, ring,
...) so their ratios hold on a machine whose memory bandwidth drifts (cloud VMs). DataLoader
rows are measured on their own, with their worker processes shut down before anything else
runs. Every ring epoch consumes its batches as torch tensors, exactly like a training loop.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from fastload.bench.report import Measurement, headline, interleaved_medians, median_seconds, print_table, system_info
from fastload.ring import Ring, default_slots, default_threads


# ---------------------------------------------------------------------------- building blocks
def make_arrays(n: int, shape: tuple[int, ...], dtype, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "f":
        x = rng.standard_normal((n, *shape), dtype=np.float32).astype(dtype, copy=False)
    else:
        x = rng.integers(0, 256, (n, *shape), dtype=dtype)
    y = rng.integers(0, 10, n, dtype=np.int64)
    return x, y


def split_shards(a: np.ndarray, shards: int) -> list[np.ndarray]:
    return [np.ascontiguousarray(p) for p in np.array_split(a, shards)]


def locate(sizes: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Global index -> (shard, row), as Dataset.locate does."""
    starts = np.concatenate([[0], np.cumsum(sizes)])
    shard = np.searchsorted(starts, idx, side="right") - 1
    return shard.astype(np.int64), (idx - starts[shard]).astype(np.int64)


class Plans:
    """Pre-drawn epochs (a fresh permutation each), so index preparation is never timed."""

    def __init__(self, n: int, sizes: np.ndarray, count: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self._plans = [locate(sizes, rng.permutation(n)) for _ in range(count)]
        self._i = 0

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        p = self._plans[self._i % len(self._plans)]
        self._i += 1
        return p


def ring_epoch_many(ring: Ring, shard: np.ndarray, row: np.ndarray) -> int:
    """Submit the whole epoch with one call, then consume every batch as torch tensors."""
    ring.submit_many(shard, row)
    rows = 0
    for batch in ring:
        rows += batch["y"].shape[0]
    return rows


def ring_epoch_window(ring: Ring, shard: np.ndarray, row: np.ndarray, window: int = 8) -> int:
    """Submit batch by batch, keeping `window` batches in flight, like a streaming loader."""
    bs = ring.batch_size
    starts = range(0, len(shard), bs)
    it = iter(starts)
    for s in it:
        ring.submit(shard[s : s + bs], row[s : s + bs])
        if ring.pending >= window:
            break
    rows = 0
    while ring.pending:
        rows += ring.get()["y"].shape[0]
        s = next(it, None)
        if s is not None:
            ring.submit(shard[s : s + bs], row[s : s + bs])
    return rows


def dataloader_row(x: np.ndarray, y: np.ndarray, batch: int, workers: int, repeats: int,
                   max_batches: int | None) -> Measurement:
    ds = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    dl = DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers,
                    persistent_workers=workers > 0)
    count = {"rows": 0}

    def epoch() -> None:
        rows = 0
        for i, (bx, _by) in enumerate(dl):
            rows += bx.shape[0]
            if max_batches is not None and i + 1 >= max_batches:
                break
        count["rows"] = rows

    try:
        secs = median_seconds(epoch, repeats=repeats, warmup=1)
    finally:
        dl._iterator = None  # shut persistent workers down before anything else runs  # noqa: SLF001
        del dl
    rows = count["rows"]
    note = "persistent workers" if workers else ""
    if max_batches is not None and rows < len(x):
        note = (note + ", " if note else "") + f"first {rows} samples per epoch"
    per = x[0].nbytes + y[0].nbytes
    return Measurement(f"DataLoader num_workers={workers}", rows, rows * per, secs,
                       kind="dataloader", note=note)


# ---------------------------------------------------------------------------- cases
def case_tensor(title: str, n: int, shape, dtype, batch: int, repeats: int, dl_batches: int | None,
                shards: int, threads=None, slots=None) -> list[Measurement]:
    x, y = make_arrays(n, shape, dtype)
    per = x[0].nbytes + y[0].nbytes
    fields = {"x": (x.dtype, x.shape[1:]), "y": (y.dtype, ())}
    rows: list[Measurement] = []
    for w in (0, 2):
        rows.append(dataloader_row(x, y, batch, w, max(1, min(repeats, 3)), dl_batches))

    xs, ys = split_shards(x, shards), split_shards(y, shards)
    sizes_1 = np.array([n])
    sizes_k = np.array([len(a) for a in xs])
    count = repeats + 2
    plans_1 = Plans(n, sizes_1, count, seed=1)
    plans_k = Plans(n, sizes_k, count, seed=2)
    plans_w = Plans(n, sizes_1, count, seed=3)
    perms = [np.random.default_rng(4 + i).permutation(n) for i in range(count)]
    bx = np.empty((batch, *x.shape[1:]), x.dtype)
    by = np.empty(batch, y.dtype)
    state = {"take": 0}

    def take_epoch() -> None:
        perm = perms[state["take"] % count]
        state["take"] += 1
        for i in range(0, n, batch):
            idx = perm[i : i + batch]
            k = len(idx)
            np.take(x, idx, axis=0, out=bx[:k])
            np.take(y, idx, axis=0, out=by[:k])

    def memcpy_epoch() -> None:
        for i in range(0, n, batch):
            k = min(batch, n - i)
            np.copyto(bx[:k], x[i : i + k])
            np.copyto(by[:k], y[i : i + k])

    # The whole Loader (sampler, ring, batch dicts) over the same rows written as a dataset.
    import shutil
    import tempfile

    import fastload

    tmp = tempfile.mkdtemp(prefix="fastload-bench-tensor-")
    with fastload.ShardWriter(f"{tmp}/ds", {"x": f"{x.dtype.name}{list(x.shape[1:])}", "y": "int64"}) as wr:
        wr.write_batch({"x": x, "y": y})
    loader = fastload.Loader(f"{tmp}/ds", batch_size=batch, seed=0, threads=threads)
    epoch_no = {"e": 0}

    def loader_epoch() -> None:
        epoch_no["e"] += 1
        loader.set_epoch(epoch_no["e"])
        for _ in loader:
            pass

    kw = {"threads": threads, "slots": slots}
    with Ring(fields, batch, {"x": [x], "y": [y]}, **kw) as r1, \
            Ring(fields, batch, {"x": xs, "y": ys}, **kw) as rk, \
            Ring(fields, batch, {"x": [x], "y": [y]}, **kw) as rw:
        fns = {
            "ring1": lambda: ring_epoch_many(r1, *plans_1.next()),
            "ringk": lambda: ring_epoch_many(rk, *plans_k.next()),
            "ringw": lambda: ring_epoch_window(rw, *plans_w.next()),
            "take": take_epoch,
            "memcpy": memcpy_epoch,
            "loader": loader_epoch,
        }
        try:
            secs = interleaved_medians(fns, repeats=repeats, warmup=1)
        finally:
            loader.close()
            shutil.rmtree(tmp, ignore_errors=True)
        cfg = f"threads={r1.threads} slots={r1.num_slots}"
        grown = r1.stats()["grown"] + rk.stats()["grown"] + rw.stats()["grown"]
    if grown:
        cfg += f" (grew {grown})"
    nb = n * per
    rows[:0] = [
        Measurement("fastload Loader", n, nb, secs["loader"], "ours", "sampler + ring + batch dicts (+ index)"),
        Measurement("fastload Ring, 1 shard", n, nb, secs["ring1"], "ours", f"{cfg}, epoch via submit_many"),
        Measurement(f"fastload Ring, {shards} shards", n, nb, secs["ringk"], "ours", f"{cfg}, epoch via submit_many"),
        Measurement("fastload Ring, 1 shard", n, nb, secs["ringw"], "ours", f"{cfg}, submit() per batch, 8 in flight"),
    ]
    rows += [
        Measurement("numpy take (1 thread)", n, nb, secs["take"], "other", "same rows into a preallocated batch"),
        Measurement("memcpy (1 thread)", n, nb, secs["memcpy"], "limit", "same bytes as whole contiguous batches"),
    ]
    print_table(title, rows)
    return rows


def case_handoff(batches: int, repeats: int, threads=None, slots=None) -> tuple[float, float]:
    """Microseconds per 1-row batch, submit() + get() as torch tensors, end to end:
    (8 batches kept in flight, the whole queue submitted first)."""
    y = np.arange(1000, dtype=np.int64)
    rng = np.random.default_rng(3)
    rows = [rng.integers(0, 1000, 1).astype(np.int64) for _ in range(batches)]
    zero = np.zeros(1, np.int64)
    with Ring({"y": (np.int64, ())}, 1, {"y": [y]}, threads=threads, slots=slots) as ring:

        def streaming() -> None:
            it = iter(rows)
            for _ in range(8):
                ring.submit(zero, next(it))
            for r in it:
                ring.get()
                ring.submit(zero, r)
            while ring.pending:
                ring.get()

        def queued() -> None:
            for r in rows:
                ring.submit(zero, r)
            while ring.pending:
                ring.get()

        secs = interleaved_medians({"stream": streaming, "queued": queued}, repeats=repeats, warmup=1)
    us_stream = secs["stream"] / batches * 1e6
    us_queued = secs["queued"] / batches * 1e6
    print("\n## Hand-off overhead (1-row int64 batches: submit() + get() as torch tensors)")
    print(f"8 batches in flight       : {us_stream:6.2f} us/batch ({batches / secs['stream'] / 1e3:.0f} k batches/s)")
    print(f"all batches queued first  : {us_queued:6.2f} us/batch ({batches / secs['queued'] / 1e3:.0f} k batches/s)")
    print("target                    :  < 20 us/batch")
    return us_stream, us_queued


def sweep(repeats: int, smoke: bool) -> None:
    """threads x slots grid on both tensor cases, each config round-robin with memcpy."""
    cases = [("MNIST", 3_000 if smoke else 60_000, (784,), np.float32, 300),
             ("3x224x224", 200 if smoke else 2_000, (3, 224, 224), np.uint8, 64)]
    for title, n, shape, dtype, batch in cases:
        x, y = make_arrays(n, shape, dtype)
        fields = {"x": (x.dtype, x.shape[1:]), "y": (y.dtype, ())}
        bx = np.empty((batch, *x.shape[1:]), x.dtype)
        by = np.empty(batch, y.dtype)

        def memcpy_epoch() -> None:
            for i in range(0, n, batch):
                k = min(batch, n - i)
                np.copyto(bx[:k], x[i : i + k])
                np.copyto(by[:k], y[i : i + k])

        print(f"\n## sweep {title}: % of memcpy (round-robin with memcpy)")
        print("threads " + " ".join(f"slots={s:<2d}" for s in (2, 3, 4, 5, 6, 8)))
        for threads in (1, 2, 3, 4):
            cells = []
            for slots in (2, 3, 4, 5, 6, 8):
                plans = Plans(n, np.array([n]), repeats + 2, seed=threads * 10 + slots)
                with Ring(fields, batch, {"x": [x], "y": [y]}, threads=threads, slots=slots) as r:
                    secs = interleaved_medians(
                        {"ring": lambda: ring_epoch_many(r, *plans.next()), "memcpy": memcpy_epoch},
                        repeats=repeats, warmup=1)
                cells.append(f"{100 * secs['memcpy'] / secs['ring']:6.0f}% ")
            print(f"{threads:7d} " + " ".join(cells))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes and one repeat")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per row (default 7)")
    ap.add_argument("--threads", type=int, default=None, help="ring producer threads (default: auto)")
    ap.add_argument("--slots", type=int, default=None, help="ring slots (default: auto)")
    ap.add_argument("--sweep", action="store_true", help="measure a threads x slots grid")
    args = ap.parse_args(argv)
    repeats = args.repeats or (1 if args.smoke else 7)
    print(f"# fastload bench_tensor — {system_info()}")
    print(f"# Ring defaults here: threads={default_threads()}, slots={default_slots(default_threads())}")
    if args.sweep:
        sweep(repeats, args.smoke)
        return 0
    t0 = time.perf_counter()
    mnist_n = 3_000 if args.smoke else 60_000
    big_n = 200 if args.smoke else 2_000
    kw = {"threads": args.threads, "slots": args.slots}
    mnist = case_tensor(f"MNIST: {mnist_n:,} x 784 float32 + int64 label, batch 300, shuffled",
                        mnist_n, (784,), np.float32, 300, repeats, None, shards=8, **kw)
    big = case_tensor(f"Large samples: {big_n:,} x 3x224x224 uint8 + int64 label, batch 64, shuffled",
                      big_n, (3, 224, 224), np.uint8, 64, repeats, 3 if args.smoke else 8, shards=8, **kw)
    us_stream, us_queued = case_handoff(2_000 if args.smoke else 20_000, max(3, repeats // 2), **kw)

    def verdict(rows: list[Measurement], name: str, dl_target: str) -> str:
        loader = next(r.samples_per_s for r in rows if r.system == "fastload Loader")
        ours = max(r.samples_per_s for r in rows if r.kind == "ours")
        dl = max(r.samples_per_s for r in rows if r.kind == "dataloader")
        lim = max(r.samples_per_s for r in rows if r.kind == "limit")
        return (f"{name}: Loader {loader / dl:.1f}x / best Ring row {ours / dl:.1f}x the best DataLoader "
                f"({dl_target}); Loader {100 * loader / lim:.0f}% / Ring {100 * ours / lim:.0f}% of memcpy "
                "(target >= 70%)")

    def record(rows: list[Measurement], workload: str) -> None:
        by = {r.system: r for r in rows}
        dl = max((r for r in rows if r.kind == "dataloader"), key=lambda r: r.samples_per_s)
        lim = max((r for r in rows if r.kind == "limit"), key=lambda r: r.samples_per_s)
        ring = max((r for r in rows if r.system.startswith("fastload Ring")), key=lambda r: r.samples_per_s)
        headline(workload, script="bench_tensor.py", unit="samples/s", smoke=args.smoke,
                 ours=("Loader", by["fastload Loader"].samples_per_s), baseline=(dl.system, dl.samples_per_s),
                 limit=("memcpy", lim.samples_per_s),
                 note=f"Ring alone {100 * ring.samples_per_s / lim.samples_per_s:.0f}% of memcpy")

    record(mnist, f"MNIST {mnist_n:,}x784 float32, batch 300, shuffled")
    record(big, f"{big_n:,} x 3x224x224 uint8 rows, batch 64, shuffled")
    print("\n## Summary")
    print(verdict(mnist, "MNIST", "target >= 5x"))
    print(verdict(big, "Large samples", "no target: one big copy per row is cheap for the DataLoader too"))
    print(f"Hand-off: {us_stream:.1f} us per batch with 8 in flight, {us_queued:.1f} us with all queued (target < 20 us)")
    print(f"(total {time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

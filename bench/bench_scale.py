"""The sampler past a billion samples (issue 30): for N = 10^6, 10^8 and 10^10 stream
positions split over 1,024 ranks (batch 256, rank 0), each in a fresh process:

* time to the first batch (``Sampler(...)`` then ``next(iter(sampler))``) and the peak RSS
  growth it costs (peak resident memory minus the resident memory before, after imports);
* time to resume at a random position (a new Sampler, ``load_state_dict``, the next batch);
* the sampler alone's rate (samples/s of ready batches on one core, ~1 s of batches), by the
  clock and per second of this process's CPU time (``time.process_time``: the one-core figure
  on a shared machine, where the clock counts the time other processes took the core).

Beside it, the sampler of state version 2 (before the per-position shuffle): its first batch
waited for a materialised permutation of N (fastload's C++ Fisher-Yates, 4 bytes per
sample; 10^10 would need 74.5 GiB: not run). And a Loader over a generated dataset of
one-byte rows: its open time and first-batch time (``--rows``; ``--full``: 10^8 rows in
1,000 shards: 100 MB of values, ~1.1 GB on disk with each row's key; about a minute to
write). Its first batch verifies each shard it touches whole (``verify="first-use"``), and a
full shuffle's first batch of 256 touches ~230 of the 1,000 shards.

And a Loader over a ragged dataset of ``--ragged-docs`` documents (``--full``: 10^8; hard
links to one shard of 10^6 documents, verify="off"), its lengths memory-mapped from the node's
cache: for padded, packed and pack_to delivery, the Loader's construction, its first batch,
the peak RSS growth (the memory maps' pages included) and the peak anonymous memory growth;
each twice, the first on the node computing the lengths' summary
(fastload.sampling.length_summary) and a later one reading it; and a packed pass resumed at
60% of the epoch, first reading every length before, then from the chunk counts the node
kept (fastload.sampling.packing.TokenStream).

And the open time of a dataset of ``--manifest-shards`` (100,000) shards, with a Loader's
first batch over it and 50 more (each of 256 shards), and the shard mappings the process
holds (bounded: fastload.store.mapped).

And weighted (with replacement) and class-balanced sampling at scale (``--table-sizes``:
10^6 and 10^8 samples, weights / labels memory-mapped from a generated file): the time the
node's first rank takes to build the table kept in the cache directory, its private memory
meanwhile, and a later rank's first batch, memory (peak RSS, and private memory: the mapped
table's pages are the node's page cache, shared), resume and rate.

Also a mixture's stream (``--mix-sizes``: epochs of 10^6, 10^8, 10^10 positions over three
datasets): first batch, memory, resume, rate; and a packed pass (``--pack-sizes``: 10^6 and
10^8 documents of generated lengths, rows of 8 x 4,096 tokens): the epoch's token count,
first batch, memory, a resume at a random step (it reads the lengths up to there), the
plan's rate.

And a remote packing Loader's wait before its first batch (``--remote-rows`` documents of
0-15 tokens): the part of its plan (``PackScan``) scanned on the training thread, up to
``fastload.loader.remote.SYNC_POSITIONS`` tokens, the rest left to the background planner; and
that background scan's CPU cost per position (``--scan-positions``: 10^7 positions in 10,000
shards; ``PassScan`` of the full shuffle and of window mode, ``PackScan``).

And a remote dataset's cache (``--plan-sizes``: its plan of a full shuffle of 10^6 and 10^8
positions, scanned whole: time and peak RSS; ``--remote-rows``: a Loader over ``http://``
(the test suite's range-capable server on this machine) of 10^6 and 10^7 one-byte rows in
``--remote-shards`` shards: built, first batch, peak RSS growth).

    python bench/bench_scale.py [--smoke] [--full] [--rows 10000000 --shards 100] [--manifest-shards 100000]
                                [--mix-sizes 1e6,1e8,1e10] [--pack-sizes 1e6,1e8] [--table-sizes 1e6,1e8]
                                [--plan-sizes 1e6,1e8] [--remote-rows 1e6,1e7 --remote-shards 100] [--ragged-docs 1e7]
                                [--scan-positions 1e7]

``--smoke`` (tiny sizes; the test suite runs it) forks each child from this process instead of
starting a fresh interpreter: it checks every row still runs; its figures are not comparable.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

WORLD, BATCH = 1024, 256


def _rss() -> int:
    """Resident bytes now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _reset_peak() -> int:
    """Reset the peak resident memory (Linux: ``5`` to /proc/self/clear_refs resets VmHWM)
    and return the resident bytes now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _rss()


def _anon() -> int:
    """Resident anonymous bytes now (RssAnon: not the pages of mapped or hashed files; what a
    rank holds that no other process shares)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def _peak() -> int:
    """Peak resident bytes since :func:`_reset_peak` (VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _sampler_figures(make, n: int, seconds: float) -> dict:
    """First batch, its memory, a resume at a random step and the sampler alone's rate of
    ``make(batch_size=, world_size=, rank=, seed=)`` (rank 0 of WORLD), measured in this
    (fresh) process after a small warm-up sampler (the imports and numpy's first calls)."""
    next(iter(make(batch_size=4, world_size=1, rank=0, seed=0)))
    before = _reset_peak()
    t0 = time.perf_counter()
    s = make(batch_size=BATCH, world_size=WORLD, rank=0, seed=1)
    it = iter(s)
    first = next(it)
    first_s = time.perf_counter() - t0
    growth = max(0, _peak() - before)
    assert len(first) == min(BATCH, -(-n // WORLD))
    state = s.state_dict(consumed=int(np.random.default_rng(n % 997).integers(0, len(s))) * BATCH * WORLD)
    t0 = time.perf_counter()
    r = make(batch_size=BATCH, world_size=WORLD, rank=0, seed=1)
    r.load_state_dict(state)
    next(iter(r))
    resume_s = time.perf_counter() - t0
    count, epoch, t0, c0 = 0, 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - t0 < seconds:  # whole epochs of this rank when they are short
        for b in it:
            count += len(b)
            if time.perf_counter() - t0 > seconds:
                break
        epoch += 1
        s.set_epoch(epoch)
        it = iter(s)
    rate_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    return {"n": n, "first_s": first_s, "rss_growth": growth, "resume_s": resume_s,
            "samples_per_s": count / rate_s if count else 0.0,
            "cpu_samples_per_s": count / cpu_s if count and cpu_s > 0 else 0.0,
            "batches_per_s": count / BATCH / rate_s if count else 0.0}


def child_sampler(n: int, seconds: float) -> dict:
    """Measured in this (fresh) process: first batch, its memory, resume, rate."""
    from fastload import Sampler

    return _sampler_figures(lambda **kw: Sampler(n, **kw), n, seconds)


class GeneratedLengths:
    """Document lengths ``low..low+spread-1`` (default 1..2048) hashed from the document's
    index, computed when read (nothing held: 10^8 of them would be 800 MB as an array);
    indexable by slices and index arrays. ``GeneratedLengths(n, 16, 0)``: the 0-15 tokens of
    :func:`_ragged_dataset`'s documents."""

    def __init__(self, n: int, spread: int = 2048, low: int = 1) -> None:
        self.n, self.spread, self.low = n, spread, low

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, key) -> np.ndarray:
        from fastload.sampling.streams import splitmix64

        idx = np.arange(*key.indices(self.n), dtype=np.int64) if isinstance(key, slice) else np.asarray(key)
        with np.errstate(over="ignore"):
            return (splitmix64(idx.astype(np.uint64)) % np.uint64(self.spread)).astype(np.int64) + self.low


PACK_ROWS, PACK_LEN = 8, 4096


def child_pack(n: int, seconds: float) -> dict:
    """A packed pass over ``n`` documents of :class:`GeneratedLengths` (mean 1,024.5 tokens),
    rank 0 of 1,024, rows of 8 x 4,096 tokens: the epoch's token count (once per dataset),
    the first batch and its memory, a resume at a random token, the rate of the plan alone."""
    from fastload import Sampler
    from fastload.sampling.packing import pack_plan, token_total

    lengths = GeneratedLengths(n)
    s = Sampler(n, batch_size=PACK_ROWS, world_size=WORLD, rank=0, seed=1)
    t0 = time.perf_counter()
    total = token_total(lengths)
    total_s = time.perf_counter() - t0

    def plan(start: int):
        return pack_plan(0, start, s.order_stream(0), lengths, rows=PACK_ROWS, length=PACK_LEN, world_size=WORLD,
                         rank=0, drop_last=True, total=total)

    warm = plan(0)
    warm.request(0)
    before = _reset_peak()
    t0 = time.perf_counter()
    p = plan(0)
    first = p.request(0)
    first_s = time.perf_counter() - t0
    growth = max(0, _peak() - before)
    assert int(first.count.sum()) == PACK_ROWS * PACK_LEN
    at = int(np.random.default_rng(n % 997).integers(0, len(p))) * p.bounds.step
    t0 = time.perf_counter()
    plan(at).request(0)
    resume_s = time.perf_counter() - t0
    count, t0 = 0, time.perf_counter()
    for _req, _ in p.requests():
        count += 1
        if time.perf_counter() - t0 > seconds:
            break
    rate_s = time.perf_counter() - t0
    return {"n": n, "total_s": total_s, "first_s": first_s, "rss_growth": growth, "resume_s": resume_s,
            "resume_docs": at * n // total, "batches_per_s": count / rate_s,
            "docs_per_s": count * p.bounds.step * n / total / rate_s}


RAGGED_PER_SHARD = 1_000_000  # documents per shard of the generated ragged dataset (hard links to one)


def _ragged_dataset(n: int, folder: str) -> Path:
    """A dataset of ``n`` documents of 0-15 int16 tokens (hashed from the row: mean 7.5), made in
    seconds: one shard of :data:`RAGGED_PER_SHARD` documents hard-linked ``n / RAGGED_PER_SHARD``
    times, and (past ``MAP_MIN`` documents) its lengths kept in the node's cache
    (``$FASTLOAD_CACHE``: the bench points it into its folder) by tiling the one shard's (what
    ``Dataset.lengths()`` reads from the shards' offsets once per node)."""
    import fastload
    from fastload.bench.linked import link_shards
    from fastload.sampling.streams import splitmix64
    from fastload.store.lengths import MAP_MIN, local_lengths_path

    per = min(n, RAGGED_PER_SHARD)
    path = Path(folder) / f"ragged-{n}"
    if (path / "manifest.json").exists():
        return path
    with np.errstate(over="ignore"):
        lens = (splitmix64(np.arange(per, dtype=np.uint64)) % np.uint64(16)).astype(np.int64)
    one = Path(folder) / f"ragged-one-{per}"
    if not (one / "manifest.json").exists():
        values = (np.arange(int(lens.sum())) % 30_000).astype(np.int16)
        with fastload.ShardWriter(one, {"tokens": "int16[]"}, shard_size="2GB") as w:  # one shard
            w.write_batch({"tokens": fastload.Ragged.from_lengths(values, lens)})
    link_shards(one, path, n // per)
    kept = local_lengths_path(fastload.Dataset(path), "tokens") if n >= MAP_MIN else None
    if kept is not None:  # what the first Loader on the node would read from the shards
        kept.parent.mkdir(parents=True, exist_ok=True)
        out = np.lib.format.open_memmap(kept, mode="w+", dtype=np.int64, shape=(n // per * per,))
        for a in range(0, len(out), per):
            out[a:a + per] = lens
        out.flush()
        del out
    return path


def _anon_peak():
    """A thread sampling this process's anonymous resident memory (RssAnon: not the page cache
    of memory-mapped files) every millisecond; returns ``stop()`` -> the peak in bytes."""
    import threading

    peak, done = [0], threading.Event()

    def run() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _anon())
            done.wait(0.001)

    t = threading.Thread(target=run, daemon=True)
    base = _anon()
    t.start()

    def stop() -> int:
        done.set()
        t.join()
        return max(0, max(peak[0], _anon()) - base)
    return stop


def child_ragged(n: int, mode: str, folder: str, when: str = "later") -> dict:
    """A Loader over ``n`` documents with memory-mapped lengths (:func:`_ragged_dataset`), rank
    0 of 1,024, ``mode`` ``padded``/``packed`` (batch 256, max_length 12) or ``pack`` (8 rows
    of 4,096 tokens; ``pack1``: with prefetch=1, so that the first batch does not wait for the
    look-ahead's batches, whose tokens lie up to 8 global steps into the stream: rank 0 of
    1,024 reads the lengths of ~36M documents of 7.5 tokens to place them): open
    (``verify="off"``), Loader and first batch in this (fresh) process; its peak RSS growth
    (pages of the lengths' and shards' memory maps included) and peak anonymous memory growth.
    ``when="first"``: as the node's first Loader (the lengths' summaries and chunk counts kept
    beside them removed first)."""
    import fastload
    from fastload.store.lengths import local_lengths_path

    path = _ragged_dataset(n, folder)
    kept = local_lengths_path(fastload.Dataset(path), "tokens")
    if when == "first" and kept is not None:
        for old in [*kept.parent.glob(kept.stem + ".summary-*.npz"), *kept.parent.glob(kept.stem + ".chunks-*.npy")]:
            old.unlink()
    warm = Path(folder) / "ragged-warm"  # the first Loader imports pyarrow and the loader's parts
    if not (warm / "manifest.json").exists():
        with fastload.ShardWriter(warm, {"tokens": "int16[]"}) as w:
            w.write_batch({"tokens": [np.arange(i % 5, dtype=np.int16) for i in range(100)]})
    with fastload.Loader(fastload.Dataset(warm), batch_size=4, device="cpu", pack_to=8) as lo:
        next(iter(lo))
    with fastload.Loader(fastload.Dataset(warm), batch_size=4, device="cpu", max_length=3) as lo:
        next(iter(lo))
    kw = (dict(batch_size=PACK_ROWS, pack_to=PACK_LEN) if mode == "pack" else
          dict(batch_size=PACK_ROWS, pack_to=PACK_LEN, prefetch=1) if mode == "pack1" else
          dict(batch_size=BATCH, ragged=mode, max_length=12))
    before = _reset_peak()
    anon = _anon_peak()
    t0 = time.perf_counter()
    ds = fastload.Dataset(path, verify="off")  # (its shards are links to one: hashing them measures nothing here)
    with fastload.Loader(ds, world_size=WORLD, rank=0, device="cpu", seed=1, **kw) as lo:
        made_s = time.perf_counter() - t0
        batch = next(iter(lo))
        first_s = time.perf_counter() - t0
    assert len(batch["index"]) >= (PACK_ROWS if mode.startswith("pack") else BATCH)
    return {"n": len(ds), "mode": mode, "loader_s": made_s, "first_s": first_s,
            "rss_growth": max(0, _peak() - before), "anon_growth": anon()}


def child_resume(n: int, folder: str) -> dict:
    """A packed pass (8 x 4,096 tokens, rank 0 of 1,024) over the lengths of
    :func:`_ragged_dataset` (memory-mapped from the node's cache) resumed at 60% of an epoch's
    tokens: first without the epoch's chunk counts kept on the node (it reads every length
    before), then as a later run or rank of the node (from the counts that pass kept)."""
    import fastload
    from fastload import Sampler
    from fastload.sampling.packing import chunk_index_path, pack_plan, token_total

    lengths = fastload.Dataset(_ragged_dataset(n, folder), verify="off").lengths("tokens")
    stream = Sampler(len(lengths), batch_size=PACK_ROWS, world_size=WORLD, rank=0, seed=1).order_stream(0)
    total = token_total(lengths)
    kept = chunk_index_path(stream, lengths, None)
    if kept is not None and kept.exists():
        kept.unlink()
    at = int(total * 0.6)  # (a run stops at a multiple of its step: any token will do here)
    out = {"n": len(lengths), "kept": kept is not None}
    for what in ("resume_s", "again_s"):
        t0 = time.perf_counter()
        req = pack_plan(0, at, stream, lengths, rows=PACK_ROWS, length=PACK_LEN, world_size=WORLD, rank=0,
                        drop_last=False, total=total).request(0)
        out[what] = time.perf_counter() - t0
    out["docs_before"] = int(req.positions[0])
    return out


def child_mixture(n: int, seconds: float) -> dict:
    """A mixture epoch of ``n`` positions over three datasets of 0.6, 0.3 and 0.1 x n samples
    (weights 0.5, 0.3, 0.2; per="batch"), rank 0 of 1,024: first batch, its memory, a resume
    at a random step, the sampler alone's rate."""
    from fastload.sampling.mixture import MixtureOrder, MixtureSampler

    sizes = np.array([n * 6 // 10, n * 3 // 10, n // 10], dtype=np.int64)
    order = MixtureOrder(("a", "b", "c"), sizes, np.concatenate([[0], np.cumsum(sizes)[:-1]]),
                         np.array([0.5, 0.3, 0.2]), "batch", n, None)
    return _sampler_figures(lambda **kw: MixtureSampler(order, **kw), n, seconds)


def _table_data(kind: str, n: int, folder: str) -> np.ndarray:
    """``n`` weights (float64, 1 to 1,000) or labels (int32, 1,000 classes) hashed from the
    index, written once to ``folder`` and memory-mapped (a user's array of 10^10 weights
    would be one too)."""
    from fastload.sampling.streams import splitmix64

    path = Path(folder) / f"{kind}-{n}.npy"
    if not path.exists():
        tmp = path.with_name(".tmp-" + path.name)
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float64 if kind == "weighted" else np.int32,
                                        shape=(n,))
        for a in range(0, n, 1 << 22):
            b = min(n, a + (1 << 22))
            with np.errstate(over="ignore"):
                v = splitmix64(np.arange(a, b, dtype=np.uint64)) % np.uint64(1000)
            out[a:b] = v + 1 if kind == "weighted" else v
        out.flush()
        del out
        tmp.rename(path)
    return np.load(path, mmap_mode="r")


def child_table(kind: str, role: str, n: int, folder: str, seconds: float) -> dict:
    """Weighted (with replacement) or class-balanced sampling over ``n`` samples whose table
    is kept in ``$FASTLOAD_CACHE`` (set by the parent): ``role`` "build": the node's first
    rank, which builds it (time, private memory at its peak: numpy's allocations, traced);
    "rank": a later rank of the node, which maps it (first batch, memory, resume, rate)."""
    import tracemalloc

    from fastload import Sampler

    data = _table_data(kind, n, folder)
    arg = "weights" if kind == "weighted" else "balance_labels"

    def make(**kw):
        return Sampler(n, **{arg: data}, **kw)

    if role == "build":
        next(iter(Sampler(10, batch_size=2, **{arg: np.arange(1, 11)})))  # imports, numpy's first calls
        a0 = _anon()
        tracemalloc.start()
        t0 = time.perf_counter()
        s = make(batch_size=BATCH, world_size=WORLD, rank=0, seed=1)
        next(iter(s))
        build_s = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return {"n": n, "build_s": build_s, "private_peak": peak, "anon_growth": max(0, _anon() - a0),
                "mapped": type(s._table[0]).__name__ == "memmap"}
    a0 = _anon()
    out = _sampler_figures(make, n, seconds)
    out["anon_growth"] = max(0, _anon() - a0)
    return out


def child_baseline(n: int) -> dict:
    """A materialised order's first batch (torch's DistributedSampler, and fastload's sampler
    before version 3): a permutation of N computed first (``torch.randperm``)."""
    import torch

    before = _reset_peak()
    t0 = time.perf_counter()
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    first = perm[:BATCH].numpy().astype(np.int64)
    return {"n": n, "first_s": time.perf_counter() - t0, "rss_growth": max(0, _peak() - before),
            "check": int(first.sum())}


def write_bytes(path: Path, rows: int, shards: int) -> float:
    """Write (once) a dataset of ``rows`` one-byte rows in ``shards`` shards; seconds taken."""
    import fastload

    if (path / "manifest.json").exists():
        return 0.0
    t0 = time.perf_counter()
    per = -(-rows // shards)
    with fastload.ShardWriter(path, {"x": "uint8"}, shard_size=per) as w:  # one byte per row: a shard per `per`
        for a in range(0, rows, per):
            w.write_batch({"x": (np.arange(a, min(rows, a + per)) % 251).astype(np.uint8)})
    return time.perf_counter() - t0


def child_loader(rows: int, shards: int, folder: str) -> dict:
    """Write (once) a dataset of ``rows`` one-byte rows in ``shards`` shards; open it and
    read the first batch of rank 0 of 1,024."""
    import fastload

    write = write_bytes
    path = Path(folder) / f"bytes-{rows}-{shards}"
    t_write = write(path, rows, shards)
    warm = Path(folder) / "bytes-warm"  # the first open imports pyarrow and the loader's parts (seconds)
    write(warm, 1000, 2)
    with fastload.Loader(fastload.Dataset(warm), batch_size=4, device="cpu") as lo:
        next(iter(lo))
    before = _reset_peak()
    t0 = time.perf_counter()
    ds = fastload.Dataset(path)
    open_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with fastload.Loader(ds, batch_size=BATCH, world_size=WORLD, rank=0, device="cpu", seed=1) as lo:
        batch = next(iter(lo))
        first_s = time.perf_counter() - t0
    assert len(batch["x"]) == min(BATCH, -(-rows // WORLD))
    return {"rows": rows, "shards": len(ds.shard_sizes), "open_s": open_s, "first_s": first_s,
            "rss_growth": max(0, _peak() - before), "write_s": t_write}


def child_manifest(shards: int, folder: str) -> dict:
    """A dataset of ``shards`` shards (hard links to one shard of 1,000 one-byte rows, so that
    it is made in seconds; the manifest lists each under its own name): its open time, and a
    Loader's first batch over it (rank 0 of 1,024)."""
    import fastload
    from fastload.bench.linked import link_shards

    one = Path(folder) / "one"
    with fastload.ShardWriter(one, {"x": "uint8"}) as w:
        w.write_batch({"x": (np.arange(1000) % 251).astype(np.uint8)})
    with fastload.Loader(fastload.Dataset(one), batch_size=4, device="cpu") as lo:  # warm the imports
        next(iter(lo))
    t0 = time.perf_counter()
    path = link_shards(one, Path(folder) / f"shards-{shards}", shards)
    t_make = time.perf_counter() - t0
    before = _reset_peak()
    t0 = time.perf_counter()
    ds = fastload.Dataset(path)
    open_s = time.perf_counter() - t0
    assert len(ds) == 1000 * shards
    t0 = time.perf_counter()
    first_s, more_s, more, maps, error = None, None, 0, [], None
    # (past fastload.store.mapped.mapped_shard_limit() shards the ring installs shards as batches
    # need them; before, it mapped every shard when it started and failed past vm.max_map_count)
    try:
        with fastload.Loader(ds, batch_size=BATCH, world_size=WORLD, rank=0, device="cpu", seed=1) as lo:
            it = iter(lo)
            batch = next(it)
            first_s = time.perf_counter() - t0
            assert len(batch["x"]) == BATCH
            maps.append(_maps(path))
            t0 = time.perf_counter()
            for _, b in zip(range(MORE_BATCHES), it):  # each of 256 shards: the mappings stay bounded
                assert np.array_equal(b["x"].numpy(), (b["index"].numpy() % 1000) % 251)
                more += 1
            more_s = time.perf_counter() - t0
            maps.append(_maps(path))
    except Exception as e:  # noqa: BLE001 - reported, not hidden
        error = f"{type(e).__name__}: {e}"[:300]
    return {"shards": shards, "open_s": open_s, "first_s": first_s, "error": error, "more_s": more_s, "more": more,
            "maps": maps, "rss_growth": max(0, _peak() - before),
            "manifest_mb": (path / "manifest.json").stat().st_size / 2**20, "make_s": t_make}


def child_plan(n: int, shards: int) -> dict:
    """What a remote Loader computes before its first batch, alone (no server): the cache's
    first-use schedule of the pass and of the next epoch (rank 0 of 1,024; a full shuffle of
    ``n`` samples in ``shards`` equal shards) and the budget it needs; time and peak RSS growth."""
    from fastload import Sampler
    from fastload.remote.schedule import minimum_budget, sampler_uses

    starts = np.linspace(0, n, shards + 1).astype(np.int64)
    sampler_uses(Sampler(1000, batch_size=4, seed=0), np.array([0, 500, 1000]))  # warm-up: imports, first calls
    before = _reset_peak()
    t0 = time.perf_counter()
    s = Sampler(n, batch_size=BATCH, world_size=WORLD, rank=0, seed=1)
    uses = sampler_uses(s, starts)
    nxt = sampler_uses(s, starts, epoch=1, start=0)
    need = minimum_budget(uses.shards, uses.first, uses.last, np.ones(shards, np.int64))[0]
    plan_s = time.perf_counter() - t0
    assert len(uses) == len(nxt) == shards and need == shards  # a full shuffle: every shard in use at once
    return {"n": n, "shards": shards, "plan_s": plan_s, "rss_growth": max(0, _peak() - before)}


def _pack_scan(n: int, shards: int, seed: int = 1, total: int | None = None):
    """The :class:`~fastload.remote.schedule.PackScan` of rank 0 of 1,024's packed pass (8 x
    4,096 tokens, full shuffle, epoch 0) over ``n`` documents of 0-15 tokens
    (:class:`GeneratedLengths`, as :func:`_ragged_dataset`'s) in ``shards`` equal shards, as a
    remote packing Loader makes it (the epoch's token count ``total`` known: it is counted
    once per dataset and node); nothing scanned yet."""
    from fastload import Sampler
    from fastload.remote.schedule import PackScan
    from fastload.sampling.packing import pack_plan, token_total

    lengths = GeneratedLengths(n, 16, 0)
    stream = Sampler(n, batch_size=PACK_ROWS, world_size=WORLD, rank=0, seed=seed).order_stream(0)
    plan = pack_plan(0, 0, stream, lengths, rows=PACK_ROWS, length=PACK_LEN, world_size=WORLD, rank=0,
                     drop_last=False, total=token_total(lengths) if total is None else total)
    return PackScan(plan, np.linspace(0, n, shards + 1).astype(np.int64))


def child_packplan(n: int, shards: int) -> dict:
    """What a remote packing Loader plans on the training thread before its first batch,
    alone (no server): :func:`_pack_scan` scanned up to ``fastload.loader.remote.SYNC_POSITIONS``
    tokens (the rest goes to the background planner): that wait, the documents it reads, the
    rest's time, the peak RSS growth."""
    from fastload.loader.remote import SYNC_POSITIONS
    from fastload.sampling.packing import token_total

    total = token_total(GeneratedLengths(n, 16, 0))
    _pack_scan(10_000, 2, seed=0).step(1 << 16)  # warm-up: the imports and numpy's first calls
    before = _reset_peak()
    t0 = time.perf_counter()
    sc = _pack_scan(n, shards, total=total)
    sc.step(SYNC_POSITIONS)
    sync_s = time.perf_counter() - t0
    horizon = sc.horizon
    t0 = time.perf_counter()
    sc.step()
    return {"n": n, "tokens": total, "pass_end": sc.end, "sync_s": sync_s, "sync_tokens": horizon,
            "rest_s": time.perf_counter() - t0, "rss_growth": max(0, _peak() - before), "sync_positions": SYNC_POSITIONS}


SCAN_SHARDS, SCAN_WINDOW = 10_000, 8  # the background plan scan's cost is measured over this many shards


def child_scancost(n: int) -> dict:
    """The background plan scan's CPU cost (``time.process_time``, this process alone) per
    position of a whole pass of rank 0 of 1,024 over ``n`` samples in :data:`SCAN_SHARDS`
    equal shards: a :class:`~fastload.remote.schedule.PassScan` of the full shuffle and of
    ``shuffle_mode="window"`` (window :data:`SCAN_WINDOW`); a
    :class:`~fastload.remote.schedule.PackScan` of a packed pass (8 x 4,096 tokens) over ``n``
    documents of 0-15 tokens (per token position, and per document)."""
    from fastload import Sampler
    from fastload.remote.schedule import sampler_scan

    starts = np.linspace(0, n, SCAN_SHARDS + 1).astype(np.int64)
    sizes = np.diff(starts)
    sampler_scan(Sampler(10_000, batch_size=4, seed=0), np.array([0, 5000, 10_000])).step()  # warm-up
    out: dict = {"n": n, "shards": SCAN_SHARDS, "window": SCAN_WINDOW}
    for name, kw in (("full", {}), ("window", dict(shuffle_mode="window", shard_sizes=sizes, window=SCAN_WINDOW))):
        sc = sampler_scan(Sampler(n, batch_size=BATCH, world_size=WORLD, rank=0, seed=1, **kw), starts)
        c0 = time.process_time()
        sc.step()
        out[f"{name}_ns"] = (time.process_time() - c0) / max(1, sc.end - sc.start) * 1e9
    ps = _pack_scan(n, SCAN_SHARDS)
    c0 = time.process_time()
    ps.step()
    cpu = time.process_time() - c0
    out["pack_ns_token"] = cpu / max(1, ps.end - ps.start) * 1e9
    out["pack_ns_doc"] = cpu / n * 1e9
    return out


def child_remote(rows: int, shards: int, folder: str) -> dict:
    """A remote Loader (``http://``, the test suite's range-capable server, on this machine)
    over ``rows`` one-byte rows in ``shards`` shards: its construction (the cache's plan,
    downloads start) and the first batch of rank 0 of 1,024; peak RSS growth."""
    import fastload

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the test servers live there
    from _servers import HttpFileServer

    root = Path(folder) / "served"
    name = f"bytes-{rows}-{shards}"
    t_write = write_bytes(root / name, rows, shards)
    write_bytes(root / "warm", 1000, 2)
    with HttpFileServer(root) as srv:
        with fastload.Loader(f"{srv.url}/warm", batch_size=4, device="cpu", cache_dir=Path(folder) / "c0") as lo:
            next(iter(lo))  # the imports and the first calls
        before, anon = _reset_peak(), _anon()
        t0 = time.perf_counter()
        with fastload.Loader(f"{srv.url}/{name}", batch_size=BATCH, world_size=WORLD, rank=0, device="cpu", seed=1,
                             cache_dir=Path(folder) / "c") as lo:
            open_s = time.perf_counter() - t0
            batch = next(iter(lo))
            first_s = time.perf_counter() - t0
            growth, anon = max(0, _peak() - before), _anon() - anon
            assert np.array_equal(batch["x"].numpy(), (batch["index"].numpy() % 251).astype(np.uint8))
    return {"rows": rows, "shards": shards, "open_s": open_s, "first_s": first_s, "rss_growth": growth,
            "anon_growth": anon, "write_s": t_write}


MORE_BATCHES = 50  # read after the first one over the dataset of many shards


def _maps(folder: Path) -> int:
    """Memory mappings of this process onto files of ``folder`` (/proc/self/maps)."""
    prefix = str(folder.resolve()) + "/"
    with open("/proc/self/maps") as fh:
        return sum(1 for line in fh if prefix in line)


_FORK = []  # --smoke: children forked from this process (its imports done once), not fresh interpreters


def _run_child(*args: str, timeout: float = 600, env: dict | None = None) -> dict:
    if _FORK:
        return _fork_child(args, env)
    p = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=timeout,
                       env=None if env is None else {**os.environ, **env})
    if p.returncode != 0:
        raise SystemExit(f"bench_scale child {args} failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _fork_child(args: tuple[str, ...], env: dict | None) -> dict:
    """A child measured in a fork of this process (``--smoke`` only: it checks every row still
    runs, in a fraction of the time; a fork's memory figures count the parent's pages it
    touches, so smoke figures are never published)."""
    import traceback

    sys.stdout.flush()
    sys.stderr.flush()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: run the row, its JSON line to the pipe, exit without the parent's cleanup
        code = 1
        try:
            os.close(r)
            os.environ.update(env or {})
            with os.fdopen(w, "w") as out:
                sys.stdout = out
                main(list(args))  # ("--child", kind, ...)
                out.flush()
            code = 0
        except BaseException:  # noqa: BLE001 - reported through the exit status and stderr
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        text = f.read()
    status = os.waitpid(pid, 0)[1]
    if status != 0:
        raise SystemExit(f"bench_scale child {args} failed (wait status {status}):\n{text[-2000:]}")
    return json.loads(text.strip().splitlines()[-1])


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1e6,1e8,1e10", help="stream positions N, comma-separated")
    ap.add_argument("--mix-sizes", default="1e6,1e8,1e10", help="positions of the mixture epochs, comma-separated")
    ap.add_argument("--pack-sizes", default="1e6,1e8", help="documents of the packed passes, comma-separated")
    ap.add_argument("--table-sizes", default="1e6,1e8",
                    help="samples of the weighted / class-balanced tables kept per node, comma-separated")
    ap.add_argument("--ragged-docs", default="1e7", help="documents of the ragged Loader's datasets, comma-separated "
                    "(--full: 1e8)")
    ap.add_argument("--seconds", type=float, default=1.0, help="how long to read batches for the rate")
    ap.add_argument("--baseline-max", type=float, default=1e8, help="largest N the randperm baseline materialises")
    ap.add_argument("--rows", type=int, default=10_000_000, help="one-byte rows of the Loader's dataset")
    ap.add_argument("--shards", type=int, default=100)
    ap.add_argument("--full", action="store_true", help="the Loader part at 10^8 rows in 1,000 shards")
    ap.add_argument("--manifest-shards", type=int, default=100_000,
                    help="shards of the dataset whose open time is measured (hard links: seconds to make)")
    ap.add_argument("--plan-sizes", default="1e6,1e8", help="positions of the remote cache's plans, comma-separated")
    ap.add_argument("--remote-rows", default="1e6,1e7",
                    help="one-byte rows of the remote Loader's datasets (served over http on this machine)")
    ap.add_argument("--remote-shards", type=int, default=100)
    ap.add_argument("--scan-positions", default="1e7", help="positions (documents) of the passes whose background "
                    f"plan scan's CPU cost is measured ({SCAN_SHARDS:,} shards), comma-separated")
    ap.add_argument("--folder", default=None, help="where the generated dataset goes (kept; default: a temp dir)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        kind, *rest = a.child
        if kind == "sampler":
            out = child_sampler(int(float(rest[0])), float(rest[1]))
        elif kind == "baseline":
            out = child_baseline(int(float(rest[0])))
        elif kind == "mixture":
            out = child_mixture(int(float(rest[0])), float(rest[1]))
        elif kind == "pack":
            out = child_pack(int(float(rest[0])), float(rest[1]))
        elif kind == "table":
            out = child_table(rest[0], rest[1], int(float(rest[2])), rest[3], float(rest[4]))
        elif kind == "manifest":
            out = child_manifest(int(rest[0]), rest[1])
        elif kind == "plan":
            out = child_plan(int(float(rest[0])), int(rest[1]))
        elif kind == "packplan":
            out = child_packplan(int(float(rest[0])), int(rest[1]))
        elif kind == "scancost":
            out = child_scancost(int(float(rest[0])))
        elif kind == "remote":
            out = child_remote(int(float(rest[0])), int(rest[1]), rest[2])
        elif kind == "ragged":
            out = child_ragged(int(float(rest[0])), *rest[1:])
        elif kind == "resume":
            out = child_resume(int(float(rest[0])), rest[1])
        else:
            out = child_loader(int(rest[0]), int(rest[1]), rest[2])
        print(json.dumps(out))
        return []
    if a.smoke:
        a.sizes, a.seconds, a.baseline_max, a.rows, a.shards = "1e6,1e10", 0.2, 1e6, 100_000, 10
        a.pack_sizes, a.mix_sizes, a.table_sizes = "1e6", "1e6", "2e6"
        a.plan_sizes, a.remote_rows, a.remote_shards = "1e6", "1e5", 10
        a.manifest_shards, a.ragged_docs, a.scan_positions = 1000, "2e6", "1e6"
        import fastload.loader  # noqa: F401 - imported once, before the children are forked
        _FORK.append(True)
    if a.full:
        a.rows, a.shards, a.ragged_docs = 100_000_000, 1000, "1e8"
    from fastload.bench.report import headline, system_info

    sizes = [int(float(x)) for x in a.sizes.split(",")]
    print(f"Sampler(N, batch_size={BATCH}, world_size={WORLD}, rank=0), each N in a fresh process; {system_info()}")
    print(f"{'N':>16} {'first batch':>12} {'peak RSS +':>11} {'resume':>9} {'batches/s':>10} {'samples/s':>12} "
          f"{'/ CPU s':>12}   | randperm: {'first batch':>11} {'peak RSS +':>11}")
    rows = []
    for n in sizes:
        r = _run_child("--child", "sampler", str(n), str(a.seconds))
        b = _run_child("--child", "baseline", str(n)) if n <= a.baseline_max else None
        rows.append((r, b))
        materialised = (f"{b['first_s'] * 1e3:>9.1f} ms {b['rss_growth'] / 2**20:>8.1f} MB" if b else
              f"{'not run (' + format(n * 8 / 2**30, '.1f') + ' GiB)':>24}")
        print(f"{n:>16,} {r['first_s'] * 1e3:>9.2f} ms {r['rss_growth'] / 2**20:>8.1f} MB "
              f"{r['resume_s'] * 1e3:>6.2f} ms {r['batches_per_s']:>10,.0f} {r['samples_per_s']:>12,.0f} "
              f"{r['cpu_samples_per_s']:>12,.0f}   | {materialised}")
    print(f"Mixture epochs of N positions (3 datasets, weights 0.5/0.3/0.2, per='batch'; rank 0 of {WORLD}, "
          f"batch {BATCH}), each N in a fresh process")
    print(f"{'N':>16} {'first batch':>12} {'peak RSS +':>11} {'resume':>9} {'samples/s':>12} {'/ CPU s':>12}")
    for n in [int(float(x)) for x in a.mix_sizes.split(",") if x]:
        mx = _run_child("--child", "mixture", str(n), str(a.seconds))
        print(f"{n:>16,} {mx['first_s'] * 1e3:>9.2f} ms {mx['rss_growth'] / 2**20:>8.1f} MB "
              f"{mx['resume_s'] * 1e3:>6.2f} ms {mx['samples_per_s']:>12,.0f} {mx['cpu_samples_per_s']:>12,.0f}")
    print(f"Packed pass (pack_to={PACK_LEN}, {PACK_ROWS} rows, rank 0 of {WORLD}) over N documents of 1-2048 "
          f"tokens, each N in a fresh process")
    print(f"{'N':>16} {'token count':>12} {'first batch':>12} {'peak RSS +':>11} {'resume (docs before)':>26} "
          f"{'batches/s':>10} {'documents/s':>12}")
    for n in [int(float(x)) for x in a.pack_sizes.split(",") if x]:
        pk = _run_child("--child", "pack", str(n), str(a.seconds))
        print(f"{n:>16,} {pk['total_s']:>10.2f} s {pk['first_s'] * 1e3:>9.2f} ms {pk['rss_growth'] / 2**20:>8.1f} MB "
              f"{pk['resume_s']:>8.2f} s ({pk['resume_docs']:>13,}) {pk['batches_per_s']:>10,.1f} "
              f"{pk['docs_per_s']:>12,.0f}")
    print(f"Weighted (with replacement) and class-balanced (1,000 classes) sampling over N samples (weights / labels "
          f"memory-mapped from a file; rank 0 of {WORLD}, batch {BATCH}): the table is built once per node by the "
          "first rank (private memory: numpy's peak), then mapped by each later rank (a fresh process each)")
    print(f"{'':>9} {'N':>14} {'build (node)':>13} {'private peak':>13} | rank: {'first batch':>11} "
          f"{'peak RSS +':>11} {'private +':>10} {'resume':>9} {'samples/s':>12} {'/ CPU s':>12}")
    for n in [int(float(x)) for x in a.table_sizes.split(",") if x]:
        with tempfile.TemporaryDirectory(dir=a.folder) as tmp:
            for kind in ("weighted", "balanced"):
                env = {"FASTLOAD_CACHE": str(Path(tmp) / "cache")}
                bd = _run_child("--child", "table", kind, "build", str(n), tmp, str(a.seconds), timeout=3600, env=env)
                rk = _run_child("--child", "table", kind, "rank", str(n), tmp, str(a.seconds), env=env)
                kept = "" if bd["mapped"] else " (in memory: below MAP_MIN)"
                print(f"{kind:>9} {n:>14,} {bd['build_s']:>11.2f} s {bd['private_peak'] / 2**20:>10.1f} MB | "
                      f"{rk['first_s'] * 1e3:>14.2f} ms {rk['rss_growth'] / 2**20:>8.1f} MB "
                      f"{rk['anon_growth'] / 2**20:>7.1f} MB {rk['resume_s'] * 1e3:>6.2f} ms "
                      f"{rk['samples_per_s']:>12,.0f} {rk['cpu_samples_per_s']:>12,.0f}{kept}")
    print(f"A remote cache's plan of a full shuffle (rank 0 of {WORLD}, 1,000 shards): the pass's first-use "
          "schedule and the next epoch's, scanned whole (in the background past the first 2^22 positions), each "
          "N in a fresh process")
    print(f"{'N':>16} {'scan':>10} {'peak RSS +':>11}")
    for n in [int(float(x)) for x in a.plan_sizes.split(",") if x]:
        pl = _run_child("--child", "plan", str(n), "1000", timeout=3600)
        print(f"{n:>16,} {pl['plan_s']:>8.2f} s {pl['rss_growth'] / 2**20:>8.1f} MB")
    print(f"A remote packing Loader's plan before its first batch (pack_to={PACK_LEN}, {PACK_ROWS} rows, rank 0 of "
          f"{WORLD}, full shuffle; N documents of 0-15 tokens in {a.remote_shards} shards; no server): the PackScan the "
          "training thread scans (up to fastload.loader.remote.SYNC_POSITIONS tokens), then the rest (the background "
          "planner's), each N in a fresh process; the pass's positions count tokens, a short epoch's padded to a "
          f"whole step of {WORLD} x {PACK_ROWS} x {PACK_LEN} (its first documents read again)")
    print(f"{'N':>16} {'epoch tokens':>14} {'pass positions':>15} {'sync wait':>10} {'(positions)':>13} {'rest':>9} "
          f"{'peak RSS +':>11}")
    for n in [int(float(x)) for x in a.remote_rows.split(",") if x]:
        pp = _run_child("--child", "packplan", str(n), str(a.remote_shards), timeout=3600)
        print(f"{n:>16,} {pp['tokens']:>14,} {pp['pass_end']:>15,} {pp['sync_s'] * 1e3:>7.1f} ms {pp['sync_tokens']:>13,} "
              f"{pp['rest_s']:>7.2f} s {pp['rss_growth'] / 2**20:>8.1f} MB")
    print(f"The background plan scan's CPU cost per position (time.process_time; a whole pass of rank 0 of {WORLD} over "
          f"N positions in {SCAN_SHARDS:,} shards): PassScan of the full shuffle and of shuffle_mode='window' "
          f"(window={SCAN_WINDOW}); PackScan of a packed pass over N documents of 0-15 tokens, per token and per "
          "document; each N in a fresh process")
    print(f"{'N':>16} {'full':>12} {'window':>12} {'packed/token':>13} {'packed/doc':>12}")
    for n in [int(float(x)) for x in a.scan_positions.split(",") if x]:
        sc = _run_child("--child", "scancost", str(n), timeout=3600)
        print(f"{n:>16,} {sc['full_ns']:>9.1f} ns {sc['window_ns']:>9.1f} ns {sc['pack_ns_token']:>10.1f} ns "
              f"{sc['pack_ns_doc']:>9.1f} ns")
    print(f"A remote Loader (http on this machine, {a.remote_shards} shards of one-byte rows, full shuffle, rank 0 "
          f"of {WORLD}): built, then its first batch (the shards it reads downloaded), each in a fresh process")
    print(f"{'rows':>16} {'built':>10} {'first batch':>12} {'peak RSS +':>11} {'anon RSS +':>11}  (peak RSS counts the "
          "pages of the shards downloaded and hashed)")
    for n in [int(float(x)) for x in a.remote_rows.split(",") if x]:
        with tempfile.TemporaryDirectory(dir=a.folder) as tmp:
            rm = _run_child("--child", "remote", str(n), str(a.remote_shards), tmp, timeout=3600)
        print(f"{n:>16,} {rm['open_s'] * 1e3:>7.0f} ms {rm['first_s'] * 1e3:>9.0f} ms "
              f"{rm['rss_growth'] / 2**20:>8.1f} MB {rm['anon_growth'] / 2**20:>8.1f} MB")
    print(f"Loader over N documents of 0-15 tokens, lengths memory-mapped from the node's cache (rank 0 of {WORLD}; "
          f"padded/packed: batch {BATCH}, max_length 12; pack: {PACK_ROWS} x {PACK_LEN}; pack1: prefetch=1), each in a "
          "fresh process")
    print(f"{'N':>16} {'mode':>7} {'Loader':>6} {'Loader()':>10} {'first batch':>12} {'peak RSS +':>11} "
          f"{'anon peak +':>12}")
    with tempfile.TemporaryDirectory(dir=a.folder) as tmp:
        for n in [int(float(x)) for x in a.ragged_docs.split(",") if x]:
            for mode in ("padded", "packed", "pack", "pack1"):
                for when in ("first", "later"):  # the first Loader of the node summarises the lengths
                    rg = _run_child("--child", "ragged", str(n), mode, a.folder or tmp, when, timeout=3600,
                                    env={"FASTLOAD_CACHE": str(Path(a.folder or tmp) / "cache")})
                    print(f"{rg['n']:>16,} {mode:>7} {when:>6} {rg['loader_s'] * 1e3:>7.1f} ms "
                          f"{rg['first_s'] * 1e3:>9.1f} ms {rg['rss_growth'] / 2**20:>8.1f} MB "
                          f"{rg['anon_growth'] / 2**20:>9.1f} MB")
            rs = _run_child("--child", "resume", str(n), a.folder or tmp, timeout=3600,
                            env={"FASTLOAD_CACHE": str(Path(a.folder or tmp) / "cache")})
            print(f"{rs['n']:>16,} packed pass resumed at 60% of the epoch ({rs['docs_before']:,} documents before): "
                  f"{rs['resume_s']:.2f} s, then {rs['again_s'] * 1e3:.1f} ms from the chunk counts the node kept"
                  + ("" if rs["kept"] else " (NOT kept: no cache directory)"))
    with tempfile.TemporaryDirectory(dir=a.folder) as tmp:
        lo = _run_child("--child", "loader", str(a.rows), str(a.shards), a.folder or tmp, timeout=3600)
    print(f"Loader over {lo['rows']:,} one-byte rows in {lo['shards']:,} shards (rank 0 of {WORLD}): "
          f"open {lo['open_s'] * 1e3:.1f} ms, first batch {lo['first_s'] * 1e3:.1f} ms "
          f"(peak RSS +{lo['rss_growth'] / 2**20:.1f} MB; written in {lo['write_s']:.1f} s)")
    with tempfile.TemporaryDirectory(dir=a.folder) as tmp:
        mf = _run_child("--child", "manifest", str(a.manifest_shards), tmp, timeout=3600)
    first = (f"Loader's first batch {mf['first_s'] * 1e3:.0f} ms, {mf['more']} more in {mf['more_s']:.1f} s "
             f"(shard mappings {' then '.join(map(str, mf['maps']))})" if mf["error"] is None else
             f"the Loader FAILED: {mf['error']}")
    print(f"Dataset of {mf['shards']:,} shards ({mf['manifest_mb']:.1f} MB manifest): "
          f"open {mf['open_s'] * 1e3:.0f} ms, "
          f"{first} (rank 0 of {WORLD}; peak RSS +{mf['rss_growth'] / 2**20:.1f} MB)")
    big, _ = rows[-1]
    base = [(r, b) for r, b in rows if b is not None][-1]
    slowest = min(r["samples_per_s"] for r, _ in rows)
    headline(f"sampler: first batch at N={big['n']:.0e}, rank 0 of {WORLD}, batch {BATCH}", script="bench_scale.py",
             unit="ms", lower_is_better=True, smoke=a.smoke,
             ours=(f"Sampler at N={big['n']:.0e}", big["first_s"] * 1e3),
             baseline=(f"materialised order (torch.randperm, as DistributedSampler) at N={base[1]['n']:.0e}", base[1]["first_s"] * 1e3),
             note=f"peak RSS +{big['rss_growth'] / 2**20:.1f} MB; resume {big['resume_s'] * 1e3:.2f} ms; "
                  f"slowest rate {slowest:,.0f} samples/s; Loader over {lo['rows']:,} rows: open "
                  f"{lo['open_s'] * 1e3:.0f} ms, first batch {lo['first_s'] * 1e3:.0f} ms; {mf['shards']:,} shards: "
                  f"open {mf['open_s'] * 1e3:.0f} ms")
    return rows


if __name__ == "__main__":
    main()

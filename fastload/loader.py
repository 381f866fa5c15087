"""Loader: sampler -> C++ ring (gather) -> DALI (images) -> device -> the training loop.

One iterator per epoch. Raw fields (tensors, scalars) are gathered by the ring's C++
threads straight into a slot; the loader keeps ``prefetch`` batches in flight. Image fields
are decoded by the field's DALI runner in one feeder thread (DALI's own threads do the work,
with the GIL released), written straight into the same ring slot on the CPU, or handed over
as CUDA tensors on the GPU. Batches arrive in sampler order.

Resume: the loader remembers the sampler's state after every batch it has *handed to the
user* (not after the ones merely prefetched), so ``state_dict()`` taken between steps
continues at exactly the next step.
"""
from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import queue
import threading
import time
import types
import weakref
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from .pipeline.presets import Transform
from .ring import Ring
from .sampling import Sampler
from .store import Dataset
from .store.format import INDEX_KEY
from .world import World

logger = logging.getLogger("fastload")

LOADER_STATE_VERSION = 1
ON_ERROR = ("raise", "skip")


class DecodeError(RuntimeError):
    """An image could not be decoded (or was refused); names shard, row and source key."""


PREFETCH_BUDGET = 256 << 20  # host memory the default prefetch may use for batches in flight


def _default_prefetch(threads: int, batch_bytes: int) -> int:
    """Batches in flight: enough to keep every gather thread busy with one to spare, more
    when batches are small (MNIST: 8 in flight reach ~80% of memcpy instead of ~55% with 3,
    bench/bench_tensor.py), capped so the slots stay within PREFETCH_BUDGET."""
    fit = PREFETCH_BUDGET // max(1, batch_bytes)
    return int(max(2, min(8, max(threads + 1, fit))))


def _default_cuda_index() -> int:
    """The current CUDA device; under torchrun, when the script has not picked one
    (current device still 0), this process's GPU: LOCAL_RANK modulo the visible devices —
    otherwise every rank of a node would decode on cuda:0."""
    cur = torch.cuda.current_device()
    local = os.environ.get("LOCAL_RANK")
    if cur == 0 and local is not None and local.strip().isdigit():
        return int(local) % max(1, torch.cuda.device_count())
    return cur


def _ring_counters(ring: Ring) -> tuple[int, float]:
    """The ring's cumulative (gather nanoseconds, device-copy seconds)."""
    return ring.stats()["gather_ns"], ring.copy_s


def _resolve_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda", _default_cuda_index()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (TypeError, RuntimeError) as e:
        raise ValueError(f"device={device!r} is not a torch device ({e})") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: fastload delivers to 'cpu' or 'cuda'")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but CUDA is not available here; use device='cpu' (or None)")
        if dev.index is None:
            dev = torch.device("cuda", _default_cuda_index())
    return dev


def dataset_fingerprint(ds: Dataset) -> str:
    """A short hash of what defines the data: sample counts, fields and shard checksums."""
    m = ds.manifest
    desc = json.dumps({"n": m["num_samples"], "fields": m["fields"],
                       "shards": [(s["num_samples"], s.get("checksum")) for s in m["shards"]]}, sort_keys=True)
    return hashlib.sha256(desc.encode()).hexdigest()[:16]


class _Resources:
    """What a Loader must release: the ring (C++ threads), DALI runners, the live iterator."""

    def __init__(self):
        self.ring: Ring | None = None
        self.runners: dict[str, Any] = {}
        self.iter_ref: weakref.ref | None = None

    def close(self) -> None:
        it = self.iter_ref() if self.iter_ref is not None else None
        self.iter_ref = None
        if it is not None:
            it.close()
        runners, self.runners = self.runners, {}
        for r in runners.values():
            try:
                r.close()
            except Exception:  # pragma: no cover - best effort at interpreter exit
                pass
        ring, self.ring = self.ring, None
        if ring is not None:
            ring.close()


class _Stats:
    """Counters behind Loader.stats(); updated by the consumer and the feeder thread."""

    def __init__(self):
        self.lock = threading.Lock()
        self.reset()

    def reset(self):
        self.t_start: float | None = None
        self.t_last: float | None = None
        self.t_end: float | None = None  # when the epoch's iteration ended (wall time stops)
        self.batches = 0
        self.samples = 0
        self.bytes = 0
        self.wait_s = 0.0
        self.first_batch_s: float | None = None
        self.decode_s = 0.0
        self.copy_s = 0.0
        self.ring_gather_ns0 = 0  # the ring's cumulative counters when this epoch began
        self.ring_copy_s0 = 0.0
        self.ring_final: tuple[int, float] | None = None  # the ring's counters when it was closed
        self.replaced = 0
        self.epochs = 0


class Loader:
    """Batches of a fastload dataset for a training loop.

    Args:
        dataset: a :class:`fastload.Dataset` or the path of one.
        batch_size: samples per batch on this rank.
        shuffle, seed, drop_last: as ``DistributedSampler`` (the order is a pure function
            of seed, epoch and world size; see :class:`fastload.Sampler`).
        device: ``"cuda"``/``"cpu"``/``None`` (CUDA when available).
        rank, world_size: default from ``torch.distributed`` when initialised, else the
            ``RANK``/``WORLD_SIZE`` environment variables, else a single process.
        fields: fields to deliver (default: every tensor, scalar and image field; string and
            bytes fields are delivered as lists when named here).
        transforms: ``{image_field: fastload.vision.train(224) | eval(...) | custom(...)}``.
        threads: gather threads (default: the usable cores minus one, at most 7);
            prefetch: batches in flight (default: up to 8, fewer for big batches to aim at 256 MB of slots).
        weights, replacement, num_draws, balance: weighted / class-balanced sampling
            (``weights`` may name a field of the dataset; ``balance=True`` balances the label
            field); shuffle_mode / window: locality-preserving shuffle (see Sampler).
        on_error: for undecodable images: "raise" (an error naming shard, row and key) or
            "skip" (replaced deterministically by the next decodable sample, counted in stats).
        log_every: log ``stats()`` every this many batches (``logging`` at INFO).

    Every batch is a dict of tensors (plus ``batch["index"]``, the global sample indices);
    ``len(loader)`` is the number of batches per epoch on this rank.
    """

    def __init__(self, dataset: Dataset | str | os.PathLike, *, batch_size: int, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False, device=None, rank: int | None = None,
                 world_size: int | None = None, fields: Sequence[str] | None = None,
                 transforms: Mapping[str, Any] | None = None, threads: int | None = None,
                 prefetch: int | None = None, weights: Any = None, replacement: bool = True,
                 num_draws: int | None = None, balance: bool | str = False, shuffle_mode: str = "full",
                 window: int | None = None, on_error: str = "raise", log_every: int | None = None):
        self.dataset = dataset if isinstance(dataset, Dataset) else Dataset(dataset)
        ds = self.dataset
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size <= 0:
            raise ValueError(f"batch_size={batch_size!r} must be an int > 0")
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error={on_error!r} must be one of {ON_ERROR}")
        if log_every is not None and (not isinstance(log_every, int) or log_every <= 0):
            raise ValueError(f"log_every={log_every!r} must be a positive int or None")
        self.batch_size = int(batch_size)
        self.world = World.detect(rank, world_size)
        self.device = _resolve_device(device)
        self.on_error = on_error
        self.log_every = log_every
        self.seed = int(seed)

        if transforms is not None and not isinstance(transforms, Mapping):
            raise ValueError(f"transforms={transforms!r} must be a dict {{image field: transform}}, "
                             "e.g. transforms={'image': fastload.vision.train(224)}")
        transforms = dict(transforms or {})
        if fields is None:
            fields = [n for n, f in ds.fields.items() if f.kind in ("tensor", "scalar", "image")]
            if INDEX_KEY in fields:  # only in datasets written before the name was reserved
                fields.remove(INDEX_KEY)
                logger.warning("fastload: %s has a field named 'index'; it is not delivered, because "
                               "batch['index'] holds the global sample indices", ds.path)
        elif isinstance(fields, (str, bytes)):
            raise ValueError(f"fields={fields!r} must be a list of field names, e.g. fields=[{fields!r}]")
        fields = list(fields)
        for n in fields:
            if n not in ds.fields:
                raise ValueError(f"fields: {n!r} is not a field of {ds.path}; fields are {list(ds.fields)}")
            if n == INDEX_KEY:
                raise ValueError(f"field {n!r} of {ds.path} would be shadowed by batch['index'] (the global "
                                 "sample indices); leave it out with fields=[...]")
        for n, t in transforms.items():
            if n not in ds.fields or ds.fields[n].kind != "image":
                raise ValueError(f"transforms: {n!r} is not an image field of {ds.path}")
            if not isinstance(t, Transform):
                hint = " (call it: vision.train(224))" if callable(t) and getattr(t, "__module__", "").startswith(
                    "fastload") else ""
                raise ValueError(f"transforms[{n!r}]={t!r} is not a fastload transform{hint}; use "
                                 "fastload.vision.train(...), .eval(...) or .custom(...) (a DALI graph)")
        missing = [n for n in fields if ds.fields[n].kind == "image" and n not in transforms]
        if missing:
            raise ValueError(
                f"image field {missing[0]!r} has no transform; pass transforms={{{missing[0]!r}: "
                "fastload.vision.train(224)} (or fastload.vision.eval(224, resize=256), or "
                "fastload.vision.custom(...)), or leave the field out with fields=[...]")
        if not fields:
            raise ValueError(f"no field to deliver; {ds.path} has fields {list(ds.fields)}")
        self.fields = fields
        self.raw_fields = [n for n in fields if ds.fields[n].fixed]
        self.image_fields = [n for n in fields if ds.fields[n].kind == "image"]
        self.list_fields = [n for n in fields if ds.fields[n].kind in ("string", "bytes")]
        self.transforms = {n: transforms[n] for n in self.image_fields}

        # Sampling.
        if isinstance(weights, str):
            wf = ds.fields.get(weights)
            if wf is None or wf.kind != "scalar":
                raise ValueError(f"weights={weights!r} must name a scalar field of {ds.path}")
            weights = ds.get_batch(np.arange(len(ds)), fields=[weights])[weights].astype(np.float64)
        labels = None
        if balance:
            lf = balance if isinstance(balance, str) else ds.label_field
            if lf is None or lf not in ds.fields or ds.fields[lf].kind != "scalar":
                raise ValueError(f"balance={balance!r} needs a label field; {ds.path} has "
                                 f"{'no label field' if ds.label_field is None else 'label ' + repr(ds.label_field)}")
            labels = ds.get_batch(np.arange(len(ds)), fields=[lf])[lf]
        self.sampler = Sampler(len(ds), batch_size=self.batch_size, world_size=self.world.world_size,
                               rank=self.world.rank, shuffle=shuffle, seed=self.seed, drop_last=drop_last,
                               weights=weights, replacement=replacement, num_draws=num_draws,
                               balance_labels=labels, shuffle_mode=shuffle_mode,
                               shard_sizes=ds.shard_sizes if shuffle_mode != "full" else None, window=window)

        from .ring import default_threads
        # Gather threads: one core is left to the training loop's own Python thread. On 2
        # cores, 1 gather thread beat 2 on both MNIST rows (54% vs 47% of memcpy) and
        # 3x224x224 rows (106% vs 101%), interleaved A/B in one process.
        self.threads = max(1, default_threads() - 1) if threads is None else int(threads)
        if self.threads < 1:
            raise ValueError(f"threads={threads!r} must be >= 1")
        batch_bytes = self.batch_size * sum(
            ds.fields[n].np_dtype.itemsize * int(np.prod(ds.fields[n].shape)) for n in self.raw_fields)
        batch_bytes += self.batch_size * sum(
            np.dtype(_np_dtype(t.out_dtype)).itemsize * int(np.prod(t.out_shape)) for t in self.transforms.values())
        self.prefetch = _default_prefetch(self.threads, batch_bytes) if prefetch is None else int(prefetch)
        if self.prefetch < 1:
            raise ValueError(f"prefetch={prefetch!r} must be >= 1")

        # Threads, the ring and DALI pipelines live in _Resources, which holds no reference
        # to the Loader: the finalizer can then run when the Loader is garbage collected.
        self._res = _Resources()
        self._position: int | None = None  # sampler's consumed count after the last delivered batch
        self._stats = _Stats()
        self._closed = False
        self._finalizer = weakref.finalize(self, self._res.close)

    # -- public ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.sampler)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's order (call before iterating, like DistributedSampler). After
        ``load_state_dict``, setting the loaded epoch keeps the loaded mid-epoch position."""
        self._stop_iter()
        if epoch != self.sampler.epoch:
            self._position = None
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self._closed:
            raise RuntimeError("this Loader is closed")
        self._stop_iter()
        self._position = None
        it = _EpochIterator(self)  # the sampler resumes a loaded position, else starts the epoch
        self._iter = it
        return it

    def state_dict(self) -> dict:
        """Plain JSON-able state: where the next batch starts, plus what must match on load."""
        pos = self.sampler.state_dict(consumed=self._position)
        return {
            "version": LOADER_STATE_VERSION,
            "dataset": {"num_samples": len(self.dataset), "fingerprint": dataset_fingerprint(self.dataset)},
            "batch_size": self.batch_size,
            "fields": list(self.fields),
            "transforms": {n: _describe(t) for n, t in self.transforms.items()},
            "seed": self.seed,
            "sampler": pos,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (same or different world size). Refuses a state taken on
        another dataset or with other settings, naming what differs."""
        if not isinstance(state, Mapping) or "sampler" not in state:
            raise ValueError("not a fastload Loader state (no 'sampler' key)")
        if state.get("version") != LOADER_STATE_VERSION:
            raise ValueError(f"Loader state version {state.get('version')!r} is not {LOADER_STATE_VERSION}")
        mine = self.state_dict()
        for key, what in (("dataset", "dataset"), ("seed", "seed"), ("fields", "fields"),
                          ("transforms", "transforms")):
            if state.get(key) != mine[key]:
                raise ValueError(f"Loader state mismatch in {what}: saved {state.get(key)!r}, "
                                 f"this loader has {mine[key]!r}")
        self._stop_iter()
        self.sampler.load_state_dict(state["sampler"])  # validates seed, size, version
        self._position = None

    def stats(self) -> dict:
        """Throughput and where the time went, since the current epoch's iteration began.

        wait_fraction = time the training loop spent blocked in ``next()`` / wall time: near 0
        means data loading keeps up; near 1 means the loop is starved."""
        s = self._stats
        ring = self._ring if self._ring is not None and not self._ring.closed else None
        ring_stats = ring.stats() if ring is not None else None
        with s.lock:
            if ring_stats is not None:
                gather_ns, ring_copy_s = ring_stats["gather_ns"], ring.copy_s
            else:  # closed (its last counters), or no ring at all (no change)
                gather_ns, ring_copy_s = s.ring_final or (s.ring_gather_ns0, s.ring_copy_s0)
            gather_s = (gather_ns - s.ring_gather_ns0) / 1e9
            copy_s = s.copy_s + (ring_copy_s - s.ring_copy_s0)
            now = s.t_end if s.t_end is not None else time.perf_counter()
            wall = (now - s.t_start) if s.t_start is not None else 0.0
            out = {
                "batches": s.batches, "samples": s.samples, "bytes": s.bytes,
                "wall_s": wall, "wait_s": s.wait_s,
                "wait_fraction": (s.wait_s / wall) if wall > 0 else 0.0,
                "batches_per_s": s.batches / wall if wall > 0 else 0.0,
                "samples_per_s": s.samples / wall if wall > 0 else 0.0,
                "mb_per_s": s.bytes / wall / 1e6 if wall > 0 else 0.0,
                "first_batch_s": s.first_batch_s,
                "stages": {"gather_s": gather_s, "decode_s": s.decode_s, "copy_s": copy_s},
                "replaced_samples": s.replaced,
                "epoch": self.sampler.epoch,
            }
        if ring_stats is not None:
            out["ring"] = ring_stats
        return out

    def close(self) -> None:
        """Stop and join every thread, release the ring and DALI pipelines. Idempotent."""
        self._closed = True
        self._stop_iter()
        ring = self._ring
        if ring is not None and not ring.closed:  # stats() stays complete after close()
            self._stats.ring_final = _ring_counters(ring)
        self._finalizer()

    def __enter__(self) -> "Loader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self._stop_iter()
        except Exception:
            pass

    # -- internals -------------------------------------------------------------------------
    @property
    def _ring(self) -> Ring | None:
        return self._res.ring

    @property
    def _runners(self) -> dict[str, Any]:
        return self._res.runners

    @property
    def _iter(self) -> _EpochIterator | None:
        return self._res.iter_ref() if self._res.iter_ref is not None else None

    @_iter.setter
    def _iter(self, it: _EpochIterator | None) -> None:
        # weak: an iterator keeps its loader alive, never the other way round
        self._res.iter_ref = weakref.ref(it) if it is not None else None

    def _stop_iter(self) -> None:
        it, self._iter = self._iter, None
        if it is not None:
            it.close()

    def _get_ring(self) -> Ring:
        if self._ring is None:
            ds = self.dataset
            specs: dict[str, Any] = {}
            sources: dict[str, list] = {}
            for n in self.raw_fields:
                f = ds.fields[n]
                specs[n] = (f.np_dtype, f.shape)
                sources[n] = [ds.column(s, n) for s in range(ds.num_shards)]
            if self.device.type == "cpu":
                for n in self.image_fields:
                    t = self.transforms[n]
                    specs[n] = (np.dtype(_np_dtype(t.out_dtype)), tuple(t.out_shape))
            slots = max(self.prefetch + 2, 3)
            self._res.ring = Ring(specs, self.batch_size, sources, threads=self.threads, slots=slots,
                              device=self.device)
        return self._ring

    def _runner(self, name: str, worker: int = 0):
        r = self._runners.get((name, worker))
        if r is None:
            r = self.transforms[name].runner(device=self.device.type, batch_size=self.batch_size,
                                             num_threads=None, prefetch=None, seed=self.seed,
                                             device_id=self.device.index if self.device.type == "cuda" else None)
            self._runners[(name, worker)] = r
        return r


def _np_dtype(dt) -> np.dtype:
    if isinstance(dt, torch.dtype):
        return torch.empty((), dtype=dt).numpy().dtype
    return np.dtype(dt)


def _describe(t) -> Any:
    d = getattr(t, "describe", None)
    return d() if callable(d) else repr(t)


class _EpochIterator:
    """One pass over the sampler's remaining batches of the current epoch."""

    def __init__(self, loader: Loader):
        self.loader = loader
        self.ring = loader._get_ring() if (loader.raw_fields or (loader.image_fields and loader.device.type == "cpu")) else None
        self.sampler_iter = iter(loader.sampler)
        loader._position = loader.sampler.consumed  # where this pass starts
        self.pending: collections.deque = collections.deque()  # (indices, sampler's consumed count after)
        self.done_sampling = False
        self.closed = False
        self.feeder: _Feeder | None = None
        self._nbytes: dict[int, int] = {}  # batch bytes by row count
        st = loader._stats
        with st.lock:
            st.reset()
            if self.ring is not None:
                st.ring_gather_ns0, st.ring_copy_s0 = _ring_counters(self.ring)
            st.t_start = time.perf_counter()
        if loader.image_fields:
            self.feeder = _Feeder(loader, self.ring)
        self._fill()

    def _next_indices(self):
        if self.done_sampling:
            return None
        try:
            idx = next(self.sampler_iter)
        except StopIteration:
            self.done_sampling = True
            return None
        return idx, self.loader.sampler.consumed

    def _fill(self) -> None:
        prefetch = self.loader.prefetch
        if self.feeder is None and self.ring is not None:
            # Raw fields only: refill in runs of about prefetch/2 batches, located and
            # submitted with one call each, so the per-batch Python cost is amortised.
            if len(self.pending) > prefetch // 2:
                return
            run = []
            while len(self.pending) + len(run) < prefetch:
                nxt = self._next_indices()
                if nxt is None:
                    break
                run.append(nxt)
            if not run:
                return
            idx_all = np.concatenate([i for i, _ in run]) if len(run) > 1 else run[0][0]
            shard, row = self.loader.dataset.locate(idx_all, check=False)
            sizes = {len(i) for i, _ in run[:-1]}
            if len(sizes) <= 1 and (not sizes or len(run[-1][0]) <= sizes.pop()):
                self.ring.submit_many(shard, row, len(run[0][0]))  # equal batches, the last maybe shorter
            else:  # pragma: no cover - the sampler only shortens the last batch
                start = 0
                for i, _ in run:
                    self.ring.submit(shard[start:start + len(i)], row[start:start + len(i)])
                    start += len(i)
            self.pending.extend(run)
            return
        while len(self.pending) < prefetch:
            nxt = self._next_indices()
            if nxt is None:
                return
            if self.feeder is not None:
                self.feeder.put(nxt[0])
            self.pending.append(nxt)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, Any]:
        if self.closed or not self.pending:
            finished = not self.closed
            self.close()
            if finished:
                # the sampler marks the epoch complete (a dropped tail included) at its end
                self.loader._position = self.loader.sampler.consumed
                if self.loader._iter is self:
                    self.loader._iter = None
            raise StopIteration
        loader = self.loader
        st = loader._stats
        t0 = time.perf_counter()
        idx, state = self.pending.popleft()
        try:
            if self.feeder is not None:
                batch = self.feeder.get()
            else:
                batch = self.ring.get() if self.ring is not None else {}
        except BaseException:
            self.close()
            raise
        t1 = time.perf_counter()
        ev = batch.pop("__event__", None)
        if ev is not None:  # CUDA images: the training stream waits for DALI's work
            cur = torch.cuda.current_stream(loader.device)
            cur.wait_event(ev)
            for v in batch.values():
                if isinstance(v, torch.Tensor) and v.is_cuda:
                    v.record_stream(cur)
        if "__index__" in batch:
            idx_t = batch.pop("__index__")
        else:
            idx_t = torch.from_numpy(idx)
            if loader.device.type == "cuda":
                idx_t = idx_t.to(loader.device, non_blocking=False)
        batch["index"] = idx_t
        if loader.list_fields:
            batch.update(loader.dataset.get_batch(idx_t.cpu().numpy(), fields=loader.list_fields))
        loader._position = state
        nbytes = self._nbytes.get(len(idx)) if not loader.list_fields else None
        if nbytes is None:  # fixed per row count unless variable-length fields are delivered
            nbytes = sum(int(v.element_size() * v.nelement()) for v in batch.values() if isinstance(v, torch.Tensor))
            if not loader.list_fields:
                self._nbytes[len(idx)] = nbytes
        with st.lock:
            st.wait_s += t1 - t0
            st.batches += 1
            st.samples += len(idx)
            st.bytes += nbytes
            st.t_last = t1
            if st.first_batch_s is None:
                st.first_batch_s = t1 - st.t_start
        self._fill()
        if loader.log_every and st.batches % loader.log_every == 0:
            s = loader.stats()
            logger.info("fastload: %d batches, %.0f samples/s, waiting %.1f%% of the time",
                        s["batches"], s["samples_per_s"], 100 * s["wait_fraction"])
        return batch

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        st = self.loader._stats
        with st.lock:
            if st.t_end is None:
                st.t_end = time.perf_counter()  # stats() of a finished epoch stay put
        if self.feeder is not None:
            self.feeder.close()
            self.feeder = None
        # Drain what is still in flight so the ring's slots are free for the next epoch.
        ring = self.ring
        if ring is not None and not ring.closed:
            while ring.pending > 0:
                try:
                    ring.get_arrays()
                except (RuntimeError, IndexError, ValueError):
                    pass
        self.pending.clear()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class _Feeder:
    """Threads that turn index batches into image batches, in order.

    CPU: two workers, each with its own DALI pipelines, take batches in turn: under a lock a
    worker takes the next indices and acquires the next ring slot (so slots are acquired in
    sampler order), then gathers the raw fields into it, lets DALI write each image field into
    it and commits. While one worker's Python glue runs (views, crop parameters, the copy into
    the slot), the other's DALI threads keep the cores busy (bench/bench_jpeg.py: +~10%).
    CUDA: one worker; raw fields go through the ring (device copy on a side stream), images
    come back from DALI as CUDA tensors, handed over with an event.
    """

    CPU_WORKERS = 2

    def __init__(self, loader: Loader, ring: Ring | None):
        # The thread must not keep the Loader alive: copy what it needs.
        self.loader = types.SimpleNamespace(
            dataset=loader.dataset, image_fields=list(loader.image_fields), raw_fields=list(loader.raw_fields),
            on_error=loader.on_error, _stats=loader._stats, device=loader.device, epoch=loader.sampler.epoch)
        self.ring = ring
        self.cuda = loader.device.type == "cuda"
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()  # CUDA: finished batches (or errors), in order
        self.acquired: queue.Queue = queue.Queue()  # CPU: None per slot acquired, or the error
        self.errors: dict[int, BaseException] = {}
        self.replaced: dict[int, np.ndarray] = {}  # seq -> indices actually delivered (on_error="skip")
        self.stop = threading.Event()
        self.seq = 0  # consumer side: the next batch to hand out
        self.take_lock = threading.Lock()
        self.next_seq = 0  # worker side: the next batch to take
        nworkers = 1 if (self.cuda or ring is None) else self.CPU_WORKERS
        self.runners = [{n: loader._runner(n, k) for n in loader.image_fields} for k in range(nworkers)]
        self.threads = [threading.Thread(target=self._run, args=(k,), name=f"fastload-feeder-{k}", daemon=True)
                        for k in range(nworkers)]
        for t in self.threads:
            t.start()

    def put(self, idx: np.ndarray) -> None:
        self.inbox.put(idx)

    def get(self) -> dict[str, Any]:
        if self.cuda or self.ring is None:
            item = self._wait(self.outbox)
            if isinstance(item, BaseException):
                raise item
            return item
        seq_before = self.seq
        self.seq += 1
        # The feeder acquires this batch's slot (or fails before it could): wait for that,
        # so that ring.get() below has a pending batch to wait for.
        item = self._wait(self.acquired)
        if isinstance(item, BaseException):
            raise item
        try:
            batch = self.ring.get()
        except RuntimeError:
            err = self.errors.pop(seq_before, None)
            if err is not None:
                raise err from None
            raise
        final = self.replaced.pop(seq_before, None)
        if final is not None:
            batch["__index__"] = torch.from_numpy(final)
        return batch

    def _wait(self, q: queue.Queue):
        while True:
            try:
                return q.get(timeout=0.1)
            except queue.Empty:
                if not any(t.is_alive() for t in self.threads):
                    raise RuntimeError("fastload feeder thread stopped unexpectedly") from None

    # -- the thread --------------------------------------------------------------------------
    def _take(self):
        """(seq, indices, slot or None) of the next batch, in order; None when stopping."""
        with self.take_lock:
            while True:
                if self.stop.is_set():
                    return None
                try:
                    idx = self.inbox.get(timeout=0.1)
                except queue.Empty:
                    continue
                if idx is None:
                    self.inbox.put(None)  # let the other workers see it too
                    return None
                seq = self.next_seq
                self.next_seq += 1
                if self.cuda or self.ring is None:
                    return seq, idx, None
                try:
                    slot = self.ring.acquire()
                except BaseException as e:  # the ring is closing: no slot for this batch
                    self.acquired.put(e)
                    return None
                self.acquired.put(None)
                return seq, idx, slot

    def _run(self, worker: int) -> None:
        runners = self.runners[worker]
        while True:
            job = self._take()
            if job is None:
                return
            seq, idx, slot = job
            if slot is not None:
                self._fill(slot, idx, seq, runners)
                continue
            try:
                self._one_cuda(idx, runners)
            except BaseException as e:  # handed to the consumer in order
                if self.stop.is_set():
                    return
                self.outbox.put(e)

    def _decode(self, name: str, idx: np.ndarray, out, runners: dict) -> tuple[Any, np.ndarray]:
        """Run the DALI runner; on bad samples raise DecodeError or replace them."""
        loader = self.loader
        ds = loader.dataset
        runner = runners[name]
        epoch = loader.epoch
        from .pipeline import BadSamples

        idx = idx.copy()
        for _attempt in range(64):
            enc = ds.views(name, idx)
            w, h = ds.image_sizes(name, idx)
            t0 = time.perf_counter()
            c0 = runner.copy_s
            try:
                res = runner.run(enc, w, h, idx, epoch, out=out)
            except BadSamples as e:
                if loader.on_error == "raise":
                    lines = [f"{ds.describe(int(idx[p]))}: {r}" for p, r in zip(e.positions, e.reasons)]
                    raise DecodeError(f"cannot decode image field {name!r}: " + "; ".join(lines)
                                      + " (pass on_error='skip' to replace such samples)") from None
                n = len(ds)
                for p in e.positions:
                    idx[p] = (idx[p] + 1) % n  # deterministic: the next sample
                with loader._stats.lock:
                    loader._stats.replaced += len(e.positions)
                continue
            finally:
                copied = runner.copy_s - c0  # DALI's output into the slot / device tensor
                with loader._stats.lock:
                    loader._stats.decode_s += time.perf_counter() - t0 - copied
                    loader._stats.copy_s += copied
            return res, idx
        raise DecodeError(f"image field {name!r}: gave up replacing undecodable samples near index {int(idx[0])}")

    def _decode_all(self, idx: np.ndarray, out_for: Callable[[str], Any], runners: dict) -> tuple[dict, np.ndarray]:
        """Decode every image field; if one field replaces samples, decode all fields again
        with the replacements so that every field of a row comes from the same sample."""
        while True:
            results: dict[str, Any] = {}
            restart = False
            for i, name in enumerate(self.loader.image_fields):
                results[name], final = self._decode(name, idx, out_for(name), runners)
                if not np.array_equal(final, idx):
                    idx = final
                    if i > 0:  # fields before this one hold the replaced samples' rows
                        restart = True
                        break
            if not restart:
                return results, idx

    def _fill(self, slot, idx: np.ndarray, seq: int, runners: dict) -> None:
        """CPU: raw fields and DALI's images straight into the acquired ring slot."""
        loader = self.loader
        ds = loader.dataset
        n = len(idx)
        try:
            if loader.raw_fields:  # timed by the ring (stats()["stages"]["gather_s"])
                shard, row = ds.locate(idx)
                slot.gather(shard, row)
            tensors = slot.tensors
            final = self._decode_all(idx, lambda name: tensors[name][:n], runners)[1]
            if not np.array_equal(final, idx):
                self.replaced[seq] = final
                if loader.raw_fields:
                    shard, row = ds.locate(final)
                    slot.gather(shard, row)  # replaced samples: their raw fields too
            slot.commit(n)
        except BaseException as e:
            # Record the error before failing the slot: the consumer looks it up as soon
            # as ring.get() raises for this batch.
            self.errors[seq] = e
            slot.fail(f"{type(e).__name__}: {e}")

    def _one_cuda(self, idx: np.ndarray, runners: dict) -> None:
        """CUDA: images from DALI on the device; raw fields through the ring."""
        loader = self.loader
        ds = loader.dataset
        out, final = self._decode_all(idx, lambda name: None, runners)
        if loader.raw_fields:
            shard, row = ds.locate(final)
            self.ring.submit(shard, row)
            out.update(self.ring.get())
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(loader.device))
        out["__index__"] = torch.from_numpy(final).to(loader.device)
        out["__event__"] = ev
        self.outbox.put(out)

    def _drain(self) -> None:
        """Take (and drop) every batch the workers put in the ring, so none is left over."""
        ring = self.ring
        if ring is None or ring.closed or self.cuda:
            return
        while ring.pending > 0:
            try:
                ring.get_arrays()
            except (RuntimeError, IndexError, ValueError):
                pass

    def close(self) -> None:
        self.stop.set()
        self.inbox.put(None)
        # A worker may be blocked in ring.acquire() waiting for a free slot: keep draining
        # the ring until every worker has seen the stop flag and returned.
        deadline = time.monotonic() + 30
        while any(t.is_alive() for t in self.threads):
            self._drain()
            for t in self.threads:
                t.join(timeout=0.01)
            if time.monotonic() > deadline:  # pragma: no cover - only if DALI hangs
                logger.warning("fastload: feeder threads did not stop within 30 s")
                break
        self._drain()
        self.errors.clear()

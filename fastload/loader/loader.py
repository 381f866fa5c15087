"""Loader: the public face. It builds its parts and hands them down; none reaches back up.

    options   (options.py)  the keyword arguments, checked once and frozen
    sampler   (sampling.py) the order; each pass is an EpochPlan value
    parts     (parts.py)    the ring, the DALI decoders, the device delivery
    source    (host.py / cuda.py)  an epoch's source of ready batches
    stats     (stats.py)    the one object every part reports into
    progress  (epoch.py)    the position after the last batch handed over (for state_dict)

Resume: the position is the sampler's after every batch *handed to the user* (not after the
ones merely prefetched), so ``state_dict()`` taken between steps continues at exactly the next
step.
"""
from __future__ import annotations

import hashlib
import json
import os
import weakref
from typing import Any, Iterator, Mapping, Sequence

from ..store import Dataset, DatasetReader
from ..world import World
from .epoch import EpochIterator, Progress
from .options import Options, build_options, make_sampler
from .parts import Parts
from .stats import Stats

__all__ = ["LOADER_STATE_VERSION", "Loader", "dataset_fingerprint"]

LOADER_STATE_VERSION = 1


def dataset_fingerprint(ds) -> str:
    """A short hash of what defines the data: sample counts, fields and shard checksums."""
    m = ds.manifest
    desc = json.dumps({"n": m["num_samples"], "fields": m["fields"],
                       "shards": [(s["num_samples"], s.get("checksum")) for s in m["shards"]]}, sort_keys=True)
    return hashlib.sha256(desc.encode()).hexdigest()[:16]


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
    ``len(loader)`` is the number of batches per epoch on this rank. The configuration is
    fixed at construction (``loader.options``).
    """

    def __init__(self, dataset: DatasetReader | str | os.PathLike, *, batch_size: int, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False, device=None, rank: int | None = None,
                 world_size: int | None = None, fields: Sequence[str] | None = None,
                 transforms: Mapping[str, Any] | None = None, threads: int | None = None,
                 prefetch: int | None = None, weights: Any = None, replacement: bool = True,
                 num_draws: int | None = None, balance: bool | str = False, shuffle_mode: str = "full",
                 window: int | None = None, on_error: str = "raise", log_every: int | None = None):
        self._closed = True  # until fully built (__del__ / close() of a half-built Loader)
        self._parts = None
        ds = dataset if isinstance(dataset, DatasetReader) else Dataset(dataset)
        self._dataset = ds
        self._world = World.detect(rank, world_size)
        self._options = build_options(ds, batch_size=batch_size, seed=seed, device=device, fields=fields,
                                      transforms=transforms, threads=threads, prefetch=prefetch, on_error=on_error,
                                      log_every=log_every)
        self._sampler = make_sampler(ds, self._world, batch_size=self._options.batch_size, seed=self._options.seed,
                                     shuffle=shuffle, drop_last=drop_last, weights=weights, replacement=replacement,
                                     num_draws=num_draws, balance=balance, shuffle_mode=shuffle_mode, window=window)
        self._stats = Stats()
        self._progress = Progress()
        # Threads, the ring and DALI pipelines live in Parts, which holds no reference to
        # the Loader: the finalizer can then run when the Loader is garbage collected.
        self._parts = Parts(ds, self._options, self._stats)
        self._finalizer = weakref.finalize(self, self._parts.close)
        self._closed = False

    # -- the configuration (read-only) ------------------------------------------------------
    dataset = property(lambda self: self._dataset)
    sampler = property(lambda self: self._sampler)
    world = property(lambda self: self._world)
    options: Options = property(lambda self: self._options)
    batch_size = property(lambda self: self._options.batch_size)
    seed = property(lambda self: self._options.seed)
    device = property(lambda self: self._options.device)
    fields = property(lambda self: list(self._options.fields))
    raw_fields = property(lambda self: list(self._options.raw_fields))
    image_fields = property(lambda self: list(self._options.image_fields))
    list_fields = property(lambda self: list(self._options.list_fields))
    transforms = property(lambda self: dict(self._options.transforms))
    threads = property(lambda self: self._options.threads)
    prefetch = property(lambda self: self._options.prefetch)
    on_error = property(lambda self: self._options.on_error)
    log_every = property(lambda self: self._options.log_every)

    # -- iteration -----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._sampler)

    @property
    def epoch(self) -> int:
        return self._sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's order (call before iterating, like DistributedSampler). After
        ``load_state_dict``, setting the loaded epoch keeps the loaded mid-epoch position."""
        self._parts.stop_iter()
        if epoch != self._sampler.epoch:
            self._progress.position = None
        self._sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self._closed:
            raise RuntimeError("this Loader is closed")
        self._parts.stop_iter()
        plan = self._sampler.epoch_plan()  # resumes a loaded position, else starts the epoch
        o = self._options
        it = EpochIterator(plan, self._parts.source(plan.epoch), prefetch=o.prefetch, stats=self._stats,
                           progress=self._progress, dataset=self._dataset, list_fields=o.list_fields,
                           log_every=o.log_every)
        self._parts.track(it)
        return it

    # -- resume --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain JSON-able state: where the next batch starts, plus what must match on load."""
        return {
            "version": LOADER_STATE_VERSION,
            "dataset": {"num_samples": len(self._dataset), "fingerprint": dataset_fingerprint(self._dataset)},
            "batch_size": self.batch_size,
            "fields": self.fields,
            "transforms": {n: t.describe() for n, t in self._options.transforms.items()},
            "seed": self.seed,
            "sampler": self._sampler.state_dict(consumed=self._progress.position),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (same or different world size). Refuses a state taken on
        another dataset or with other settings, naming what differs."""
        if not isinstance(state, Mapping) or "sampler" not in state:
            raise ValueError("not a fastload Loader state (no 'sampler' key)")
        if state.get("version") != LOADER_STATE_VERSION:
            raise ValueError(f"Loader state version {state.get('version')!r} is not {LOADER_STATE_VERSION}")
        mine = self.state_dict()
        for key in ("dataset", "seed", "fields", "transforms"):
            if state.get(key) != mine[key]:
                raise ValueError(f"Loader state mismatch in {key}: saved {state.get(key)!r}, "
                                 f"this loader has {mine[key]!r}")
        self._parts.stop_iter()
        self._sampler.load_state_dict(state["sampler"])  # validates seed, size, version
        self._progress.position = None

    # -- stats and lifetime --------------------------------------------------------------------
    def stats(self) -> dict:
        """Throughput and where the time went, since the current epoch's iteration began.

        wait_fraction = time the training loop spent blocked in ``next()`` / wall time: near 0
        means data loading keeps up; near 1 means the loop is starved."""
        out = self._stats.snapshot()
        out["epoch"] = self._sampler.epoch
        ring = self._parts.ring_stats() if self._parts is not None else None
        if ring is not None:
            out["ring"] = ring
        return out

    def close(self) -> None:
        """Stop and join every thread, release the ring and DALI pipelines. Idempotent."""
        self._closed = True
        if self._parts is None:
            return
        self._parts.stop_iter()
        self._stats.detach_all()  # stats() stays complete after close()
        self._finalizer()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            if self._parts is not None:
                self._parts.stop_iter()
        except Exception:
            pass

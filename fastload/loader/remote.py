"""RemoteShards: what a Loader adds for a remote dataset (``fastload.remote``).

* At construction it checks that the cache budget can hold what the order needs at once
  (:class:`~fastload.errors.CacheTooSmall` names ``shuffle_mode="window"`` and the minimum).
* At each pass it hands the cache the pass's first-use schedule and the next epoch's, so the
  cache downloads in that exact order and fetches the next epoch's first shards early.
* Before batches go to the ring it makes sure their shards are local and installed as ring
  sources (``prepare``); after a shard's last use the cache calls back and the ring drops it,
  so its mapping is released before the file is deleted.
* The position after every batch handed to the training loop goes to the cache (eviction).
* The cache's counters go into the Loader's stats (per epoch).
"""
from __future__ import annotations

import threading
from typing import Sequence

import numpy as np

from ..errors import CacheTooSmall
from ..remote.schedule import plan_uses, sampler_uses

__all__ = ["RemoteShards", "download_stats"]


class RemoteShards:
    def __init__(self, dataset, sampler, *, batch_size: int, world_size: int, prefetch: int, stats) -> None:
        self._ds = dataset
        self._cache = dataset.cache
        self._sampler = sampler
        # the reader asks for shards up to this many positions before reporting them consumed:
        # the batches in flight on every rank, plus a step of skew between ranks
        self._cache.ahead = (prefetch + 2) * batch_size * world_size
        uses = sampler_uses(sampler, dataset.shard_starts)
        need = self._cache.minimum_limit(uses)
        if need > self._cache.limit:
            raise CacheTooSmall(self._cache._too_small_message(uses, need, self._hint(prefetch)), minimum=need)
        self._ring = None
        self._pending_plan = None
        self._fields: tuple[str, ...] = ()
        self._installed: set[int] = set()
        self._lock = threading.Lock()
        stats.attach("remote", self._cache.probe, derive=download_stats)  # its counters, per epoch

    def _hint(self, prefetch: int) -> str:
        """What else to change: the window's minimum for a full shuffle, else smaller windows."""
        s = self._sampler
        if s.shuffle_mode == "window":
            return (f"use a smaller window (window={s.window}), fewer batches in flight (prefetch={prefetch}) "
                    f"or smaller batches: the shards a window and the batches in flight touch must fit")
        if s.weights is not None or s.labels is not None or not s.shuffle:
            return "read in shard windows with shuffle_mode=\"window\""
        from ..remote.schedule import epoch_uses
        from ..sampling import window_permutation

        w1 = epoch_uses(window_permutation(self._ds.shard_sizes, 1, s.seed, s.epoch), self._ds.shard_starts)
        return (f"read in shard windows with shuffle_mode=\"window\" (window=1 needs "
                f"{self._cache.minimum_limit(w1)} bytes here; each shard of window w is in use at once)")

    # -- the schedule --------------------------------------------------------------------
    def begin(self, plan) -> None:
        """A pass starts: this one's schedule, and the next epoch's (predicted: epoch + 1),
        handed to the cache with the first batches (so its downloads count in this epoch's
        stats, which begin with the pass)."""
        self._pending_plan = plan

    def _start_pass(self) -> None:
        plan, self._pending_plan = self._pending_plan, None
        starts = self._ds.shard_starts
        nxt = sampler_uses(self._sampler, starts, epoch=plan.epoch + 1, start=0)
        self._cache.plan(plan_uses(plan, starts), next_uses=nxt)

    def advance(self, position: int) -> None:
        self._cache.advance(position)

    # -- ring sources --------------------------------------------------------------------
    def attach_ring(self, ring, fields: Sequence[str]) -> None:
        self._ring, self._fields = ring, tuple(fields)
        self._cache.on_release(self._drop)

    def prepare(self, batches: Sequence[np.ndarray]) -> None:
        """Make the shards of these batches local and (for raw fields) ring sources."""
        if self._pending_plan is not None:
            self._start_pass()
        idx = np.concatenate(batches) if len(batches) > 1 else batches[0]
        shards = np.unique(self._ds.locate(idx, check=False, verify=False)[0]).tolist()  # (verified by column())
        for s in shards:
            if s in self._installed:
                continue
            self._ds.shard(s)  # blocks until the shard is in the cache, then maps it
            with self._lock:
                if s in self._installed:
                    continue
                if self._ring is not None and self._fields:
                    self._ring.set_source(s, {n: self._ds.column(s, n) for n in self._fields})
                self._installed.add(s)

    def _drop(self, s: int) -> None:
        with self._lock:
            if s not in self._installed:
                return
            self._installed.discard(s)
            if self._ring is not None and self._fields and not self._ring.closed:
                self._ring.set_source(s, None)

    def close(self) -> None:
        """The Loader closes: no more callbacks into its ring; the download threads stop."""
        self._cache.remove_release_hook(self._drop)
        with self._lock:
            self._ring = None
            self._installed.clear()
        self._cache.stop()


def download_stats(out: dict) -> dict:
    """Turn the cache's busy time into ``download_MBps`` in a stats snapshot."""
    if "bytes_downloaded" in out:
        busy = out.pop("download_busy_s", 0.0)
        out["download_MBps"] = out["bytes_downloaded"] / busy / 1e6 if busy > 0 else 0.0
    return out

"""The cache's timeline: when each use of a shard is admitted, released, and evicted.

Part of :mod:`fastload.remote.cache`. :class:`_Timeline` is the part of
:class:`~fastload.remote.cache.ShardCache` that

* lays the uses of the kept passes (the previous, the current and the predicted next) on one
  timeline, with the admission time of each under the budget
  (:func:`~fastload.remote.schedule.admission_times`);
* on each event (an admission, a last use passed, a first use coming within ``ahead``)
  releases this process's mappings of shards it no longer needs (``on_release`` callbacks)
  and evicts: exactly the shards every local rank is past, and, when bytes are needed for a
  download, the shards not needed now, farthest next use first.
"""
from __future__ import annotations

import logging
import os
import time

import numpy as np

from ..errors import RemoteError
from .schedule import EpochUses, admission_times

__all__: list[str] = []

logger = logging.getLogger("fastload")

_NEVER = np.iinfo(np.int64).min // 4  # "admitted since forever" (uses of a previous pass)



class _Timeline:
    """Mixin of :class:`~fastload.remote.cache.ShardCache` (uses the ``_u_*`` timeline
    arrays and the counters set by its ``__init__``)."""

    def _rebuild_timeline(self, n_prev: int, t0: int) -> None:
        shards, first, last = [], [], []
        for j, p in enumerate(self._passes):
            u: EpochUses = p["uses"]
            off = p["base"] - u.start
            shards.append(u.shards)
            first.append(u.first + off)
            last.append(u.last + off)
        sh = np.concatenate(shards) if shards else np.zeros(0, np.int64)
        fi = np.concatenate(first) if first else np.zeros(0, np.int64)
        la = np.concatenate(last) if last else np.zeros(0, np.int64)
        n_prev_uses = sum(len(p["uses"]) for p in self._passes[:n_prev])
        adm = np.full(len(sh), _NEVER, dtype=np.int64)
        adm[n_prev_uses:] = admission_times(sh[n_prev_uses:], fi[n_prev_uses:], la[n_prev_uses:], self.sizes,
                                            self.limit, t0)
        self._u_shard, self._u_first, self._u_last, self._u_admit = sh, fi, la, adm
        order = np.argsort(sh, kind="stable")
        bounds = np.searchsorted(sh[order], np.arange(self.num_shards + 1))
        self._by_shard = {int(s): order[bounds[s]:bounds[s + 1]] for s in np.unique(sh)}
        self._by_last = np.argsort(la, kind="stable")
        self._next = n_prev_uses
        ev = np.concatenate([adm[n_prev_uses:], la + 1, fi - self.ahead])
        self._events = np.unique(ev[ev > _NEVER])
        self._next_event = self._event_after(t0 - 1)

    def _event_after(self, t: int) -> int:
        i = int(np.searchsorted(self._events, t, side="right"))
        return int(self._events[i]) if i < len(self._events) else np.iinfo(np.int64).max

    def _on_event(self) -> None:
        self._write_progress()
        self._release_passed()
        self._next_event = self._event_after(self._my_t)
        node_t = self._refresh_node_t(force=True)
        t0 = time.monotonic()
        if not self._lock_admission(t0 + self.policy.timeout_s):  # never without a deadline
            raise RemoteError(f"eviction in {self.dir} stopped: " + self._admission_stuck(time.monotonic() - t0))
        try:
            self._evict(node_t, need=0)
        finally:
            self._unlock_admission()
        with self._cond:
            self._cond.notify_all()

    def _release_passed(self) -> None:
        """Mappings of shards whose uses are all behind this rank go (callbacks)."""
        t = self._my_t
        order = self._by_last
        while self._release_ptr < len(order) and self._u_last[order[self._release_ptr]] < t:
            s = int(self._u_shard[order[self._release_ptr]])
            self._release_ptr += 1
            if s in self._released or self._required_by_me(s, t):
                continue
            self._released.add(s)
            self._call_release(s)

    def _required_by_me(self, s: int, t: int) -> bool:
        us = self._by_shard.get(s)
        if us is None:
            return False
        return bool(np.any((self._u_first[us] - self.ahead <= t) & (self._u_last[us] >= t)))

    def _call_release(self, s: int) -> None:
        for fn in self._release_hooks:
            try:
                fn(s)
            except Exception:  # a hook must not break the cache
                logger.exception("fastload: release hook failed for shard %s", self.names[s])

    def _classify(self, s: int, node_t: int) -> tuple[bool, float]:
        """(live, next use): live = an admitted use of ``s`` is not behind the node, or a
        local rank (possibly ahead of the node) reads it; next use = the first position of
        its earliest not-yet-admitted use (inf: none, -inf: never planned)."""
        us = self._by_shard.get(s)
        if us is None:
            return False, float("-inf")
        adm, la, fi = self._u_admit[us], self._u_last[us], self._u_first[us]
        live = bool(np.any((adm <= node_t) & (la >= node_t)))
        if not live:
            for t in self._rank_t:
                if np.any((fi - self.ahead <= t) & (la >= t)):
                    live = True
                    break
        fut = fi[adm > node_t]
        return live, float(fut.min()) if len(fut) else float("inf")

    def _evict(self, node_t: int, need: int) -> int:
        """Delete shards nobody needs any more (exact eviction); then, while ``need`` bytes
        more are wanted, shards not needed now, farthest next use first. Returns bytes freed.
        Called with the admission lock held."""
        complete, _ = self._present()
        freed = 0
        candidates = []
        for s, size in complete.items():
            if s in self._inflight:
                continue
            live, nxt = self._classify(s, node_t)
            if live:
                continue
            if nxt == float("inf") and not self.mirror:  # every planned use is behind the node
                if self._delete(s):
                    freed += size
            else:
                candidates.append((nxt, s, size))
        if need > freed:
            # farthest next use first; never-planned files (on-demand reads) by age
            def key(c):
                nxt, s, _ = c
                if nxt == float("-inf"):
                    try:
                        return (1, -self.path(s).stat().st_mtime)
                    except FileNotFoundError:
                        return (2, 0)
                return (0, -nxt)
            for nxt, s, size in sorted(candidates, key=key):
                if freed >= need:
                    break
                if self._delete(s):
                    freed += size
        return freed

    def _delete(self, s: int) -> bool:
        self._call_release(s)
        try:
            os.unlink(self.path(s))
        except FileNotFoundError:
            return False
        self.evictions += 1
        return True

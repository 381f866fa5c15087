"""The cache's timeline: when each use of a shard is admitted, released, and evicted.

Part of :mod:`fastload.remote.cache`. :class:`Timeline` is the schedule of one cache:

* it lays the uses of the kept passes (the previous, the current and the predicted next) on
  one timeline, with the admission time of each under the budget
  (:func:`~fastload.remote.schedule.admission_times`), and tracks this rank's position on it;
* it hands the download threads the next use to fetch, in first-use order, once admitted;
* on each event (an admission, a last use passed, a first use coming within ``ahead``) it
  says which shards this process no longer needs (their mappings are released), and which
  shards may be evicted: exactly the shards every local rank is past, and, when bytes are
  needed for a download, the shards not needed now, farthest next use first.

It decides; it never touches a file or a thread. :class:`Eviction` carries out what it says
on the cache's files: it calls the ``on_release`` callbacks (a process drops its mappings
first: a mapped, unlinked file would still hold its blocks) and deletes. The timeline is not
thread-safe: the cache calls it under its condition's lock where threads share it.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Collection, Mapping

import numpy as np

from .schedule import EpochUses, admission_times

if TYPE_CHECKING:
    from .cache_files import CacheFiles
    from .cache_ranks import NodeRanks

__all__ = ["Eviction", "Timeline"]

logger = logging.getLogger("fastload")

_NEVER = np.iinfo(np.int64).min // 4  # "admitted since forever" (uses of a previous pass)
_END = np.iinfo(np.int64).max


class Timeline:
    """The schedule of a cache of ``len(sizes)`` shards (``sizes``: their bytes). ``ahead``:
    how many positions before reporting them consumed the reader asks for shards (its
    prefetch; settable until a pass is planned)."""

    def __init__(self, sizes: np.ndarray, ahead: int = 0):
        self._sizes = sizes
        self._num_shards = len(sizes)
        self.ahead = max(0, int(ahead))
        self.pass_no = 0  # passes planned so far
        self._base_next = 0  # where the next pass starts on the timeline
        self.my_t = 0  # this rank's position
        self._cur_base = self._cur_start = self._cur_len = 0
        self._release_ptr = 0
        self._released: set[int] = set()
        self.clear()

    def clear(self) -> None:
        """No pass planned: the timeline (the uses of the kept passes, in first-use order,
        and the events and releases along it) is empty."""
        self._passes: list[dict] = []  # {"k", "base", "uses"} of the kept passes
        self._u_shard = self._u_first = self._u_last = self._u_admit = np.zeros(0, np.int64)
        self._by_shard: dict[int, np.ndarray] = {}
        self._by_last = np.zeros(0, np.int64)
        self._events, self._next_event = np.zeros(0, np.int64), _END
        self._next = 0  # next use for the prefetch threads

    @property
    def active(self) -> bool:
        """A pass is planned."""
        return bool(self._passes)

    @property
    def hold(self) -> int:
        """The first position of the kept passes (nothing of this run is evicted before it)."""
        return self._passes[0]["base"] if self._passes else 0

    def planned(self, shard: int) -> bool:
        """Some kept pass uses ``shard``."""
        return shard in self._by_shard

    # -- passes ------------------------------------------------------------------------------
    def plan(self, uses: EpochUses, next_uses: EpochUses | None, limit: int) -> None:
        """A pass begins: ``uses`` (positions from ``uses.start``), and optionally the next
        pass's uses, admitted under ``limit`` bytes after this pass's. The previous pass is
        kept (its shards in use may still be read by a slower rank)."""
        self.pass_no += 1
        base = self._base_next
        length = uses.end - uses.start
        cur = {"k": self.pass_no, "base": base, "uses": uses}
        nxt = None
        if next_uses is not None:
            nxt = {"k": self.pass_no + 1, "base": base + length, "uses": next_uses}
        prev = [p for p in self._passes if p["k"] == self.pass_no - 1]
        self._passes = prev + [cur] + ([nxt] if nxt else [])
        self._base_next = base + length
        self._cur_base, self._cur_start, self._cur_len = base, uses.start, length
        self._rebuild(len(prev), base, limit)
        self.my_t = base
        self._release_ptr = 0
        self._released.clear()

    def update(self, uses: EpochUses, next_uses: EpochUses | None, limit: int) -> None:
        """More is known of the current pass (its :class:`~fastload.remote.schedule.PassScan`
        went on): ``uses`` replaces its uses, and ``next_uses`` (when given) the next pass's.
        ``uses`` must extend the uses planned so far: the same shards first, in the same
        order, at the same first uses (more after them), each last use no later than before;
        so the download threads' place in the queue, this rank's position and what was
        released stay, and admissions only move earlier."""
        cur = next(p for p in self._passes if p["k"] == self.pass_no)
        old: EpochUses = cur["uses"]
        n = len(old)
        planned_next = any(p["k"] == self.pass_no + 1 for p in self._passes)
        if (uses.start, uses.end) != (old.start, old.end) or len(uses) < n or (planned_next and len(uses) > n) or not (
                np.array_equal(uses.shards[:n], old.shards) and np.array_equal(uses.first[:n], old.first)
                and np.all(uses.last[:n] <= old.last)):
            raise ValueError("a pass's uses may only be extended (its scan went on)")
        cur["uses"] = uses
        keep = [p for p in self._passes if p["k"] <= self.pass_no]
        if next_uses is not None:
            keep.append({"k": self.pass_no + 1, "base": self._base_next, "uses": next_uses})
        elif planned_next:
            keep = self._passes
        self._passes = keep
        n_prev = sum(1 for p in self._passes if p["k"] < self.pass_no)
        queue = self._next
        self._rebuild(n_prev, self._cur_base, limit)
        self._next = max(self._next, queue)  # the uses before it are the same ones: taken already
        self._release_ptr = 0  # (what was released stays released)
        self._next_event = self._event_after(self.my_t - 1)

    def _rebuild(self, n_prev: int, t0: int, limit: int) -> None:
        shards, first, last = [], [], []
        for p in self._passes:
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
        adm[n_prev_uses:] = admission_times(sh[n_prev_uses:], fi[n_prev_uses:], la[n_prev_uses:], self._sizes,
                                            limit, t0)
        self._u_shard, self._u_first, self._u_last, self._u_admit = sh, fi, la, adm
        order = np.argsort(sh, kind="stable")
        bounds = np.searchsorted(sh[order], np.arange(self._num_shards + 1))
        self._by_shard = {int(s): order[bounds[s]:bounds[s + 1]] for s in np.unique(sh)}
        self._by_last = np.argsort(la, kind="stable")
        self._next = n_prev_uses
        ev = np.concatenate([adm[n_prev_uses:], la + 1, fi - self.ahead])
        self._events = np.unique(ev[ev > _NEVER])
        self._next_event = self._event_after(t0 - 1)

    # -- this rank's position ----------------------------------------------------------------
    def advance(self, consumed: int) -> bool:
        """The global position consumed in the current pass; True when an event is due
        (the cache then handles it and calls :meth:`event_handled`)."""
        if not self._passes:
            return False
        t = self._cur_base + min(self._cur_len, max(0, int(consumed) - self._cur_start))
        if t <= self.my_t:
            return False
        self.my_t = t
        return t >= self._next_event

    def event_handled(self) -> None:
        self._next_event = self._event_after(self.my_t)

    def _event_after(self, t: int) -> int:
        i = int(np.searchsorted(self._events, t, side="right"))
        return int(self._events[i]) if i < len(self._events) else _END

    def to_release(self) -> list[int]:
        """Shards whose uses are all behind this rank (each once per pass): this process's
        mappings of them go."""
        t = self.my_t
        order = self._by_last
        out = []
        while self._release_ptr < len(order) and self._u_last[order[self._release_ptr]] < t:
            s = int(self._u_shard[order[self._release_ptr]])
            self._release_ptr += 1
            if s in self._released or self._required_by_me(s, t):
                continue
            self._released.add(s)
            out.append(s)
        return out

    def _required_by_me(self, s: int, t: int) -> bool:
        us = self._by_shard.get(s)
        if us is None:
            return False
        return bool(np.any((self._u_first[us] - self.ahead <= t) & (self._u_last[us] >= t)))

    # -- the download threads' queue ---------------------------------------------------------
    def next_use(self) -> int | None:
        """The next use (an index on the timeline) for the download threads; None: none left."""
        return self._next if self._next < len(self._u_shard) else None

    def admitted_at(self, use: int) -> int:
        """The node position from which ``use``'s shard may be downloaded."""
        return int(self._u_admit[use])

    def take(self, use: int, node_t: int) -> int | None:
        """Take ``use`` off the queue: its shard, or None when its last use is behind the
        node already (nothing to fetch)."""
        self._next = use + 1
        return None if self._u_last[use] < node_t else int(self._u_shard[use])

    # -- eviction ----------------------------------------------------------------------------
    def _classify(self, s: int, node_t: int, positions: Collection[int]) -> tuple[bool, float]:
        """(live, next use): live = an admitted use of ``s`` is not behind the node, or a
        local rank (possibly ahead of the node) reads it; next use = the first position of
        its earliest not-yet-admitted use (inf: none, -inf: never planned)."""
        us = self._by_shard.get(s)
        if us is None:
            return False, float("-inf")
        adm, la, fi = self._u_admit[us], self._u_last[us], self._u_first[us]
        live = bool(np.any((adm <= node_t) & (la >= node_t)))
        if not live:
            for t in positions:
                if np.any((fi - self.ahead <= t) & (la >= t)):
                    live = True
                    break
        fut = fi[adm > node_t]
        return live, float(fut.min()) if len(fut) else float("inf")

    def evictable(self, complete: Mapping[int, int], busy: Collection[int], node_t: int,
                  positions: Collection[int], *, mirror: bool,
                  age: Callable[[int], float | None]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Which of the ``complete`` shards (shard -> bytes) may go, the node at ``node_t``
        and the live local ranks at ``positions`` (``busy``: being downloaded, kept):
        ``(done, spare)``. ``done``: no planned use is left ahead of the node (deleted at once,
        unless the cache is a ``mirror``); ``spare``: not needed now, in the order to delete
        them when room is needed: farthest next use first, then the never-planned files
        (on-demand reads) newest first (``age(shard)``: its mtime, None: gone)."""
        done, candidates = [], []
        for s, size in complete.items():
            if s in busy:
                continue
            live, nxt = self._classify(s, node_t, positions)
            if live:
                continue
            if nxt == float("inf") and not mirror:  # every planned use is behind the node
                done.append((s, size))
            else:
                candidates.append((nxt, s, size))

        def key(c):
            nxt, s, _ = c
            if nxt == float("-inf"):
                mtime = age(s)
                return (2, 0) if mtime is None else (1, -mtime)
            return (0, -nxt)

        return done, [(s, size) for _, s, size in sorted(candidates, key=key)]


class Eviction:
    """Releasing and deleting the shards of ``files`` as ``timeline`` says, the node's ranks
    being ``ranks``. Owns the ``on_release`` callbacks and the ``evictions`` counter."""

    def __init__(self, files: CacheFiles, timeline: Timeline, ranks: NodeRanks):
        self._files, self._timeline, self._ranks = files, timeline, ranks
        self._hooks: list[Callable[[int], None]] = []
        self.evictions = 0

    def on_release(self, fn: Callable[[int], None]) -> None:
        self._hooks.append(fn)

    def remove_release_hook(self, fn: Callable[[int], None]) -> None:
        try:
            self._hooks.remove(fn)
        except ValueError:
            pass

    def release(self, s: int) -> None:
        """This process no longer needs shard ``s``: the callbacks drop its mappings."""
        for fn in self._hooks:
            try:
                fn(s)
            except Exception:  # a hook must not break the cache
                logger.exception("fastload: release hook failed for shard %s", self._files.names[s])

    def release_passed(self) -> None:
        """Release the shards whose uses are all behind this rank (see :meth:`Timeline.to_release`)."""
        for s in self._timeline.to_release():
            self.release(s)

    def evict(self, node_t: int, need: int, busy: Collection[int] = ()) -> int:
        """Delete shards nobody needs any more (exact eviction); then, while ``need`` bytes
        more are wanted, shards not needed now, farthest next use first (``busy``: being
        downloaded by this process, kept). Returns bytes freed. Called with the admission
        lock held."""
        files = self._files
        complete, _ = files.present()
        done, spare = self._timeline.evictable(complete, busy, node_t, self._ranks.positions, mirror=files.mirror,
                                               age=files.age)
        freed = 0
        for s, size in done:
            if self._delete(s):
                freed += size
        for s, size in spare:
            if freed >= need:
                break
            if self._delete(s):
                freed += size
        return freed

    def _delete(self, s: int) -> bool:
        self.release(s)  # this process's mappings first: a mapped, unlinked file holds its blocks
        if not self._files.delete(s):
            return False
        self.evictions += 1
        return True

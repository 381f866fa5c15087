"""RemoteShards: what a Loader adds for a remote dataset, or a mixture with remote datasets
(``fastload.remote``).

* At construction it checks that each cache budget can hold what the order needs at once
  (:class:`~fastload.errors.CacheTooSmall` names ``shuffle_mode="window"`` and the minimum;
  a mixture, which has no window mode, shares its one budget out by those needs, or says
  which dataset needs more).
* At construction (a warm start: downloads begin while the model is built) and at each pass
  it hands every cache its dataset's part of the pass's first-use schedule and of the next
  epoch's (positions are the pass's, common to every dataset of a mixture), so each cache
  downloads in that exact order and fetches the next epoch's first shards early.
* Before batches go to the ring it makes sure their shards are local and installed as ring
  sources (``prepare``); after a shard's last use its cache calls back and the ring drops it,
  so its mapping is released before the file is deleted.
* The position after every batch handed to the training loop goes to every cache (eviction).
* The caches' counters, added up, go into the Loader's stats (per epoch), with the reader's
  waits for a long pass's plan (``plan_wait_s``, ``plan_waits``: see :class:`_Planner`).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import CacheTooSmall, PassEnded, format_bytes
from ..remote.pacing import RetryPolicy
from ..remote.schedule import SCAN, EpochUses, PackScan, PassScan, plan_scan, sampler_scan

__all__ = ["RemoteShards", "download_stats", "remote_members"]

logger = logging.getLogger("fastload")


def remote_members(dataset) -> list[tuple[Any, int, Any]]:
    """``(cache, first shard, reader)`` of each remote dataset read by ``dataset`` (a reader,
    or a mixture's ConcatReader; shards numbered as ``dataset`` numbers them)."""
    if getattr(dataset, "cache", None) is not None:
        return [(dataset.cache, 0, dataset)]
    readers = getattr(dataset, "readers", None) or []
    bases = getattr(dataset, "shard_bases", None)
    return [(r.cache, int(bases[d]), r) for d, r in enumerate(readers) if getattr(r, "cache", None) is not None]


def _largest(lo: int, hi: int, ok) -> int | None:
    """The largest ``x`` in ``lo..hi`` with ``ok(x)`` (``ok`` taken as monotone: true up to
    some point), or None; a binary search (each ``ok`` may compute an epoch's order)."""
    if hi < lo or not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


SYNC_POSITIONS = 1 << 22  # a pass's positions scanned before its plan starts (all of a shorter pass)


def _part(uses: EpochUses, base: int, n: int) -> EpochUses:
    """The uses of shards ``base..base+n-1``, renumbered from 0 (positions unchanged)."""
    keep = (uses.shards >= base) & (uses.shards < base + n)
    return EpochUses(uses.epoch, uses.start, uses.end, uses.shards[keep] - base, uses.first[keep], uses.last[keep])


class RemoteShards:
    """See the module docstring. ``pack``: a packing Loader's ``(epoch, start) -> PackPlan``
    (its positions count tokens, ``pack_to`` per row); None: positions count samples."""

    def __init__(self, dataset, sampler, *, batch_size: int, world_size: int, prefetch: int, stats,
                 mixture=None, warm: bool = True, pack=None, pack_to: int = 1) -> None:
        self._ds = dataset
        self._members = remote_members(dataset)
        self._caches = [c for c, _, _ in self._members]
        self._sampler = sampler
        self._mixture = mixture
        self._pack = pack
        self._pid = os.getpid()
        # the reader asks for shards up to this many positions before reporting them consumed:
        # the batches in flight on every rank, plus a step of skew between ranks
        for c in self._caches:
            c.ahead = (prefetch + 2) * batch_size * world_size * (pack_to if pack is not None else 1)
        scan = self._scan(sampler.epoch, None)
        scan.step(SYNC_POSITIONS)  # a longer pass: the rest in the background (_Planner), once planned
        uses = self._parts(scan.seen())  # (what the budget needs at least: all of it when the scan is over)
        needs = [c.minimum_limit(u) for c, u in zip(self._caches, uses)]
        if mixture is None:
            (cache,), (need,), (u,) = self._caches, needs, uses
            if need > cache.limit:
                raise CacheTooSmall(cache._too_small_message(u, need, self._hint(prefetch)), minimum=need)
        else:
            self._check_mixture(needs, uses)
        self._ring = None
        self._local = None  # LocalShards of a mixture's local datasets (attach_ring)
        self._pending_plan = None
        self._fields: tuple[str, ...] = ()
        self._ragged: tuple[str, ...] = ()
        self._installed: set[int] = set()
        self._hooks: list = []
        self._lock = threading.Lock()
        self._planned: list[EpochUses] | None = None  # the pass the caches are on
        self._planned_stream = None  # ... and the stream it was computed from
        self._planner: _Planner | None = None  # a long pass's scan going on in the background
        self._plan_wait_s, self._plan_waits = 0.0, 0  # the reader's waits on the planners stopped so far
        self._frozen: dict | None = None
        stats.attach("remote", self._probe, derive=download_stats)  # its counters, per epoch
        if warm:
            self._warm_start(scan)

    def _warm_start(self, scan) -> None:
        """Start downloading the current pass (as the sampler stands: epoch and resume
        position) now, while the training script builds its model: the first batch then
        waits for less. The first pass's stats count these downloads (their counters are
        held at this moment until the pass begins); a pass that turns out different (a
        ``set_epoch`` or ``load_state_dict`` before iterating) is planned again."""
        self._frozen = self._probe()
        self._planned = self._launch(scan)
        self._planned_stream = self._sampler.order_stream(self._sampler.epoch)

    def _launch(self, scan) -> list[EpochUses]:
        """Hand the caches the pass of ``scan`` (scanned ``SYNC_POSITIONS`` at least) and the
        next epoch's: at once when the scan is over and the next epoch is no longer than
        ``SYNC_POSITIONS`` (scanned here; a packed one never is), else what is known now, the
        rest (the pass's, then the next epoch's) as a background thread scans on
        (:class:`_Planner`): a pass resumed near the end of a long epoch starts without
        scanning the next epoch first."""
        uses = self._parts(scan.uses())
        pass_nos = lambda: [c.pass_no for c in self._caches]  # noqa: E731
        if scan.done:
            # (a packed epoch's plan may count its tokens first, O(documents): in the background)
            nxt = None if self._pack is not None else self._scan(scan.epoch + 1, 0)
            if nxt is not None and (nxt.done or nxt.end - nxt.start <= SYNC_POSITIONS):
                nxt.step()
                for c, u, n in zip(self._caches, uses, self._parts(nxt.uses())):
                    c.plan(u, next_uses=n)
                return uses
            for c, u in zip(self._caches, uses):
                c.plan(u)
            self._planner = _Planner(self, scan, pass_nos(), nxt)
            return uses
        seen = self._parts(scan.seen())
        for c, u, k in zip(self._caches, uses, seen):
            c.plan(u, check=k)
        self._planner = _Planner(self, scan, pass_nos())
        return uses

    def _scan(self, epoch: int, start: int | None, check: Callable[[], None] | None = None) -> PassScan | PackScan:
        """The scan of a pass over ``epoch`` from ``start`` (None: where the sampler stands):
        a :class:`~fastload.remote.schedule.PassScan` (a packed pass: a
        :class:`~fastload.remote.schedule.PackScan`), nothing scanned yet. ``check``: called
        between chunks of the packed plan's count of the epoch's tokens (a planner's stop)."""
        if self._pack is None:
            return sampler_scan(self._sampler, self._ds.shard_starts, epoch=epoch, start=start)
        if start is None:
            start = self._sampler.start_position() if epoch == self._sampler.epoch else 0
        return PackScan(self._pack(epoch, start, check=check), self._ds.shard_starts)

    def _plan_scan(self, plan: Any) -> PassScan | PackScan:
        if self._pack is None:
            return plan_scan(plan, self._ds.shard_starts)
        return PackScan(plan, self._ds.shard_starts)

    def _check(self, seen: list[EpochUses]) -> None:
        """CacheTooSmall when what the uses seen so far need already exceeds a budget."""
        for c, u in zip(self._caches, seen):
            need = c.minimum_limit(u)
            if need > c.limit:
                raise CacheTooSmall(c._too_small_message(u, need), minimum=need)

    def _stop_planner(self) -> None:
        """Stop the planner, if any, within the caches' ``retry.close_s`` (the bound of every
        close of a remote Loader); its reader's waits go on counting in the stats."""
        planner = self._planner
        if planner is None:
            return
        planner.stop(max(c.policy.close_s for c in self._caches))
        with self._lock:
            self._planner = None
            self._plan_wait_s += planner.wait_s
            self._plan_waits += planner.waits

    def _on_planned_pass(self, plan: Any) -> bool:
        """True when the caches are on ``plan``'s pass already (the warm start's: the same
        epoch, positions and stream), which then needs no second scan of its stream."""
        planned, stream = self._planned, self._planned_stream
        if planned is None or stream is None or not planned:
            return False
        end = plan.bounds[-1][2] if len(plan.bounds) else plan.start
        u = planned[0]
        if (u.epoch, u.start, u.end) != (plan.epoch, plan.start, end):
            return False
        mine = plan.stream if self._pack is None else plan.tokens.stream
        return mine is stream or (hasattr(mine, "same") and mine.same(stream))

    def _parts(self, uses: EpochUses) -> list[EpochUses]:
        return [_part(uses, base, r.num_shards) for _, base, r in self._members]

    def _check_mixture(self, needs: list[int], uses: list[EpochUses]) -> None:
        """A mixture reads each dataset in its own random order: there is no window mode to
        fall back on, so the budget must hold each dataset's need. The caches the mixture
        opened share its one budget out by these needs; a Dataset opened by the user keeps
        its own ``cache_limit``."""
        hint = ("read local copies (`fastload prefetch URL DIR`): a mixture reads each dataset in its own random "
                "order, so it has no shuffle_mode=\"window\" to need less")
        shared = [i for i, c in enumerate(self._caches) if any(c is s for s in self._mixture.shared_caches)]
        if shared:
            from ..remote.budget import share_budget

            share_budget([self._caches[i] for i in shared], self._mixture.cache_limit, [needs[i] for i in shared],
                         hint=hint)
        for i, (c, need) in enumerate(zip(self._caches, needs)):
            if i not in shared and need > c.limit:
                raise CacheTooSmall(c._too_small_message(uses[i], need, hint), minimum=need)

    def _hint(self, prefetch: int) -> str:
        """What else to change, computed from what would fit ``cache_limit``: the largest
        window (window mode), else the most batches in flight with window=1, else what
        window=1 needs; for a full shuffle, what window=1 needs."""
        s = self._sampler
        if s.shuffle_mode == "window":
            if self._pack is not None:  # positions count tokens: no per-window estimate here
                return (f"use a window smaller than window={s.window}, fewer batches in flight than "
                        f"prefetch={prefetch}, or smaller batches: the shards a window and the batches in flight "
                        "touch must fit")
            cache = self._caches[0]
            limit, unit = cache.limit, cache.ahead // (prefetch + 2)  # ahead = (prefetch + 2) * unit
            w = _largest(1, s.window - 1, lambda w: self._window_need(w, cache.ahead) <= limit)
            if w is not None:
                return (f"read with window={w}, the largest window that fits cache_limit={format_bytes(limit)} "
                        f"(it needs {format_bytes(self._window_need(w, cache.ahead))} here)")
            p = _largest(1, prefetch - 1, lambda p: self._window_need(1, (p + 2) * unit) <= limit)
            if p is not None:
                return (f"read with window=1 and prefetch={p}, the most batches in flight that fit "
                        f"cache_limit={format_bytes(limit)} (it needs "
                        f"{format_bytes(self._window_need(1, (p + 2) * unit))} here)")
            least = self._window_need(1, 3 * unit)
            return (f"use smaller batches: even window=1 with prefetch=1 needs {format_bytes(least)} "
                    f"({least} bytes) of cache here")
        if s.weights is not None or s.labels is not None or not s.shuffle:
            return "read in shard windows with shuffle_mode=\"window\""
        from ..remote.schedule import epoch_uses
        from ..sampling.order import Windowed

        w1 = epoch_uses(Windowed(self._ds.shard_sizes, 1, s.seed, s.epoch), self._ds.shard_starts)
        return (f"read in shard windows with shuffle_mode=\"window\" (window=1 needs "
                f"{self._caches[0].minimum_limit(w1)} bytes here; each shard of window w is in use at once)")

    def _window_need(self, window: int, ahead: int) -> int:
        """The cache bytes this pass would need in windows of ``window`` shards, with the
        reader asking ``ahead`` positions early (:func:`~fastload.remote.schedule.minimum_budget`)."""
        from ..remote.schedule import epoch_end, epoch_uses, minimum_budget
        from ..sampling import epoch_order

        s, cache = self._sampler, self._caches[0]
        stream = epoch_order(s.num_samples, seed=s.seed, epoch=s.epoch, shuffle=s.shuffle, weights=s.weights,
                              replacement=s.replacement, num_draws=s.num_draws, balance_labels=s.labels,
                              batch_size=s.batch_size, shuffle_mode="window", shard_sizes=s.shard_sizes,
                              window=window)
        start = s.start_position()
        end = epoch_end(s.stream_len, world_size=s.world_size, batch_size=s.batch_size, drop_last=s.drop_last,
                        drop_last_batch=s.drop_last_batch, start=start)
        u = epoch_uses(stream, self._ds.shard_starts, epoch=s.epoch, start=start, end=end)
        return minimum_budget(u.shards, u.first, u.last, cache.sizes, ahead)[0]

    # -- the schedule --------------------------------------------------------------------
    def begin(self, plan) -> None:
        """A pass starts: this one's schedule, and the next epoch's (predicted: epoch + 1),
        handed to the caches with the first batches (so their downloads count in this epoch's
        stats, which begin with the pass)."""
        self._pending_plan = plan

    def _start_pass(self) -> None:
        plan, self._pending_plan = self._pending_plan, None
        same = self._on_planned_pass(plan)
        self._planned, self._planned_stream, self._frozen = None, None, None
        if same:
            return  # warm-started at construction: the caches are on this pass already
        self._stop_planner()
        scan = self._plan_scan(plan)
        scan.step(SYNC_POSITIONS)
        self._launch(scan)

    def advance(self, position: int) -> None:
        for c in self._caches:
            c.advance(position)

    # -- ring sources --------------------------------------------------------------------
    def attach_ring(self, ring, fields: Sequence[str], ragged: Sequence[str] = ()) -> None:
        """The ring whose sources are the shards in the cache: ``fields`` (fixed-size) and
        ``ragged`` fields of each shard are installed as it arrives and dropped after its
        last use."""
        self._ring, self._fields, self._ragged = ring, tuple(fields), tuple(ragged)
        local = np.ones(self._ds.num_shards, dtype=bool)  # a mixture's local datasets' shards
        for _, base, r in self._members:
            local[base:base + r.num_shards] = False
        if local.any() and (self._fields or self._ragged):
            # mapped as batches need them and dropped past the limit when no batch in flight
            # needs them, as a local dataset's (LocalShards): a remote one's go after their last use
            from ..store.mapped import mapped_shard_limit
            from .shards import LocalShards

            self._local = LocalShards(ring, self._ds, self._fields, self._ragged, mapped_shard_limit(), managed=local)
        for c, base, _ in self._members:
            def hook(s: int, base: int = base) -> None:
                self._drop(s + base)

            c.on_release(hook)
            self._hooks.append((c, hook))

    def prepare(self, batches: Sequence[np.ndarray]) -> None:
        """Make the shards of these batches local and (for raw fields) ring sources."""
        if self._pending_plan is not None:
            self._start_pass()
        planner = self._planner
        if planner is not None and planner.error is not None:
            raise planner.error
        idx = np.concatenate(batches) if len(batches) > 1 else batches[0]
        shards = np.unique(self._ds.locate(idx, check=False, verify=False)[0])  # (verified by column())
        local = self._local
        if local is not None:
            local.prepare(batches)  # a mixture's local datasets' shards
            shards = shards[~local._managed[shards]]
        for s in shards.tolist():
            if s in self._installed:
                continue
            self._ds.shard(s)  # blocks until the shard is in the cache, then maps it
            with self._lock:
                if s in self._installed:
                    continue
                if self._ring is not None and (self._fields or self._ragged):
                    arrays: dict = {n: self._ds.column(s, n) for n in self._fields}
                    for n in self._ragged:
                        offsets, values = self._ds.ragged_column(s, n)
                        arrays[n] = (values, offsets)
                    self._ring.set_source(s, arrays)
                self._installed.add(s)

    __call__ = prepare  # the epoch's source calls its prepare hook

    def plan_through(self, requests: Sequence[Any]) -> None:
        """Before these batches (:class:`~fastload.sampling.packing.Request`) are prepared:
        wait until the caches were handed the pass's uses up to the last position they read
        (a long pass's scan goes on in the background, :class:`_Planner`). A reader ahead of
        the scan would read shards the caches do not know it needs there: a shard used
        earlier (the previous pass) would be released, and one never planned evicted, while
        a prepared batch still reads it."""
        if self._pending_plan is not None:
            self._start_pass()
        planner = self._planner
        if planner is not None and requests:
            planner.wait_known(max(_reach(r) for r in requests))

    def idle(self) -> None:
        """The ring was drained with its feeder closed (see LocalShards.idle)."""
        if self._local is not None:
            self._local.idle()

    def _drop(self, s: int) -> None:
        if os.getpid() != self._pid:  # a forked child's copy: the ring is the parent's
            return
        with self._lock:
            if s not in self._installed:
                return
            self._installed.discard(s)
            if self._ring is not None and (self._fields or self._ragged) and not self._ring.closed:
                self._ring.set_source(s, None)

    def _probe(self) -> dict:
        if self._frozen is not None:
            return dict(self._frozen)
        out: dict = {}
        for c in self._caches:
            for k, v in c.probe().items():
                out[k] = out.get(k, 0) + v
        with self._lock:
            planner, out["plan_wait_s"], out["plan_waits"] = self._planner, self._plan_wait_s, self._plan_waits
        if planner is not None:
            out["plan_wait_s"] += planner.wait_s
            out["plan_waits"] += planner.waits
        return out

    def close(self) -> None:
        """The Loader closes: no more callbacks into its ring; the background planner stops
        within one ``retry.close_s``, then the download threads of every cache, all within
        one more (a transfer stalled in a read of its server is left behind, with a warning:
        see :meth:`ShardCache.stop`)."""
        self._stop_planner()
        for c, hook in self._hooks:
            c.remove_release_hook(hook)
        self._hooks = []
        with self._lock:
            self._ring = None
            self._local = None
            self._installed.clear()
        from ..remote.cache import stop_caches

        stop_caches(self._caches)  # within one retry.close_s (2 s), whatever the servers do


def _reach(request: Any) -> int:
    """The position after the last one a batch's request reads (tokens when packed:
    ``count`` holds its pieces' tokens; else samples, one position per row)."""
    n = int(np.sum(request.count)) if request.count is not None else len(request.index)
    return int(request.position) + n


class _Planner:
    """A long pass's scan (:class:`~fastload.remote.schedule.PassScan`), then the next
    epoch's (``nxt``, nothing scanned yet; None: the scan of ``scan.epoch + 1`` from 0),
    going on in a background thread: the caches (on their passes ``pass_nos``) get what it
    knows each time it has scanned as far again as before, or a second went by (of the next
    epoch too: its first shards are fetched before this pass ends, however long that epoch
    is), the pass's exact schedule as soon as its scan is over, and, once both are over, the
    next epoch's. The reader never reads past what the caches were handed (:attr:`known`):
    a batch further on waits (:meth:`wait_known`), and the thread hands the caches what it
    knows as soon as its scan is past that batch (see :meth:`_follow` for when). A budget
    the uses seen so far already exceed fails the caches (their ``ensure`` raises it) and the
    next batch (``error``). The reader's time in :meth:`wait_known` is counted (``wait_s``,
    ``waits``: the Loader's ``plan_wait_s`` and ``plan_waits``). :meth:`stop` is bounded: the
    thread checks its stop at every chunk it scans or counts."""

    EVERY_S = 1.0
    WAIT_POLL_S = 0.05
    THROTTLE = 9  # an update (the caches' lock held) at most every THROTTLE x its own time: a tenth of the time
    _clock = staticmethod(time.monotonic)  # the update schedule's clock

    def __init__(self, owner: RemoteShards, scan: PassScan | PackScan, pass_nos: list[int],
                 nxt: PassScan | PackScan | None = None) -> None:
        self._owner, self._scan, self._pass_nos, self._nxt = owner, scan, pass_nos, nxt
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._known = threading.Condition()
        # the caches were handed the pass's uses of every position before this one (its
        # plan: what the scan knew when this planner was made)
        self.known = scan.end if scan.done else scan.horizon
        self._wanted = scan.start  # the position the reader waits to be known (none past known: none waits)
        self.wait_s, self.waits = 0.0, 0  # the reader's time waiting for positions to be known, and its waits
        self._thread = threading.Thread(target=self._run, name="fastload-plan", daemon=True)
        self._thread.start()

    def wait_known(self, position: int) -> None:
        """Return once the caches know the pass's uses of every position before ``position``
        (at once, usually: the scan is far ahead of the reader); raises the planner's error,
        and :class:`~fastload.errors.PassEnded` when the planner was stopped first (the
        Loader closed from another thread while this reader waited: its batch would read
        shards the caches were never told of)."""
        position = min(int(position), self._scan.end)
        if self.known < position:
            t0 = time.monotonic()
            with self._known:
                try:
                    self._wanted = max(self._wanted, position)
                    while (self.known < position and self.error is None and not self._stop.is_set()
                           and self._thread.is_alive()):
                        self._known.wait(self.WAIT_POLL_S)
                finally:
                    self.wait_s += time.monotonic() - t0
                    self.waits += 1
        if self.error is not None:
            raise self.error
        if self.known < position:
            if self._stop.is_set():
                raise PassEnded(f"the Loader was closed (or a new pass began) while a batch of this pass waited for "
                                f"the plan of its shards (positions up to {position}, planned up to {self.known}): "
                                "that batch and the ones after it were not delivered. Start a new pass "
                                "(iter(loader)) on an open Loader")
            # (the thread ended without: never expected)
            raise RuntimeError(f"the plan of this pass ended at position {self.known} before position {position}")

    def _set_known(self, position: int) -> None:
        with self._known:
            self.known = max(self.known, position)
            self._known.notify_all()

    def _update(self, nxt: list[EpochUses] | None) -> None:
        o, scan = self._owner, self._scan
        known = scan.end if scan.done else scan.horizon  # (this thread alone steps the scan)
        o._check(o._parts(scan.seen()))
        uses = o._parts(scan.uses())
        for i, (c, u) in enumerate(zip(o._caches, uses)):
            if self._stop.is_set():
                return
            c.update(self._pass_nos[i], u, None if nxt is None else nxt[i])
        if not self._stop.is_set():  # (stopped: some cache may not have been told; a waiting reader raises PassEnded)
            self._set_known(known)

    def _follow(self, scan: PassScan | PackScan, update: Callable[[], None]) -> bool:
        """Scan ``scan`` to its end, calling ``update()`` as it goes; False when stopped first.

        An update holds the caches' lock while it computes their admissions (a fraction of a
        second at 10^5 shards), so updates are throttled to a tenth of the time (the next one
        no sooner than ``THROTTLE`` times the last one's duration after it). Within that, one
        is made each time the scan has gone as far again, or a second went by. And -- this
        pass's scan -- when the reader waits for a position the scan is past now (blocked: it
        needs the update now): at once if the last update was not made for a waiting reader
        (a reader that caught up with the scan once waits for nothing more than the scan),
        else throttled too. A reader waiting again and again is faster than the scan: it
        reads on as fast as the updates tell it more, so the less of the time they take, the
        faster it reads (one update per chunk scanned would take nearly all of it: a chunk
        is scanned in milliseconds); meanwhile the scan goes on, and the update that ends the
        wait tells it that much more."""
        mark, t, gap, for_reader = 2 * scan.horizon - scan.start, self._clock(), 0.0, False
        while not scan.done:
            if self._stop.is_set():
                return False
            scan.step(SCAN)
            if scan.done:
                break
            now = self._clock()
            waited = scan is self._scan and self.known < self._wanted <= scan.horizon
            free = now - t >= gap  # (the throttle)
            if (waited and (free or not for_reader)) or ((scan.horizon >= mark or now - t >= self.EVERY_S) and free):
                update()
                mark, t, for_reader = 2 * scan.horizon - scan.start, self._clock(), waited
                gap = self.THROTTLE * (t - now)
        return not self._stop.is_set()

    def _check_stop(self) -> None:
        """Called between chunks of a long count (the next epoch's packed plan): ends it once stopped."""
        if self._stop.is_set():
            raise _Stopped()

    def _run(self) -> None:
        scan, o = self._scan, self._owner
        try:
            if not self._follow(scan, lambda: self._update(None)):
                return
            if self.known < scan.end:  # the pass's exact schedule at once: the reader may wait for it
                self._update(None)
            nxt = o._scan(scan.epoch + 1, 0, check=self._check_stop) if self._nxt is None else self._nxt
            if self._follow(nxt, lambda: self._update(o._parts(nxt.uses()))):
                self._update(o._parts(nxt.uses()))
        except BaseException as e:  # noqa: BLE001 - handed to the reader
            if self._stop.is_set():
                return
            self.error = e
            for c in o._caches:
                c.fail(e)
            with self._known:
                self._known.notify_all()

    def stop(self, timeout: float = RetryPolicy.close_s) -> bool:
        """Stop scanning (within one chunk of positions, or of documents counted for the
        next epoch's packed plan; a reader waiting in :meth:`wait_known` raises at once) and
        join the thread, for at most ``timeout`` seconds (a Loader passes its caches'
        ``retry.close_s``, the bound of its other closes). False, with a warning, when the
        thread did not end by then: it is left behind (a daemon thread; it stops at its next
        check, and the caches refuse updates of a pass they are no longer on)."""
        self._stop.set()
        with self._known:
            self._known.notify_all()
        if self._thread is threading.current_thread():
            return True  # (it returns once this call does)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("fastload: the background planner of a remote pass (epoch %d) did not end within %.1f s "
                           "of being stopped; it was left behind (the daemon thread %s, which stops at its next "
                           "check)", self._scan.epoch, timeout, self._thread.name)
            return False
        return True


class _Stopped(Exception):
    """A planner's long count ended by its stop (not an error: the planner just returns)."""


def download_stats(out: dict) -> dict:
    """Turn the caches' busy time into ``download_MBps`` in a stats snapshot."""
    if "bytes_downloaded" in out:
        busy = out.pop("download_busy_s", 0.0)
        out["download_MBps"] = out["bytes_downloaded"] / busy / 1e6 if busy > 0 else 0.0
    return out

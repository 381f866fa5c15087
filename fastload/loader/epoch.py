"""One pass over an epoch: pull ready batches from a source, in order, and keep it fed.

``EpochIterator`` walks an ``EpochPlan`` (the sampler's batches for this pass, a value; or a
``PackPlan`` when packing sequences), keeps ``prefetch`` batches requested from the source,
and for each batch it hands to the training loop reports it to the stats and records the
position after it in ``Progress`` — the one value it shares with the Loader, so a
``state_dict()`` taken between two steps resumes exactly at the next one. It knows nothing
of rings, DALI or devices.

Look-ahead: once a pass has requested its last batch, it asks ``lookahead()`` (a bound
:meth:`LookAhead.request`) for the next pass, an ``Ahead``, and requests that pass's first
batches as its own are taken, keeping ``prefetch`` in flight in all: the next pass's first
batch is then ready when it begins, instead of waiting for a decode. ``LookAhead`` holds the
one Ahead slot (built by the Loader with its sampler and its machinery's ``source``); the next
pass's iterator takes the ``Ahead`` over (its requests, its source) when its plan is the same
pass (``EpochPlan.same_pass``); one that does not match is closed unused.

A pass is planned at ``iter()`` (its first batches requested at once), but like a
``DataLoader``'s it follows the sampler at its first ``next()``: the Loader's ``replan`` then
re-plans a pass whose sampler was moved to another epoch in between (``discard``, ``restart``).
PyTorch Lightning moves it there: ``iter(loader)``, then ``loader.sampler.set_epoch(e)``, when a
fit begins and when it reloads its dataloaders. So a pass planned at ``iter()`` while the slot
holds an Ahead of *another* epoch requests nothing yet (it is ``waiting``) and leaves the Ahead
in place: the source delivers in request order, so nothing may be put behind the Ahead's
requests before the first ``next()`` says whose they are. Then the pass takes the Ahead over
when the sampler was moved to its epoch, else closes it (its feeder and ring drained, as for
any Ahead closed unused) and requests its own first batches. And a pass dropped before its
first ``next()`` (Lightning calls ``iter()`` once only to check that the loader is iterable)
leaves what it requested in the slot (``LookAhead.hand_back``): the pass begun next takes it
over when it is the same pass. Such a pass uses up nothing else either: a loaded mid-epoch
position and the look-ahead's note of ``set_epoch`` are taken at the first ``next()``.

Never silently nothing: the iterator holds its ``owner`` (the Loader), so
``for batch in Loader(path, ...)`` — a Loader nobody else holds — delivers its whole epoch.
A pass ends quietly (``StopIteration``) only when its data ran out; a pass ended by anything
else (the Loader closed, ``set_epoch``, ``load_state_dict``, a new pass, an error in an
earlier ``next()``) raises ``PassEnded`` from every later ``next()``, saying why.
"""
from __future__ import annotations

import collections
import functools
import logging
import threading
from time import perf_counter
from dataclasses import dataclass
from typing import Any, Callable

from ..runtime import lifecycle
from ..errors import PassEnded
from ..sampling.packing import PackPlan
from ..sampling import EpochPlan
from .source import BatchSource
from .stats import Stats

__all__ = ["Ahead", "EpochIterator", "LookAhead", "PassEnded", "Progress"]

logger = logging.getLogger("fastload")


@dataclass
class Progress:
    """Where the training loop is: the sampler's global consumed count after the last batch
    handed over (``None``: no pass since the epoch was set or a state was loaded)."""

    position: int | None = None


def _download_line(s: dict) -> str:
    """The remote cache's part of a log line (empty for a local dataset)."""
    if "bytes_downloaded" not in s:
        return ""
    busy = s.get("download_busy_s", 0.0)
    mbps = s["bytes_downloaded"] / busy / 1e6 if busy > 0 else 0.0
    plan = (f", {s['plan_wait_s']:.2f} s for the plan of a long pass ({s['plan_waits']} waits)"
            if s.get("plan_waits") else "")  # (only when the reader caught up with the planner)
    return (f"; downloaded {s['bytes_downloaded'] / 1e6:.1f} MB at {mbps:.0f} MB/s, waited "
            f"{s['download_wait_s']:.2f} s for downloads{plan}, {s['cache_hits']} cache hits, "
            f"{s['evictions']} evictions, {s['retries']} retries")


def _take_requests(batches, room: int) -> tuple[list, list[int], bool]:
    """Up to ``room`` requests from a plan's iterator of (request, position after it):
    (the requests, their positions, whether the plan is exhausted)."""
    run, afters = [], []
    while len(run) < room:
        try:
            req, after = next(batches)
        except StopIteration:
            return run, afters, True
        run.append(req)
        afters.append(after)
    return run, afters, False


class Ahead:
    """The next pass's first requests, put to its source before its iterator exists (see the
    module docstring). ``close()`` ends it unused (the source drops what it was asked for)."""

    def __init__(self, plan: EpochPlan, source: BatchSource, *, batches=None, afters=(), done: bool = False) -> None:
        self.plan = plan
        self.source = source
        self.batches = plan.requests() if batches is None else batches  # those not requested yet
        self.afters: list[int] = list(afters)  # the position after each batch requested so far
        self.done = done  # every batch of the pass requested
        self.failed = False  # a request failed: never taken over (its error comes again in its own pass)

    def fill(self, room: int) -> None:
        if self.done:
            return
        try:
            run, afters, self.done = _take_requests(self.batches, room)
            if run:
                self.source.put(run)
        except BaseException:
            self.failed = True
            raise
        self.afters.extend(afters)  # once they are requested

    @property
    def alive(self) -> bool:
        """Whether it can still be taken over: no request failed, its source's feeder runs."""
        return not self.failed and self.source.feeder_alive

    def close(self) -> None:
        self.source.close()


class LookAhead:
    """The Ahead slot of a Loader: at most one next pass requested ahead, built from the
    sampler's plan (``sampler.plan(epoch)``) and a source for its epoch (``source(epoch)``).

    The next pass is guessed when a pass has requested its last batch (the bound
    :meth:`after` returns): ``epoch + 1`` when the script moves the epochs — the sampler's
    ``set_epoch`` was called since the pass before this one began (at its first ``next()``; by
    ``loader.set_epoch``, or on ``loader.sampler`` as PyTorch Lightning does, before ``iter()`` or
    between ``iter()`` and the first ``next()``) — else ``epoch`` again (as a loop that never
    calls it iterates). A wrong guess costs the batches decoded for it (``prefetch`` at most).
    ``enabled`` is False where nothing is worth requesting ahead (see :func:`look_ahead_pays`);
    the slot then stays empty."""

    def __init__(self, sampler, source: Callable[[int], BatchSource], *, enabled: bool) -> None:
        self._sampler = sampler
        self._source = source
        self.enabled = enabled
        self._ahead: Ahead | None = None
        self._mark = sampler.epochs_set  # the sampler's set_epoch count when the last pass began
        self._closed = False

    def set_epoch(self, epoch: int) -> None:
        """The sampler was set to ``epoch`` by the Loader: an Ahead requested for another epoch
        stops now."""
        if self._ahead is not None and self._ahead.plan.epoch != epoch:
            self.drop()

    def after(self, epoch: int) -> Callable[[], Ahead | None] | None:
        """For the pass over ``epoch`` just begun: what its iterator calls once its last batch
        is requested (None: nothing is requested ahead)."""
        since, self._mark = self._mark, self._sampler.epochs_set
        return functools.partial(self._guess, epoch, since) if self.enabled else None

    def _guess(self, epoch: int, since: int) -> Ahead | None:
        return self.request(epoch + 1 if self._sampler.epochs_set != since else epoch)

    def request(self, epoch: int) -> Ahead | None:
        """Begin the pass over ``epoch`` ahead (None when one is held already, or closed)."""
        if self._closed or self._ahead is not None:
            return None
        self._ahead = Ahead(self._sampler.plan(epoch), self._source(epoch))
        return self._ahead

    def take(self, plan) -> Ahead | None:
        """The Ahead requested for this very pass, if any and still fed; any other is closed
        (and on any error while deciding: nothing it requested is left in the feeder)."""
        ahead = self._ahead
        if ahead is None:
            return None
        try:
            if ahead.alive and ahead.plan.same_pass(plan):
                self._ahead = None
                return ahead
        except BaseException:
            self.drop()
            raise
        self.drop()
        return None

    def holds_another_epoch(self, plan) -> bool:
        """Whether the Ahead held (still fed) is for another epoch than ``plan``'s: a pass
        planned at ``iter()`` then leaves it in place, since the script may yet move the
        sampler to its epoch before the first ``next()`` (PyTorch Lightning does)."""
        ahead = self._ahead
        return ahead is not None and ahead.alive and ahead.plan.epoch != plan.epoch

    def hand_back(self, ahead: Ahead) -> None:
        """Hold ``ahead``: what a pass dropped before its first ``next()`` had requested (PyTorch
        Lightning calls ``iter()`` once only to check that the loader is iterable); the pass
        begun next takes it over if it is the same pass. Closed when the slot is taken, or
        nothing is requested ahead any more."""
        if self._closed or not self.enabled or self._ahead is not None:
            ahead.close()
            return
        self._ahead = ahead

    def drop(self) -> None:
        """Close the Ahead held, if any (its source drops what it was asked for)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.close()

    def close(self) -> None:
        """Drop the Ahead held; nothing is requested ahead any more."""
        self._closed = True
        self.drop()


def look_ahead_pays(options, remote: bool) -> bool:
    """Whether a Loader requests its next pass ahead: only where a pass's first batch waits for
    real work (a decode on the CPU) and the next pass is a pure function of the epoch: image
    fields decoded on the host, fed by the shared feeder in order. Not on a GPU (nvJPEG's first
    batch is quick, and batches decoded ahead would hold device memory through the script's
    evaluation between epochs), a packed pass, a remote dataset (its cache plans by pass) or a
    user's transform thread (it would take the next pass's batches early)."""
    o = options
    return (bool(o.image_fields) and o.device.type == "cpu" and o.pack is None and not remote
            and o.batch_transform is None and o.device_transform is None)


class EpochIterator:
    """One pass (see the module docstring). ``replan(iterator)``, if given, is called at the
    first ``next()``, before any batch is taken: it may :meth:`discard` this pass's requests and
    :meth:`restart` it over another plan (the Loader does, when the sampler was moved to another
    epoch since ``iter()``: a ``DataLoader`` reads its sampler only at the first ``next()``).
    ``source=None`` (with a ``replan``): nothing is requested until then (:attr:`waiting`)."""

    def __init__(self, plan: EpochPlan | PackPlan, source: BatchSource | None, *, prefetch: int, stats: Stats,
                 progress: Progress, fixed_size: bool = True, log_every: int | None = None,
                 on_position=None, ahead: Ahead | None = None, lookahead=None, replan=None,
                 owner: Any = None, keep=None) -> None:
        self._owner = owner  # the Loader: alive as long as one of its passes is iterated
        self._keep = keep  # (Ahead) -> None: what this pass requested, if it is dropped untouched (__del__)
        self._thread = threading.get_ident()
        self._ended: str | None = None  # why the pass ended before its data ran out (None: it did not)
        self._taken = 0  # batches handed over in this pass
        self._prefetch = prefetch
        self._half = prefetch // 2  # an amortizing source is refilled in runs of about this many
        self._stats = stats
        self._progress = progress
        self._fixed_size = fixed_size  # every batch of a row count has the same bytes
        self._log_every = log_every
        self._on_position = on_position  # a remote dataset's cache: evicts after last uses
        self._nbytes: dict[int, int] = {}  # batch bytes by row count
        self._replan = replan  # (this iterator) -> None, asked once, at the first next()
        self.closed = False
        self._generation = lifecycle.generation  # changes in a forked child (no syscall per batch)
        if source is None and ahead is None and replan is None:
            raise ValueError("a pass without a source needs a replan to give it one at its first next()")
        self.restart(plan, source, ahead=ahead, lookahead=lookahead)

    @property
    def plan(self) -> EpochPlan | PackPlan:
        return self._plan

    @property
    def waiting(self) -> bool:
        """Nothing requested yet: the pass waits for its first ``next()`` (and its ``replan``)."""
        return self._source is None and not self.closed

    def restart(self, plan: EpochPlan | PackPlan, source: BatchSource | None, *, ahead: Ahead | None = None,
                lookahead=None) -> None:
        """Begin the pass over ``plan``: from ``ahead``'s requests (and source) when it is that
        pass requested ahead, else from nothing on ``source`` (``None``: request nothing yet,
        see :attr:`waiting`). Called by ``__init__``, and by a ``replan`` after :meth:`discard`."""
        self._plan = plan
        self._batches = plan.requests() if ahead is None else ahead.batches
        self._source = source if ahead is None else ahead.source
        self._amortize = self._source is None or self._source.amortize
        self._pending: collections.deque = collections.deque(() if ahead is None else ahead.afters)
        self._done_sampling = ahead is not None and ahead.done
        self._lookahead = lookahead  # () -> the next pass's Ahead, or None (asked once)
        self._next: Ahead | None = None
        self._progress.position = plan.start
        self._stats.begin_epoch()
        if ahead is not None:
            self._stats.add("batches_ahead", len(ahead.afters))
        try:
            self._fill()
        except BaseException:
            self.close()
            raise

    def discard(self) -> None:
        """Drop this pass's requests before its first batch (its source joins its threads and
        drains what it was asked for), leaving the iterator open for :meth:`restart`."""
        if self._taken:
            raise RuntimeError("a pass that handed over batches cannot be discarded")
        self._pending.clear()
        self._done_sampling = True
        self._lookahead = None
        try:
            self._stats.end_epoch()
        finally:
            if self._source is not None:
                self._source.close()

    def follow(self, lookahead: Callable[[], Ahead | None] | None) -> None:
        """The look-ahead of a pass planned at ``iter()`` (as :meth:`restart`'s), given at its
        first ``next()``: a pass dropped before it never began the look-ahead's guess."""
        self._lookahead = lookahead

    def _fill(self) -> None:
        """Request batches up to ``prefetch`` in flight. ``__next__`` calls it only when at most
        half are left (``amortize``: refill in runs of about prefetch/2 batches, one call each)."""
        if self._done_sampling or self._source is None:
            return
        run, afters, self._done_sampling = _take_requests(self._batches, self._prefetch - len(self._pending))
        if run:
            self._source.put(run)
            self._pending.extend(afters)

    def _feed_next(self) -> None:
        """Request the next pass's first batches into the room this pass's last ones leave."""
        try:
            if self._next is None:
                lookahead, self._lookahead = self._lookahead, None
                self._next = lookahead()
                if self._next is None:
                    return
            room = self._prefetch - len(self._pending) - len(self._next.afters)
            if room > 0 and not self._next.done and not self._next.failed:
                self._next.fill(room)
        except Exception as e:  # not this pass's business: the next pass meets it again, as its own
            logger.debug("fastload: requesting the next pass ahead failed: %s", e)

    def __iter__(self) -> EpochIterator:
        return self

    def __next__(self) -> dict[str, Any]:
        if lifecycle.generation != self._generation:
            raise RuntimeError("this Loader iterator was created before os.fork(); its threads do not exist in "
                               "this process. Create a new fastload.Loader in the child process.")
        if self._ended is not None:
            raise PassEnded(self._ended)
        if self._replan is not None:
            self._first_next()
        if self.closed or not self._pending:
            finished = not self.closed
            self.close()
            if finished:  # the sampler marks the epoch complete (a dropped tail included)
                self._progress.position = self._plan.end
                if self._on_position is not None:
                    self._on_position(self._plan.end)
            raise StopIteration
        t0 = perf_counter()
        try:
            ready = self._source.get()
        except BaseException as e:
            self.close(f"this pass ended at its batch {self._taken + 1} with "
                       f"{type(e).__name__}: {e}; the batches after it were not delivered. Start a new pass "
                       "(iter(loader)), or load a state_dict to continue from the last batch delivered")
            raise
        try:  # from here until it counts as handed over (last), anything raised ends the pass
            t1 = perf_counter()
            pending = self._pending
            after = pending.popleft()
            if self._on_position is not None:  # a remote cache frees what only batches before `after`
                self._on_position(after)         # read, before the batches after it are requested (its
                # read-ahead room; were the hand-over to fail, a resume downloads again what it needs)
            # the batches after it (a Ctrl-C half way through a put leaves the source out of step)
            if not self._done_sampling and (len(pending) <= self._half or not self._amortize):
                self._fill()
            if self._done_sampling and (self._next is not None or self._lookahead is not None):
                self._feed_next()
            batch = ready.batch
            n = len(ready.index)
            nbytes = self._nbytes.get(n) if self._fixed_size else None
            if nbytes is None:  # fixed per row count unless variable-length fields are delivered
                nbytes = sum(int(v.element_size() * v.nelement()) for v in batch.values()
                             if hasattr(v, "element_size"))
                if self._fixed_size:
                    self._nbytes[n] = nbytes
            batches = self._stats.delivered(n, nbytes, t1 - t0, t1)
            if self._log_every and batches % self._log_every == 0:
                s = self._stats.snapshot()
                logger.info("fastload: %d batches, %.0f samples/s, waiting %.1f%% of the time%s",
                            s["batches"], s["samples_per_s"], 100 * s["wait_fraction"], _download_line(s))
            self._progress.position = after
            self._taken += 1
        except BaseException as e:
            if self._ended is None:
                self._ended = (f"this pass ended at its batch {self._taken + 1}: handing it over (and requesting "
                               f"the batches after it) failed with {type(e).__name__}: {e}; that batch and the ones "
                               "after it were not delivered. Start a new pass (iter(loader)), or load a state_dict "
                               "to continue from the last batch delivered")
            self.close()
            raise
        return batch

    def _first_next(self) -> None:
        """Ask ``replan`` (once) whether this pass still stands; an error there ends the pass."""
        replan, self._replan = self._replan, None
        if self.closed:
            return
        try:
            replan(self)
        except BaseException as e:
            self._ended = (f"planning this pass at its first next() failed with {type(e).__name__}: {e}; "
                           "start a new pass (iter(loader))")
            self.close()
            raise

    def close(self, reason: str | None = None) -> None:
        """End this pass: stats stop their clock, the source joins its threads and drains
        (in a forked child, whose copy of the source has no threads: nothing). ``reason``:
        why a pass whose data had not run out ended; every later ``next()`` raises it."""
        if reason is not None and self._ended is None and not self.closed and (self._pending or self.waiting):
            self._ended = reason
        if self.closed:
            return
        self.closed = True
        self._owner = None
        self._lookahead = None
        self._replan = None
        if lifecycle.generation != self._generation:
            return
        self._pending.clear()
        try:
            self._stats.end_epoch()
        finally:  # (a Ctrl-C in between: what it requested must not stay in the feeder)
            if self._source is not None:
                self._source.close()

    def _leave_requests(self) -> bool:
        """Dropped before its first ``next()``, in the thread that made it: hand what it
        requested to ``keep`` (an :class:`Ahead`, the source still running) instead of dropping
        it. True when it did."""
        if (self._keep is None or self.closed or self._taken or self._source is None or not self._pending
                or lifecycle.generation != self._generation or threading.get_ident() != self._thread):
            return False
        ahead = Ahead(self._plan, self._source, batches=self._batches, afters=self._pending,
                      done=self._done_sampling)
        try:
            self._keep(ahead)  # first: held by the slot (or closed), never left in the feeder unowned
        except BaseException:
            ahead.close()  # (if the slot holds it: closed, it is never taken over)
            raise
        self._source = None  # the Ahead's now: close() leaves it running
        self.close()
        return True

    def __del__(self):
        try:
            if not self._leave_requests():
                self.close()
        except Exception:
            pass

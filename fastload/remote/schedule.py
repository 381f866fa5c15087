"""Which shards an epoch needs, when, and when each may be downloaded under a byte budget.

An epoch is read as a stream of global positions (see ``fastload.sampling``): after the
ranks together consumed ``C`` positions, every position below ``C`` is done on every rank.
For each shard the schedule keeps its **first** and **last** position of use in the epoch;
the order of first uses is the download order. Positions of consecutive passes over the
data are laid end to end on one axis ``T`` ("timeline"), the same on every rank of a node.

A shard is *required* from ``first - ahead`` (the reader asks for shards ``ahead``
positions before it reports them consumed: its prefetch) until ``last`` (inclusive). The
smallest budget that lets the reader go on is the largest total size of shards required at
the same moment (:func:`minimum_budget`): with less, a shard the reader waits for can only
get room when the reader moves on: a deadlock, refused up front (:class:`CacheTooSmall`).

Admission (:func:`admission_times`) walks the uses in first-use order and gives each the
earliest ``T`` at which it fits next to the uses admitted before it that are still required
then. It is strictly in order (a later shard never takes the room of an earlier one, the
deadlock "admit whatever fits" runs into) and, with a budget of at least the minimum, every
shard is admitted by the time it is required.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from ..sampling import RankBatches, Stream, per_rank_count

__all__ = ["EpochUses", "PackScan", "PassScan", "epoch_end", "epoch_uses", "pack_uses", "plan_scan", "plan_uses", "sampler_scan",
           "sampler_uses", "minimum_budget", "admission_times", "token_uses"]


@dataclass(frozen=True)
class EpochUses:
    """The shards one pass reads: ``shards[j]`` is first used at position ``first[j]`` and
    last at ``last[j]`` (positions of the epoch's stream, ``start <= first <= last < end``),
    sorted by ``first``."""

    epoch: int
    start: int
    end: int
    shards: np.ndarray
    first: np.ndarray
    last: np.ndarray

    def __len__(self) -> int:
        return len(self.shards)

    def same_as(self, other: EpochUses | None) -> bool:
        return (other is not None and self.epoch == other.epoch and self.start == other.start
                and self.end == other.end and np.array_equal(self.shards, other.shards)
                and np.array_equal(self.first, other.first) and np.array_equal(self.last, other.last))


def epoch_end(stream_len: int, *, world_size: int, batch_size: int, drop_last: bool = False,
              drop_last_batch: bool = False, start: int = 0) -> int:
    """The global position after the last one the ranks read this pass (padding included:
    positions ``>= stream_len`` wrap around to the stream's start)."""
    if drop_last_batch:
        b = RankBatches(start, stream_len, world_size, 0, batch_size, drop_last, True)  # O(1): not a list
        return b[-1][2] if len(b) else start
    return start + per_rank_count(stream_len - start, world_size, drop_last) * world_size


SCAN = 1 << 18  # stream positions (or documents) per step of a pass's scan: a few MB of arrays


def _shard_of(starts: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """``idx -> shard`` for global sample indices (vectorised): a division when every shard
    but the last has the same number of samples (the last no more), else a binary search."""
    sizes = np.diff(starts)
    if len(sizes) and sizes[0] > 0 and np.all(sizes[:-1] == sizes[0]) and 0 < sizes[-1] <= sizes[0]:
        per = int(sizes[0])
        return lambda idx: idx // per
    return lambda idx: np.searchsorted(starts, idx, side="right") - 1


def _uses(epoch: int, start: int, end: int, first: np.ndarray, last: np.ndarray) -> EpochUses:
    used = np.flatnonzero(last >= 0)
    order = used[np.argsort(first[used], kind="stable")]
    return EpochUses(int(epoch), int(start), int(end), order.astype(np.int64), first[order], last[order])


def _empty(nshards: int) -> tuple[np.ndarray, np.ndarray]:
    return np.full(nshards, np.iinfo(np.int64).max, dtype=np.int64), np.full(nshards, -1, dtype=np.int64)


class PassScan:
    """The first-use schedule of positions ``start..end-1`` of ``stream`` (see
    :func:`epoch_uses`), computed as far as it has been scanned: :meth:`step` scans the next
    positions (``chunk`` at a time: a few MB of arrays, whatever the pass's length), and
    :meth:`uses` says what is known, so a cache can start on a long pass before its scan is
    over.

    Known after scanning up to ``horizon``: every shard first used before it, in first-use
    order, with its exact first use (later steps only add shards after them). Its last use
    is exact once the scan is past ``bound[shard]``, the position from which the order's
    structure says it is read no more (``shuffle_mode="window"``: the end of its window; the
    natural order: the end of the shard; otherwise: the end of the pass), and until then
    taken as ``bound - 1`` (:meth:`uses`: no later than that; a cache planned with it keeps a
    shard no shorter than it must, admits no download earlier than the exact schedule would,
    and its admissions only move earlier as the scan goes on) or as the last use seen
    (:meth:`seen`: no earlier than that; what the budget needs at least)."""

    def __init__(self, stream: Stream | np.ndarray, shard_starts: np.ndarray, *, epoch: int = 0, start: int = 0,
                 end: int | None = None, chunk: int = SCAN) -> None:
        from ..sampling.order import Natural

        self.stream = stream
        self.m = m = len(stream)
        self.epoch, self.start = int(epoch), int(start)
        self.end = m if end is None else int(end)
        self.chunk = int(chunk)
        self.starts = np.asarray(shard_starts, dtype=np.int64)
        self.first, self.last = _empty(len(self.starts) - 1)
        self._array = None if isinstance(stream, Stream) else np.asarray(stream)
        self._shard_of = _shard_of(self.starts)
        self.horizon = self.start
        if isinstance(stream, Natural):  # position p reads sample p: each shard's positions are its own samples
            if m > 0:  # each shard one "document" of its samples
                _fold(self.first, self.last, np.arange(len(self.starts) - 1, dtype=np.int64), self.starts, m,
                      self.start, self.end)
            self.horizon = max(self.start, self.end)
        self.bound = self._bounds()

    @property
    def done(self) -> bool:
        return self.horizon >= self.end

    def _indices(self, a: int, b: int) -> np.ndarray:
        m = self.m
        wraps = a >= m or b > m  # padding: positions past the stream read its start again
        if self._array is None:
            pos = np.arange(a, b, dtype=np.int64)
            return self.stream.at(pos % m if wraps else pos)  # type: ignore[union-attr]
        return self._array[np.arange(a, b) % m] if wraps else self._array[a:b]

    def step(self, positions: int | None = None) -> None:
        """Scan the next ``positions`` positions (None: to the end of the pass)."""
        stop = self.end if positions is None else min(self.end, self.horizon + int(positions))
        for a in range(self.horizon, stop, self.chunk):
            b = min(stop, a + self.chunk)
            sh = self._shard_of(np.asarray(self._indices(a, b), dtype=np.int64))
            pos = np.arange(a, b, dtype=np.int64)
            np.minimum.at(self.first, sh, pos)  # (positions ascend: the first chunk a shard is in sets its first use)
            np.maximum.at(self.last, sh, pos)
            self.horizon = b

    def _bounds(self) -> np.ndarray:
        """Per shard, a position from which the pass reads it no more (see the class
        docstring): the end of its window in ``shuffle_mode="window"``, else the pass's end."""
        wend = _window_ends(self.stream, self.starts)
        bound = np.full(len(self.starts) - 1, self.end, dtype=np.int64)
        if wend is not None:
            np.minimum(wend, self.end, out=bound)
            if self.end > self.m:  # the padding reads the stream's first positions again, past its end
                again = np.unique(self._shard_of(np.asarray(self._indices(self.m, self.end), dtype=np.int64)))
                bound[again] = self.end
        return bound

    def uses(self) -> EpochUses:
        """What is known so far, each last use no later than it can be (the class docstring)."""
        if self.done:
            return _uses(self.epoch, self.start, self.end, self.first, self.last)
        last = np.where(self.last < 0, -1, np.where(self.horizon >= self.bound, self.last, self.bound - 1))
        return _uses(self.epoch, self.start, self.end, self.first, last)

    def seen(self) -> EpochUses:
        """What is known so far, each last use the last one seen (no later than the true one)."""
        return _uses(self.epoch, self.start, self.end, self.first, self.last)


def _window_ends(stream: Any, starts: np.ndarray) -> np.ndarray | None:
    """Per shard, the stream position where its window ends (it is read at no position from
    there to the stream's end) when ``stream`` is a window order over these shards; else None."""
    from ..sampling.order import Windowed

    ns = len(starts) - 1
    sizes = np.diff(starts)
    if not (isinstance(stream, Windowed) and len(stream.order) == ns
            and np.array_equal(np.asarray(getattr(stream, "_sizes", ()), np.int64), sizes)):
        return None
    ocum = np.zeros(ns + 1, np.int64)  # where each shard of the reading order begins
    np.cumsum(sizes[stream.order], out=ocum[1:])
    rank = np.arange(ns)
    out = np.empty(ns, np.int64)
    out[stream.order] = ocum[np.minimum((rank // stream.window + 1) * stream.window, ns)]
    return out


def epoch_uses(stream: Stream | np.ndarray, shard_starts: np.ndarray, *, epoch: int = 0, start: int = 0,
               end: int | None = None, chunk: int = SCAN) -> EpochUses:
    """First and last use of every shard read by positions ``start..end-1`` of ``stream``
    (position ``p`` reads ``stream[p % len(stream)]``). ``shard_starts``: the cumulative
    sample counts (length num_shards + 1). ``stream``: a per-position
    :class:`~fastload.sampling.Stream` (never materialised: its positions are computed
    ``chunk`` at a time) or an array. Memory: a few integers per shard and ``chunk``
    positions' arrays, whatever the pass's length; the natural order costs nothing per
    position. (A :class:`PassScan` scanned to the end.)"""
    scan = PassScan(stream, shard_starts, epoch=epoch, start=start, end=end, chunk=chunk)
    scan.step()
    return scan.uses()


def sampler_scan(sampler, shard_starts: np.ndarray, *, epoch: int | None = None, start: int | None = None,
                 chunk: int = SCAN) -> PassScan:
    """The :class:`PassScan` of a :class:`fastload.Sampler`'s pass (its epoch and resume
    position unless given), over its per-position order (never its stream materialised);
    nothing scanned yet."""
    e = sampler.epoch if epoch is None else int(epoch)
    s = (sampler.start_position() if e == sampler.epoch else 0) if start is None else int(start)
    end = epoch_end(sampler.stream_len, world_size=sampler.world_size, batch_size=sampler.batch_size,
                    drop_last=sampler.drop_last, drop_last_batch=sampler.drop_last_batch, start=s)
    return PassScan(sampler.order_stream(e), shard_starts, epoch=e, start=s, end=end, chunk=chunk)


def sampler_uses(sampler, shard_starts: np.ndarray, *, epoch: int | None = None, start: int | None = None) -> EpochUses:
    """:func:`epoch_uses` for a :class:`fastload.Sampler`'s pass (its epoch and resume
    position unless given), from its per-position order (never its stream materialised)."""
    scan = sampler_scan(sampler, shard_starts, epoch=epoch, start=start)
    scan.step()
    return scan.uses()


def plan_scan(plan, shard_starts: np.ndarray, chunk: int = SCAN) -> PassScan:
    """The :class:`PassScan` of a :class:`fastload.sampling.EpochPlan` (one rank's pass): the
    positions every rank of the job reads in it (all ranks step together)."""
    end = plan.bounds[-1][2] if plan.bounds else plan.start
    return PassScan(plan.stream, shard_starts, epoch=plan.epoch, start=plan.start, end=end, chunk=chunk)


def plan_uses(plan, shard_starts: np.ndarray) -> EpochUses:
    """:func:`epoch_uses` of a :class:`fastload.sampling.EpochPlan` (one rank's pass): the
    positions every rank of the job reads in it (all ranks step together)."""
    end = plan.bounds[-1][2] if plan.bounds else plan.start
    return epoch_uses(plan.stream, shard_starts, epoch=plan.epoch, start=plan.start, end=end)


def token_uses(stream: np.ndarray, cum: np.ndarray, shard_starts: np.ndarray, *, epoch: int = 0, start: int = 0,
               end: int | None = None) -> EpochUses:
    """:func:`epoch_uses` of a packed pass, whose positions count tokens: document ``j`` of
    ``stream`` holds tokens ``cum[j]..cum[j+1]-1`` of the token stream (positions past
    ``cum[-1]`` wrap around), and a shard is used from the first to the last token of its
    documents that positions ``start..end-1`` read. Vectorised over documents (one step per
    wrap-around), never over tokens."""
    stream = np.asarray(stream, dtype=np.int64)
    cum = np.asarray(cum, dtype=np.int64)
    total = int(cum[-1]) if len(cum) else 0
    end = total if end is None else int(end)
    starts = np.asarray(shard_starts, dtype=np.int64)
    first, last = _empty(len(starts) - 1)
    if total > 0 and end > start:
        _fold(first, last, _shard_of(starts)(stream), cum, total, start, end)
    return _uses(epoch, start, end, first, last)


def _fold(first: np.ndarray, last: np.ndarray, shard_of_docs: np.ndarray, cum: np.ndarray, total: int, start: int,
          end: int) -> None:
    """Fold into ``first`` / ``last`` (per shard) the uses, by positions ``start..end-1`` of a
    token stream of ``total`` tokens (positions past it wrap around, any number of times),
    of some consecutive documents of the stream: the ``j``-th holds tokens
    ``cum[j]..cum[j+1]-1`` (absolute: ``cum`` has one entry more than ``shard_of_docs``) and
    belongs to shard ``shard_of_docs[j]``. One step per wrap-around, vectorised over the
    documents, never over tokens."""
    if end <= start or len(shard_of_docs) == 0:
        return
    c0, c1 = int(cum[0]), int(cum[-1])
    for k in range(start // total, (end - 1) // total + 1):  # each pass of the stream the range touches
        lo, hi = max(start - k * total, c0), min(end - k * total, c1)
        if hi <= lo:
            continue
        d0 = int(np.searchsorted(cum, lo, side="right")) - 1
        d1 = int(np.searchsorted(cum, hi, side="left"))
        docs = np.arange(max(d0, 0), min(d1, len(shard_of_docs)), dtype=np.int64)
        docs = docs[cum[docs + 1] > cum[docs]]  # empty documents are read by no token
        if not len(docs):
            continue
        np.minimum.at(first, shard_of_docs[docs], np.maximum(cum[docs], lo) + k * total)
        np.maximum.at(last, shard_of_docs[docs], np.minimum(cum[docs + 1], hi) - 1 + k * total)


class PackScan:
    """The :class:`PassScan` of a packed pass (a :class:`fastload.sampling.packing.PackPlan`,
    one rank's: the tokens every rank of the job reads in it), whose positions count tokens:
    read from its token stream's chunks of documents, one chunk per step at least (never the
    epoch's documents or token counts materialised), in the order of the positions (a pass
    past the stream's end reads its first documents again after the others).

    The same guarantees as :class:`PassScan`'s: after scanning up to ``horizon`` (every
    position before it), every shard first used before it, in first-use order, with its exact
    first use. Its last use is exact once the scan is past the last document of its window
    (``shuffle_mode="window"``) or of the shard (the natural order) and no later position
    reads it again; until then :meth:`uses` takes it as the pass's last position."""

    def __init__(self, plan: Any, shard_starts: np.ndarray) -> None:
        from ..sampling.order import Natural

        self.epoch, self.start = int(plan.epoch), int(plan.start)
        self.end = int(plan.bounds[-1][2]) if len(plan.bounds) else self.start
        self.starts = np.asarray(shard_starts, dtype=np.int64)
        ns = len(self.starts) - 1
        self.first, self.last = _empty(ns)
        self._shard_of = _shard_of(self.starts)
        self._tokens, self._total = plan.tokens, int(plan.total)
        total, lo, hi = self._total, self.start, self.end
        # the passes over the stream the positions make: (k, first, end position), in order
        self._segments = [] if total <= 0 or hi <= lo else [
            (k, max(lo, k * total), min(hi, (k + 1) * total)) for k in range(lo // total, (hi - 1) // total + 1)]
        self.horizon = self.start if self._segments else max(self.start, self.end)
        stream = plan.tokens.stream
        ends = _window_ends(stream, self.starts)
        if ends is None and isinstance(stream, Natural) and len(stream) == int(self.starts[-1]):
            ends = self.starts[1:].copy()  # each shard's documents one after the other
        self._doc_end = ends  # per shard, the stream position (documents) after which it is not read
        self._docs = 0  # documents of the first segment scanned (stream positions before this one)
        self._closed = np.zeros(ns, bool)  # shards the first segment reads no more and no later one reads
        self._again: np.ndarray | None = None
        self._walk = self._chunks()

    @property
    def done(self) -> bool:
        return self.horizon >= self.end

    def _chunks(self) -> Iterator[tuple[int, int, int, int, np.ndarray, np.ndarray]]:
        for k, a, b in self._segments:
            for d0, idx, cum in self._tokens.doc_chunks(a - k * self._total, b - k * self._total):
                yield k, a, b, d0, idx, cum

    def _read_again(self) -> np.ndarray:
        """The shards read by the segments after the first (the padding's documents): their
        last use is known at the end only (every shard when that is a stream or more)."""
        ns = len(self.starts) - 1
        rest = self._segments[1:]
        if sum(b - a for _, a, b in rest) >= self._total:
            return np.ones(ns, bool)
        again = np.zeros(ns, bool)
        for k, a, b in rest:
            lo, hi = a - k * self._total, b - k * self._total
            for _, idx, cum in self._tokens.doc_chunks(lo, hi):
                read = (cum[:-1] < hi) & (cum[1:] > lo)  # the documents with a token in lo..hi-1
                again[self._shard_of(idx[read])] = True
        return again

    def step(self, positions: int | None = None) -> None:
        """Scan on to ``positions`` positions (tokens) past the horizon at least, a chunk of
        documents at a time (None: to the end of the pass)."""
        stop = self.end if positions is None else min(self.end, self.horizon + int(positions))
        if self._again is None and self._doc_end is not None and self._segments:
            self._again = self._read_again()
        while self.horizon < stop:
            try:
                k, a, b, d0, idx, cum = next(self._walk)
            except StopIteration:
                self.horizon = self.end
                break
            _fold(self.first, self.last, self._shard_of(idx), cum, self._total, a, b)
            self.horizon = max(self.horizon, min(b, k * self._total + int(cum[-1])))
            if k == self._segments[0][0]:
                self._docs = d0 + len(idx)
            if self._doc_end is not None:
                past = self._doc_end <= self._docs if k == self._segments[0][0] else np.ones(len(self._closed), bool)
                self._closed = past & ~self._again  # type: ignore[operator]

    def uses(self) -> EpochUses:
        """What is known so far, each last use no later than it can be (the class docstring)."""
        if self.done:
            return _uses(self.epoch, self.start, self.end, self.first, self.last)
        last = np.where(self.last < 0, -1, np.where(self._closed, self.last, self.end - 1))
        return _uses(self.epoch, self.start, self.end, self.first, last)

    def seen(self) -> EpochUses:
        """What is known so far, each last use the last one seen (no later than the true one)."""
        return _uses(self.epoch, self.start, self.end, self.first, self.last)


def pack_uses(plan, shard_starts: np.ndarray) -> EpochUses:
    """:func:`token_uses` of a :class:`fastload.sampling.packing.PackPlan` (one rank's pass): the
    tokens every rank of the job reads in it (all ranks step together), read from its token
    stream's chunks (never the epoch's documents or token counts materialised). (A
    :class:`PackScan` scanned to the end.)"""
    scan = PackScan(plan, shard_starts)
    scan.step()
    return scan.uses()


def _merged_intervals(shards: np.ndarray, lo: np.ndarray, hi: np.ndarray):
    """Per shard, the union of its [lo, hi] intervals: (shard, lo, hi) arrays."""
    if not len(shards):
        return shards, lo, hi
    order = np.lexsort((lo, shards))
    s, a, b = shards[order], lo[order], hi[order]
    out_s, out_a, out_b = [], [], []
    cs, ca, cb = int(s[0]), int(a[0]), int(b[0])
    for x, y, z in zip(s[1:].tolist(), a[1:].tolist(), b[1:].tolist()):
        if x == cs and y <= cb + 1:
            cb = max(cb, z)
        else:
            out_s.append(cs), out_a.append(ca), out_b.append(cb)
            cs, ca, cb = x, y, z
    out_s.append(cs), out_a.append(ca), out_b.append(cb)
    return np.array(out_s, np.int64), np.array(out_a, np.int64), np.array(out_b, np.int64)


def minimum_budget(shards: np.ndarray, first: np.ndarray, last: np.ndarray, sizes: np.ndarray,
                   ahead: int = 0) -> tuple[int, int]:
    """``(bytes, T)``: the largest total size of shards required at one moment ``T`` (a
    shard is required on ``[first - ahead, last]``), and that moment."""
    if not len(shards):
        return 0, 0
    s, a, b = _merged_intervals(np.asarray(shards, np.int64), np.asarray(first, np.int64) - int(ahead),
                                np.asarray(last, np.int64))
    sz = np.asarray(sizes, np.int64)[s]
    t = np.concatenate([a, b + 1])
    d = np.concatenate([sz, -sz])
    order = np.lexsort((d, t))  # at equal T, releases (negative) before admissions
    run = np.cumsum(d[order])
    k = int(np.argmax(run))
    return int(run[k]), int(t[order][k])


def admission_times(shards: np.ndarray, first: np.ndarray, last: np.ndarray, sizes: np.ndarray,
                    limit: int, t0: int) -> np.ndarray:
    """The earliest ``T >= t0`` at which each use (in the given, first-use, order) may be
    downloaded: it fits in ``limit`` beside the earlier uses still required at ``T``
    (required until ``last``), and no earlier than the use before it. A use of a shard that
    is still resident from an earlier use costs nothing."""
    n = len(shards)
    out = np.empty(n, dtype=np.int64)
    sizes = np.asarray(sizes, np.int64)
    until: dict[int, int] = {}     # resident shard -> last T it is required
    heap: list[tuple[int, int]] = []
    live = 0
    t = int(t0)

    def release_before(t_now: int) -> None:
        nonlocal live
        while heap and heap[0][0] < t_now:
            u_end, s_ = heapq.heappop(heap)
            if until.get(s_) == u_end:
                del until[s_]
                live -= int(sizes[s_])

    for j in range(n):
        s = int(shards[j])
        release_before(t)
        if s in until:
            out[j] = t
            if int(last[j]) > until[s]:
                until[s] = int(last[j])
                heapq.heappush(heap, (until[s], s))
            continue
        size = int(sizes[s])
        while live + size > limit and heap:
            t = max(t, heap[0][0] + 1)
            release_before(t)
        out[j] = t
        until[s] = int(last[j])
        heapq.heappush(heap, (until[s], s))
        live += size
    return out

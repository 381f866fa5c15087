"""An epoch's plan: its stream (:func:`epoch_order` picks the kind of order), the ranks'
shares of it in global steps (:func:`per_rank_count`, :class:`RankBatches`), and one rank's
pass as a value (:class:`EpochPlan`). Nothing here holds anything per sample or per batch:
a pass's batches and their indices are computed as they are asked for."""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from .draws import weighted_draws
from .order import CHUNK, FIRST_CHUNK, Balanced, Drawn, Natural, Shuffled, Stream, Weighted, Windowed
from .tables import balance_table, weight_table


def per_rank_count(remaining: int, world_size: int, drop_last: bool) -> int:
    """Samples each rank reads from ``remaining`` stream positions (DistributedSampler's rule)."""
    if remaining <= 0:
        return 0
    return remaining // world_size if drop_last else -(-remaining // world_size)


class RankBatches(Sequence):
    """This rank's batches when the stream positions ``start..stream_len-1`` are split over
    ``world_size`` ranks, as a sequence of ``(begin, end, consumed_after)`` computed per
    batch (O(1) memory at any number of batches): ``begin..end-1`` are stream positions
    (``>= stream_len`` means wrapped-around padding) and ``consumed_after`` is the global
    consumed count once every rank has read that step."""

    def __init__(self, start: int, stream_len: int, world_size: int, rank: int, batch_size: int,
                 drop_last: bool, drop_last_batch: bool = False) -> None:
        self.args = (int(start), int(stream_len), int(world_size), int(rank), int(batch_size), bool(drop_last),
                     bool(drop_last_batch))
        per = per_rank_count(stream_len - start, world_size, drop_last)
        self.full, self.rem = divmod(per, batch_size)  # full steps, then one shorter step (the same on every rank)
        self._n = self.full + (1 if self.rem and not drop_last_batch else 0)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, k):
        if isinstance(k, slice):
            return tuple(self[i] for i in range(*k.indices(self._n)))
        k = int(k)
        if k < 0:
            k += self._n
        if not 0 <= k < self._n:
            raise IndexError(f"batch {k} of a pass of {self._n} batches")
        start, _, world, rank, batch, _, _ = self.args
        step = batch * world
        if k < self.full:
            s0 = start + k * step
            return (s0 + rank * batch, s0 + (rank + 1) * batch, s0 + step)
        last = start + self.full * step
        return (last + rank * self.rem, last + (rank + 1) * self.rem, last + self.rem * world)

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        return (self[k] for k in range(self._n))

    def positions(self, k0: int, k1: int) -> tuple[np.ndarray, np.ndarray]:
        """The stream positions of batches ``k0..k1-1`` one after the other (int64, not yet
        wrapped), and where each batch's begin (``k1 - k0 + 1`` offsets)."""
        start, _, world, rank, batch, _, _ = self.args
        f1 = min(k1, self.full)
        parts, sizes = [], []
        if k0 < f1:
            begins = start + np.arange(k0, f1, dtype=np.int64) * (batch * world) + rank * batch
            parts.append((begins[:, None] + np.arange(batch, dtype=np.int64)).ravel())
            sizes += [batch] * (f1 - k0)
        if k1 > self.full and k0 <= self.full < self._n:
            b, e, _ = self[self.full]
            parts.append(np.arange(b, e, dtype=np.int64))
            sizes.append(e - b)
        offsets = np.zeros(len(sizes) + 1, np.int64)
        np.cumsum(sizes, out=offsets[1:])
        return (np.concatenate(parts) if parts else np.zeros(0, np.int64)), offsets

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RankBatches):
            return self.args == other.args or (len(self) == len(other) and list(self) == list(other))
        if isinstance(other, Sequence):
            return len(self) == len(other) and all(tuple(a) == tuple(b) for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"RankBatches({len(self)} batches, args={self.args})"


def rank_batch_bounds(start: int, stream_len: int, world_size: int, rank: int, batch_size: int,
                      drop_last: bool, drop_last_batch: bool = False) -> list[tuple[int, int, int]]:
    """:class:`RankBatches` as a list (see there)."""
    return list(RankBatches(start, stream_len, world_size, rank, batch_size, drop_last, drop_last_batch))


def epoch_order(num_samples: int, *, seed: int, epoch: int, shuffle: bool = True,
                weights: np.ndarray | None = None, replacement: bool = True, num_draws: int | None = None,
                balance_labels: np.ndarray | None = None, batch_size: int = 1,
                shuffle_mode: str = "full", shard_sizes: Sequence[int] | None = None,
                window: int = 1, table: tuple | None = None) -> Stream:
    """The epoch's stream of global sample indices as a :class:`~fastload.sampling.order.Stream`
    (see the package docstring): computed per position, except weighted draws without
    replacement (computed whole). ``table``: the :func:`~fastload.sampling.tables.weight_table`
    of ``weights`` or the :func:`~fastload.sampling.tables.balance_table` of
    ``balance_labels``, when the caller keeps it across epochs."""
    m = num_samples if num_draws is None else num_draws
    if balance_labels is not None:
        return Balanced(balance_table(balance_labels) if table is None else table, m, batch_size, seed, epoch)
    if weights is not None and replacement:
        return Weighted(weight_table(weights) if table is None else table, m, seed, epoch)
    if weights is not None:
        return Drawn(weighted_draws(weights, m, replacement, seed, epoch), num_samples)
    if not shuffle:
        return Natural(num_samples)
    if shuffle_mode == "window":
        return Windowed(shard_sizes, window, seed, epoch)
    return Shuffled(num_samples, seed, epoch)


def epoch_stream(num_samples: int, *, seed: int, epoch: int, shuffle: bool = True,
                 weights: np.ndarray | None = None, replacement: bool = True, num_draws: int | None = None,
                 balance_labels: np.ndarray | None = None, batch_size: int = 1,
                 shuffle_mode: str = "full", shard_sizes: Sequence[int] | None = None,
                 window: int = 1) -> np.ndarray:
    """The epoch's stream of global sample indices materialised (:func:`epoch_order` as an
    array: ``M`` indices)."""
    return np.asarray(epoch_order(num_samples, seed=seed, epoch=epoch, shuffle=shuffle, weights=weights,
                                  replacement=replacement, num_draws=num_draws, balance_labels=balance_labels,
                                  batch_size=batch_size, shuffle_mode=shuffle_mode, shard_sizes=shard_sizes,
                                  window=window))


@dataclass(frozen=True)
class EpochPlan:
    """One rank's pass over an epoch, as a value: what a loader iterates, with no reference
    back to the :class:`Sampler`.

    ``stream`` is the epoch's stream (identical on every rank; a
    :class:`~fastload.sampling.order.Stream`, computed per position: an array passed here is
    wrapped), ``bounds`` this rank's batches as ``(begin, end, consumed_after)`` stream
    positions (positions past the stream wrap around: ``DistributedSampler``'s padding;
    a :class:`RankBatches`, computed per batch), ``start`` the global consumed count the pass
    begins at (a resumed position, or 0). The indices of a batch are computed when it is
    asked for, with those of the next batches (twice as many each time the pass reads on, up
    to :data:`~fastload.sampling.order.CHUNK` positions: one vectorised call; the only memory
    a pass holds)."""

    epoch: int
    start: int
    stream: Stream
    bounds: Sequence[tuple[int, int, int]]
    _chunk: list = field(default_factory=lambda: [None], init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.stream, Stream):
            object.__setattr__(self, "stream", Drawn(np.asarray(self.stream)))

    def __len__(self) -> int:
        return len(self.bounds)

    @property
    def end(self) -> int:
        """The consumed count once the pass is complete: the epoch is then over (a tail
        dropped by ``drop_last`` included), so a state saved here resumes to nothing."""
        last = self.bounds[-1][2] if len(self.bounds) else self.start
        return max(last, len(self.stream))

    def same_pass(self, other: object) -> bool:
        """True when ``other`` is a plan of the very same pass: the same epoch, start, batches
        and stream (the same stream, or equal values)."""
        if not isinstance(other, EpochPlan):
            return False
        return (self.epoch == other.epoch and self.start == other.start and self.bounds == other.bounds
                and (self.stream is other.stream or self.stream.same(other.stream)))

    def indices(self, k: int) -> np.ndarray:
        """Global sample indices (int64) of this rank's ``k``-th batch."""
        if not isinstance(self.bounds, RankBatches):
            b, e, _ = self.bounds[k]
            return self.stream.at(np.arange(b, e, dtype=np.int64) % len(self.stream))
        got = self._chunk[0]
        if got is None or not got[0] <= k < got[1]:
            # FIRST_CHUNK positions first (the first batch comes at once: a call's cost is
            # numpy's per-call overhead up to there), then twice as many each time a pass
            # reads on, up to CHUNK positions
            batch = self.bounds.args[4]
            most = max(1, CHUNK // batch)
            want = min(most, 2 * (got[1] - got[0])) if got is not None and k == got[1] else max(1, FIRST_CHUNK // batch)
            k1 = min(len(self.bounds), k + want)
            pos, offsets = self.bounds.positions(k, k1)
            m = len(self.stream)
            if pos.size and int(pos[-1]) >= m:
                pos %= m  # padding: wrap around
            got = (k, k1, self.stream.at(pos), offsets)
            self._chunk[0] = got
        k0, _, idx, offsets = got
        return idx[offsets[k - k0]:offsets[k - k0 + 1]].copy()
    def __iter__(self) -> Iterator[tuple[np.ndarray, int]]:
        """``(indices, consumed_after)`` per batch, in order."""
        for k, (_, _, after) in enumerate(self.bounds):
            yield self.indices(k), after

    def requests(self):
        """``(Request, consumed_after)`` per batch: the indices with the batch's stream
        position (what a loader hands its source; see fastload.sampling.packing.Request)."""
        from .packing import Request

        for k, (b, _, after) in enumerate(self.bounds):
            yield Request(self.indices(k), b), after

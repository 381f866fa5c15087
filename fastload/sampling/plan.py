"""An epoch's plan: its stream (:func:`epoch_stream` picks the kind of order), the ranks'
shares of it in global steps (:func:`per_rank_count`, :func:`rank_batch_bounds`), and one
rank's pass as a value (:class:`EpochPlan`)."""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from .draws import balanced_draws, weighted_draws
from .streams import _index_dtype, permutation, window_permutation


def per_rank_count(remaining: int, world_size: int, drop_last: bool) -> int:
    """Samples each rank reads from ``remaining`` stream positions (DistributedSampler's rule)."""
    if remaining <= 0:
        return 0
    return remaining // world_size if drop_last else -(-remaining // world_size)


def rank_batch_bounds(start: int, stream_len: int, world_size: int, rank: int, batch_size: int,
                      drop_last: bool, drop_last_batch: bool = False) -> list[tuple[int, int, int]]:
    """This rank's batches when the stream positions ``start..stream_len-1`` are split over
    ``world_size`` ranks: a list of ``(begin, end, consumed_after)``, where ``begin..end-1``
    are stream positions (``>= stream_len`` means wrapped-around padding) and
    ``consumed_after`` is the global consumed count once every rank has read that step."""
    per = per_rank_count(stream_len - start, world_size, drop_last)
    full, rem = divmod(per, batch_size)  # full steps, then one shorter step (the same on every rank)
    out: list[tuple[int, int, int]] = []
    if full:  # (then batch_size * world_size <= about stream_len: int64 holds every position)
        step0 = start + np.arange(full, dtype=np.int64) * (batch_size * world_size)  # vectorised: 10^5 steps in ~1 ms
        begin = step0 + rank * batch_size
        out = list(zip(begin.tolist(), (begin + batch_size).tolist(), (step0 + batch_size * world_size).tolist()))
    if rem and not drop_last_batch:
        last = start + full * batch_size * world_size
        out.append((last + rank * rem, last + (rank + 1) * rem, last + rem * world_size))
    return out


def epoch_stream(num_samples: int, *, seed: int, epoch: int, shuffle: bool = True,
                 weights: np.ndarray | None = None, replacement: bool = True, num_draws: int | None = None,
                 balance_labels: np.ndarray | None = None, batch_size: int = 1,
                 shuffle_mode: str = "full", shard_sizes: Sequence[int] | None = None,
                 window: int = 1) -> np.ndarray:
    """The epoch's stream of global sample indices (see the module docstring)."""
    m = num_samples if num_draws is None else num_draws
    if balance_labels is not None:
        return balanced_draws(balance_labels, m, batch_size, seed, epoch)
    if weights is not None:
        return weighted_draws(weights, m, replacement, seed, epoch)
    if not shuffle:
        return np.arange(num_samples, dtype=_index_dtype(num_samples))
    if shuffle_mode == "window":
        return window_permutation(shard_sizes, window, seed, epoch)
    return permutation(num_samples, seed, epoch)


@dataclass(frozen=True)
class EpochPlan:
    """One rank's pass over an epoch, as a value: what a loader iterates, with no reference
    back to the :class:`Sampler`.

    ``stream`` is the epoch's full stream (identical on every rank), ``bounds`` this rank's
    batches as ``(begin, end, consumed_after)`` stream positions (positions past the stream
    wrap around: ``DistributedSampler``'s padding), ``start`` the global consumed count the
    pass begins at (a resumed position, or 0)."""

    epoch: int
    start: int
    stream: np.ndarray
    bounds: tuple[tuple[int, int, int], ...]

    def __len__(self) -> int:
        return len(self.bounds)

    @property
    def end(self) -> int:
        """The consumed count once the pass is complete: the epoch is then over (a tail
        dropped by ``drop_last`` included), so a state saved here resumes to nothing."""
        last = self.bounds[-1][2] if self.bounds else self.start
        return max(last, len(self.stream))

    def same_pass(self, other: object) -> bool:
        """True when ``other`` is a plan of the very same pass: the same epoch, start, batches
        and stream (the same array, or equal values)."""
        if not isinstance(other, EpochPlan):
            return False
        return (self.epoch == other.epoch and self.start == other.start and self.bounds == other.bounds
                and (self.stream is other.stream or np.array_equal(self.stream, other.stream)))

    def indices(self, k: int) -> np.ndarray:
        """Global sample indices (int64) of this rank's ``k``-th batch."""
        b, e, _ = self.bounds[k]
        m = len(self.stream)
        if e <= m:
            return self.stream[b:e].astype(np.int64)
        return self.stream[np.arange(b, e) % m].astype(np.int64)  # padding: wrap around

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

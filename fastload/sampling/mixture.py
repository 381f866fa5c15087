"""The order of a mixture: which dataset each position of an epoch reads, and which sample.

The container (``fastload.Mixture``, the datasets and their caches) is :mod:`fastload.store.mixture`;
this module sees only its values (:class:`MixtureOrder`).

    mix = fastload.Mixture({"web": web, "books": books}, weights={"web": 0.7, "books": 0.3},
                           epoch_size=1_000_000)
    loader = fastload.Loader(mix, batch_size=32)          # or:
    loader = fastload.Loader([web, books], mix=[0.7, 0.3], epoch_size=1_000_000, batch_size=32)

The model
---------
Each dataset keeps its own stream: its samples in a fresh random order per pass of its own
(keyed by the loader's seed and the dataset's position), passes one after the other. A
mixture epoch is a stream of ``M`` positions, each naming a dataset; position ``t`` of
dataset ``i`` takes the next sample of dataset ``i``'s stream. So a small dataset is read
again (in a new order) when it runs out, a large one is read partly, and nothing is read
twice before its whole dataset has been read.

``per="batch"`` (default): every run of ``batch_size`` positions — one rank's batch — holds
dataset ``i`` ``floor(B * p_i)`` or ``ceil(B * p_i)`` times, and the ceilings rotate over
the datasets so that over many batches each dataset gets its share (within a few samples of
``p_i * M`` per epoch). The order inside a batch is shuffled. ``per="epoch"``: the epoch
holds dataset ``i`` exactly ``round(p_i * M)`` times (largest remainders), in a random order
per epoch, so batches vary around the proportions.

Computed per position (:class:`MixtureLayout`; nothing per position is held).
``per="batch"``: run ``c``'s counts come from its golden-ratio point in 64-bit fixed point
(:class:`BatchCounts`), the counts of all runs before it from floor sums in O(log c); its
``B`` slots, laid out dataset after dataset, are shuffled by a keyed bijection of the run,
and the run is computed whole (``B`` positions) to number each dataset's positions in
stream order. ``per="epoch"``: a keyed bijection of the epoch's ``M`` positions onto slots
laid out dataset after dataset; slot ``s`` of dataset ``i`` reads that epoch's draw
``s - first slot of i``, so within an epoch a dataset's draws come in a random order (every
one once; a dataset read more than once per epoch may repeat a sample before its pass ends).

An epoch is ``epoch_size`` positions, or — ``stop_on=name`` — as many as it takes to read
every sample of that dataset once (each epoch then is exactly one pass over it).

The stream is a pure function of (seed, epoch, sizes, weights, batch size), identical on
every rank, and a Loader reads it exactly like a single dataset's: by global steps, with a
state that is one number (positions consumed), so a mixture resumes exactly, also at
another world size. ``batch["source"]`` is each row's dataset (its position in the
mixture), ``batch["index"]`` the sample's index within that dataset. Each rank's batch is
one run of ``batch_size`` positions (every step consumes a multiple of it), so the
``per="batch"`` counts hold on every rank at any world size — except when an epoch's last
step splits its remaining positions evenly over the ranks (``DistributedSampler``'s rule):
those shorter batches hold their run's counts together.

With ``pack_to`` the mixture still mixes *documents* (positions of this stream), and packing
reads their tokens: dataset ``i``'s share of the tokens is proportional to ``p_i`` times its
mean document length, and packed rows hold no exact counts. Weights divided by the mean
lengths give proportions of tokens (see the README).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .bijection import bijection, round_keys
from .length_summary import range_total
from .order import CHUNK, Stream, sorted_unique
from .sampler import Sampler
from .streams import DATASET_PASSES, MIXTURE_BATCHES, MIXTURE_EPOCH, PERMUTATION, seed_sequence

__all__ = ["BatchCounts", "MixtureLayout", "MixtureOrder", "MixtureSampler", "MixtureStream", "batch_counts",
           "dataset_draws", "dataset_samples", "mixture_layout"]

_WEYL = 0x9E3779B97F4A7C15  # round(2^64 * (sqrt(5) - 1) / 2), odd: run c's point is frac((c + 1) * golden)
_M64 = 1 << 64
SPAN_PER_RUN = 1024  # _before: sum the counts of up to this many runs per run asked for, not floor sums
# (a run's count of a dataset summed costs ~10 ns, its floor sum ~10 us: even at 1,000 per run asked
# for, summing is no slower; a rank's batches at up to 1,024 ranks are that far apart)
SPAN_PIECE = 1 << 16  # _before: runs whose counts are summed at a time, for up to 15 datasets
SPAN_ELEMENTS = 1 << 20  # _before: at most this many (run, dataset) counts at a time (8 MB)
ORDER = "per-position"  # in the identity: a state of the array layout (before) is refused, naming it


def _floor_sum(n: int, m: int, a: int, b: int) -> int:
    """``sum(floor((a * k + b) / m) for k in range(n))`` exactly, in O(log m) steps (Python
    integers, ``a, b >= 0``): the Euclid-like reduction of the floor sum."""
    total = 0
    while True:
        if a >= m:
            total += (n - 1) * n // 2 * (a // m)
            a %= m
        if b >= m:
            total += n * (b // m)
            b %= m
        y = a * n + b
        if y < m:
            return total
        n, b, m, a = y // m, y % m, a, m


class BatchCounts:
    """The counts of ``per="batch"``: run ``c`` of ``batch_size`` positions holds dataset ``i``
    ``floor(B * p_i)`` times, plus one when one of the points ``u_c + j`` (``j = 0..extra-1``,
    ``u_c = frac((c + 1) * golden)`` in 64-bit fixed point) falls in its share of the
    fractions (systematic sampling with golden-ratio offsets): every count is the floor or the
    ceiling, every run sums to ``B``, and each dataset's ceilings come at the rate of its
    fraction. The counts of runs ``0..c-1`` together take O(log) from ``c`` (floor sums)."""

    def __init__(self, weights: np.ndarray, batch_size: int) -> None:
        ideal = np.asarray(weights, dtype=np.float64) * batch_size
        self.batch_size = int(batch_size)
        self.base = np.floor(ideal).astype(np.int64)
        extra = self.batch_size - int(self.base.sum())
        bounds = np.concatenate([[0.0], np.cumsum(ideal - self.base)])
        fixed = [int(x * _M64) for x in bounds[:-1].tolist()] + [extra * _M64]  # floats times 2^64: exact
        for i in range(1, len(fixed)):
            fixed[i] = max(fixed[i], fixed[i - 1])
        self._q = np.array([f >> 64 for f in fixed], dtype=np.int64)
        self._r = [f & (_M64 - 1) for f in fixed]
        self._r64 = np.array(self._r, dtype=np.uint64)
        self._per_run = self.base + np.diff(self._q)

    def _above(self, runs) -> np.ndarray:
        """``(len(runs), n + 1)`` bool: whether each share's bound lies above run ``c``'s point."""
        k = np.asarray(runs, dtype=np.uint64) + np.uint64(1)
        u = k * np.uint64(_WEYL)  # wraps (uint64 arrays wrap silently): frac((c + 1) * golden) * 2^64
        return self._r64[None, :] > u[:, None]

    def counts(self, runs) -> np.ndarray:
        """``(len(runs), n)``: each dataset's count in each run of ``runs``."""
        return self._per_run[None, :] + np.diff(self._above(runs).astype(np.int64), axis=1)

    def summed(self, first: int, stop: int, at: np.ndarray) -> np.ndarray:
        """``(len(at), n)``: each dataset's count in runs ``first..first+a-1`` together, for
        each ``a`` of ``at`` (each in ``0..stop-first``): :meth:`counts` summed, without the
        ``(runs, n)`` array of counts."""
        above = np.zeros((stop - first + 1, len(self._r)), np.int64)
        np.cumsum(self._above(np.arange(first, stop, dtype=np.int64)), axis=0, out=above[1:])
        at = np.asarray(at, dtype=np.int64)
        return at[:, None] * self._per_run[None, :] + np.diff(above[at], axis=1)

    def before(self, c: int) -> np.ndarray:
        """Each dataset's count in runs ``0..c-1`` together (O(log c) per dataset)."""
        c = int(c)
        f0 = _floor_sum(c + 1, _M64, _WEYL, 0)
        below = [f0 - _floor_sum(c + 1, _M64, _WEYL, _M64 - r) + (r == 0) + c for r in self._r]  # u_1..u_c < r
        return c * self._per_run + np.diff(np.array(below, dtype=np.int64))


def batch_counts(weights: np.ndarray, batch_size: int, chunks: int) -> np.ndarray:
    """``(chunks, n)`` samples of each dataset in each of the first ``chunks`` runs of
    ``batch_size`` positions (:class:`BatchCounts`)."""
    return BatchCounts(weights, batch_size).counts(np.arange(chunks))


def _apportion(total: int, weights: np.ndarray) -> np.ndarray:
    """``total`` split by ``weights`` with largest remainders (sums to ``total`` exactly)."""
    ideal = weights * total
    out = np.floor(ideal).astype(np.int64)
    short = total - int(out.sum())
    if short > 0:
        out[np.argsort(-(ideal - out), kind="stable")[:short]] += 1
    return out


class MixtureLayout:
    """Which dataset each position of a mixture epoch reads and which draw of that dataset
    it is, per position (see the module docstring): ``length`` positions per epoch, of which
    ``per_epoch[i]`` read dataset ``i``. Built once per sampler: O(datasets) memory."""

    def __init__(self, weights: np.ndarray, sizes: np.ndarray, *, batch_size: int, per: str, seed: int,
                 epoch_size: int | None, stop_on: int | None) -> None:
        self.n = len(weights)
        self.per, self.seed, self.batch_size = per, int(seed), int(batch_size)
        if per == "epoch":
            if stop_on is not None:
                j = stop_on
                m = max(int(round(sizes[j] / weights[j])), int(sizes[j]))
                rest = np.delete(weights, j)
                counts = np.insert(_apportion(m - int(sizes[j]), rest / rest.sum()) if self.n > 1 else
                                   np.zeros(0, np.int64), j, sizes[j])
            else:
                counts = _apportion(epoch_size, weights)
            self.per_epoch = np.asarray(counts, dtype=np.int64)
            self._cum = np.concatenate([[0], np.cumsum(self.per_epoch)])
            self.length = int(self._cum[-1])
            return
        self.counts = BatchCounts(weights, batch_size)
        self._keys = round_keys(self.seed, 0, MIXTURE_BATCHES)  # the same every epoch
        if stop_on is None:
            self.length = int(epoch_size)
        else:  # up to the run holding dataset j's size-th draw, and in it that draw's position
            j = stop_on
            need = int(sizes[j])
            hi = 1
            while self.counts.before(hi)[j] < need:
                hi *= 2
            lo = 0  # the first c with before(c + 1)[j] >= need
            while lo < hi - 1:
                mid = (lo + hi) // 2
                if self.counts.before(mid)[j] >= need:
                    hi = mid
                else:
                    lo = mid
            run = lo
            left = need - int(self.counts.before(run)[j])
            ids, _ = self._runs(np.array([run]))
            self.length = run * self.batch_size + int(np.flatnonzero(ids[0] == j)[left - 1]) + 1
        full, rem = divmod(self.length, self.batch_size)
        tail = np.zeros(self.n, np.int64)
        if rem:
            ids, _ = self._runs(np.array([full]))
            tail = np.bincount(ids[0, :rem], minlength=self.n)
        self.per_epoch = self.counts.before(full) + tail

    def _runs(self, runs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(dataset, occurrence)`` of every offset of the runs ``runs``: ``(len(runs), B)``
        each; occurrence: how many offsets before it in its run read the same dataset. A run's
        slots are its counts laid out dataset after dataset, shuffled by a keyed bijection of
        the run (keyed by the run's number)."""
        b = self.batch_size
        cum = np.cumsum(self.counts.counts(runs), axis=1)  # (runs, n): each dataset's end slot
        offsets = np.tile(np.arange(b, dtype=np.int64), len(runs))
        slots = bijection(offsets, b, self._keys, sub=np.repeat(runs, b)).reshape(len(runs), b)
        ids = (slots[:, :, None] >= cum[:, None, :]).sum(axis=2)  # the dataset whose slots hold it
        occ = np.zeros_like(ids)
        for i in range(self.n):
            hit = ids == i
            occ += np.where(hit, np.cumsum(hit, axis=1) - 1, 0)
        return ids, occ

    def _before(self, runs: np.ndarray) -> np.ndarray:
        """``(len(runs), n)``: each dataset's count in the runs before each of ``runs``
        (sorted): floor sums for the first, then the counts of the runs between summed (in
        pieces of :data:`SPAN_PIECE` runs, fewer for many datasets: :data:`SPAN_ELEMENTS`) when they are not too many per run asked for (a
        stretch of the stream, or a rank's batches at up to :data:`SPAN_PER_RUN` ranks: a
        run's counts cost nanoseconds, its floor sums microseconds), else floor sums for each."""
        first, last = int(runs[0]), int(runs[-1])
        if last - first > SPAN_PER_RUN * len(runs) + 64:
            return np.stack([self.counts.before(c) for c in runs.tolist()])
        out = np.empty((len(runs), self.n), np.int64)
        base = self.counts.before(first)  # before run a, the piece's first
        lo = 0
        piece = max(256, min(SPAN_PIECE, SPAN_ELEMENTS // (self.n + 1)))  # bounded memory at any n
        for a in range(first, last + 1, piece):
            b = min(last + 1, a + piece)
            hi = lo + int(np.searchsorted(runs[lo:], b))
            span = self.counts.summed(a, b, np.append(runs[lo:hi] - a, b - a))
            out[lo:hi] = base + span[:-1]
            base = base + span[-1]
            lo = hi
        return out

    def locate(self, pos: np.ndarray, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """``(dataset, draw of that dataset's stream)`` of the epoch's ``pos`` positions."""
        if self.per == "epoch":
            keys = round_keys(self.seed, epoch, MIXTURE_EPOCH)
            slot = bijection(pos, self.length, keys)
            ids = np.searchsorted(self._cum, slot, side="right") - 1
            return ids, epoch * self.per_epoch[ids] + slot - self._cum[ids]
        run = pos // self.batch_size
        runs = sorted_unique(run)
        inv = np.searchsorted(runs, run)
        ids, occ = self._runs(runs)
        before = self._before(runs)
        off = pos - run * self.batch_size
        d = ids[inv, off]
        return d, epoch * self.per_epoch[d] + before[inv, d] + occ[inv, off]


def mixture_layout(weights: np.ndarray, sizes: np.ndarray, *, batch_size: int, per: str, seed: int, epoch: int,
                   epoch_size: int | None, stop_on: int | None) -> np.ndarray:
    """The dataset of each of the epoch's positions, materialised (:class:`MixtureLayout`
    computes it per position)."""
    lay = MixtureLayout(weights, sizes, batch_size=batch_size, per=per, seed=seed, epoch_size=epoch_size,
                        stop_on=stop_on)
    return lay.locate(np.arange(lay.length, dtype=np.int64), epoch)[0]


@functools.lru_cache(maxsize=256)
def _dataset_key(seed: int, dataset: int) -> int:
    return int(seed_sequence(seed, dataset, DATASET_PASSES).generate_state(1, np.uint64)[0] >> 1)


@functools.lru_cache(maxsize=1024)
def _pass_keys(seed: int, dataset: int, p: int) -> np.ndarray:
    """The round keys of pass ``p`` of dataset ``dataset``'s own stream (read-only; a pure
    function of its arguments, kept: every batch of a pass asks for them)."""
    keys = round_keys(_dataset_key(seed, dataset), p, PERMUTATION)
    keys.flags.writeable = False
    return keys


def _samples(size: np.ndarray, seed: int, ids: np.ndarray, draws: np.ndarray, shuffle: bool) -> np.ndarray:
    """The samples of draws ``draws`` of datasets ``ids`` (one each, of ``size`` samples:
    arrays like ``draws``), in one bijection call over every (dataset, pass) met
    (:func:`dataset_samples`)."""
    if not shuffle or not len(draws):
        return draws % size
    passes = draws // size
    width = int(passes.max()) + 1
    groups, inv = np.unique(ids * width + passes, return_inverse=True)  # (dataset, pass)
    if len(groups) == 1:
        keys = _pass_keys(seed, int(groups[0]) // width, int(groups[0]) % width)
    else:
        keys = np.stack([_pass_keys(seed, g // width, g % width) for g in groups.tolist()], axis=1)[:, inv.ravel()]
    return bijection(draws - passes * size, size, keys)


def dataset_samples(size: int, seed: int, dataset: int, draws: np.ndarray, shuffle: bool) -> np.ndarray:
    """The samples of draws ``draws`` of one dataset's own stream: its passes one after the
    other, each a fresh keyed bijection of the dataset keyed by (seed, dataset, pass),
    computed per draw (``permutation(size, key, pass)`` materialises one pass)."""
    draws = np.asarray(draws, dtype=np.int64)
    return _samples(np.full(len(draws), size, np.int64), seed, np.full(len(draws), dataset, np.int64), draws,
                    shuffle)


def dataset_draws(size: int, seed: int, dataset: int, first: int, count: int, shuffle: bool) -> np.ndarray:
    """Draws ``first..first+count-1`` of one dataset's own stream (:func:`dataset_samples`)."""
    return dataset_samples(size, seed, dataset, np.arange(first, first + count, dtype=np.int64), shuffle)


class MixtureStream(Stream):
    """A mixture epoch's stream per position: global indices into the mixture's reader."""

    def __init__(self, layout: MixtureLayout, sizes: np.ndarray, starts: np.ndarray, seed: int, epoch: int,
                 shuffle: bool) -> None:
        self.layout, self.sizes, self.starts = layout, sizes, np.asarray(starts, dtype=np.int64)
        self._sizes = np.asarray(sizes, dtype=np.int64)
        self.seed, self.epoch, self.shuffle = int(seed), int(epoch), bool(shuffle)
        self.num_samples = int(np.sum(sizes))

    def __len__(self) -> int:
        return self.layout.length

    def _at(self, pos: np.ndarray) -> np.ndarray:
        if not len(pos):
            return np.zeros(0, np.int64)
        ids, draws = self.layout.locate(pos, self.epoch)
        return self.starts[ids] + _samples(self._sizes[ids], self.seed, ids, draws, self.shuffle)

    def token_total(self, lengths, max_length: int | None = None, check: Callable[[], None] | None = None) -> int:
        """The tokens the epoch reads (``lengths`` by global index, truncated to
        ``max_length``): dataset ``i`` reads draws ``e * E_i .. (e + 1) * E_i - 1`` of its
        stream, so its whole passes count its lengths' sum (the same every epoch:
        :func:`~fastload.sampling.length_summary.range_total`, counted once per process) and
        only a partial pass (or its complement, whichever is shorter) is computed draw by
        draw, in chunks. ``check()`` is called before each dataset's sum and each chunk (a
        background planner's stop: it may raise to end the count)."""
        def tokens(idx) -> int:
            tok = np.asarray(lengths[idx], dtype=np.int64)
            return int((tok if max_length is None else np.minimum(tok, max_length)).sum())

        total = 0
        for i, count in enumerate(self.layout.per_epoch.tolist()):
            size, start = int(self.sizes[i]), int(self.starts[i])
            if not count or not size:
                continue
            if check is not None:
                check()
            whole = range_total(lengths, start, start + size, max_length)  # (counted once per process)
            a, b = self.epoch * count, (self.epoch + 1) * count
            for p in range(a // size, (b - 1) // size + 1):  # each pass of the dataset the epoch reads
                lo, hi = max(a, p * size), min(b, (p + 1) * size)
                if hi - lo == size:
                    total += whole
                    continue
                inside = hi - lo <= size // 2
                ranges = [(lo, hi)] if inside else [(p * size, lo), (hi, (p + 1) * size)]
                part = 0
                for r0, r1 in ranges:
                    for c in range(r0, r1, CHUNK):
                        if check is not None:
                            check()
                        draws = np.arange(c, min(r1, c + CHUNK), dtype=np.int64)
                        part += tokens(start + dataset_samples(size, self.seed, i, draws, self.shuffle))
                total += part if inside else whole - part
        return total

    @property
    def _key(self) -> tuple:
        return (id(self.layout), self.epoch, self.shuffle)


@dataclass(frozen=True)
class MixtureOrder:
    """What a mixture's stream is a function of (besides seed, epoch and batch size): the
    values a :class:`MixtureSampler` reads, taken from a :class:`fastload.Mixture`
    (``MixtureOrder.of(mixture)``) so that ordering never reaches up into the datasets."""

    names: tuple[str, ...]
    sizes: np.ndarray  # samples per dataset
    starts: np.ndarray  # each dataset's first global index in the mixture's reader
    weights: np.ndarray  # normalised proportions
    per: str  # "batch" or "epoch"
    epoch_size: int | None
    stop_on: int | None

    @classmethod
    def of(cls, mixture: Any) -> MixtureOrder:
        return cls(tuple(mixture.names), mixture.sizes, np.asarray(mixture.reader.starts, dtype=np.int64),
                   mixture.weights, mixture.per, mixture.epoch_size, mixture.stop_on)

    def identity(self, batch_size: int) -> dict:
        """What defines the mixture's streams (a resumed state must match it)."""
        return {"datasets": list(self.names), "sizes": self.sizes.tolist(), "weights": self.weights.tolist(),
                "per": self.per, "epoch_size": self.epoch_size, "stop_on": self.stop_on,
                "mix_batch_size": batch_size if self.per == "batch" else None, "order": ORDER}


class MixtureSampler(Sampler):
    """A :class:`~fastload.Sampler` whose stream is a mixture's (global indices into the
    mixture's :class:`~fastload.store.concat.ConcatReader`): rank partition, padding,
    drop_last, state and resume are the plain sampler's. ``order``: a :class:`MixtureOrder`
    (or a :class:`fastload.Mixture`, whose order is taken)."""

    def __init__(self, order: Any, *, batch_size: int, world_size: int = 1, rank: int = 0, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = False):
        order = order if isinstance(order, MixtureOrder) else MixtureOrder.of(order)
        self.order = order
        super().__init__(int(order.sizes.sum()), batch_size=batch_size, world_size=world_size, rank=rank,
                         shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.layout = MixtureLayout(order.weights, order.sizes, batch_size=batch_size, per=order.per, seed=seed,
                                    epoch_size=order.epoch_size, stop_on=order.stop_on)
        self._mlen = self.layout.length

    _drawn = False  # computed per position (MixtureLayout)
    reads_every_sample_once = False  # datasets are read again or partly

    @property
    def stream_len(self) -> int:
        return getattr(self, "_mlen", 0) or self.num_samples

    def order_stream(self, epoch: int | None = None) -> Stream:
        e = self.epoch if epoch is None else int(epoch)
        o = self._orders.get(e)
        if o is None:
            o = MixtureStream(self.layout, self.order.sizes, self.order.starts, self.seed, e, self.shuffle)
            keep = (self.epoch, self.epoch + 1)
            if e in keep:
                self._orders = {k: v for k, v in self._orders.items() if k in keep}
                self._orders[e] = o
        return o

    def _compute_identity(self) -> dict:
        return {**super()._compute_identity(), "mixture": self.order.identity(self.batch_size)}

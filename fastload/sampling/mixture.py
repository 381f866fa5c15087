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

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .bijection import bijection, round_keys
from .sampler import Sampler
from .streams import DATASET_PASSES, MIXTURE_BATCHES, MIXTURE_EPOCH, PERMUTATION, generator, seed_sequence

__all__ = ["MixtureOrder", "MixtureSampler", "batch_counts", "dataset_draws", "mixture_layout"]

_GOLDEN = (math.sqrt(5) - 1) / 2


def batch_counts(weights: np.ndarray, batch_size: int, chunks: int) -> np.ndarray:
    """``(chunks, n)`` samples of each dataset in each run of ``batch_size`` positions: the
    floor of ``B * p_i`` plus one for the datasets whose fractions the chunk's rotating
    points fall in (systematic sampling with golden-ratio offsets): every count is the floor
    or the ceiling, every row sums to ``B``, and each dataset's ceilings come at the rate of
    its fraction."""
    ideal = weights * batch_size
    base = np.floor(ideal).astype(np.int64)
    frac = ideal - base
    extra = batch_size - int(base.sum())
    bounds = np.concatenate([[0.0], np.cumsum(frac)])
    bounds[-1] = extra  # exactly: the fractions add up to the whole number of extras
    u = ((np.arange(chunks) + 1) * _GOLDEN) % 1.0
    # points u + j (j = 0..extra-1) in [bounds[i], bounds[i+1]): at most one per dataset
    hits = np.ceil(bounds[None, 1:] - u[:, None]) - np.ceil(bounds[None, :-1] - u[:, None])
    return base[None, :] + hits.astype(np.int64)


def _within_chunks(ids: np.ndarray, batch_size: int, rng: np.random.Generator) -> np.ndarray:
    """``ids`` (grouped by dataset inside each chunk) shuffled within each chunk."""
    keys = rng.random(len(ids)) + np.arange(len(ids)) // batch_size
    return ids[np.argsort(keys, kind="stable")]


def mixture_layout(weights: np.ndarray, sizes: np.ndarray, *, batch_size: int, per: str, seed: int, epoch: int,
                   epoch_size: int | None, stop_on: int | None) -> np.ndarray:
    """The dataset of each of the epoch's positions (int8/int16/int32), see the module
    docstring. ``per="batch"`` layouts do not depend on the epoch."""
    n = len(weights)
    dt = np.int8 if n < 128 else np.int32
    if per == "epoch":
        if stop_on is not None:
            j = stop_on
            m = max(int(round(sizes[j] / weights[j])), int(sizes[j]))
            rest = np.delete(weights, j)
            counts = np.insert(_apportion(m - int(sizes[j]), rest / rest.sum()) if n > 1 else np.zeros(0, np.int64),
                               j, sizes[j])
        else:
            counts = _apportion(epoch_size, weights)
        ids = np.repeat(np.arange(n, dtype=dt), counts)
        generator(seed, epoch, MIXTURE_EPOCH).shuffle(ids)
        return ids
    rng = generator(seed, 0, MIXTURE_BATCHES)  # the same every epoch
    if stop_on is None:
        chunks = -(-epoch_size // batch_size)
        counts = batch_counts(weights, batch_size, chunks)
        ids = np.repeat(np.tile(np.arange(n, dtype=dt), chunks), counts.ravel())
        return _within_chunks(ids, batch_size, rng)[:epoch_size]
    j = stop_on
    need = int(sizes[j])
    per_chunk = weights[j] * batch_size
    chunks = int(need / per_chunk) + 2
    while True:
        counts = batch_counts(weights, batch_size, chunks)
        if counts[:, j].sum() >= need:
            break
        chunks *= 2
    chunks = int(np.searchsorted(np.cumsum(counts[:, j]), need)) + 1  # the chunk holding the last one
    ids = np.repeat(np.tile(np.arange(n, dtype=dt), chunks), counts[:chunks].ravel())
    ids = _within_chunks(ids, batch_size, rng)
    last = int(np.flatnonzero(ids == j)[need - 1])
    return ids[:last + 1]


def _apportion(total: int, weights: np.ndarray) -> np.ndarray:
    """``total`` split by ``weights`` with largest remainders (sums to ``total`` exactly)."""
    ideal = weights * total
    out = np.floor(ideal).astype(np.int64)
    short = total - int(out.sum())
    if short > 0:
        out[np.argsort(-(ideal - out), kind="stable")[:short]] += 1
    return out


def dataset_draws(size: int, seed: int, dataset: int, first: int, count: int, shuffle: bool) -> np.ndarray:
    """Positions ``first..first+count-1`` of one dataset's own stream: its passes one after
    the other, each a fresh keyed bijection of the dataset keyed by (seed, dataset, pass),
    computed per position (``permutation(size, key, pass)`` materialises one pass)."""
    if count == 0:
        return np.empty(0, np.int64)
    pos = np.arange(first, first + count, dtype=np.int64)
    if not shuffle:
        return pos % size
    key = int(seed_sequence(seed, dataset, DATASET_PASSES).generate_state(1, np.uint64)[0] >> 1)
    out = np.empty(count, np.int64)
    p0, p1 = first // size, (first + count - 1) // size
    for p in range(p0, p1 + 1):  # one pass after the other (a few: count is at most an epoch)
        a = max(first, p * size) - first
        b = min(first + count, (p + 1) * size) - first
        out[a:b] = bijection(pos[a:b] - p * size, size, round_keys(key, p, PERMUTATION))
    return out


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
                "mix_batch_size": batch_size if self.per == "batch" else None}


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
        self._layout: np.ndarray | None = None  # per="batch": the same every epoch
        self._mlen = len(self._layout_for(0))

    _drawn = True  # the stream is computed whole (its layout is an array per epoch)
    reads_every_sample_once = False  # datasets are read again or partly

    @property
    def stream_len(self) -> int:
        return getattr(self, "_mlen", 0) or self.num_samples

    def _layout_for(self, epoch: int) -> np.ndarray:
        m = self.order
        if m.per == "batch" and self._layout is not None:
            return self._layout
        ids = mixture_layout(m.weights, m.sizes, batch_size=self.batch_size, per=m.per, seed=self.seed,
                             epoch=epoch, epoch_size=m.epoch_size, stop_on=m.stop_on)
        if m.per == "batch":
            self._layout = ids
        return ids

    def _compute(self, e: int) -> np.ndarray:
        """The mixture's stream of epoch ``e`` (cached and prepared ahead by Sampler.stream/prepare)."""
        m = self.order
        ids = self._layout_for(e)
        counts = np.bincount(ids, minlength=len(m.sizes))
        out = np.empty(len(ids), dtype=np.int64)
        for i, size in enumerate(m.sizes.tolist()):
            where = np.flatnonzero(ids == i)
            local = dataset_draws(size, self.seed, i, e * int(counts[i]), len(where), self.shuffle)
            out[where] = local + m.starts[i]
        out.flags.writeable = False
        return out

    def _compute_identity(self) -> dict:
        return {**super()._compute_identity(), "mixture": self.order.identity(self.batch_size)}

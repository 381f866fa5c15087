"""The keyed random streams: ``(seed, epoch, purpose)`` entropy for every random order
(the uniform orders themselves, ``permutation`` and ``window_permutation``, are in
``order.py``: keyed bijections computed per position, see ``bijection.py``).

Every random stream fastload draws from a generator is a pure function of (seed, epoch,
purpose) (:func:`seed_sequence`, :func:`generator`). The purposes are named here, one per
kind of stream, so that no two kinds ever read the same numbers:

    PERMUTATION      0  a shuffled pass (``order.permutation``)
    WINDOW           1  shards and windows of ``shuffle_mode="window"`` (``order.window_permutation``)
    WEIGHTED         2  weighted draws (``draws.weighted_draws``)
    BALANCED         3  class-balanced draws (``draws.balanced_draws``)
    DATASET_PASSES   4  a mixed dataset's own passes (``mixture.dataset_draws``: the epoch slot
                        holds the dataset's number)
    MIXTURE_BATCHES  5  a mixture's per-batch layout (epoch 0: the same every epoch)
    MIXTURE_EPOCH    6  a mixture's per-epoch layout

Counter-based randomness (one value per (key, counter), no state to carry: a sample's crop,
a batch's seeds) hashes with :func:`splitmix64`, SplitMix64's finaliser vectorised over
uint64 arrays (``pipeline/crops.py``, ``loader/finish.py``).
"""
from __future__ import annotations

import numpy as np

__all__ = ["BALANCED", "DATASET_PASSES", "GOLDEN_GAMMA", "MIXTURE_BATCHES", "MIXTURE_EPOCH", "MIX_C1", "MIX_C2",
           "PERMUTATION", "WEIGHTED", "WINDOW", "generator", "seed_sequence", "splitmix64"]

# the purposes of the keyed streams (see the module docstring); never reuse or renumber one:
# the orders of every seed depend on them
PERMUTATION, WINDOW, WEIGHTED, BALANCED, DATASET_PASSES, MIXTURE_BATCHES, MIXTURE_EPOCH = range(7)

# SplitMix64's constants: the golden-ratio increment and the finaliser's two multipliers
GOLDEN_GAMMA = np.uint64(0x9E3779B97F4A7C15)
MIX_C1 = np.uint64(0xBF58476D1CE4E5B9)
MIX_C2 = np.uint64(0x94D049BB133111EB)


def splitmix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser over a uint64 array (a bijection with full avalanche; uint64
    arithmetic wraps: call it under ``np.errstate(over="ignore")``)."""
    z = (z ^ (z >> np.uint64(30))) * MIX_C1
    z = (z ^ (z >> np.uint64(27))) * MIX_C2
    return z ^ (z >> np.uint64(31))


def seed_sequence(seed: int, epoch: int, purpose: int) -> np.random.SeedSequence:
    """The entropy of one random stream: (seed, epoch, purpose), a purpose named above."""
    return np.random.SeedSequence([seed & (2**64 - 1), epoch, purpose])


def generator(seed: int, epoch: int, purpose: int) -> np.random.Generator:
    """A PCG64 generator over :func:`seed_sequence`."""
    return np.random.Generator(np.random.PCG64(seed_sequence(seed, epoch, purpose)))


def _index_dtype(n: int):
    return np.int32 if n < 2**31 else np.int64

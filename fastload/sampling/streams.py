"""The keyed random streams and the uniform orders: ``(seed, epoch, purpose)`` entropy,
:func:`permutation` (fastload's C++ Fisher–Yates) and :func:`window_permutation` (shards in a
random order, samples shuffled within windows of shards)."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _seeds(seed: int, epoch: int, purpose: int) -> np.random.SeedSequence:
    """The entropy of one random stream: (seed, epoch, purpose), purpose 0..3 per stream kind."""
    return np.random.SeedSequence([seed & (2**64 - 1), epoch, purpose])


def _rng(seed: int, epoch: int, purpose: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(_seeds(seed, epoch, purpose)))


def _index_dtype(n: int):
    return np.int32 if n < 2**31 else np.int64


def permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """A uniformly random permutation of ``0..n-1`` keyed by (seed, epoch)."""
    from .. import _C

    key = _seeds(seed, epoch, 0).generate_state(2, np.uint64)
    out = np.empty(n, dtype=_index_dtype(n))
    _C.permutation(out, int(key[0]), int(key[1]))
    return out


def window_permutation(shard_sizes: Sequence[int], window: int, seed: int, epoch: int) -> np.ndarray:
    """Shards in random order; samples shuffled within each window of ``window`` shards.

    Memory: at most ``window`` shards are being read at any time (by all ranks together),
    at the price of a less random order (samples from the same window are close together)."""
    sizes = np.asarray(shard_sizes, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    n = int(sizes.sum())
    rng = _rng(seed, epoch, 1)
    order = rng.permutation(len(sizes))
    dt = _index_dtype(n)
    out = np.empty(n, dtype=dt)
    pos = 0
    for w0 in range(0, len(order), window):
        chunk = [np.arange(starts[s], starts[s] + sizes[s], dtype=dt) for s in order[w0:w0 + window]]
        block = np.concatenate(chunk) if chunk else np.empty(0, dt)
        rng.shuffle(block)
        out[pos:pos + len(block)] = block
        pos += len(block)
    return out

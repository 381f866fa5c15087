"""A keyed bijection of ``[0, n)``: a shuffle computed one position at a time.

``bijection(positions, n, keys)`` maps stream positions to sample indices so that, for a
fixed key, every index of ``[0, n)`` is hit by exactly one position: a permutation of
``[0, n)`` that is never stored. A rank computes only the positions of its batches in
flight, so an epoch over ``10^10`` samples costs no memory, its first batch microseconds, and
resuming at any position nothing at all.

The construction
----------------
A **Feistel network** over ``[0, 2^b)``, ``b = max(2, bit length of n - 1)`` (so
``2^b < 2n``): a value is split into a high part of ``ceil(b/2)`` bits and a low part of
``floor(b/2)`` bits, and :data:`ROUNDS` rounds alternately xor the low part with a keyed
hash of the high part and the high part with a keyed hash of the low part. Each round is
invertible (xor with a function of the other part), so the network is a permutation of
``[0, 2^b)`` for any round function. The round function is a 64-bit multiply-xorshift-multiply
of ``part ^ key[r]`` (SplitMix64's finaliser without its last step), whose top bits are
taken: every input bit reaches them.

**Cycle walking** restricts it to ``[0, n)``: a position whose image lands in ``[n, 2^b)`` is
pushed through the network again until it lands inside. The walk stays on the position's
cycle of the ``2^b``-permutation, which returns to ``[0, n)``, and the result is a
permutation of ``[0, n)`` (Black and Rogaway, "Ciphers with arbitrary finite domains",
2002). Since ``2^b < 2n``, fewer than 2 passes are needed on average.

Everything is elementwise uint64 arithmetic (wrapping), so the order is the same on every
machine and numpy version: computed per element by the C++ extension (``fastload._C.feistel``,
csrc/feistel.cpp: ~10 ns a position, where numpy's per-call overhead made a call over a batch's
few thousand positions cost tens of microseconds whatever its size), or by the numpy
implementation here (the reference: the tests check that both give the same numbers; it
is used when the extension was built without ``feistel``). ``n`` and ``keys`` may differ per element (a window's own
bijection in ``shuffle_mode="window"``, a dataset's passes in a mixture).

Quality is measured, not assumed: tests/test_sampling_bijection.py checks that it is a
permutation for every ``n`` up to 2,000 exhaustively, that a fixed index lands uniformly
over the positions across keys (chi-square), that adjacent positions are uncorrelated and
that the ranks' shares are disjoint.
"""
from __future__ import annotations

import numpy as np

try:
    from .._C import feistel as _feistel
except ImportError:  # an extension built before feistel.cpp: the numpy reference below
    _feistel = None

from .streams import MIX_C1, MIX_C2, seed_sequence, splitmix64

__all__ = ["ROUNDS", "bijection", "derive_keys", "round_keys"]

ROUNDS = 12  # round keys per stream: domains of up to SMALL_BITS bits use them all
FEW_ROUNDS = 6  # larger domains (Luby-Rackoff: 4 make a strong pseudo-random permutation)
SMALL_BITS = 10  # halves of 1-5 bits give each round few functions to draw from: more rounds

_U32 = np.uint64(32)
_U64 = np.uint64(64)


def round_keys(seed: int, epoch: int, purpose: int) -> np.ndarray:
    """The :data:`ROUNDS` uint64 round keys of the stream (seed, epoch, purpose)."""
    return seed_sequence(seed, epoch, purpose).generate_state(ROUNDS, np.uint64)


def derive_keys(keys: np.ndarray, sub: np.ndarray) -> np.ndarray:
    """Round keys of the sub-streams ``sub`` (e.g. a window's or a pass's number) of the
    stream whose round keys are ``keys``: shape ``(ROUNDS, len(sub))``."""
    sub = np.asarray(sub, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = splitmix64(sub + np.uint64(0x9E3779B97F4A7C15))
        return splitmix64(keys[:, None] ^ h[None, :])


def _bits(n):
    """(low bits, high bits) of the network for a domain of ``n`` (scalar or uint64 array)."""
    if np.ndim(n) == 0:
        b = max(2, (int(n) - 1).bit_length())
        return np.uint64(b // 2), np.uint64(b - b // 2)
    n = np.asarray(n, dtype=np.uint64)
    # bit length of n - 1 (n >= 1), exactly: frexp of a float64 may round up near 2^53
    m = np.maximum(n, np.uint64(2)) - np.uint64(1)
    b = np.zeros(n.shape, np.uint64)
    for s in (32, 16, 8, 4, 2, 1):
        s = np.uint64(s)
        big = (m >> s) > 0
        b[big] += s
        m[big] >>= s
    b += np.uint64(1)  # m is now 1
    b = np.maximum(b, np.uint64(2))
    lo = b >> np.uint64(1)
    return lo, b - lo


def _network(x: np.ndarray, lo, hi, keys: np.ndarray, rounds: int, inverse: bool = False) -> np.ndarray:
    """The Feistel network of ``rounds`` rounds over ``[0, 2^(lo+hi))`` applied to ``x``
    (uint64); ``inverse``: its inverse (the same rounds in reverse order: each round xors one
    part with a function of the other, which it leaves unchanged)."""
    low = x & ((np.uint64(1) << lo) - np.uint64(1))
    high = x >> lo
    shift_lo, shift_hi = _U64 - lo, _U64 - hi
    z = np.empty_like(x)
    for r in (reversed(range(rounds)) if inverse else range(rounds)):
        src, dst, shift = (high, low, shift_lo) if r % 2 == 0 else (low, high, shift_hi)
        np.bitwise_xor(src, keys[r], out=z)
        z *= MIX_C1
        z ^= z >> _U32
        z *= MIX_C2
        dst ^= z >> shift
    high <<= lo
    high |= low
    return high


def _walk(x: np.ndarray, n, lo, hi, keys: np.ndarray, rounds: int, inverse: bool = False) -> np.ndarray:
    """The network (or its inverse) restricted to ``[0, n)`` by cycle walking; ``n``, ``lo``,
    ``hi`` scalars or arrays like ``x``, ``keys`` ``(ROUNDS,)`` or ``(ROUNDS, len(x))``."""
    out = _network(x, lo, hi, keys, rounds, inverse)
    todo = np.flatnonzero(out >= n)
    per = np.ndim(n) > 0
    while todo.size:  # fewer than 2 passes on average: at most half the domain lies outside [0, n)
        k = keys[:, todo] if keys.ndim == 2 else keys
        sub = _network(out[todo], lo[todo] if per else lo, hi[todo] if per else hi, k, rounds, inverse)
        out[todo] = sub
        todo = todo[sub >= (n[todo] if per else n)]
    return out


def bijection(positions, n, keys: np.ndarray, *, inverse: bool = False, sub=None) -> np.ndarray:
    """The images of ``positions`` (each in ``[0, n)``) under the keyed permutation of
    ``[0, n)``: int64. ``n`` is an int or an array like ``positions``; ``keys`` has shape
    ``(ROUNDS,)`` (one permutation) or ``(ROUNDS, len(positions))`` (one per element).
    ``sub``: an array like ``positions`` of sub-stream numbers: element ``i`` uses the
    keys ``derive_keys(keys, sub)[:, i]`` (``keys`` of shape ``(ROUNDS,)``), derived per
    element without the ``(ROUNDS, len)`` array. ``inverse``: the inverse permutation (where
    each index lands)."""
    if _feistel is None:
        return _bijection_numpy(positions, n, keys, inverse=inverse, sub=sub)
    pos = np.asarray(positions, dtype=np.int64)
    if pos.size == 0:
        return np.empty(pos.shape, np.int64)
    x = pos.reshape(-1).view(np.uint64)  # (a negative position reads as >= 2^63: refused as outside [0, n))
    nn = np.asarray(n, dtype=np.uint64).reshape(-1)
    s = None if sub is None else np.asarray(sub, dtype=np.uint64).reshape(-1)
    return _feistel(x, nn, np.asarray(keys, dtype=np.uint64), s, inverse).view(np.int64).reshape(pos.shape)


def _bijection_numpy(positions, n, keys: np.ndarray, *, inverse: bool = False, sub=None) -> np.ndarray:
    """:func:`bijection` in numpy (the reference of ``fastload._C.feistel``)."""
    x = np.asarray(positions, dtype=np.int64).astype(np.uint64)
    keys = np.asarray(keys, dtype=np.uint64)
    if x.size == 0:
        return np.empty(x.shape, np.int64)
    if sub is not None:
        keys = derive_keys(keys, np.asarray(sub).reshape(-1))
    if np.ndim(n) == 0:
        lo, hi = _bits(n)
        rounds = ROUNDS if int(lo + hi) <= SMALL_BITS else FEW_ROUNDS
        return _walk(x, np.uint64(n), lo, hi, keys, rounds, inverse).astype(np.int64)
    n = np.asarray(n, dtype=np.uint64)
    lo, hi = _bits(n)
    out = np.empty(x.shape, np.int64)
    small = (lo + hi) <= np.uint64(SMALL_BITS)
    for sel, rounds in ((np.flatnonzero(~small), FEW_ROUNDS), (np.flatnonzero(small), ROUNDS)):
        if sel.size:
            k = keys[:, sel] if keys.ndim == 2 else keys
            out[sel] = _walk(x[sel], n[sel], lo[sel], hi[sel], k, rounds, inverse).astype(np.int64)
    return out

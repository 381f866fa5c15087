"""An epoch's stream as a function of the position: :class:`Stream` and its kinds.

A :class:`Stream` is the epoch's sequence of ``M`` global sample indices, identical on every
rank, without being stored: ``stream.at(positions)`` computes the indices of the positions
asked for (those of the batches in flight), so memory and the time to the first batch do
not grow with ``M``. It reads like an array where that is cheap (``len``, ``stream[i]``,
``stream[a:b]``, ``stream[positions]``), and ``np.asarray(stream)`` materialises it (``M``
indices: for tests and users; a remote cache plans its downloads from the per-position order,
a chunk at a time, with :class:`fastload.remote.schedule.PassScan`, and never reads it whole).

The kinds:

* :class:`Natural`: ``0..N-1`` (``shuffle=False``);
* :class:`Shuffled`: a keyed bijection of ``[0, N)`` (:mod:`.bijection`), keyed by
  (seed, epoch): the full shuffle;
* :class:`Windowed`: ``shuffle_mode="window"``: shards in the order of a keyed bijection of
  the shards, cut into windows of ``window`` consecutive shards of that order, each
  window's samples in the order of its own keyed bijection. Memory: a few integers per shard
  (the shard order and where each window starts), nothing per sample;
* :class:`Weighted`: weighted draws with replacement: position ``p``'s uniform is a
  counter-based hash of (key, p), inverted through the cumulative weights and a guide table
  (12 bytes per sample, built once per node and memory-mapped by its ranks: ``tables.py``;
  nothing per draw);
* :class:`Balanced`: class-balanced draws: each run of ``batch_size`` positions holds
  every class equally often, each class's samples read in passes of their own keyed
  bijection (a table of the samples grouped by class, 8 bytes per sample, built once per
  node like the weighted one);
* :class:`Drawn`: an array computed whole (weighted draws without replacement).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .bijection import bijection, derive_keys, round_keys
from .streams import BALANCED, GOLDEN_GAMMA, PERMUTATION, WEIGHTED, WINDOW, splitmix64

__all__ = ["Balanced", "Drawn", "Natural", "Shuffled", "Stream", "Weighted", "Windowed", "permutation", "sorted_unique",
           "window_permutation", "index_dtype", "uniforms"]

CHUNK = 1 << 16  # positions computed per call when materialising or walking a long range
FIRST_CHUNK = 1 << 12  # positions of a pass's first call (about as fast as one batch's)


def index_dtype(n: int):
    """The narrowest index dtype of a materialised stream over ``n`` samples."""
    return np.int32 if n < 2**31 else np.int64


class Stream:
    """An epoch's stream of global sample indices, computed per position (see the module
    docstring). Subclasses define ``__len__``, ``num_samples``, :meth:`_at` and ``_key``
    (what makes two streams the same)."""

    num_samples: int

    def __len__(self) -> int:
        raise NotImplementedError

    def _at(self, pos: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    @property
    def _key(self) -> tuple:
        raise NotImplementedError

    def at(self, positions) -> np.ndarray:
        """Global sample indices (int64) of ``positions`` (each in ``[0, len)``)."""
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and (int(pos.min()) < 0 or int(pos.max()) >= len(self)):
            raise IndexError(f"stream positions must lie in [0, {len(self)}); got {int(pos.min())}.."
                             f"{int(pos.max())}")
        return self._at(pos.ravel()).reshape(pos.shape)

    def __getitem__(self, key):
        m = len(self)
        if isinstance(key, slice):
            return self.at(np.arange(*key.indices(m), dtype=np.int64))
        if isinstance(key, (int, np.integer)):
            k = int(key) + (m if int(key) < 0 else 0)
            return int(self.at(np.array([k]))[0])
        pos = np.asarray(key, dtype=np.int64)
        return self.at(np.where(pos < 0, pos + m, pos))

    def __array__(self, dtype=None, copy=None):
        """The stream materialised (read-only), computed once and kept with the stream (for
        tests and users: neither the sampler's batches nor a remote cache's plan need it)."""
        out = self.__dict__.get("_array")
        if out is None:
            m = len(self)
            out = np.empty(m, dtype=index_dtype(self.num_samples))
            for a in range(0, m, CHUNK):
                b = min(m, a + CHUNK)
                out[a:b] = self._at(np.arange(a, b, dtype=np.int64))
            out.flags.writeable = False
            self._array = out
        return out if dtype is None else out.astype(dtype, copy=False)

    def tolist(self) -> list[int]:
        return np.asarray(self).tolist()

    def copy(self) -> np.ndarray:
        """The stream materialised (a new, writable array)."""
        return np.array(np.asarray(self))

    def same(self, other: object) -> bool:
        """True when ``other`` (a Stream or an array) holds the same indices."""
        if isinstance(other, Stream) and type(other) is type(self) and not isinstance(self, Drawn):
            return self._key == other._key
        if len(other) != len(self):  # type: ignore[arg-type]
            return False
        return bool(np.array_equal(np.asarray(self), np.asarray(other)))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(len={len(self)})"


class Natural(Stream):
    """``0..n-1``."""

    def __init__(self, n: int) -> None:
        self.num_samples = int(n)

    def __len__(self) -> int:
        return self.num_samples

    def _at(self, pos: np.ndarray) -> np.ndarray:
        return pos.copy()

    @property
    def _key(self) -> tuple:
        return (self.num_samples,)


class Shuffled(Stream):
    """A keyed bijection of ``[0, n)``, keyed by (seed, epoch)."""

    def __init__(self, n: int, seed: int, epoch: int, purpose: int = PERMUTATION) -> None:
        self.num_samples = int(n)
        self.seed, self.epoch = int(seed), int(epoch)
        self.keys = round_keys(seed, epoch, purpose)

    def __len__(self) -> int:
        return self.num_samples

    def _at(self, pos: np.ndarray) -> np.ndarray:
        return bijection(pos, self.num_samples, self.keys)

    @property
    def _key(self) -> tuple:
        return (self.num_samples, tuple(self.keys.tolist()))


class Windowed(Stream):
    """Shards in a keyed random order, samples shuffled within each window of ``window``
    consecutive shards of that order (each window by its own keyed bijection)."""

    def __init__(self, shard_sizes: Sequence[int], window: int, seed: int, epoch: int) -> None:
        sizes = np.asarray(shard_sizes, dtype=np.int64)
        self.num_samples = int(sizes.sum())
        self.window = int(window)
        self._sizes = tuple(sizes.tolist())
        starts = np.zeros(len(sizes) + 1, np.int64)
        np.cumsum(sizes, out=starts[1:])
        keys = round_keys(seed, epoch, WINDOW)
        self._shard_keys = keys
        order = bijection(np.arange(len(sizes)), len(sizes), keys) if len(sizes) else np.zeros(0, np.int64)
        self.order = order  # shards in reading order
        self._first = starts[:-1][order]  # first global index of each shard, in reading order
        self._ocum = np.zeros(len(sizes) + 1, np.int64)  # positions where each shard (reading order) begins
        np.cumsum(sizes[order], out=self._ocum[1:])
        nwin = -(-len(sizes) // self.window)
        self._wstart = self._ocum[np.minimum(np.arange(nwin + 1) * self.window, len(sizes))]  # windows' first positions

    def __len__(self) -> int:
        return self.num_samples

    def _at(self, pos: np.ndarray) -> np.ndarray:
        w = np.searchsorted(self._wstart, pos, side="right") - 1
        base = self._wstart[w]
        local = bijection(pos - base, self._wstart[w + 1] - base, self._shard_keys, sub=w)
        off = base + local  # the sample's offset in the shards' reading order
        s = np.searchsorted(self._ocum, off, side="right") - 1
        return self._first[s] + (off - self._ocum[s])

    @property
    def _key(self) -> tuple:
        return (self._sizes, self.window, tuple(self._shard_keys.tolist()))


def sorted_unique(a: np.ndarray) -> np.ndarray:
    """``np.unique(a)`` (int64), without its sort when ``a`` is sorted already (a pass's
    positions are, but where padding wraps around): a fraction of its cost on a batch."""
    if len(a) > 1 and not bool((a[1:] >= a[:-1]).all()):
        return np.unique(a)
    keep = np.empty(len(a), bool)
    keep[:1] = True
    np.not_equal(a[1:], a[:-1], out=keep[1:])
    return a[keep]


def uniforms(key: int, positions: np.ndarray) -> np.ndarray:
    """A uniform float64 in [0, 1) per position, a pure function of (key, position):
    SplitMix64's output at step ``position`` of a generator seeded with ``key``, top 53 bits."""
    with np.errstate(over="ignore"):
        z = positions.astype(np.uint64) * GOLDEN_GAMMA + np.uint64(key)
        return (splitmix64(z) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


class Weighted(Stream):
    """``num_draws`` draws with replacement with probability proportional to the weights
    whose cumulative sums are ``cdf`` (float64), keyed by (seed, epoch): position ``p`` draws
    the index whose cumulative interval holds ``uniforms(key, p) * cdf[-1]`` (inverse CDF:
    exact for any number of samples). The search starts from a guide table (Chen and Asau's
    indexed search: for each of ``len(cdf)`` equal slices of ``[0, cdf[-1])``, the first index
    whose interval reaches into it), so a draw costs a few steps, not ``log2 N`` cache misses.
    ``table``: ``(cdf, guide, last)`` from :func:`~fastload.sampling.tables.weight_table`
    (built once per node, see there)."""

    def __init__(self, table: tuple[np.ndarray, np.ndarray, int], num_draws: int, seed: int, epoch: int) -> None:
        self.table = table
        self.cdf, self.guide, self.last = table
        self.num_samples, self.num_draws = len(self.cdf), int(num_draws)
        self.key = int(round_keys(seed, epoch, WEIGHTED)[0])

    def __len__(self) -> int:
        return self.num_draws

    def _at(self, pos: np.ndarray) -> np.ndarray:
        cdf, guide = self.cdf, self.guide
        total, g = float(cdf[-1]), len(guide) - 1
        u = uniforms(self.key, pos) * total
        order = np.argsort(u)  # sorted, the lookups below walk the tables in order (cache-friendly)
        u = u[order]
        b = np.minimum((u * (g / total)).astype(np.int64), g - 1)
        # the answer, searchsorted(cdf, u, "right"), lies in [guide[b], guide[b + 1]]; one slice
        # more on each side absorbs the rounding of b
        lo = guide[np.maximum(b - 1, 0)].astype(np.int64)
        hi = guide[np.minimum(b + 2, g)].astype(np.int64)
        while True:  # bisection of every bracket at once
            act = np.flatnonzero(lo < hi)
            if not act.size:
                break
            mid = (lo[act] + hi[act]) >> 1
            right = cdf[mid] <= u[act]
            lo[act[right]] = mid[right] + 1
            hi[act[~right]] = mid[~right]
        np.minimum(lo, self.last, out=lo)  # u rounded up to cdf[-1]: the last positive weight
        out = np.empty_like(lo)
        out[order] = lo
        return out

    @property
    def _key(self) -> tuple:
        return (id(self.cdf), self.num_draws, self.key)


class Balanced(Stream):
    """``num_draws`` class-balanced draws (``batch_size`` ``B``, ``C`` classes), per position.

    Chunk ``c`` (positions ``cB..cB+B-1``, one rank's batch) holds ``B // C`` slots of every
    class plus ``B % C`` extra slots; the extra slots of all chunks, one after the other,
    are passes of keyed permutations of the classes (so over the epoch every class gets the
    same number, within one). A keyed bijection of the chunk's ``B`` slots (its own key)
    shuffles them. The ``t``-th slot of class ``k`` in stream order (counted from the
    chunks before, in O(1), plus the rank inside the chunk) reads sample ``t mod n_k`` of
    pass ``t // n_k`` over class ``k``'s ``n_k`` samples, each pass a keyed bijection: minority
    classes repeat in fresh orders, majority classes are subsampled.
    ``table``: ``(members, starts)`` from :func:`~fastload.sampling.tables.balance_table`
    (built once per node, see there)."""

    def __init__(self, table: tuple[np.ndarray, np.ndarray], num_draws: int, batch_size: int, seed: int,
                 epoch: int) -> None:
        self.members, self.starts = table
        self.sizes = np.diff(self.starts)
        self.classes = len(self.sizes)
        self.num_samples, self.num_draws, self.batch = len(self.members), int(num_draws), int(batch_size)
        self.per, self.extra = divmod(self.batch, self.classes)
        keys = round_keys(seed, epoch, BALANCED)
        self._keys = keys
        self._slot_keys = keys  # a chunk's layout: derive_keys(., chunk)
        sub = derive_keys(keys, np.array([1, 2], np.uint64) << np.uint64(62))
        self._class_keys, self._member_keys = sub[:, 0].copy(), sub[:, 1].copy()

    def __len__(self) -> int:
        return self.num_draws

    def _extra_class(self, q: np.ndarray) -> np.ndarray:
        """The class of extra slot ``q`` (passes of keyed permutations of the classes)."""
        c = self.classes
        return bijection(q % c, c, self._class_keys, sub=q // c)

    def _extra_before(self, k: np.ndarray, q: np.ndarray) -> np.ndarray:
        """How many of the extra slots ``0..q-1`` hold class ``k``: one per whole pass, plus
        one if ``k`` comes before ``q mod C`` in the pass ``q`` is in."""
        c = self.classes
        p, r = q // c, q % c
        where = bijection(k, c, self._class_keys, sub=p, inverse=True)
        return p + (where < r)

    def _at(self, pos: np.ndarray) -> np.ndarray:
        b, c = self.batch, self.classes
        chunks = sorted_unique(pos // b)  # every slot of the chunks asked for: ranks inside a chunk need them all
        ch = np.repeat(chunks, b)
        j = np.tile(np.arange(b, dtype=np.int64), len(chunks))
        m = bijection(j, b, self._slot_keys, sub=ch)
        cls = m % c
        ext = np.flatnonzero(m >= self.per * c)
        if ext.size:
            cls[ext] = self._extra_class(ch[ext] * self.extra + (m[ext] - self.per * c))
        # the rank of each slot among its chunk's slots of the same class, in stream order
        order = np.lexsort((j, cls, ch))
        key = ch[order] * c + cls[order]
        new = np.empty(len(key), bool)
        new[0] = True
        np.not_equal(key[1:], key[:-1], out=new[1:])
        first = np.flatnonzero(new)
        rank = np.empty(len(j), np.int64)
        rank[order] = np.arange(len(j)) - np.repeat(first, np.diff(first, append=len(j)))
        t = ch * self.per + rank
        if self.extra:
            t += self._extra_before(cls, ch * self.extra)
        n_k = self.sizes[cls]
        passes, i = t // n_k, t % n_k
        mem = bijection(i, n_k, self._member_keys, sub=passes * c + cls)
        sample = self.members[self.starts[cls] + mem]
        return sample[np.searchsorted(chunks, pos // b) * b + pos % b]

    @property
    def _key(self) -> tuple:
        return (id(self.members), self.num_draws, self.batch, tuple(self._keys.tolist()))


class Drawn(Stream):
    """A stream computed whole: an array of global sample indices."""

    def __init__(self, array: np.ndarray, num_samples: int | None = None) -> None:
        self.array = np.asarray(array)
        self.num_samples = int(num_samples if num_samples is not None
                               else (int(self.array.max()) + 1 if self.array.size else 0))

    def __len__(self) -> int:
        return len(self.array)

    def _at(self, pos: np.ndarray) -> np.ndarray:
        return self.array[pos].astype(np.int64)

    def __array__(self, dtype=None, copy=None):
        return self.array if dtype is None else self.array.astype(dtype, copy=False)

    @property
    def _key(self) -> tuple:
        return (id(self.array),)

    def same(self, other: object) -> bool:
        if isinstance(other, Drawn) and other.array is self.array:
            return True
        return len(other) == len(self) and bool(np.array_equal(self.array, np.asarray(other)))  # type: ignore[arg-type]


def permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """The keyed permutation of ``0..n-1`` (seed, epoch) materialised: the full shuffle's
    stream (:class:`Shuffled`) as an array."""
    return np.asarray(Shuffled(n, seed, epoch))


def window_permutation(shard_sizes: Sequence[int], window: int, seed: int, epoch: int) -> np.ndarray:
    """Shards in random order; samples shuffled within each window of ``window`` shards,
    materialised (:class:`Windowed`).

    Memory: at most ``window`` shards are being read at any time (by all ranks together),
    at the price of a less random order (samples from the same window are close together)."""
    return np.asarray(Windowed(shard_sizes, window, seed, epoch))

"""The per-sample tables of weighted and class-balanced draws, built once per node.

:class:`~fastload.sampling.order.Weighted` draws through the cumulative weights and a guide
table (12 bytes per sample below 2^31 samples), :class:`~fastload.sampling.order.Balanced`
through the samples grouped by class (8 bytes per sample): 120 and 80 GB at 10^10 samples.
Nothing per draw, but held by every rank of a node they would cost that once per rank.

From :data:`~fastload.runtime.kept.MAP_MIN` samples on they are kept in the node-local cache
directory instead (:func:`fastload.runtime.kept.kept_arrays`, the machinery that keeps a
dataset's lengths): ``tables/weighted-v1/<key>/{cdf,guide}.npy`` and
``tables/balanced-v1/<key>/{members,starts}.npy``, where ``key`` is the xxh3-128 of the
weights' or labels' content (dtype, shape and bytes, hashed in chunks: never the array's
identity) and ``v1`` the table's format version. One process of the node builds a table (the
others wait for it, then map its files), in chunks of :data:`CHUNK` samples through memory
maps, so building costs a few chunks of memory, not the table; every process then maps it
read-only and shares its pages. A file of the wrong size or header is built again. Smaller
tables, labels of Python objects, and a machine without a usable cache directory (a warning
says so) hold the table in memory. Kept or not, a table is the same to the last bit: it is
built by the same chunked functions (:func:`fill_weight_table`, :func:`fill_balance_table`).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..runtime.kept import MAP_MIN, content_key, kept_arrays, kept_folder
from .order import index_dtype

__all__ = ["BALANCED_FORMAT", "CHUNK", "COPY_FORMAT", "WEIGHTED_FORMAT", "balance_table", "fill_balance_table",
           "fill_weight_table", "frozen", "own_copy", "weight_table"]

CHUNK = 1 << 20  # samples per step of a build (8 MB of float64; a few such arrays at a time)
WEIGHTED_FORMAT = "weighted-v1"  # (cdf float64, guide index_dtype(n + 1)); bump when either changes
BALANCED_FORMAT = "balanced-v1"  # (members int64, starts int64 of C + 1)
COPY_FORMAT = "copy-v1"  # (values: the array's dtype and length)


def frozen(a: np.ndarray) -> bool:
    """True when nothing in this process can change ``a``'s values: neither ``a`` nor any
    array it is a view of is writable, and the memory under them is a read-only memory map
    (``np.load(..., mmap_mode="r")``, a fastload kept file), immutable bytes, or an array
    that owns it and was made read-only (``flags.writeable = False``, taken at its word)."""
    import mmap

    x = a
    while isinstance(x, np.ndarray):
        if x.flags.writeable:
            return False
        if x.base is None:
            return True
        x = x.base
    if isinstance(x, mmap.mmap):
        with memoryview(x) as view:
            return view.readonly
    return isinstance(x, bytes)


def own_copy(a: np.ndarray, what: str) -> np.ndarray:
    """``a`` where nobody can change it (:func:`frozen`), else a read-only copy of it that the
    caller owns (same dtype), so that what is drawn from it and its digest in a resume state
    never change after construction: in memory below :data:`MAP_MIN` elements (or for Python
    objects), else copied once, in chunks, into a file kept per node
    (``tables/copy-v1/<key>/values.npy``, keyed by the content like the tables) and
    memory-mapped: the user's array is never read again, and the node's ranks share the
    copy's pages."""
    if frozen(a):
        return a
    n = len(a)
    if n < MAP_MIN or a.dtype.hasobject:
        c = np.array(a, copy=True)
        c.flags.writeable = False
        return c

    def build(alloc: Callable[..., np.ndarray]) -> None:
        out = alloc("values")
        for i in range(0, n, CHUNK):
            out[i:i + CHUNK] = a[i:i + CHUNK]

    folder = kept_folder("tables", COPY_FORMAT, content_key(COPY_FORMAT, a))
    return kept_arrays(folder, {"values": (a.dtype, (n,))}, build, what=f"a copy of the {n:,} {what}",
                       holds=f"{n:,} {what}")["values"]


def fill_weight_table(weights: np.ndarray, cdf: np.ndarray, guide: np.ndarray) -> int:
    """Fill ``cdf`` (the cumulative weights, float64: each sum as ``np.cumsum`` adds it, one
    after the other) and ``guide`` (``len(weights) + 1`` entries: ``guide[j]`` counts the
    samples whose cumulative weight lies below slice ``j`` of ``n`` equal slices of the
    total, ``guide[n] = n``) in chunks of :data:`CHUNK`; returns the last sample with a
    positive weight as the table sees it (the first whose cumulative weight is the total)."""
    n = len(weights)
    carry = 0.0
    for a in range(0, n, CHUNK):
        b = min(n, a + CHUNK)
        part = np.array(weights[a:b], dtype=np.float64)  # a copy: the user's array stays as it is
        part[0] += carry
        np.cumsum(part, out=cdf[a:b])
        carry = float(cdf[b - 1])
    total = carry
    scale = n / total
    # c[i] = the slice cdf[i] falls in (nondecreasing in i); guide[j] = #{i: c[i] < j}, so the
    # entries j in (c[a-1], c[b-1]] are a + the rank of j in chunk a..b's c
    nxt = 0  # the next guide entry to fill
    for a in range(0, n, CHUNK):
        b = min(n, a + CHUNK)
        c = (cdf[a:b] * scale).astype(np.int64)
        np.clip(c, 0, n, out=c)
        c0, hi = int(c[0]), min(int(c[-1]), n - 1)
        if nxt > hi:
            continue
        if c[-1] - c0 < 4 * CHUNK:  # below[t] = #{i in the chunk: c[i] < c0 + t}, by counting
            below = np.zeros(int(c[-1]) - c0 + 2, np.int64)
            np.cumsum(np.bincount(c - c0), out=below[1:])
            first = max(nxt, c0)
            guide[nxt:first] = a  # (entries at or below c0: every sample before the chunk)
            guide[first:hi + 1] = a + below[first - c0:hi + 1 - c0]
        else:  # a few heavy weights span many slices: search, a window of entries at a time
            for j0 in range(nxt, hi + 1, CHUNK):
                j1 = min(hi + 1, j0 + CHUNK)
                guide[j0:j1] = a + np.searchsorted(c, np.arange(j0, j1), side="left")
        nxt = hi + 1
    guide[nxt:n] = n
    guide[n] = n
    return int(np.searchsorted(cdf, total, side="left"))


def _check_weight_table(t: dict) -> bool:
    cdf, guide = t["cdf"], t["guide"]
    total = float(cdf[-1])
    return bool(np.isfinite(total) and total > 0 and guide[0] == 0 and guide[-1] == len(cdf) and cdf[0] >= 0)


def weight_table(weights: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """``(cdf, guide, last)`` of :class:`~fastload.sampling.order.Weighted` for ``weights``
    (checked already: >= 0, finite, not all zero): kept per node past ``MAP_MIN`` samples
    (see the module docstring), else in memory."""
    n = len(weights)
    specs = {"cdf": (np.float64, (n,)), "guide": (index_dtype(n + 1), (n + 1,))}
    folder = kept_folder("tables", WEIGHTED_FORMAT, content_key(WEIGHTED_FORMAT, weights)) if n >= MAP_MIN else None
    def build(alloc: Callable[..., np.ndarray]) -> None:
        fill_weight_table(weights, alloc("cdf"), alloc("guide"))

    t = kept_arrays(folder, specs, build,
                    what=f"the weighted-draw table of {n:,} weights", holds=f"a table of {n:,} weights",
                    check=_check_weight_table)
    cdf = t["cdf"]
    return cdf, t["guide"], int(np.searchsorted(cdf, cdf[-1], side="left"))


class _Classes:
    """The sorted distinct labels (found in chunks) and each label's class number: through a
    lookup table when the labels are integers of a small range, else a search."""

    def __init__(self, labels: np.ndarray) -> None:
        self.lut = None
        if labels.dtype.kind in "iub" and len(labels):
            lo = min(int(labels[a:a + CHUNK].min()) for a in range(0, len(labels), CHUNK))
            hi = max(int(labels[a:a + CHUNK].max()) for a in range(0, len(labels), CHUNK))
            if hi - lo < CHUNK and hi < 2**63:
                seen = np.zeros(hi - lo + 1, bool)
                for a in range(0, len(labels), CHUNK):
                    seen[labels[a:a + CHUNK].astype(np.int64) - lo] = True
                present = np.flatnonzero(seen)
                self.classes = (present + lo).astype(labels.dtype)
                self.lut = np.cumsum(seen) - 1  # value - lo -> class number
                self.lo = lo
                return
        classes = np.unique(labels[:CHUNK])
        for a in range(CHUNK, len(labels), CHUNK):
            classes = np.union1d(classes, np.unique(labels[a:a + CHUNK]))
        self.classes = classes

    def __len__(self) -> int:
        return len(self.classes)

    def of(self, part: np.ndarray) -> np.ndarray:
        if self.lut is not None:
            return self.lut[part.astype(np.int64) - self.lo]
        return np.searchsorted(self.classes, part)


def fill_balance_table(labels: np.ndarray, alloc: Callable[..., np.ndarray]) -> None:
    """Fill ``members`` (the samples grouped by class, classes in the order of
    ``np.unique(labels)``, ascending within a class) and ``starts`` (where each class's group
    starts, ``C + 1`` entries), allocated by ``alloc(name, shape)``, in chunks of
    :data:`CHUNK`: three passes over the labels (the classes, their sizes, the placing of each
    chunk's samples), a few chunks of memory plus a few numbers per class."""
    n = len(labels)
    classes = _Classes(labels)
    k = len(classes)
    counts = np.zeros(k, np.int64)
    for a in range(0, n, CHUNK):
        counts += np.bincount(classes.of(labels[a:a + CHUNK]), minlength=k)
    starts = alloc("starts", (k + 1,))
    starts[0] = 0
    np.cumsum(counts, out=starts[1:])
    members = alloc("members", (n,))
    fill = np.array(starts[:-1])  # where each class's next sample goes
    narrow = np.uint16 if k <= 1 << 16 else np.int64  # (a stable sort of 16-bit keys is a radix sort)
    for a in range(0, n, CHUNK):
        inv = classes.of(labels[a:a + CHUNK])
        order = np.argsort(inv.astype(narrow), kind="stable")
        cls = inv[order]
        got = np.bincount(inv, minlength=k)
        first = np.zeros(k, np.int64)
        np.cumsum(got[:-1], out=first[1:])
        members[fill[cls] + np.arange(len(cls)) - first[cls]] = a + order
        fill += got


def _check_balance_table(t: dict) -> bool:
    members, starts = t["members"], t["starts"]
    return bool(len(starts) >= 2 and starts[0] == 0 and starts[-1] == len(members))


def balance_table(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(members, starts)`` of :class:`~fastload.sampling.order.Balanced` for ``labels``:
    kept per node past ``MAP_MIN`` samples (see the module docstring), else in memory."""
    n = len(labels)
    specs = {"members": (np.int64, (n,)), "starts": (np.int64, None)}
    folder = None
    if n >= MAP_MIN and not labels.dtype.hasobject:
        folder = kept_folder("tables", BALANCED_FORMAT, content_key(BALANCED_FORMAT, labels))
    t = kept_arrays(folder, specs, lambda alloc: fill_balance_table(labels, alloc),
                    what=f"the class table of {n:,} labels", holds=f"a class table of {n:,} labels",
                    check=_check_balance_table)
    return t["members"], t["starts"]

"""What a Loader needs to know about every sample's length, from one pass kept per node.

Before its first batch, a Loader over a ragged field sizes its ring and plans its packed
passes from numbers over all ``N`` lengths (each truncated to ``max_length``): the longest
(a padded slot), the sum of the ``B`` longest (a packed slot), the mean (a typical batch),
the token total (a packed epoch's length) and how many short documents fit in a batch
(:func:`fastload.sampling.packing.max_pieces`, the most pieces a packed batch can hold).
Each of them was a pass over the lengths per Loader, and two copied all ``N`` of them (8
bytes each): at 10^9 documents each rank read 8 GB several times and held 16 GB more.

:func:`length_summary` computes all of them in one pass over chunks of the lengths (memory:
one chunk, a histogram of the lengths below :data:`HIST` and the :data:`TOP` longest), once
per process for an array, and once per **node** for lengths memory-mapped from fastload's
cache (``lengths-<field>.npy``: a local dataset's, a remote one's, a mixture's): kept beside
that file as ``lengths-<field>.summary-<max_length>.npz`` (a few hundred KB), written
atomically and checked against the file it summarises (its size, modification time, inode,
the array's offset and length) and against the very array it is used for (a
:func:`fingerprint` of :data:`PROBES` evenly spaced lengths read through it) when read, so a
later Loader, run or rank of the node reads a small file instead of ``N`` lengths. The node's
ranks starting together do not each compute it: one takes a kernel lock beside the file
(:func:`summary_lock`, the per-node lock of :mod:`fastload.runtime.kept`), the others wait for
it and read what it wrote (past :func:`~fastload.runtime.kept.build_wait_s`, a stopped holder,
they compute it too). A
process whose map is no longer the file at that path (the file was replaced, e.g. rebuilt
after a damaged copy was removed, while it held the old map) keeps nothing on disk, and a
summary is not written when the file changed while it was computed. A summary that cannot
be written (a read-only cache) is recomputed by each process.

Every number is exact but two bounds, which only size memory: the sum of the ``k`` longest
past :data:`TOP` (then ``top[-1]`` for each of the rest), and ``max_pieces``'s count of
documents of :data:`HIST` tokens or more that fit in a batch (then ``HIST`` tokens each):
both are upper bounds, as the ring's sizing needs.
"""
from __future__ import annotations

import logging
import mmap
import os
import re
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import xxhash

from ..files import atomic_write
from ..runtime.kept import Flock, build_wait_s

__all__ = ["HIST", "PROBES", "STEP", "TOP", "LengthSummary", "fingerprint", "kept_file", "length_summary", "summary_lock",
           "range_total", "same_file", "summary_path"]

logger = logging.getLogger("fastload")

HIST = 1 << 16  # lengths below this are counted exactly, per length
TOP = 4096  # the longest lengths kept (a packed slot sums the batch size's longest)
STEP = 1 << 18  # lengths read at a time (a few MB of temporaries)
PROBES = 4096  # lengths a fingerprint reads
_VERSION = 1
_KEPT_NAME = re.compile(r"lengths-.+\.npy")  # the files fastload's caches keep lengths in


@dataclass(frozen=True)
class LengthSummary:
    """``n`` lengths truncated to ``max_length``: their ``total``, how many are ``nonzero``,
    the ``longest``, ``hist[v]`` the count of length ``v`` for ``v < len(hist) <= HIST``
    (``len(hist)`` is past the longest below ``HIST``), ``long_count`` of ``HIST`` or more,
    and ``top`` the ``min(n, TOP)`` longest, longest first."""

    n: int
    max_length: int | None
    total: int
    nonzero: int
    longest: int
    hist: np.ndarray
    long_count: int
    top: np.ndarray

    @property
    def mean(self) -> float:
        return self.total / self.n if self.n else 0.0

    def longest_sum(self, k: int) -> int:
        """The sum of the ``k`` longest lengths (``k`` past ``n``: every length, plus the
        longest for each of the rest); past :data:`TOP`, an upper bound."""
        k = int(k)
        if k <= 0 or self.n == 0:
            return 0
        kept = min(k, len(self.top))
        out = int(self.top[:kept].sum())
        if k > kept:
            out += (k - kept) * (int(self.top[-1]) if k <= self.n else self.longest)
        return out

    def most_pieces(self, rows: int, length: int) -> int:
        """See :func:`fastload.sampling.packing.max_pieces` (this is its computation)."""
        size = rows * length
        if self.total == 0:
            return max(1, rows)  # no token: no batch
        passes, rest = divmod(size, self.total)
        h = self.hist[:size + 1].copy()  # longer documents never fit in the rest
        h[0] = 0
        tokens_upto = np.cumsum(h * np.arange(len(h), dtype=np.int64))  # tokens of all documents of length <= v
        v = int(np.searchsorted(tokens_upto, rest, side="right"))  # the first length not all of whose documents fit
        fit = int(h[:v].sum())
        if v < len(h):
            fit += (rest - int(tokens_upto[v - 1])) // v  # and as many of length v as fit
        elif size >= HIST:  # every counted one fits: documents of HIST tokens or more (at most this many)
            fit += min(self.long_count, (rest - int(tokens_upto[-1])) // HIST)
        whole = passes * self.nonzero + fit
        return int(min(size, rows + whole + 1))

    def _arrays(self) -> dict[str, np.ndarray]:
        ml = -1 if self.max_length is None else self.max_length
        head = [_VERSION, self.n, ml, self.total, self.nonzero, self.longest, self.long_count]
        return {"head": np.array(head, np.int64), "hist": self.hist, "top": self.top}

    @classmethod
    def _of(cls, a: Any) -> LengthSummary:
        head = [int(x) for x in a["head"]]
        if len(head) != 7 or head[0] != _VERSION:
            raise ValueError("another version")
        _, n, ml, total, nonzero, longest, long_count = head
        hist, top = np.asarray(a["hist"], np.int64), np.asarray(a["top"], np.int64)
        if hist.ndim != 1 or top.ndim != 1 or len(hist) > HIST or len(top) != min(n, TOP):
            raise ValueError("arrays of the wrong shape")
        return cls(n, None if ml < 0 else ml, total, nonzero, longest, hist, long_count, top)


def compute(lengths: Any, max_length: int | None = None) -> LengthSummary:
    """The summary of ``lengths`` (anything sliceable to int arrays: an array, a memory map),
    from one pass over chunks of :data:`STEP` of them."""
    n = len(lengths)
    hist = np.zeros(HIST + 1, np.int64)  # the last: HIST or more
    total = nonzero = longest = 0
    top = np.empty(0, np.int64)  # the longest so far, longest first
    for a in range(0, n, STEP):
        tok = np.asarray(lengths[a:a + STEP], dtype=np.int64)
        if max_length is not None:
            tok = np.minimum(tok, max_length)
        if not len(tok):
            continue
        if int(tok.min()) < 0:
            bad = a + int(np.argmin(tok))
            raise ValueError(f"length {int(tok.min())} of sample {bad} is negative: lengths count items")
        total += int(tok.sum())
        nonzero += int(np.count_nonzero(tok))
        longest = max(longest, int(tok.max()))
        hist += np.bincount(np.minimum(tok, HIST), minlength=HIST + 1)
        cand = tok if len(top) < TOP else tok[tok > top[-1]]
        if len(cand):
            both = np.concatenate([top, cand])
            if len(both) > TOP:
                both = np.partition(both, len(both) - TOP)[len(both) - TOP:]
            top = np.sort(both)[::-1].copy()
    long_count = int(hist[HIST])
    used = min(HIST, longest + 1) if n else 1
    return LengthSummary(n, max_length, total, nonzero, longest, hist[:used].copy(), long_count, top)


def fingerprint(lengths: Any) -> int:
    """A cheap fingerprint of ``lengths``' content: the xxh3-64 of their count and of
    :data:`PROBES` evenly spaced lengths (all of them below that), read through ``lengths``
    itself (a few thousand reads: 20-70 ms at 10^8 lengths in the page cache, 0.8 s from a
    cold file on this project's 2-core test machine; once per process and array)."""
    n = len(lengths)
    return _digest(n, np.asarray(lengths[_probes(n)], dtype=np.int64))


def _probes(n: int) -> np.ndarray:
    k = min(n, PROBES)
    return (np.arange(k, dtype=np.int64) * (n - 1)) // max(k - 1, 1)


def _digest(n: int, probed: np.ndarray) -> int:
    h = xxhash.xxh3_64(np.int64(n).tobytes())
    h.update(np.ascontiguousarray(probed, dtype=np.int64).tobytes())
    return h.intdigest() >> 1  # (an int64)


def _file_fingerprint(fd: int, offset: int, n: int, dtype: np.dtype) -> int:
    """:func:`fingerprint` of the ``n`` lengths of ``dtype`` at ``offset`` of open file ``fd``
    (read with ``pread``: no map of the file made for it)."""
    size = dtype.itemsize
    raw = b"".join(os.pread(fd, size, offset + int(i) * size) for i in _probes(n).tolist())
    return _digest(n, np.frombuffer(raw, dtype).astype(np.int64))


def _identity(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_size, st.st_mtime_ns, st.st_ino


def same_file(path: str | os.PathLike, source: tuple[int, ...]) -> bool:
    """Whether the file at ``path`` still has the identity (size, modification time, inode)
    ``source`` (:func:`kept_file`) begins with: checked again before a file made from it is
    written, so nothing computed while it was replaced is labelled with its identity."""
    try:
        return _identity(os.stat(path)) == tuple(source[:3])
    except OSError:
        return False


def kept_file(lengths: Any) -> tuple[Path, tuple[int, ...]] | None:
    """The ``lengths-*.npy`` file of fastload's caches that ``lengths`` maps whole and
    read-only (not a slice of it), and what identifies its content (size, modification time,
    inode, the array's offset, length and dtype, and the :func:`fingerprint` of ``lengths``);
    None for any other array, and for a map that is no longer the file at its path (the
    file was replaced since it was mapped: the fingerprint of the file open at the path
    differs): nothing computed from it is kept."""
    if not isinstance(lengths, np.memmap) or not isinstance(lengths.base, mmap.mmap) or lengths.ndim != 1:
        return None
    name = getattr(lengths, "filename", None)
    if not name or lengths.mode != "r" or not _KEPT_NAME.fullmatch(os.path.basename(name)):
        return None
    n, offset = len(lengths), int(lengths.offset)
    try:
        fd = os.open(name, os.O_RDONLY)
    except OSError:
        return None
    try:  # the identity and the fingerprint of one file: the one open
        st = os.fstat(fd)
        if offset + lengths.nbytes != st.st_size:  # the array must end where the file does
            return None
        mine = _remember(lengths, "fingerprint", lambda: fingerprint(lengths))
        there = _file_fingerprint(fd, offset, n, lengths.dtype)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    if there != mine:
        logger.debug("fastload: %s was replaced since this process mapped it; keeping nothing made from the old map",
                     name)
        return None
    return Path(name), (*_identity(st), offset, n, lengths.dtype.num, mine)


def summary_path(lengths: Any, max_length: int | None) -> tuple[Path, tuple[int, ...]] | None:
    """Where the summary of ``lengths`` is kept on the node, and what it must have been made
    from (:func:`kept_file`; None: not kept on disk)."""
    kept = kept_file(lengths)
    if kept is None:
        return None
    p, source = kept
    return p.with_name(f"{p.stem}.summary-{'all' if max_length is None else max_length}.npz"), source


def _read(path: Path, source: tuple[int, ...]) -> LengthSummary | None:
    try:
        with np.load(path, allow_pickle=False) as a:
            if tuple(int(x) for x in a["source"]) != source:
                return None
            return LengthSummary._of(a)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, EOFError) as e:
        logger.debug("fastload: %s is not a usable summary (%s); computing it again", path, e)
        return None


def _write(path: Path, source: tuple[int, ...], s: LengthSummary) -> None:
    a = s._arrays()
    src = np.array(source, np.int64)
    try:
        atomic_write(path, lambda f: np.savez(f, head=a["head"], hist=a["hist"], top=a["top"], source=src),
                     fsync=False)
    except OSError as e:  # a read-only cache: each process computes it
        logger.debug("fastload: could not keep the lengths' summary in %s (%s)", path, e)


_CACHE: dict[tuple[int, Any], Any] = {}
_LOCK = threading.Lock()


def _remember(lengths: Any, what: Any, make: Callable[[], Any]) -> Any:
    """``make()``, kept for as long as ``lengths`` lives when it cannot change (not a
    writable array) under ``what``."""
    key = (id(lengths), what)
    fixed = not (isinstance(lengths, np.ndarray) and lengths.flags.writeable)
    with _LOCK:
        got = _CACHE.get(key) if fixed else None
    if got is not None:
        return got
    v = make()
    if fixed:
        try:
            weakref.finalize(lengths, _CACHE.pop, key, None)
        except TypeError:  # not weakly referenceable (a list, a tuple): not kept
            return v
        with _LOCK:
            _CACHE[key] = v
    return v


def summary_lock(path: Path) -> Path:
    """The lock file under which one process of the node computes the summaries of the
    lengths file ``path`` (``.lengths-<field>.npy.summary.lock`` beside it; never deleted)."""
    return path.with_name(f".{path.name}.summary.lock")


def _summarise(lengths: Any, max_length: int | None) -> LengthSummary:
    kept = summary_path(lengths, max_length)
    if kept is None:
        return compute(lengths, max_length)
    path, source = kept
    s = _read(path, source)
    if s is not None:
        return s
    # one process of the node computes it (the ranks of a job start together): the others wait
    # for the kernel lock (fastload.runtime.kept.Flock), then read what it wrote; past the
    # deadline (a stopped holder) or without a usable lock (a read-only cache) they compute it too
    lock, waited = None, False
    try:
        try:
            lock = Flock(summary_lock(Path(lengths.filename)))
            if not lock.try_lock():
                waited = True
                logger.info("fastload: waiting for another process of this node, which summarises %s",
                            lengths.filename)
                if not lock.lock(build_wait_s(len(lengths))):
                    logger.warning("fastload: another process of this node has been summarising %s for too long; "
                                   "this one does it too", lengths.filename)
            s = _read(path, source)  # written meanwhile by the process that held the lock
        except OSError as e:
            logger.debug("fastload: no lock for the lengths' summary beside %s (%s)", lengths.filename, e)
        if s is None and waited and lock is not None:
            # the holder wrote nothing (its write failed: a full disk, or the file was replaced):
            # compute without the lock, as every waiter will, rather than one after the other
            lock.close()
            lock = None
        if s is None:
            s = compute(lengths, max_length)
            if same_file(lengths.filename, source):  # not replaced meanwhile
                _write(path, source, s)
        return s
    finally:
        if lock is not None:
            lock.close()


def length_summary(lengths: Any, max_length: int | None = None) -> LengthSummary:
    """The :class:`LengthSummary` of ``lengths`` truncated to ``max_length`` (see the module
    docstring): kept for as long as ``lengths`` lives when it cannot change (not a writable
    array), and on the node beside a memory-mapped ``lengths-*.npy`` of fastload's caches."""
    return _remember(lengths, ("summary", max_length), lambda: _summarise(lengths, max_length))


def range_total(lengths: Any, start: int, stop: int, max_length: int | None = None) -> int:
    """The tokens of ``lengths[start:stop]`` (each truncated to ``max_length``): for all of
    them the summary's total (:func:`length_summary`: kept on the node), else counted in
    chunks of :data:`STEP` once per process for lengths that cannot change (a mixture's
    dataset: its whole passes count the same every epoch)."""
    start, stop = int(start), int(stop)
    if start == 0 and stop == len(lengths):
        return length_summary(lengths, max_length).total

    def count() -> int:
        total = 0
        for a in range(start, stop, STEP):
            tok = np.asarray(lengths[a:min(stop, a + STEP)], dtype=np.int64)
            total += int((tok if max_length is None else np.minimum(tok, max_length)).sum())
        return total

    return _remember(lengths, ("range", start, stop, max_length), count)

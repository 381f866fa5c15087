"""Sequence packing: an epoch's documents cut into rows of exactly ``N`` tokens.

``Loader(..., pack_to=N)`` reads the epoch's sample stream (the sampler's order, identical
on every rank) as one **token stream**: the documents' tokens one after the other. Global
step ``k`` covers ``W * rows * N`` consecutive tokens of it; rank ``r`` takes the ``r``-th
block of ``rows * N`` and cuts it into ``rows`` rows of ``N``. A document that does not fit
in what is left of a row continues at the start of the next row (the standard
concatenate-and-chunk of language-model pretraining), so every token is read once and no
row holds padding. Each row is a list of *pieces* ``(document, first token, tokens)``; a
piece never crosses a row boundary, so ``cu_seqlens`` over the batch are piece boundaries.

The resume state is one number, like the sampler's: the global count of tokens consumed.
Which document and which of its tokens come next is a pure function of it, so a resumed run
continues inside a document exactly where it stopped, at any world size.

Coverage follows ``DistributedSampler``: with ``drop_last=False`` the last step wraps around
to the start of the epoch's token stream (every row is full; the first tokens are read
again — several times when one batch is longer than the whole stream), with
``drop_last=True`` the tokens of an incomplete last step are not read.

A pass reads the stream in chunks as it advances (:class:`TokenStream`): a batch's pieces
are computed when it is asked for, from the chunks holding its tokens, and nothing per
document of the epoch is held (the token count before each chunk: 8 bytes per 65,536
documents). Where the rows of a step begin depends on the lengths of every document before
them, so each rank reads the lengths of the whole global step (``W * rows * N`` tokens of
documents, not only its own share) and resuming at token ``t`` reads the stream's lengths
up to ``t``: per document one stream position (the keyed bijection) and one 8-byte read of
its length, about 50-100 ns on one core: seconds per 10^8 documents before ``t``
(bench/bench_scale.py's packed pass at 10^8 documents resumes 6.0x10^7 documents in, 3-5 s;
the time grows with ``t``, the memory does not: chunks are read and dropped) — unless the
node kept the epoch's chunk counts from an earlier pass (lengths memory-mapped from
fastload's cache; see :class:`TokenStream`): then milliseconds. The ring is sized
once for the most pieces any batch can have in any order of the documents
(:func:`max_pieces`, from a histogram of the lengths kept per node with the epoch's token
count: :mod:`fastload.sampling.length_summary`).
"""
from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import re
import threading
import time
import weakref
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np

from ..files import atomic_write, temp_pattern
from .length_summary import kept_file, length_summary, same_file
from .order import CHUNK, Natural, Shuffled, Windowed

logger = logging.getLogger("fastload")

__all__ = ["PackPlan", "Request", "TokenBatches", "TokenStream", "epoch_pieces", "max_pieces", "pack_bounds",
           "pack_plan", "pieces", "token_total"]


class Request(NamedTuple):
    """One batch asked of a source: global sample index per row, the stream position of the
    batch (samples; tokens when packing), and, when packing, each row's window of items in
    the packed field and the stream position of its document."""

    index: np.ndarray
    position: int
    start: np.ndarray | None = None
    count: np.ndarray | None = None
    positions: np.ndarray | None = None  # stream position of each row (None: position + arange)

    def stream_positions(self) -> np.ndarray:
        if self.positions is not None:
            return self.positions
        return self.position + np.arange(len(self.index), dtype=np.int64)


def pack_bounds(start: int, total: int, world_size: int, rank: int, rows: int, length: int,
                drop_last: bool) -> list[tuple[int, int, int]]:
    """This rank's batches from token ``start`` of a ``total``-token stream: a list of
    ``(first token, end token, tokens consumed after the step)`` (positions past ``total``
    wrap around to the stream's start); :class:`TokenBatches` computes them without a list."""
    return list(TokenBatches(start, total, world_size, rank, rows, length, drop_last))


def pieces(cum: np.ndarray, begin: int, end: int, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The pieces of tokens ``begin..end-1`` of a token stream whose documents end at
    ``cum[1:]`` (``cum[0] == 0``), cut at every multiple of ``length`` past ``begin`` and at
    every document boundary: ``(stream position of the document, first token within it,
    tokens)``. Positions past ``cum[-1]`` wrap around; empty documents yield no piece."""
    total = int(cum[-1])
    cuts = [np.arange(begin, end, length, dtype=np.int64)]  # row starts
    for k in range(begin // total, (end - 1) // total + 1):  # each pass of the stream the range touches
        lo, hi = max(begin - k * total, 0), min(end - k * total, total)
        inner = cum[np.searchsorted(cum, lo, side="right"):np.searchsorted(cum, hi, side="left")]
        cuts.append(inner + k * total)  # document boundaries inside the range
        if 0 < k * total < end and k * total > begin:
            cuts.append(np.array([k * total], dtype=np.int64))  # the wrap-around
    at = np.union1d(np.concatenate(cuts), [end])  # sorted, unique: empty documents vanish
    first_tok = at[:-1] % total
    docs = np.searchsorted(cum, first_tok, side="right") - 1
    return docs.astype(np.int64), first_tok - cum[docs], np.diff(at)


class TokenBatches(Sequence):
    """This rank's batches of a packed pass, arithmetic (nothing per batch is held):
    batch ``k`` is ``(first token, end token, tokens consumed after the step)``, see
    :func:`pack_bounds` (the same values, as a list)."""

    def __init__(self, start: int, total: int, world_size: int, rank: int, rows: int, length: int,
                 drop_last: bool) -> None:
        self.start, self.total, self.rank = int(start), int(total), int(rank)
        self.per_rank = rows * length
        self.step = self.per_rank * world_size
        left = self.total - self.start
        if self.total <= 0 or left <= 0:
            self._n = 0
        else:
            self._n = left // self.step if drop_last else -(-left // self.step)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, k):  # type: ignore[override]
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(self._n))]
        k = int(k) + (self._n if int(k) < 0 else 0)
        if not 0 <= k < self._n:
            raise IndexError(f"batch {k} of a pass of {self._n}")
        s0 = self.start + k * self.step
        return (s0 + self.rank * self.per_rank, s0 + (self.rank + 1) * self.per_rank, s0 + self.step)


# stream -> {(id(lengths), len, max_length): (weak reference to the lengths, tokens)}
_STREAM_TOTALS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def token_total(lengths: np.ndarray, max_length: int | None = None) -> int:
    """The tokens of all documents (each truncated to ``max_length``): an epoch's token
    count when its stream reads every sample once. From the lengths' summary
    (:func:`~fastload.sampling.length_summary.length_summary`: one pass in chunks, kept per
    process and, for lengths memory-mapped from fastload's cache, per node)."""
    return length_summary(lengths, max_length).total


KEEP_NEW = 16  # chunks read past the kept index before it is written again (or an eighth of it, at most KEEP_MAX)
KEEP_MAX = 2048  # so a resume reads at most this many chunks (1.3x10^8 documents) past the last kept one
KEEP_FILES = 4  # chunk-count files kept per lengths file (the latest epochs'): older ones are deleted
TEMP_AGE = 600  # seconds after which a chunk-count file's temporary file is a killed write's
_SAME_EVERYWHERE = (Natural, Shuffled, Windowed)  # streams whose _key is the same in every process


def chunk_index_path(stream: Any, lengths: Any, max_length: int | None) -> Path | None:
    """Where the token counts before each chunk of ``stream``'s documents are kept on the
    node: beside lengths memory-mapped from fastload's cache
    (:func:`~fastload.sampling.length_summary.kept_file`), for a stream that is the same in
    every process (plain, shuffled, windowed; not draws, whose key is their table's), named
    ``lengths-<field>.chunks-<file>-<stream>.npy``: ``<file>`` a hash of the lengths file's
    identity and of the fingerprint of the very array read (so counts made from other
    lengths are never opened), ``<stream>`` a hash of the stream (its key, and a few of its
    indices: an order computed otherwise by another release is another stream),
    ``max_length`` and :data:`CHUNK`. None: not kept."""
    got = _chunk_index(stream, lengths, max_length)
    return None if got is None else got[0]


def _chunk_index(stream: Any, lengths: Any, max_length: int | None) -> tuple[Path, tuple[int, ...]] | None:
    """:func:`chunk_index_path`, and the lengths file's identity it was named from."""
    if type(stream) not in _SAME_EVERYWHERE:
        return None
    kept = kept_file(lengths)
    if kept is None:
        return None
    p, source = kept
    m = len(stream)
    probes = stream.at([0, m // 3, m // 2, m - 1]).tolist() if m else []
    what = json.dumps([type(stream).__name__, stream._key, probes, max_length, CHUNK])
    ident = hashlib.sha256(json.dumps(list(source)).encode()).hexdigest()[:12]
    name = f"{p.stem}.chunks-{ident}-{hashlib.sha256(what.encode()).hexdigest()[:20]}.npy"
    return p.with_name(name), source


def sweep_chunk_files(index: Path, keep: int = KEEP_FILES) -> None:
    """Delete the chunk-count files beside ``index`` (:func:`chunk_index_path`) of the same
    lengths file that cannot be read again: those of another identity of the file (it was
    replaced: their counts are of other lengths) or of an older naming, all but the
    ``keep`` latest (by modification time; ``index`` is always kept), and temporary files
    of writes killed (untouched for :data:`TEMP_AGE` s)."""
    stem, rest = index.name.split(".chunks-", 1)
    ours = re.compile(rf"{re.escape(stem)}\.chunks-{re.escape(rest.split('-', 1)[0])}-[0-9a-f]+\.npy")
    family = re.compile(rf"{re.escape(stem)}\.chunks-[0-9a-f-]+\.npy")
    temps = re.compile(temp_pattern(family.pattern))
    now, current = time.time(), []
    try:
        entries = list(os.scandir(index.parent))
    except OSError:
        return
    for e in entries:
        try:
            if ours.fullmatch(e.name):
                if e.name != index.name:
                    current.append((e.stat().st_mtime, e.path))
                continue
            if family.fullmatch(e.name) or (temps.fullmatch(e.name) and now - e.stat().st_mtime > TEMP_AGE):
                os.unlink(e.path)
        except OSError:  # removed by another process meanwhile, or not ours to remove
            continue
    for _, path in sorted(current, reverse=True)[max(keep - 1, 0):]:
        try:
            os.unlink(path)
        except OSError:
            continue


def _read_index(path: Path, chunks: int, total: int | None) -> list[int] | None:
    """The kept counts (``[0, tokens before chunk 1, ...]``) when they can be those of this
    stream: int64, from 0, never decreasing, at most ``chunks + 1``, within ``total``."""
    try:
        ck = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, EOFError) as e:
        logger.debug("fastload: %s is not a usable chunk index (%s); reading the lengths", path, e)
        return None
    ok = (ck.dtype == np.int64 and ck.ndim == 1 and 1 <= len(ck) <= chunks + 1 and int(ck[0]) == 0
          and bool(np.all(ck[1:] >= ck[:-1])))
    if ok and total is not None:
        ok = int(ck[-1]) <= total and (len(ck) < chunks + 1 or int(ck[-1]) == total)
    if not ok:
        logger.debug("fastload: %s does not hold this stream's chunk counts; reading the lengths", path)
        return None
    return ck.tolist()


class TokenStream:
    """An epoch's token stream computed in chunks of :data:`CHUNK` documents as it is read:
    documents ``stream[p]`` one after the other, each ``lengths[stream[p]]`` tokens
    (truncated to ``max_length``). Held: the token count before every chunk read so far
    (one integer per 65,536 documents) and the cumulative counts of the last few chunks, never
    an array over the epoch. ``total``: the epoch's tokens when known without reading the
    stream (a permutation of all samples: :func:`token_total`), else counted by one pass over
    the stream's chunks when first asked for.

    Where the lengths are memory-mapped from fastload's cache and the stream is the same in
    every process (:func:`chunk_index_path`), the token counts before each chunk read so far
    are kept beside them on the node (written again every :data:`KEEP_NEW` chunks or an
    eighth more, at most :data:`KEEP_MAX`, and when the stream is read to its end; 8 bytes
    per chunk, one file per epoch, the latest :data:`KEEP_FILES` of a lengths file kept:
    :func:`sweep_chunk_files`): a later pass over the same epoch (a resumed run, another
    rank of the node) starts from them and reads only the lengths past the last kept chunk
    before its tokens (10.9 s -> 3 ms for a resume 6x10^7 documents into an epoch of 10^8)."""

    _KEEP = 4  # chunks whose cumulative counts are kept

    def __init__(self, stream, lengths: np.ndarray, max_length: int | None = None, total: int | None = None) -> None:
        self.stream = stream
        self.lengths = lengths
        self.max_length = max_length
        self.m = len(stream)
        self.chunks = -(-self.m // CHUNK)
        self._ck = [0]  # tokens before chunk j, for every chunk read so far (and the end after the last)
        self._cums: dict[int, np.ndarray] = {}
        self._total = None if total is None else int(total)
        self._lock = threading.Lock()
        index = _chunk_index(stream, lengths, max_length)
        self._index: Path | None = None if index is None else index[0]
        self._source: tuple[int, ...] = () if index is None else index[1]
        known = _read_index(self._index, self.chunks, self._total) if self._index is not None else None
        if known is not None:
            self._ck = known
        self._written = len(self._ck)  # counts the index on disk holds

    def _keep(self) -> None:
        """Write the counts read so far beside the lengths (see the class docstring)."""
        n = len(self._ck)
        if self._index is None or n <= self._written or (
                n < self.chunks + 1 and n - self._written < max(KEEP_NEW, min(self._written // 8, KEEP_MAX))):
            return
        if not same_file(getattr(self.lengths, "filename", ""), self._source):  # replaced since: these counts are not its
            self._index = None
            return
        try:
            try:
                on_disk = len(np.load(self._index, mmap_mode="r", allow_pickle=False))
            except (OSError, ValueError, EOFError):
                on_disk = 0
            if on_disk < n:  # another process of the node may have read further
                ck = np.array(self._ck, np.int64)
                atomic_write(self._index, lambda f: np.save(f, ck), fsync=False)
                if not on_disk:  # a new file: the stale and the oldest of this lengths file's go
                    sweep_chunk_files(self._index)
        except OSError as e:  # a read-only cache: not kept
            logger.debug("fastload: could not keep the chunk counts in %s (%s)", self._index, e)
            self._index = None
        self._written = n

    def _indices(self, j: int) -> np.ndarray:
        a, b = j * CHUNK, min(self.m, (j + 1) * CHUNK)
        return np.asarray(self.stream[a:b], dtype=np.int64)

    def _tokens(self, j: int, idx: np.ndarray | None = None) -> np.ndarray:
        tok = np.asarray(self.lengths[self._indices(j) if idx is None else idx], dtype=np.int64)
        return tok if self.max_length is None else np.minimum(tok, self.max_length)

    def doc_chunks(self, lo: int, hi: int) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """``(stream position of its first document, global sample indices, cumulative token
        counts)`` of each chunk of documents holding tokens ``lo..hi-1`` (``0 <= lo < hi <=
        total``), one chunk at a time, in order (the counts absolute: one entry more than the
        indices). Held meanwhile: one chunk
        (what a remote cache's plan reads, never the epoch's documents whole)."""
        with self._lock:
            self._read_past(lo)
            j = bisect.bisect_right(self._ck, lo) - 1
        while j < self.chunks:
            idx = self._indices(j)
            tok = self._tokens(j, idx)
            cum = np.empty(len(tok) + 1, np.int64)
            with self._lock:
                cum[0] = self._ck[j]
            np.cumsum(tok, out=cum[1:])
            cum[1:] += cum[0]
            with self._lock:
                if j + 1 == len(self._ck):
                    self._ck.append(int(cum[-1]))
            yield j * CHUNK, idx, cum
            if cum[-1] >= hi:
                return
            j += 1

    def _cum(self, j: int) -> np.ndarray:
        """Chunk ``j``'s cumulative token counts, absolute (``len + 1`` entries); ``j`` is read."""
        c = self._cums.get(j)
        if c is None:
            tok = self._tokens(j)
            c = np.empty(len(tok) + 1, np.int64)
            c[0] = self._ck[j]
            np.cumsum(tok, out=c[1:])
            c[1:] += c[0]
            if len(self._cums) >= self._KEEP:
                self._cums.pop(next(iter(self._cums)))
            self._cums[j] = c
            if j + 1 == len(self._ck):
                self._ck.append(int(c[-1]))
        return c

    def _read_past(self, t: int) -> None:
        """Read chunks until one ends past token ``t`` (or the stream ends)."""
        while self._ck[-1] <= t and len(self._ck) <= self.chunks:
            self._cum(len(self._ck) - 1)

    @property
    def total(self) -> int:
        return self.count()

    def count(self, check: Callable[[], None] | None = None) -> int:
        """:attr:`total`, counted now when not known yet; ``check()`` is called before each
        chunk of that count (a background planner's stop: it may raise to end the count; the
        sums counted so far stay with this object, consistent, and a later call goes on from
        them)."""
        if self._total is None:
            key = (id(self.lengths), len(self.lengths), self.max_length)
            try:  # (an id is reused once its object dies: the entry holds a weak reference to check)
                ref, known = _STREAM_TOTALS.get(self.stream, {}).get(key, (None, None))
            except TypeError:  # an array: not kept
                ref, known = None, None
            if ref is None or ref() is not self.lengths:
                known = None
            with self._lock:
                if known is not None:
                    self._total = known
                    return known
                counted = getattr(self.stream, "token_total", None)  # a stream that counts faster (a mixture's)
                if counted is not None:
                    self._total = int(counted(self.lengths, self.max_length, check=check))
                else:
                    while len(self._ck) <= self.chunks:  # one pass, the sums kept (a resume reads them)
                        if check is not None:
                            check()
                        j = len(self._ck) - 1
                        self._ck.append(self._ck[j] + int(self._tokens(j).sum()))
                    self._total = self._ck[-1]
                    self._keep()
            try:  # kept with the stream (a sampler keeps its epochs' streams): counted once per epoch
                _STREAM_TOTALS.setdefault(self.stream, {})[key] = (weakref.ref(self.lengths), self._total)
            except TypeError:  # (a stream or lengths without weak references: not kept)
                pass
        return self._total

    def window(self, lo: int, hi: int) -> tuple[int, np.ndarray]:
        """The documents holding tokens ``lo..hi-1`` (``0 <= lo < hi <= total``): the stream
        position of the first and their cumulative counts (``cum[0] <= lo``, ``cum[-1] >= hi``)."""
        with self._lock:
            self._read_past(hi - 1)
            self._keep()
            ck = self._ck
            j0, j1 = bisect.bisect_right(ck, lo) - 1, bisect.bisect_right(ck, hi - 1) - 1
            parts = [self._cum(j0)] + [self._cum(j)[1:] for j in range(j0 + 1, j1 + 1)]
        cum = parts[0] if len(parts) == 1 else np.concatenate(parts)
        a = int(np.searchsorted(cum, lo, side="right")) - 1
        b = int(np.searchsorted(cum, hi - 1, side="right")) - 1
        return j0 * CHUNK + a, cum[a:b + 2]

    def pieces(self, begin: int, end: int, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:func:`pieces` of tokens ``begin..end-1`` (past ``total`` the stream wraps around),
        reading only the chunks that hold them: ``(stream position of the document, first
        token within it, tokens)``."""
        total = self.total
        rows = np.arange(begin, end, length, dtype=np.int64)
        docs, firsts, counts = [], [], []
        for p in range(begin // total, (end - 1) // total + 1):  # each pass of the stream the batch touches
            base = p * total
            lo, hi = max(begin, base), min(end, base + total)
            d0, cum = self.window(lo - base, hi - base)
            cum = cum + base
            inner = cum[(cum > lo) & (cum < hi)]  # document starts inside (empty documents: repeated)
            cuts = np.unique(np.concatenate([np.array([lo, hi], np.int64), rows[(rows > lo) & (rows < hi)],
                                             inner]).astype(np.int64))  # (union1d with [] made float64)
            at = np.searchsorted(cum, cuts[:-1], side="right") - 1  # the last document starting there: not empty
            docs.append(d0 + at)
            firsts.append(cuts[:-1] - cum[at])
            counts.append(np.diff(cuts))
        return tuple(np.concatenate(x).astype(np.int64) for x in (docs, firsts, counts))  # type: ignore[return-value]


class PackPlan:
    """One rank's pass over a packed epoch, as a value (the packed twin of
    :class:`fastload.sampling.EpochPlan`): ``tokens`` the epoch's :class:`TokenStream`,
    ``bounds`` this rank's batches in tokens (:class:`TokenBatches`), ``start`` the global
    token count the pass begins at. A batch's pieces are computed when it is asked for
    (:meth:`request`), from the chunks of the stream that hold its tokens.

    ``stream`` and ``cum`` materialise the epoch's samples and their cumulative token counts
    (for tests); the pass itself never needs them, nor does a remote cache's plan (it reads
    :meth:`TokenStream.doc_chunks`)."""

    def __init__(self, epoch: int, start: int, tokens: TokenStream, length: int, bounds: TokenBatches) -> None:
        self.epoch, self.start, self.tokens, self.length, self.bounds = epoch, start, tokens, length, bounds
        self._most = 0  # the most pieces of a batch asked for so far

    def __len__(self) -> int:
        return len(self.bounds)

    @property
    def total(self) -> int:
        """The epoch's tokens (before padding)."""
        return self.tokens.total

    @property
    def end(self) -> int:
        last = self.bounds[-1][2] if len(self.bounds) else self.start
        return max(last, self.total)

    @cached_property
    def stream(self) -> np.ndarray:
        return np.asarray(self.tokens.stream)

    @cached_property
    def cum(self) -> np.ndarray:
        t = self.tokens
        tok = np.asarray(t.lengths[self.stream], dtype=np.int64)
        if t.max_length is not None:
            tok = np.minimum(tok, t.max_length)
        cum = np.zeros(len(tok) + 1, dtype=np.int64)
        np.cumsum(tok, out=cum[1:])
        return cum

    @property
    def most_pieces(self) -> int:
        """The most pieces one batch of this pass asked for so far has (the first batch's
        when none was: 0 without batches)."""
        if not self._most and len(self):
            self.request(0)
        return self._most

    def request(self, k: int) -> Request:
        b, e, _ = self.bounds[k]
        docs, first, count = self.tokens.pieces(b, e, self.length)
        self._most = max(self._most, len(docs))
        index = np.asarray(self.tokens.stream[docs], dtype=np.int64) if len(docs) else np.empty(0, np.int64)
        return Request(index, b, first, count, docs)

    def requests(self) -> Iterator[tuple[Request, int]]:
        for k in range(len(self.bounds)):
            yield self.request(k), self.bounds[k][2]


def epoch_pieces(cum: np.ndarray, begins: np.ndarray, ends: np.ndarray,
                 length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`pieces` of many batches at once: batch ``k`` covers tokens ``begins[k]..ends[k]-1``
    (increasing, disjoint; past ``cum[-1]`` the stream wraps around, any number of times).
    Returns ``(docs, first, count, batch_first)``: the pieces of every batch one after the
    other, and where each batch's pieces begin (``len(begins) + 1`` entries)."""
    total = int(cum[-1])
    if len(begins) == 0 or total <= 0:
        e = np.empty(0, np.int64)
        return e, e, e, np.zeros(len(begins) + 1, np.int64)
    rows = -(-int((ends - begins).max()) // length)
    # every row start, then every document start that falls inside a batch (empty documents
    # start nowhere): each batch split at the passes of the stream it spans, the documents
    # starting in each piece found by binary search — only this rank's, never every pass's
    row_starts = (begins[:, None] + np.arange(rows, dtype=np.int64) * length).ravel()
    row_starts = row_starts[row_starts < np.repeat(ends, rows)]
    doc_starts = cum[:-1][cum[1:] > cum[:-1]]
    p0, p1 = begins // total, (ends - 1) // total
    spans = p1 - p0 + 1
    seg_pass = np.repeat(p0, spans) + (np.arange(int(spans.sum())) - np.repeat(np.cumsum(spans) - spans, spans))
    seg_lo = np.maximum(np.repeat(begins, spans), seg_pass * total) - seg_pass * total
    seg_hi = np.minimum(np.repeat(ends, spans), (seg_pass + 1) * total) - seg_pass * total
    i0 = np.searchsorted(doc_starts, seg_lo, side="left")
    n = np.searchsorted(doc_starts, seg_hi, side="left") - i0
    first_of = np.cumsum(n) - n
    pick = np.arange(int(n.sum())) - np.repeat(first_of - i0, n)  # the ranges i0..i0+n-1, one after the other
    inside = doc_starts[pick] + np.repeat(seg_pass * total, n)
    cuts = np.union1d(row_starts, inside)  # sorted, unique
    batch = np.searchsorted(begins, cuts, side="right") - 1
    stop = np.minimum(np.append(cuts[1:], ends[-1]), ends[batch])  # the next cut or the batch's end
    first_tok = cuts % total
    docs = np.searchsorted(cum, first_tok, side="right") - 1
    batch_first = np.searchsorted(cuts, begins, side="left")
    return (docs.astype(np.int64), first_tok - cum[docs], stop - cuts,
            np.append(batch_first, len(cuts)).astype(np.int64))


def pack_plan(epoch: int, start: int, stream, lengths: np.ndarray, *, rows: int, length: int,
              world_size: int, rank: int, drop_last: bool, max_length: int | None = None,
              total: int | None = None, check: Callable[[], None] | None = None) -> PackPlan:
    """The packed pass over ``stream`` (global sample indices: a per-position
    :class:`~fastload.sampling.order.Stream` or an array) whose samples have ``lengths``
    tokens (indexed by global sample index; truncated to ``max_length``). ``total``: the
    epoch's tokens when known (:func:`token_total` when the stream reads every sample once),
    else counted from the stream (one pass over it, in chunks; ``check()`` is called before
    each chunk: :meth:`TokenStream.count`)."""
    tokens = TokenStream(stream, lengths, max_length, total)
    bounds = TokenBatches(start, tokens.count(check), world_size, rank, rows, length, drop_last)
    return PackPlan(epoch, start, tokens, length, bounds)


def max_pieces(lengths: np.ndarray, rows: int, length: int, max_length: int | None = None) -> int:
    """An upper bound on the pieces of one batch of ``rows`` rows of ``length`` tokens, in any
    order of the documents: one piece per row plus one per document start inside the batch.
    Those documents, but the last, lie whole inside the batch, and they follow each other in
    the epoch's token stream, which wraps around when the batch is longer than what is left
    of it (``drop_last=False``) — as many times as the batch is longer than the whole stream.
    So at most ``q`` whole passes over the documents (``q = rows * length // total``), plus
    the shortest documents that fit in the rest, plus one.
    Counted from the lengths' histogram (:func:`~fastload.sampling.length_summary.length_summary`:
    one pass in chunks, kept per process and per node; no sorted copy of the lengths), exact
    unless documents of 65,536 tokens or more fit in the rest (then counted as that long)."""
    return length_summary(lengths, max_length).most_pieces(rows, length)

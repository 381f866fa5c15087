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

A pass's pieces are computed for all its batches at once, vectorised, when it begins
(:func:`epoch_pieces`); the ring is sized once for the most pieces any batch can have in any
order of the documents (:func:`max_pieces`).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Iterator, NamedTuple

import numpy as np

__all__ = ["PackPlan", "Request", "epoch_pieces", "max_pieces", "pack_bounds", "pack_plan", "pieces"]


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
    wrap around to the stream's start)."""
    if total <= 0 or start >= total:
        return []
    per_rank = rows * length
    step = per_rank * world_size
    left = total - start
    steps = left // step if drop_last else -(-left // step)
    out = []
    for k in range(steps):
        s0 = start + k * step
        out.append((s0 + rank * per_rank, s0 + (rank + 1) * per_rank, s0 + step))
    return out


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


@dataclass(frozen=True)
class PackPlan:
    """One rank's pass over a packed epoch, as a value (the packed twin of
    :class:`fastload.sampling.EpochPlan`): ``stream`` the epoch's samples, ``cum`` their
    cumulative token counts, ``bounds`` this rank's batches in tokens, ``start`` the global
    token count the pass begins at.

    The pieces of every batch of the pass are computed at once, vectorised, on first use
    (:meth:`request` then only slices them): arrays with one entry per piece, in batch order.
    """

    epoch: int
    start: int
    stream: np.ndarray
    cum: np.ndarray
    length: int
    bounds: tuple[tuple[int, int, int], ...]

    def __len__(self) -> int:
        return len(self.bounds)

    @property
    def end(self) -> int:
        last = self.bounds[-1][2] if self.bounds else self.start
        return max(last, int(self.cum[-1]))

    @cached_property
    def _pieces(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(first piece of each batch (len + 1), sample index, first token, tokens, stream
        position)`` of every piece of the pass."""
        begins = np.array([b for b, _, _ in self.bounds], dtype=np.int64)
        ends = np.array([e for _, e, _ in self.bounds], dtype=np.int64)
        docs, first, count, batch_first = epoch_pieces(self.cum, begins, ends, self.length)
        return batch_first, self.stream[docs].astype(np.int64), first, count, docs

    @property
    def most_pieces(self) -> int:
        """The most pieces one batch of this pass has (0 without batches)."""
        batch_first = self._pieces[0]
        return int(np.diff(batch_first).max(initial=0))

    def request(self, k: int) -> Request:
        batch_first, index, first, count, docs = self._pieces
        a, b = batch_first[k], batch_first[k + 1]
        return Request(index[a:b], self.bounds[k][0], first[a:b], count[a:b], docs[a:b])

    def requests(self) -> Iterator[tuple[Request, int]]:
        for k, (_, _, after) in enumerate(self.bounds):
            yield self.request(k), after


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


def pack_plan(epoch: int, start: int, stream: np.ndarray, lengths: np.ndarray, *, rows: int, length: int,
              world_size: int, rank: int, drop_last: bool, max_length: int | None = None) -> PackPlan:
    """The packed pass over ``stream`` (global sample indices) whose samples have
    ``lengths`` tokens (indexed by global sample index; truncated to ``max_length``)."""
    tok = lengths[stream]
    if max_length is not None:
        tok = np.minimum(tok, max_length)
    cum = np.zeros(len(stream) + 1, dtype=np.int64)
    np.cumsum(tok, out=cum[1:])
    bounds = pack_bounds(start, int(cum[-1]), world_size, rank, rows, length, drop_last)
    return PackPlan(epoch, start, stream, cum, length, tuple(bounds))


def max_pieces(lengths: np.ndarray, rows: int, length: int, max_length: int | None = None) -> int:
    """An upper bound on the pieces of one batch of ``rows`` rows of ``length`` tokens, in any
    order of the documents: one piece per row plus one per document start inside the batch.
    Those documents, but the last, lie whole inside the batch, and they follow each other in
    the epoch's token stream, which wraps around when the batch is longer than what is left
    of it (``drop_last=False``) — as many times as the batch is longer than the whole stream.
    So at most ``q`` whole passes over the documents (``q = rows * length // total``), plus
    the shortest documents that fit in the rest, plus one."""
    tok = lengths if max_length is None else np.minimum(lengths, max_length)
    nz = np.sort(tok[tok > 0]).astype(np.int64)
    total = int(nz.sum())
    if total == 0:
        return max(1, rows)  # no token: no batch
    size = rows * length
    passes, rest = divmod(size, total)
    whole = passes * len(nz) + int(np.searchsorted(np.cumsum(nz), rest, side="right"))
    return int(min(size, rows + whole + 1))

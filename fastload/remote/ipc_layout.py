"""Where a column's buffers are in an Arrow IPC file, from its footer and one message header.

A ragged field's per-sample lengths are its offsets buffer (int64, rows + 1) — a few bytes
per sample, somewhere inside a shard of megabytes. To read only that buffer of a remote
shard (:mod:`fastload.remote.lengths`), this module parses the two small flatbuffers that
locate it, as the Arrow IPC format defines them (format/File.fbs, Message.fbs, Schema.fbs):

1. the file's tail: ``<footer flatbuffer> <int32 footer length> "ARROW1"``. The footer holds
   the schema (its field tree) and one ``Block`` per record batch: ``(offset,
   metaDataLength, bodyLength)``;
2. the record batch's message at ``Block.offset``: an encapsulated ``Message`` (``0xFFFFFFFF``,
   int32 length, flatbuffer) whose ``RecordBatch`` header lists one ``FieldNode`` (length,
   null count) per field in depth-first order and one ``Buffer`` (offset, length into the
   body, which starts at ``Block.offset + metaDataLength``) per buffer of those fields.

A field's buffers in the body follow from its type: validity + data for fixed-width types,
validity + offsets + data for (large) binary and strings, validity + offsets then the child
for (large) lists, validity then the child for fixed-size lists, validity then the children
for structs (a dictionary-encoded field: validity + indices). pyarrow has no API for this:
``IpcReadOptions(included_fields=)`` still reads the list's values.

Every read is bounds-checked; anything unexpected raises :class:`LayoutError` (never an
IndexError from a stray offset).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

__all__ = ["Block", "LayoutError", "ListColumn", "MAGIC", "footer_length", "list_column", "parse_footer"]

MAGIC = b"ARROW1"

# Buffers in a record batch body per type (Schema.fbs union Type), children not included.
_BUFFERS = {1: 0, 2: 2, 3: 2, 4: 3, 5: 3, 6: 2, 7: 2, 8: 2, 9: 2, 10: 2, 11: 2, 12: 2, 13: 1, 15: 2, 16: 1,
            17: 2, 18: 2, 19: 3, 20: 3, 21: 2}
_LARGE_LIST = 21
_RECORD_BATCH = 3  # MessageHeader union


class LayoutError(Exception):
    """The bytes are not the Arrow IPC layout expected here (damaged, or not a fastload shard)."""


def _at(fmt: str, buf: bytes, off: int):
    size = struct.calcsize(fmt)
    if off < 0 or off + size > len(buf):
        raise LayoutError(f"a flatbuffer reference points outside its {len(buf)} bytes")
    return struct.unpack_from(fmt, buf, off)[0]


class _Table:
    """A flatbuffer table at ``pos`` of ``buf``; fields by index (their vtable slot)."""

    __slots__ = ("buf", "pos", "vt", "vt_len")

    def __init__(self, buf: bytes, pos: int):
        self.buf, self.pos = buf, pos
        self.vt = pos - _at("<i", buf, pos)
        self.vt_len = _at("<H", buf, self.vt)

    def _slot(self, i: int) -> int:
        o = 4 + 2 * i
        return _at("<H", self.buf, self.vt + o) if o + 2 <= self.vt_len else 0

    def scalar(self, i: int, fmt: str, default=0):
        o = self._slot(i)
        return _at(fmt, self.buf, self.pos + o) if o else default

    def table(self, i: int) -> _Table | None:
        o = self._slot(i)
        if not o:
            return None
        p = self.pos + o
        return _Table(self.buf, p + _at("<I", self.buf, p))

    def vector(self, i: int, item: int) -> tuple[int, int]:
        """(start, count) of a vector of ``item``-byte elements (0, 0 when absent)."""
        o = self._slot(i)
        if not o:
            return 0, 0
        p = self.pos + o
        p += _at("<I", self.buf, p)
        n = _at("<I", self.buf, p)
        if p + 4 + n * item > len(self.buf):
            raise LayoutError("a flatbuffer vector runs past its buffer")
        return p + 4, n

    def tables(self, i: int) -> list[_Table]:
        start, n = self.vector(i, 4)
        return [_Table(self.buf, start + 4 * k + _at("<I", self.buf, start + 4 * k)) for k in range(n)]

    def string(self, i: int) -> str:
        start, n = self.vector(i, 1)
        return self.buf[start:start + n].decode("utf-8", "replace")


@dataclass(frozen=True)
class Block:
    offset: int
    meta_length: int
    body_length: int


@dataclass(frozen=True)
class Footer:
    fields: list  # the schema's top-level Field tables
    batches: list[Block]
    dictionaries: int


def footer_length(tail: bytes, size: int) -> int:
    """The footer's length from the file's last bytes (``tail``, at least 10 of a ``size``-byte
    file); LayoutError when the tail is not an Arrow IPC file's."""
    if len(tail) < 10 or tail[-6:] != MAGIC:
        raise LayoutError("the file does not end with the Arrow IPC magic ARROW1")
    n = _at("<i", tail, len(tail) - 10)
    if n <= 0 or n + 10 + 8 > size:
        raise LayoutError(f"footer length {n} does not fit a file of {size} bytes")
    return n


def parse_footer(tail: bytes, size: int) -> Footer:
    """The footer of a ``size``-byte file from its last bytes (holding the whole footer)."""
    n = footer_length(tail, size)
    if n + 10 > len(tail):
        raise LayoutError(f"the footer ({n} bytes) is longer than the {len(tail)} bytes read")
    buf = bytes(tail[len(tail) - 10 - n:len(tail) - 10])
    root = _Table(buf, _at("<I", buf, 0))
    schema = root.table(1)
    if schema is None:
        raise LayoutError("the footer has no schema")
    start, count = root.vector(3, 24)
    batches = [Block(_at("<q", buf, start + 24 * k), _at("<i", buf, start + 24 * k + 8),
                     _at("<q", buf, start + 24 * k + 16)) for k in range(count)]
    for b in batches:
        if b.offset < 8 or b.meta_length <= 0 or b.body_length < 0 or b.offset + b.meta_length + b.body_length > size - n - 10:
            raise LayoutError(f"record batch block {b} does not fit a file of {size} bytes")
    return Footer(schema.tables(1), batches, root.vector(2, 24)[1])


def _subtree(field: _Table, depth: int = 0) -> tuple[int, int]:
    """(nodes, buffers) a field takes in a record batch, children included."""
    if depth > 64:
        raise LayoutError("the schema nests types more than 64 deep")
    if field.table(4) is not None:  # dictionary-encoded: indices here, values in a dictionary batch
        return 1, 2
    kind = field.scalar(2, "<B")
    if kind not in _BUFFERS:
        raise LayoutError(f"field {field.string(0)!r} has an Arrow type (id {kind}) whose layout is not read here")
    nodes, bufs = 1, _BUFFERS[kind]
    for child in field.tables(5):
        n, b = _subtree(child, depth + 1)
        nodes, bufs = nodes + n, bufs + b
    return nodes, bufs


@dataclass(frozen=True)
class ListColumn:
    """Where a large_list column of a record batch is: its offsets buffer's absolute byte
    range in the file, its rows and its items (the child's length)."""

    rows: int
    items: int
    offsets_at: int
    offsets_bytes: int  # (rows + 1) * 8


def message_flatbuffer(meta: bytes) -> bytes:
    """The flatbuffer of an encapsulated message (``meta``: its ``metaDataLength`` bytes)."""
    first = _at("<i", meta, 0)
    if first == -1:  # continuation marker, then the length (format >= 0.15)
        n, at = _at("<i", meta, 4), 8
    else:
        n, at = first, 4
    if n <= 0 or at + n > len(meta):
        raise LayoutError(f"message metadata length {n} does not fit its {len(meta)} bytes")
    return bytes(meta[at:at + n])


def list_column(footer: Footer, meta: bytes, name: str) -> ListColumn:
    """Locate the large_list column ``name`` of the file's only record batch, from its footer
    and the batch's metadata (``meta``: ``Block.meta_length`` bytes at ``Block.offset``)."""
    if len(footer.batches) != 1:
        raise LayoutError(f"the file holds {len(footer.batches)} record batches; fastload shards hold one")
    block = footer.batches[0]
    node, buf = 0, 0
    target = None
    for f in footer.fields:
        if f.string(0) == name:
            target = f
            break
        n, b = _subtree(f)
        node, buf = node + n, buf + b
    if target is None:
        raise LayoutError(f"the file has no column {name!r}")
    if target.scalar(2, "<B") != _LARGE_LIST or target.table(4) is not None:
        raise LayoutError(f"column {name!r} is not a large_list")
    fb = message_flatbuffer(meta)
    msg = _Table(fb, _at("<I", fb, 0))
    if msg.scalar(1, "<B") != _RECORD_BATCH:
        raise LayoutError("the block does not hold a record batch")
    if msg.scalar(3, "<q") != block.body_length:
        raise LayoutError(f"the record batch's body length {msg.scalar(3, '<q')} differs from its block's "
                          f"{block.body_length}")
    rb = msg.table(2)
    if rb is None:
        raise LayoutError("the record batch message has no header")
    if rb.table(3) is not None:
        raise LayoutError("the record batch is compressed; fastload shards are not")
    rows = rb.scalar(0, "<q")
    nstart, ncount = rb.vector(1, 16)
    bstart, bcount = rb.vector(2, 16)
    if node + 1 >= ncount or buf + 1 >= bcount:
        raise LayoutError(f"the record batch has {ncount} field nodes and {bcount} buffers, too few for "
                          f"column {name!r}")
    list_len = _at("<q", fb, nstart + 16 * node)
    items = _at("<q", fb, nstart + 16 * (node + 1))
    off, length = _at("<q", fb, bstart + 16 * (buf + 1)), _at("<q", fb, bstart + 16 * (buf + 1) + 8)
    need = (rows + 1) * 8
    if rows < 0 or list_len != rows or items < 0:
        raise LayoutError(f"column {name!r} has {list_len} rows and {items} items in a batch of {rows} rows")
    if off < 0 or off % 8 or length < need or off + length > block.body_length:
        raise LayoutError(f"the offsets buffer of column {name!r} ({length} bytes at {off}) does not fit "
                          f"{rows} rows in a body of {block.body_length} bytes")
    return ListColumn(rows, items, block.offset + block.meta_length + off, need)

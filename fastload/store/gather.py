"""Gathering samples from a reader's shards: ``get_batch``, ``ds[i]``, ``__getitems__``,
``keys``, ``describe``, encoded-image ``views`` and ``image_sizes``.

:class:`Gathering` is the reading half of :class:`~fastload.store.reader.DatasetReader`:
global indices are located (``locate``, which verifies the shards first), grouped by shard,
and each field is gathered from the shard's zero-copy columns by the C++ kernels (fixed-size
fields as stacked arrays, ragged fields as arrays ``(k, *item_shape)``, binary fields as
``bytes``, strings as ``str``; copies, so they outlive the memory map). The kernels read the
mapping with SIGBUS guarded: a shard truncated while in use, or an I/O error under a mapped
page, raises :class:`~fastload.errors.ShardReadError` naming its file instead of killing the
process. (``views()`` hands out the mapping itself: whoever reads those views, DALI included,
reads unguarded.)
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..validate import is_int
from .format import KEY_COLUMN, image_size_columns, media_columns

__all__ = ["Gathering"]


def _take(col: np.ndarray, rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``col[rows]`` for a C-contiguous mapped column, copied by the C++ gather kernel, whose
    reads survive SIGBUS (ShardReadError naming the shard's file; an out-of-range row raises
    IndexError)."""
    from .. import _C

    rows = np.ascontiguousarray(rows, dtype=np.int64)
    if out is None:
        out = np.empty((len(rows), *col.shape[1:]), dtype=col.dtype)
    if len(rows):
        if not col.flags.c_contiguous:  # not a shard's column view: nothing to guard
            np.take(col, rows, axis=0, out=out)
        else:
            _C.gather_rows([out], [[col]], np.zeros(len(rows), dtype=np.int64), rows)
    return out


class Gathering:
    """Batch and sample reads for a reader that provides ``fields``, ``_field(name)``,
    ``num_shards``, ``shard_files``, ``path``, ``transform``, ``locate(indices)`` and the
    per-shard columns ``column``, ``ragged_column``, ``_raw_column`` and ``_int_column``."""

    def _groups(self, shard: np.ndarray):
        if self.num_shards == 1:
            yield 0, slice(None)
            return
        for s in np.unique(shard):
            yield int(s), shard == s

    def _gather_fixed(self, name: str, shard: np.ndarray, row: np.ndarray) -> np.ndarray:
        f = self.fields[name]
        out = np.empty((len(row), *f.shape), dtype=f.np_dtype)
        for s, sel in self._groups(shard):
            col = self.column(s, name)
            if isinstance(sel, slice):
                _take(col, row, out)
            else:
                out[sel] = _take(col, row[sel])
        return out

    def _gather_ragged(self, name: str, shard: np.ndarray, row: np.ndarray) -> list[np.ndarray]:
        """One array ``(k, *item_shape)`` per row: copies, so they outlive the memory map."""
        from .. import _C

        f = self.fields[name]
        out: list = [None] * len(row)
        for s, sel in self._groups(shard):
            offsets, values = self.ragged_column(s, name)
            pos = np.arange(len(row))[sel]
            r = np.ascontiguousarray(row[sel], dtype=np.int64)
            vals, offs = _C.gather_ragged([(values, offsets)], np.zeros(len(r), dtype=np.int64), r,
                                          dtype=f.np_dtype, item_shape=list(f.shape))  # guarded reads
            b = offs.tolist()
            for k, p in enumerate(pos.tolist()):
                out[p] = vals[b[k]:b[k + 1]]  # disjoint slices of one new array: no map reference
        return out

    def _gather_binary(self, name: str, shard: np.ndarray, row: np.ndarray) -> list:
        out: list = [None] * len(row)
        as_str = self.fields[name].kind == "string" if name in self.fields else True
        from .. import _C

        for s, sel in self._groups(shard):
            offsets, values = self._raw_column(s, name)
            pos = np.arange(len(row))[sel]
            blob, bounds = _C.gather_binary(offsets, values, np.ascontiguousarray(row[sel], dtype=np.int64))
            data, b = blob.tobytes(), bounds.tolist()  # read from the mapping with SIGBUS guarded
            for k, p in enumerate(pos.tolist()):
                v = data[b[k]:b[k + 1]]
                out[p] = v.decode("utf-8") if as_str else v
        return out

    def views(self, field: str, indices: np.ndarray | Sequence[int], *, copy: bool = False) -> list[np.ndarray]:
        """uint8 arrays of the encoded bytes of an image/bytes field, one per index: zero-copy
        views of the mapping, or with ``copy=True`` views of one new array the bytes were copied
        into by a guarded C++ read (a shard truncated or failing under its mapping raises
        ``ShardReadError`` here instead of killing whoever reads the views later, e.g. DALI)."""
        f = self._field(field)
        if f.fixed or f.ragged:
            raise TypeError(f"field {field!r} is a {f.kind} field; views() is for binary fields")
        shard, row = self.locate(indices)
        out: list = [None] * len(row)
        if copy:
            from .. import _C
        for s, sel in self._groups(shard):
            offsets, values = self._raw_column(s, field)
            pos = np.arange(len(row))[sel]
            r = row[sel]
            if copy:
                blob, bounds = _C.gather_binary(offsets, values, np.ascontiguousarray(r, dtype=np.int64))
                starts, ends, values = bounds[:-1].tolist(), bounds[1:].tolist(), blob
            else:
                starts, ends = offsets[r].tolist(), offsets[r + 1].tolist()
            for p, a, b in zip(pos.tolist(), starts, ends):
                out[p] = values[a:b]
        return out

    def image_sizes(self, field: str, indices: np.ndarray | Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(width, height) int32 arrays read from the store (recorded at convert time): of each
        image, or each video's frames; for an audio field (length, channels), the two sizes
        its transforms are handed."""
        f = self._field(field)
        if f.kind not in ("image", "video", "audio"):
            raise TypeError(f"field {field!r} is a {f.kind} field, not an image")
        shard, row = self.locate(indices)
        wcol, hcol = image_size_columns(field)
        if f.kind == "audio":
            info = self.media_info(field, indices, ["length", "channels"])
            return (np.minimum(info["length"], np.iinfo(np.int32).max).astype(np.int32),
                    info["channels"].astype(np.int32))
        w = np.empty(len(row), dtype=np.int32)
        h = np.empty(len(row), dtype=np.int32)
        for s, sel in self._groups(shard):
            w[sel] = _take(self._int_column(s, wcol), row[sel])
            h[sel] = _take(self._int_column(s, hcol), row[sel])
        return w, h

    def media_info(self, field: str, indices: np.ndarray | Sequence[int],
                   names: Sequence[str] | None = None) -> dict[str, Any]:
        """What convert probed of each video/audio file (``format.media_columns``): ``{info:
        array}`` (a list of str for ``codec``), for ``names`` (default: all)."""
        f = self._field(field)
        cols = media_columns(field, f.kind)
        if not cols:
            raise TypeError(f"field {field!r} is a {f.kind} field, not a video or audio field")
        names = list(cols) if names is None else list(names)
        unknown = [k for k in names if k not in cols]
        if unknown:
            raise ValueError(f"{field!r} records {sorted(cols)}, not {unknown}")
        shard, row = self.locate(indices)
        out: dict[str, Any] = {}
        for k in names:
            col, t = cols[k]
            if k == "codec":
                out[k] = self._gather_binary(col, shard, row)
                continue
            a = np.empty(len(row), dtype=t.to_pandas_dtype())
            for s, sel in self._groups(shard):
                a[sel] = _take(self._int_column(s, col), row[sel])
            out[k] = a
        return out

    def keys(self, indices: np.ndarray | Sequence[int]) -> list[str]:
        """The source key (e.g. the relative path of the original file) of each sample."""
        shard, row = self.locate(indices)
        return self._gather_binary(KEY_COLUMN, shard, row)

    def describe(self, index: int) -> str:
        """'shard shard-00003.arrow row 17 (key cat/001.jpg)' for error messages."""
        shard, row = self.locate([index])
        key = self.keys([index])[0]
        return f"sample {index} (shard {self.shard_files[int(shard[0])].name}, row {int(row[0])}, key {key!r})"

    def get_batch(self, indices: np.ndarray | Sequence[int], fields: Sequence[str] | None = None) -> dict:
        """Gather a whole batch: fixed fields as stacked numpy arrays (vectorised), ragged
        fields as lists of arrays ``(k, *item_shape)``, binary fields as lists of ``bytes``,
        strings as lists of ``str``."""
        shard, row = self.locate(indices)
        out: dict[str, Any] = {}
        for name in (fields if fields is not None else self.fields):
            f = self._field(name)
            out[name] = (self._gather_fixed(name, shard, row) if f.fixed
                         else self._gather_ragged(name, shard, row) if f.ragged
                         else self._gather_binary(name, shard, row))
        return out

    def __getitem__(self, i: int) -> dict:
        n = len(self)
        if not is_int(i):
            raise TypeError(f"dataset index must be an int, not {type(i).__name__}; use get_batch() for many")
        i = int(i)
        if i < -n or i >= n:
            raise IndexError(f"sample index {i} is out of range for {self.path} ({n} samples)")
        b = self.get_batch([i % n])
        sample = {k: v[0] for k, v in b.items()}
        return sample if self.transform is None else self.transform(sample)

    def __getitems__(self, indices: Sequence[int]) -> list[dict]:
        """Batched fetch for ``torch.utils.data.DataLoader``: one vectorised gather, then
        split into the list of samples that ``collate_fn`` expects."""
        b = self.get_batch(indices)
        n = len(indices)
        samples = [{k: v[j] for k, v in b.items()} for j in range(n)]
        return samples if self.transform is None else [self.transform(s) for s in samples]

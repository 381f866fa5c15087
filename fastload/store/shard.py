"""One shard of a dataset, memory-mapped and structurally checked, with its zero-copy views.

A shard is an Arrow IPC file holding exactly one record batch. :class:`MappedShard` maps it
with ``_C.map_file`` (regular files only, no file descriptor kept), checks it against its
manifest entry (the manifest's size, schema and row count; the bytes' checksum is the
verifier's job, :mod:`fastload.store.first_use`) and caches one numpy view per column, built
on first use: ``(rows, *shape)`` for a tensor or scalar field, ``(offsets, values)`` for a
ragged or binary one. The views are read-only and share the mapping's memory, which stays
alive while any of them does.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import FormatError, MissingFileError
from ..files import printable
from .format import Field, schema_mismatch

__all__ = ["MappedShard", "SchemaCheck"]


class SchemaCheck:
    """:func:`schema_mismatch` against ``fields``, remembering the last schema that held them:
    a shard whose schema equals it (metadata included) passes without the full comparison
    (a reader of many shards maps thousands of them, all with the same schema)."""

    __slots__ = ("fields", "_ok")

    def __init__(self, fields: dict[str, Field]) -> None:
        self.fields = fields
        self._ok: pa.Schema | None = None

    def __call__(self, schema: pa.Schema) -> str | None:
        ok = self._ok
        if ok is not None and schema.equals(ok, check_metadata=True):
            return None
        why = schema_mismatch(schema, self.fields)
        if why is None:
            self._ok = schema
        return why


class MappedShard:
    """One memory-mapped shard (no file descriptor kept: ``_C.map_file``), structurally
    checked against its manifest entry: its record batch and cached zero-copy views."""

    __slots__ = ("batch", "views", "mm")

    def __init__(self, path: Path, entry: dict, fields: dict[str, Field], check: SchemaCheck | None = None):
        from .. import _C

        try:
            self.mm = _C.map_file(os.fspath(path), entry["bytes"])
        except FileNotFoundError:
            raise MissingFileError(
                f"shard {path} listed in the manifest is missing: the dataset was damaged or replaced "
                "(e.g. by convert --overwrite) since it was opened; reopen it, or run `fastload verify`") from None
        except ValueError as e:  # not a regular file, or not the manifest's size
            raise FormatError(f"shard {printable(str(e))}; the dataset is damaged or was changed since it was "
                              "written (run `fastload verify`)") from None
        except OSError as e:
            raise FormatError(f"shard {path} cannot be read ({e.strerror or e})") from None
        try:
            reader = pa.ipc.open_file(pa.py_buffer(self.mm))
            if reader.num_record_batches != 1:
                raise FormatError(f"shard {path} holds {reader.num_record_batches} record batches; "
                                  "fastload shards hold exactly one (run `fastload verify`)")
            why = schema_mismatch(reader.schema, fields) if check is None else check(reader.schema)
            if why is not None:
                raise FormatError(f"shard {path} does not hold the manifest's fields: {why}; the dataset is "
                                  "damaged (run `fastload verify`)")
            self.batch = reader.get_batch(0)
            self.batch.validate()  # buffer sizes agree with lengths (cheap; the checksum covers the bytes)
        except (pa.ArrowInvalid, pa.ArrowException, OSError) as e:
            raise FormatError(f"shard {path} cannot be opened as an Arrow IPC file "
                              f"({str(e).splitlines()[0][:200]}); run `fastload verify` on the dataset") from None
        if self.batch.num_rows != entry["num_samples"]:
            raise FormatError(f"shard {path} holds {self.batch.num_rows} rows, the manifest says "
                              f"{entry['num_samples']} (run `fastload verify`)")
        self.views: dict[str, Any] = {}

    def fixed(self, name: str, f: Field) -> np.ndarray:
        """Zero-copy view ``(rows, *shape)`` of the tensor/scalar field ``name`` (cached)."""
        v = self.views.get(name)
        if v is None:
            col = self.batch.column(name)
            values = col.values if isinstance(col.type, pa.FixedSizeListType) else col
            rows = self.batch.num_rows
            base, per_row = f.storage()
            arr = values.to_numpy(zero_copy_only=True)
            if isinstance(col.type, pa.FixedSizeListType):
                arr = arr[col.offset * per_row:(col.offset + rows) * per_row]
            v = arr.view(f.np_dtype).reshape((rows, *f.shape))
            self.views[name] = v
        return v

    def binary(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """Zero-copy ``(offsets int32[rows+1], values uint8[...])`` of a binary/string column (cached)."""
        v = self.views.get(name)
        if v is None:
            col = self.batch.column(name)
            bufs = col.buffers()
            offsets = np.frombuffer(bufs[1], dtype=np.int32)[col.offset: col.offset + len(col) + 1]
            values = (np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None and bufs[2].size
                      else np.zeros(0, dtype=np.uint8))
            v = (offsets, values)
            self.views[name] = v
        return v

    def ragged(self, name: str, f: Field, path: Path) -> tuple[np.ndarray, np.ndarray]:
        """Zero-copy ``(offsets int64, values (items, *item_shape))`` of a ragged field (cached);
        ``path`` names the shard in errors."""
        v = self.views.get(name)
        if v is None:
            v = _ragged_views(self.batch.column(name), f, path)
            self.views[name] = v
        return v

    def ints(self, name: str) -> np.ndarray:
        """Zero-copy view of a plain integer column (e.g. image sizes) (cached)."""
        v = self.views.get(name)
        if v is None:
            v = self.batch.column(name).to_numpy(zero_copy_only=True)
            self.views[name] = v
        return v


def _ragged_views(col: pa.Array, f: Field, path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Zero-copy (offsets int64, values (items, *item_shape)) of a large_list column."""
    if not isinstance(col.type, pa.LargeListType):
        raise FormatError(f"shard {path}: ragged field column has type {col.type}, not large_list")
    offsets = col.offsets.to_numpy(zero_copy_only=True)  # indices into col.values, slice-aware
    items = col.values
    base, per_item = f.storage()
    if isinstance(items.type, pa.FixedSizeListType):
        flat = items.values.to_numpy(zero_copy_only=True)[items.offset * per_item:(items.offset + len(items)) * per_item]
    else:
        flat = items.to_numpy(zero_copy_only=True)
    n_items = len(items)
    values = flat.view(f.np_dtype).reshape((n_items, *f.shape))
    if len(offsets) and (offsets[0] < 0 or offsets[-1] > n_items):
        raise FormatError(f"shard {path}: ragged field offsets run past its {n_items} items; the shard is damaged")
    return offsets, values

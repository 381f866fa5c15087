"""table: Parquet, CSV or JSON-lines through pyarrow; each column becomes a field.

Numeric and bool columns -> scalar fields; fixed-size (or equal-length) numeric lists ->
tensor fields; numeric lists of varying length -> ragged fields (``int32[]``), lists of
fixed-size lists (or of equal-length lists) -> ragged fields with item rows (``float32[*,4]``);
strings -> string fields; binary -> bytes. A column named by
``--image-column`` (or auto-detected: strings ending in an image extension, or binary values
that open as images) becomes an image field: strings are paths, relative to the table's
folder unless absolute. A string column whose values are paths ending in a video extension
(``.mp4 .m4v .mkv .webm .avi .mov``) becomes a video field, an audio extension (``.wav .flac
.ogg .oga .opus .mp3``) an audio field, each file probed as ``videofolder`` / ``audiofolder``
probe theirs. ``--label NAME`` picks the label column; a string label column is
mapped to class ids in sorted order, the names kept as class names.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..files import NotRegularFile, check_regular, printable, read_regular
from ..store.format import SUPPORTED_DTYPES, Field
from ..store.geometry import DEFAULT_MAX_PIXELS
from ..store.values import Ragged
from .common import IMAGE_EXTENSIONS, ConvertError, Source, bulk_chunks, check_image, label_from_strings, resolve_label

TABLE_SUFFIXES = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".tsv": "csv",
                  ".jsonl": "json", ".ndjson": "json", ".json": "json"}


def read_table(path: Path, rows: tuple[int, int] | None = None) -> pa.Table:
    """The table at ``path``, or only its rows ``rows[0]..rows[1]-1``: a Parquet file reads
    just the row groups that hold them; CSV and JSON have no random access (read, then sliced)."""
    if rows is not None and TABLE_SUFFIXES.get(path.suffix.lower()) == "parquet" and path.is_file():
        return _parquet_rows(path, *rows)
    table = _read_whole(path)
    return table if rows is None else table.slice(rows[0], rows[1] - rows[0])


def _parquet_rows(path: Path, start: int, stop: int, columns: Sequence[str] | None = None) -> pa.Table:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path, memory_map=True)
        md = pf.metadata
        groups, first, at = [], None, 0
        for g in range(md.num_row_groups):
            n = md.row_group(g).num_rows
            if at + n > start and at < stop:
                groups.append(g)
                first = at if first is None else first
            at += n
        if not groups:
            return pf.schema_arrow.empty_table() if columns is None else pf.schema_arrow.empty_table().select(columns)
        t = pf.read_row_groups(groups, columns=columns)
    except (pa.ArrowInvalid, pa.ArrowException, OSError) as e:
        raise ConvertError(f"{path}: cannot be read as parquet ({str(e).splitlines()[0]})") from None
    return t.slice(start - first, stop - start)


def parquet_rows(path, start: int, stop: int, columns: Sequence[str] | None = None) -> pa.Table:
    """Rows ``start..stop-1`` of a Parquet file (a path, or an open random-access file such as
    an object store's), reading only the row groups that hold them."""
    return _parquet_rows(path if hasattr(path, "read_at") else Path(path), start, stop, columns)


def _read_whole(path: Path) -> pa.Table:
    kind = TABLE_SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise ConvertError(f"{path}: unknown table type {path.suffix!r}; use one of {', '.join(sorted(TABLE_SUFFIXES))}")
    if not path.exists():
        raise ConvertError(f"{path}: no such file")
    try:
        check_regular(path, what="table file")
    except NotRegularFile as e:
        raise ConvertError(str(e)) from None
    try:
        if kind == "parquet":
            import pyarrow.parquet as pq
            return pq.read_table(path, memory_map=True)
        if kind == "csv":
            import pyarrow.csv as pcsv
            opts = pcsv.ParseOptions(delimiter="\t") if path.suffix.lower() == ".tsv" else None
            return pcsv.read_csv(path, parse_options=opts)
        import pyarrow.json as pjson
        return pjson.read_json(path)
    except (pa.ArrowInvalid, pa.ArrowException, OSError) as e:
        raise ConvertError(f"{path}: cannot be read as {kind} ({str(e).splitlines()[0]})") from None


def _looks_like_image(value) -> bool:
    try:
        check_image(value)
        return True
    except ValueError:
        return False


class TableSource(Source):
    def __init__(self, src: str | os.PathLike, label: str | None = None,
                 image_columns: Sequence[str] = (), max_pixels: int | None = DEFAULT_MAX_PIXELS, *,
                 rows: tuple[int, int] | None = None, classes: Sequence[str] | None = None,
                 detect_images: bool = True, ragged: Sequence[str] = (), max_size: int | None = None,
                 quality: int | None = None, media_columns: dict[str, str] | None = None):
        """``rows=(a, b)``: only rows a..b-1 of the table (keys and messages keep the table's
        row numbers); ``classes``: the class names of a string label column (found over the
        whole table by the caller) instead of those of these rows; ``detect_images=False``:
        image columns are exactly ``image_columns``, none guessed from the values; ``ragged``:
        list columns stored as ragged fields even where these rows happen to have equal
        lengths; ``media_columns``: ``{column: "video" | "audio"}``, exactly the path columns
        holding media files (default: found by their extensions in these rows). They let tasks of
        the distributed convert each read their own rows alike."""
        from .sourcestate import stat_file

        path = Path(src)
        opened = {os.fspath(path): stat_file(path)}  # before reading it
        table = read_table(path, rows).combine_chunks()
        self.offset = rows[0] if rows is not None else 0
        if table.num_rows == 0:
            raise ConvertError(f"{path}: the table has no rows" + (f" in rows {rows[0]}..{rows[1] - 1}" if rows else ""))
        unknown = [c for c in image_columns if c not in table.column_names]
        if unknown:
            raise ConvertError(f"{path}: --image-column {unknown[0]!r} is not a column; columns are {table.column_names}")
        self.root = path.parent
        self.columns: dict[str, object] = {}
        self.image_paths: set[str] = set()
        fields: dict[str, Field] = {}
        class_names = None
        # a string column named like a label (or --label) becomes class ids + class names
        str_label = label if label is not None else next(
            (c for c in ("label", "labels") if c in table.column_names), None)
        for name in table.column_names:
            col = table.column(name).chunk(0) if table.column(name).num_chunks else pa.array([], table.schema.field(name).type)
            if col.null_count:
                row = self.offset + int(np.flatnonzero(np.asarray(col.is_null()))[0])
                raise ConvertError(f"{path}: column {name!r} has {col.null_count} missing value(s), first at row {row}; "
                                   "fill or drop them first")
            t = col.type
            if name == str_label and (pa.types.is_string(t) or pa.types.is_large_string(t)):
                if classes is None:
                    class_names, ids = label_from_strings(col.to_pylist())
                else:
                    class_names, ids = list(classes), _class_ids(col, classes, path, name, self.offset)
                fields[name] = Field("scalar", "int64")
                self.columns[name] = ids
            elif pa.types.is_boolean(t):
                fields[name] = Field("scalar", "bool")
                self.columns[name] = col.to_numpy(zero_copy_only=False)
            elif pa.types.is_integer(t) or pa.types.is_floating(t):
                fields[name] = Field("scalar", np.dtype(t.to_pandas_dtype()).name)
                self.columns[name] = col.to_numpy(zero_copy_only=False)
            elif pa.types.is_fixed_size_list(t) or pa.types.is_list(t) or pa.types.is_large_list(t):
                lens = pc.list_value_length(col).to_numpy(zero_copy_only=False)
                nested = pa.types.is_fixed_size_list(t.value_type) or pa.types.is_list(t.value_type) or \
                    pa.types.is_large_list(t.value_type)
                if nested or name in ragged or len(set(lens.tolist())) != 1 or lens[0] == 0:
                    fields[name], self.columns[name] = _ragged_column(path, name, col, lens)
                    continue
                flat = pc.list_flatten(col).to_numpy(zero_copy_only=False)
                if flat.dtype.name not in SUPPORTED_DTYPES:
                    raise ConvertError(f"{path}: list column {name!r} holds {flat.dtype}, which cannot be stored")
                fields[name] = Field("tensor", flat.dtype.name, (int(lens[0]),))
                self.columns[name] = flat.reshape(len(col), int(lens[0]))
            elif pa.types.is_string(t) or pa.types.is_large_string(t):
                values = col.to_pylist()
                media = _media_kind(values) if media_columns is None else media_columns.get(name)
                if media is not None and name not in image_columns:
                    fields[name] = Field(media)
                    self.image_paths.add(name)  # (path columns: the files are read at convert time)
                    self.columns[name] = np.array(values, dtype=object)
                    continue
                is_img = name in image_columns or (detect_images and not image_columns and all(
                    str(v).lower().endswith(IMAGE_EXTENSIONS) for v in values[:100]))
                fields[name] = Field("image") if is_img else Field("string")
                if is_img:
                    self.image_paths.add(name)
                self.columns[name] = np.array(values, dtype=object)
            elif pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
                is_img = name in image_columns or (detect_images and not image_columns
                                                   and _looks_like_image(col[0].as_py()))
                fields[name] = Field("image") if is_img else Field("bytes")
                self.columns[name] = col
            else:
                raise ConvertError(f"{path}: column {name!r} has type {t}, which fastload cannot store; "
                                   "use numbers, bools, strings, binary or fixed-length numeric lists")
        for c in image_columns:
            if fields[c].kind != "image":
                raise ConvertError(f"{path}: --image-column {c!r} holds {table.schema.field(c).type}; "
                                   "an image column holds paths (strings) or encoded bytes")
        label = resolve_label(fields, label)
        if label is not None and not (fields[label].kind == "scalar" and fields[label].dtype.startswith(("int", "uint"))):
            raise ConvertError(f"{path}: label column {label!r} must hold integers or strings, not {fields[label]}")
        super().__init__(fields=fields, num_samples=table.num_rows, label=label, class_names=class_names,
                         metadata={"source": "table", "file": path.name}, max_pixels=max_pixels,
                         max_size=max_size, quality=quality)
        self.path = path
        # the first path column in the table's order: a set's order depends on PYTHONHASHSEED, and
        # every process and engine must key the samples alike
        self._key_col = next((n for n in table.column_names if n in self.image_paths), None)
        self.opened = opened

    def inputs(self) -> list[str]:
        """The table file, then the image files its path columns name (in row order)."""
        out = [os.fspath(self.path)]
        for name in sorted(self.image_paths):
            for v in self.columns[name]:
                p = Path(str(v))
                out.append(os.fspath(p if p.is_absolute() else self.root / p))
        return out

    def key(self, i: int) -> str:
        if self._key_col is not None:
            return str(self.columns[self._key_col][i])
        return f"{self.path.name}:{self.offset + i}"

    def read(self, i: int) -> dict:
        out = {}
        for name, f in self.fields.items():
            col = self.columns[name]
            if name in self.image_paths:
                p = Path(str(col[i]))
                p = p if p.is_absolute() else self.root / p
                what = f"{f.kind} file"
                try:
                    out[name] = read_regular(p, what=what)
                except OSError as e:
                    raise ValueError(f"cannot read {what} {printable(str(p))} ({e.strerror or e})") from None
            elif isinstance(col, pa.Array):
                out[name] = col[i].as_py()
            else:
                out[name] = col[i]
        return out

    def fast_chunks(self):
        if not all(f.fixed or f.ragged for f in self.fields.values()):
            return None
        return bulk_chunks({n: self.columns[n] for n in self.fields}, self.num_samples)


def _media_kind(values: list) -> str | None:
    """"video" / "audio" when every one of the first 100 values is a path with such an extension."""
    from ..store.media import AUDIO_EXTENSIONS, VIDEO_EXTENSIONS

    head = [str(v).lower() for v in values[:100]]
    for kind, ext in (("video", VIDEO_EXTENSIONS), ("audio", AUDIO_EXTENSIONS)):
        if head and all(v.endswith(ext) for v in head):
            return kind
    return None


def _ragged_column(path: Path, name: str, col: pa.Array, lens: np.ndarray) -> tuple[Field, Ragged]:
    """A list column of varying lengths as a ragged field: numeric items (``int32[]``), or
    rows of equal length (``float32[*,4]``) from fixed-size or equal-length inner lists."""
    items = pc.list_flatten(col)
    item_shape: tuple[int, ...] = ()
    t = items.type
    if pa.types.is_fixed_size_list(t) or pa.types.is_list(t) or pa.types.is_large_list(t):
        if items.null_count:
            raise ConvertError(f"{path}: list column {name!r} has missing inner lists; fill or drop them first")
        inner = pc.list_value_length(items).to_numpy(zero_copy_only=False)
        if len(inner) and (len(set(inner.tolist())) != 1 or inner[0] == 0):
            raise ConvertError(f"{path}: list column {name!r} holds inner lists of different lengths "
                               f"({int(inner.min())}..{int(inner.max())}); a ragged field varies in its first "
                               "dimension only")
        item_shape = (int(inner[0]) if len(inner) else int(getattr(t, "list_size", 1) or 1),)
        items = pc.list_flatten(items)
        t = items.type
    if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)):
        raise ConvertError(f"{path}: list column {name!r} holds {t}; fastload stores lists of numbers")
    if items.null_count:
        raise ConvertError(f"{path}: list column {name!r} has {items.null_count} missing value(s) inside its lists; "
                           "fill or drop them first")
    values = items.to_numpy(zero_copy_only=False)
    if values.dtype.name not in SUPPORTED_DTYPES:
        raise ConvertError(f"{path}: list column {name!r} holds {values.dtype}, which cannot be stored")
    values = values.reshape(-1, *item_shape)
    return Field("ragged", values.dtype.name, item_shape), Ragged.from_lengths(values, lens.astype(np.int64))


def _class_ids(col: pa.Array, classes: Sequence[str], path: Path, name: str, offset: int) -> np.ndarray:
    """Class ids of string labels ``col`` given every class name (sorted, as label_from_strings)."""
    ids = pc.index_in(col, value_set=pa.array(list(classes), type=pa.string()))
    if ids.null_count:
        row = int(np.flatnonzero(np.asarray(ids.is_null()))[0])
        raise ConvertError(f"{path}: label {col[row].as_py()!r} of row {offset + row} (column {name!r}) is "
                           "not one of the class names found when the conversion was planned; was the table "
                           "changed meanwhile?")
    return ids.to_numpy(zero_copy_only=False).astype(np.int64)

"""The on-disk format: field kinds, their Arrow types, and the manifest.

See docs/FORMAT.md for the written specification. Everything here is pure data
description; the writer and reader share it so the two can never disagree.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import pyarrow as pa

from ..errors import FormatError  # noqa: F401  (still importable from here)
from ..errors import parse_bytes

FORMAT_NAME = "fastload"
# The newest version this fastload reads and writes. A dataset records the lowest version
# that describes it: 2 only when it has a ragged field, so datasets without one still open
# with readers of version 1 (see docs/FORMAT.md, "Compatibility").
# 3 only when it has a video or audio field.
FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
MANIFEST = "manifest.json"
SKIPPED_REPORT = "skipped.jsonl"
KEY_COLUMN = "__key__"
SHARD_PATTERN = "shard-{:05d}.arrow"  # at least 5 digits: shard 123456 is shard-123456.arrow
# A dataset written over another one (overwrite) names its shards shard-NNNNN-GGGGGGGG.arrow,
# GGGGGGGG a generation token no earlier generation in that directory used: a reader that
# opened the old dataset never maps a file of the new one under the old manifest.
GENERATION_PATTERN = "shard-{:05d}-{}.arrow"
SHARD_FILE_RE = r"shard-[0-9]{5,}(?:-[0-9a-f]{8})?\.arrow"  # every name the writer gives, nothing else
CHECKSUM_ALGO = "xxh3_128"


def stale_files(names, keep: set[str]) -> list[str]:
    """fastload's own files among ``names`` (a directory's or an object-store prefix's) that
    a new dataset listing ``keep`` replaces: shards it does not list, and a skipped report
    it does not have. Never anything fastload did not name (a shared prefix's other files)."""
    return sorted(n for n in names if n not in keep and (re.fullmatch(SHARD_FILE_RE, n) or n == SKIPPED_REPORT))


KINDS = ("tensor", "scalar", "ragged", "image", "bytes", "string", "video", "audio")
NUMERIC_KINDS = ("tensor", "scalar", "ragged")
MEDIA_KINDS = ("video", "audio")  # encoded files, with what convert probed in hidden columns

# numpy dtypes with a native, zero-copy Arrow primitive type.
_NATIVE = {
    "int8": pa.int8(), "int16": pa.int16(), "int32": pa.int32(), "int64": pa.int64(),
    "uint8": pa.uint8(), "uint16": pa.uint16(), "uint32": pa.uint32(), "uint64": pa.uint64(),
    "float16": pa.float16(), "float32": pa.float32(), "float64": pa.float64(),
}
# numpy dtypes stored through a native type: bool as uint8 (Arrow booleans are bit-packed,
# which would make every read a copy); complex as pairs of floats (a trailing axis of 2).
_STORED_AS = {"bool": ("uint8", 1), "complex64": ("float32", 2), "complex128": ("float64", 2)}
SUPPORTED_DTYPES = tuple(sorted([*_NATIVE, *_STORED_AS]))

DEFAULT_SHARD_SIZE = 256 * 1024 * 1024
MAX_SHARD_SIZE = 2**31 - 1  # binary columns use 32-bit offsets
# convert refuses smaller shards unless forced: `--shard-size 10` (10 bytes) would write one
# shard per sample, tens of thousands of files.
MIN_SHARD_SIZE = 1_000_000

_MAX_LIST_SIZE = 2**31 - 1  # Arrow's fixed_size_list length is an int32

_SPEC_RE = re.compile(r"^\s*([a-z0-9_]+)\s*(?:\[\s*([0-9*,\s]*)\s*\])?\s*$")


def _check_dtype(dtype: Any, where: str) -> str:
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"{where}: {dtype!r} is not a numpy dtype ({e}); "
                         f"use one of {', '.join(SUPPORTED_DTYPES)}") from None
    name = dt.name
    if name not in _NATIVE and name not in _STORED_AS:
        raise ValueError(f"{where}: dtype {name!r} cannot be stored; "
                         f"use one of {', '.join(SUPPORTED_DTYPES)}")
    return name


@dataclass(frozen=True)
class Field:
    """One column of a dataset.

    kind: "tensor" (fixed shape, any numeric numpy dtype), "scalar" (int/float/bool),
    "ragged" (a variable number of items per sample, each of the fixed ``shape``: ``int32[]``
    token sequences, ``float32[*,4]`` boxes), "image" (encoded image bytes), "bytes" (opaque
    binary), "string" (UTF-8), "video" or "audio" (an encoded media file; what was probed
    at write time is kept beside it, see :func:`media_columns`). For a ragged field ``shape`` is the shape of one *item*
    (``()`` for ``int32[]``, ``(4,)`` for ``float32[*,4]``); the first dimension varies.
    """

    kind: str
    dtype: str | None = None
    shape: tuple[int, ...] = ()

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"field kind {self.kind!r} is unknown; use one of {', '.join(KINDS)}")
        if self.kind in NUMERIC_KINDS:
            if self.dtype is None:
                raise ValueError(f"a {self.kind} field needs a dtype")
            object.__setattr__(self, "dtype", _check_dtype(self.dtype, f"{self.kind} field"))
            shape = tuple(int(s) for s in self.shape)
            if self.kind == "scalar" and shape:
                raise ValueError(f"a scalar field has shape (), not {shape}; use a tensor field")
            if any(s <= 0 for s in shape):
                raise ValueError(f"{self.kind} shape {shape} must have only positive sizes")
            per_row = _STORED_AS.get(self.dtype, (None, 1))[1] * math.prod(shape)
            if per_row > _MAX_LIST_SIZE:
                raise ValueError(f"{self.kind} shape {shape} holds {per_row:,} values per sample (item); an "
                                 f"Arrow fixed-size list holds at most {_MAX_LIST_SIZE:,}")
            object.__setattr__(self, "shape", shape)
        else:
            if self.dtype is not None or self.shape:
                raise ValueError(f"a {self.kind} field takes no dtype or shape")

    # -- description ---------------------------------------------------------------------
    @property
    def fixed(self) -> bool:
        """True when every sample has the same byte size (tensor and scalar)."""
        return self.kind in ("tensor", "scalar")

    @property
    def ragged(self) -> bool:
        """True for a variable-length field (``int32[]``, ``float32[*,4]``)."""
        return self.kind == "ragged"

    @property
    def np_dtype(self) -> np.dtype:
        if self.kind not in NUMERIC_KINDS:
            raise TypeError(f"a {self.kind} field has no numpy dtype")
        return np.dtype(self.dtype)

    @property
    def row_nbytes(self) -> int:
        if not self.fixed:
            raise TypeError(f"a {self.kind} field has no fixed row size")
        return self.np_dtype.itemsize * int(math.prod(self.shape))

    @property
    def item_nbytes(self) -> int:
        """Bytes of one item of a ragged field (one token, one box)."""
        if not self.ragged:
            raise TypeError(f"a {self.kind} field has no items")
        return self.np_dtype.itemsize * int(math.prod(self.shape))

    def to_json(self) -> dict:
        d: dict[str, Any] = {"kind": self.kind}
        if self.kind in NUMERIC_KINDS:
            d["dtype"] = self.dtype
            d["shape"] = list(self.shape)
        return d

    @classmethod
    def from_json(cls, d: Any) -> Field:
        """The field a manifest (or a shard's Arrow metadata) describes. Strict: ValueError
        for anything :meth:`to_json` would not have written (a shape of strings or floats, an
        unknown key, a dtype on an image field...)."""
        if not isinstance(d, Mapping):
            raise ValueError(f"a field description is a JSON object, not {type(d).__name__}")
        unknown = sorted(set(d) - {"kind", "dtype", "shape"})
        if unknown:
            raise ValueError(f"unknown key(s) {unknown}; a field has 'kind', 'dtype' and 'shape'")
        kind = d.get("kind")
        if not isinstance(kind, str):
            raise ValueError(f"'kind' must be one of {', '.join(KINDS)}, not {kind!r}")
        dtype = d.get("dtype")
        if dtype is not None and not isinstance(dtype, str):
            raise ValueError(f"'dtype' must be a string such as 'float32', not {dtype!r}")
        shape = d.get("shape", [])
        if not isinstance(shape, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in shape):
            raise ValueError(f"'shape' must be a list of integers, not {shape!r}")
        f = cls(kind, dtype, tuple(shape))
        if kind in NUMERIC_KINDS and ("shape" not in d or dtype != f.dtype):  # e.g. "float" for "float64"
            raise ValueError(f"expected {f.to_json()}, got {dict(d)} (a {kind} field names its "
                             "numpy dtype and its shape)")
        return f

    def __str__(self) -> str:
        if self.kind == "tensor":
            return f"{self.dtype}[{','.join(map(str, self.shape))}]"
        if self.kind == "ragged":
            return f"{self.dtype}[{','.join(['*', *map(str, self.shape)])}]" if self.shape else f"{self.dtype}[]"
        if self.kind == "scalar":
            return str(self.dtype)
        return self.kind

    # -- Arrow mapping ---------------------------------------------------------------------
    def storage(self) -> tuple[str, int]:
        """(numpy dtype name of the stored values, values per row — per item for ragged)."""
        base, mult = _STORED_AS.get(self.dtype, (self.dtype, 1))
        return base, mult * int(math.prod(self.shape))

    def arrow_type(self) -> pa.DataType:
        if self.kind in ("image", "bytes", *MEDIA_KINDS):
            return pa.binary()
        if self.kind == "string":
            return pa.string()
        base, n = self.storage()
        if self.kind == "ragged":  # int64 offsets: no 2 GiB limit on one sample or column
            return pa.large_list(_NATIVE[base] if n == 1 else pa.list_(_NATIVE[base], n))
        if self.kind == "scalar" and n == 1 and self.dtype not in _STORED_AS:
            return _NATIVE[base]
        if self.kind == "scalar" and self.dtype == "bool":
            return pa.uint8()
        return pa.list_(_NATIVE[base], n)


def parse_field(spec: Any, name: str = "?") -> Field:
    """Turn "image", "int64", "float32[784]", "uint8[3,224,224]", a ragged "int32[]" /
    "float32[*,4]", or a Field into a Field."""
    if isinstance(spec, Field):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"field {name!r}: spec {spec!r} must be a Field or a string such as "
                         "'image', 'string', 'int64', 'float32[784]' or 'int32[]'")
    m = _SPEC_RE.match(spec)
    if not m:
        raise ValueError(f"field {name!r}: cannot parse spec {spec!r}; expected e.g. 'image', 'string', "
                         "'int64', 'float32[3,32,32]', 'int32[]' (ragged) or 'float32[*,4]' (ragged rows of 4)")
    base, dims = m.group(1), m.group(2)
    if base in ("image", "bytes", "string", *MEDIA_KINDS):
        if dims is not None:
            raise ValueError(f"field {name!r}: a {base} field takes no shape ({spec!r})")
        return Field(base)
    if dims is None:
        return Field("scalar", base)
    parts = [d.strip() for d in dims.split(",")] if dims.strip() else []
    if not parts or parts == ["*"]:
        return Field("ragged", base, ())
    if any(not p for p in parts):
        raise ValueError(f"field {name!r}: empty dimension in {spec!r}")
    ragged = parts[0] == "*"
    rest = parts[1:] if ragged else parts
    if any(p == "*" for p in rest):
        raise ValueError(f"field {name!r}: only the first dimension may vary ('*') in {spec!r}, "
                         "e.g. 'float32[*,4]'")
    shape = tuple(int(d) for d in rest)
    return Field("ragged" if ragged else "tensor", base, shape)


def format_version_for(fields: Mapping[str, Field]) -> int:
    """The lowest format version that describes a dataset with these fields."""
    if any(f.kind in MEDIA_KINDS for f in fields.values()):
        return 3
    return 2 if any(f.ragged for f in fields.values()) else 1


def parse_size(value: int | str, what: str = "shard_size") -> int:
    """'256MB', '1.5GiB', '4096' or an int -> bytes, at most a shard's limit of 2 GiB."""
    return parse_bytes(value, what, maximum=MAX_SHARD_SIZE, maximum_text="2 GiB")


def image_size_columns(name: str) -> tuple[str, str]:
    """Hidden int32 columns holding each image's width and height, read at convert time."""
    return f"{name}_width", f"{name}_height"


# What is probed of each media file at write time, as hidden columns ``<field>_<name>``.
VIDEO_INFO = {"width": pa.int32(), "height": pa.int32(), "frames": pa.int32(), "fps": pa.float64(),
              "codec": pa.string()}
AUDIO_INFO = {"sample_rate": pa.int32(), "channels": pa.int32(), "length": pa.int64(), "codec": pa.string()}


def media_columns(name: str, kind: str) -> dict[str, tuple[str, pa.DataType]]:
    """``{info: (hidden column, Arrow type)}`` of a video or audio field ``name``: a video's
    width, height, frame count, frame rate and codec; an audio file's sample rate, channel
    count, length (samples per channel) and codec. Empty for other kinds."""
    info = VIDEO_INFO if kind == "video" else AUDIO_INFO if kind == "audio" else {}
    return {k: (f"{name}_{k}", t) for k, t in info.items()}


# The Loader adds each batch's global sample indices as batch["index"]; a field of that name
# would be shadowed, so it is refused at write time.
INDEX_KEY = "index"


def check_field_names(fields: Mapping[str, Field]) -> None:
    reserved = {KEY_COLUMN}
    for name, f in fields.items():
        if f.kind == "image":
            reserved.update(image_size_columns(name))
        reserved.update(c for c, _ in media_columns(name, f.kind).values())
    for name in fields:
        if not isinstance(name, str) or not name:
            raise ValueError(f"field name {name!r} must be a non-empty string")
        if name == INDEX_KEY:
            raise ValueError(f"field name {name!r} is reserved: the Loader delivers each batch's global "
                             f"sample indices as batch['index']; rename the field/column (e.g. 'source_index')")
        if name in reserved:
            raise ValueError(f"field name {name!r} is reserved by fastload "
                             f"(it stores image sizes, media information or sample keys); rename the field")


def arrow_schema(fields: Mapping[str, Field]) -> pa.Schema:
    cols = []
    for name, f in fields.items():
        cols.append(pa.field(name, f.arrow_type(), nullable=False,
                             metadata={b"fastload": json.dumps(f.to_json()).encode()}))
        if f.kind == "image":
            w, h = image_size_columns(name)
            cols += [pa.field(w, pa.int32(), nullable=False), pa.field(h, pa.int32(), nullable=False)]
        cols += [pa.field(c, t, nullable=False) for c, t in media_columns(name, f.kind).values()]
    cols.append(pa.field(KEY_COLUMN, pa.string(), nullable=False))
    version = format_version_for(fields)
    return pa.schema(cols, metadata={b"fastload_format_version": str(version).encode()})


def shard_name(i: int, generation: str | None = None) -> str:
    """The file name of shard ``i`` (of a dataset written over another: with its generation)."""
    return SHARD_PATTERN.format(i) if generation is None else GENERATION_PATTERN.format(i, generation)


def field_of_arrow(f: pa.Field) -> Field:
    """The fastload field an Arrow field of a shard describes (its ``fastload`` metadata)."""
    raw = (f.metadata or {}).get(b"fastload")
    if raw is None:
        raise ValueError(f"column {f.name!r} carries no fastload field description")
    try:
        d = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"column {f.name!r}: unreadable fastload metadata ({e})") from None
    return Field.from_json(d)


def schema_mismatch(schema: pa.Schema, fields: Mapping[str, Field]) -> str | None:
    """Why a shard's Arrow schema does not hold the manifest's ``fields`` (column names,
    order, Arrow types, and each field's kind, dtype and shape from the column metadata, so a
    ``[16]`` tensor is not read as ``[8,2]``), or None when it does."""
    want = arrow_schema(fields)
    if schema.names != want.names:
        return f"its columns are {schema.names}, the manifest's fields give {want.names}"
    for got, exp in zip(schema, want):
        if not got.type.equals(exp.type):
            return f"column {got.name!r} is {got.type}, the manifest says {exp.type}"
        if got.name in fields:
            try:
                f = field_of_arrow(got)
            except ValueError as e:
                return str(e)
            if f != fields[got.name]:
                return f"column {got.name!r} holds {f}, the manifest says {fields[got.name]}"
    return None

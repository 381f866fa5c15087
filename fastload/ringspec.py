"""The checked description of a ring: its fields, their per-shard sources, index arrays.

The one validation layer in front of the C++ ring (``fastload._C.Ring``): every message names
the field and shard at fault; the C++ side then only asserts its invariants.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .validate import is_int as _is_int

__all__ = ["as_index", "parse_fields", "parse_sources"]

_INT64 = np.dtype(np.int64)


def as_index(a: Any, name: str) -> np.ndarray:
    if type(a) is np.ndarray and a.dtype == _INT64 and a.ndim == 1 and a.flags.c_contiguous:
        return a  # fast path
    arr = np.asarray(a)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must be an integer array, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    return np.ascontiguousarray(arr, dtype=np.int64)


def parse_fields(fields: Mapping[str, Any]) -> tuple[list[str], list[np.dtype], list[tuple[int, ...]]]:
    if not isinstance(fields, Mapping) or not fields:
        raise ValueError("fields must be a non-empty dict of name -> (dtype, shape)")
    names, dtypes, shapes = [], [], []
    for name, spec in fields.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"field names must be non-empty strings, got {name!r}")
        try:
            dt, shape = spec
        except (TypeError, ValueError):
            raise ValueError(f"field {name!r}: expected (dtype, shape), got {spec!r}") from None
        try:
            dt = np.dtype(dt)
        except TypeError as e:
            raise ValueError(f"field {name!r}: {dt!r} is not a numpy dtype ({e})") from None
        if dt.hasobject or dt.itemsize == 0:
            raise ValueError(f"field {name!r}: dtype {dt} has no fixed binary layout")
        if _is_int(shape):
            shape = (int(shape),)
        try:
            shape = tuple(int(d) for d in shape)
        except TypeError:
            raise ValueError(f"field {name!r}: shape must be a tuple of ints, got {shape!r}") from None
        if any(d < 0 for d in shape):
            raise ValueError(f"field {name!r}: shape {shape} has a negative dimension")
        names.append(name)
        dtypes.append(dt)
        shapes.append(shape)
    return names, dtypes, shapes


def parse_sources(
    sources: Mapping[str, Any] | None, names: list[str], dtypes: list[np.dtype], shapes: list[tuple[int, ...]]
) -> list[list[np.ndarray] | None]:
    sources = {} if sources is None else sources
    if not isinstance(sources, Mapping):
        raise ValueError("sources must be a dict of field name -> list of per-shard arrays")
    unknown = sorted(set(sources) - set(names))
    if unknown:
        raise ValueError(f"sources has fields {unknown} that are not in fields {names}")
    out: list[list[np.ndarray] | None] = []
    ref_name, ref_rows = None, None
    for name, dt, shape in zip(names, dtypes, shapes):
        if name not in sources or sources[name] is None:
            out.append(None)
            continue
        shards = sources[name]
        if isinstance(shards, np.ndarray):
            shards = [shards]
        shards = list(shards)
        checked = []
        for s, a in enumerate(shards):
            if not isinstance(a, np.ndarray):
                raise ValueError(f"field {name!r} shard {s}: source must be a numpy array, got {type(a).__name__}")
            if a.dtype != dt:
                raise ValueError(f"field {name!r} shard {s}: source dtype {a.dtype} != field dtype {dt}")
            if a.ndim < 1 or a.shape[1:] != shape:
                raise ValueError(
                    f"field {name!r} shard {s}: source shape {a.shape} is not (rows, *{shape})"
                )
            if not a.flags.c_contiguous:
                raise ValueError(
                    f"field {name!r} shard {s}: source must be C-contiguous (use np.ascontiguousarray)"
                )
            checked.append(a)
        rows = [a.shape[0] for a in checked]
        if ref_rows is None:
            ref_name, ref_rows = name, rows
        elif rows != ref_rows:
            raise ValueError(
                f"field {name!r} has shard sizes {rows[:8]}{'...' if len(rows) > 8 else ''} "
                f"but field {ref_name!r} has {ref_rows[:8]}{'...' if len(ref_rows) > 8 else ''}; "
                "every field must have the same shards"
            )
        out.append(checked)
    return out

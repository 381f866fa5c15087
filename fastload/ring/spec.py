"""The checked description of a ring: its fields, their per-shard sources, index arrays.

The one validation layer in front of the C++ ring (``fastload._C.Ring``): every message names
the field and shard at fault; the C++ side then only asserts its invariants.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..validate import is_int as _is_int

__all__ = ["RaggedField", "as_index", "batch_dict", "check_source", "pad_as", "pad_check", "parse_fields", "parse_ragged",
           "parse_sources", "ragged_descs", "row_args", "shard_sources", "window_args"]


@dataclass(frozen=True)
class RaggedField:
    """A ring field with a variable number of items per row (see Note [Ragged gather] in
    csrc/gather.h). Its sources are ``(values, offsets)`` per shard: ``values`` of shape
    ``(items, *item_shape)``, ``offsets`` int64 ``(rows + 1,)``. A batch delivers ``name``
    (packed: ``(total, *item_shape)``; ``padded``: ``(rows, width, *item_shape)``, rows
    filled up with ``pad_value``) and ``name + "_offsets"`` (int64, ``rows + 1``, rebased to
    0: row ``i`` has ``offsets[i + 1] - offsets[i]`` items). ``max_items`` truncates each
    row; ``multiple`` rounds the padded width up (at least one multiple); ``capacity`` is
    the items a slot holds (default: ``batch_size`` times the longest row of the shards
    loaded when the ring is made) — a larger batch gets memory of its own rather than
    failing. ``positions`` (packed only): the batch also holds ``name + "_positions"``,
    int64, one per item: its place within its sample (the row's window start plus its place
    in the window; the position ids of sequence packing), written by the producer with the
    items."""

    dtype: Any
    item_shape: tuple = ()
    padded: bool = False
    pad_value: Any = 0
    max_items: int | None = None
    multiple: int = 1
    capacity: int | None = None
    positions: bool = False

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
        if isinstance(spec, RaggedField):
            spec = (spec.dtype, spec.item_shape)
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


def pad_as(value: Any, dt: np.dtype) -> np.generic | None:
    """``value`` as a scalar of dtype ``dt``, or None when it is not a value of ``dt`` (why:
    :func:`pad_check`)."""
    return pad_check(value, dt)[0]


def pad_check(value: Any, dt: np.dtype) -> tuple[np.generic | None, str]:
    """``(value as a scalar of dtype dt, "")``, or ``(None, why)`` when ``dt`` cannot hold
    it: a pad is never silently changed into another number.

    Integer and bool dtypes take exactly representable integers only (``1.0`` is 1; ``1.5``,
    NaN, out-of-range values and complex numbers are refused). Float dtypes (and each part of
    a complex one) take an integer only when they hold it exactly (``16777217`` is not a
    float32), NaN and infinities, and a float that they hold exactly or whose nearest value
    is the same decimal number (``0.1`` is float32's ``0.1``; ``1/3`` or ``16777217.0`` for
    float32, ``1.0001`` for float16 are refused, naming the nearest value); a finite value
    too large for the dtype is refused. Complex numbers need a complex dtype (or an
    imaginary part of 0)."""
    dt = np.dtype(dt)
    parts = _pad_parts(value)
    if parts is None:
        return None, f"a pad value is a single real or complex number, not {type(value).__name__}"
    re_, im = parts
    if dt.kind in "biu":
        if im is not None:
            return None, "a complex number for an integer field"
        if not isinstance(re_, int):
            if not (np.isfinite(re_) and float(re_).is_integer()):
                return None, f"{dt} holds integers only"
            re_ = int(re_)
        lo, hi = (0, 1) if dt.kind == "b" else (int(np.iinfo(dt).min), int(np.iinfo(dt).max))
        if not lo <= re_ <= hi:
            return None, f"{dt} holds {lo}..{hi}"
        return dt.type(re_), ""
    if dt.kind == "f":
        if im is not None and im != 0:
            return None, "a complex number with an imaginary part for a real field"
        return _float_pad(re_, dt)
    if dt.kind == "c":
        part = np.dtype(f"f{dt.itemsize // 2}")
        r, why = _float_pad(re_, part)
        if r is None:
            return None, f"real part: {why}"
        i, why = _float_pad(0 if im is None else im, part)
        if i is None:
            return None, f"imaginary part: {why}"
        return dt.type(complex(float(r), float(i))), ""
    return None, f"pads of dtype {dt} are not supported"


def _pad_parts(value: Any) -> tuple[Any, Any] | None:
    """(real, imaginary or None) of a pad: Python ints exact (any size), floats as numpy
    scalars of their own dtype (a float32 0.1 is the decimal 0.1, not float64's nearest)."""
    if isinstance(value, (bool, np.bool_)):
        return int(bool(value)), None
    if isinstance(value, (int, np.integer)):
        return int(value), None
    if isinstance(value, np.floating):
        return value, None
    if isinstance(value, float):
        return np.float64(value), None
    if isinstance(value, np.complexfloating):
        return value.real, value.imag
    if isinstance(value, complex):
        return np.float64(value.real), np.float64(value.imag)
    if isinstance(value, (str, bytes)):
        return None
    try:
        a = np.asarray(value)  # a 0-d array, a torch scalar tensor
    except (TypeError, ValueError):
        return None
    if a.ndim != 0 or a.dtype.kind not in "biufc":
        return None
    return _pad_parts(a[()])


def _shortest(x: np.floating) -> float:
    """The shortest decimal that names ``x`` in its own dtype, as a Python float."""
    return float(np.format_float_scientific(x, unique=True))


def _float_pad(x: Any, dt: np.dtype) -> tuple[np.generic | None, str]:
    """``x`` (a Python int or a numpy float scalar) as float dtype ``dt`` (see pad_check)."""
    import warnings

    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if isinstance(x, int):
            try:
                cast = dt.type(float(x))
            except OverflowError:
                return None, f"{x} is too large for {dt}"
            if not np.isfinite(cast):
                return None, f"{x} is too large for {dt}"
            if int(cast) != x:
                return None, f"{dt} cannot hold {x} exactly (the nearest {dt} is {int(cast)})"
            return cast, ""
        cast = np.asarray(x).astype(dt)[()]
        if not np.isfinite(x):
            return cast, ""  # NaN and infinities are values of every float dtype
        if np.isinf(cast):
            return None, f"{x} is too large for {dt}"
        if np.asarray(cast).astype(x.dtype)[()] == x or _shortest(cast) == _shortest(x):
            return cast, ""  # exact, or the same decimal number at the dtype's precision
    return None, (f"{dt} cannot hold {np.format_float_positional(x, unique=True, trim='-')} exactly (the "
                  f"nearest {dt} is {np.format_float_positional(cast, unique=True, trim='-')})")


def parse_ragged(fields: Mapping[str, Any], names: list[str], dtypes: list[np.dtype],
                 shapes: list[tuple[int, ...]]) -> list[RaggedField | None]:
    """Per field: its checked RaggedField, or None for a fixed field."""
    out: list[RaggedField | None] = []
    taken = set(names)
    for name, dt, _shape in zip(names, dtypes, shapes):
        spec = fields[name]
        if not isinstance(spec, RaggedField):
            out.append(None)
            continue
        if name + "_offsets" in taken:
            raise ValueError(f"field {name!r}: its offsets are delivered as {name + '_offsets'!r}, which is "
                             "also a field name")
        if spec.positions and (spec.padded or name + "_positions" in taken):
            raise ValueError(f"field {name!r}: positions are delivered for a packed field (padded=False) as "
                             f"{name + '_positions'!r}, which must not be a field name")
        for what, v, lo in (("max_items", spec.max_items, 0), ("multiple", spec.multiple, 1),
                            ("capacity", spec.capacity, 0)):
            if v is not None and (not _is_int(v) or v < lo):
                raise ValueError(f"field {name!r}: {what}={v!r} must be an int >= {lo}")
        why = pad_check(spec.pad_value, dt)[1]
        if why:
            raise ValueError(f"field {name!r}: pad_value={spec.pad_value!r} is not a value of dtype {dt} ({why})")
        out.append(spec)
    return out


def _per_shard(name: str, shards: Any, shard_rows: Any) -> list:
    """A field's sources as a list, one entry per shard (as many as ``shard_rows`` has, if given)."""
    shards = list(shards)
    if shard_rows is not None and len(shards) != len(shard_rows):
        raise ValueError(f"field {name!r} has {len(shards)} shard sources for {len(shard_rows)} shards")
    return shards


def ragged_sources(name: str, shards: Any, dt: np.dtype, shape: tuple[int, ...],
                   shard_rows: Any = None, base: int = 0) -> list[tuple[np.ndarray, np.ndarray] | int]:
    """Checked ``(values, offsets)`` per shard of a ragged field (named ``base + s`` in
    messages). With ``shard_rows``, a shard's entry may be None: not loaded yet (its row count
    takes its place)."""
    one = isinstance(shards, tuple) and len(shards) == 2 and isinstance(shards[0], np.ndarray)
    shards = _per_shard(name, [shards] if one else shards, shard_rows)
    out: list = []
    for s, pair in enumerate(shards):
        sid = base + s
        if pair is None and shard_rows is not None:
            out.append(int(shard_rows[s]))
            continue
        try:
            values, offsets = pair
        except (TypeError, ValueError):
            raise ValueError(f"field {name!r} shard {sid}: a ragged source is a (values, offsets) pair") from None
        if not isinstance(values, np.ndarray) or values.dtype != dt or values.shape[1:] != shape or values.ndim < 1:
            raise ValueError(f"field {name!r} shard {sid}: values must be a numpy array of dtype {dt} and shape "
                             f"(items, *{shape})")
        if not values.flags.c_contiguous:
            raise ValueError(f"field {name!r} shard {sid}: values must be C-contiguous")
        if (not isinstance(offsets, np.ndarray) or offsets.dtype != np.int64 or offsets.ndim != 1
                or len(offsets) < 1 or not offsets.flags.c_contiguous):
            raise ValueError(f"field {name!r} shard {sid}: offsets must be a contiguous 1-d int64 array (rows + 1)")
        if shard_rows is not None and len(offsets) - 1 != int(shard_rows[s]):
            raise ValueError(f"field {name!r} shard {sid}: offsets hold {len(offsets) - 1} rows, the shard "
                             f"{int(shard_rows[s])}")
        out.append((values, offsets))
    return out


def check_source(name: str, s: int, a: Any, dt: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """One shard's source array of field ``name``, checked (dtype, row shape, contiguity)."""
    if not isinstance(a, np.ndarray):
        raise ValueError(f"field {name!r} shard {s}: source must be a numpy array, got {type(a).__name__}")
    if a.dtype != dt:
        raise ValueError(f"field {name!r} shard {s}: source dtype {a.dtype} != field dtype {dt}")
    if a.ndim < 1 or a.shape[1:] != shape:
        raise ValueError(f"field {name!r} shard {s}: source shape {a.shape} is not (rows, *{shape})")
    if not a.flags.c_contiguous:
        raise ValueError(f"field {name!r} shard {s}: source must be C-contiguous (use np.ascontiguousarray)")
    return a


def parse_sources(
    sources: Mapping[str, Any] | None, names: list[str], dtypes: list[np.dtype], shapes: list[tuple[int, ...]],
    ragged: list[RaggedField | None] | None = None, shard_rows: Any = None,
) -> list[list | None]:
    """Per field, one source per shard, or None for a field without sources. With
    ``shard_rows`` (rows per shard), a fixed-size field's shard entry may be None: not
    loaded yet (the ring gets its row count; ``Ring.set_source`` installs it later)."""
    sources = {} if sources is None else sources
    if not isinstance(sources, Mapping):
        raise ValueError("sources must be a dict of field name -> list of per-shard arrays")
    unknown = sorted(set(sources) - set(names))
    if unknown:
        raise ValueError(f"sources has fields {unknown} that are not in fields {names}")
    out: list[list[np.ndarray] | None] = []
    ref_name, ref_rows = None, None
    for name, dt, shape, rag in zip(names, dtypes, shapes, ragged or [None] * len(names)):
        if name not in sources or sources[name] is None:
            out.append(None)
            continue
        shards = sources[name]
        if rag is not None:
            checked = ragged_sources(name, shards, dt, shape, shard_rows)
            rows = [p if isinstance(p, int) else len(p[1]) - 1 for p in checked]
        else:
            checked = []
            for s, a in enumerate(_per_shard(name, [shards] if isinstance(shards, np.ndarray) else shards,
                                             shard_rows)):
                if a is None and shard_rows is not None:
                    checked.append(int(shard_rows[s]))  # not loaded yet: its row count
                    continue
                a = check_source(name, s, a, dt, shape)
                if shard_rows is not None and a.shape[0] != int(shard_rows[s]):
                    raise ValueError(f"field {name!r} shard {s}: source has {a.shape[0]} rows, "
                                     f"the shard {shard_rows[s]}")
                checked.append(a)
            rows = [a if isinstance(a, int) else a.shape[0] for a in checked]
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


def ragged_descs(ragged: list[RaggedField | None], srcs: list, batch_size: int, dtypes: list[np.dtype],
                 shapes: list[tuple[int, ...]]) -> tuple[list[tuple | None], int]:
    """What the C++ ring takes for each ragged field — ``(padded, pad bytes, max_items or -1,
    multiple, capacity, positions)`` — and the slot bytes of all ragged regions."""
    descs: list[tuple | None] = []
    nbytes = 0
    for rag, src, dt, shape in zip(ragged, srcs, dtypes, shapes):
        if rag is None:
            descs.append(None)
            continue
        item = dt.itemsize * int(np.prod(shape, dtype=np.int64))
        cap = rag.capacity
        if cap is None:  # room for batch_size of the longest rows: a batch never needs more
            longest = max((int(np.max(p[1][1:] - p[1][:-1])) for p in (src or [])
                           if not isinstance(p, int) and len(p[1]) > 1), default=0)  # loaded shards only
            if rag.max_items is not None:
                longest = min(longest, rag.max_items)
            m = rag.multiple
            if rag.padded:
                longest = max(-(-longest // m) * m, m if m > 1 else 0)
            cap = batch_size * longest
        pad = pad_as(rag.pad_value, dt).tobytes() if rag.padded else b""  # checked by parse_ragged
        descs.append((bool(rag.padded), pad, -1 if rag.max_items is None else int(rag.max_items),
                      int(rag.multiple), int(cap), bool(rag.positions)))
        nbytes += (batch_size + 1) * 8 + int(cap) * (item + (8 if rag.positions else 0))
    return descs, nbytes


def batch_dict(names: list[str], arrays: tuple) -> dict:
    """The ring's arrays as ``{name: array}``: a ragged field's ``(values, offsets)`` pair as
    ``name`` and ``name + "_offsets"`` (and its positions as ``name + "_positions"``); fields
    without an array (None) left out."""
    out = {}
    for n, a in zip(names, arrays):
        if type(a) is tuple:
            out[n], out[n + "_offsets"] = a[0], a[1]
            if len(a) == 3:
                out[n + "_positions"] = a[2]
        elif a is not None:
            out[n] = a
    return out


def shard_sources(shard: Any, arrays: Any, names: list[str], dtypes: list[np.dtype], shapes: list[tuple],
                  sourced: list[bool], shard_rows: list[int], ragged: list[bool] | None = None) -> list[Any]:
    """Checked per-field entries (``None`` for a field without sources) of ``Ring.set_source``:
    ``arrays`` (``{field: array}`` for every fixed-size sourced field and ``{field: (values,
    offsets)}`` for every ragged one with sources, or ``None`` to drop the shard) for
    ``shard``, whose row count is ``shard_rows[shard]``."""
    if not _is_int(shard) or not 0 <= shard < len(shard_rows):
        raise ValueError(f"shard={shard!r} must be an int in [0, {len(shard_rows)})")
    ragged = ragged or [False] * len(names)
    per_field: list[Any] = [None] * len(names)
    if arrays is not None:
        if not isinstance(arrays, Mapping):
            raise ValueError("arrays must be a dict {field: array} or None (to drop the shard)")
        want = {n for n, src, rag in zip(names, sourced, ragged) if src or rag}
        if set(arrays) != want:
            raise ValueError(f"shard {shard}: set_source needs arrays for exactly the sourced fields "
                             f"{sorted(want)}, got {sorted(arrays)}")
        for f, (n, dt, shape) in enumerate(zip(names, dtypes, shapes)):
            if n not in arrays:
                continue
            if ragged[f]:
                pair = arrays[n]
                if not isinstance(pair, tuple):
                    raise ValueError(f"field {n!r} shard {shard}: a ragged field's source is a (values, offsets) "
                                     f"pair, got {type(pair).__name__}")
                (per_field[f],) = ragged_sources(n, [pair], dt, shape, [shard_rows[shard]], base=int(shard))
                continue
            a = check_source(n, int(shard), arrays[n], dt, shape)
            if a.shape[0] != shard_rows[shard]:
                raise ValueError(f"field {n!r} shard {shard}: source has {a.shape[0]} rows, "
                                 f"the shard {shard_rows[shard]}")
            per_field[f] = a
    return per_field


def row_args(shard: Any, row: Any, index: Any, index_field: str | None) -> tuple:
    """Checked ``(shard, row, index)`` int64 arrays of one request (``index`` only with an
    index field)."""
    s, r = as_index(shard, "shard"), as_index(row, "row")
    if len(s) != len(r):
        raise ValueError(f"shard and row must have the same length (got {len(s)} and {len(r)})")
    if index_field is None:
        if index is not None:
            raise ValueError("index= needs a ring with an index_field")
        return s, r, None
    if index is None:
        raise ValueError(f"this ring's index field {index_field!r} needs index= (the global indices)")
    ix = as_index(index, "index")
    if len(ix) != len(s):
        raise ValueError(f"index has {len(ix)} entries for {len(s)} rows")
    return s, r, ix


def window_args(start: Any, count: Any, n: int) -> tuple:
    """Checked per-row ``(start, count)`` windows of the ragged fields (each may be None)."""
    out = []
    for name, a in (("start", start), ("count", count)):
        if a is not None:
            a = as_index(a, name)
            if len(a) != n:
                raise ValueError(f"{name} has {len(a)} entries for {n} rows")
        out.append(a)
    return tuple(out)

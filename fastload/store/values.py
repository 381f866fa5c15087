"""Checked values: what a sample's values must be to go into a field, never silently changed.

Every function here either returns the value as the field stores it or raises
:class:`~fastload.errors.SampleError` naming the field and the sample, before anything of the
sample is buffered (so a writer can go on with the next sample). Casts are checked by value:
an integer out of the field's range, or a finite number that becomes inf in a smaller float
type, is an error, never a wrapped or clipped number.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..errors import SampleError
from .format import Field

__all__ = ["check_label_field", "check_labels", "encoded", "fixed_rows", "lost_in_cast"]

KeyOf = Callable[[int], str]  # row of a value -> the key of its sample, for messages


def fixed_rows(name: str, f: Field, value: Any, n: int | None, keys: KeyOf) -> np.ndarray:
    """``value`` as rows of the tensor/scalar field ``f``: one sample (``n is None``, shape
    ``(1, *f.shape)``) or a batch of ``n`` (shape ``(n, *f.shape)``), contiguous, in the
    field's dtype. ``keys(row)`` names the sample of a row in errors."""
    where = f"sample {keys(0)!r}" if n is None else f"the batch of samples {keys(0)!r}..{keys(n - 1)!r}"
    try:
        arr = np.asarray(value)
    except ValueError as e:  # ragged nested lists
        raise SampleError(f"field {name!r} of {where}: not a {f} array ({e})") from None
    want = f.shape if n is None else (n, *f.shape)
    if arr.shape != want:
        raise SampleError(f"field {name!r} of {where}: got shape {arr.shape}, expected {want} ({f})")
    if arr.dtype == object:
        raise SampleError(f"field {name!r} of {where}: values numpy cannot store as numbers "
                          f"(integers beyond 64 bits, or mixed types?); expected {f}")
    if arr.dtype != f.np_dtype:
        ints = arr.dtype.kind in "iu" and f.np_dtype.kind in "iu"  # any sign: range-checked below
        if not (ints or np.can_cast(arr.dtype, f.np_dtype, casting="same_kind")):
            raise SampleError(f"field {name!r} of {where}: got dtype {arr.dtype}, expected {f.dtype}")
        with np.errstate(over="ignore", invalid="ignore"):  # overflow is checked just below
            cast = arr.astype(f.np_dtype)
        lost = lost_in_cast(arr, cast, f.np_dtype)
        if lost is not None:
            flat = lost.reshape(1 if n is None else n, -1).any(axis=1)
            row = int(np.flatnonzero(flat)[0])
            bad = arr.reshape(flat.size, -1)[row][lost.reshape(flat.size, -1)[row]][0].item()
            raise SampleError(f"field {name!r} of sample {keys(row)!r}: {bad!r} does not fit in "
                              f"{f.np_dtype} (it would be stored as something else); widen the field "
                              "or fix the value")
        arr = cast
    return np.ascontiguousarray(arr).reshape(want if n is not None else (1, *f.shape))


def lost_in_cast(src: np.ndarray, cast: np.ndarray, dtype: np.dtype) -> np.ndarray | None:
    """Mask of the values of ``src`` that ``cast`` (``src`` cast to ``dtype``) does not hold,
    or None when it holds them all."""
    if np.issubdtype(dtype, np.integer) and np.issubdtype(src.dtype, np.integer):
        info = np.iinfo(dtype)
        lost = (src < info.min) | (src > info.max)
    elif np.issubdtype(dtype, np.inexact) and src.dtype.kind in "iu":
        with np.errstate(invalid="ignore", over="ignore"):  # integers must survive exactly
            lost = ~np.isfinite(cast) | (cast.astype(src.dtype) != src)
    elif np.issubdtype(dtype, np.inexact) and src.dtype.kind in "fc":
        lost = np.isfinite(src) & ~np.isfinite(cast)  # overflow to inf (rounding is expected)
    else:
        return None
    return lost if lost.any() else None


def check_label_field(fields: Mapping[str, Field], label: str | None) -> None:
    """A label field must be one of ``fields`` and an integer scalar (ValueError otherwise)."""
    if label is None:
        return
    f = fields.get(label)
    if f is None:
        raise ValueError(f"label={label!r} is not one of the fields {list(fields)}")
    if f.kind != "scalar" or not np.issubdtype(f.np_dtype, np.integer):
        raise ValueError(f"label field {label!r} must be an integer scalar, not {f}")


def check_labels(name: str, labels: np.ndarray, class_names: Sequence[str] | None, keys: KeyOf) -> None:
    """Class ids must be 0 or more, and below ``len(class_names)`` when there are names."""
    labels = labels.reshape(-1)
    top = len(class_names) if class_names is not None else None
    bad = labels < 0 if top is None else (labels < 0) | (labels >= top)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        limit = f"0..{top - 1} (one per class name)" if top is not None else "0 or more"
        raise SampleError(f"field {name!r} of sample {keys(i)!r}: class id {int(labels[i])} is not "
                          f"a valid label; class ids are {limit}")


def encoded(name: str, f: Field, value: Any, key: str) -> bytes | str:
    """The value of an image/bytes field as ``bytes`` (a 1-d uint8 array is taken as bytes),
    or of a string field as ``str``."""
    if f.kind == "string":
        if not isinstance(value, str):
            raise SampleError(f"field {name!r} of sample {key!r}: expected str, got {type(value).__name__}")
        return value
    if isinstance(value, np.ndarray) and value.dtype == np.uint8 and value.ndim == 1:
        value = value.tobytes()
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise SampleError(f"field {name!r} of sample {key!r}: expected bytes, got {type(value).__name__}")
    return bytes(value)

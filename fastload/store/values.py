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

__all__ = ["Ragged", "check_label_field", "check_labels", "encoded", "fixed_rows", "lost_in_cast", "ragged_rows"]

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
    arr = _cast(name, f, arr, where, lambda flat_row: keys(flat_row), 1 if n is None else n)
    return np.ascontiguousarray(arr).reshape(want if n is not None else (1, *f.shape))


def _cast(name: str, f: Field, arr: np.ndarray, where: str, key_of_row: KeyOf, rows: int) -> np.ndarray:
    """``arr`` (``rows`` equal-size rows) in the field's dtype, checked by value."""
    if arr.dtype == object:
        raise SampleError(f"field {name!r} of {where}: values numpy cannot store as numbers "
                          f"(integers beyond 64 bits, or mixed types?); expected {f}")
    if arr.dtype == f.np_dtype:
        return arr
    ints = arr.dtype.kind in "iu" and f.np_dtype.kind in "iu"  # any sign: range-checked below
    if not (ints or np.can_cast(arr.dtype, f.np_dtype, casting="same_kind")):
        raise SampleError(f"field {name!r} of {where}: got dtype {arr.dtype}, expected {f.dtype}")
    with np.errstate(over="ignore", invalid="ignore"):  # overflow is checked just below
        cast = arr.astype(f.np_dtype)
    lost = lost_in_cast(arr, cast, f.np_dtype)
    if lost is not None:
        flat = lost.reshape(rows, -1).any(axis=1)
        row = int(np.flatnonzero(flat)[0])
        bad = arr.reshape(rows, -1)[row][lost.reshape(rows, -1)[row]][0].item()
        raise SampleError(f"field {name!r} of sample {key_of_row(row)!r}: {bad!r} does not fit in "
                          f"{f.np_dtype} (it would be stored as something else); widen the field "
                          "or fix the value")
    return cast


class Ragged:
    """Many samples of a ragged field at once, without a Python object per sample:
    ``values`` (all items, shape ``(total, *item_shape)``) and ``offsets`` (``n + 1``
    non-decreasing integers from 0 to ``total``: sample ``i`` is
    ``values[offsets[i]:offsets[i + 1]]``). ``ShardWriter.write_batch`` takes it for a ragged
    field in place of a list of arrays; ``Ragged.from_lengths(values, lengths)`` builds one
    from per-sample lengths. ``r[a:b]`` is samples ``a..b-1`` (views, offsets rebased)."""

    __slots__ = ("values", "offsets")

    def __init__(self, values: Any, offsets: Any):
        self.values = np.asarray(values)
        offsets = np.asarray(offsets)
        if offsets.ndim != 1 or offsets.size == 0 or offsets.dtype.kind not in "iu":
            raise ValueError(f"Ragged offsets must be a non-empty 1-d integer array (n + 1 entries), "
                             f"got shape {offsets.shape} dtype {offsets.dtype}")
        offsets = offsets.astype(np.int64, copy=False)
        if self.values.ndim == 0:
            raise ValueError("Ragged values must have at least one dimension (the items)")
        if offsets[0] != 0 or offsets[-1] != len(self.values) or (offsets.size > 1 and (np.diff(offsets) < 0).any()):
            bad = int(np.flatnonzero(np.diff(offsets) < 0)[0]) if (np.diff(offsets) < 0).any() else None
            raise ValueError(
                f"Ragged offsets must rise from 0 to len(values)={len(self.values)}"
                + (f"; they decrease after sample {bad}" if bad is not None
                   else f"; they run from {int(offsets[0])} to {int(offsets[-1])}"))
        self.offsets = offsets

    @classmethod
    def from_lengths(cls, values: Any, lengths: Any) -> Ragged:
        lengths = np.asarray(lengths)
        if lengths.ndim != 1 or lengths.dtype.kind not in "iu" or (lengths < 0).any():
            raise ValueError("Ragged lengths must be a 1-d array of integers >= 0")
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return cls(values, offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            a, b, step = key.indices(len(self))
            if step != 1:
                raise ValueError("Ragged supports contiguous slices only")
            b = max(a, b)
            o = self.offsets[a:b + 1]
            return Ragged(self.values[o[0]:o[-1]], o - o[0])
        i = int(key)
        if i < 0:
            i += len(self)
        return self.values[self.offsets[i]:self.offsets[i + 1]]

    def __repr__(self) -> str:
        return f"Ragged({len(self)} samples, {len(self.values)} items of {self.values.shape[1:]} {self.values.dtype})"


def ragged_rows(name: str, f: Field, value: Any, n: int | None, keys: KeyOf) -> tuple[np.ndarray, np.ndarray]:
    """``value`` as the items of the ragged field ``f``: ``(values, lengths)`` with ``values``
    of shape ``(total, *f.shape)`` in the field's dtype (contiguous) and ``lengths`` int64,
    one per sample. One sample (``n is None``): an array-like of shape ``(k, *f.shape)``
    (``k`` may be 0). A batch of ``n``: a :class:`Ragged`, or a sequence of such arrays."""
    item = tuple(f.shape)
    if n is None:
        arr = _one_ragged(name, f, value, f"sample {keys(0)!r}")
        return _cast(name, f, arr, f"sample {keys(0)!r}", keys, 1).reshape(-1, *item), np.array([len(arr)], np.int64)
    where = f"the batch of samples {keys(0)!r}..{keys(n - 1)!r}"
    if isinstance(value, Ragged):
        if len(value) != n:
            raise SampleError(f"field {name!r} of {where}: Ragged holds {len(value)} samples, expected {n}")
        values = value.values
        if values.size == 0 and values.shape[1:] != item:
            values = values.reshape(0, *item) if not item or values.ndim == 1 else values
        if values.shape[1:] != item:
            raise SampleError(f"field {name!r} of {where}: Ragged values have items of shape {values.shape[1:]}, "
                              f"expected {item} ({f})")
        lengths = value.lengths
    else:
        if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
            raise SampleError(f"field {name!r} of {where}: expected a list of arrays (one per sample) or a "
                              f"fastload.store.Ragged, got {type(value).__name__}")
        arrays = [_one_ragged(name, f, v, f"sample {keys(i)!r}") for i, v in enumerate(value)]
        lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
        typed = [a for a in arrays if a.size]
        values = np.concatenate(typed) if typed else np.empty((0, *item), f.np_dtype)
    row_of_item = None

    def key_of_item(i: int) -> str:  # the flat item row -> its sample's key
        nonlocal row_of_item
        if row_of_item is None:
            row_of_item = np.cumsum(lengths)
        return keys(int(np.searchsorted(row_of_item, i, side="right")))

    values = _cast(name, f, values, where, key_of_item, len(values)) if len(values) else values.astype(f.np_dtype)
    return np.ascontiguousarray(values), lengths.astype(np.int64, copy=False)


def _one_ragged(name: str, f: Field, value: Any, where: str) -> np.ndarray:
    try:
        arr = np.asarray(value)
    except ValueError as e:
        raise SampleError(f"field {name!r} of {where}: not a {f} array ({e})") from None
    item = tuple(f.shape)
    if arr.shape == (0,) or arr.shape == (0, *item):  # [] or np.empty(0): no items, any dtype
        return np.empty((0, *item), dtype=f.np_dtype)
    if arr.ndim != 1 + len(item) or arr.shape[1:] != item:
        want = "(k,)" if not item else f"(k, {', '.join(map(str, item))})"
        raise SampleError(f"field {name!r} of {where}: got shape {arr.shape}, expected {want} ({f})")
    return arr


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

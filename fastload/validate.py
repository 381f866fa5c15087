"""Argument checks shared by every public entry point: one message style everywhere.

``check_int("batch_size", v, min=1)`` accepts Python and numpy integers (never ``bool``,
never a float such as ``1.0`` or ``1.5``) and returns a Python int; ``check_choice`` names the
allowed values; ``check_bool`` accepts ``True``/``False`` only (``shuffle="no"`` is not
truthy here); ``check_seed`` accepts the seeds fastload's random streams support
(``0 <= seed < 2**64``: larger seeds would alias smaller ones); ``check_index_array`` turns
sample indices into an int64 array without truncating floats. Messages follow
``f"{name}={value!r} must be ..."`` and are :class:`ValueError`\\ s.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

__all__ = ["ON_ERROR", "SEED_MAX", "check_bool", "check_choice", "check_index_array", "check_int", "check_seed",
           "is_int"]

SEED_MAX = 2**64 - 1  # seeds key numpy's SeedSequence as one 64-bit word
# on_error= of the Loader and of convert: a bad sample raises (naming it), or is skipped
# (counted in stats() / listed in the skipped report)
ON_ERROR = ("raise", "skip")


def is_int(value: Any) -> bool:
    """An integer that is not a bool (``True`` is not 1 here)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_int(name: str, value: Any, *, min: int | None = None, max: int | None = None) -> int:
    if not is_int(value):
        raise ValueError(f"{name}={_show(value)} must be an int" + _range(min, max))
    v = int(value)
    if (min is not None and v < min) or (max is not None and v > max):
        raise ValueError(f"{name}={_show(value)} must be an int" + _range(min, max))
    return v


def check_seed(name: str, value: Any) -> int:
    """A seed: an int in ``[0, 2**64 - 1]``."""
    return check_int(name, value, min=0, max=SEED_MAX)


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name}={_show(value)} must be True or False")
    return bool(value)


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> Any:
    if not any(value == c and type(value) is type(c) for c in choices):
        raise ValueError(f"{name}={_show(value)} must be one of {tuple(choices)}")
    return value


def check_index_array(values: Any, name: str = "indices") -> np.ndarray:
    """Sample indices as a 1-d int64 array. Integer arrays and sequences of ints only: a
    float (``1.7``) or bool index is an error, never truncated or taken as 0/1."""
    if type(values) is np.ndarray and values.dtype == np.int64 and values.ndim == 1:
        return values  # fast path
    arr = np.asarray(values)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        bad = arr.reshape(-1)[0] if arr.dtype.kind != "O" else next(
            (v for v in arr.reshape(-1) if not is_int(v)), arr.reshape(-1)[0])
        raise ValueError(f"{name} must be integers, got {_show(bad)} ({arr.dtype}); "
                         "sample indices are ints 0..len(dataset)-1")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-d, got shape {arr.shape}")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{name} holds {int(arr.max())}, beyond any dataset's size")
    return arr.astype(np.int64, copy=False)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _range(lo: int | None, hi: int | None) -> str:
    if lo is not None and hi is not None:
        return f" in [{lo}, {hi}]"
    if lo is not None:
        return f" >= {lo}" if lo != 1 else " > 0"
    if hi is not None:
        return f" <= {hi}"
    return ""

"""Argument checks shared by every public entry point: one message style everywhere.

``check_int("batch_size", v, min=1)`` accepts Python and numpy integers (never ``bool``,
never a float such as ``1.0``) and returns a Python int; ``check_choice`` names the allowed
values. Messages follow ``f"{name}={value!r} must be ..."``.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

__all__ = ["check_choice", "check_int", "is_int"]


def is_int(value: Any) -> bool:
    """An integer that is not a bool (``True`` is not 1 here)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_int(name: str, value: Any, *, min: int | None = None, max: int | None = None) -> int:
    if not is_int(value):
        raise ValueError(f"{name}={value!r} must be an int" + _range(min, max))
    v = int(value)
    if (min is not None and v < min) or (max is not None and v > max):
        raise ValueError(f"{name}={value!r} must be an int" + _range(min, max))
    return v


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> Any:
    if not any(value == c and type(value) is type(c) for c in choices):
        raise ValueError(f"{name}={value!r} must be one of {tuple(choices)}")
    return value


def _range(lo: int | None, hi: int | None) -> str:
    if lo is not None and hi is not None:
        return f" in [{lo}, {hi}]"
    if lo is not None:
        return f" >= {lo}" if lo != 1 else " > 0"
    if hi is not None:
        return f" <= {hi}"
    return ""

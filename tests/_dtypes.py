"""Every numeric dtype a field may have, and random values of each (shared by the store and
ragged tests)."""
from __future__ import annotations

import numpy as np

DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "float32", "float64", "bool", "complex64", "complex128"]


def random_values(rng, dtype: str, shape) -> np.ndarray:
    """Values of ``dtype`` spread over its range (integers: min to max inclusive)."""
    a = rng.standard_normal(shape) * 100
    if dtype == "bool":
        return a > 0
    if dtype.startswith("complex"):
        return (a + 1j * rng.standard_normal(shape)).astype(dtype)
    if dtype.startswith(("int", "uint")):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    return a.astype(dtype)

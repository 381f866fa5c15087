"""arrays: numpy ``.npz`` / ``.npy`` files (or a directory of ``.npy``) -> one field per array.

The first axis of every array is the sample axis, and all arrays must agree on its length.
1-d arrays become scalar fields, others tensor fields of shape ``a.shape[1:]``. An integer
array named ``label``/``labels`` (or ``--label NAME``) becomes the label field. Pickled
object arrays are refused: ``allow_pickle=False`` always.
"""
from __future__ import annotations

import os
import zipfile
from pathlib import Path

import numpy as np

from ..files import NotRegularFile, check_regular
from ..store.format import SUPPORTED_DTYPES, Field
from .common import ConvertError, Source, bulk_chunks, resolve_label


def _load(path: Path) -> dict[str, np.ndarray]:
    try:
        if path.is_dir():
            files = sorted(path.glob("*.npy"))
            if not files:
                raise ConvertError(f"{path}: a directory with no .npy files")
            for p in files:  # only regular files: a FIFO would block np.load, /dev/zero never end
                check_regular(p, what="array file")
            return {p.stem: np.load(p, mmap_mode="r", allow_pickle=False) for p in files}
        if path.suffix in (".npy", ".npz"):
            check_regular(path, what="array file")
        if path.suffix == ".npy":
            return {path.stem: np.load(path, mmap_mode="r", allow_pickle=False)}
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as z:
                return {k: z[k] for k in z.files}
    except ConvertError:
        raise
    except NotRegularFile as e:
        raise ConvertError(str(e)) from None
    except FileNotFoundError:
        raise ConvertError(f"{path}: no such file") from None
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as e:
        raise ConvertError(f"{path}: not a readable numpy file ({e})") from None
    raise ConvertError(f"{path}: arrays expects a .npz file, a .npy file or a directory of .npy files")


class ArraysSource(Source):
    def __init__(self, src: str | os.PathLike, label: str | None = None):
        path = Path(src)
        arrays = _load(path)
        if not arrays:
            raise ConvertError(f"{path}: holds no arrays")
        lengths = {}
        fields = {}
        for name, a in arrays.items():
            if a.ndim == 0:
                raise ConvertError(f"{path}: array {name!r} is 0-d; every array needs a sample axis first")
            if a.dtype.name not in SUPPORTED_DTYPES:
                raise ConvertError(f"{path}: array {name!r} has dtype {a.dtype}, which cannot be stored; "
                                   f"supported: {', '.join(SUPPORTED_DTYPES)}")
            lengths[name] = a.shape[0]
            fields[name] = (Field("scalar", a.dtype.name) if a.ndim == 1
                            else Field("tensor", a.dtype.name, a.shape[1:]))
        if len(set(lengths.values())) != 1:
            raise ConvertError(f"{path}: arrays disagree on the number of samples (first axis): {lengths}")
        label = resolve_label(fields, label)
        if label is not None and not (fields[label].kind == "scalar" and np.issubdtype(arrays[label].dtype, np.integer)):
            raise ConvertError(f"{path}: label array {label!r} must be 1-d integers, not {fields[label]}")
        super().__init__(fields=fields, num_samples=next(iter(lengths.values())), label=label,
                         metadata={"source": "arrays"})
        self.path = path
        self.arrays = arrays

    def read(self, i: int) -> dict:
        return {n: a[i] for n, a in self.arrays.items()}

    def fast_chunks(self):
        return bulk_chunks(self.arrays, self.num_samples)

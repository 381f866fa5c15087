"""arrays: numpy ``.npz`` / ``.npy`` files (or a directory of ``.npy``) -> one field per array.

The first axis of every array is the sample axis, and all arrays must agree on its length.
1-d arrays become scalar fields, others tensor fields of shape ``a.shape[1:]``. An integer
array named ``label``/``labels`` (or ``--label NAME``) becomes the label field.

Ragged fields (a variable number of items per sample) come as a pair: ``NAME`` holds every
sample's items one after the other (shape ``(items, *item_shape)``) and ``NAME_offsets``
(``n + 1`` integers rising from 0 to ``len(NAME)``) or ``NAME_lengths`` (``n`` integers)
says where each sample's start. From Python, ``convert("arrays", {"tokens": obj, ...}, dst)``
also takes a dict of arrays, where an object array of per-sample arrays is a ragged field.
Pickled object arrays in files are refused: ``allow_pickle=False`` always.
"""
from __future__ import annotations

import os
import zipfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from ..files import NotRegularFile, check_regular
from ..store.format import SUPPORTED_DTYPES, Field
from ..store.values import Ragged
from .common import ConvertError, Source, bulk_chunks, resolve_label


def array_files(path: Path) -> list[Path]:
    """The files an arrays source reads: SRC itself, or the ``.npy`` files of a folder (sorted)."""
    return sorted(Path(path).glob("*.npy")) if Path(path).is_dir() else [Path(path)]


def _load(path: Path, files: list[Path]) -> dict[str, np.ndarray]:
    try:
        if path.is_dir():
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
        hint = ("; an object array needs pickle, which fastload never loads: store a ragged field as a pair "
                "NAME (the items one after the other) and NAME_offsets") if "allow_pickle" in str(e) or "Python objects" in str(e) else ""
        raise ConvertError(f"{path}: not a readable numpy file ({e}){hint}") from None
    raise ConvertError(f"{path}: arrays expects a .npz file, a .npy file or a directory of .npy files")


def _pairs(path, arrays: dict) -> dict:
    """Replace each ``NAME`` + ``NAME_offsets`` / ``NAME_lengths`` pair (and, from Python,
    each object array of per-sample arrays) by a Ragged."""
    out = dict(arrays)
    for name in list(arrays):
        for suffix in ("_offsets", "_lengths"):
            if name.endswith(suffix) and name[:-len(suffix)] in arrays:
                base = name[:-len(suffix)]
                try:
                    out[base] = (Ragged(arrays[base], arrays[name]) if suffix == "_offsets"
                                 else Ragged.from_lengths(arrays[base], arrays[name]))
                except ValueError as e:
                    raise ConvertError(f"{path}: arrays {base!r} and {name!r} are not a ragged pair ({e})") from None
                del out[name]
    for name, a in list(out.items()):
        if isinstance(a, np.ndarray) and a.dtype == object:
            out[name] = _from_objects(path, name, a)
    return out


def _from_objects(path, name: str, a: np.ndarray) -> Ragged:
    if a.ndim != 1:
        raise ConvertError(f"{path}: object array {name!r} must be 1-d (one array per sample)")
    try:
        parts = [np.asarray(x) for x in a]
    except ValueError as e:
        raise ConvertError(f"{path}: object array {name!r}: {e}") from None
    shapes = {p.shape[1:] for p in parts if p.size}
    if len(shapes) > 1 or any(p.ndim == 0 for p in parts):
        raise ConvertError(f"{path}: object array {name!r}: samples must be arrays whose shapes differ only in the "
                           f"first dimension; got item shapes {sorted(shapes)[:4]}")
    typed = [p for p in parts if p.size]
    values = np.concatenate(typed) if typed else np.empty(0, np.float32)
    return Ragged.from_lengths(values, [len(p) if p.ndim else 1 for p in parts])


class ArraysSource(Source):
    def __init__(self, src: str | os.PathLike | Mapping, label: str | None = None):
        if isinstance(src, Mapping):
            path = Path("<arrays>")
            arrays = {str(k): (v if isinstance(v, Ragged) else np.asarray(v)) for k, v in src.items()}
        else:
            from .sourcestate import stat_file

            path = Path(src)
            files = array_files(path)
            opened = {os.fspath(f): stat_file(f) for f in files}  # before reading them
            arrays = _load(path, files)
        if not arrays:
            raise ConvertError(f"{path}: holds no arrays")
        arrays = _pairs(path, arrays)
        lengths = {}
        fields = {}
        for name, a in arrays.items():
            if isinstance(a, Ragged):
                if a.values.dtype.name not in SUPPORTED_DTYPES:
                    raise ConvertError(f"{path}: ragged array {name!r} has dtype {a.values.dtype}, which cannot be "
                                       f"stored; supported: {', '.join(SUPPORTED_DTYPES)}")
                lengths[name] = len(a)
                fields[name] = Field("ragged", a.values.dtype.name, a.values.shape[1:])
                continue
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
        if not isinstance(src, Mapping):
            self.files = [os.fspath(f) for f in files]
            self.opened = opened

    def inputs(self) -> list[str]:
        return getattr(self, "files", [])

    def read(self, i: int) -> dict:
        return {n: a[i] for n, a in self.arrays.items()}

    def fast_chunks(self):
        return bulk_chunks(self.arrays, self.num_samples)

"""Sources -> fastload datasets. One module per source kind; ``convert()`` dispatches.

``fastload.convert`` names both this package and its :func:`convert` function. Importing
the package (``import fastload.convert``, ``from fastload.convert import ...``) binds the
*package* to the attribute ``convert`` of ``fastload`` whenever that happens — with a lazy
``fastload/__init__`` possibly after the function was bound there — so the package itself is
callable as the function: ``fastload.convert("imagefolder", src, dst)`` works either way.
"""
from __future__ import annotations

import os
import sys
import types
from collections.abc import Mapping
from typing import Sequence

from ..errors import ConvertError
from .common import Source, run_convert

KINDS = ("imagefolder", "arrays", "table", "webdataset")


def make_source(kind: str, src: str | os.PathLike, *, label: str | None = None,
                image_columns: Sequence[str] = (), max_pixels: int | None = None) -> Source:
    if kind == "imagefolder":
        from .imagefolder import ImageFolderSource
        return ImageFolderSource(src, max_pixels=max_pixels)
    if kind == "arrays":
        from .arrays import ArraysSource
        return ArraysSource(src, label=label)
    if kind == "table":
        from .table import TableSource
        return TableSource(src, label=label, image_columns=image_columns, max_pixels=max_pixels)
    if kind == "webdataset":
        from .webdataset import WebDatasetSource
        return WebDatasetSource(src)
    raise ValueError(f"unknown source kind {kind!r}; use one of {', '.join(KINDS)}")


def convert(kind: str, src: str | os.PathLike, dst: str | os.PathLike, *, workers: int | None = None,
            shard_size: int | str = "256MB", on_error: str = "raise", overwrite: bool = False,
            label: str | None = None, image_columns: Sequence[str] = (), max_pixels: int | None = None,
            progress: bool = True) -> dict:
    """Convert a source into a fastload dataset at ``dst``; return a summary dict.

    kind: "imagefolder" (SRC/<class>/<images>), "arrays" (.npz / .npy / folder of .npy, or
    a dict of arrays; ragged fields as NAME + NAME_offsets pairs or object arrays),
    "table" (Parquet, CSV, JSON lines) or "webdataset" (.tar shards). Refuses a non-empty
    ``dst`` unless ``overwrite`` (which swaps the new dataset in only once it is complete: a
    failed overwrite leaves the old one untouched); on failure nothing that opens is left
    behind. Samples the writer refuses (wrong shape, a value out of the field's range) are
    errors naming the sample, or skipped and reported with ``on_error="skip"``.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown source kind {kind!r}; use one of {', '.join(KINDS)}")
    in_memory = kind == "arrays" and isinstance(src, Mapping)  # a dict of arrays, from Python
    if not in_memory and not os.path.exists(src):
        raise ConvertError(f"{src}: no such file or directory")
    s_abs, d_abs = (None, None) if in_memory else (os.path.realpath(src), os.path.realpath(dst))
    if s_abs is not None and os.path.isdir(s_abs) and (d_abs == s_abs or d_abs.startswith(s_abs.rstrip(os.sep) + os.sep)):
        raise ConvertError(f"{dst} is inside the source {src}; choose a destination outside it "
                           "(the dataset would become part of its own source)")
    source = make_source(kind, src, label=label, image_columns=image_columns, max_pixels=max_pixels)
    try:
        return run_convert(source, dst, workers=workers, shard_size=shard_size, on_error=on_error,
                           overwrite=overwrite, progress=progress, desc=f"convert {kind}")
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            close()


class _CallablePackage(types.ModuleType):
    def __call__(self, *args, **kwargs) -> dict:
        return convert(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage

__all__ = ["KINDS", "ConvertError", "convert", "make_source"]

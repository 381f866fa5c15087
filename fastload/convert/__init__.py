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
from ..store.geometry import DEFAULT_MAX_PIXELS
from ..validate import check_bool, check_choice, check_int
from .common import Source, check_shard_size, run_convert

KINDS = ("imagefolder", "arrays", "table", "webdataset")


# The options each source kind takes; passing another is an error, never silently ignored.
_OPTIONS = {"imagefolder": {"max_pixels"}, "arrays": {"label"}, "table": {"label", "image_columns", "max_pixels"},
            "webdataset": {"max_pixels"}}
_WHY = {("imagefolder", "label"): "its labels are the class folder names",
        ("webdataset", "label"): "its label is the .cls member",
        ("arrays", "max_pixels"): "arrays hold no images"}


def check_options(kind: str, *, label: str | None, image_columns: Sequence[str], max_pixels: int | None) -> None:
    given = {"label": label is not None, "image_columns": bool(image_columns), "max_pixels": max_pixels is not None}
    for opt, on in given.items():
        if on and opt not in _OPTIONS[kind]:
            flag = "--" + opt.replace("_", "-").replace("columns", "column")
            why = _WHY.get((kind, opt), f"only {', '.join(k for k, o in _OPTIONS.items() if opt in o)} take it")
            raise ConvertError(f"{flag} does not apply to {kind} sources ({why}); leave it out")
    if label is not None and (not isinstance(label, str) or not label):
        raise ConvertError(f"--label {label!r} must name a column or array")


def make_source(kind: str, src: str | os.PathLike, *, label: str | None = None,
                image_columns: Sequence[str] = (), max_pixels: int | None = None) -> Source:
    check_choice("kind", kind, KINDS)
    check_options(kind, label=label, image_columns=image_columns, max_pixels=max_pixels)
    max_pixels = DEFAULT_MAX_PIXELS if max_pixels is None else check_int("max_pixels", max_pixels, min=1)
    if kind == "imagefolder":
        from .imagefolder import ImageFolderSource
        return ImageFolderSource(src, max_pixels=max_pixels)
    if kind == "arrays":
        from .arrays import ArraysSource
        return ArraysSource(src, label=label)
    if kind == "table":
        from .table import TableSource
        return TableSource(src, label=label, image_columns=image_columns, max_pixels=max_pixels)
    from .webdataset import WebDatasetSource
    return WebDatasetSource(src, max_pixels=max_pixels)


def convert(kind: str, src: str | os.PathLike, dst: str | os.PathLike, *, workers: int | None = None,
            shard_size: int | str = "256MB", on_error: str = "raise", overwrite: bool = False,
            label: str | None = None, image_columns: Sequence[str] = (), max_pixels: int | None = None,
            progress: bool = True, allow_small_shards: bool = False) -> dict:
    """Convert a source into a fastload dataset at ``dst``; return a summary dict.

    kind: "imagefolder" (SRC/<class>/<images>), "arrays" (.npz / .npy / folder of .npy, or
    a dict of arrays; ragged fields as NAME + NAME_offsets pairs or object arrays),
    "table" (Parquet, CSV, JSON lines) or "webdataset" (.tar shards). Refuses a non-empty
    ``dst`` unless ``overwrite`` (which swaps the new dataset in only once it is complete: a
    failed overwrite leaves the old one untouched); on failure nothing that opens is left
    behind. Samples the writer refuses (wrong shape, a value out of the field's range) are
    errors naming the sample, or skipped and reported with ``on_error="skip"``.

    Images are decoded by PIL (in ``workers`` processes) and by DALI's CPU decoder (the
    Loader's), and refused above ``max_pixels`` (default: the Loader's, 2**26), so a dataset
    that converts is one the Loader decodes. ``shard_size`` below 1 MB needs
    ``allow_small_shards=True``. Options a source kind does not take (``label`` for an image
    folder) are errors.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown source kind {kind!r}; use one of {', '.join(KINDS)}")
    check_options(kind, label=label, image_columns=image_columns, max_pixels=max_pixels)
    check_shard_size(shard_size, check_bool("allow_small_shards", allow_small_shards))
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
                           overwrite=overwrite, progress=progress, desc=f"convert {kind}",
                           allow_small_shards=allow_small_shards)
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            close()


class _CallablePackage(types.ModuleType):
    def __call__(self, *args, **kwargs) -> dict:
        return convert(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage

__all__ = ["KINDS", "ConvertError", "convert", "make_source"]

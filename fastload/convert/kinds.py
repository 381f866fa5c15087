"""The source kinds of ``fastload convert`` and the one place that opens a source by kind."""
from __future__ import annotations

import os
from typing import Sequence

from ..errors import ConvertError
from ..store.geometry import DEFAULT_MAX_PIXELS
from ..validate import check_int
from .common import Source

KINDS = ("imagefolder", "arrays", "table", "webdataset")

# The options each source kind takes; passing another is an error, never silently ignored.
_OPTIONS = {"imagefolder": {"max_pixels"}, "arrays": {"label"}, "table": {"label", "image_columns", "max_pixels"},
            "webdataset": {"max_pixels"}}
_WHY = {("imagefolder", "label"): "its labels are the class folder names",
        ("webdataset", "label"): "its label is the .cls member",
        ("arrays", "max_pixels"): "arrays hold no images"}


def check_options(kind: str, *, label: str | None, image_columns: Sequence[str], max_pixels: int | None) -> None:
    """ConvertError for an option ``kind`` does not take (``--label`` for an image folder,
    whose labels are its folder names) instead of ignoring it."""
    if kind not in _OPTIONS:
        raise ValueError(f"unknown source kind {kind!r}; use one of {', '.join(KINDS)}")
    given = {"label": label is not None, "image_columns": bool(image_columns), "max_pixels": max_pixels is not None}
    for opt, on in given.items():
        if on and opt not in _OPTIONS[kind]:
            flag = "--" + opt.replace("_", "-").replace("columns", "column")
            why = _WHY.get((kind, opt), f"only {', '.join(k for k, o in _OPTIONS.items() if opt in o)} take it")
            raise ConvertError(f"{flag} does not apply to {kind} sources ({why}); leave it out")
    if label is not None and (not isinstance(label, str) or not label):
        raise ConvertError(f"--label {label!r} must name a column or array")
    if max_pixels is not None:
        check_int("max_pixels", max_pixels, min=1)


def make_source(kind: str, src: str | os.PathLike, *, label: str | None = None,
                image_columns: Sequence[str] = (), max_pixels: int | None = None) -> Source:
    """The source of ``kind`` at ``src``; images are limited to ``max_pixels`` (default: the
    Loader's own limit, 2**26)."""
    check_options(kind, label=label, image_columns=image_columns, max_pixels=max_pixels)
    max_pixels = DEFAULT_MAX_PIXELS if max_pixels is None else max_pixels
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
        return WebDatasetSource(src, max_pixels=max_pixels)
    raise ValueError(f"unknown source kind {kind!r}; use one of {', '.join(KINDS)}")

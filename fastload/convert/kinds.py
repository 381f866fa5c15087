"""The source kinds of ``fastload convert`` and the one place that opens a source by kind."""
from __future__ import annotations

import os
from typing import Sequence

from .common import Source

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

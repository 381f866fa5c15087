"""The source kinds of ``fastload convert`` and the one place that opens a source by kind."""
from __future__ import annotations

import os
from typing import Sequence

from ..errors import ConvertError
from ..store.geometry import DEFAULT_MAX_PIXELS
from ..validate import check_int
from .common import Source
from .resize import check_resize_options

KINDS = ("imagefolder", "arrays", "table", "webdataset", "videofolder", "audiofolder")

# The options each source kind takes; passing another is an error, never silently ignored.
_IMAGES = {"max_pixels", "max_size", "quality"}  # the options of sources with image fields
_OPTIONS = {"imagefolder": _IMAGES, "arrays": {"label"}, "table": {"label", "image_columns", *_IMAGES},
            "webdataset": _IMAGES, "videofolder": {"min_frames", "video_codec"}, "audiofolder": set()}
_WHY = {("imagefolder", "label"): "its labels are the class folder names",
        ("webdataset", "label"): "its label is the .cls member",
        **{("arrays", o): "arrays hold no images" for o in _IMAGES},
        **{(k, o): f"{k} sources hold no images" for k in ("videofolder", "audiofolder") for o in _IMAGES},
        **{(k, "label"): "its labels are the class folder names" for k in ("videofolder", "audiofolder")}}


def check_options(kind: str, *, label: str | None, image_columns: Sequence[str], max_pixels: int | None,
                  max_size: int | None = None, quality: int | None = None, min_frames: int | None = None,
                  video_codec: str | None = None) -> None:
    """ConvertError for an option ``kind`` does not take (``--label`` for an image folder,
    whose labels are its folder names) instead of ignoring it; UsageError for a bad
    ``max_size`` / ``quality``."""
    if kind not in _OPTIONS:
        raise ValueError(f"unknown source kind {kind!r}; use one of {', '.join(KINDS)}")
    given = {"label": label is not None, "image_columns": bool(image_columns), "max_pixels": max_pixels is not None,
             "max_size": max_size is not None, "quality": quality is not None, "min_frames": min_frames is not None,
             "video_codec": video_codec is not None}
    for opt, on in given.items():
        if on and opt not in _OPTIONS[kind]:
            flag = "--" + opt.replace("_", "-").replace("columns", "column")
            why = _WHY.get((kind, opt), f"only {', '.join(k for k, o in _OPTIONS.items() if opt in o)} take it")
            raise ConvertError(f"{flag} does not apply to {kind} sources ({why}); leave it out")
    if label is not None and (not isinstance(label, str) or not label):
        raise ConvertError(f"--label {label!r} must name a column or array")
    if max_pixels is not None:
        check_int("max_pixels", max_pixels, min=1)
    check_resize_options(max_size, quality)
    if kind == "videofolder":
        from .media import check_media_options

        check_media_options(min_frames, video_codec)


def make_source(kind: str, src: str | os.PathLike, *, label: str | None = None,
                image_columns: Sequence[str] = (), max_pixels: int | None = None, max_size: int | None = None,
                quality: int | None = None, min_frames: int | None = None, video_codec: str | None = None) -> Source:
    """The source of ``kind`` at ``src``; images are limited to ``max_pixels`` (default: the
    Loader's own limit, 2**26) and, with ``max_size``, stored re-encoded when their longer
    side exceeds it (JPEG ``quality``, default 90; see resize.py)."""
    check_options(kind, label=label, image_columns=image_columns, max_pixels=max_pixels, max_size=max_size,
                  quality=quality, min_frames=min_frames, video_codec=video_codec)
    if kind in ("videofolder", "audiofolder"):
        from .media import media_folder

        return media_folder(kind, src, **({"min_frames": min_frames, "video_codec": video_codec}
                                          if kind == "videofolder" else {}))
    max_pixels = DEFAULT_MAX_PIXELS if max_pixels is None else max_pixels
    resize = {"max_size": max_size, "quality": quality}
    if kind == "imagefolder":
        from .imagefolder import ImageFolderSource
        return ImageFolderSource(src, max_pixels=max_pixels, **resize)
    if kind == "arrays":
        from .arrays import ArraysSource
        return ArraysSource(src, label=label)
    if kind == "table":
        from .table import TableSource
        return TableSource(src, label=label, image_columns=image_columns, max_pixels=max_pixels, **resize)
    if kind == "webdataset":
        from .webdataset import WebDatasetSource
        return WebDatasetSource(src, max_pixels=max_pixels, **resize)
    raise ValueError(f"unknown source kind {kind!r}; use one of {', '.join(KINDS)}")

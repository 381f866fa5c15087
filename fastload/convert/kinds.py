"""The source kinds of ``fastload convert`` and the one place that opens a source by kind."""
from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

from ..errors import ConvertError
from ..store.geometry import DEFAULT_MAX_PIXELS
from ..validate import check_int
from .common import Source
from .resize import check_resize_options

KINDS = ("imagefolder", "arrays", "table", "webdataset", "coco", "videofolder", "audiofolder")

# The options each source kind takes; passing another is an error, never silently ignored.
_IMAGES = {"max_pixels", "max_size", "quality"}  # the options of sources with image fields
_OPTIONS = {"imagefolder": _IMAGES, "arrays": {"label"}, "table": {"label", "image_columns", *_IMAGES},
            "webdataset": _IMAGES, "coco": {"max_pixels", "images", "masks", "skip_empty"},
            "videofolder": {"min_frames", "video_codec"}, "audiofolder": set()}
_WHY = {("imagefolder", "label"): "its labels are the class folder names",
        ("webdataset", "label"): "its label is the .cls member",
        **{("arrays", o): "arrays hold no images" for o in _IMAGES},
        **{("coco", o): "boxes and masks are in pixels of the stored image: resize the images and their "
                        "annotations before converting, or resize in the Loader's transform"
           for o in ("max_size", "quality")},
        ("coco", "label"): "its labels are the annotations' category ids",
        **{(k, o): f"{k} sources hold no images" for k in ("videofolder", "audiofolder") for o in _IMAGES},
        **{(k, "label"): "its labels are the class folder names" for k in ("videofolder", "audiofolder")}}
# Options of the coco kind alone (IMAGES_DIR, --masks, --skip-empty), passed as ``source_options``.
COCO_OPTIONS = ("images", "masks", "skip_empty")
# Options of the videofolder kind (--min-frames, --video-codec), passed as ``source_options`` too.
MEDIA_OPTIONS = ("min_frames", "video_codec")
SOURCE_OPTIONS = (*COCO_OPTIONS, *MEDIA_OPTIONS)


def check_options(kind: str, *, label: str | None, image_columns: Sequence[str], max_pixels: int | None,
                  max_size: int | None = None, quality: int | None = None,
                  source_options: Mapping[str, Any] | None = None) -> None:
    """ConvertError for an option ``kind`` does not take (``--label`` for an image folder,
    whose labels are its folder names) instead of ignoring it; UsageError for a bad
    ``max_size`` / ``quality``."""
    if kind not in _OPTIONS:
        raise ValueError(f"unknown source kind {kind!r}; use one of {', '.join(KINDS)}")
    given = {"label": label is not None, "image_columns": bool(image_columns), "max_pixels": max_pixels is not None,
             "max_size": max_size is not None, "quality": quality is not None}
    source_options = dict(source_options or {})
    unknown = [k for k in source_options if k not in SOURCE_OPTIONS]
    if unknown:
        raise ValueError(f"unknown source option {unknown[0]!r}; the source options are {', '.join(SOURCE_OPTIONS)}")
    given.update({k: v is not None and v is not False for k, v in source_options.items()})
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

        check_media_options(source_options.get("min_frames"), source_options.get("video_codec"))


def make_source(kind: str, src: str | os.PathLike, *, label: str | None = None,
                image_columns: Sequence[str] = (), max_pixels: int | None = None, max_size: int | None = None,
                quality: int | None = None, source_options: Mapping[str, Any] | None = None) -> Source:
    """The source of ``kind`` at ``src``; images are limited to ``max_pixels`` (default: the
    Loader's own limit, 2**26) and, with ``max_size``, stored re-encoded when their longer
    side exceeds it (JPEG ``quality``, default 90; see resize.py)."""
    check_options(kind, label=label, image_columns=image_columns, max_pixels=max_pixels, max_size=max_size,
                  quality=quality, source_options=source_options)
    if kind in ("videofolder", "audiofolder"):
        from .media import media_folder

        return media_folder(kind, src, **dict(source_options or {}))
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
    if kind == "coco":
        from .coco import CocoSource
        return CocoSource(src, max_pixels=max_pixels, **dict(source_options or {}))
    raise ValueError(f"unknown source kind {kind!r}; use one of {', '.join(KINDS)}")

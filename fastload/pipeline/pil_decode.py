"""Decode one encoded image on the host, for code that is not a Loader (a plain
``torch.utils.data.DataLoader`` over a :class:`fastload.Dataset`, a notebook, a test).

``fastload.vision.decode(data)`` -> a ``torch.uint8`` tensor ``(H, W, C)`` (or ``(C, H, W)``).
Pillow with libjpeg-turbo decodes; the image is turned upright by its EXIF orientation, as
DALI does in a Loader and as the sizes recorded by ``convert`` assume. ``min_size`` lets
JPEG decode at 1/2, 1/4 or 1/8 scale when the shorter side stays at least that large
(several times faster for thumbnails or small training crops).

Inside a Loader, images are decoded by DALI (``transforms={...}``), in C++ threads, on the
GPU when there is one: this helper is for per-sample Python pipelines.
"""
from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["decode"]

_MODES = {"RGB": 3, "L": 1, "RGBA": 4}


def decode(data: Any, *, mode: str = "RGB", layout: str = "HWC", min_size: int | None = None) -> torch.Tensor:
    """``data`` (bytes, a uint8 numpy array or tensor, e.g. ``ds[i]["image"]``) -> uint8 tensor.

    mode: "RGB" (3 channels), "L" (grey, 1 channel) or "RGBA". layout: "HWC" or "CHW".
    min_size: decode JPEGs at a reduced scale whose shorter side is still >= ``min_size``.
    Raises ValueError naming the problem when ``data`` is not a decodable image."""
    import torch
    from PIL import Image, ImageOps

    if mode not in _MODES:
        raise ValueError(f"mode={mode!r} must be one of {tuple(_MODES)}")
    if layout not in ("HWC", "CHW"):
        raise ValueError(f"layout={layout!r} must be 'HWC' or 'CHW'")
    if isinstance(data, torch.Tensor):
        data = data.numpy()
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8 or data.ndim != 1:
            raise ValueError(f"decode takes encoded bytes; got an array of {data.dtype} {data.shape}")
        data = np.ascontiguousarray(data).data  # a memoryview of the bytes, no copy
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"decode takes encoded image bytes, not {type(data).__name__}")
    try:
        im: Image.Image = Image.open(io.BytesIO(data))
        if min_size is not None and im.format == "JPEG":
            w, h = im.size
            scale = min(w, h) / max(int(min_size), 1)
            if scale >= 2:  # draft picks the smallest DCT scale with both sides >= the request
                im.draft(mode if mode != "RGBA" else "RGB", (int(w / scale) or 1, int(h / scale) or 1))
        im = ImageOps.exif_transpose(im)
        if im.mode != mode:
            im = im.convert(mode)
        arr = np.asarray(im)
    except Exception as e:  # Pillow raises many types
        raise ValueError(f"not a decodable image ({type(e).__name__}: {e})") from None
    if not arr.flags.writeable:
        arr = arr.copy()
    if arr.ndim == 2:
        arr = arr[:, :, None]
    t = torch.from_numpy(arr)
    return t.permute(2, 0, 1).contiguous() if layout == "CHW" else t

"""Images stored pre-resized: ``convert --max-size N`` (like FFCV's ``max_resolution``).

An image whose longer side (as the decoders deliver it: EXIF orientation applied) exceeds N
pixels is re-encoded at convert time so that its longer side is exactly N, the aspect ratio
kept (the shorter side rounded, at least 1 pixel). Every other image is stored byte for byte.

How an image is re-encoded:

* decoded by PIL, turned upright by its EXIF orientation (as DALI reads it, see
  ``store.geometry.exif_orientation``), resized with Lanczos (PIL's ``LANCZOS``, formerly
  ``ANTIALIAS``); the new file carries no EXIF block, so it decodes upright as stored and its
  recorded width and height are those of the new pixels;
* JPEG (and MPO, the phones' multi-picture JPEG: its first picture) stays JPEG, at
  ``--quality`` (default 90), grayscale kept grayscale, CMYK made RGB;
* PNG stays PNG, lossless (palette images become RGB or RGBA, 1-bit ones grayscale, 16-bit
  ones stay 16-bit);
* every other format (BMP, TIFF, WebP, PPM/PGM, JPEG 2000) becomes JPEG at ``--quality``: the
  Loader decodes to 8-bit RGB anyway, and a lossy JPEG is what makes these small. An alpha
  channel is dropped as the Loader's decoder drops it.

The ICC profile, if any, is kept. The new bytes then go through the same checks as any image
(PIL, then DALI's decoder), and are what the dataset stores.
"""
from __future__ import annotations

import io
from typing import Any

from ..errors import UsageError
from ..store.geometry import exif_orientation
from ..validate import is_int

__all__ = ["DEFAULT_QUALITY", "MIN_MAX_SIZE", "check_resize_options", "shrink", "target_size", "transpose_upright"]

MIN_MAX_SIZE = 16  # below this a stored image is too small for any crop worth training on
DEFAULT_QUALITY = 90


def check_resize_options(max_size: Any, quality: Any) -> None:
    """UsageError naming the option for a bad ``max_size`` / ``quality``."""
    if max_size is not None and (not is_int(max_size) or int(max_size) < MIN_MAX_SIZE):
        raise UsageError(f"--max-size (max_size={max_size!r}) must be an int >= {MIN_MAX_SIZE}: the longer side, "
                         "in pixels, of the images as stored (larger ones are re-encoded at that size)")
    if quality is not None:
        if max_size is None:
            raise UsageError("--quality (quality) applies to images re-encoded by --max-size (max_size); "
                             "pass --max-size too, or leave --quality out")
        if not is_int(quality) or not 1 <= int(quality) <= 100:
            raise UsageError(f"--quality (quality={quality!r}) must be an int in [1, 100] (the JPEG quality of "
                             f"re-encoded images; default {DEFAULT_QUALITY})")


def target_size(width: int, height: int, max_size: int) -> tuple[int, int]:
    """(width, height) with the longer side ``max_size`` and the aspect ratio kept."""
    if width >= height:
        return max_size, max(1, round(height * max_size / width))
    return max(1, round(width * max_size / height)), max_size


# EXIF orientation -> the PIL transpose that turns the pixels upright (ImageOps.exif_transpose's)
_UPRIGHT = {2: "FLIP_LEFT_RIGHT", 3: "ROTATE_180", 4: "FLIP_TOP_BOTTOM", 5: "TRANSPOSE", 6: "ROTATE_270",
            7: "TRANSVERSE", 8: "ROTATE_90"}


def transpose_upright(im, orientation: int):
    """The PIL image ``im`` transposed as the EXIF ``orientation`` (1-8) turns pixels upright."""
    from PIL import Image

    op = _UPRIGHT.get(orientation)
    return im if op is None else im.transpose(getattr(Image.Transpose, op))


def _upright(im):
    """``im`` turned upright by its EXIF orientation (the operations of ImageOps.exif_transpose)."""
    return transpose_upright(im, exif_orientation(im))


_PNG_MODES = ("L", "LA", "RGB", "RGBA", "I", "I;16", "I;16B", "I;16L")


def _eight_bit_gray(im):
    """A 16- or 32-bit grayscale image as 8-bit "L" (16-bit: the high byte)."""
    import numpy as np
    from PIL import Image

    a = np.asarray(im)
    a = (a.astype(np.uint32) >> 8) if im.mode.startswith("I;16") else np.clip(a, 0, 255)
    return Image.fromarray(a.astype(np.uint8), "L")


def _png_mode(im):
    if im.mode in _PNG_MODES:
        return im
    if im.mode in ("P", "PA"):
        return im.convert("RGBA" if im.mode == "PA" or "transparency" in im.info else "RGB")
    if im.mode == "1":
        return im.convert("L")
    return im.convert("RGBA" if "A" in im.mode else "RGB")


def _jpeg_mode(im):
    if im.mode in ("L", "RGB"):
        return im
    if im.mode == "1":
        return im.convert("L")
    if im.mode in ("I", "F") or im.mode.startswith("I;16"):
        return _eight_bit_gray(im)
    return im.convert("RGB")  # RGBA, LA, P, CMYK, YCbCr, ...: alpha dropped, as DALI's RGB output does


def shrink(im, max_size: int, quality: int) -> bytes:
    """Re-encode the loaded PIL image ``im`` (larger than ``max_size``) upright at ``max_size``;
    ValueError when it cannot be."""
    from PIL import Image

    fmt, icc = im.format, im.info.get("icc_profile")
    try:
        out = _upright(im)
        png = fmt == "PNG"
        out = _png_mode(out) if png else _jpeg_mode(out)
        out = out.resize(target_size(out.width, out.height, max_size), Image.Resampling.LANCZOS)
        buf = io.BytesIO()
        kw: dict[str, Any] = {"icc_profile": icc} if icc else {}
        if png:
            out.save(buf, "PNG", **kw)
        else:
            out.save(buf, "JPEG", quality=int(quality), **kw)
        return buf.getvalue()
    except Exception as e:  # PIL raises many types
        raise ValueError(f"cannot re-encode it at --max-size {max_size} ({type(e).__name__}: {e})") from None

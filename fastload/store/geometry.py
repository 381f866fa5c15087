"""Image geometry: an image's (width, height) as the decoders deliver it.

The store records each image's size at convert time (the hidden ``<name>_width`` and
``<name>_height`` columns) so that crop windows can be drawn without decoding. Decoders
apply the EXIF orientation, so the recorded size is the upright one. Reading it decodes no
pixels. PIL is imported on first use only.
"""
from __future__ import annotations

import io

__all__ = ["DEFAULT_MAX_PIXELS", "displayed_size", "exif_orientation", "image_size"]

# The one image-size limit: the Loader's transforms refuse images with more pixels than this
# (before decoding), and convert refuses them at conversion time by default, so a dataset that
# converts is a dataset that loads. 2**26 = 67 MP, about 200 MB decoded as RGB.
DEFAULT_MAX_PIXELS = 2**26

# EXIF orientations 5-8 rotate by 90 degrees: the decoders (DALI, like PIL's exif_transpose)
# deliver the image upright, so its width and height are swapped relative to the pixel data.
_TRANSPOSING_ORIENTATIONS = (5, 6, 7, 8)
# Formats whose EXIF block DALI reads. TIFF is left out: PIL already reports a TIFF's
# upright size (and transposes it on load).
_EXIF_FORMATS = ("JPEG", "MPO", "PNG", "WEBP")


def exif_orientation(im) -> int:
    """The EXIF orientation (1-8) of an open PIL image as DALI applies it, 1 when it has none.

    Only the real EXIF block counts (JPEG APP1, PNG eXIf, WebP EXIF: ``im.info["exif"]``), not
    PIL's other sources (XMP ``tiff:Orientation``, PNG text "Raw profile type exif"), which DALI
    ignores. Reading it decodes no pixels."""
    raw = im.info.get("exif") if im.format in _EXIF_FORMATS else None
    if not raw:
        return 1
    try:
        from PIL import Image

        exif = Image.Exif()
        exif.load(raw)
        orientation = int(exif.get(0x0112, 1))
    except Exception:  # a damaged EXIF block: the decoders ignore it too
        return 1
    return orientation if 1 <= orientation <= 8 else 1


def displayed_size(im) -> tuple[int, int]:
    """(width, height) of an open PIL image as DALI decodes it: after its EXIF orientation
    (see :func:`exif_orientation`). Reading it decodes no pixels."""
    w, h = int(im.size[0]), int(im.size[1])
    return (h, w) if exif_orientation(im) in _TRANSPOSING_ORIENTATIONS else (w, h)


def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) from an encoded image's header, without decoding the pixels, as the
    decoders deliver it (EXIF orientation applied: crop windows are drawn in that frame)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        return displayed_size(im)

"""Images at convert time: fully decoded by PIL (and re-encoded for ``--max-size``), under one
pixel limit, the run's ``max_pixels``.

PIL has a limit of its own (``Image.MAX_IMAGE_PIXELS``, about 89 MP: a warning above it, a
``DecompressionBombError`` above twice that), which would refuse an image the user allowed
with ``--max-pixels`` and print two lines of warning for others. While fastload decodes, PIL's
limit is the run's: fastload's own check of the header's size comes first (and names the
size and the option), then PIL decodes under the same limit, its warning silenced.
(DALI's decoder, the Loader's, checks every image a second time: see imagecheck.py.)
"""
from __future__ import annotations

import contextlib
import io
import threading
import warnings
from typing import Iterator

from ..store.geometry import displayed_size
from .resize import DEFAULT_QUALITY, shrink

__all__ = ["DECODABLE_FORMATS", "IMAGE_EXTENSIONS", "check_image", "pil_limit", "prepare_image"]

# What DALI's decoders read (fn.decoders.image): anything else must be re-encoded first. MPO is
# the multi-picture JPEG phones write (PIL's name for it); DALI decodes its first picture, as PIL.
DECODABLE_FORMATS = {"JPEG", "MPO", "PNG", "BMP", "TIFF", "WEBP", "PPM", "JPEG2000"}
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".pgm", ".pbm", ".pnm", ".bmp", ".tif",
                    ".tiff", ".webp", ".jp2", ".j2k")

_PIL_LOCK = threading.RLock()  # PIL's limit and the warning filters are process-wide
_KEEP = object()


@contextlib.contextmanager
def pil_limit(max_pixels=_KEEP) -> Iterator[None]:
    """PIL's pixel limit set to ``max_pixels`` (None: none) for the block, PIL's
    DecompressionBombWarning silenced; both restored afterwards."""
    from PIL import Image

    with _PIL_LOCK, warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        old = Image.MAX_IMAGE_PIXELS
        if max_pixels is not _KEEP:
            Image.MAX_IMAGE_PIXELS = max_pixels
        try:
            yield
        finally:
            Image.MAX_IMAGE_PIXELS = old


def check_image(data: bytes, max_pixels: int | None = None) -> tuple[int, int]:
    """Decode ``data`` fully and return (width, height); raise ValueError when it is not an
    image DALI can decode."""
    return prepare_image(data, max_pixels)[1]


def prepare_image(data: bytes, max_pixels: int | None = None, max_size: int | None = None,
                  quality: int = DEFAULT_QUALITY) -> tuple[bytes | None, tuple[int, int]]:
    """Decode ``data`` fully; return (the re-encoded image or None, its (width, height)).
    With ``max_size``, an image whose longer side exceeds it is re-encoded (resize.py) and the
    new bytes are checked as any image; others are kept as they are (None). Raise ValueError
    when it is not an image DALI can decode, or has more than ``max_pixels`` pixels (None:
    PIL's own limit applies)."""
    from PIL import Image

    try:
        # the header first, without PIL's limit: fastload's own check below names the size
        with pil_limit(None if max_pixels is not None else _KEEP), Image.open(io.BytesIO(data)) as im:
            fmt = im.format
            w, h = im.size
            if fmt not in DECODABLE_FORMATS:
                raise ValueError(f"image format {fmt} cannot be decoded by DALI; re-encode it as JPEG or PNG")
            if max_pixels is not None and w * h > max_pixels:
                why = ("convert decodes it to resize it; raise --max-pixels if it is genuine" if max_size else
                       "the Loader would refuse it too; raise --max-pixels and the transform's max_pixels "
                       "together if it is genuine")
                raise ValueError(f"image of {w}x{h} = {w * h} pixels exceeds max_pixels={max_pixels} ({why})")
            with pil_limit(max_pixels if max_pixels is not None else _KEEP):  # PIL decodes under the run's limit
                im.load()
                w, h = displayed_size(im)  # after load(): a PNG's eXIf chunk may follow its pixels
                if max_size is not None and max(w, h) > max_size:
                    small = shrink(im, max_size, quality)
                    return small, prepare_image(small, max_pixels)[1]
    except ValueError:
        raise
    except Exception as e:  # PIL raises many types (OSError, SyntaxError, DecompressionBombError…)
        if type(e).__name__ == "UnidentifiedImageError":
            raise ValueError("not an image: the header matches no known image format") from None
        raise ValueError(f"not a decodable image ({type(e).__name__}: {e})") from None
    return None, (int(w), int(h))

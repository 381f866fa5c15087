"""Small datasets made on the spot from real photographs (no download).

The photos are the ones that ship inside scikit-image (``skimage.data``); random crops of
them, resized so the longer side is 300-500 px and saved as JPEG (quality 90), make an
ImageFolder tree whose classes are the source photos. Deterministic for a given seed.
"""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "motorcycle_left", "immunohistochemistry",
          "hubble_deep_field", "colorwheel", "retina", "camera", "page")


def photos(names=PHOTOS) -> dict[str, np.ndarray]:
    """RGB uint8 arrays of the named skimage.data photos (those that exist in this version)."""
    try:
        from skimage import data
    except ImportError:
        raise ImportError("sample data needs scikit-image (pip install scikit-image); its bundled "
                          "photographs are the real images used for the demo and the benchmarks") from None
    out = {}
    for n in names:
        fn = getattr(data, n, None)
        if fn is None:
            continue
        try:
            img = np.asarray(fn())
        except Exception:  # a photo that needs a download (pooch) in this version: leave it out
            continue
        if img.ndim == 2:
            img = np.stack([img] * 3, axis=-1)
        img = img[..., :3]
        if img.dtype != np.uint8:
            img = (255 * (img.astype(np.float64) / max(float(img.max()), 1e-9))).astype(np.uint8)
        if min(img.shape[:2]) >= 64:
            out[n] = img
    if not out:
        raise RuntimeError("no skimage.data photo could be loaded")
    return out


def random_jpeg(img: np.ndarray, rng: np.random.Generator, *, min_side: int = 300, max_side: int = 500,
                quality: int = 90) -> bytes:
    """A random crop of ``img``, resized so its longer side is in [min_side, max_side], as JPEG."""
    from PIL import Image

    h, w = img.shape[:2]
    ch = int(rng.integers(max(32, h // 3), h + 1))
    cw = int(rng.integers(max(32, w // 3), w + 1))
    y = int(rng.integers(0, h - ch + 1))
    x = int(rng.integers(0, w - cw + 1))
    crop = Image.fromarray(np.ascontiguousarray(img[y:y + ch, x:x + cw]))
    longer = int(rng.integers(min_side, max_side + 1))
    scale = longer / max(ch, cw)
    crop = crop.resize((max(8, round(cw * scale)), max(8, round(ch * scale))), Image.BILINEAR)
    buf = io.BytesIO()
    crop.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def make_image_folder(dst: str | Path, num_images: int = 256, *, seed: int = 0, classes: int | None = None,
                      min_side: int = 300, max_side: int = 500, quality: int = 90) -> Path:
    """Write ``num_images`` JPEGs into ``dst/<class>/<n>.jpg``; class = source photo."""
    dst = Path(dst)
    src = photos()
    names = sorted(src)[: classes or len(src)]
    rng = np.random.default_rng(seed)
    for i in range(num_images):
        c = names[i % len(names)]
        d = dst / c
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i:06d}.jpg").write_bytes(random_jpeg(src[c], rng, min_side=min_side, max_side=max_side,
                                                     quality=quality))
    return dst

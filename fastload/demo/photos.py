"""Small datasets made on the spot from real photographs (no download).

The photos are the ones that ship inside scikit-image (``skimage.data``); random crops of
them, resized so the longer side is 300-500 px and saved as JPEG (quality 90), make an
ImageFolder tree whose classes are the source photos. Deterministic for a given seed.

scikit-image is an optional (test/bench) dependency: without it ``make_image_folder`` falls
back to ``synthetic_photos`` (textured, varied images drawn with numpy, the same crops and
JPEG encoding), so ``fastload demo`` works after a plain ``pip install fastload``.
``photo_source()`` says which of the two is in use.
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


SYNTHETIC = ("bricks", "waves", "rings", "checker", "gradient", "noise", "stripes", "blobs")


def synthetic_photos(names=SYNTHETIC, *, size: tuple[int, int] = (512, 640)) -> dict[str, np.ndarray]:
    """Deterministic RGB uint8 images, one per class name, made with numpy alone: each class has
    its own structure (bricks, waves, rings, ...) plus smooth colour and fine noise, so the JPEGs
    made from them are textured like photos (not flat colour, which compresses to nothing)."""
    h, w = size
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    out = {}
    for k, n in enumerate(names):
        rng = np.random.default_rng(1000 + k)
        f = rng.uniform(0.02, 0.09, 3)
        phase = rng.uniform(0, 2 * np.pi, 3)
        kind = SYNTHETIC[k % len(SYNTHETIC)] if n not in SYNTHETIC else n
        if kind == "bricks":
            base = ((yy // 24 % 2 * 20 + xx) // 48 + yy // 24) % 2 + 0.15 * ((yy % 24 < 2) | (xx % 48 < 2))
        elif kind == "waves":
            base = np.sin(f[0] * xx + 3 * np.sin(f[1] * yy)) * 0.5 + 0.5
        elif kind == "rings":
            r = np.hypot(yy - h * rng.uniform(0.3, 0.7), xx - w * rng.uniform(0.3, 0.7))
            base = np.sin(f[2] * r * 1.5) * 0.5 + 0.5
        elif kind == "checker":
            base = ((yy // 32 + xx // 32) % 2).astype(np.float32)
        elif kind == "gradient":
            base = (yy / h + xx / w) / 2
        elif kind == "stripes":
            base = (np.sin(f[0] * (xx + 0.7 * yy)) > 0).astype(np.float32)
        elif kind == "blobs":
            base = np.zeros((h, w), np.float32)
            for cy, cx, rad in zip(rng.uniform(0, h, 12), rng.uniform(0, w, 12), rng.uniform(20, 90, 12)):
                base += np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * rad ** 2))
            base = np.clip(base, 0, 1)
        else:  # noise: low-frequency noise, upsampled
            small = rng.random((h // 16 + 1, w // 16 + 1)).astype(np.float32)
            base = np.kron(small, np.ones((16, 16), np.float32))[:h, :w]
        tint = np.stack([np.sin(f[i] * 0.3 * (xx + yy) + phase[i]) * 0.5 + 0.5 for i in range(3)], -1)
        c0, c1 = rng.uniform(0, 1, 3), rng.uniform(0, 1, 3)
        img = base[..., None] * c0 + (1 - base[..., None]) * c1
        img = 0.7 * img + 0.3 * tint + rng.normal(0, 0.04, (h, w, 3))
        out[n] = (np.clip(img, 0, 1) * 255).astype(np.uint8)
    return out


def photo_source() -> str:
    """'scikit-image' when its bundled photographs can be used, else 'synthetic'."""
    try:
        import skimage.data  # noqa: F401
    except ImportError:
        return "synthetic"
    return "scikit-image"


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
    """Write ``num_images`` JPEGs into ``dst/<class>/<n>.jpg``; class = source photo (scikit-image's
    photographs, or ``synthetic_photos`` without scikit-image: see ``photo_source``)."""
    dst = Path(dst)
    src = photos() if photo_source() == "scikit-image" else synthetic_photos()
    names = sorted(src)[: classes or len(src)]
    rng = np.random.default_rng(seed)
    for i in range(num_images):
        c = names[i % len(names)]
        d = dst / c
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i:06d}.jpg").write_bytes(random_jpeg(src[c], rng, min_side=min_side, max_side=max_side,
                                                     quality=quality))
    return dst

"""Image files and datasets the tests share: crops of scikit-image's real photos as JPEG, and
folders of files written from a dict."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np

import fastload


def jpeg(a: np.ndarray, quality: int = 90) -> bytes:
    from PIL import Image

    b = io.BytesIO()
    Image.fromarray(a).save(b, "JPEG", quality=quality)
    return b.getvalue()


def write_photo_crops(path: Path, n: int, shard_size: str) -> Path:
    """``n`` JPEG crops of 80-199 px per side from four photos, labels ``i % 4``, keys
    ``img000.jpg``..., in shards of ``shard_size`` (seeded: the same bytes every run)."""
    from fastload.demo.photos import photos

    p = list(photos(["astronaut", "chelsea", "coffee", "rocket"]).values())
    rng = np.random.default_rng(1)
    with fastload.ShardWriter(path, {"image": "image", "label": "int64"}, label="label", shard_size=shard_size) as wr:
        for i in range(n):
            src = p[i % len(p)]
            h, w = rng.integers(80, 200), rng.integers(80, 200)
            y, x = rng.integers(0, src.shape[0] - h), rng.integers(0, src.shape[1] - w)
            wr.write({"image": jpeg(src[y:y + h, x:x + w]), "label": i % 4}, key=f"img{i:03d}.jpg")
    return path


def write_folder(root: Path, files: dict[str, bytes]) -> Path:
    """Write ``{relative path: bytes}`` under ``root`` (parents created); returns ``root``."""
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return root

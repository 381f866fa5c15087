"""``fastload demo``: the whole job, end to end, on a small dataset made from real photos."""
from __future__ import annotations

import shutil
import time
from pathlib import Path


def run_demo(out: Path, num_images: int = 512, quick: bool = False) -> int:
    from .cli import inspect_text
    from .convert import convert
    from .sample_data import make_image_folder

    if quick:
        num_images = min(num_images, 96)
    out.mkdir(parents=True, exist_ok=True)
    src = out / "images"
    dst = out / "dataset"
    t0 = time.perf_counter()
    if src.exists():
        shutil.rmtree(src)
    make_image_folder(src, num_images, seed=0)
    t_gen = time.perf_counter() - t0
    print(f"[1/2] generated {num_images} JPEGs from scikit-image's photos in {src} ({t_gen:.1f} s)")
    r = convert("imagefolder", src, dst, overwrite=True, progress=False)
    print(f"[2/2] converted to {dst}: {r['num_samples']} samples, {r['num_shards']} shard(s) "
          f"in {r['seconds']:.2f} s ({r['num_samples'] / max(r['seconds'], 1e-9):,.0f} images/s)")
    print()
    print(inspect_text(dst))
    print()
    print(f"output: {out.resolve()}")
    return 0

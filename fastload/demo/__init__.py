"""``fastload demo``: the whole job, end to end, on a small dataset made from real photos.

1. generate an image folder of JPEG crops of scikit-image's sample photos (no download), or of
   synthetic textured images when scikit-image is not installed (the line says which);
2. ``fastload convert imagefolder`` it into Arrow shards and print ``inspect``;
3. iterate it with ``fastload.Loader`` and the ImageNet training preset (DALI);
4. a short benchmark against ``torch.utils.data.DataLoader`` doing the same work.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path


def run_demo(out: Path, num_images: int = 512, quick: bool = False) -> int:
    """Run the demo into ``out``. On any failure (an exception, Ctrl-C) what this run made is
    removed again: ``out`` itself if it did not exist before, else the parts written into it."""
    out = Path(out)
    made_out = not out.exists()
    parts = [out / "images", out / "dataset", out / "demo-results.json"]
    fresh = [p for p in parts if not p.exists()]
    try:
        return _run_demo(out, num_images, quick)
    except BaseException:
        if made_out:
            shutil.rmtree(out, ignore_errors=True)
        else:
            for p in fresh:
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                elif p.exists():
                    p.unlink()
        raise


def _run_demo(out: Path, num_images: int, quick: bool) -> int:
    import torch

    from .. import vision
    from ..bench.cli import BenchOptions
    from ..bench.report import machine_info, system_info
    from ..bench.runs import run_fastload, run_torch
    from ..convert import convert
    from ..loader import Loader
    from .photos import make_image_folder, photo_source
    from ..store.inspect import inspect_text

    if quick:
        num_images = min(num_images, 96)
    out.mkdir(parents=True, exist_ok=True)
    src = out / "images"
    dst = out / "dataset"
    t0 = time.perf_counter()
    if src.exists():
        shutil.rmtree(src)
    source = photo_source()
    make_image_folder(src, num_images, seed=0)
    what = ("scikit-image's photos" if source == "scikit-image" else
            "synthetic textured images (scikit-image is not installed; pip install scikit-image for real photos)")
    print(f"[1/4] generated {num_images} JPEGs from {what} in {src} "
          f"({time.perf_counter() - t0:.1f} s)")
    r = convert("imagefolder", src, dst, overwrite=True, progress=False)
    print(f"[2/4] converted to {dst}: {r['num_samples']} samples, {r['num_shards']} shard(s) "
          f"in {r['seconds']:.2f} s ({r['num_samples'] / max(r['seconds'], 1e-9):,.0f} images/s)\n")
    print(inspect_text(dst))
    print()

    batch = 32
    with Loader(dst, batch_size=batch, transforms={"image": vision.train(224)}, seed=0) as loader:
        t0 = time.perf_counter()
        n = 0
        for b in loader:
            assert b["image"].shape[1:] == (3, 224, 224) and torch.isfinite(b["image"]).all()
            n += len(b["index"])
        dt = time.perf_counter() - t0
        s = loader.stats()
        first = b
    print(f"[3/4] one epoch with fastload.Loader + vision.train(224) on {s['ring']['threads']} threads: "
          f"{n} images in {dt:.2f} s; batch['image'] is {tuple(first['image'].shape)} "
          f"{str(first['image'].dtype).replace('torch.', '')}, labels {first['label'][:8].tolist()}...")

    opts = BenchOptions(batch_size=batch, transform="train224", device="cpu", warmup=2, progress=False)
    results = [run_fastload(dst, opts)] + [run_torch(dst, opts, w) for w in ((0,) if quick else (0, 2))]
    base = max(x.samples_per_s for x in results[1:])
    print("[4/4] the same work, one epoch each, after a short warm-up (decode -> RandomResizedCrop(224) -> "
          "flip -> normalize -> float32 CHW):")
    print(f"      {'system':28s} {'images/s':>9s}  {'vs best DataLoader':>18s}")
    for x in results:
        print(f"      {x.system:28s} {x.samples_per_s:9,.0f}  {x.samples_per_s / base:17.2f}x")
    m = machine_info()
    (out / "demo-results.json").write_text(json.dumps(
        {"machine": m, "images": num_images, "batch_size": batch, "results": [x.as_dict() for x in results]}, indent=2))
    print(f"\nmachine: {system_info(m)}"
          + ("" if m["gpu"] else "; GPU: none (the same transform on the CPU: DALI decodes, torch resizes)"))
    print(f"output: {out.resolve()} (images/, dataset/, demo-results.json)")
    print(f"next:   fastload bench {dst} --compare torch --limit --plot bench.png")
    return 0

"""Where DALI's CPU time goes in RandomResizedCrop 224: decode vs resize (a diagnostic).

    .venv/bin/python bench/dali_stages.py            # 2,000 photos, 3 interleaved epochs
    .venv/bin/python bench/dali_stages.py --smoke    # 128 photos, one epoch

The same photos as bench_jpeg.py (``make_image_folder(n, seed=0)``), read by DALI's file
reader, ``num_threads`` = the usable cores, DALI's default executor:

* ROI decode: ``fn.decoders.image_random_crop`` alone (the crop is decoded directly);
* + resize: the same, then ``fn.resize`` to 224x224 (linear, antialiased: vision.train's);
* + resize, no antialias: ``fn.resize(..., antialias=False)``;
* torch resize: the ROI-decoded crops of one epoch (decoded beforehand, untimed) resized to
  224x224 one by one by torch's uint8 bilinear antialiased ``interpolate`` on one thread.

It answers issue 17's question why fastload's CPU image path (DALI's graph) trails FFCV
(full decode with libjpeg-turbo, OpenCV INTER_AREA resize): the resize, not the decode. Not
in run_all.py (no fastload row: it measures the decoder fastload runs). Rates are images per
second of wall time; the torch row is one thread, the DALI rows use every usable core.
"""
from __future__ import annotations

import argparse
import math
import shutil
import tempfile
import time
from pathlib import Path

from fastload.bench.report import Spread, interleaved_times, system_info
from fastload.demo.photos import make_image_folder
from fastload.runtime.system import usable_cores

SIZE = 224


def dali_pipe(root: Path, batch: int, threads: int, stage: str):
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=None, seed=0)
    def pipe():
        jpegs, _ = fn.readers.file(file_root=str(root), random_shuffle=True, seed=1)
        images = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB,
                                               random_area=[0.08, 1.0], random_aspect_ratio=[3 / 4, 4 / 3])
        if stage == "resize":
            images = fn.resize(images, resize_x=SIZE, resize_y=SIZE, antialias=True)
        elif stage == "resize_noaa":
            images = fn.resize(images, resize_x=SIZE, resize_y=SIZE, antialias=False)
        return images

    p = pipe()
    p.build()
    return p


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    if a.smoke:
        a.images, a.repeats = 128, 1
    import numpy as np
    import torch

    threads = usable_cores()
    runs = math.ceil(a.images / a.batch_size)
    tmp = Path(tempfile.mkdtemp(prefix="dali_stages_"))
    try:
        make_image_folder(tmp / "src", a.images, seed=0)
        pipes = {name: dali_pipe(tmp / "src", a.batch_size, threads, stage)
                 for name, stage in (("DALI ROI decode", "decode"), ("DALI ROI decode + resize", "resize"),
                                     ("DALI ROI decode + resize, no antialias", "resize_noaa"))}
        crops = []  # one epoch of ROI-decoded crops, HWC uint8, for the torch row
        for _ in range(runs):
            out, = pipes["DALI ROI decode"].run()
            crops += [np.array(out.at(i)) for i in range(len(out))]
        tensors = [torch.from_numpy(c).permute(2, 0, 1).unsqueeze(0) for c in crops]  # channels-last memory

        def torch_resize() -> None:
            prev = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                for t in tensors:
                    torch.nn.functional.interpolate(t, size=(SIZE, SIZE), mode="bilinear", antialias=True)
            finally:
                torch.set_num_threads(prev)

        fns = {k: (lambda p=p: [p.run() for _ in range(runs)]) for k, p in pipes.items()}
        fns["torch resize of the same crops (1 thread)"] = torch_resize
        times = interleaved_times(fns, repeats=a.repeats, warmup=0 if a.smoke else 1)
        n = {k: runs * a.batch_size for k in pipes}
        n["torch resize of the same crops (1 thread)"] = len(tensors)
        print(f"DALI CPU stages of RandomResizedCrop {SIZE}: {a.images} photos, batch {a.batch_size}, DALI threads "
              f"{threads}, median (min–max) of {a.repeats} interleaved epochs; {system_info()}")
        rates = {k: Spread.of(v).rate(n[k]) for k, v in times.items()}
        for k, r in rates.items():
            print(f"  {k:44s} {r.fmt(',.0f', ' img/s')}")
        dec, both = rates["DALI ROI decode"].median, rates["DALI ROI decode + resize"].median
        cpu_dec, cpu_both = threads / dec, threads / both  # CPU-seconds per image (every thread busy)
        cpu_torch = 1 / rates["torch resize of the same crops (1 thread)"].median
        print(f"CPU per image: decode {cpu_dec * 1e3:.3f} ms, DALI resize {(cpu_both - cpu_dec) * 1e3:.3f} ms "
              f"({(cpu_both - cpu_dec) / cpu_both:.0%} of decode + resize), torch resize {cpu_torch * 1e3:.3f} ms")
        for p in pipes.values():
            shutdown = getattr(p, "_shutdown", None)
            if shutdown is not None:
                shutdown()
        return {k: r.median for k, r in rates.items()}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"(total {time.perf_counter() - t0:.0f} s)")

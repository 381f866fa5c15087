"""FFCV's side of bench_jpeg.py, in its own interpreter (FFCV needs numba, OpenCV and
libjpeg-turbo: ``bash bench/setup_ffcv.sh`` makes a venv for it; it is never imported into
fastload's process, whose DALI bundles its own libjpeg).

    <ffcv python> bench/_ffcv_worker.py --folder DIR --beton FILE --batch-size 64 --workers 2

Writes the ImageFolder ``DIR`` to an FFCV ``.beton`` (``RGBImageField(write_mode="jpg")``:
FFCV decodes each JPEG and re-encodes it at quality 90, the quality of bench_jpeg's photos;
no resizing), then answers commands on stdin, one JSON line each on stdout, so that
bench_jpeg.py can run FFCV round-robin with the other systems:

* ``epoch``: one shuffled epoch of RandomResizedCrop 224 + flip, uint8 channels-last (FFCV's
  fastest layout: ``ToTorchImage(channels_last=True)``) -> ``{"seconds", "samples"}``;
* ``cold``: a new Loader to its first batch -> ``{"seconds"}`` (numba compiles FFCV's
  pipeline once per process; the first ``cold`` pays for it, later ones do not); ``drop``
  shuts that Loader down (untimed by bench_jpeg.py);
* ``quit``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--folder", required=True)
    ap.add_argument("--beton", required=True)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    a = ap.parse_args()

    from importlib.metadata import version

    from ffcv.fields import IntField, RGBImageField
    from ffcv.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.reader import Reader
    from ffcv.transforms import RandomHorizontalFlip, Squeeze, ToTensor, ToTorchImage
    from ffcv.writer import DatasetWriter
    from PIL import Image

    root = Path(a.folder)
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    items = [(p, c) for c, name in enumerate(classes) for p in sorted((root / name).glob("*.jpg"))]

    class Folder:
        def __len__(self):
            return len(items)

        def __getitem__(self, i):
            p, c = items[i]
            with Image.open(p) as im:
                return im.convert("RGB"), c

    t0 = time.perf_counter()
    DatasetWriter(a.beton, {"image": RGBImageField(write_mode="jpg", jpeg_quality=90), "label": IntField()},
                  num_workers=a.workers).from_indexed_dataset(Folder(), chunksize=64)
    write_s = time.perf_counter() - t0
    image_bytes = int(Reader(a.beton).alloc_table["size"].sum())  # the re-encoded JPEGs (the file has padding)
    print(json.dumps({"ready": True, "ffcv": version("ffcv"), "images": len(items), "image_bytes": image_bytes,
                      "write_s": write_s}), flush=True)

    def make():
        return Loader(a.beton, batch_size=a.batch_size, num_workers=a.workers, order=OrderOption.RANDOM,
                      drop_last=False, os_cache=True, seed=0,
                      pipelines={"image": [RandomResizedCropRGBImageDecoder((224, 224)), RandomHorizontalFlip(),
                                           ToTensor(), ToTorchImage(channels_last=True)],
                                 "label": [IntDecoder(), ToTensor(), Squeeze()]})

    loader = make()
    cold = None
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "quit":
            break
        t0 = time.perf_counter()
        if cmd == "epoch":
            n = 0
            for x, y in loader:
                if x.dtype.itemsize != 1 or tuple(x.shape[1:]) != (3, 224, 224) or len(y) != len(x):
                    raise RuntimeError(f"unexpected FFCV batch {x.dtype} {tuple(x.shape)}")
                n += len(x)
            out = {"seconds": time.perf_counter() - t0, "samples": n}
        elif cmd == "cold":
            ld = make()
            it = iter(ld)
            next(it)
            out = {"seconds": time.perf_counter() - t0}
            cold = (ld, it)
        elif cmd == "drop":
            if cold is not None:
                cold[1].close()  # FFCV's EpochIterator: stop its thread
            cold = None
            out = {"seconds": time.perf_counter() - t0}
        else:
            out = {"error": f"unknown command {cmd!r}"}
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""JPEG decode + RandomResizedCrop(224) + flip throughput: fastload.Loader against torch
DataLoader with PIL, with NVIDIA DALI alone (CPU pipeline, files from disk) as the limit.

    .venv/bin/python bench/bench_jpeg.py              # 2,000 photos, 5 repeats (a few minutes)
    .venv/bin/python bench/bench_jpeg.py --smoke      # 128 photos, one repeat
    .venv/bin/python bench/bench_jpeg.py --images 5000 --batch-size 128 --repeats 5

The images are JPEG crops of real photographs (fastload.sample_data, longer side 300-500 px,
quality 90) in an ImageFolder tree; fastload reads the same images converted to its store.
Every row is one shuffled epoch of 224x224 crops in batches, measured round-robin with the
others (interleaved_medians); GB/s counts the JPEG bytes decoded. DALI runs synchronously
(exec_async=False, exec_pipelined=False) so that it does no work between its timed epochs.

One more row, in a table of its own, reads a second store converted with ``--max-size 256``:
the images re-encoded at convert time so that their longer side is 256 px (FFCV's
``max_resolution``). Those are NOT the same bytes (fewer pixels to decode), so that row is
never compared with the DataLoader, DALI or the headline: it shows what pre-resizing buys.
"""
from __future__ import annotations

import argparse
import math
import shutil
import tempfile
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler

import fastload
from fastload.bench.baseline import EpochSampler, PILImageWork
from fastload.bench.report import Measurement, headline, interleaved_medians, print_table, system_info
from fastload.sample_data import make_image_folder
from fastload.system import usable_cores

MAX_SIZE = 256  # the pre-resized store's --max-size
RESIZED = f"fastload Loader (cpu) float32 CHW, stored at --max-size {MAX_SIZE}"


class PILFolder(Dataset):
    """ImageFolder read with PIL, keyed by (epoch, index) (see EpochSampler): the DataLoader
    baseline's work per image (fastload.bench.baseline.PILImageWork: the Loader's
    RandomResizedCrop windows, flip, ImageNet normalisation, float32 CHW)."""

    def __init__(self, root: Path, work: PILImageWork):
        classes = sorted(p.name for p in root.iterdir() if p.is_dir())
        self.items = [(p, c) for c, name in enumerate(classes) for p in sorted((root / name).glob("*.jpg"))]
        self.work = work

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, key: tuple[int, int]):
        epoch, i = key
        path, label = self.items[i]
        return torch.from_numpy(self.work(path.read_bytes(), i, epoch)), label


def dali_pipe(root: Path, batch: int, threads: int, uint8_hwc: bool):
    from nvidia.dali import fn, pipeline_def, types

    # Synchronous run(): no work runs ahead between timed epochs (costs DALI ~3% here).
    @pipeline_def(batch_size=batch, num_threads=threads, device_id=None, seed=0,
                  exec_async=False, exec_pipelined=False)
    def pipe():
        jpegs, labels = fn.readers.file(file_root=str(root), random_shuffle=True, name="Reader")
        images = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB,
                                               random_area=[0.08, 1.0], random_aspect_ratio=[3 / 4, 4 / 3])
        images = fn.resize(images, resize_x=224, resize_y=224)
        mirror = fn.random.coin_flip()
        if uint8_hwc:
            images = fn.crop_mirror_normalize(images, mirror=mirror, dtype=types.UINT8, output_layout="HWC")
        else:
            images = fn.crop_mirror_normalize(images, mirror=mirror, dtype=types.FLOAT, output_layout="CHW",
                                              mean=[0.485 * 255, 0.456 * 255, 0.406 * 255],
                                              std=[0.229 * 255, 0.224 * 255, 0.225 * 255])
        return images, labels

    p = pipe()
    p.build()
    return p


def loader_epoch(loader, n: int, dtype: torch.dtype, shape: tuple[int, ...]):
    """One epoch of ``loader``, checking every batch's image tensor and the sample count."""
    epoch = [0]

    def run() -> None:
        epoch[0] += 1
        loader.set_epoch(epoch[0])
        seen = 0
        for b in loader:
            img = b["image"]
            if img.dtype != dtype or tuple(img.shape[1:]) != shape or img.shape[0] != b["label"].shape[0]:
                raise RuntimeError(f"unexpected batch: image {img.dtype} {tuple(img.shape)}, label {tuple(b['label'].shape)}")
            seen += img.shape[0]
        if seen != n:
            raise RuntimeError(f"epoch delivered {seen} samples, expected {n}")
    return run


def dataloader_epoch(dl: DataLoader, sampler: EpochSampler, n: int):
    """One epoch of the DataLoader baseline (crop windows of that epoch), checking the count."""
    epoch = [0]

    def run() -> None:
        epoch[0] += 1
        sampler.set_epoch(epoch[0])
        seen = sum(x.shape[0] for x, _ in dl)
        if seen != n:
            raise RuntimeError(f"epoch delivered {seen} samples, expected {n}")
    return run


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="128 images, one repeat")
    a = ap.parse_args(argv)
    if a.smoke:
        a.images, a.repeats = 128, 1
    n, b = a.images, a.batch_size
    cores = usable_cores()
    tmp = Path(tempfile.mkdtemp(prefix="bench_jpeg_"))
    loaders, pipes, dls = [], [], []
    try:
        src, store, small = tmp / "folder", tmp / "store", tmp / "store_small"
        make_image_folder(src, n, seed=0)
        fastload.convert("imagefolder", src, store, progress=False)
        jpeg_bytes = sum(p.stat().st_size for p in src.rglob("*.jpg"))
        # the same photos re-encoded at convert (longer side <= MAX_SIZE): other bytes
        resized = fastload.convert("imagefolder", src, small, progress=False, max_size=MAX_SIZE)["resized_images"]
        sds = fastload.Dataset(small)
        small_bytes = sum(len(x) for x in sds.get_batch(list(range(len(sds))))["image"])

        fns = {}
        for name, tf, dtype, shape in (
                ("float32 CHW", fastload.vision.train(224), torch.float32, (3, 224, 224)),
                ("uint8 HWC", fastload.vision.train(224, dtype="uint8", layout="HWC"), torch.uint8, (224, 224, 3))):
            loaders.append(fastload.Loader(str(store), batch_size=b, transforms={"image": tf}, device="cpu", seed=0))
            fns[f"fastload Loader (cpu) {name}"] = loader_epoch(loaders[-1], n, dtype, shape)
        loaders.append(fastload.Loader(str(small), batch_size=b, transforms={"image": fastload.vision.train(224)},
                                       device="cpu", seed=0))
        fns[RESIZED] = loader_epoch(loaders[-1], n, torch.float32, (3, 224, 224))
        ds = PILFolder(src, PILImageWork(fastload.vision.train(224), seed=0))
        for w in (0, 2):
            sampler = EpochSampler(RandomSampler(ds))
            dls.append(DataLoader(ds, batch_size=b, sampler=sampler, num_workers=w, persistent_workers=w > 0))
            fns[f"DataLoader + PIL, num_workers={w}"] = dataloader_epoch(dls[-1], sampler, n)
        runs = math.ceil(n / b)
        for name, hwc in (("DALI alone (files from disk)", False), ("DALI alone, uint8 HWC", True)):
            pipes.append(dali_pipe(src, b, cores, hwc))
            fns[name] = (lambda p: lambda: [p.run() for _ in range(runs)])(pipes[-1])

        secs = interleaved_medians(fns, repeats=a.repeats, warmup=1)  # the resized row too: same conditions
        small_s = secs.pop(RESIZED)
        kinds = {"DALI alone (files from disk)": "limit", "DALI alone, uint8 HWC": "other"}
        notes = {
            "fastload Loader (cpu) float32 CHW": f"threads={loaders[0].threads}",
            "fastload Loader (cpu) uint8 HWC": f"threads={loaders[1].threads}; normalise on the GPU",
            "DataLoader + PIL, num_workers=2": "persistent workers",
            "DALI alone (files from disk)": f"CPU pipeline, num_threads={cores}, float32 CHW",
            "DALI alone, uint8 HWC": f"CPU pipeline, num_threads={cores}, uint8 HWC",
        }
        rows = [Measurement(k, n, jpeg_bytes, v,
                            "ours" if k.startswith("fastload") else "dataloader" if k.startswith("DataLoader")
                            else kinds[k], notes.get(k, "")) for k, v in secs.items()]
        for r in rows:
            r.note = f"{r.seconds:.2f} s/epoch" + (f"; {r.note}" if r.note else "")
        speedup = secs["fastload Loader (cpu) float32 CHW"] / small_s
        resized_rows = [Measurement(
            RESIZED, n, small_bytes, small_s, "other",
            f"{small_s:.2f} s/epoch; threads={loaders[2].threads}; NOT the same bytes: {resized} of {n} images "
            f"re-encoded at convert (longer side {MAX_SIZE}, JPEG q90), {small_bytes / 1e6:.1f} MB stored vs "
            f"{jpeg_bytes / 1e6:.1f} MB; {speedup:.2f}x the full-size fastload float32 CHW row")]
    finally:
        for ld in loaders:
            ld.close()
        for dl in dls:
            dl._iterator = None  # shut persistent workers down  # noqa: SLF001
        del pipes[:], dls[:]
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"{n} JPEGs ({jpeg_bytes / 1e6:.1f} MB) -> RandomResizedCrop 224 + flip, batch {b}, "
          f"one shuffled epoch per run, median of {a.repeats}; {system_info()}")
    print_table("JPEG decode: one epoch, 224x224 crops", rows)
    print_table(f"Stored pre-resized (convert --max-size {MAX_SIZE}): other bytes, not comparable with the "
                "table above", resized_rows)
    by = {r.system: r.samples_per_s for r in rows}
    ours, ours_u8 = by["fastload Loader (cpu) float32 CHW"], by["fastload Loader (cpu) uint8 HWC"]
    best_dl = max(r.samples_per_s for r in rows if r.kind == "dataloader")
    dl_row = max((r for r in rows if r.kind == "dataloader"), key=lambda r: r.samples_per_s)
    headline(f"{n:,} real-photo JPEGs -> RandomResizedCrop 224 + flip + normalize, batch {b}",
             script="bench_jpeg.py", unit="img/s", smoke=a.smoke,
             ours=("Loader (cpu) float32 CHW", ours), baseline=(dl_row.system, best_dl),
             limit=("DALI alone from files", by["DALI alone (files from disk)"]),
             note=f"uint8 HWC {ours_u8:,.0f} img/s = {ours_u8 / by['DALI alone, uint8 HWC']:.2f}x DALI alone uint8")
    print("\n## Summary")
    print(f"fastload float32 CHW: {ours / best_dl:.1f}x the best DataLoader + PIL (target >= 2x), "
          f"{ours / by['DALI alone (files from disk)']:.2f}x DALI alone (target >= 1.0x)")
    print(f"fastload uint8 HWC: {ours_u8 / by['DALI alone, uint8 HWC']:.2f}x DALI alone uint8 HWC")
    print("GPU figures (DALI mixed / nvJPEG decoder, Loader device=\"cuda\") were not measurable on this "
          "machine (no GPU).")
    return rows + resized_rows


if __name__ == "__main__":
    main()

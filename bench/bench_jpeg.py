"""JPEG decode + RandomResizedCrop(224) + flip throughput and time to the first batch:
fastload.Loader against torch DataLoader with PIL, NVIDIA DALI alone (CPU pipeline, files
from disk: the limit) and FFCV where it is installed.

    .venv/bin/python bench/bench_jpeg.py              # 2,000 photos, 5 repeats (a few minutes)
    .venv/bin/python bench/bench_jpeg.py --smoke      # 64 photos, one repeat
    .venv/bin/python bench/bench_jpeg.py --images 5000 --batch-size 128 --repeats 5

The images are JPEG crops of real photographs (fastload.demo.photos, longer side 300-500 px,
quality 90) in an ImageFolder tree; fastload reads the same images converted to its store.
Every row is one shuffled epoch of 224x224 crops in batches, run round-robin with the others
(interleaved_times); each figure is the median with the min–max of the repeats, and ratios
carry the spread of the per-round ratios. GB/s counts the JPEG bytes decoded.

Fairness:
* DALI alone runs with DALI's default executor (asynchronous, pipelined, 2 batches queued:
  its fastest). It runs ahead, so each of its epochs ends when this process's threads are
  idle again (``wait_until_idle``: the batches it queued are computed inside its own timing,
  not in the next system's); every in-process row ends the same way. Its reader has no
  partial batch, so it decodes ceil(N/batch) batches per epoch and is credited with exactly
  those images (2,048 for 2,000 photos in batches of 64).
* The DataLoader rows use persistent workers, idle between their epochs.
* Time to the first batch (cold: the loader or pipeline is built, its threads or workers
  started, and one batch delivered; a warm-up round first pays for imports and JIT) is
  measured for each system round-robin too.
* FFCV (``bash bench/setup_ffcv.sh`` installs it into bench/out/ffcv-venv, or point
  $FASTLOAD_FFCV_PYTHON at an interpreter with ffcv) runs in its own process
  (bench/_ffcv_worker.py), round-robin with the rest, with num_workers = the usable cores and
  its fastest layout (uint8, channels-last). Its writer re-encodes the JPEGs (quality 90, no
  resizing): close to, but not exactly, the same bytes. Where FFCV is not installed the
  uint8 row is compared with the reference figure of issue 17 (~1,300 img/s on this machine,
  quiet), clearly labelled as not measured here.

One more row, in a table of its own, reads a second store converted with ``--max-size 256``:
the images re-encoded at convert time so that their longer side is 256 px (FFCV's
``max_resolution``). Those are NOT the same bytes (fewer pixels to decode), so that row is
never compared with the DataLoader, DALI or the headline: it shows what pre-resizing buys.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler

import fastload
from fastload.bench.machine import equal_priority
from fastload.bench.baseline import EpochSampler, PILImageWork
from fastload.bench.report import (Measurement, Spread, headline, interleaved_cold_starts, interleaved_times,
                                   print_table, system_info, wait_until_idle)
from fastload.demo.photos import make_image_folder
from fastload.runtime.system import usable_cores

HERE = Path(__file__).resolve().parent
MAX_SIZE = 256  # the pre-resized store's --max-size
RESIZED = f"fastload Loader (cpu) float32 CHW, stored at --max-size {MAX_SIZE}"
F32, U8 = "fastload Loader (cpu) float32 CHW", "fastload Loader (cpu) uint8 HWC"
DALI_F32, DALI_U8 = "DALI alone (files from disk)", "DALI alone, uint8 HWC"
FFCV_ROW = "FFCV uint8 channels-last"
# Issue 17's targets, and its reference figure for FFCV (channels-last uint8, 2,000 photos of
# 300-500 px, this 2-core VM, quiet), used only where FFCV cannot run here.
TARGET_VS_DALI, TARGET_VS_FFCV, TARGET_VS_DATALOADER = 1.2, 1.2, 2.0
FFCV_REFERENCE = 1300.0


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
    """vision.train(224) as a graph that DALI runs whole (as fastload does on a GPU; on the
    CPU fastload's feeders resize, flip and normalize in torch), DALI's default executor."""
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=None, seed=0)
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


def _shutdown_dali(p) -> None:
    shutdown = getattr(p, "_shutdown", None)  # what Pipeline.__del__ calls: join DALI's threads now
    if shutdown is not None:
        shutdown()


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
        wait_until_idle()
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
        wait_until_idle()
    return run


def dali_epoch(p, runs: int):
    """``runs`` batches of DALI alone; the epoch ends when the batches its executor queued
    ahead are computed too (this process idle again)."""
    def run() -> None:
        for _ in range(runs):
            p.run()
        wait_until_idle()
    return run


# ---------------------------------------------------------------------------- FFCV, in its own process
def ffcv_python() -> tuple[str | None, str]:
    """(an interpreter that imports ffcv, or None; why not)."""
    env = os.environ.get("FASTLOAD_FFCV_PYTHON", "").strip()
    cands = [env] if env else [str(HERE / "out" / "ffcv-venv" / "bin" / "python")]
    for py in cands:
        if not Path(py).exists():
            continue
        r = subprocess.run([py, "-c", "import ffcv"], capture_output=True, text=True, timeout=300)
        if r.returncode == 0:
            return py, ""
        return None, f"{py} cannot import ffcv: {(r.stderr.strip().splitlines() or ['?'])[-1]}"
    return None, ("FFCV is not installed for this benchmark (it needs numba, OpenCV and libjpeg-turbo in "
                  "its own venv: bash bench/setup_ffcv.sh, or set FASTLOAD_FFCV_PYTHON)")


class Ffcv:
    """FFCV in its own interpreter (bench/_ffcv_worker.py), driven line by line."""

    def __init__(self, py: str, folder: Path, beton: Path, batch: int, workers: int):
        self.p = subprocess.Popen([py, str(HERE / "_ffcv_worker.py"), "--folder", str(folder), "--beton", str(beton),
                                   "--batch-size", str(batch), "--workers", str(workers)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = self._read()

    def _read(self) -> dict:
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"the FFCV worker exited ({self.p.wait()}); see its stderr above")
        out = json.loads(line)
        if "error" in out:
            raise RuntimeError(f"FFCV worker: {out['error']}")
        return out

    def ask(self, cmd: str) -> dict:
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.p.poll() is None:
            try:
                self.p.stdin.write("quit\n")
                self.p.stdin.close()
                self.p.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.p.kill()
                self.p.wait()


# ---------------------------------------------------------------------------- main
def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cold-repeats", type=int, default=3, help="cold starts per system (after one warm-up)")
    ap.add_argument("--smoke", action="store_true", help="64 images (one batch), one repeat")
    a = ap.parse_args(argv)
    equal_priority()  # the rows compared run at one priority (FASTLOAD_NICE=0 unless set)
    if a.smoke:
        a.images, a.repeats, a.cold_repeats = 64, 1, 1
    n, b = a.images, a.batch_size
    cores = usable_cores()
    runs = math.ceil(n / b)  # DALI's reader has no partial batch
    ffcv_py, ffcv_why = ffcv_python()
    tmp = Path(tempfile.mkdtemp(prefix="bench_jpeg_"))
    loaders, pipes, dls, ffcv = [], [], [], None
    try:
        src, store, small = tmp / "folder", tmp / "store", tmp / "store_small"
        make_image_folder(src, n, seed=0)
        fastload.convert("imagefolder", src, store, progress=False)
        jpeg_bytes = sum(p.stat().st_size for p in src.rglob("*.jpg"))
        # the same photos re-encoded at convert (longer side <= MAX_SIZE): other bytes
        resized = fastload.convert("imagefolder", src, small, progress=False, max_size=MAX_SIZE)["resized_images"]
        sds = fastload.Dataset(small)
        small_bytes = sum(len(x) for x in sds.get_batch(list(range(len(sds))))["image"])
        if ffcv_py:
            ffcv = Ffcv(ffcv_py, src, tmp / "ffcv.beton", b, cores)
            ffcv_why = (f"FFCV {ffcv.info['ffcv']}, num_workers={cores}; its .beton re-encodes the JPEGs "
                        f"({ffcv.info['image_bytes'] / 1e6:.1f} MB vs {jpeg_bytes / 1e6:.1f} MB)")
        ds = PILFolder(src, PILImageWork(fastload.vision.train(224), seed=0))
        f32_tf = fastload.vision.train(224)

        # -- time to the first batch, cold, round-robin
        def start_loader():
            ld = fastload.Loader(str(store), batch_size=b, transforms={"image": f32_tf}, device="cpu", seed=0)
            it = iter(ld)
            next(it)
            # the epoch stays open until the untimed shut-down, as the others' do (a dropped
            # iterator waits for its decode in flight: that is the cost of a `break`, not of
            # the first batch)
            return lambda: (it.close(), ld.close())

        def start_dataloader(w):
            def start():
                dl = DataLoader(ds, batch_size=b, sampler=EpochSampler(RandomSampler(ds)), num_workers=w)
                it = iter(dl)
                next(it)
                return getattr(it, "_shutdown_workers", lambda: None)
            return start

        def start_dali():
            p = dali_pipe(src, b, cores, False)
            p.run()
            return lambda: _shutdown_dali(p)

        starts = {F32: start_loader, "DataLoader + PIL, num_workers=0": start_dataloader(0),
                  "DataLoader + PIL, num_workers=2": start_dataloader(2), DALI_F32: start_dali}
        if ffcv:
            starts[FFCV_ROW] = lambda: (ffcv.ask("cold"), lambda: ffcv.ask("drop"))[1]
        cold = interleaved_cold_starts(starts, repeats=a.cold_repeats, warmup=0 if a.smoke else 1)

        # -- one epoch of each, round-robin
        fns = {}
        for name, tf, dtype, shape in ((F32, f32_tf, torch.float32, (3, 224, 224)),
                                       (U8, fastload.vision.train(224, dtype="uint8", layout="HWC"), torch.uint8,
                                        (224, 224, 3))):
            loaders.append(fastload.Loader(str(store), batch_size=b, transforms={"image": tf}, device="cpu", seed=0))
            fns[name] = loader_epoch(loaders[-1], n, dtype, shape)
        loaders.append(fastload.Loader(str(small), batch_size=b, transforms={"image": fastload.vision.train(224)},
                                       device="cpu", seed=0))
        fns[RESIZED] = loader_epoch(loaders[-1], n, torch.float32, (3, 224, 224))
        for w in (0, 2):
            sampler = EpochSampler(RandomSampler(ds))
            dls.append(DataLoader(ds, batch_size=b, sampler=sampler, num_workers=w, persistent_workers=w > 0))
            fns[f"DataLoader + PIL, num_workers={w}"] = dataloader_epoch(dls[-1], sampler, n)
        for name, hwc in ((DALI_F32, False), (DALI_U8, True)):
            pipes.append(dali_pipe(src, b, cores, hwc))
            fns[name] = dali_epoch(pipes[-1], runs)
        if ffcv:
            def ffcv_epoch():
                got = ffcv.ask("epoch")["samples"]
                if got != n:
                    raise RuntimeError(f"FFCV delivered {got} samples, expected {n}")
                wait_until_idle()  # as every other row's epoch ends (this process is idle already)
            fns[FFCV_ROW] = ffcv_epoch
        times = interleaved_times(fns, repeats=a.repeats, warmup=1)  # the resized row too: same conditions
        small_t = times.pop(RESIZED)
        notes = {
            F32: f"threads={loaders[0].threads}",
            U8: f"threads={loaders[1].threads}; normalise on the GPU",
            "DataLoader + PIL, num_workers=2": "persistent workers",
            DALI_F32: f"CPU pipeline, num_threads={cores}, default executor, float32 CHW; "
                      f"{runs * b} images per epoch",
            DALI_U8: f"CPU pipeline, num_threads={cores}, default executor, uint8 HWC; {runs * b} images per epoch",
            FFCV_ROW: ffcv_why,
        }
        rows = []
        for k, ts in times.items():
            imgs = runs * b if k.startswith("DALI") else n
            kind = ("ours" if k.startswith("fastload") else "dataloader" if k.startswith("DataLoader")
                    else "limit" if k == DALI_F32 else "other")
            r = Measurement.from_times(k, imgs, int(jpeg_bytes * imgs / n), ts, kind, group="epoch")
            r.note = f"{r.seconds:.2f} s/epoch" + (f"; {notes[k]}" if notes.get(k) else "")
            if k in cold:
                fb = Spread.of(cold[k])
                r.first_batch_s = fb.median
                r.first_batch_range = [fb.lo, fb.hi] if fb.n > 1 else None
            rows.append(r)
        small_row = Measurement.from_times(RESIZED, n, small_bytes, small_t, "other", group="epoch")
        speedup = Spread.of([x / y for x, y in zip(times[F32], small_t)])
        small_row.note = (f"{small_row.seconds:.2f} s/epoch; threads={loaders[2].threads}; NOT the same bytes: "
                          f"{resized} of {n} images re-encoded at convert (longer side {MAX_SIZE}, JPEG q90), "
                          f"{small_bytes / 1e6:.1f} MB stored vs {jpeg_bytes / 1e6:.1f} MB; "
                          f"{speedup.fmt('.2f', 'x')} the full-size fastload float32 CHW row")
    finally:
        for ld in loaders:
            ld.close()
        for dl in dls:
            dl._iterator = None  # shut persistent workers down  # noqa: SLF001
        for p in pipes:
            _shutdown_dali(p)
        del pipes[:], dls[:]
        if ffcv is not None:
            ffcv.close()
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"{n} JPEGs ({jpeg_bytes / 1e6:.1f} MB) -> RandomResizedCrop 224 + flip, batch {b}, one shuffled epoch "
          f"per run, median (min–max) of {a.repeats} interleaved repeats; first batch: median (min–max) of "
          f"{a.cold_repeats} cold starts; {system_info()}")
    print_table("JPEG decode: one epoch, 224x224 crops", rows)
    print_table(f"Stored pre-resized (convert --max-size {MAX_SIZE}): other bytes, not comparable with the "
                "table above", [small_row])
    summary(rows, a, n, b, ffcv_why if ffcv is None else "")
    return rows + [small_row]


def _verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def summary(rows: list[Measurement], a, n: int, b: int, ffcv_missing: str) -> None:
    by = {r.system: r for r in rows}
    ours, u8, dali, dali_u8 = by[F32], by[U8], by[DALI_F32], by[DALI_U8]
    dl = max((r for r in rows if r.kind == "dataloader"), key=lambda r: r.samples_per_s)
    fastest_dl_start = min((r for r in rows if r.kind == "dataloader"), key=lambda r: r.first_batch_s)

    def ratio(x: Measurement, y: Measurement) -> str:
        sp = x.paired(y)
        return f"{x.samples_per_s / y.samples_per_s:.2f}x" + (f" ({sp.lo:.2f}–{sp.hi:.2f}x)" if sp else "")

    vs_dali, vs_dl = ours.samples_per_s / dali.samples_per_s, ours.samples_per_s / dl.samples_per_s
    if FFCV_ROW in by:
        ffcv = by[FFCV_ROW]
        vs_ffcv, ffcv_text = u8.samples_per_s / ffcv.samples_per_s, f"{ratio(u8, ffcv)} FFCV measured beside it"
        ffcv_note = f"{u8.samples_per_s / ffcv.samples_per_s:.2f}x FFCV ({ffcv.samples_per_s:,.0f} img/s, measured)"
    else:
        vs_ffcv = u8.samples_per_s / FFCV_REFERENCE
        ffcv_text = (f"{vs_ffcv:.2f}x FFCV's reference figure ~{FFCV_REFERENCE:,.0f} img/s (issue 17, this machine, "
                     f"quiet; a reference, NOT measured in this run: {ffcv_missing})")
        ffcv_note = f"{vs_ffcv:.2f}x FFCV's ~{FFCV_REFERENCE:,.0f} img/s reference (not measured here)"
    starts = {"Loader": ours, f"DataLoader nw={dl.system[-1]}": dl, "DALI alone": dali}
    if fastest_dl_start is not dl:
        starts[f"DataLoader nw={fastest_dl_start.system[-1]}"] = fastest_dl_start
    if FFCV_ROW in by:
        starts["FFCV"] = by[FFCV_ROW]
    first = {k: Spread(r.first_batch_s, *(r.first_batch_range or [r.first_batch_s] * 2), a.cold_repeats)
             for k, r in starts.items()}
    headline(f"{n:,} real-photo JPEGs -> RandomResizedCrop 224 + flip + normalize, batch {b}",
             script="bench_jpeg.py", unit="img/s", smoke=a.smoke,
             ours=("Loader (cpu) float32 CHW", ours.rate_spread), baseline=(dl.system, dl.rate_spread),
             limit=("DALI alone from files", dali.rate_spread), vs_baseline=ours.paired(dl),
             vs_limit=ours.paired(dali), first_batch=first,
             note=f"uint8 HWC {u8.rate_spread.fmt(',.0f')} img/s = {u8.samples_per_s / dali_u8.samples_per_s:.2f}x "
                  f"DALI alone uint8, {ffcv_note}")
    print("\n## Summary (targets of issue 17; medians, with the spread of the per-round ratios)")
    print(f"float32 CHW vs DALI alone (same augmentation, same files): {ratio(ours, dali)} "
          f"(target >= {TARGET_VS_DALI}x): {_verdict(vs_dali >= TARGET_VS_DALI)}")
    print(f"uint8 HWC: {ratio(u8, dali_u8)} DALI alone uint8 HWC; {ffcv_text} "
          f"(target >= {TARGET_VS_FFCV}x FFCV): {_verdict(vs_ffcv >= TARGET_VS_FFCV)}")
    print(f"float32 CHW vs the best DataLoader + PIL ({dl.system}): {ratio(ours, dl)} "
          f"(target >= {TARGET_VS_DATALOADER}x): {_verdict(vs_dl >= TARGET_VS_DATALOADER)}")
    print(f"time to the first batch (cold): Loader {first['Loader'].fmt('.3f', ' s')}, "
          + ", ".join(f"{k} {v.fmt('.3f', ' s')}" for k, v in first.items() if k != "Loader")
          + f" (target: <= the DataLoader's, {fastest_dl_start.system}): "
          + _verdict(ours.first_batch_s <= fastest_dl_start.first_batch_s))
    if not torch.cuda.is_available():
        print("GPU figures (DALI mixed / nvJPEG decoder, Loader device=\"cuda\") were not measurable on this "
              "machine (no GPU).")


if __name__ == "__main__":
    main()

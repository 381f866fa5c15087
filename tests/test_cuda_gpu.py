"""The CUDA path on a real GPU (marked ``cuda``: skipped on machines without one).

The same behaviours the fake-CUDA tests check by recording calls (test_cuda_fake.py), here
measured: the mixed decoder's ROI + EXIF output against the CPU's (F14), batches consumed
under a user stream, no context on cuda:0 from a rank on cuda:1 (F3), slots page-locked (F8),
a bad image located without rebuilding the GPU pipeline per bisection step (F10), and
loading that overlaps a GPU-busy training step instead of queueing behind it (F2, F4, F5).
"""
from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import fastload
from fastload import Loader, vision
from fastload.sample_data import photos

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
ROOT = Path(__file__).resolve().parent.parent


def _jpeg(a: np.ndarray, **kw) -> bytes:
    b = io.BytesIO()
    Image.fromarray(a).save(b, "JPEG", quality=95, **kw)
    return b.getvalue()


@pytest.fixture(scope="module")
def exif_ds(tmp_path_factory):
    """Photos stored rotated with an EXIF orientation (3, 6, 8), and upright twins."""
    root = tmp_path_factory.mktemp("exif")
    p = photos(["astronaut", "chelsea", "coffee"])
    for name, img in p.items():
        upright = np.ascontiguousarray(img[:240, :320])
        (root / "src" / name).mkdir(parents=True)
        Image.fromarray(upright).save(root / "src" / name / "up.jpg", "JPEG", quality=95)
        for orient, k in ((3, 2), (6, 1), (8, 3)):  # rot90 k times counter-clockwise = stored pixels
            im = Image.fromarray(np.ascontiguousarray(np.rot90(upright, k=k)))
            ex = im.getexif()
            ex[0x0112] = orient
            im.save(root / "src" / name / f"rot{orient}.jpg", "JPEG", quality=95, exif=ex.tobytes())
    fastload.convert("imagefolder", root / "src", root / "ds", progress=False)
    return fastload.Dataset(root / "ds")


@pytest.fixture(scope="module")
def raw_ds(tmp_path_factory):
    path = tmp_path_factory.mktemp("raw") / "ds"
    rng = np.random.default_rng(0)
    x = rng.integers(0, 255, (4096, 3, 64, 64), dtype=np.uint8)
    with fastload.ShardWriter(path, {"x": "uint8[3,64,64]", "label": "int64"}, label="label") as wr:
        wr.write_batch({"x": x, "label": np.arange(4096) % 10})
    return fastload.Dataset(path), x


@pytest.fixture(scope="module")
def photo_ds(tmp_path_factory):
    root = tmp_path_factory.mktemp("photos")
    from fastload.sample_data import make_image_folder

    make_image_folder(root / "src", 512, seed=0)
    fastload.convert("imagefolder", root / "src", root / "ds", progress=False)
    return fastload.Dataset(root / "ds")


def _all(loader) -> tuple[np.ndarray, np.ndarray]:
    idx, img = [], []
    for b in loader:
        idx.append(b["index"].cpu().numpy())
        img.append(b["image"].float().cpu().numpy())
    return np.concatenate(idx), np.concatenate(img)


@pytest.mark.parametrize("make", [lambda: vision.train(96, scale=(0.3, 1.0)), lambda: vision.eval(96, resize=110)],
                         ids=["train-roi", "eval"])
def test_mixed_decoder_matches_cpu_on_exif_rotated_images(exif_ds, make):
    """F14: the hardware/nvJPEG ROI decode in the upright frame equals the CPU decode."""
    kw = dict(batch_size=6, shuffle=True, seed=3, transforms={"image": make()})
    with Loader(exif_ds, device="cpu", **kw) as lo:
        idx_c, cpu = _all(lo)
    with Loader(exif_ds, device="cuda", **kw) as lo:
        idx_g, gpu = _all(lo)
    assert np.array_equal(idx_c, idx_g)
    diff = np.abs(gpu - cpu).mean(axis=(1, 2, 3))
    assert diff.max() < 0.08, diff  # nvJPEG vs libjpeg-turbo rounding, not a rotated or shifted window
    w, h = exif_ds.image_sizes("image", np.arange(len(exif_ds)))
    assert set(w.tolist()) == {320} and set(h.tolist()) == {240}  # recorded upright


def test_raw_batches_under_a_user_stream_are_exact(raw_ds):
    ds, x = raw_ds
    ref = torch.from_numpy(x).cuda()
    s = torch.cuda.Stream()
    with Loader(ds, batch_size=256, device="cuda", seed=1) as lo, torch.cuda.stream(s):
        for b in lo:
            junk = torch.empty_like(b["x"]).fill_(7)  # reuse pressure on the caching allocator
            assert torch.equal(b["x"], ref[b["index"]])
            del junk


def test_images_under_a_user_stream_equal_those_on_the_default_stream(photo_ds):
    kw = dict(batch_size=32, shuffle=False, transforms={"image": vision.eval(64)})
    with Loader(photo_ds, device="cuda", **kw) as lo:
        _, plain = _all(lo)
    s = torch.cuda.Stream()
    with Loader(photo_ds, device="cuda", **kw) as lo, torch.cuda.stream(s):
        _, streamed = _all(lo)
    assert np.array_equal(plain, streamed)


def test_slots_are_page_locked(raw_ds):
    ds, _ = raw_ds
    with Loader(ds, batch_size=256, device="cuda") as lo:
        next(iter(lo))
        ring = lo._parts._ring
        assert lo._parts._delivery.pinned == ring.num_slots
        assert all(torch.from_numpy(ring.slot_memory(s)).is_pinned() for s in range(ring.num_slots))


def test_a_bad_image_costs_one_gpu_rebuild(tmp_path, photo_ds):
    p = photos(["chelsea"])["chelsea"]
    with fastload.ShardWriter(tmp_path / "ds", {"image": "image"}) as wr:
        for i in range(64):
            if i == 40:
                wr.write({"image": b"\xff\xd8\xff" + b"junk" * 60}, key="bad.jpg", image_sizes={"image": (64, 64)})
            else:
                wr.write({"image": _jpeg(p[i:i + 200, i:i + 200])}, key=f"{i}.jpg")
    with Loader(tmp_path / "ds", batch_size=64, device="cuda", shuffle=False, on_error="skip",
                transforms={"image": vision.train(64)}) as lo:
        t0 = time.perf_counter()
        b = next(iter(lo))
        dt = time.perf_counter() - t0
        assert 40 not in b["index"].cpu().tolist() and lo.stats()["replaced_samples"] == 1
        gpu = [r for r in lo._parts._decoders._runners.values()]
        assert sum(r.rebuilds for r in gpu) == 1, [r.rebuilds for r in gpu]
    print(f"first batch with one bad image: {dt:.2f} s")


_RANK1 = textwrap.dedent("""
    import os, subprocess, sys
    import fastload
    from fastload import vision
    with fastload.Loader(sys.argv[1], batch_size=16, transforms={"image": vision.train(64)}) as lo:
        assert lo.device.index == 1, lo.device
        for i, b in enumerate(lo):
            if i == 3:
                break
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_bus_id", "--format=csv,noheader"],
                             capture_output=True, text=True, check=True).stdout
        buses = subprocess.run(["nvidia-smi", "--query-gpu=index,pci.bus_id", "--format=csv,noheader"],
                               capture_output=True, text=True, check=True).stdout
    mine = {ln.split(",")[1].strip() for ln in out.splitlines() if ln.split(",")[0].strip() == str(os.getpid())}
    index = {ln.split(",")[1].strip(): int(ln.split(",")[0]) for ln in buses.splitlines()}
    print(sorted(index[b] for b in mine))
""")


@pytest.mark.skipif(torch.cuda.device_count() < 2 or shutil.which("nvidia-smi") is None,
                    reason="needs 2 GPUs and nvidia-smi")
def test_rank_1_opens_no_context_on_gpu_0(photo_ds):
    """F3: a torchrun rank on cuda:1 (LOCAL_RANK=1) creates no CUDA context on cuda:0, from
    any of its threads."""
    env = {**os.environ, "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
           "PYTHONPATH": str(ROOT)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    r = subprocess.run([sys.executable, "-c", _RANK1, str(photo_ds.path)], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "[1]"


def _sleep_cycles_per_ms() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def _epoch(loader, step_cycles: int, batches: int) -> float:
    t0 = time.perf_counter()
    for i, b in enumerate(loader):
        if step_cycles:
            torch.cuda._sleep(step_cycles)  # the training step: GPU-busy on the current stream
        if i + 1 == batches:
            break
    torch.cuda.synchronize()
    return time.perf_counter() - t0


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["raw", "images"])
def test_loading_overlaps_a_gpu_busy_step(kind, raw_ds, photo_ds):
    """F2/F4/F5: with the GPU busy in the training step, loading (host-to-device copies,
    DALI's work and its copy out) proceeds beside it: an epoch takes about max(step, load),
    not step + load, as it does when a copy or a DALI run waits behind the training stream."""
    if kind == "raw":
        ds, kw, n = raw_ds[0], dict(batch_size=256), 16
    else:
        ds, kw, n = photo_ds, dict(batch_size=32, transforms={"image": vision.train(128)}), 16
    with Loader(ds, device="cuda", **kw) as lo:
        _epoch(lo, 0, n)  # warm up: pipelines built, slots pinned
        load = min(_epoch(lo, 0, n) for _ in range(2))
        per_step = max(load / n, 0.002)  # a step as long as loading one batch: the hardest case
        cycles = int(per_step * 1000 * _sleep_cycles_per_ms())
        t0 = time.perf_counter()
        for _ in range(n):
            torch.cuda._sleep(cycles)
        torch.cuda.synchronize()
        step = time.perf_counter() - t0
        both = min(_epoch(lo, cycles, n) for _ in range(2))
    print(f"{kind}: load {load:.3f} s, step {step:.3f} s, both {both:.3f} s")
    assert both < 0.8 * (load + step), (load, step, both)

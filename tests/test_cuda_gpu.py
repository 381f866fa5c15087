"""The CUDA path on a real GPU (marked ``cuda``: skipped on machines without one).

The same behaviours the fake-CUDA tests check by recording calls (test_cuda_fake.py), here
measured: the mixed decoder's ROI + EXIF output against the CPU's (F14), batches consumed
under a user stream, no context on cuda:0 from a rank on cuda:1 (F3), slots page-locked (F8),
a bad image located without rebuilding the GPU pipeline per bisection step (F10), and
loading that overlaps a GPU-busy training step instead of queueing behind it (F2, F4, F5).
"""
from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import fastload
from fastload import Loader, vision
from fastload.demo.photos import photos

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
ROOT = Path(__file__).resolve().parent.parent


def _jpeg(a: np.ndarray, **kw) -> bytes:
    b = io.BytesIO()
    from PIL import Image  # here: the raw-field tests run without Pillow

    Image.fromarray(a).save(b, "JPEG", quality=95, **kw)
    return b.getvalue()


@pytest.fixture(scope="module")
def exif_ds(tmp_path_factory):
    """Photos stored rotated with an EXIF orientation (3, 6, 8), and upright twins."""
    pytest.importorskip("nvidia.dali", reason="image tests need DALI")
    Image = pytest.importorskip("PIL.Image")
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
    pytest.importorskip("nvidia.dali", reason="image tests need DALI")
    root = tmp_path_factory.mktemp("photos")
    from fastload.demo.photos import make_image_folder

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
        ring = lo._machinery._ring
        assert lo._machinery._delivery.pinned == ring.num_slots
        assert all(torch.from_numpy(ring.slot_memory(s)).is_pinned() for s in range(ring.num_slots))


def test_a_failed_registration_leaves_no_error_behind():
    """F7 on the real runtime: fastload reads away the last error a refused cudaHostRegister
    leaves (ctypes on the libcudart torch links), so torch's next kernel-launch check does not
    raise it from an unrelated operation."""
    import mmap

    from fastload.runtime.device import clear_cuda_error

    mem = mmap.mmap(-1, 2 << 12)  # page-aligned, like a ring slot
    buf = np.frombuffer(mem, np.uint8)
    rt = torch.cuda.cudart()
    ptr = buf.ctypes.data
    assert int(rt.cudaHostRegister(ptr, buf.nbytes, 1)) == 0
    try:
        err = rt.cudaHostRegister(ptr, buf.nbytes, 1)  # again: cudaErrorHostMemoryAlreadyRegistered
        assert int(err) != 0
        cleared = clear_cuda_error()
        if cleared is None:
            pytest.skip("torch's CUDA runtime is not a shared library here: its error cannot be cleared")
        assert cleared == int(err)
        x = torch.ones(1024, device="cuda")
        torch.cuda.synchronize()
        assert float((x + 1).sum()) == 2048.0  # kernels launch: no stale error surfaced
        assert clear_cuda_error() == 0
    finally:
        assert int(rt.cudaHostUnregister(ptr)) == 0


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
        gpu = [r for r in lo._machinery._decoders._runners.values()]
        assert sum(r.rebuilds for r in gpu) == 1, [r.rebuilds for r in gpu]
    print(f"first batch with one bad image: {dt:.2f} s")


_RANK1 = textwrap.dedent("""
    import ctypes, json, sys
    import fastload
    from fastload import vision


    def primary_contexts_active() -> list[bool]:
        # The driver's own answer, in this process (no nvidia-smi, no PID namespace): is the
        # primary context of each visible device active? Driver ordinals follow
        # CUDA_VISIBLE_DEVICES like torch's, and cuInit creates no context.
        cu = ctypes.CDLL("libcuda.so.1")
        assert cu.cuInit(0) == 0
        n = ctypes.c_int()
        assert cu.cuDeviceGetCount(ctypes.byref(n)) == 0
        out = []
        for i in range(n.value):
            dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
            assert cu.cuDeviceGet(ctypes.byref(dev), i) == 0
            assert cu.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) == 0
            out.append(bool(active.value))
        return out


    with fastload.Loader(sys.argv[1], batch_size=16, transforms={"image": vision.train(64)}) as lo:
        assert lo.device.index == 1, lo.device
        for i, b in enumerate(lo):
            if i == 3:
                break
        print(json.dumps(primary_contexts_active()))
""")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_rank_1_opens_no_context_on_gpu_0(photo_ds):
    """F3: a torchrun rank on cuda:1 (LOCAL_RANK=1 of 2, on a node of 2 or more GPUs) creates no
    CUDA context on cuda:0, from any of its threads (raw fields, DALI's mixed decoder, the
    feeders, pinning). Asked of the driver inside the process: works in containers too."""
    env = {**os.environ, "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", _RANK1, str(photo_ds.path)], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    active = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(active) >= 2 and active[1], active  # it did use its own GPU
    assert [i for i, a in enumerate(active) if a] == [1], f"primary contexts active on {active}"


def _sleep_cycles_per_ms() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def _epochs(loader, epochs: int, step_cycles: int = 0) -> float:
    """Seconds for ``epochs`` whole epochs, each batch followed by a GPU-busy "training step"
    of ``step_cycles`` on the current stream; the clock stops when the GPU is done."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(epochs):
        for _b in loader:
            if step_cycles:
                torch.cuda._sleep(step_cycles)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["raw", "images"])
def test_loading_overlaps_a_gpu_busy_step(kind, raw_ds, request):
    """F2/F4/F5: with the GPU busy in the training step, loading (host-to-device copies,
    DALI's work and its copy out) proceeds beside it: the run takes about max(step, load),
    not step + load, as it does when a copy or a DALI run waits behind the training stream.

    Sized from this host's own speed: as many epochs as make loading alone last >= 0.3 s
    (a fast host loads an epoch in milliseconds), and a step per batch exactly as long as
    loading one batch (the hardest case for overlap, with no floor that a fast host could
    not beat). Serial would take load + step; the bound asks that at least half of the
    shorter one be hidden."""
    if kind == "raw":
        ds, kw = raw_ds[0], dict(batch_size=256)
    else:
        ds, kw = request.getfixturevalue("photo_ds"), dict(batch_size=32, transforms={"image": vision.train(128)})
    with Loader(ds, device="cuda", **kw) as lo:
        _epochs(lo, 1)  # warm up: pipelines built, slots pinned, allocator primed
        one = min(_epochs(lo, 1) for _ in range(2))
        epochs = max(1, min(200, math.ceil(0.3 / max(one, 1e-4))))
        batches = epochs * len(lo)
        load = min(_epochs(lo, epochs) for _ in range(2))
        cycles = max(1, int(load / batches * 1e3 * _sleep_cycles_per_ms()))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(batches):
            torch.cuda._sleep(cycles)
        torch.cuda.synchronize()
        step = time.perf_counter() - t0
        both = min(_epochs(lo, epochs, cycles) for _ in range(2))
    print(f"{kind}: {epochs} epoch(s) of {len(lo)} batches: load {load:.3f} s, step {step:.3f} s, both {both:.3f} s")
    assert both < load + step - 0.5 * min(load, step), (load, step, both)

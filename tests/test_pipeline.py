"""DALI image pipeline on the CPU: real JPEGs and PNGs, presets against reference
implementations, per-sample reproducibility, bad images."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from fastload import vision
from fastload.pipeline import BadSamples
from fastload.pipeline.crops import random_resized_crop, train_params, uniforms
from fastload.demo.photos import photos


def encode(img: np.ndarray, fmt: str = "JPEG", **kw) -> np.ndarray:
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, fmt, **({"quality": 95} if fmt == "JPEG" else {}) | kw)
    return np.frombuffer(buf.getvalue(), np.uint8)


@pytest.fixture(scope="module")
def images():
    """Real photographs of several sizes and aspect ratios, as JPEG and PNG (one RGBA, one gray)."""
    p = photos(["astronaut", "chelsea", "coffee", "rocket"])
    arrays = [p["astronaut"][:300, :400], p["chelsea"], p["coffee"][:217, :333], p["rocket"][::2, ::2]]
    enc = [encode(a) for a in arrays]
    enc.append(encode(p["chelsea"][:120, :160], "PNG"))
    arrays.append(p["chelsea"][:120, :160])
    rgba = np.dstack([p["coffee"][:90, :70], np.full((90, 70), 200, np.uint8)])
    enc.append(encode(rgba, "PNG"))
    arrays.append(rgba[..., :3])
    gray = (p["astronaut"][:200, :150].mean(axis=2)).astype(np.uint8)
    enc.append(encode(gray))
    arrays.append(np.repeat(gray[..., None], 3, axis=2))
    w = np.array([a.shape[1] for a in arrays], np.int32)
    h = np.array([a.shape[0] for a in arrays], np.int32)
    return enc, arrays, w, h


def run(transform, enc, w, h, idx=None, epoch=0, seed=0, batch_size=None):
    idx = np.arange(len(enc)) if idx is None else np.asarray(idx)
    r = transform.runner(device="cpu", batch_size=batch_size or len(enc), seed=seed, num_threads=2)
    try:
        return r.run(list(enc), w, h, idx, epoch).numpy()
    finally:
        r.close()


def test_train_preset_shapes_dtypes_ranges(images):
    enc, _, w, h = images
    out = run(vision.train(96), enc, w, h)
    assert out.shape == (len(enc), 3, 96, 96) and out.dtype == np.float32
    mean = np.array(vision.IMAGENET_MEAN)[:, None, None]
    std = np.array(vision.IMAGENET_STD)[:, None, None]
    lo, hi = (0 - mean) / std, (1 - mean) / std
    assert (out >= lo - 1e-4).all() and (out <= hi + 1e-4).all()
    assert out.std() > 0.3  # real pixels, not a constant
    half = run(vision.train(64, dtype="float16", layout="HWC"), enc, w, h)
    assert half.shape == (len(enc), 64, 64, 3) and half.dtype == np.float16
    raw = run(vision.train((48, 80), dtype="uint8", layout="HWC"), enc, w, h)
    assert raw.shape == (len(enc), 48, 80, 3) and raw.dtype == np.uint8 and raw.max() > 200


def test_train_crop_matches_reference_pil_crop_resize_flip(images):
    """The ROI decode + resize + flip equals PIL: crop the same window, resize, mirror."""
    enc, arrays, w, h = images
    idx = np.arange(100, 100 + len(enc))
    t = vision.train(64, dtype="uint8", layout="HWC", scale=(0.2, 1.0))
    out = run(t, enc, w, h, idx=idx, epoch=3, seed=5)
    anchor, shape, flip = train_params(5, 3, idx, w, h, t.scale, t.ratio, t.flip)
    assert flip.min() == 0 or flip.max() == 1
    for i, _a in enumerate(arrays):
        x, y = (int(v) for v in anchor[i])
        cw, ch = (int(v) for v in shape[i])
        ref_src = np.asarray(Image.open(io.BytesIO(enc[i].tobytes())).convert("RGB"))
        crop = Image.fromarray(ref_src[y:y + ch, x:x + cw])
        ref = np.asarray(crop.resize((64, 64), Image.BILINEAR), dtype=np.float32)
        if flip[i]:
            ref = ref[:, ::-1]
        diff = np.abs(out[i].astype(np.float32) - ref).mean()
        assert diff < 6, (i, diff)  # resampling kernels differ slightly; a wrong window is >> 20


def test_eval_preset_equals_reference_resize_center_crop(images):
    enc, arrays, w, h = images
    t = vision.eval(64, resize=73)
    out = run(t, enc, w, h)
    mean = np.array(vision.IMAGENET_MEAN, np.float32)
    std = np.array(vision.IMAGENET_STD, np.float32)
    for i in range(len(enc)):
        src = Image.open(io.BytesIO(enc[i].tobytes())).convert("RGB")
        W, H = src.size
        s = 73 / min(W, H)
        nw, nh = max(73, round(W * s)), max(73, round(H * s))
        r = np.asarray(src.resize((nw, nh), Image.BILINEAR), np.float32) / 255
        # center crop; DALI rounds a half-pixel margin up (torchvision rounds half to even)
        top, left = int(np.floor((nh - 64) / 2 + 0.5)), int(np.floor((nw - 64) / 2 + 0.5))
        ref = ((r[top:top + 64, left:left + 64] - mean) / std).transpose(2, 0, 1)
        err = np.abs(out[i] - ref).mean()
        assert err < 0.06, (i, err)  # ~3 grey levels on average


def _run_whole_dali(transform, enc, w, h, idx, epoch=0, seed=0):
    r = transform.runner(device="cpu", batch_size=len(enc), seed=seed, num_threads=2, dali_only=True)
    try:
        assert not r.host_tail
        return r.run(list(enc), w, h, idx, epoch).numpy()
    finally:
        r.close()


@pytest.mark.parametrize("make", [
    lambda: vision.train(64, scale=(0.2, 1.0)),
    lambda: vision.train((48, 80), dtype="uint8", layout="HWC"),
    lambda: vision.train(56, dtype="float16", layout="HWC", mean=(0.5, 0.4, 0.3), std=(0.2, 0.3, 0.25)),
    lambda: vision.eval(64, resize=73),
    lambda: vision.eval((40, 56), dtype="uint8", layout="CHW"),
], ids=["train-f32-chw", "train-u8-hwc", "train-f16-hwc-own-stats", "eval-f32", "eval-u8-chw"])
def test_torch_finish_on_the_cpu_matches_dalis_whole_graph(images, make):
    """On the CPU the presets end DALI's graph at the decoder and resize, crop, flip and
    normalize in torch (pipeline/host_tail.py): the same pixels as DALI's whole graph (the
    GPU's) up to the resampling filters' rounding, per sample, for every dtype and layout.
    A wrong window, flip, layout or normalisation is off by far more."""
    enc, _, w, h = images
    t = make()
    idx = np.arange(40, 40 + len(enc))
    r = t.runner(device="cpu", batch_size=len(enc), seed=4, num_threads=2)
    try:
        assert r.host_tail
        ours = r.run(list(enc), w, h, idx, 2).numpy()
    finally:
        r.close()
    ref = _run_whole_dali(t, enc, w, h, idx, epoch=2, seed=4)
    assert ours.shape == ref.shape == (len(enc), *t.out_shape) and ours.dtype == ref.dtype
    scale = 1.0 if t.dtype == "uint8" else 1 / (255 * min(t.std))  # one grey level in output units
    diff = np.abs(ours.astype(np.float32) - ref.astype(np.float32)).reshape(len(enc), -1)
    assert diff.mean(axis=1).max() < 1.5 * scale, diff.mean(axis=1) / scale  # measured <= 0.7; flipped >= 6
    if isinstance(t, type(vision.train())):
        _, _, flip = train_params(4, 2, idx, w, h, t.scale, t.ratio, t.flip)
        assert 0 < flip.sum() < len(flip)  # both kinds present: a flip on the wrong side would show
    else:  # eval: no resampling difference on the crop's border rows either (same window)
        assert diff.max(axis=1).max() < 40 * scale


def test_the_torch_finish_runs_on_its_thread_alone():
    """Feeders call one_torch_thread(): torch's operators there use that thread only, while
    the process's setting (the training loop's) is left as it was."""
    import threading

    from fastload.pipeline.host_tail import one_torch_thread

    before = torch.get_num_threads()
    seen = []

    def worker():
        seen.append((one_torch_thread(), torch.get_num_threads()))
    th = threading.Thread(target=worker)
    th.start()
    th.join()
    assert seen == [(True, 1)]
    assert torch.get_num_threads() == before
    other = []
    th = threading.Thread(target=lambda: other.append(torch.get_num_threads()))
    th.start()
    th.join()
    assert other == [before]  # a new thread still gets the process default


def test_same_seed_epoch_index_same_pixels_regardless_of_batch(images):
    enc, _, w, h = images
    idx = np.array([7, 123456789, 42, 0, 5, 99, 3])
    t = vision.train(48)
    whole = run(t, enc, w, h, idx=idx, epoch=2, seed=9)
    # each sample alone, in reverse order, and in a bigger runner: identical pixels
    for i in reversed(range(len(enc))):
        alone = run(t, enc[i:i + 1], w[i:i + 1], h[i:i + 1], idx=idx[i:i + 1], epoch=2, seed=9, batch_size=16)
        assert np.array_equal(alone[0], whole[i])
    other_epoch = run(t, enc, w, h, idx=idx, epoch=3, seed=9)
    assert not np.array_equal(other_epoch, whole)


def test_uniforms_are_a_pure_function_of_seed_epoch_index():
    idx = np.array([0, 1, 2, 2**40, 5])
    a = uniforms(1, 2, idx, 8)
    assert a.shape == (5, 8) and (a >= 0).all() and (a < 1).all()
    assert np.array_equal(a[[4, 0]], uniforms(1, 2, idx[[4, 0]], 8))  # independent of batch composition
    assert not np.array_equal(a, uniforms(1, 3, idx, 8)) and not np.array_equal(a, uniforms(2, 2, idx, 8))
    big = uniforms(0, 0, np.arange(200_000), 2)
    assert abs(big.mean() - 0.5) < 0.005
    assert abs(np.corrcoef(big[:, 0], big[:, 1])[0, 1]) < 0.01
    assert abs(np.corrcoef(big[:-1, 0], big[1:, 0])[0, 1]) < 0.01  # neighbouring indices


def test_random_resized_crop_params_follow_torchvision():
    rng = np.random.default_rng(0)
    n = 20_000
    W = rng.integers(50, 800, n)
    H = rng.integers(50, 800, n)
    u = uniforms(0, 0, np.arange(n), 40)
    x, y, cw, ch = random_resized_crop(W, H, u, (0.08, 1.0), (3 / 4, 4 / 3))
    assert (x >= 0).all() and (y >= 0).all() and (x + cw <= W).all() and (y + ch <= H).all()
    assert (cw >= 1).all() and (ch >= 1).all()
    frac = cw * ch / (W * H)
    assert 0.06 < frac.min() and frac.max() <= 1.0 + 1e-9
    ratio = cw / ch
    assert np.quantile(ratio, 0.01) > 0.7 and np.quantile(ratio, 0.99) < 1.4
    # a 1000x10 strip cannot fit any attempt's ratio: the fallback clamps it (central crop)
    x, y, cw, ch = random_resized_crop(np.array([1000]), np.array([10]), u[:1], (0.08, 1.0), (3 / 4, 4 / 3))
    assert (cw[0], ch[0]) == (13, 10) and x[0] == (1000 - 13) // 2


def test_flip_probability():
    _, _, flip = train_params(0, 0, np.arange(10_000), np.full(10_000, 100), np.full(10_000, 100),
                              (0.08, 1.0), (0.75, 4 / 3), 0.5)
    assert 0.47 < flip.mean() < 0.53
    _, _, never = train_params(0, 0, np.arange(100), np.full(100, 100), np.full(100, 100), (0.08, 1.0),
                               (0.75, 4 / 3), 0.0)
    assert never.sum() == 0


def test_corrupt_and_mismatched_images_are_named_by_position(images):
    enc, _, w, h = images
    garbage = np.frombuffer(b"\xff\xd8\xff not a jpeg" * 20, np.uint8)
    batch = [enc[0], garbage, enc[1], enc[2]]
    ww = np.array([w[0], 100, w[1], w[2]])
    hh = np.array([h[0], 100, h[1], h[2]])
    r = vision.train(32).runner(device="cpu", batch_size=8, num_threads=1)
    try:
        with pytest.raises(BadSamples) as e:
            r.run(batch, ww, hh, np.arange(4), 0)
        assert e.value.positions == [1]
        assert "not a decodable image" in e.value.reasons[0]
        # the runner recovers: the next batch decodes
        ok = r.run(enc[:3], w[:3], h[:3], np.arange(3), 0)
        assert ok.shape == (3, 3, 32, 32)
        # a recorded size that does not match the bytes is caught, not decoded into garbage
        with pytest.raises(BadSamples) as e:
            r.run([enc[1]], np.array([w[1] * 3]), np.array([h[1] * 3]), np.arange(1), 0)
        assert "do not match" in e.value.reasons[0]
    finally:
        r.close()


def test_a_broken_pipeline_is_not_blamed_on_valid_images(images, monkeypatch):
    enc, _, w, h = images
    r = vision.eval(32, resize=40).runner(device="cpu", batch_size=4)
    try:
        # every image of a batch corrupt: still the data's fault (the canary image decodes)
        junk = [np.frombuffer(b"not an image at all", np.uint8)] * 3
        with pytest.raises(BadSamples) as e:
            r.run(junk, w[:3], h[:3], np.arange(3), 0)
        assert e.value.positions == [0, 1, 2]
        # the pipeline itself fails (a DALI API misuse, an executor error): a RuntimeError
        # saying so, not BadSamples naming every valid image
        def broken(encoded, params, capture=True):
            raise RuntimeError("Assert on \"exec_dynamic\" failed: this call needs the dynamic executor")

        monkeypatch.setattr(r, "_run_once", broken)
        with pytest.raises(RuntimeError, match="including a valid built-in") as e:
            r.run(enc[:4], w[:4], h[:4], np.arange(4), 0)
        assert not isinstance(e.value, BadSamples) and "dynamic executor" in str(e.value)
    finally:
        r.close()


def test_huge_header_refused_before_decoding(images):
    enc, _, w, h = images
    r = vision.eval(32, max_pixels=10_000).runner(device="cpu", batch_size=4)
    try:
        with pytest.raises(BadSamples) as e:
            r.run(enc[:2], w[:2], h[:2], np.arange(2), 0)
        assert e.value.positions == [0, 1] and "max_pixels=10000" in e.value.reasons[0]
    finally:
        r.close()


def test_custom_graph_and_shape_check(images):
    from nvidia.dali import fn, types

    enc, _, w, h = images

    def gray_thumbnail(encoded, device):
        img = fn.decoders.image(encoded, device="mixed" if device == "gpu" else "cpu", output_type=types.GRAY)
        return fn.resize(img, device=device, resize_x=20, resize_y=10)

    t = vision.custom(gray_thumbnail, shape=(10, 20, 1), dtype="uint8")
    out = run(t, enc, w, h)
    assert out.shape == (len(enc), 10, 20, 1) and out.dtype == np.uint8
    wrong = vision.custom(gray_thumbnail, shape=(3, 10, 20), dtype="uint8")
    with pytest.raises(RuntimeError, match="declares"):
        run(wrong, enc, w, h)


@pytest.mark.parametrize("make,match", [
    (lambda: vision.train(0), r"size=0 must be a positive int"),
    (lambda: vision.train(224, scale=(0.5, 0.1)), "scale"),
    (lambda: vision.train(224, ratio=(0, 1)), "ratio"),
    (lambda: vision.train(224, flip=2), "flip"),
    (lambda: vision.train(224, dtype="int7"), "dtype"),
    (lambda: vision.train(224, layout="CWH"), "layout"),
    (lambda: vision.train(224, std=(0, 1, 1)), "std"),
    (lambda: vision.train(224, dtype="uint8", mean=(0.5, 0.5, 0.5)), "uint8"),
    (lambda: vision.eval(224, resize=100), "resize=100"),
    (lambda: vision.custom(42, shape=(3, 4, 4)), "custom"),
])
def test_bad_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_describe_is_json_and_equality():
    import json
    t = vision.train(224)
    assert json.loads(json.dumps(t.describe()))["kind"] == "train"
    assert t == vision.train(224) and t != vision.train(192)
    assert "eval" in repr(vision.eval(224))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_matches_cpu_graph(images):  # pragma: no cover - no GPU here
    pytest.importorskip("nvidia.dali", reason="a DALI graph on the GPU")
    enc, _, w, h = images
    t = vision.eval(64)
    cpu = run(t, enc, w, h)
    r = t.runner(device="cuda", batch_size=len(enc), device_id=torch.cuda.current_device())
    try:
        gpu = r.run(list(enc), w, h, np.arange(len(enc)), 0)
        torch.cuda.current_stream().wait_event(r.ready_event)  # copied out on the runner's own stream
        assert gpu.is_cuda and gpu.shape == (len(enc), 3, 64, 64)
        assert np.abs(gpu.cpu().numpy() - cpu).mean() < 0.05  # nvJPEG vs libjpeg-turbo rounding
    finally:
        r.close()


def test_exif_rotated_images_are_recorded_and_decoded_upright(tmp_path):
    """Phone photos carry an EXIF orientation; DALI decodes them upright, so the store records
    the upright size and crops are drawn in that frame (a train crop never falls outside)."""
    import fastload

    upright = photos(["astronaut"])["astronaut"][:120, :300]  # 300 wide, 120 tall
    stored = np.ascontiguousarray(np.rot90(upright, k=1))  # the pixels as a camera stores them
    (tmp_path / "src" / "a").mkdir(parents=True)
    for fmt, ext in (("JPEG", "jpg"), ("PNG", "png")):
        im = Image.fromarray(stored)
        ex = im.getexif()
        ex[0x0112] = 6  # "rotate 90 CW to display"
        im.save(tmp_path / "src" / "a" / f"rot.{ext}", fmt, exif=ex.tobytes(),
                **({"quality": 95} if fmt == "JPEG" else {}))
        Image.fromarray(upright).save(tmp_path / "src" / "a" / f"up.{ext}", fmt,
                                      **({"quality": 95} if fmt == "JPEG" else {}))
    fastload.convert("imagefolder", tmp_path / "src", tmp_path / "ds", progress=False)
    ds = fastload.Dataset(tmp_path / "ds")
    keys = [k.decode() if isinstance(k, bytes) else k for k in ds.keys(np.arange(len(ds)))]
    w, h = ds.image_sizes("image", np.arange(len(ds)))
    assert w.tolist() == [300] * 4 and h.tolist() == [120] * 4  # upright, for every file
    with fastload.Loader(ds, batch_size=len(ds), shuffle=False, device="cpu",
                         transforms={"image": vision.eval(96, resize=96, dtype="uint8", layout="HWC")}) as ev:
        out = next(iter(ev))["image"].numpy()
    by_key = dict(zip(keys, out))
    # lossless PNG: the rotated file decodes to exactly the upright pixels
    assert np.array_equal(by_key["a/rot.png"], by_key["a/up.png"])
    assert np.abs(by_key["a/rot.jpg"].astype(int) - by_key["a/up.jpg"].astype(int)).mean() < 8
    with fastload.Loader(ds, batch_size=2, device="cpu", transforms={"image": vision.train(64)}) as tr:
        for epoch in range(3):
            tr.set_epoch(epoch)
            assert sum(len(b["index"]) for b in tr) == len(ds)
        assert tr.stats()["replaced_samples"] == 0


def test_recorded_size_is_the_size_dali_decodes():
    """Orientation from places DALI ignores (XMP, a PNG text chunk) must not swap the recorded
    size; a TIFF's orientation is applied by both; a real EXIF orientation by both."""
    from PIL import PngImagePlugin

    from fastload.convert.common import check_image
    from fastload.store.writer import image_size

    img = Image.fromarray(photos(["astronaut"])["astronaut"][:40, :100])  # 100 wide, 40 tall
    xmp = ('<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/'
           '22-rdf-syntax-ns#"><rdf:Description rdf:about="" xmlns:tiff="http://ns.adobe.com/tiff/1.0/" '
           'tiff:Orientation="6"/></rdf:RDF></x:xmpmeta>')
    ex = Image.Exif()
    ex[0x0112] = 6
    raw = (b"Exif\x00\x00" + ex.tobytes()).hex()
    text = PngImagePlugin.PngInfo()
    text.add_text("Raw profile type exif", f"\nexif\n{len(raw) // 2:8d}\n{raw}\n")
    variants = {"jpeg xmp": ("JPEG", {"xmp": xmp.encode()}), "png text exif": ("PNG", {"pnginfo": text}),
                "tiff orientation": ("TIFF", {"tiffinfo": {0x0112: 6}}),
                "jpeg exif": ("JPEG", {"exif": ex.tobytes()}), "webp exif": ("WEBP", {"exif": ex.tobytes()})}
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=1, num_threads=1, device_id=None, prefetch_queue_depth=1)
    def decode():
        return fn.decoders.image(fn.external_source(name="e"), device="cpu", output_type=types.RGB,
                                 adjust_orientation=True)

    pipe = decode()
    pipe.build()
    try:
        for name, (fmt, kw) in variants.items():
            buf = io.BytesIO()
            img.save(buf, fmt, **kw)
            data = buf.getvalue()
            pipe.feed_input("e", [np.frombuffer(data, np.uint8)])
            (out,) = pipe.run()
            h, w = out.at(0).shape[:2]
            assert image_size(data) == (w, h), name
            assert check_image(data) == (w, h), name
    finally:
        pipe._shutdown()  # join DALI's threads now (what Pipeline.__del__ does)


def test_held_outputs_are_never_overwritten_by_later_runs(images):
    """CPU outputs are DALI's own buffers (zero-copy): a batch the training loop still holds
    must keep its pixels while the runner decodes more batches."""
    enc, _, w, h = images
    r = vision.eval(32, resize=40).runner(device="cpu", batch_size=4, num_threads=2)
    try:
        held = [r.run(enc[:4], w[:4], h[:4], np.arange(4), 0)]
        first = held[0].clone()
        for k in range(6):
            held.append(r.run(enc[3:7], w[3:7], h[3:7], np.arange(4) + 10 * k, 0))
        assert torch.equal(held[0], first)
        assert not torch.equal(held[0], held[1])  # different images, so a reused buffer would show
    finally:
        r.close()


_CRASH_SCRIPT = """
import io, numpy as np
from PIL import Image
from fastload import vision
from fastload.pipeline import BadSamples
rng = np.random.default_rng(0)
enc = []
for _ in range(32):
    b = io.BytesIO(); Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(b, "JPEG")
    enc.append(np.frombuffer(b.getvalue(), np.uint8))
enc[2] = np.frombuffer(b"not an image " * 20, np.uint8)
r = vision.eval(32, resize=40).runner(device="cpu", batch_size=32, num_threads=2)
wh = np.full(32, 64, np.int32)
try:
    r.run(enc, wh, wh, np.arange(32), 0)
except BadSamples as e:
    print("bad", e.positions)
r.close()
"""


@pytest.mark.slow
def test_a_failed_large_cpu_batch_does_not_crash_the_process():
    """DALI 2.4 segfaults in ~40% of processes that shut a CPU pipeline down after it failed
    a batch of 32 with an early bad image, when the cores are busy (10 of 20 runs with two
    busy loops beside it, either executor; never with runs of 16-24). The runner decodes in
    runs of CPU_RUN images instead. The 5 processes run at once (each one a trial: a process
    that got through its first failed batch got through 5 more, with runs of 32; 2-3 of 5
    crashed when run at once, as one after the other)."""
    import subprocess
    import sys

    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    procs = []
    try:
        procs = [subprocess.Popen([sys.executable, "-u", "-c", _CRASH_SCRIPT], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(5)]
        for p in procs:
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0, (p.returncode, out[-500:], err[-2000:])
            assert "bad [2]" in out
    finally:
        for q in load + procs:
            q.kill()
            q.wait()


def test_large_cpu_batches_are_decoded_in_runs_with_the_same_pixels():
    """A CPU batch larger than CPU_RUN is decoded in runs (DALI 2.4 crash, see CPU_RUN): the
    same pixels as runs of one image each, bad samples named by their batch position."""
    from fastload.pipeline.runner import CPU_RUN

    rng = np.random.default_rng(1)
    n = 2 * CPU_RUN + 8
    enc = [encode(rng.integers(0, 255, (48 + i % 5, 64, 3), dtype=np.uint8)) for i in range(n)]
    w = np.full(n, 64, np.int32)
    h = np.array([48 + i % 5 for i in range(n)], np.int32)
    t = vision.train(24)
    one = t.runner(device="cpu", batch_size=1, num_threads=1)
    r = t.runner(device="cpu", batch_size=n, num_threads=2)
    try:
        want = torch.cat([one.run([enc[i]], w[i:i + 1], h[i:i + 1], np.array([i]), 3) for i in range(n)])
        got = r.run(enc, w, h, np.arange(n), 3)
        assert got.shape == (n, 3, 24, 24) and torch.equal(got, want)
        out = torch.empty_like(want)
        assert r.run(enc, w, h, np.arange(n), 3, out=out) is out and torch.equal(out, want)
        junk = np.frombuffer(b"not an image " * 20, np.uint8)
        bad = list(enc)
        bad[5] = bad[CPU_RUN + 3] = bad[n - 1] = junk
        with pytest.raises(BadSamples) as e:
            r.run(bad, w, h, np.arange(n), 3)
        assert e.value.positions == [5, CPU_RUN + 3, n - 1]
        assert torch.equal(r.run(enc, w, h, np.arange(n), 3), want)  # and it recovers
    finally:
        one.close()
        r.close()

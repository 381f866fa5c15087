"""Sample transforms over several fields: a user's multi-field DALI graph (custom with
inputs= and outputs=), its keyed per-sample uniforms, its errors; and the CUDA delivery of
multi-field graphs (detection, segmentation, custom) on the fake GPU (tests/fake_cuda.py)."""
from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch

import fastload
from fake_cuda import fake_dali_on_gpu
from fastload import vision
from fastload.vision import Spec

from test_detection import make_boxes_dataset


@pytest.fixture(scope="module")
def mf_ds(tmp_path_factory):
    return make_boxes_dataset(tmp_path_factory.mktemp("mf") / "ds", n=20, seed=8)


def half_boxes(inputs, device):
    """Decode and resize the image to 24x24; boxes halved by DALI's arithmetic (ragged, on the
    CPU); labels passed through; the per-sample uniforms as an output."""
    from nvidia.dali import fn, types

    img = fn.decoders.image(inputs["image"], device="mixed" if device == "gpu" else "cpu", output_type=types.RGB)
    img = fn.resize(img, device=device, resize_x=24, resize_y=24)
    img = fn.crop_mirror_normalize(img, device=device, dtype=types.UINT8, output_layout="CHW")
    return {"image": img, "boxes": inputs["boxes"] * 0.5, "labels": inputs["labels"], "r": inputs["random"]}


CUSTOM = vision.custom(half_boxes, inputs={"image": "image", "boxes": "boxes", "labels": "labels"},
                       outputs={"image": Spec((3, 24, 24), "uint8"), "boxes": Spec((None, 4), "float32"),
                                "labels": ((None,), "int64"), "r": ((8,), "float32")})


def test_a_custom_multi_field_graph(mf_ds):
    with fastload.Loader(mf_ds, batch_size=6, transforms=CUSTOM, shuffle=False, fields=[]) as lo:
        batches = list(lo)
    assert set(batches[0]) == {"image", "boxes", "boxes_lengths", "labels", "labels_lengths", "r", "index"}
    r_by_index = {}
    for b in batches:
        assert b["image"].shape[1:] == (3, 24, 24) and b["image"].dtype == torch.uint8
        for i, idx in enumerate(b["index"].tolist()):
            n = int(b["boxes_lengths"][i])
            assert np.array_equal(b["boxes"][i, :n].numpy(), mf_ds[idx]["boxes"] * 0.5)
            assert b["labels"][i, :n].tolist() == mf_ds[idx]["labels"].tolist()
            r_by_index[idx] = b["r"][i].numpy()
    rs = np.stack(list(r_by_index.values()))
    assert ((rs >= 0) & (rs < 1)).all() and len(np.unique(rs)) == rs.size  # uniforms, all different
    # the uniforms are per sample, not per batch position: another batch size, other ranks, the same values
    for rank in range(2):
        with fastload.Loader(mf_ds, batch_size=4, transforms=CUSTOM, rank=rank, world_size=2, shuffle=True) as lo:
            for b in lo:
                for i, idx in enumerate(b["index"].tolist()):
                    assert np.array_equal(b["r"][i].numpy(), r_by_index[idx])


def test_custom_graph_errors(mf_ds):
    def missing(inputs, device):
        from nvidia.dali import fn

        return {"image": fn.decoders.image(inputs["image"], device="cpu")}

    t = vision.custom(missing, inputs={"image": "image"}, outputs={"image": Spec((3, 24, 24), "uint8"),
                                                                   "extra": Spec((1,), "float32")})
    with pytest.raises(RuntimeError, match=r"graph cannot be built: ValueError: .*missing \['extra'\]"), \
            fastload.Loader(mf_ds, batch_size=4, transforms=t) as lo:
        next(iter(lo))
    wrong = vision.custom(half_boxes, inputs={"image": "image", "boxes": "boxes", "labels": "labels"},
                          outputs={"image": Spec((3, 32, 32), "uint8"), "boxes": Spec((None, 4), "float32"),
                                   "labels": Spec((None,), "int64"), "r": Spec((8,), "float32")})
    with pytest.raises(Exception, match=r"output 'image' came out as \(4, 3, 24, 24\); it declares \(4, 3, 32, 32\)"), \
            fastload.Loader(mf_ds, batch_size=4, transforms=wrong) as lo:
        next(iter(lo))
    with pytest.raises(ValueError, match=r"outputs\[.image.\]=\(3, 24, 24\) must be a fastload.vision.Spec"):
        vision.custom(half_boxes, inputs={"image": "image"}, outputs={"image": (3, 24, 24)})
    with pytest.raises(ValueError, match="shape= declares a one-field graph"):
        vision.custom(half_boxes, shape=(3, 4, 4), outputs={"image": Spec((3, 4, 4), "uint8")})
    with pytest.raises(ValueError, match="Spec dtype"):
        Spec((None, 4), "complex64")
    with pytest.raises(ValueError, match="its output key 'weight' would shadow field 'weight'"):
        _shadow(mf_ds)


def _shadow(ds):
    """An output whose ragged key is a delivered field."""
    t = vision.custom(half_boxes, inputs={"image": "image", "boxes": "boxes"},
                      outputs={"image": Spec((3, 24, 24), "uint8"), "weight": Spec((None,), "float32")})
    fastload.Loader(ds, batch_size=4, transforms=t, fields=["weight"])


def _cpu_reference(ds, transforms, **kw):
    """The batches of a CPU Loader running the transform's whole graph in DALI, as the fake GPU
    does (on the CPU the presets finish in torch)."""
    from fastload.pipeline import presets

    with mock.patch.object(presets._Normalized, "finishes_on_cpu", False), \
            fastload.Loader(ds, device="cpu", transforms=transforms, **kw) as lo:
        return [{k: v.clone() for k, v in b.items()} for b in lo]


@pytest.mark.parametrize("transform", [
    vision.detection(40, return_crop=True, dtype="uint8"),
    vision.detection(40, letterbox=True),
    vision.segmentation(32, return_crop=True),
    CUSTOM,
], ids=["detection", "letterbox", "segmentation", "custom"])
@pytest.mark.parametrize("ragged", ["padded", "packed"])
def test_multi_field_graphs_on_cuda(fake, mf_ds, monkeypatch, transform, ragged):
    builds = fake_dali_on_gpu(fake, monkeypatch)
    kw = dict(batch_size=6, seed=4, shuffle=True, fields=[])
    if ragged == "packed" and "boxes" in transform.outputs:
        kw["ragged"] = "packed"
    ref = _cpu_reference(mf_ds, transform, **kw)
    with fastload.Loader(mf_ds, device="cuda:1", transforms=transform, **kw) as lo:
        batches = [dict(b) for b in lo]
        assert fake.contexts == {1}, f"CUDA calls on other devices: {fake.devices_by_thread()}"
        assert fake.blocking_copies() == [], "a blocking copy"
        dali = [c for c in fake.copies if c.src == "dali"]
        assert dali and all(c.stream.cuda_stream != 0 for c in dali), "DALI's output copied on a default stream"
        h2d = [c for c in fake.copies if c.src == "cpu" and c.thread.startswith("fastload-feeder")]
        assert all(c.non_blocking and c.stream.cuda_stream != 0 for c in h2d), "host outputs copied blocking"
        assert [w for w in fake.host_waits if w.thread != "MainThread"] == [], "a feeder waited on the host"
        assert builds
        assert len(batches) == len(ref)
        for b, r in zip(batches, ref):
            assert set(b) == set(r)
            for k in r:
                assert b[k].is_cuda, k
                got = b[k].cpu()
                assert got.dtype == r[k].dtype and torch.equal(got, r[k]), k


@pytest.mark.parametrize("make", [lambda: vision.detection(64), lambda: vision.detection(64, letterbox=True),
                                  lambda: vision.segmentation(48)], ids=["detection", "letterbox", "segmentation"])
def test_cuda_graphs_are_valid_offline_with_roi_decoders_mixed_and_the_rest_on_the_gpu(mf_ds, make):
    """DALI validates each multi-field CUDA graph without a GPU (pipeline/offline.py): the
    window decoded by the mixed ROI decoder, every other operator and every output on the GPU,
    the per-sample parameters fed from the CPU."""
    from fastload.pipeline import offline

    t = make()
    t.bind(mf_ds.fields)
    r = offline.check(t, device="cuda", batch_size=8)
    assert r.problems() == []
    assert {d.schema for d in r.decoders} == {"decoders__ImageSlice"} and {d.device for d in r.decoders} == {"mixed"}
    assert len(r.decoders) == len(t.image_inputs) and [d for _, d in r.outputs] == ["gpu"] * len(r.outputs)
    cpu_inputs = {n for op in r.ops for n, d in op.inputs if d == "cpu"}
    assert set(t.param_names()) <= cpu_inputs
    assert offline.check(t, device="cpu", dali_only=True).problems() == []


@pytest.mark.parametrize("make", [lambda: vision.detection(64, return_crop=True),
                                  lambda: vision.detection(64, letterbox=True, return_crop=True),
                                  lambda: vision.segmentation(48, return_crop=True)],
                         ids=["detection", "letterbox", "segmentation"])
def test_the_cpu_finish_is_the_gpu_graph(mf_ds, make):
    """On the CPU, DALI decodes the window and torch finishes (resize, letterbox, flip,
    normalize, masks nearest): the same result as the whole graph in DALI (the GPU's)."""
    t = make()
    t.bind(mf_ds.fields)
    idx = np.arange(16)
    a = t.runner(batch_size=16).run_batch(mf_ds, idx, 3)
    b = t.runner(batch_size=16, dali_only=True).run_batch(mf_ds, idx, 3)
    assert set(a) == set(b)
    for k in a:
        if k == "image":  # two antialiased resizes: close, not bit-equal
            assert (a[k] - b[k]).abs().mean() < 0.005, k  # (at sharp edges a pixel may differ more)
        else:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("make", [lambda: vision.detection(64, return_crop=True),
                                  lambda: vision.detection(64, letterbox=True, return_crop=True),
                                  lambda: vision.segmentation(48, return_crop=True)],
                         ids=["detection", "letterbox", "segmentation"])
def test_multi_field_graphs_on_a_gpu_match_the_cpu(mf_ds, make):  # pragma: no cover - no GPU here
    """On a real GPU (mixed ROI decoders, GPU resize/normalize/flip/pad): the same windows,
    boxes, labels and masks as the CPU Loader, images within nvJPEG's rounding."""
    pytest.importorskip("nvidia.dali", reason="multi-field graphs need DALI (tools/gpu_check.sh runs without it)")
    kw = dict(batch_size=8, seed=2, transforms=make(), fields=[])
    with fastload.Loader(mf_ds, device="cpu", **kw) as lo:
        ref = [{k: v.clone() for k, v in b.items()} for b in lo]
    with fastload.Loader(mf_ds, device="cuda", **kw) as lo:
        got = [{k: v.cpu() for k, v in b.items()} for b in lo]
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        assert set(g) == set(r)
        for k in r:
            if k == "image":
                assert (g[k] - r[k]).abs().mean() < 0.05
            elif k == "mask":  # PNG decodes exactly; nearest picks the same pixels
                assert (g[k] == r[k]).float().mean() > 0.999
            else:
                assert torch.equal(g[k], r[k]), k

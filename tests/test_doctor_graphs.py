"""What the doctor does with each preset's graph, and the CPU twin that catches what DALI's
offline check cannot (review gpu-path-2 §2, G4): ``offline.check`` validates schema and
placement only (no operator is built); ``offline.run_twin`` builds the same graph whole in
DALI on the CPU and runs a batch, so bad argument values, types, layouts and output shapes
show without a GPU."""
from __future__ import annotations

import pytest

from fastload import doctor, vision
from fastload.doctor import FAIL, OK
from fastload.pipeline import offline


def _graph(resize=None, **cmn):
    def build(encoded, device):
        from nvidia.dali import fn

        img = fn.decoders.image(encoded, device="mixed" if device == "gpu" else "cpu")
        img = fn.resize(img, device=device, **(resize or {"size": (64, 64)}))
        return fn.crop_mirror_normalize(img, device=device, **cmn)
    return build


def _types():
    from nvidia.dali import types

    return types


BROKEN = {  # accepted by the offline check, refused or wrong when built and run
    "negative resize_x": (lambda t: _graph({"resize_x": -5, "resize_y": 64}, dtype=t.UINT8, output_layout="HWC"),
                          "produced (2, 64, 5, 3)"),
    "an int64 output": (lambda t: _graph(dtype=t.INT64, output_layout="HWC"), "Not supported output type"),
    "a 2-channel mean": (lambda t: _graph(dtype=t.FLOAT, mean=[0.0, 0.0], std=[1.0] * 3, output_layout="HWC"),
                         "mean"),
    "layout XYZ": (lambda t: _graph(dtype=t.UINT8, output_layout="XYZ"), "output_layout"),
    "a shape not the declared one": (lambda t: _graph({"size": (40, 40)}, dtype=t.UINT8, output_layout="HWC"),
                                     "produced (2, 40, 40, 3); it declares (2, 64, 64, 3)"),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_the_cpu_twin_catches_what_the_offline_check_accepts(name):
    make, words = BROKEN[name]
    dtype = "float32" if "mean" in name else "uint8"
    t = vision.custom(make(_types()), shape=(64, 64, 3), dtype=dtype)
    assert offline.check(t, device="cuda").problems() == []  # schema and placement are fine
    with pytest.raises(RuntimeError, match="the CPU twin of the graph") as e:
        offline.run_twin(t)
    assert words in str(e.value), str(e.value)


def test_the_cpu_twin_of_a_good_graph_runs_and_says_what_came_out():
    types = _types()
    t = vision.custom(_graph(dtype=types.FLOAT, output_layout="CHW", mean=[0.0] * 3, std=[255.0] * 3),
                      shape=(3, 64, 64), dtype="float32")
    run = offline.run_twin(t)
    assert (run.shape, run.dtype) == ((2, 3, 64, 64), "float32") and run.summary() == \
        "2 JPEGs -> (2, 3, 64, 64) float32"


def test_every_preset_s_twin_runs():
    for name, t in doctor.presets().items():
        run = offline.run_twin(t)
        assert run.shape == (2, *t.out_shape), name


def test_doctor_fails_a_graph_whose_twin_fails(monkeypatch):
    def broken(t, **kw):
        raise RuntimeError("the CPU twin of the graph produced (2, 224, 5, 3); the transform declares (2, 224, 224, 3)")

    monkeypatch.setattr(offline, "run_twin", broken)
    checks = doctor.check_graphs("cuda", gpu_usable=False, names=["eval"])
    c, = checks
    assert c.status == FAIL and c.message.startswith("checked offline: operators and placement (decoders.Image@mixed")
    assert c.message.endswith("the CPU twin of the graph produced (2, 224, 5, 3); the transform declares "
                              "(2, 224, 224, 3)")


def test_on_the_cpu_the_doctor_checks_runs_the_twin_and_the_graph():
    c, = doctor.check_graphs("cpu", gpu_usable=False, names=["train"])
    assert c.status == OK, c.message
    parts = c.message.split("; ")
    assert parts[0].startswith("checked offline: operators and placement (decoders.ImageSlice@cpu")
    assert parts[1].startswith("CPU twin built and ran 2 JPEGs -> (2, 3, 224, 224) float32")
    assert parts[2] == "built and ran a JPEG on the CPU"

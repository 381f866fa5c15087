"""The CUDA graph of every preset, validated by DALI without a GPU (review test A).

``Pipeline.serialize()`` with ``device_id=None`` runs DALI's argument, schema and device
checks on a ``mixed``/``gpu`` graph without touching CUDA; reading the serialized graph back
says where every operator runs."""
from __future__ import annotations

import pytest

from fastload import vision
from fastload.pipeline import offline

PRESETS = {
    "train": lambda: vision.train(224),
    "train-uint8-hwc": lambda: vision.train((96, 128), dtype="uint8", layout="HWC"),
    "train-fp16": lambda: vision.train(64, dtype="float16", scale=(0.5, 1.0), flip=0.0),
    "eval": lambda: vision.eval(224),
    "eval-uint8": lambda: vision.eval(64, resize=80, dtype="uint8", layout="HWC"),
}


def _crop(encoded, device):
    from nvidia.dali import fn

    img = fn.decoders.image(encoded, device="mixed" if device == "gpu" else "cpu")
    return fn.crop(fn.resize(img, device=device, size=(40, 40)), device=device, crop=(32, 32))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_cuda_graph_is_valid_with_decoder_mixed_and_ops_on_gpu(name):
    t = PRESETS[name]()
    r = offline.check(t, device="cuda", batch_size=16)
    assert r.problems() == []
    dec, = r.decoders
    assert dec.device == "mixed"
    assert dec.schema == ("decoders__ImageSlice" if name.startswith("train") else "decoders__Image")
    sources = [op for op in r.ops if op.is_source]
    assert {op.device for op in sources} == {"cpu"}
    assert {op.name for op in sources} == {"encoded", *t.param_names()}
    others = [op for op in r.ops if not op.is_source and not op.is_decoder]
    assert [op.schema for op in others] == ["Resize", "CropMirrorNormalize"]
    assert {op.device for op in others} == {"gpu"}
    assert [d for _, d in r.outputs] == ["gpu"]
    # every per-sample parameter reaches the graph from the CPU (named arguments must be CPU)
    cpu_inputs = {n for op in r.ops for n, d in op.inputs if d == "cpu"}
    assert set(t.param_names()) <= cpu_inputs
    # the executor the runner asks for (F4/F5 change these on purpose)
    assert (r.exec_dynamic, r.exec_pipelined, r.exec_async, r.prefetch_queue_depth) == (False, True, True, 1)
    assert r.batch_size == 16


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_cpu_graph_is_the_gpu_graph_up_to_the_decoder(name):
    """On the CPU the presets' DALI graph ends at the decoder (resize, crop, flip and
    normalize run in torch, pipeline/host_tail.py): the same sources and decoder, with the
    same arguments, as on the GPU (bar the decoder's device), and nothing after it."""
    t = PRESETS[name]()
    gpu = offline.check(t, device="cuda")
    cpu = offline.check(t, device="cpu")
    assert cpu.problems() == []
    assert t.finishes_on_cpu
    fed = {"encoded", *t.param_names(decoded_only=True)}  # the flip is done by torch on the CPU
    head = [op for op in gpu.ops if (op.is_source and op.name in fed) or op.is_decoder]
    assert [op.schema for op in cpu.ops] == [op.schema for op in head]
    assert [[a for a in op.args if a[0] != "device"] for op in cpu.ops] == \
        [[a for a in op.args if a[0] != "device"] for op in head]
    assert [d for _, d in cpu.outputs] == ["cpu"] and cpu.decoders[0].device == "cpu"
    assert {op.name for op in cpu.ops if op.is_source} == fed


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_whole_dali_graph_is_the_same_on_both_devices(name):
    """dali_only=True (the bench's "DALI alone" limit) runs the GPU's graph on the CPU."""
    t = PRESETS[name]()
    gpu = offline.check(t, device="cuda")
    cpu = offline.check(t, device="cpu", dali_only=True)
    assert cpu.problems() == []
    assert [op.schema for op in cpu.ops] == [op.schema for op in gpu.ops]  # one graph, two devices
    assert [op.args for op in cpu.ops] == [op.args for op in gpu.ops]


def test_custom_graph_on_cuda():
    r = offline.check(vision.custom(_crop, shape=(32, 32, 3), dtype="uint8"), device="cuda")
    assert r.problems() == []
    assert r.summary() == "decoders.Image@mixed, Resize@gpu, Crop@gpu -> gpu"


def test_a_graph_left_on_the_cpu_is_reported():
    from nvidia.dali import fn

    def cpu_only(encoded, device):  # ignores `device`: decodes and resizes on the CPU
        return fn.resize(fn.decoders.image(encoded, device="cpu"), size=(8, 8))

    r = offline.check(vision.custom(cpu_only, shape=(8, 8, 3), dtype="uint8"), device="cuda")
    assert r.problems() == ["decoders__Image (__Image_0) runs on 'cpu', expected 'mixed'",
                            "Resize (__Resize_1) runs on 'cpu', expected 'gpu'",
                            "output __Resize_1 is on 'cpu', expected 'gpu'"]


def _misspelled(encoded, device):
    from nvidia.dali import fn

    return fn.resize(fn.decoders.image(encoded, device="mixed"), resize_xx=3)


def _gpu_image_into_a_cpu_op(encoded, device):
    from nvidia.dali import fn

    return fn.resize(fn.decoders.image(encoded, device="mixed"), device="cpu", size=3)


@pytest.mark.parametrize("build, error", [
    (_misspelled, 'Argument "resize_xx" is not defined'),
    (_gpu_image_into_a_cpu_op, "incompatible device"),
])
def test_dali_rejects_a_broken_cuda_graph_offline(build, error):
    with pytest.raises((KeyError, RuntimeError), match=error):
        offline.check(vision.custom(build, shape=(3, 3, 3), dtype="uint8"), device="cuda")


def test_parse_rejects_garbage():
    with pytest.raises(ValueError):
        offline.parse_pipeline_def(b"\x08")  # a varint key with no value


def test_a_cuda_runner_without_a_device_says_so_before_dali_does():
    """Offline validation defines CUDA graphs without a device; running one needs a device id,
    and says so (DALI's own refusal, at run time, read as a pipeline failing on every image)."""
    from fastload import vision

    runner = vision.train(32).runner(device="cuda", batch_size=2, device_id=None)
    with pytest.raises(ValueError, match="needs device_id="):
        runner.prepare()
    runner.close()

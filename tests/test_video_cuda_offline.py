"""The CUDA graphs of fastload.video and fastload.audio, validated by DALI without a GPU
(``Pipeline.serialize()`` with ``device_id=None``, see fastload.pipeline.offline)."""
from __future__ import annotations

import pytest

from fastload import audio, video
from fastload.pipeline import offline

VIDEO = {
    "clip": lambda: video.clip(16, 2, 224),
    "clip-float-cthw": lambda: video.clip(8, 4, 112, crop="center", dtype="float16", mean=[0.45] * 3,
                                          std=[0.225] * 3, layout="CTHW"),
    "clips": lambda: video.clips(3, 8, 2, 64, layout="TCHW"),
}


@pytest.mark.parametrize("name", sorted(VIDEO))
def test_video_cuda_graph_decodes_with_nvdec_and_runs_on_the_gpu(name):
    t = VIDEO[name]()
    r = offline.check(t, device="cuda", batch_size=8)
    assert r.problems() == []
    dec, = r.decoders
    assert (dec.schema, dec.device) == ("decoders__Video", "mixed")
    assert {op.name for op in r.ops if op.is_source} == {"encoded", *t.param_names()}
    assert {op.device for op in r.ops if not op.is_source and not op.is_decoder} == {"gpu"}


def test_video_dali_graph_on_the_cpu_is_the_same_graph():
    r = offline.check(video.clip(16, 2, 224), device="cpu", batch_size=8, dali_only=True)
    assert r.problems() == []
    assert [op.schema for op in r.ops if not op.is_source] == \
        [op.schema for op in offline.check(video.clip(16, 2, 224), device="cuda").ops if not op.is_source]


@pytest.mark.parametrize("t", [audio.clip(16000, 1.0), audio.mel(80, 16000, 1.0)], ids=["clip", "mel"])
def test_audio_cuda_graph_decodes_on_the_cpu_and_computes_on_the_gpu(t):
    r = offline.check(t, device="cuda", batch_size=8)
    dec, = r.decoders
    assert (dec.schema, dec.device) == ("decoders__Audio", "cpu")  # DALI decodes audio on the CPU only
    assert [d for _, d in r.outputs] == ["gpu"]
    gpu = {op.schema for op in r.ops if op.device == "gpu"}
    if t.describe()["kind"] == "mel":
        assert {"Spectrogram", "MelFilterBank", "ToDecibels"} <= gpu

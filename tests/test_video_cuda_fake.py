"""Video and audio through the Loader's CUDA delivery, against a fake torch.cuda
(tests/fake_cuda.py): the DALI graph a GPU would run (built for the CPU by
``fake_dali_on_gpu``) delivers the clips the CPU path delivers, copied on a side stream."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("av")

from fake_cuda import fake_dali_on_gpu  # noqa: E402
from fastload import Loader, audio, video  # noqa: E402
from fastload.store import ShardWriter  # noqa: E402

from _media import make_video, tone, wav_bytes  # noqa: E402


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    path = tmp_path_factory.mktemp("media") / "ds"
    with ShardWriter(path, {"video": "video", "audio": "audio", "label": "int64"}) as w:
        for i, n in enumerate([9, 20, 33, 14, 27, 6]):
            w.write({"video": make_video(n), "audio": wav_bytes(tone(0.2 + 0.1 * i, 16000, 1, seed=i), 16000),
                     "label": i})
    return path


def test_clips_and_windows_on_cuda_equal_the_cpu_path(fake, media, monkeypatch):
    fake_dali_on_gpu(fake, monkeypatch)
    t = {"video": video.clip(4, stride=3, size=None, flip=0.5), "audio": audio.clip(16000, 0.25)}
    with Loader(media, batch_size=3, transforms=t, seed=2, device="cpu") as lo:
        ref = [{k: v.clone() for k, v in b.items()} for b in lo]
    with Loader(media, batch_size=3, transforms=t, seed=2, device="cuda:1") as lo:
        got = list(lo)
        assert fake.blocking_copies() == []
        assert fake.contexts == {1}, [(c.kind, c.thread, c.device) for c in fake.calls if c.device == 0][:5]
    assert len(got) == len(ref) == 2
    for b, r in zip(got, ref, strict=True):
        assert b["video"].is_cuda and b["audio"].is_cuda
        assert b["index"].cpu().tolist() == r["index"].tolist()
        assert torch.equal(b["video"].cpu(), r["video"])  # NVDEC's graph and PyAV: the same frames and flips
        assert torch.equal(b["audio"].cpu(), r["audio"])

"""fastload.video: clips cut by DALI, checked against PyAV's decode of the same frames (issue 29)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("av")

import fastload  # noqa: E402
from fastload import Loader, video  # noqa: E402
from fastload.errors import DecodeError  # noqa: E402
from fastload.store import ShardWriter  # noqa: E402

from _media import make_video, pyav_frames  # noqa: E402

LENGTHS = [12, 30, 5, 21, 40, 9, 17, 26]  # 5 and 9 are shorter than a 4-frame clip of stride 3


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    """Lossless VP9 (WebM) videos whose frames tell their number apart, and a dataset of them."""
    vids = [make_video(n) for n in LENGTHS]
    path = tmp_path_factory.mktemp("video") / "ds"
    with ShardWriter(path, {"video": "video", "label": "int64"}) as w:
        for i, v in enumerate(vids):
            w.write({"video": v, "label": i % 2})
    return path, vids, [pyav_frames(v) for v in vids]


def _start_of(clip0: np.ndarray, ref: np.ndarray) -> int:
    hits = [k for k in range(len(ref)) if np.array_equal(ref[k], clip0)]
    assert len(hits) == 1, hits  # every frame of the test videos is distinct
    return hits[0]


def test_clip_is_frames_stride_apart_pixel_equal_to_pyav(videos):
    path, _, ref = videos
    t = video.clip(4, stride=3, size=None, flip=0)
    assert t.describe()["kind"] == "clip"
    starts = {}
    for epoch in range(3):
        with Loader(path, batch_size=3, transforms={"video": t}, seed=7) as lo:
            lo.set_epoch(epoch)
            for b in lo:
                assert b["video"].shape[1:] == (4, 48, 64, 3) and b["video"].dtype == torch.uint8
                for i, c in zip(b["index"].tolist(), b["video"].numpy()):
                    frames = ref[i]
                    s = _start_of(c[0], frames)
                    span = 3 * 3 + 1
                    if len(frames) < span:  # too short: from frame 0, the last frame repeated
                        assert s == 0
                    else:
                        assert 0 <= s <= len(frames) - span
                    want = frames[np.minimum(s + 3 * np.arange(4), len(frames) - 1)]
                    np.testing.assert_array_equal(c, want)
                    starts.setdefault(i, set()).add(s)
    assert any(len(s) > 1 for s in starts.values())  # the start is drawn anew each epoch
    assert starts[2] == {0} and starts[5] == {0}


def test_too_short_video_repeats_its_last_frame(videos):
    path, vids, ref = videos
    with Loader(path, batch_size=8, transforms={"video": video.clip(8, stride=1, size=None, flip=0)},
                shuffle=False) as lo:
        b = next(iter(lo))
    c = b["video"][2].numpy()  # 5 frames: 0 1 2 3 4 4 4 4
    np.testing.assert_array_equal(c, ref[2][[0, 1, 2, 3, 4, 4, 4, 4]])
    d = video.decode(vids[2], start=0, frames=8)  # the DataLoader helper pads the same way
    np.testing.assert_array_equal(d.numpy(), c)


def test_same_clips_on_any_world_size_and_after_resume(videos):
    path = videos[0]
    t = video.clip(4, stride=2, size=32, crop="random", flip=0.5)
    kw = dict(seed=3)
    whole = {}
    with Loader(path, batch_size=4, transforms={"video": t}, **kw) as lo:
        lo.set_epoch(1)
        for b in lo:
            for i, c in zip(b["index"].tolist(), b["video"]):
                whole[i] = c.clone()
    assert len(whole) == len(LENGTHS)
    for rank in range(3):
        with Loader(path, batch_size=2, transforms={"video": t}, rank=rank, world_size=3, **kw) as lo:
            lo.set_epoch(1)
            for b in lo:
                for i, c in zip(b["index"].tolist(), b["video"]):
                    assert torch.equal(c, whole[i]), i
    with Loader(path, batch_size=2, transforms={"video": t}, **kw) as lo:  # stopped after 2 batches...
        lo.set_epoch(1)
        it = iter(lo)
        seen = [next(it)["index"] for _ in range(2)]
        state = lo.state_dict()
    with Loader(path, batch_size=3, transforms={"video": t}, rank=1, world_size=2, **kw) as lo:  # ...resumed
        lo.load_state_dict(state)
        rest = [(i, c.clone()) for b in lo for i, c in zip(b["index"].tolist(), b["video"])]
    assert rest and not {i for i, _ in rest} & set(torch.cat(seen).tolist())
    for i, c in rest:
        assert torch.equal(c, whole[i]), i


def test_crop_flip_normalise_and_layouts(videos):
    path, _, ref = videos
    t = video.clip(2, stride=1, size=24, crop="center", flip=1.0, dtype="float32", mean=[0.5] * 3,
                   std=[0.25] * 3, layout="CTHW")
    with Loader(path, batch_size=8, transforms={"video": t}, shuffle=False) as lo:
        b = next(iter(lo))["video"]
    assert b.shape == (8, 3, 2, 24, 24) and b.dtype == torch.float32
    u8 = video.clip(2, stride=1, size=24, crop="center", flip=1.0, layout="TCHW")
    with Loader(path, batch_size=8, transforms={"video": u8}, shuffle=False) as lo:
        raw = next(iter(lo))["video"]
    assert raw.shape == (8, 2, 3, 24, 24)
    np.testing.assert_allclose(b.numpy(), ((raw.permute(0, 2, 1, 3, 4).float() / 255 - 0.5) / 0.25).numpy(),
                               atol=1e-5)
    plain = video.clip(2, stride=1, size=24, crop="center", flip=0.0, layout="TCHW")
    with Loader(path, batch_size=8, transforms={"video": plain}, shuffle=False) as lo:
        unflipped = next(iter(lo))["video"]
    assert torch.equal(raw, unflipped.flip(-1))  # flip=1.0 mirrors every clip left to right
    assert not torch.equal(raw, unflipped)


def test_clips_evenly_spaced_for_evaluation(videos):
    path, _, ref = videos
    t = video.clips(3, 2, stride=4, size=None)
    with Loader(path, batch_size=8, transforms={"video": t}, shuffle=False) as lo:
        b = next(iter(lo))["video"]
    assert b.shape == (8, 3, 2, 48, 64, 3)
    for i in range(8):
        n = LENGTHS[i]
        last = max(n - 5, 0)
        for k, s in enumerate([0, last // 2, last]):
            want = ref[i][np.minimum([s, s + 4], n - 1)]
            np.testing.assert_array_equal(b[i, k].numpy(), want)


def test_h264_decodes_on_the_cpu_through_pyav(tmp_path):
    h264 = [make_video(n, codec="h264") for n in (14, 20)]
    path = tmp_path / "h264"
    with ShardWriter(path, {"video": "video"}) as w:
        for v in h264:
            w.write({"video": v})
    with Loader(path, batch_size=2, transforms={"video": video.clip(5, stride=2, size=None, flip=0)}, seed=4,
                shuffle=False) as lo:
        b = next(iter(lo))["video"].numpy()
    for i, v in enumerate(h264):
        ref = pyav_frames(v)
        s = _start_of(b[i, 0], ref)
        np.testing.assert_array_equal(b[i], ref[s + 2 * np.arange(5)])


def _dali_graph(path, t, idx, epoch=0, seed=0):
    """The transform's DALI graph (the GPU's) run on the CPU, for the same samples."""
    ds = fastload.Dataset(path)
    bound = t.for_dataset(ds, "video")
    r = bound.runner(device="cpu", batch_size=len(idx), seed=seed, dali_only=True)
    try:
        w, h = ds.image_sizes("video", idx)
        return r.run(ds.views("video", idx, copy=True), w, h, np.asarray(idx), epoch).clone()
    finally:
        r.close()


def test_dali_graph_and_cpu_path_deliver_the_same_clips(videos, tmp_path):
    path = videos[0]
    idx = list(range(len(LENGTHS)))
    for t, tol in ((video.clip(4, stride=3, size=None, flip=0.5), 0),
                   (video.clip(4, stride=2, size=40, crop="random", flip=0.5, dtype="float32", mean=[0.45] * 3,
                               std=[0.225] * 3, layout="CTHW"), 0.08),
                   (video.clips(2, 3, stride=2, size=32, layout="TCHW"), 2.0)):
        gpu_graph = _dali_graph(path, t, idx, epoch=1, seed=5)
        with Loader(path, batch_size=8, transforms={"video": t}, shuffle=False, seed=5) as lo:
            lo.set_epoch(1)
            cpu = next(iter(lo))["video"]
        assert gpu_graph.shape == cpu.shape and gpu_graph.dtype == cpu.dtype
        diff = (gpu_graph.float() - cpu.float()).abs()
        assert diff.mean() <= tol, (t, diff.mean())  # the same frames, crops and flips; resize filters agree
    h264 = tmp_path / "h264"
    with ShardWriter(h264, {"video": "video"}) as w:
        w.write({"video": make_video(12, codec="h264")}, key="bad.mp4")
    with pytest.raises(fastload.BadSamples, match=r"video codec 'h264' is not decoded by DALI's CPU decoder"):
        _dali_graph(h264, video.clip(2, size=None), [0])


def test_a_corrupt_video_is_named(tmp_path, videos):
    good = videos[1][1]
    path = tmp_path / "corrupt"
    with ShardWriter(path, {"video": "video"}) as w:
        w.write({"video": good}, key="a.webm")
        w.write({"video": good}, key="b.webm")
    # damage b's frames after convert (as a disk error would): same length, same probed info
    shard = next(path.glob("shard-*.arrow"))
    data = bytearray(shard.read_bytes())
    at = data.rfind(good[len(good) // 2: len(good) // 2 + 64])
    assert at > 0
    data[at: at + 1500] = b"\xff" * 1500
    shard.write_bytes(bytes(data))
    t = {"video": video.clip(4, stride=6, size=None, flip=0)}  # frames up to 18 or later: past the damage
    with pytest.raises(DecodeError, match=r"b\.webm.*damaged"):
        with Loader(path, batch_size=2, transforms=t, shuffle=False, verify="off") as lo:
            for _ in lo:
                pass


def test_arguments_are_checked(videos):
    path = videos[0]
    with pytest.raises(ValueError, match="crop="):
        video.clip(crop="middle")
    with pytest.raises(ValueError, match="dtype='uint8' delivers pixels as decoded"):
        video.clip(mean=[0.5] * 3, std=[0.2] * 3)
    with pytest.raises(ValueError, match="layout="):
        video.clip(layout="HWC")
    with pytest.raises(ValueError, match=r"video field 'video' has no transform.*fastload\.video\.clip"):
        Loader(path, batch_size=2)
    with pytest.raises(ValueError, match="is an image transform"):
        Loader(path, batch_size=2, transforms={"video": fastload.vision.train(32)})
    with pytest.raises(RuntimeError, match="inside a Loader"):
        video.clip().params(0, 0, np.arange(2), np.ones(2), np.ones(2))


def test_decode_helper_for_dataloader_code(videos):
    _, vids, ref = videos
    np.testing.assert_array_equal(video.decode(vids[1]).numpy(), ref[1])
    np.testing.assert_array_equal(video.decode(vids[1], start=3, frames=4, stride=5).numpy(), ref[1][[3, 8, 13, 18]])
    np.testing.assert_array_equal(video.decode(vids[1], start=20, stride=4).numpy(), ref[1][[20, 24, 28]])
    with pytest.raises(ValueError, match="past the video's end"):
        video.decode(vids[2], frames=8, pad=False)
    with pytest.raises(ValueError, match="does not decode"):
        video.decode(b"\x00" * 100)


@pytest.mark.parametrize("codec", ["vp9", "h264"])
def test_late_clips_seek_to_a_key_frame_and_match_a_full_decode(codec, monkeypatch):
    from fastload.video import cpu

    data = make_video(100, codec=codec, gop=10)
    ref = pyav_frames(data)
    want = np.array([61, 64, 67, 70, 99, 120])  # 120: past the end, the last frame
    seeked = cpu._decode_after_seek(__import__("av"), data, 61, 120, set(want.tolist()))
    assert seeked is not None  # an evenly timed stream: the seek path, not a decode from frame 0
    calls = []
    monkeypatch.setattr(cpu, "_decode", lambda *a: calls.append(a) or pytest.fail("decoded from the start"))
    got = cpu.decode_frames(data, want, expected=100)
    assert not calls
    np.testing.assert_array_equal(got, ref[np.minimum(want, 99)])
    monkeypatch.undo()
    np.testing.assert_array_equal(cpu.decode_frames(data, np.array([3, 40])), ref[[3, 40]])  # early: from frame 0

"""Video and audio fields in the store, and ``convert videofolder`` / ``audiofolder`` (issue 29)."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("av")

import fastload  # noqa: E402
from fastload.errors import SampleError  # noqa: E402
from fastload.store import ShardWriter  # noqa: E402

from _media import flac_bytes, make_video, pyav_frames, tone, wav_bytes  # noqa: E402


def _folder(root, files):
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return root


def test_store_records_what_was_probed(tmp_path):
    v = [make_video(10), make_video(7, 32, 24, codec="h264")]
    a = [wav_bytes(tone(0.25, 16000, 1), 16000), flac_bytes(tone(0.1, 22050, 2), 22050)]
    with ShardWriter(tmp_path / "ds", {"clip": "video", "sound": "audio", "label": "int64"}) as w:
        for i in range(2):
            w.write({"clip": v[i], "sound": a[i], "label": i})
    ds = fastload.Dataset(tmp_path / "ds")
    assert ds.fields["clip"].kind == "video" and ds.fields["sound"].kind == "audio"
    assert ds.manifest["format_version"] == 3
    info = ds.media_info("clip", [1, 0])
    assert info["frames"].tolist() == [7, 10] and info["width"].tolist() == [32, 64]
    assert info["height"].tolist() == [24, 48] and info["codec"] == ["h264", "vp9"]
    assert info["fps"].tolist() == [24.0, 24.0]
    au = ds.media_info("sound", [0, 1])
    assert au["sample_rate"].tolist() == [16000, 22050] and au["channels"].tolist() == [1, 2]
    assert au["length"].tolist() == [4000, 2205] and au["codec"] == ["pcm_s16le", "flac"]
    assert ds[0]["clip"] == v[0]  # the file, byte for byte
    assert fastload.verify(tmp_path / "ds") == []  # no problem found (a list of problems)
    with pytest.raises(TypeError, match="not a video or audio field"):
        ds.media_info("label", [0])


def test_writer_refuses_an_undecodable_video_naming_the_sample(tmp_path):
    with ShardWriter(tmp_path / "ds", {"clip": "video"}) as w:
        with pytest.raises(SampleError, match=r"field 'clip' of sample 'broken'.*not a decodable video"):
            w.write({"clip": b"\x00" * 500}, key="broken")
        with pytest.raises(SampleError, match="lacks"):
            w.write({"clip": make_video(3)}, key="k", media_info={"clip": {"frames": 3}})
        given = {"width": 32, "height": 24, "frames": 3, "fps": 24.0, "codec": "vp9"}
        for k, bad in (("frames", 2.5), ("width", 32.0), ("fps", float("inf")), ("height", True)):
            with pytest.raises(SampleError, match=rf"media_info\['clip'\]\['{k}'\] of sample 'k'"):
                w.write({"clip": make_video(3)}, key="k", media_info={"clip": {**given, k: bad}})
        w.write({"clip": make_video(3)}, key="ok")
    assert len(fastload.Dataset(tmp_path / "ds")) == 1


def test_convert_videofolder_probes_skips_and_transcodes(tmp_path):
    src = _folder(tmp_path / "src", {
        "cat/a.webm": make_video(20), "cat/b.mp4": make_video(12, codec="h264"),
        "dog/c.mkv": make_video(30, codec="mjpeg"), "dog/bad.mp4": b"\x00\x01" * 999, "dog/notes.txt": b"x"})
    with pytest.raises(fastload.ConvertError, match=r"dog/bad\.mp4: not a media file"):
        fastload.convert("videofolder", src, tmp_path / "out0", progress=False, workers=0)
    r = fastload.convert("videofolder", src, tmp_path / "out", progress=False, on_error="skip", workers=2,
                         min_frames=15, video_codec="vp9")
    assert r["num_samples"] == 2 and r["skipped"] == 2
    report = [json.loads(line) for line in open(r["report"])]
    assert [x["key"] for x in report] == ["cat/b.mp4", "dog/bad.mp4"]
    assert "shorter than --min-frames 15" in report[0]["reason"]
    ds = fastload.Dataset(tmp_path / "out")
    assert ds.keys([0, 1]) == ["cat/a.webm", "dog/c.mkv"] and ds.class_names == ["cat", "dog"]
    assert ds.media_info("video", [0, 1])["frames"].tolist() == [20, 30]
    assert ds.manifest["metadata"]["ignored_files"] == 1 and ds.manifest["metadata"]["min_frames"] == 15
    # --video-codec vp9: the H.264 video is re-encoded as VP9 with every frame, the others kept
    r = fastload.convert("videofolder", src, tmp_path / "vp9", progress=False, on_error="skip", workers=0,
                         video_codec="vp9")
    ds = fastload.Dataset(tmp_path / "vp9")
    assert r["transcoded_videos"] == 1
    assert ds.keys(range(3)) == ["cat/a.webm", "cat/b.mp4", "dog/c.mkv"]
    assert ds.media_info("video", range(3))["codec"] == ["vp9", "vp9", "mjpeg"]
    assert ds[2]["video"] == (src / "dog/c.mkv").read_bytes()
    orig, new = pyav_frames((src / "cat/b.mp4").read_bytes()), pyav_frames(ds[1]["video"])
    assert new.shape == orig.shape
    assert np.abs(new.astype(int) - orig.astype(int)).mean() < 6  # lossy, but the same pictures


def test_convert_options_belong_to_their_kind(tmp_path):
    src = _folder(tmp_path / "src", {"a/x.wav": wav_bytes(tone(0.1), 16000)})
    with pytest.raises(fastload.ConvertError, match="--min-frames does not apply to audiofolder"):
        fastload.convert("audiofolder", src, tmp_path / "o", min_frames=3, progress=False)
    with pytest.raises(fastload.ConvertError, match="--max-size does not apply to videofolder"):
        fastload.convert("videofolder", src, tmp_path / "o", max_size=64, progress=False)
    with pytest.raises(fastload.ConvertError, match="no video files"):
        fastload.convert("videofolder", src, tmp_path / "o", progress=False)


def _mp3() -> bytes:
    import io

    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp3") as c:
        s = c.add_stream("libmp3lame", rate=16000, layout="mono")
        f = av.AudioFrame.from_ndarray(tone(0.2, 16000, 1).reshape(1, -1), format="s16", layout="mono")
        f.sample_rate = 16000
        for fr in av.AudioResampler(format="s16p", layout="mono", rate=16000).resample(f):
            for pk in s.encode(fr):
                c.mux(pk)
        for pk in s.encode():
            c.mux(pk)
    return buf.getvalue()


def test_convert_audiofolder_cli(tmp_path):
    src = _folder(tmp_path / "src", {"speech/a.wav": wav_bytes(tone(0.3, 16000, 1), 16000),
                                     "music/b.flac": flac_bytes(tone(0.2, 44100, 2), 44100),
                                     "music/c.ogg": b"OggS" + b"\x00" * 100, "music/d.mp3": _mp3()})
    p = subprocess.run([sys.executable, "-m", "fastload", "convert", "audiofolder", str(src), str(tmp_path / "out"),
                        "-q", "--on-error", "skip"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "skipped 2 sample" in p.stdout + p.stderr
    report = (tmp_path / "out" / "skipped.jsonl").read_text()
    assert "music/d.mp3" in report and "re-encode it, e.g. as FLAC" in report  # DALI 2.4 fails on MP3
    ds = fastload.Dataset(tmp_path / "out")
    assert ds.class_names == ["music", "speech"] and ds.keys([0, 1]) == ["music/b.flac", "speech/a.wav"]
    info = ds.media_info("audio", [0, 1])
    assert info["sample_rate"].tolist() == [44100, 16000] and info["length"].tolist() == [8820, 4800]


@pytest.mark.slow
@pytest.mark.allow_thread_leak  # Ray's client threads outlive ray.shutdown()
def test_convert_videofolder_with_ray_matches_local(tmp_path):
    pytest.importorskip("ray")
    src = _folder(tmp_path / "src", {f"c{i % 2}/v{i}.webm": make_video(5 + i) for i in range(4)})
    local = fastload.convert("videofolder", src, tmp_path / "local", progress=False, workers=0)
    ray = fastload.convert("videofolder", src, tmp_path / "ray", progress=False, engine="ray", workers=2)
    a, b = fastload.Dataset(tmp_path / "local"), fastload.Dataset(tmp_path / "ray")
    assert local["num_samples"] == ray["num_samples"] == 4
    assert a.keys(range(4)) == b.keys(range(4))
    assert a.media_info("video", range(4))["frames"].tolist() == b.media_info("video", range(4))["frames"].tolist()


@pytest.mark.parametrize("engine", ["local", pytest.param("ray", marks=[pytest.mark.slow, pytest.mark.allow_thread_leak])])
def test_convert_table_with_video_and_audio_path_columns(tmp_path, engine):
    if engine == "ray":
        pytest.importorskip("ray")
    import pyarrow as pa
    import pyarrow.parquet as pq

    _folder(tmp_path / "src", {"v/a.webm": make_video(6), "v/b.mp4": make_video(9, codec="h264"),
                               "s/a.wav": wav_bytes(tone(0.1), 16000), "s/b.flac": flac_bytes(tone(0.2), 16000)})
    pq.write_table(pa.table({"clip": ["v/a.webm", "v/b.mp4"], "sound": ["s/a.wav", "s/b.flac"],
                             "label": ["x", "y"]}), tmp_path / "src" / "t.parquet")
    r = fastload.convert("table", tmp_path / "src" / "t.parquet", tmp_path / "out", progress=False, engine=engine,
                         workers=1)
    assert r["num_samples"] == 2
    ds = fastload.Dataset(tmp_path / "out")
    assert ds.fields["clip"].kind == "video" and ds.fields["sound"].kind == "audio"
    assert ds.media_info("clip", [0, 1])["frames"].tolist() == [6, 9]
    assert ds.media_info("sound", [0, 1])["length"].tolist() == [1600, 3200]
    assert ds[1]["clip"] == (tmp_path / "src" / "v/b.mp4").read_bytes() and ds.class_names == ["x", "y"]
    (tmp_path / "src" / "v/b.mp4").write_bytes(b"\x00" * 64)  # a broken file is named
    with pytest.raises(fastload.ConvertError, match=r"field 'clip': not a media file"):
        fastload.convert("table", tmp_path / "src" / "t.parquet", tmp_path / "out2", progress=False, workers=0)


def test_a_planned_videofolder_notices_files_added_before_a_resume(tmp_path):
    from fastload.convert.plan import make_plan, source_changes
    from fastload.convert.task import open_group

    src = _folder(tmp_path / "src", {f"c{i % 2}/v{i}.webm": make_video(4 + i) for i in range(3)})
    plan = make_plan("videofolder", src, tmp_path / "dst", shard_size=10**6, overwrite=False, resume=False,
                     source_options={"min_frames": 5})
    assert plan.options["min_frames"] == 5 and source_changes(plan) == ""
    g = open_group(plan, 0)  # a task reads its rows of the plan's listing, with the plan's options
    assert [g.key(i) for i in range(g.num_samples)] == ["c0/v0.webm", "c0/v2.webm", "c1/v1.webm"][:g.num_samples]
    assert g.min_frames == 5
    (src / "c1" / "v9.webm").write_bytes(make_video(4))
    assert "v9.webm" in source_changes(plan)

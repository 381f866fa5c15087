"""fastload.audio: windows and log-mel spectrograms by DALI, against numpy references (issue 29)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("av")

from fastload import Loader, audio  # noqa: E402
from fastload.store import ShardWriter  # noqa: E402

from _media import flac_bytes, tone, wav_bytes  # noqa: E402

SECONDS = [0.3, 0.7, 1.1, 1.5, 2.6, 0.9]


@pytest.fixture(scope="module")
def sounds(tmp_path_factory):
    pcms = [tone(s, 16000, 2, seed=i) for i, s in enumerate(SECONDS)]
    path = tmp_path_factory.mktemp("audio") / "ds"
    with ShardWriter(path, {"audio": "audio"}) as w:
        for i, p in enumerate(pcms):
            w.write({"audio": wav_bytes(p, 16000) if i % 2 else flac_bytes(p, 16000)}, key=f"s{i}")
    return path, pcms


def _batch(path, t, **kw):
    out = {}
    with Loader(path, batch_size=4, transforms={"audio": t}, **kw) as lo:
        for b in lo:
            for i, x in zip(b["index"].tolist(), b["audio"]):
                out[i] = x.clone()
    return out


def test_windows_are_the_files_samples_zero_padded(sounds):
    path, pcms = sounds
    got = _batch(path, audio.clip(16000, 1.0), seed=2)
    for i, p in enumerate(pcms):
        x = p.astype(np.float64).mean(1) / 32768  # mono: the channels averaged
        c = got[i].numpy()
        assert c.shape == (16000,) and c.dtype == np.float32
        if len(x) <= 16000:
            np.testing.assert_allclose(c[:len(x)], x, atol=1e-4)
            assert not c[len(x):].any()
        else:
            err = [np.abs(x[s:s + 16000] - c).max() for s in range(len(x) - 16000 + 1)]
            assert min(err) < 1e-4
    lead = _batch(path, audio.clip(16000, 1.0, random=False))
    for i, p in enumerate(pcms):
        x = p.astype(np.float64).mean(1)[:16000] / 32768
        np.testing.assert_allclose(lead[i].numpy()[:len(x)], x, atol=1e-4)


def test_stereo_keeps_channels(sounds):
    path, pcms = sounds
    got = _batch(path, audio.clip(16000, 0.25, mono=False, random=False))
    for i, p in enumerate(pcms):
        assert got[i].shape == (2, 4000)
        np.testing.assert_allclose(got[i].numpy(), p[:4000].T / 32768, atol=1e-4)
    x = audio.decode(wav_bytes(pcms[1], 16000))  # the DataLoader helper: the same samples
    np.testing.assert_allclose(x.numpy(), pcms[1].T / 32768, atol=1e-4)


def test_windows_are_a_function_of_the_sample_not_the_rank(sounds):
    path, _ = sounds
    t = audio.clip(16000, 0.5)
    whole = _batch(path, t, seed=9)
    for rank in range(2):
        part = _batch(path, t, seed=9, rank=rank, world_size=2)
        for i, x in part.items():
            assert torch.equal(x, whole[i])
    other = _batch(path, t, seed=10)
    assert any(not torch.equal(other[i], whole[i]) for i in whole if SECONDS[i] > 0.6)


def test_resampling_matches_the_analytic_signal(tmp_path):
    t = np.arange(22050) / 22050
    sig = 0.5 * np.sin(2 * np.pi * 440 * t) + 0.3 * np.sin(2 * np.pi * 1000 * t)
    with ShardWriter(tmp_path / "ds", {"audio": "audio"}) as w:
        w.write({"audio": wav_bytes((sig * 32767).round().astype(np.int16)[:, None], 22050)})
    got = _batch(tmp_path / "ds", audio.clip(16000, 1.0, random=False))[0].numpy()
    tt = np.arange(16000) / 16000
    ref = 0.5 * np.sin(2 * np.pi * 440 * tt) + 0.3 * np.sin(2 * np.pi * 1000 * tt)
    assert np.abs(got - ref)[200:-200].max() < 2e-4  # (the first and last ms: the filter's edges)
    y = audio.decode(wav_bytes((sig * 32767).round().astype(np.int16)[:, None], 22050), sample_rate=16000,
                     mono=True).numpy()
    assert abs(len(y) - 16000) <= 32 and np.abs(y[200:15000] - ref[200:15000]).max() < 1e-2  # FFmpeg's resampler


def _mel_reference(x: np.ndarray, sr: int, n_fft: int, hop: int, n_mels: int) -> np.ndarray:
    """Log-mel in numpy: centred (reflect-padded) frames, periodic Hann window, |rfft|^2, Slaney
    mel filters normalised by their width (librosa's defaults), 10 log10, floor -100 dB."""
    xp = np.pad(x.astype(np.float64), n_fft // 2, mode="reflect")
    frames = 1 + (len(xp) - n_fft) // hop
    win = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n_fft) / n_fft)
    power = np.abs(np.fft.rfft(np.stack([xp[k * hop:k * hop + n_fft] * win for k in range(frames)]), axis=1)) ** 2

    def hz_to_mel(f):
        f = np.asarray(f, float)
        return np.where(f >= 1000, 15 + np.log(np.maximum(f, 1e-10) / 1000) / (np.log(6.4) / 27), f * 3 / 200)

    def mel_to_hz(m):
        m = np.asarray(m, float)
        return np.where(m >= 15, 1000 * np.exp(np.log(6.4) / 27 * (m - 15)), m * 200 / 3)

    pts = mel_to_hz(np.linspace(hz_to_mel(0), hz_to_mel(sr / 2), n_mels + 2))
    f = np.arange(n_fft // 2 + 1) * sr / n_fft
    bank = np.stack([np.maximum(0, np.minimum((f - lo) / (c - lo), (hi - f) / (hi - c))) * 2 / (hi - lo)
                     for lo, c, hi in zip(pts, pts[1:], pts[2:])])
    return 10 * np.log10(np.maximum(bank @ power.T, 1e-10))


def test_log_mel_matches_a_numpy_reference(sounds):
    path, pcms = sounds
    t = audio.mel(40, 16000, 1.0, n_fft=400, hop=160, random=False)
    assert t.out_shape == (40, 101)
    got = _batch(path, t)
    for i, p in enumerate(pcms):
        x = np.zeros(16000)
        m = p.astype(np.float64).mean(1)[:16000] / 32768
        x[:len(m)] = m
        ref = _mel_reference(x, 16000, 400, 160, 40)
        g = got[i].numpy()
        assert g.shape == ref.shape
        loud = ref > -60  # where the signal is (zero padding sits at the floor on both sides)
        assert np.abs(g - ref)[loud].max() < 0.05, i  # decibels


def test_arguments_are_checked(sounds):
    path, _ = sounds
    with pytest.raises(ValueError, match="seconds="):
        audio.clip(16000, 0)
    with pytest.raises(ValueError, match="n_fft"):
        audio.mel(n_fft=401)
    with pytest.raises(ValueError, match="f_max"):
        audio.mel(sample_rate=16000, f_max=9000)
    with pytest.raises(ValueError, match=r"audio field 'audio' has no transform.*fastload\.audio\.clip"):
        Loader(path, batch_size=2)
    from fastload import video

    with pytest.raises(ValueError, match="is for video fields"):
        Loader(path, batch_size=2, transforms={"audio": video.clip()})
    assert "fastload.audio.mel(" in repr(audio.mel())


def test_a_damaged_audio_file_is_named(tmp_path):
    from fastload.errors import DecodeError

    good = flac_bytes(tone(1.0, 16000, 1), 16000)
    with ShardWriter(tmp_path / "ds", {"audio": "audio"}) as w:
        w.write({"audio": wav_bytes(tone(0.5, 16000, 1), 16000)}, key="fine.wav")
        w.write({"audio": good}, key="broken.flac")
    shard = next((tmp_path / "ds").glob("shard-*.arrow"))
    data = bytearray(shard.read_bytes())
    at = data.rfind(good[:64])
    assert at > 0
    data[at:at + 64] = b"\x00" * 64  # the FLAC header gone, as a disk error would take it
    shard.write_bytes(bytes(data))
    with pytest.raises(DecodeError, match=r"broken\.flac"):
        with Loader(tmp_path / "ds", batch_size=2, shuffle=False, verify="off",
                    transforms={"audio": audio.clip(16000, 0.5)}) as lo:
            for _ in lo:
                pass
    with Loader(tmp_path / "ds", batch_size=2, shuffle=False, verify="off", on_error="skip",
                transforms={"audio": audio.clip(16000, 0.5, random=False)}) as lo:
        b = next(iter(lo))
    assert b["index"].tolist() == [0, 0]  # replaced by a decodable sample

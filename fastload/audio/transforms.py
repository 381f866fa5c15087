"""``clip`` and ``mel``: DALI graphs from an audio file's bytes to fixed-length windows.

The graph: ``fn.decoders.audio`` (float32 in [-1, 1), resampled to ``sample_rate`` by DALI's
windowed-sinc resampler, channels averaged with ``mono``) → ``fn.slice`` (a window of
``seconds * sample_rate`` samples from a start drawn per (seed, epoch, global index), or from
the first sample; past the end, zeros) → for ``mel``: ``fn.spectrogram`` (periodic Hann
window, centred frames, power 2) → ``fn.mel_filter_bank`` (Slaney mel scale, area-normalised)
→ ``fn.to_decibels`` (``10 * log10(max(x, 1e-10))``). DALI decodes audio on the CPU only; on
a GPU the window is moved to the device and the spectrogram and mel filter bank run there.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..pipeline.crops import uniforms
from ..pipeline.media import MediaTransform
from ..validate import check_bool, check_int

_STREAM = 0xA0D10  # the uniforms' stream of audio windows
LOG_FLOOR_DB = -100.0  # mel's decibels: 10 * log10(max(power, 1e-10))


def hann(n: int) -> np.ndarray:
    """The periodic Hann window of ``n`` samples (torch.hann_window's default)."""
    return (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n) / n)).astype(np.float32)


class Clip(MediaTransform):
    """A window of ``seconds`` at ``sample_rate`` per sample: float32 ``(samples,)`` with
    ``mono`` (the channels averaged), else ``(channels, samples)`` (one channel count in the
    dataset). ``random=False`` takes each file's first samples (evaluation)."""

    field_kind = "audio"
    max_pixels = 2**62  # (the runner's size check: an audio field's sizes are its length and channels)

    def __init__(self, sample_rate: int = 16000, seconds: float = 1.0, *, mono: bool = True, random: bool = True):
        self.sample_rate = check_int("sample_rate", sample_rate, min=1)
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) \
                or seconds <= 0:
            raise ValueError(f"seconds={seconds!r} must be a positive number")
        self.seconds = float(seconds)
        self.samples = int(round(self.seconds * self.sample_rate))
        if self.samples < 1:
            raise ValueError(f"seconds={seconds!r} at sample_rate={sample_rate} is no sample")
        self.mono = check_bool("mono", mono)
        self.random = check_bool("random", random)
        self.channels = 1
        self.out_dtype = "float32"
        self._set_shape()

    def _set_shape(self) -> None:
        self.out_shape = (self.samples,) if self.mono else (self.channels, self.samples)

    def _bound(self, ds, name: str) -> None:
        if self.mono or len(ds) == 0:
            return
        ch = ds.media_info(name, np.arange(len(ds)), ["channels"])["channels"]
        odd = np.flatnonzero(ch != ch[0])
        if len(odd):
            i = int(odd[0])
            raise ValueError(f"transforms[{name!r}]: mono=False keeps the channels, so every file must have as "
                             f"many; {ds.describe(0)} has {ch[0]}, {ds.describe(i)} has {ch[i]}: pass mono=True")
        self.channels = int(ch[0])
        self._set_shape()

    def describe(self) -> dict:
        return {"kind": "clip", "sample_rate": self.sample_rate, "seconds": self.seconds, "mono": self.mono,
                "random": self.random}

    def param_names(self, decoded_only: bool = False) -> dict[str, Any]:
        return {"start": np.int32}

    def params(self, seed, epoch, index, width, height):
        index = np.asarray(index)
        if not self.random:
            return {"start": np.zeros((len(index), 1), np.int32)}
        info = self.info(index, ["length", "sample_rate"])
        resampled = info["length"].astype(np.int64) * self.sample_rate // np.maximum(info["sample_rate"], 1)
        room = np.maximum(resampled - self.samples + 1, 1)
        u = uniforms(seed, epoch, index, 1, stream=_STREAM)[:, 0]
        start = np.minimum(np.floor(u * room).astype(np.int64), room - 1)
        return {"start": start.astype(np.int32).reshape(-1, 1)}

    def _window(self, encoded, params):
        from nvidia.dali import fn, types

        audio, _ = fn.decoders.audio(encoded, dtype=types.FLOAT, downmix=self.mono, sample_rate=self.sample_rate)
        return fn.slice(audio, params["start"], [self.samples], axes=[0], out_of_bounds_policy="pad", fill_values=0.0)

    def graph(self, encoded, params, *, decode_device, device, decoded_only=False):
        from nvidia.dali import fn

        x = self._window(encoded, params)  # DALI decodes audio on the CPU only
        if not self.mono:
            x = fn.transpose(x, perm=[1, 0])
        return x.gpu() if device == "gpu" else x


class Mel(Clip):
    """:class:`Clip` (mono), then a log-mel spectrogram ``(n_mels, 1 + samples // hop)`` in
    decibels, computed on the device (see the module docstring)."""

    def __init__(self, n_mels: int = 80, sample_rate: int = 16000, seconds: float = 1.0, *, n_fft: int = 400,
                 hop: int = 160, f_min: float = 0.0, f_max: float | None = None, random: bool = True):
        super().__init__(sample_rate, seconds, mono=True, random=random)
        self.n_mels = check_int("n_mels", n_mels, min=1)
        self.n_fft = check_int("n_fft", n_fft, min=2)
        if self.n_fft % 2:
            raise ValueError(f"n_fft={n_fft} must be even")
        self.hop = check_int("hop", hop, min=1)
        self.f_min = float(f_min)
        self.f_max = float(sample_rate / 2 if f_max is None else f_max)
        if not 0 <= self.f_min < self.f_max <= sample_rate / 2:
            raise ValueError(f"need 0 <= f_min < f_max <= sample_rate / 2, got f_min={f_min}, f_max={f_max}")
        self.out_shape = (self.n_mels, 1 + self.samples // self.hop)

    def describe(self) -> dict:
        d = super().describe()
        d.pop("mono")
        return {**d, "kind": "mel", "n_mels": self.n_mels, "n_fft": self.n_fft, "hop": self.hop, "f_min": self.f_min,
                "f_max": self.f_max}

    def graph(self, encoded, params, *, decode_device, device, decoded_only=False):
        from nvidia.dali import fn

        x = self._window(encoded, params)
        if device == "gpu":
            x = x.gpu()
        s = fn.spectrogram(x, device=device, nfft=self.n_fft, window_length=self.n_fft, window_step=self.hop,
                           window_fn=hann(self.n_fft).tolist(), center_windows=True, power=2)
        m = fn.mel_filter_bank(s, device=device, sample_rate=float(self.sample_rate), nfilter=self.n_mels,
                               freq_low=self.f_min, freq_high=self.f_max)
        return fn.to_decibels(m, device=device, multiplier=10.0, reference=1.0, cutoff_db=LOG_FLOOR_DB)


def clip(sample_rate: int = 16000, seconds: float = 1.0, **kw) -> Clip:
    """A window of ``seconds`` resampled to ``sample_rate``: float32 ``(samples,)`` with
    ``mono=True`` (channels averaged), else ``(channels, samples)``; from a start drawn per
    (seed, epoch, index), or the first sample with ``random=False``; zeros past the end."""
    return Clip(sample_rate, seconds, **kw)


def mel(n_mels: int = 80, sample_rate: int = 16000, seconds: float = 1.0, **kw) -> Mel:
    """:func:`clip` (mono), then a log-mel spectrogram ``(n_mels, 1 + samples // hop)`` in
    decibels on the device: periodic Hann window of ``n_fft`` (default 400), ``hop`` (160),
    Slaney mel filters from ``f_min`` to ``f_max``, ``10 * log10(max(power, 1e-10))``."""
    return Mel(n_mels, sample_rate, seconds, **kw)

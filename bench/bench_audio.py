"""Audio windows and log-mels: fastload (DALI's audio decoder) against a DataLoader decoding with
PyAV, in one run.

    .venv/bin/python bench/bench_audio.py                  # 400 files of 2-6 s, 44.1 kHz stereo FLAC
    .venv/bin/python bench/bench_audio.py --smoke          # 32 files (seconds)
    .venv/bin/python bench/bench_audio.py --device cuda    # fastload's spectrogram and mel on the GPU

The data: generated 44.1 kHz stereo FLAC files (chirps and noise) of 2 to 6 seconds, one
fastload dataset of an ``audio`` field. The workload: a random 1 s window resampled to 16 kHz,
mono, float32 (B, 16000), batch 32, one epoch per row; then the same with an 80-band log-mel
spectrogram (n_fft 400, hop 160: (B, 80, 101)). Rows:

  * fastload Loader, ``fastload.audio.clip(16000, 1.0)`` / ``fastload.audio.mel(80, 16000, 1.0)``;
  * torch DataLoader, ``num_workers=2``, a map-style dataset decoding with PyAV (FFmpeg's
    resampler to 16 kHz mono), cutting the window in numpy; for the mel row, ``torch.stft``
    and the same mel filter bank in the workers (the usual torchaudio-style recipe).

Figures are samples/s of the second of two epochs (pipelines built, workers started),
one run per row (``--repeats`` for more, median shown), and each
fastload row's ratio to the DataLoader doing the same work.
"""
from __future__ import annotations

import argparse
import io
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

RATE, SECONDS, BATCH, N_MELS, N_FFT, HOP = 16000, 1.0, 32, 80, 400, 160


def make_flac(i: int, seconds: float, rate: int = 44100) -> bytes:
    import av

    rng = np.random.default_rng(i)
    t = np.arange(int(seconds * rate)) / rate
    x = np.stack([0.4 * np.sin(2 * np.pi * (100 + 50 * c + rng.uniform(100, 800) * t) * t) for c in range(2)], 1)
    pcm = (np.clip(x + 0.02 * rng.standard_normal(x.shape), -1, 1) * 32000).astype(np.int16)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="flac") as c:
        s = c.add_stream("flac", rate=rate, layout="stereo")
        f = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="stereo")
        f.sample_rate = rate
        for p in [*s.encode(f), *s.encode()]:
            c.mux(p)
    return buf.getvalue()


def mel_bank() -> torch.Tensor:
    """The Slaney mel filter bank fastload.audio.mel uses (area-normalised triangles)."""
    def hz_to_mel(f):
        f = np.asarray(f, float)
        return np.where(f >= 1000, 15 + np.log(np.maximum(f, 1e-10) / 1000) / (np.log(6.4) / 27), f * 3 / 200)

    def mel_to_hz(m):
        m = np.asarray(m, float)
        return np.where(m >= 15, 1000 * np.exp(np.log(6.4) / 27 * (m - 15)), m * 200 / 3)

    pts = mel_to_hz(np.linspace(0, hz_to_mel(RATE / 2), N_MELS + 2))
    f = np.arange(N_FFT // 2 + 1) * RATE / N_FFT
    bank = np.stack([np.maximum(0, np.minimum((f - lo) / (c - lo), (hi - f) / (hi - c))) * 2 / (hi - lo)
                     for lo, c, hi in zip(pts, pts[1:], pts[2:])])
    return torch.from_numpy(bank.astype(np.float32))


class PyAVWindows(torch.utils.data.Dataset):
    """The usual map-style dataset: decode, resample, cut a random window (and a log-mel)."""

    def __init__(self, files: list[bytes], mel: bool):
        self.files, self.mel = files, mel
        self.bank, self.window = mel_bank(), torch.hann_window(N_FFT)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> torch.Tensor:
        from fastload.audio import decode

        x = decode(self.files[i], sample_rate=RATE, mono=True)
        n = int(RATE * SECONDS)
        start = int(np.random.default_rng(i).integers(0, max(1, len(x) - n + 1)))
        w = torch.zeros(n)
        w[:max(0, min(n, len(x) - start))] = x[start:start + n]
        if not self.mel:
            return w
        spec = torch.stft(w, N_FFT, HOP, window=self.window, center=True, pad_mode="reflect",
                          return_complex=True).abs() ** 2
        return 10 * torch.log10(torch.clamp(self.bank @ spec, min=1e-10))


def time_fastload(path: str, t, device: str) -> float:
    import fastload

    from fastload.bench.runs import second_epoch_rate

    with fastload.Loader(path, batch_size=BATCH, device=device, transforms={"audio": t}) as lo:
        return second_epoch_rate(lo, "audio")  # the second epoch: the pipelines built and warm


def time_dataloader(files: list[bytes], mel: bool) -> float:
    dl = torch.utils.data.DataLoader(PyAVWindows(files, mel), batch_size=BATCH, shuffle=True, num_workers=2,
                                     persistent_workers=True)
    for _ in range(2):  # the second epoch is timed: the workers are up
        t0 = time.perf_counter()
        n = sum(len(b) for b in dl)
    return n / (time.perf_counter() - t0)


def main(argv=None) -> int:
    import fastload
    from fastload.bench.headlines import headline
    from fastload.store import ShardWriter

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=400)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--smoke", action="store_true", help="32 files")
    a = p.parse_args(argv)
    from fastload.bench.machine import equal_priority

    equal_priority()  # the rows compared run at one priority (FASTLOAD_NICE=0 unless set)
    if a.smoke:
        a.files = 32
    tmp = tempfile.mkdtemp(prefix="bench-audio-")
    try:
        t0 = time.perf_counter()
        files = [make_flac(i, 2 + 4 * (i % 5) / 4) for i in range(a.files)]
        with ShardWriter(f"{tmp}/ds", {"audio": "audio"}) as w:
            for f in files:
                w.write({"audio": f})
        print(f"# {a.files} FLAC files, 44.1 kHz stereo, 2-6 s ({sum(map(len, files)) / 1e6:.1f} MB), made in "
              f"{time.perf_counter() - t0:.0f} s; a 1 s window at 16 kHz mono, batch {BATCH}", flush=True)
        runs = {
            ("window", "fastload"): lambda: time_fastload(f"{tmp}/ds", fastload.audio.clip(RATE, SECONDS), a.device),
            ("window", "DataLoader + PyAV (2 workers)"): lambda: time_dataloader(files, False),
            ("log-mel", "fastload"): lambda: time_fastload(f"{tmp}/ds", fastload.audio.mel(N_MELS, RATE, SECONDS),
                                                           a.device),
            ("log-mel", "DataLoader + PyAV + torch.stft (2 workers)"): lambda: time_dataloader(files, True),
        }
        rows = {}
        for key, fn in runs.items():
            rows[key] = float(np.median([fn() for _ in range(a.repeats)]))
            print(f"  {key[0]:8s} {key[1]:45s} {rows[key]:9.1f} samples/s", flush=True)
        print(f"\n## audio ({a.device}), samples/s (ratio to the DataLoader doing the same work)")
        for what in ("window", "log-mel"):
            base = [v for (w, name), v in rows.items() if w == what and name != "fastload"][0]
            for (w, name), v in rows.items():
                if w == what:
                    print(f"| {what} | {name} | {v:.1f} | {v / base:.2f}x |")
        base = rows[("log-mel", "DataLoader + PyAV + torch.stft (2 workers)")]
        headline("audio log-mel (1 s, 16 kHz, 80 bands)", script="bench_audio.py", unit="samples/s",
                 ours=(f"fastload {a.device}", rows[("log-mel", "fastload")]),
                 baseline=("DataLoader + PyAV + torch.stft, 2 workers", base), smoke=a.smoke)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Audio for ``Loader(transforms={"audio": ...})``, decoded by NVIDIA DALI.

    fastload.audio.clip(16000, 1.0)                  a random 1 s window per sample, float32 (B, 16000)
    fastload.audio.clip(16000, 2.0, random=False)    the first 2 s (evaluation)
    fastload.audio.clip(44100, 1.0, mono=False)      (B, channels, 44100), one channel count in the dataset
    fastload.audio.mel(80, 16000, 1.0)               log-mel (B, 80, 101), in decibels, on the device
    fastload.audio.decode(ds[i]["audio"])            one file -> float32 tensor (channels, samples), for DataLoader code

Samples are floats in [-1, 1) (16-bit PCM divided by 32768), resampled to ``sample_rate``;
a file shorter than the window is padded with zeros. The window's start is drawn per (seed,
epoch, global index), so resumed and re-sharded runs see the same windows.
See :mod:`fastload.audio.transforms` for the graph.
"""
from __future__ import annotations

from .decode import decode
from .transforms import Clip, Mel, clip, hann, mel

__all__ = ["Clip", "Mel", "clip", "decode", "hann", "mel"]

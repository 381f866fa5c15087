"""Video clips for ``Loader(transforms={"video": ...})``, decoded by NVIDIA DALI.

    fastload.video.clip(16, stride=2, size=224)         one random clip per sample, uint8 (B, T, H, W, C)
    fastload.video.clip(16, size=None, flip=0)          frames as decoded (one frame size in the dataset)
    fastload.video.clip(16, size=112, crop="center", dtype="float32", mean=..., std=..., layout="CTHW")
    fastload.video.clips(4, frames=16, size=224)        4 evenly spaced clips per video: (B, 4, T, ...)
    fastload.video.decode(ds[i]["video"])               one video -> uint8 tensor (T, H, W, C), for DataLoader code

A clip is ``frames`` frames ``stride`` apart. Its start is drawn per (seed, epoch, global
index), so a resumed run, on any number of ranks, cuts the same clips. A video shorter than
``(frames - 1) * stride + 1`` frames starts at frame 0 and is padded by repeating its last
frame (``fastload convert videofolder --min-frames N`` refuses such videos instead).

Devices: on a GPU the clip is decoded by DALI's ``mixed`` decoder (NVDEC: H.264, HEVC, VP8,
VP9, AV1, MPEG-4, MJPEG) and resized, cropped, flipped and normalised on the GPU. On the CPU,
PyAV (FFmpeg, any codec) decodes in native threads and torch finishes each clip straight into
the batch (:mod:`fastload.video.cpu`): chosen by measurement (docs/how-to/video-audio.md), as
DALI's CPU video decoder was 3-4x slower than PyAV on VP9 here and cannot read H.264, HEVC,
MPEG-4 or AV1. ``runner(..., dali_only=True)`` runs the DALI graph on the CPU (VP8, VP9 and
MJPEG only; ``fastload convert videofolder --video-codec vp9`` re-encodes the others).
"""
from __future__ import annotations

from .decode import decode
from .transforms import Clip, Clips, clip, clips

__all__ = ["Clip", "Clips", "clip", "clips", "decode"]

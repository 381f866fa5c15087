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
DALI's decoder reads VP8, VP9 and MJPEG only: a sample in another codec is refused, naming it
(replaced with ``on_error="skip"``). The answer for CPU training on H.264 datasets is to
re-encode once, at convert time: ``fastload convert videofolder SRC DST --video-codec vp9``.
Measured on 2 cores (docs/how-to/video-audio.md): decoding sets the pace on the CPU whatever
reads the clip (a DataLoader with PyAV at 2 workers: 93 clips/s on H.264, 100 on VP9; DALI's
CPU decoder on VP9: 103), so a PyAV path inside the Loader would win nothing over the
re-encoded VP9, while keeping one DALI graph for both devices.
"""
from __future__ import annotations

from .decode import decode
from .transforms import Clip, Clips, clip, clips

__all__ = ["Clip", "Clips", "clip", "clips", "decode"]

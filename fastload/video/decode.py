"""``fastload.video.decode``: one video's frames with PyAV, for DataLoader code."""
from __future__ import annotations

import io
from typing import Any

import numpy as np

from ..store.media import import_av
from ..validate import check_bool, check_int
from .cpu import decode_frames


def decode(data: Any, *, start: int = 0, frames: int | None = None, stride: int = 1, pad: bool = True):
    """The frames ``start, start + stride, ...`` (``frames`` of them; all to the end by
    default) of an encoded video (bytes or a uint8 array, e.g. ``ds[i]["video"]``) as a uint8
    tensor ``(T, H, W, 3)``, decoded by PyAV (FFmpeg; any codec), as the Loader's CPU path
    decodes. Past the end the last frame repeats (``pad=True``, as ``fastload.video.clip``),
    or ValueError (``pad=False``)."""
    import torch

    start = check_int("start", start, min=0)
    stride = check_int("stride", stride, min=1)
    pad = check_bool("pad", pad)
    if hasattr(data, "tobytes"):
        data = data.tobytes()
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"decode() takes the video's encoded bytes, not {type(data).__name__}")
    if frames is None or not pad:
        n = _count(data)
        if frames is None:
            if start >= n:
                raise ValueError(f"start={start} is past the video's last frame ({n} frames)")
            frames = len(range(start, n, stride))
        elif start + (frames - 1) * stride >= n:
            raise ValueError(f"frame {start + (frames - 1) * stride} is past the video's end ({n} frames); "
                             "pad=True repeats the last frame")
    frames = check_int("frames", frames, min=1)
    return torch.from_numpy(decode_frames(data, start + stride * np.arange(frames)))


def _count(data) -> int:
    av = import_av()
    try:
        with av.open(io.BytesIO(bytes(data))) as c:
            s = c.streams.video[0]
            s.thread_type = "AUTO"
            return sum(1 for _ in c.decode(s))
    except (IndexError, av.error.FFmpegError) as e:
        raise ValueError(f"video does not decode (PyAV: {type(e).__name__}: {e})") from None

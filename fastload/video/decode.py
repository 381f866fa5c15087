"""``fastload.video.decode``: one video's frames with PyAV, for DataLoader code."""
from __future__ import annotations

import io
from typing import Any

import numpy as np

from ..store.media import import_av
from ..validate import check_int


def decode(data: Any, *, start: int = 0, frames: int | None = None, stride: int = 1, pad: bool = True):
    """The frames ``start, start + stride, ...`` (``frames`` of them; all to the end by
    default) of an encoded video (bytes or a uint8 array, e.g. ``ds[i]["video"]``) as a uint8
    tensor ``(T, H, W, 3)``, decoded by PyAV (FFmpeg; any codec). Past the end, the last
    frame repeats (``pad=True``, as ``fastload.video.clip``) or ValueError (``pad=False``)."""
    import torch

    av = import_av()
    start = check_int("start", start, min=0)
    stride = check_int("stride", stride, min=1)
    if frames is not None:
        frames = check_int("frames", frames, min=1)
    if isinstance(data, np.ndarray) or hasattr(data, "tobytes"):
        data = data.tobytes() if hasattr(data, "tobytes") else bytes(data)
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"decode() takes the video's encoded bytes, not {type(data).__name__}")
    want = None if frames is None else [start + k * stride for k in range(frames)]
    last = None if want is None else want[-1]
    got: dict[int, np.ndarray] = {}
    n = 0
    try:
        with av.open(io.BytesIO(bytes(data))) as c:
            s = c.streams.video[0]
            s.thread_type = "AUTO"
            for i, f in enumerate(c.decode(s)):
                n = i + 1
                if (want is None and i >= start and (i - start) % stride == 0) or (want is not None and i in want):
                    got[i] = f.to_ndarray(format="rgb24")
                if last is not None and i >= last:
                    break
                prev = f
    except (IndexError, av.error.FFmpegError) as e:  # no video stream, undecodable data
        raise ValueError(f"not a decodable video ({type(e).__name__}: {e})") from None
    if n == 0:
        raise ValueError("not a decodable video: no frame")
    if want is None:
        if start >= n:
            raise ValueError(f"start={start} is past the video's last frame ({n} frames)")
        want = list(range(start, n, stride))
    missing = [i for i in want if i not in got]
    if missing and not pad:
        raise ValueError(f"frame {missing[0]} is past the video's end ({n} frames); pad=True repeats the last frame")
    if missing:
        got.setdefault(n - 1, prev.to_ndarray(format="rgb24"))
    return torch.from_numpy(np.stack([got[min(i, n - 1)] if i >= n else got[i] for i in want]))

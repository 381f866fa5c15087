"""``fastload.audio.decode``: one audio file's samples with PyAV, for DataLoader code."""
from __future__ import annotations

import io
from typing import Any

import numpy as np

from ..store.media import import_av
from ..validate import check_bool, check_int


def decode(data: Any, *, sample_rate: int | None = None, mono: bool = False):
    """An encoded audio file (bytes or a uint8 array, e.g. ``ds[i]["audio"]``) as a float32
    tensor in [-1, 1): ``(channels, samples)``, or ``(samples,)`` with ``mono`` (channels
    averaged), resampled to ``sample_rate`` by FFmpeg when given. Decoded by PyAV."""
    import torch

    av = import_av()
    mono = check_bool("mono", mono)
    if sample_rate is not None:
        sample_rate = check_int("sample_rate", sample_rate, min=1)
    if hasattr(data, "tobytes"):
        data = data.tobytes()
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"decode() takes the audio file's encoded bytes, not {type(data).__name__}")
    parts = []
    try:
        with av.open(io.BytesIO(bytes(data))) as c:
            s = c.streams.audio[0]
            layout = s.codec_context.layout.name
            rs = av.AudioResampler(format="fltp", layout=layout, rate=sample_rate or s.codec_context.sample_rate)
            for f in c.decode(s):
                parts += [r.to_ndarray() for r in rs.resample(f)]
            parts += [r.to_ndarray() for r in rs.resample(None)]
    except (IndexError, av.error.FFmpegError) as e:
        raise ValueError(f"not a decodable audio file ({type(e).__name__}: {e})") from None
    if not parts:
        raise ValueError("not a decodable audio file: no samples")
    x = np.concatenate(parts, axis=1).astype(np.float32)
    return torch.from_numpy(x.mean(0) if mono else x)

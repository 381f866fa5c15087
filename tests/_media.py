"""Test media made with PyAV: videos whose frames encode their frame number, audio files."""
from __future__ import annotations

import io
import wave

import numpy as np


def frame_pattern(i: int, width: int, height: int) -> np.ndarray:
    """An RGB frame that tells its number ``i`` apart: flat blocks (lossless codecs keep them
    exact), the top half ``4*i``, the bottom left ``255 - 4*i``, a gradient bottom right."""
    img = np.zeros((height, width, 3), np.uint8)
    img[: height // 2] = (4 * i) % 256
    img[height // 2:, : width // 2, 0] = (255 - 4 * i) % 256
    img[height // 2:, : width // 2, 1] = (i * 16) % 256
    img[height // 2:, width // 2:] = np.linspace(0, 255, width - width // 2, dtype=np.uint8)[None, :, None]
    return img


def make_video(frames: int = 24, width: int = 64, height: int = 48, codec: str = "vp9", fps: int = 24,
               container: str | None = None, gop: int = 8) -> bytes:
    """The bytes of a video of ``frames`` frames (:func:`frame_pattern`): lossless VP9 in
    WebM, or H.264 (with B-frames) / MJPEG / VP8 (in mp4 / mkv / webm); a key frame every ``gop``
    frames (so that seeking has somewhere to land)."""
    import av

    fmt = container or {"vp9": "webm", "vp8": "webm", "h264": "mp4", "mjpeg": "matroska"}[codec]
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as c:
        name = {"vp9": "libvpx-vp9", "vp8": "libvpx", "h264": "libx264", "mjpeg": "mjpeg"}[codec]
        s = c.add_stream(name, rate=fps)
        s.width, s.height = width, height
        if codec == "vp9":
            s.pix_fmt = "yuv444p"
            s.options = {"lossless": "1", "deadline": "realtime", "cpu-used": "8", "g": str(gop)}
        elif codec == "h264":
            s.pix_fmt = "yuv420p"
            s.options = {"preset": "ultrafast", "qp": "0", "g": str(gop), "bf": "2"}
        elif codec == "mjpeg":
            s.pix_fmt = "yuvj444p"
        else:
            s.pix_fmt = "yuv420p"
        for i in range(frames):
            f = av.VideoFrame.from_ndarray(frame_pattern(i, width, height), format="rgb24")
            for p in s.encode(f):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def pyav_frames(data: bytes) -> np.ndarray:
    """Every frame of ``data`` decoded by PyAV as uint8 (T, H, W, 3)."""
    import av

    with av.open(io.BytesIO(data)) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])


def tone(seconds: float = 0.5, rate: int = 16000, channels: int = 1, seed: int = 0) -> np.ndarray:
    """int16 (samples, channels): a chirp plus a little noise, different per channel."""
    t = np.arange(int(seconds * rate)) / rate
    rng = np.random.default_rng(seed)
    out = [0.5 * np.sin(2 * np.pi * (200 + 300 * c + 400 * t) * t) + 0.05 * rng.standard_normal(len(t))
           for c in range(channels)]
    return (np.clip(np.stack(out, 1), -1, 1) * 32000).astype(np.int16)


def wav_bytes(pcm: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(pcm.shape[1])
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.ascontiguousarray(pcm).tobytes())
    return buf.getvalue()


def flac_bytes(pcm: np.ndarray, rate: int) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="flac") as c:
        s = c.add_stream("flac", rate=rate, layout="mono" if pcm.shape[1] == 1 else "stereo")
        f = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm).reshape(1, -1),
                                       format="s16", layout="mono" if pcm.shape[1] == 1 else "stereo")
        f.sample_rate = rate
        for p in s.encode(f):
            c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()

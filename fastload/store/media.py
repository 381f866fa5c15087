"""Video and audio files: what the store records of each (its hidden info columns).

A ``video`` or ``audio`` field stores the encoded file as it is (mp4/mkv/webm/avi;
wav/flac/ogg) and, beside it, what probing it found (``format.media_columns``): a video's
width, height, frame count, frame rate and codec; an audio file's sample rate, channel count,
length in samples per channel and codec. Probing *decodes* the whole stream with PyAV
(FFmpeg): a container's own frame count is often missing or wrong (WebM has none), and a file
that does not decode to the end is refused here, at write time, not in the middle of an epoch.

PyAV (``pip install av``, the ``media`` extra) is imported on first use only.
"""
from __future__ import annotations

import io
from typing import Any

# Codecs (FFmpeg's names) the Loader decodes. DALI 2.4's CPU video decoder reads VP8, VP9 and
# MJPEG only; its GPU decoder (NVDEC) reads the others too (see fastload.video).
CPU_VIDEO_CODECS = ("vp8", "vp9", "mjpeg")
VIDEO_CODECS = ("h264", "hevc", "vp8", "vp9", "av1", "mpeg4", "mjpeg")
# What DALI 2.4's audio decoder (libsndfile) reads: PCM WAV, FLAC, Ogg Vorbis/Opus. Not MP3
# (it fails on PyAV-made MP3 files): those are refused at convert time, naming them.
AUDIO_CODECS = ("pcm_s16le", "pcm_s24le", "pcm_s32le", "pcm_f32le", "pcm_u8", "flac", "vorbis", "opus")
VIDEO_EXTENSIONS = (".mp4", ".m4v", ".mkv", ".webm", ".avi", ".mov")
AUDIO_EXTENSIONS = (".wav", ".flac", ".ogg", ".oga", ".opus", ".mp3")

__all__ = ["AUDIO_CODECS", "AUDIO_EXTENSIONS", "CPU_VIDEO_CODECS", "VIDEO_CODECS", "VIDEO_EXTENSIONS", "import_av",
           "probe", "probe_audio", "probe_video"]


class _FrameSizes(ValueError):
    """Frames of more than one size (said as it is, not as a decode failure)."""


def import_av():
    """PyAV, or an ImportError saying how to install it."""
    try:
        import av
    except ImportError:
        raise ImportError("video and audio fields need PyAV to probe and decode files: "
                          "pip install 'fastload[media]' (or pip install av)") from None
    return av


def _open(data: Any):
    av = import_av()
    if isinstance(data, memoryview) or hasattr(data, "tobytes"):
        data = bytes(data)
    if not isinstance(data, (bytes, bytearray)):
        raise ValueError(f"expected the encoded file's bytes, got {type(data).__name__}")
    if not data:
        raise ValueError("empty file")
    try:
        return av.open(io.BytesIO(data), mode="r")
    except Exception as e:  # av.error.InvalidDataError and friends
        raise ValueError(f"not a media file FFmpeg can open ({type(e).__name__}: {e})") from None


def probe_video(data: Any) -> dict[str, Any]:
    """``{"width", "height", "frames", "fps", "codec"}`` of an encoded video (its first video
    stream), every frame decoded; ValueError naming what is wrong when it cannot be decoded to
    the end, holds no frame, or uses a codec the Loader cannot decode."""
    with _open(data) as c:
        if not c.streams.video:
            raise ValueError("holds no video stream")
        s = c.streams.video[0]
        codec = s.codec_context.name
        if codec not in VIDEO_CODECS:
            raise ValueError(f"video codec {codec!r} cannot be decoded by fastload (DALI decodes "
                             f"{', '.join(VIDEO_CODECS)}); re-encode it, e.g. convert with --video-codec vp9")
        s.thread_type = "AUTO"
        frames, w, h = 0, 0, 0
        try:
            for f in c.decode(s):
                if not frames:
                    w, h = f.width, f.height
                elif (f.width, f.height) != (w, h):
                    raise _FrameSizes(f"frame {frames} is {f.width}x{f.height}, frame 0 {w}x{h}; a clip needs one "
                                     "frame size: re-encode the video at one size")
                frames += 1
        except _FrameSizes as e:
            raise ValueError(str(e)) from None
        except Exception as e:  # PyAV's InvalidDataError is a ValueError too: named with its frame
            raise ValueError(f"video does not decode past frame {frames} ({type(e).__name__}: {e})") from None
        if frames == 0:
            raise ValueError("video stream holds no decodable frame")
        rate = s.average_rate or s.guessed_rate or s.base_rate
        fps = float(rate) if rate else 0.0
    return {"width": int(w), "height": int(h), "frames": int(frames), "fps": fps, "codec": codec}


def probe_audio(data: Any) -> dict[str, Any]:
    """``{"sample_rate", "channels", "length", "codec"}`` of an encoded audio file (its first
    audio stream; ``length`` in samples per channel), every frame decoded; ValueError naming
    what is wrong otherwise."""
    with _open(data) as c:
        if not c.streams.audio:
            raise ValueError("holds no audio stream")
        s = c.streams.audio[0]
        codec = s.codec_context.name
        if codec not in AUDIO_CODECS:
            raise ValueError(f"audio codec {codec!r} cannot be decoded by fastload (DALI's audio decoder reads "
                             "WAV, FLAC and Ogg Vorbis/Opus); re-encode it, e.g. as FLAC")
        length = 0
        try:
            for f in c.decode(s):
                length += f.samples
        except Exception as e:
            raise ValueError(f"audio does not decode past sample {length} ({type(e).__name__}: {e})") from None
        if length == 0:
            raise ValueError("audio stream holds no samples")
        rate = int(s.codec_context.sample_rate or s.rate or 0)
        channels = int(s.codec_context.channels if hasattr(s.codec_context, "channels")
                       else s.codec_context.layout.nb_channels)
    if rate <= 0 or channels <= 0:
        raise ValueError(f"audio stream declares sample rate {rate} and {channels} channel(s)")
    return {"sample_rate": rate, "channels": channels, "length": int(length), "codec": codec}


def probe(kind: str, data: Any) -> dict[str, Any]:
    """:func:`probe_video` or :func:`probe_audio` by field kind."""
    if kind == "video":
        return probe_video(data)
    if kind == "audio":
        return probe_audio(data)
    raise ValueError(f"a {kind} field is no media field")

"""videofolder and audiofolder: ``SRC/<class>/<file>`` like imagefolder, for video and audio.

The folder is walked as an image folder is (imagefolder.py: sorted class folders, links,
keys, ignored files), taking video files (``.mp4 .m4v .mkv .webm .avi .mov``) or audio files
(``.wav .flac .ogg .oga .opus .mp3``). Every file is probed by decoding it to the end with
PyAV (:mod:`fastload.store.media`), in the validation workers: a file that does not decode,
holds no video (audio) stream, or uses a codec fastload cannot decode is an error naming it
(or skipped and reported with ``--on-error skip``). What the probe found (frames, fps, size,
codec; sample rate, channels, length) is stored beside the file.

Video options:

* ``min_frames``: a video with fewer frames is refused (skipped with ``--on-error skip``)
  instead of being padded by its last frame at load time (``fastload.video.clip``).
* ``video_codec="vp9"``: a video DALI's CPU decoder cannot read (H.264, HEVC, MPEG-4, AV1:
  it reads VP8, VP9 and MJPEG only) is re-encoded to VP9 in WebM (libvpx-vp9, constant
  quality ``crf`` 32, same size and frame rate), so the whole dataset decodes on a machine
  without a GPU. Others are stored as they are. The local engine's summary counts the re-encoded
  videos (`transcoded_videos`); the manifest does not (a distributed commit takes no per-part counts).
"""
from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np

from ..store.format import Field
from ..store.media import AUDIO_EXTENSIONS, CPU_VIDEO_CODECS, VIDEO_EXTENSIONS, import_av, probe
from ..validate import check_int
from .common import ConvertError, Source
from .imagefolder import ImageFolderSource

VIDEO_CODEC_CHOICES = ("keep", "vp9")
TRANSCODE_CRF = 32

__all__ = ["AudioFolderSource", "VideoFolderSource", "VIDEO_CODEC_CHOICES", "check_media_options", "transcode_vp9"]


def check_media_options(min_frames, video_codec) -> tuple[int | None, str | None]:
    if min_frames is not None:
        min_frames = check_int("min_frames", min_frames, min=1)
    if video_codec is not None and video_codec not in VIDEO_CODEC_CHOICES:
        raise ConvertError(f"--video-codec {video_codec!r} must be one of {', '.join(VIDEO_CODEC_CHOICES)}")
    return min_frames, (None if video_codec == "keep" else video_codec)


def transcode_vp9(data: bytes, crf: int = TRANSCODE_CRF) -> bytes:
    """``data``'s first video stream re-encoded as VP9 in WebM (yuv420p, same size and frame
    rate; audio dropped)."""
    av = import_av()
    out = io.BytesIO()
    with av.open(io.BytesIO(bytes(data))) as src, av.open(out, mode="w", format="webm") as dst:
        s = src.streams.video[0]
        rate = s.average_rate or s.guessed_rate or 25
        o = dst.add_stream("libvpx-vp9", rate=rate)
        o.width, o.height = s.codec_context.width, s.codec_context.height
        o.pix_fmt = "yuv420p"
        o.options = {"crf": str(crf), "b": "0", "deadline": "realtime", "cpu-used": "8", "row-mt": "1"}
        for f in src.decode(s):
            f.pts = None  # frames are numbered anew, one per 1/rate
            for p in o.encode(f.reformat(format="yuv420p")):
                dst.mux(p)
        for p in o.encode():
            dst.mux(p)
    return out.getvalue()


class _MediaFolder(ImageFolderSource):
    KIND = "video"

    def __init__(self, src, *, min_frames: int | None = None, video_codec: str | None = None):
        self.min_frames, self.video_codec = check_media_options(min_frames, video_codec)
        import_av()  # the install hint before the folder is walked
        super().__init__(src)

    @classmethod
    def from_listing(cls, root, classes, paths, labels, ignored, max_pixels=None, repeated_dirs=0, *,
                     min_frames=None, video_codec=None, **_):
        self = cls.__new__(cls)
        self.min_frames, self.video_codec = check_media_options(min_frames, video_codec)
        self._init(Path(root), list(classes), np.asarray(paths), np.asarray(labels, dtype=np.int64), int(ignored),
                   None, int(repeated_dirs))
        return self

    def _init(self, root, classes, paths, labels, ignored, max_pixels, repeated=0, max_size=None, quality=None):
        kind = self.KIND
        meta = {"source": f"{kind}folder", "ignored_files": ignored, "repeated_dirs": repeated}
        if kind == "video" and self.min_frames is not None:
            meta["min_frames"] = self.min_frames
        if kind == "video" and self.video_codec is not None:
            meta["video_codec"] = self.video_codec
        Source.__init__(self, fields={kind: Field(kind), "label": Field("scalar", "int64")}, num_samples=len(paths),
                        label="label", class_names=classes, metadata=meta)
        self.root, self.paths, self.labels = root, paths, labels
        self.ignored, self.repeated_dirs = ignored, repeated

    def read(self, i: int) -> dict:
        sample = super().read(i)  # {"image": bytes, "label": int}
        return {self.KIND: sample.pop("image"), **sample}

    @property
    def needs_validation(self) -> bool:
        return True

    def check(self, i: int) -> tuple[dict, dict]:
        """({field: probed info}, {field: re-encoded bytes}) of sample i; ValueError naming what
        is wrong."""
        data = self.read(i)[self.KIND]
        info = probe(self.KIND, data)
        new = {}
        if self.KIND == "video":
            if self.video_codec == "vp9" and info["codec"] not in CPU_VIDEO_CODECS:
                data = transcode_vp9(data)
                new[self.KIND] = data
                info = probe("video", data)
            if self.min_frames is not None and info["frames"] < self.min_frames:
                raise ValueError(f"video of {info['frames']} frames is shorter than --min-frames {self.min_frames}")
        return {self.KIND: info}, new


class VideoFolderSource(_MediaFolder):
    EXTENSIONS = VIDEO_EXTENSIONS
    WHAT = "video"
    KIND = "video"


class AudioFolderSource(_MediaFolder):
    EXTENSIONS = AUDIO_EXTENSIONS
    WHAT = "audio"
    KIND = "audio"

    def __init__(self, src, **kw):
        if kw.get("min_frames") is not None or kw.get("video_codec") is not None:
            raise ConvertError("--min-frames and --video-codec are for videofolder sources; leave them out")
        super().__init__(src)


def media_folder(kind: str, src: str | os.PathLike, **kw) -> _MediaFolder:
    return (VideoFolderSource if kind == "videofolder" else AudioFolderSource)(src, **kw)

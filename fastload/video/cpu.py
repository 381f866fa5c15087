"""Clips on the CPU: PyAV (FFmpeg) decodes in native threads, torch resizes, crops, flips and
normalises straight into the batch (a ring slot).

Why not DALI's CPU video decoder: measured on this project's 2-core machine
(docs/how-to/video-audio.md), a 16-frame clip of a 320x240 VP9 video decoded by PyAV on one
thread came at 53-59 clips/s, by DALI's CPU decoder at 13-16 (18-30 without its frame index),
and DALI's CPU decoder cannot read H.264, HEVC, MPEG-4 or AV1 at all. FFmpeg releases the GIL
while it decodes, so a pool of threads scales with the cores; torch's antialiased bilinear
resize is the filter DALI uses on the GPU (the same graph's other half, see
:mod:`fastload.pipeline.host_tail`). On a GPU the whole clip stays in DALI (NVDEC).
"""
from __future__ import annotations

import io
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..errors import BadSamples
from ..pipeline.host_tail import one_torch_thread
from ..pipeline.runner import default_threads
from ..store.media import import_av

__all__ = ["PyAVRunner", "decode_frames"]


def decode_frames(data: Any, wanted: np.ndarray, expected: int | None = None) -> np.ndarray:
    """Frames ``wanted`` (sorted or not, repeats allowed; past the last frame: the last one) of
    an encoded video as uint8 ``(len(wanted), H, W, 3)``, decoded by PyAV from the start to
    the last one wanted. ValueError when it does not decode, or ends before frame
    ``expected - 1`` (the count convert recorded) while a later frame is wanted: damaged since."""
    av = import_av()
    wanted = np.asarray(wanted, dtype=np.int64)
    need = set(wanted.tolist())
    top = int(wanted.max())
    try:
        if int(wanted.min()) >= SEEK_FROM:
            found = _decode_after_seek(av, data, int(wanted.min()), top, need)
            if found is not None:
                got, last, last_img = found
                return _assemble(got, last, last_img, wanted, top, expected)
        got, last, last_img = _decode(av, data, top, need)
    except (IndexError, av.error.FFmpegError) as e:
        raise ValueError(f"video does not decode (PyAV: {type(e).__name__}: {e})") from None
    return _assemble(got, last, last_img, wanted, top, expected)


# A clip starting at this frame or later seeks to the key frame before it rather than
# decoding every frame from the first (as DALI's decoder does with its frame index).
SEEK_FROM = 32


def _decode(av, data, top: int, need: set) -> tuple[dict, int, Any]:
    """Frames ``need`` (and ``top``) decoded from the first, counting frames."""
    got: dict[int, np.ndarray] = {}
    last, last_img = -1, None
    with av.open(io.BytesIO(memoryview(data))) as c:
        s = c.streams.video[0]
        s.thread_type = "AUTO"
        for i, f in enumerate(c.decode(s)):
            last = i
            if i in need or i == top:
                got[i] = f.to_ndarray(format="rgb24")
            if i >= top:
                break
            last_img = f
    return got, last, last_img


def _decode_after_seek(av, data, first: int, top: int, need: set) -> tuple[dict, int, Any] | None:
    """Frames ``need`` decoded from the key frame at or before frame ``first``, each frame's
    number read from its timestamp. None (decode from the start instead) unless the stream
    is evenly timed where it was read: every timestamp on the frame grid, one frame after
    another, the first at or before ``first``; a variable frame rate is never guessed at."""
    got: dict[int, np.ndarray] = {}
    with av.open(io.BytesIO(memoryview(data))) as c:
        s = c.streams.video[0]
        rate = s.average_rate
        if not rate or s.time_base is None:
            return None
        fps, tb = float(rate), float(s.time_base)
        t0 = (s.start_time or 0) * tb
        s.thread_type = "AUTO"
        c.seek(int(round((t0 + first / fps) / tb)), stream=s, backward=True, any_frame=False)
        prev, last_img = None, None
        for f in c.decode(s):
            if f.pts is None:
                return None
            k = (f.pts * tb - t0) * fps
            i = int(round(k))
            if abs(k - i) > 0.1 or (prev is None and i > first) or (prev is not None and i != prev + 1):
                return None
            prev = i
            if i in need or i == top:
                got[i] = f.to_ndarray(format="rgb24")
            if i >= top:
                break
            last_img = f
        if prev is None:
            return None
    return got, prev, last_img


def _assemble(got: dict, last: int, last_img, wanted: np.ndarray, top: int, expected: int | None) -> np.ndarray:
    if last < 0:
        raise ValueError("video holds no decodable frame")
    if expected is not None and last < min(top, expected - 1):
        raise ValueError(f"video ends after frame {last}, but holds {expected} frames as converted: the file is "
                         "damaged (verify the dataset; convert it again)")
    if last not in got:  # the video ended before the last frame wanted: repeat its last one
        got[last] = last_img.to_ndarray(format="rgb24")  # (the frame numbered ``last``)
    return np.stack([got[min(int(k), last)] for k in wanted])


class PyAVRunner:
    """The CPU runner of a ``fastload.video`` transform (the Loader's runner contract: ``run``,
    ``prepare``, ``close``, ``copy_s``, ``whole_batches``)."""

    device = "cpu"
    ready_event = None

    def __init__(self, transform, *, batch_size: int, num_threads: int | None, seed: int):
        self.transform = transform
        self.batch_size = int(batch_size)
        self.num_threads = default_threads("cpu") if num_threads is None else int(num_threads)
        self.seed = int(seed)
        self.out_shape = tuple(transform.out_shape)
        self.out_dtype = np.dtype(transform.out_dtype)
        self.copy_s = 0.0
        self.whole_batches = False
        self.rebuilds = 0
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def prepare(self) -> None:
        self._executor()

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="fastload-video",
                                                initializer=one_torch_thread)
            return self._pool

    def run(self, encoded: list, widths, heights, indices, epoch: int, out=None):
        import torch

        n = len(encoded)
        if n == 0 or n > self.batch_size:
            raise ValueError(f"batch of {n} videos; this runner takes 1..{self.batch_size}")
        t = self.transform
        params = t.params(self.seed, epoch, np.asarray(indices), widths, heights)
        lists = t.frame_lists(params)
        frames = t.info(indices, ["frames"])["frames"]
        if out is None:
            out = torch.empty((n, *self.out_shape), dtype=getattr(torch, self.out_dtype.name))
        elif not isinstance(out, torch.Tensor):
            out = torch.from_numpy(out)

        def one(i: int) -> str | None:
            try:
                t.finish_clip(decode_frames(encoded[i], lists[i], int(frames[i])), {k: v[i] for k, v in params.items()}, out[i])
            except ValueError as e:
                return str(e)
            return None

        reasons = list(self._executor().map(one, range(n)))
        bad = [i for i, r in enumerate(reasons) if r is not None]
        if bad:
            raise BadSamples(bad, [reasons[i] for i in bad])
        return out

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

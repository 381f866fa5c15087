"""``clip`` and ``clips``: DALI graphs from a video's bytes to fixed-shape clips.

The graph: ``fn.decoders.video`` (``start_frame``/``sequence_length``/``stride``, or a list of
``frames`` for ``clips``; ``pad_mode="edge"`` repeats the last frame past the end) →
``fn.resize`` (shorter side to ``size``, antialiased) → ``fn.crop_mirror_normalize`` (a
``size`` x ``size`` window at a random or central position, horizontal flip, mean/std,
dtype, layout). Starts, crop positions and flips are drawn by :func:`fastload.pipeline.crops.uniforms`
from (seed, epoch, global index): pure functions of the sample, not of the batch or rank.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..pipeline.crops import uniforms
from ..pipeline.media import MediaTransform, channels, check_dtype_layout
from ..store.geometry import DEFAULT_MAX_PIXELS
from ..store.media import CPU_VIDEO_CODECS
from ..validate import check_int

DTYPES = ("uint8", "float32", "float16")
LAYOUTS = ("THWC", "TCHW", "CTHW")
CROPS = ("random", "center")
_STREAM = 0x29  # the uniforms' stream: video draws never coincide with the image presets'
_DALI_LAYOUT = {"THWC": "FHWC", "TCHW": "FCHW", "CTHW": "CFHW"}


class _Video(MediaTransform):
    field_kind = "video"
    # on the CPU: PyAV decodes, torch finishes each clip into the batch (cpu.py); DALI on a GPU
    finishes_on_cpu = True

    def __init__(self, frames, stride, size, crop, flip, mean, std, dtype, layout):
        self.frames = check_int("frames", frames, min=1)
        self.stride = check_int("stride", stride, min=1)
        self.size = None if size is None else check_int("size", size, min=1)
        if crop not in CROPS:
            raise ValueError(f"crop={crop!r} must be one of {', '.join(CROPS)}")
        self.crop = crop
        if isinstance(flip, bool) or not isinstance(flip, (int, float)) or not 0.0 <= float(flip) <= 1.0:
            raise ValueError(f"flip={flip!r} must be a probability in [0, 1]")
        self.flip = float(flip)
        check_dtype_layout(dtype, layout, DTYPES, LAYOUTS)
        self.mean, self.std = channels("mean", mean), channels("std", std)
        if (self.mean is None) != (self.std is None):
            raise ValueError("give mean and std together (per RGB channel, in 0..1 units), or neither")
        if self.std is not None and min(self.std) <= 0:
            raise ValueError(f"std={std!r} must be > 0")
        if dtype == "uint8" and self.mean is not None:
            raise ValueError("dtype='uint8' delivers pixels as decoded; normalising needs dtype='float32' or 'float16'")
        self.dtype, self.layout = dtype, layout
        self.out_dtype = dtype
        self.max_pixels = DEFAULT_MAX_PIXELS  # per frame, as an image's
        self._hw = None if self.size is None else (self.size, self.size)
        self._set_shape()

    @property
    def span(self) -> int:
        """Frames from a clip's first to its last, inclusive."""
        return (self.frames - 1) * self.stride + 1

    def _set_shape(self) -> None:
        if self._hw is None:
            self.out_shape = ()  # settled by the dataset (size=None keeps its one frame size)
            return
        h, w = self._hw
        clip = {"THWC": (self.frames, h, w, 3), "TCHW": (self.frames, 3, h, w), "CTHW": (3, self.frames, h, w)}
        self.out_shape = self._lead() + clip[self.layout]

    def _lead(self) -> tuple[int, ...]:
        return ()

    def _bound(self, ds, name: str) -> None:
        if self.size is not None or len(ds) == 0:
            return
        info = ds.media_info(name, np.arange(len(ds)), ["width", "height"])
        w, h = info["width"], info["height"]
        odd = np.flatnonzero((w != w[0]) | (h != h[0]))
        if len(odd):
            i = int(odd[0])
            raise ValueError(f"transforms[{name!r}]: size=None keeps the frames as decoded, so every video must have "
                             f"one frame size; {ds.describe(0)} is {w[0]}x{h[0]}, {ds.describe(i)} is {w[i]}x{h[i]}: "
                             "pass size= to resize and crop")
        self._hw = (int(h[0]), int(w[0]))
        self._set_shape()

    def _common(self) -> dict:
        return {"frames": self.frames, "stride": self.stride, "size": self.size, "crop": self.crop,
                "flip": self.flip, "mean": list(self.mean) if self.mean else None,
                "std": list(self.std) if self.std else None, "dtype": self.dtype, "layout": self.layout}

    def refuse(self, index, device):
        """Only the DALI graph on the CPU (``dali_only``) is limited to DALI's CPU codecs."""
        if device != "cpu":
            return []
        codecs = self.info(index, ["codec"])["codec"]
        return [(p, f"video codec {c!r} is not decoded by DALI's CPU decoder (it reads "
                    f"{', '.join(CPU_VIDEO_CODECS)}); leave dali_only off (PyAV decodes it), or convert the videos "
                    "again with --video-codec vp9") for p, c in enumerate(codecs) if c not in CPU_VIDEO_CODECS]

    def runner(self, *, device: str = "cpu", batch_size: int, num_threads: int | None = None,
               prefetch: int | None = None, seed: int = 0, device_id: int | None = None, dali_only: bool = False):
        """On the CPU a :class:`~fastload.video.cpu.PyAVRunner` (``dali_only``: DALI's CPU graph,
        VP8/VP9/MJPEG only); on CUDA the DALI graph with the mixed decoder."""
        if device == "cpu" and not dali_only:
            from .cpu import PyAVRunner

            return PyAVRunner(self, batch_size=batch_size, num_threads=num_threads, seed=seed)
        return super().runner(device=device, batch_size=batch_size, num_threads=num_threads, prefetch=prefetch,
                              seed=seed, device_id=device_id, dali_only=True)

    def finish_clip(self, frames: np.ndarray, p: dict, row) -> None:
        """One sample's decoded frames ``(K, H, W, 3)`` uint8 resized (shorter side to
        ``size``, antialiased bilinear), cropped at ``p``'s position, flipped, normalised and
        laid out into ``row`` (the sample's row of the batch), in torch: DALI's graph, on the CPU."""
        import torch
        from torch.nn.functional import interpolate

        from ..pipeline.host_tail import eval_window

        x = torch.from_numpy(frames).permute(0, 3, 1, 2)  # (K, 3, H, W), channels-last memory
        if self.size is not None:
            h, w = int(x.shape[2]), int(x.shape[3])
            nh, nw, _, _ = eval_window(h, w, self.size, (self.size, self.size))
            if (nh, nw) != (h, w):
                x = interpolate(x, size=(nh, nw), mode="bilinear", antialias=True, align_corners=False)
            top = int(np.floor(float(p["crop_y"]) * (nh - self.size) + 0.5))
            left = int(np.floor(float(p["crop_x"]) * (nw - self.size) + 0.5))
            x = x[:, :, top:top + self.size, left:left + self.size]
        elif tuple(x.shape[2:]) != self._hw:
            raise ValueError(f"frames of {x.shape[3]}x{x.shape[2]}, not the {self._hw[1]}x{self._hw[0]} recorded")
        if int(p["flip"]):
            x = x.flip(-1)
        x = x.reshape(*self._lead(), self.frames, *x.shape[1:])  # (n, T, 3, h, w) for clips
        lead = len(self._lead())
        perm = {"THWC": (0, 2, 3, 1), "TCHW": (0, 1, 2, 3), "CTHW": (1, 0, 2, 3)}[self.layout]
        x = x.permute(*range(lead), *(lead + k for k in perm))
        if self.mean is None:
            row.copy_(x)
            return
        shape = [3 if d == "C" else 1 for d in self.layout]
        m = torch.tensor([255.0 * v for v in self.mean], dtype=torch.float32).view(shape)
        s = torch.tensor([255.0 * v for v in self.std], dtype=torch.float32).view(shape)
        row.copy_((x.float() - m) / s)

    def _window(self, u: np.ndarray, n: int) -> dict[str, np.ndarray]:
        """Crop position (x, y in [0, 1]) and flip from uniforms ``u[:, 0:3]``."""
        if self.crop == "random":
            pos = u[:, 0:2].astype(np.float32)
        else:
            pos = np.full((n, 2), 0.5, dtype=np.float32)
        flip = (u[:, 2] < self.flip).astype(np.int32)
        return {"crop_x": np.ascontiguousarray(pos[:, 0]), "crop_y": np.ascontiguousarray(pos[:, 1]), "flip": flip}

    def _finish(self, video, params, *, device: str, layout: str):
        from nvidia.dali import fn, types

        kw: dict[str, Any] = {"device": device, "output_layout": layout, "mirror": params["flip"],
                              "dtype": {"float32": types.FLOAT, "float16": types.FLOAT16, "uint8": types.UINT8}[self.dtype]}
        if self.size is not None:
            video = fn.resize(video, device=device, resize_shorter=self.size, antialias=True)
            kw.update(crop=(self.size, self.size), crop_pos_x=params["crop_x"], crop_pos_y=params["crop_y"])
        if self.mean is not None:
            kw["mean"] = [255.0 * m for m in self.mean]
            kw["std"] = [255.0 * s for s in self.std]
        return fn.crop_mirror_normalize(video, **kw)

    def param_names(self, decoded_only: bool = False) -> dict[str, Any]:
        crop = {"crop_x": np.float32, "crop_y": np.float32} if self.size is not None else {}
        return {**crop, "flip": np.int32}


class Clip(_Video):
    """One clip per sample, its start drawn per (seed, epoch, index): see the module docstring."""

    def __init__(self, frames: int = 16, stride: int = 2, size: int | None = 224, *, crop: str = "random",
                 flip: float = 0.5, mean=None, std=None, dtype: str = "uint8", layout: str = "THWC"):
        super().__init__(frames, stride, size, crop, flip, mean, std, dtype, layout)

    def describe(self) -> dict:
        return {"kind": "clip", **self._common()}

    def param_names(self, decoded_only=False):
        return {"start": np.int32, **super().param_names()}

    def params(self, seed, epoch, index, width, height):
        index = np.asarray(index)
        frames = self.info(index, ["frames"])["frames"].astype(np.int64)
        u = uniforms(seed, epoch, index, 4, stream=_STREAM)
        room = np.maximum(frames - self.span + 1, 1)  # starts that keep the clip inside the video
        start = np.minimum(np.floor(u[:, 3] * room).astype(np.int64), room - 1).astype(np.int32)
        return {"start": start, **self._window(u, len(index))}

    def frame_lists(self, params: dict) -> np.ndarray:
        """``(n, frames)`` frame numbers of each sample's clip (past the end: clamped by the decoder)."""
        return params["start"].astype(np.int64)[:, None] + self.stride * np.arange(self.frames)[None, :]

    def graph(self, encoded, params, *, decode_device, device, decoded_only=False):
        from nvidia.dali import fn

        video = fn.decoders.video(encoded, device=decode_device, start_frame=params["start"],
                                  sequence_length=self.frames, stride=self.stride, pad_mode="edge")
        return self._finish(video, params, device=device, layout=_DALI_LAYOUT[self.layout])


class Clips(_Video):
    """``n`` clips per video, their starts evenly spaced from the first frame to the last
    possible start (the evaluation recipe: average the predictions), centre crop, no flip:
    ``(n, *clip)`` per sample."""

    def __init__(self, n: int, frames: int = 16, stride: int = 2, size: int | None = 224, *, crop: str = "center",
                 flip: float = 0.0, mean=None, std=None, dtype: str = "uint8", layout: str = "THWC"):
        self.n = check_int("n", n, min=1)
        super().__init__(frames, stride, size, crop, flip, mean, std, dtype, layout)

    def _lead(self):
        return (self.n,)

    def describe(self) -> dict:
        return {"kind": "clips", "n": self.n, **self._common()}

    def param_names(self, decoded_only=False):
        return {"frame_list": np.int32, **super().param_names()}

    def starts(self, frames: np.ndarray) -> np.ndarray:
        """``(len(frames), n)`` first frames of the clips of videos of ``frames`` frames."""
        last = np.maximum(np.asarray(frames, dtype=np.int64) - self.span, 0)
        k = np.arange(self.n)
        return np.floor(last[:, None] * k[None, :] / max(self.n - 1, 1)).astype(np.int64) if self.n > 1 else \
            (last[:, None] // 2)

    def params(self, seed, epoch, index, width, height):
        index = np.asarray(index)
        frames = self.info(index, ["frames"])["frames"].astype(np.int64)
        st = self.starts(frames)
        lst = st[:, :, None] + self.stride * np.arange(self.frames)[None, None, :]
        lst = np.minimum(lst, (frames - 1)[:, None, None]).reshape(len(index), -1).astype(np.int32)
        u = uniforms(seed, epoch, index, 3, stream=_STREAM)
        return {"frame_list": lst, **self._window(u, len(index))}

    def frame_lists(self, params: dict) -> np.ndarray:
        return params["frame_list"].astype(np.int64)

    def graph(self, encoded, params, *, decode_device, device, decoded_only=False):
        from nvidia.dali import fn

        video = fn.decoders.video(encoded, device=decode_device, frames=params["frame_list"], pad_mode="edge")
        out = self._finish(video, params, device=device, layout="FHWC")  # (n * T, h, w, 3)
        h, w = self._hw if self._hw is not None else (-1, -1)
        out = fn.reshape(out, shape=[self.n, self.frames, h, w, 3], layout="")
        perm = {"THWC": [0, 1, 2, 3, 4], "TCHW": [0, 1, 4, 2, 3], "CTHW": [0, 4, 1, 2, 3]}[self.layout]
        return out if self.layout == "THWC" else fn.transpose(out, perm=perm, device=device)


def clip(frames: int = 16, stride: int = 2, size: int | None = 224, **kw) -> Clip:
    """One clip per sample: ``frames`` frames ``stride`` apart from a start drawn per (seed,
    epoch, index); shorter side resized to ``size`` and a ``size`` x ``size`` crop (``crop=
    "random"`` or ``"center"``; ``size=None`` keeps the frames as decoded), mirrored with
    probability ``flip``; uint8 as decoded unless ``dtype="float32"``/``"float16"`` with
    ``mean``/``std`` (0..1 units); ``layout`` ``"THWC"``, ``"TCHW"`` or ``"CTHW"``. A video
    shorter than the clip repeats its last frame."""
    return Clip(frames, stride, size, **kw)


def clips(n: int, frames: int = 16, stride: int = 2, size: int | None = 224, **kw) -> Clips:
    """``n`` clips per video for evaluation, their starts evenly spaced, centre crop, no flip:
    ``(n, *clip)`` per sample (the other arguments as :func:`clip`)."""
    return Clips(n, frames, stride, size, **kw)

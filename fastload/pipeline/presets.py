"""Image transforms: ImageNet-style ``train`` and ``eval`` presets and ``custom`` graphs.

Each transform is a small immutable description (``describe()`` is JSON, stored in loader
checkpoints) that can build its DALI graph for either device and compute its per-sample
parameters from (seed, epoch, global index, width, height).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np

from ..validate import check_int
from .runner import Runner
from .crops import train_params

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
DTYPES = ("float32", "float16", "uint8")
LAYOUTS = ("CHW", "HWC")
# 67 MP (200 MB decoded): larger headers are refused before decoding, here and by convert
from ..store.geometry import DEFAULT_MAX_PIXELS  # noqa: E402

__all__ = ["Transform", "train", "eval", "custom", "IMAGENET_MEAN", "IMAGENET_STD", "DEFAULT_MAX_PIXELS"]


def _size(name: str, v: Any) -> tuple[int, int]:
    given = v  # the error names what the user wrote (size=0, not size=(0, 0))
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        v = (int(v), int(v))
    if not (isinstance(v, (tuple, list)) and len(v) == 2 and all(isinstance(x, (int, np.integer)) and x > 0 for x in v)):
        raise ValueError(f"{name}={given!r} must be a positive int or an (height, width) pair of positive ints")
    return int(v[0]), int(v[1])


def _pair(name: str, v: Any, lo: float, positive: bool = False) -> tuple[float, float]:
    try:
        a, b = (float(x) for x in v)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={v!r} must be a (low, high) pair of numbers") from None
    if not (math.isfinite(a) and math.isfinite(b)) or a > b or a < lo or (positive and a <= 0):
        raise ValueError(f"{name}={v!r} must be finite with {lo} {'<' if positive else '<='} low <= high")
    return a, b


def _channels(name: str, v: Any) -> tuple[float, ...]:
    try:
        t = tuple(float(x) for x in v)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={v!r} must be 3 numbers (one per RGB channel)") from None
    if len(t) != 3 or not all(math.isfinite(x) for x in t):
        raise ValueError(f"{name}={v!r} must be 3 finite numbers (one per RGB channel)")
    return t


class Transform:
    """Base of the presets. Subclasses define ``graph``, ``params`` and ``param_names``."""

    out_shape: tuple[int, ...]
    out_dtype: str
    max_pixels: int

    def describe(self) -> dict:
        raise NotImplementedError

    # On the CPU the runner builds the graph up to the decoder only (``decoded_only``) and
    # ``finish`` does the rest in torch, per image (see fastload.pipeline.host_tail)
    finishes_on_cpu = False

    def param_names(self, decoded_only: bool = False) -> dict[str, Any]:
        """``{external source name: numpy dtype}`` of the per-sample parameters the DALI
        graph reads (``params`` computes them all; ``finish`` may use the others)."""
        return {}

    def params(self, seed: int, epoch: int, index: np.ndarray, width: np.ndarray, height: np.ndarray) -> dict:
        return {}

    def graph(self, encoded: Any, params: dict, *, decode_device: str, device: str, decoded_only: bool = False) -> Any:
        raise NotImplementedError

    def finish(self, decoded: Any, params: dict, out: Any) -> None:
        """The rest of a ``decoded_only`` graph's work: DALI's decoded images into ``out``."""
        raise NotImplementedError

    def row_bytes(self) -> int:
        """Bytes of one sample's output(s): what a ring slot holds per row when the CPU finish
        writes into it."""
        return np.dtype(self.out_dtype).itemsize * int(np.prod(self.out_shape))

    def runner(self, *, device: str = "cpu", batch_size: int, num_threads: int | None = None,
               prefetch: int | None = None, seed: int = 0, device_id: int | None = None,
               dali_only: bool = False) -> Runner:
        return Runner(self, device=device, batch_size=batch_size, num_threads=num_threads, prefetch=prefetch,
                      seed=seed, device_id=device_id, dali_only=dali_only)

    def __repr__(self) -> str:
        d = self.describe()
        kind = d.pop("kind")
        return f"fastload.vision.{kind}({', '.join(f'{k}={v!r}' for k, v in d.items())})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Transform) and self.describe() == other.describe()

    def __hash__(self) -> int:
        return hash(repr(self))


class _Normalized(Transform):
    def __init__(self, size, mean, std, dtype, layout, max_pixels):
        self.size = _size("size", size)
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} must be one of {DTYPES}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout={layout!r} must be one of {LAYOUTS}")
        self.dtype = dtype
        self.layout = layout
        if dtype == "uint8":
            if mean is not None or std is not None:
                raise ValueError("dtype='uint8' delivers raw pixels (normalise on the GPU); leave mean/std unset")
            self.mean = self.std = None
        else:
            self.mean = _channels("mean", IMAGENET_MEAN if mean is None else mean)
            self.std = _channels("std", IMAGENET_STD if std is None else std)
            if min(self.std) <= 0:
                raise ValueError(f"std={std!r} must be > 0")
        self.max_pixels = check_int("max_pixels", max_pixels, min=1)
        h, w = self.size
        self.out_shape = (3, h, w) if layout == "CHW" else (h, w, 3)
        self.out_dtype = dtype

    def _common(self) -> dict:
        return {"size": list(self.size), "mean": list(self.mean) if self.mean else None,
                "std": list(self.std) if self.std else None, "dtype": self.dtype, "layout": self.layout,
                "max_pixels": self.max_pixels}

    def _normalize(self, images: Any, *, device: str, mirror: Any = None, crop: Any = None) -> Any:
        from nvidia.dali import fn, types

        kw: dict[str, Any] = {"device": device, "output_layout": self.layout,
                              "dtype": {"float32": types.FLOAT, "float16": types.FLOAT16, "uint8": types.UINT8}[self.dtype]}
        if self.mean is not None and self.std is not None:  # both or neither
            kw["mean"] = [255.0 * m for m in self.mean]
            kw["std"] = [255.0 * s for s in self.std]
        if mirror is not None:
            kw["mirror"] = mirror
        if crop is not None:
            kw["crop"] = crop
            kw["crop_pos_x"] = 0.5
            kw["crop_pos_y"] = 0.5
        return fn.crop_mirror_normalize(images, **kw)

    finishes_on_cpu = True  # torch's resize is ~4x cheaper than DALI's on the CPU (host_tail.py)

    def finish(self, decoded: Any, params: dict, out: Any) -> None:
        from .host_tail import finish_batch

        finish_batch(self, decoded, params, out)


def crop_and_flip(scale: Sequence[float], ratio: Sequence[float], flip: float) -> tuple[tuple, tuple, float]:
    """RandomResizedCrop's ``scale`` (fractions of the image area) and ``ratio``, and a flip
    probability, checked: what ``vision.train`` and ``vision.segmentation`` take alike."""
    s = _pair("scale", scale, 0.0, positive=True)
    if s[1] > 1:
        raise ValueError(f"scale={scale!r}: the high end is a fraction of the image area, <= 1")
    r = _pair("ratio", ratio, 0.0, positive=True)
    if not 0.0 <= float(flip) <= 1.0:
        raise ValueError(f"flip={flip!r} must be a probability in [0, 1]")
    return s, r, float(flip)


class Train(_Normalized):
    """RandomResizedCrop(size, scale, ratio) → horizontal flip(p) → normalize, as torchvision's
    ImageNet recipe; the crop is decoded directly (ROI decoding) where the decoder allows. On
    the CPU the resize, flip and normalize run in torch (``finish``, host_tail.py)."""

    def __init__(self, size: int | Sequence[int] = 224, *, scale: Sequence[float] = (0.08, 1.0),
                 ratio: Sequence[float] = (3 / 4, 4 / 3), flip: float = 0.5,
                 mean: Sequence[float] | None = None, std: Sequence[float] | None = None, dtype: str = "float32",
                 layout: str = "CHW", max_pixels: int = DEFAULT_MAX_PIXELS):
        super().__init__(size, mean, std, dtype, layout, max_pixels)
        self.scale, self.ratio, self.flip = crop_and_flip(scale, ratio, flip)

    def describe(self) -> dict:
        return {"kind": "train", **self._common(), "scale": list(self.scale), "ratio": list(self.ratio),
                "flip": self.flip}

    def param_names(self, decoded_only=False):
        window = {"crop_anchor": np.float32, "crop_shape": np.float32}
        return window if decoded_only else {**window, "flip": np.int32}  # else finish() flips

    def params(self, seed, epoch, index, width, height):
        anchor, shape, flip = train_params(seed, epoch, index, width, height, self.scale, self.ratio, self.flip)
        return {"crop_anchor": anchor, "crop_shape": shape, "flip": flip}

    def graph(self, encoded, params, *, decode_device, device, decoded_only=False):
        from nvidia.dali import fn, types

        images = fn.decoders.image_slice(encoded, params["crop_anchor"], params["crop_shape"],
                                         device=decode_device, output_type=types.RGB, axis_names="WH",
                                         normalized_anchor=False, normalized_shape=False,
                                         adjust_orientation=True)  # the window is in the upright frame
        if decoded_only:
            return images  # resize, flip, normalize: finish()
        h, w = self.size
        images = fn.resize(images, device=device, resize_x=w, resize_y=h, antialias=True)
        return self._normalize(images, device=device, mirror=params["flip"])


class Eval(_Normalized):
    """Resize the shorter side to ``resize`` (default ``size / 0.875``), center crop ``size``,
    normalize: the ImageNet evaluation recipe. On the CPU all but the decode run in torch
    (``finish``, host_tail.py)."""

    def __init__(self, size: int | Sequence[int] = 224, *, resize: int | None = None,
                 mean: Sequence[float] | None = None, std: Sequence[float] | None = None, dtype: str = "float32",
                 layout: str = "CHW", max_pixels: int = DEFAULT_MAX_PIXELS):
        super().__init__(size, mean, std, dtype, layout, max_pixels)
        if resize is None:
            resize = int(round(max(self.size) / 0.875))
        if isinstance(resize, bool) or not isinstance(resize, (int, np.integer)) or resize < max(self.size):
            raise ValueError(f"resize={resize!r} must be an int >= the crop size {max(self.size)}")
        self.resize = int(resize)

    def describe(self) -> dict:
        return {"kind": "eval", **self._common(), "resize": self.resize}

    def graph(self, encoded, params, *, decode_device, device, decoded_only=False):
        from nvidia.dali import fn, types

        images = fn.decoders.image(encoded, device=decode_device, output_type=types.RGB,
                                   adjust_orientation=True)  # upright, as the store's sizes
        if decoded_only:
            return images  # resize, center crop, normalize: finish()
        images = fn.resize(images, device=device, resize_shorter=self.resize, antialias=True)
        return self._normalize(images, device=device, crop=self.size)

    def finish(self, decoded: Any, params: dict, out: Any) -> None:
        from .host_tail import finish_batch

        finish_batch(self, decoded, params, out, resize_shorter=self.resize)  # then the center crop


class Custom(Transform):
    """A user's DALI graph: ``build(encoded, device=...)`` receives the ``external_source``
    node of the encoded bytes and the device for the non-decoder operators ("cpu" or "gpu";
    decode with ``device="mixed" if device == "gpu" else "cpu"``) and returns one node whose
    samples all have ``shape`` and ``dtype``."""

    def __init__(self, build: Callable, *, shape: Sequence[int], dtype: str = "float32", name: str | None = None,
                 max_pixels: int = DEFAULT_MAX_PIXELS):
        if not callable(build):
            raise ValueError(f"custom(build=...) needs a function that builds a DALI graph, got {build!r}")
        try:
            dims = list(shape) if not isinstance(shape, (str, bytes)) else []
        except TypeError:
            dims = []
        if not dims:
            raise ValueError(f"shape={shape!r} must be a non-empty sequence of ints")
        self.out_shape = tuple(check_int(f"shape[{i}]", s, min=1) for i, s in enumerate(dims))  # 2.9 is no size
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} must be one of {DTYPES}")
        self.out_dtype = dtype
        self.build = build
        self.name = name or f"{getattr(build, '__module__', '?')}.{getattr(build, '__qualname__', repr(build))}"
        self.max_pixels = check_int("max_pixels", max_pixels, min=1)

    def describe(self) -> dict:
        return {"kind": "custom", "name": self.name, "shape": list(self.out_shape), "dtype": self.out_dtype,
                "max_pixels": self.max_pixels}

    def graph(self, encoded, params, *, decode_device, device, decoded_only=False):
        return self.build(encoded, device=device)


def train(size: int | Sequence[int] = 224, **kw: Any) -> Train:
    return Train(size, **kw)


def eval(size: int | Sequence[int] = 224, **kw: Any) -> Eval:  # noqa: A001 - the name users expect
    return Eval(size, **kw)


def custom(build: Callable, *, shape: Sequence[int], dtype: str = "float32", **kw: Any) -> Custom:
    return Custom(build, shape=shape, dtype=dtype, **kw)

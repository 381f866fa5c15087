"""``vision.detection``: an SSD-style IoU crop of image and boxes together, resize (or
letterbox), horizontal flip, normalize — one sample transform over ``image``, ``boxes``,
``labels``.

The crop is decided on the host, in numpy, for the whole batch at once (:func:`iou_crop`:
torchvision's ``RandomIoUCrop`` rule, which is also what DALI's ``fn.random_bbox_crop`` does
with ``all_boxes_above_threshold=False``, pixel aspect ratios and 40 attempts), from uniforms
that are a pure function of (seed, epoch, sample index): a resumed run, at any world size,
gives every sample the same window. Only that window is decoded (``fn.decoders.image_slice``,
the ``mixed`` ROI decoder on a GPU). The boxes follow the same window by arithmetic
(:func:`transform_boxes`): boxes whose centre leaves the crop are dropped with their labels,
the rest are clipped to it, scaled to the output image and mirrored with it. Output boxes are
in pixels of the output image.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import BadSamples
from .crops import uniforms
from .multi import SampleTransform, Spec
from .presets import DEFAULT_MAX_PIXELS, _Normalized, _pair

__all__ = ["Detection", "BOX_FORMATS", "iou_crop", "transform_boxes", "letterbox_size"]

BOX_FORMATS = ("xyxy", "xywh", "cxcywh")
ROUNDS = 10  # picks of a minimum IoU before falling back to the whole image (torchvision: unbounded)
TRIALS = 40  # windows tried per pick (torchvision's and SSD's)
ASPECT = (0.5, 2.0)  # the window's width / height, in pixels


def iou_crop(u: np.ndarray, width: np.ndarray, height: np.ndarray, boxes: np.ndarray, valid: np.ndarray,
             scale: tuple[float, float], min_iou: tuple[float, ...]) -> tuple[np.ndarray, np.ndarray]:
    """SSD's random crop, vectorised over a batch: ``(window, whole)``, ``window`` ``(n, 4)``
    float64 ``x0, y0, x1, y1`` in pixels, ``whole`` True where the sample keeps its whole image
    (and every box). ``boxes`` ``(n, L, 4)`` xyxy padded, ``valid`` ``(n, L)``; ``u``:
    ``(n, ROUNDS * (1 + 4 * TRIALS))`` uniforms.

    Per round: pick one of (whole image, any window, each ``min_iou``); then up to TRIALS
    windows of width ``W * U(scale)`` and height ``H * U(scale)`` (independently; width /
    height within ``ASPECT``) at a uniform position; the first window holding the centre of
    at least one box, and whose best IoU with such a box reaches the minimum, is taken. No
    window in ROUNDS rounds: the whole image."""
    n = len(width)
    W = np.asarray(width, np.float64)
    H = np.asarray(height, np.float64)
    u = u.reshape(n, ROUNDS, 1 + 4 * TRIALS)
    thresholds = np.array([np.inf, 0.0, *min_iou])
    window = np.stack([np.zeros(n), np.zeros(n), W, H], axis=1)  # the whole image, unless a round finds one
    whole = np.ones(n, bool)
    todo = np.arange(n)
    cx = (boxes[..., 0] + boxes[..., 2]) / 2
    cy = (boxes[..., 1] + boxes[..., 3]) / 2
    area = (boxes[..., 2] - boxes[..., 0]) * (boxes[..., 3] - boxes[..., 1])
    lo, hi = scale
    for rnd in range(ROUNDS):  # round by round, over the samples still without a decision
        if not len(todo):
            break
        pick = np.minimum((u[todo, rnd, 0] * len(thresholds)).astype(np.int64), len(thresholds) - 1)
        r = u[todo, rnd, 1:].reshape(len(todo), TRIALS, 4)
        w, h = W[todo, None], H[todo, None]
        cw = np.floor(w * (lo + (hi - lo) * r[..., 0]))
        ch = np.floor(h * (lo + (hi - lo) * r[..., 1]))
        with np.errstate(divide="ignore", invalid="ignore"):
            ar = cw / ch
        ok = (cw > 0) & (ch > 0) & (ar >= ASPECT[0]) & (ar <= ASPECT[1])
        left = np.floor((w - cw) * r[..., 2])
        top = np.floor((h - ch) * r[..., 3])
        right, bottom = left + cw, top + ch
        b = boxes[todo][:, None]  # (m, 1, L, 4)
        L, T, R_, B = (a[..., None] for a in (left, top, right, bottom))
        inside = valid[todo][:, None] & (cx[todo][:, None] > L) & (cx[todo][:, None] < R_) \
            & (cy[todo][:, None] > T) & (cy[todo][:, None] < B)
        iw = np.clip(np.minimum(b[..., 2], R_) - np.maximum(b[..., 0], L), 0, None)
        ih = np.clip(np.minimum(b[..., 3], B) - np.maximum(b[..., 1], T), 0, None)
        inter = iw * ih
        with np.errstate(divide="ignore", invalid="ignore"):
            iou = np.where(inside, inter / (area[todo][:, None] + (cw * ch)[..., None] - inter), -1.0)
        good = ok & inside.any(axis=-1) & (iou.max(axis=-1, initial=-1.0) >= thresholds[pick][:, None])  # (m, T)
        keep_whole = pick == 0
        found = ~keep_whole & good.any(axis=-1)
        first = np.argmax(good, axis=-1)
        rows = np.arange(len(todo))
        sel = todo[found]
        window[sel] = np.stack([a[rows, first][found] for a in (left, top, right, bottom)], axis=1)
        whole[sel] = False
        todo = todo[~(found | keep_whole)]
    return window, whole


def letterbox_size(cw: np.ndarray, ch: np.ndarray, size: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """``(h, w)`` of a ``cw`` x ``ch`` window resized to fit ``size`` keeping its aspect."""
    s = np.minimum(size[0] / ch, size[1] / cw)
    return (np.clip(np.rint(ch * s), 1, size[0]), np.clip(np.rint(cw * s), 1, size[1]))


def transform_boxes(boxes: np.ndarray, lengths: np.ndarray, window: np.ndarray, keep_all: np.ndarray,
                    out_hw: tuple[np.ndarray, np.ndarray], flip: np.ndarray, canvas_w: int,
                    box_format: str = "xyxy") -> tuple[np.ndarray, np.ndarray]:
    """The boxes of a batch after its crops: ``(boxes, kept)``, ``kept`` a bool mask over the
    input boxes (the labels to keep). ``boxes`` ``(T, 4)`` xyxy of every sample one after the
    other (``lengths``); per sample ``window`` ``x0, y0, x1, y1``, ``keep_all`` (no centre
    rule: the whole image), the size ``out_hw`` the window is resized to, ``flip`` (mirror
    the ``canvas_w`` wide output)."""
    lengths = np.asarray(lengths, np.int64)
    rep = lambda a: np.repeat(np.asarray(a, np.float64), lengths)  # noqa: E731 - per box
    b = np.asarray(boxes, np.float64).reshape(-1, 4)
    x0, y0, x1, y1 = (rep(window[:, k]) for k in range(4))
    cx = (b[:, 0] + b[:, 2]) / 2
    cy = (b[:, 1] + b[:, 3]) / 2
    kept = np.repeat(np.asarray(keep_all, bool), lengths) | ((cx > x0) & (cx < x1) & (cy > y0) & (cy < y1))
    sx = rep(out_hw[1]) / (x1 - x0)
    sy = rep(out_hw[0]) / (y1 - y0)
    nb = np.empty_like(b)
    nb[:, 0] = (np.clip(b[:, 0], x0, x1) - x0) * sx
    nb[:, 2] = (np.clip(b[:, 2], x0, x1) - x0) * sx
    nb[:, 1] = (np.clip(b[:, 1], y0, y1) - y0) * sy
    nb[:, 3] = (np.clip(b[:, 3], y0, y1) - y0) * sy
    f = np.repeat(np.asarray(flip, bool), lengths)
    nb[f, 0], nb[f, 2] = canvas_w - nb[f, 2], canvas_w - nb[f, 0]
    nb = nb[kept]
    if box_format == "xywh":
        nb[:, 2:] -= nb[:, :2]
    elif box_format == "cxcywh":
        wh = nb[:, 2:] - nb[:, :2]
        nb[:, :2] += wh / 2
        nb[:, 2:] = wh
    return nb.astype(np.float32), kept


def _padded(values: list, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    L = int(lengths.max(initial=0))
    out = np.zeros((len(values), max(L, 1), 4))
    valid = np.arange(max(L, 1))[None, :] < lengths[:, None]
    if len(lengths) and lengths.sum():
        out[valid] = np.concatenate(values).reshape(-1, 4)
    return out, valid


class Detection(SampleTransform, _Normalized):
    """See the module docstring and :func:`fastload.vision.detection`."""

    host_outputs = ("boxes", "labels", "crop", "flip")

    def __init__(self, size=512, *, scale=(0.3, 1.0), min_iou=(0.1, 0.3, 0.5, 0.7, 0.9), flip: float = 0.5,
                 crop: bool = True, letterbox: bool = False, mean=None, std=None, dtype: str = "float32",
                 layout: str = "CHW", box_format: str = "xyxy", return_crop: bool = False, image: str = "image",
                 boxes: str = "boxes", labels: str = "labels", max_pixels: int = DEFAULT_MAX_PIXELS):
        _Normalized.__init__(self, size, mean, std, dtype, layout, max_pixels)
        self.scale = _pair("scale", scale, 0.0, positive=True)
        if self.scale[1] > 1:
            raise ValueError(f"scale={scale!r}: the high end is a fraction of the image side, <= 1")
        try:
            self.min_iou = tuple(float(x) for x in min_iou)
        except (TypeError, ValueError):
            raise ValueError(f"min_iou={min_iou!r} must be a sequence of IoU thresholds in [0, 1]") from None
        if not all(0.0 <= x <= 1.0 for x in self.min_iou):
            raise ValueError(f"min_iou={min_iou!r} must be IoU thresholds in [0, 1]")
        if not 0.0 <= float(flip) <= 1.0:
            raise ValueError(f"flip={flip!r} must be a probability in [0, 1]")
        self.flip = float(flip)
        for name, v in (("crop", crop), ("letterbox", letterbox), ("return_crop", return_crop)):
            if not isinstance(v, bool):
                raise ValueError(f"{name}={v!r} must be True or False")
        self.crop, self.letterbox, self.return_crop = crop, letterbox, return_crop
        if box_format not in BOX_FORMATS:
            raise ValueError(f"box_format={box_format!r} must be one of {BOX_FORMATS}")
        self.box_format = box_format
        for name, v in (("image", image), ("boxes", boxes), ("labels", labels)):
            if not isinstance(v, str) or not v:
                raise ValueError(f"{name}={v!r} must be the name of a field")
        self.inputs = {"image": image, "boxes": boxes, "labels": labels}
        self.outputs = {"image": Spec(self.out_shape, self.dtype), "boxes": Spec((None, 4), "float32"),
                        "labels": Spec((None,), "int64")}
        if return_crop:
            self.outputs.update(crop=Spec((4,), "float32"), flip=Spec((), "bool"))

    def describe(self) -> dict:
        return {"kind": "detection", **self._common(), "scale": list(self.scale), "min_iou": list(self.min_iou),
                "flip": self.flip, "crop": self.crop, "letterbox": self.letterbox, "box_format": self.box_format,
                "return_crop": self.return_crop, "inputs": dict(self.inputs)}

    def bind(self, fields) -> None:
        super().bind(fields)
        for n in ("boxes", "labels"):
            if n in self._image_inputs:
                raise ValueError(f"{self!r}: {n}={self.inputs[n]!r} is an image field")
        b, lab = fields[self.inputs["boxes"]], fields[self.inputs["labels"]]
        if not b.ragged or tuple(b.shape) != (4,):
            raise ValueError(f"{self!r}: field {self.inputs['boxes']!r} is {b}; boxes are a ragged field of "
                             "items of 4 (x0, y0, x1, y1 pixels), e.g. 'float32[*,4]'")
        if not lab.ragged or tuple(lab.shape) != ():
            raise ValueError(f"{self!r}: field {self.inputs['labels']!r} is {lab}; labels are a ragged field of "
                             "scalars, one per box, e.g. 'int64[]'")

    def param_names(self, decoded_only=False):
        window = {"crop_anchor": np.float32, "crop_shape": np.float32}
        if decoded_only:
            return window
        extra = {"resize_x": np.float32, "resize_y": np.float32} if self.letterbox else {}
        return {**window, "flip": np.int32, **extra}

    def prepare(self, seed, epoch, index, data):
        widths, heights = (np.asarray(a, np.float64) for a in data["image"])
        boxes, labels = data["boxes"], data["labels"]
        n = len(index)
        lengths = np.array([len(b) for b in boxes], np.int64)
        nlabels = np.array([len(x) for x in labels], np.int64)
        differ = np.flatnonzero(lengths != nlabels)
        if len(differ):  # (BadSamples: named, or replaced under on_error="skip", as an undecodable image)
            raise BadSamples(differ, [f"{int(lengths[i])} boxes but {int(nlabels[i])} labels; every box needs one "
                                      "label" for i in differ])
        u = uniforms(seed, epoch, index, ROUNDS * (1 + 4 * TRIALS) + 1, stream=11)
        if self.crop:
            padded, valid = _padded(boxes, lengths)
            window, whole = iou_crop(u[:, :-1], widths, heights, padded, valid, self.scale, self.min_iou)
        else:
            window = np.stack([np.zeros(n), np.zeros(n), widths, heights], axis=1)
            whole = np.ones(n, bool)
        flip = u[:, -1] < self.flip
        cw, ch = window[:, 2] - window[:, 0], window[:, 3] - window[:, 1]
        size_h, size_w = self.size
        out_hw = letterbox_size(cw, ch, self.size) if self.letterbox else (np.full(n, size_h), np.full(n, size_w))
        flat = np.concatenate(boxes).reshape(-1, 4) if lengths.sum() else np.zeros((0, 4), np.float32)
        nb, kept = transform_boxes(flat, lengths, window, whole, out_hw, flip, size_w, self.box_format)
        lab = np.concatenate(labels).astype(np.int64) if lengths.sum() else np.zeros(0, np.int64)
        owner = np.repeat(np.arange(n), lengths)
        new_len = np.bincount(owner[kept], minlength=n).astype(np.int64)
        params = {"crop_anchor": window[:, :2].astype(np.float32),
                  "crop_shape": np.stack([cw, ch], 1).astype(np.float32), "flip": flip.astype(np.int32),
                  "resize_x": out_hw[1].astype(np.float32), "resize_y": out_hw[0].astype(np.float32)}
        host: dict[str, Any] = {"boxes": (nb, new_len), "labels": (lab[kept], new_len)}
        if self.return_crop:
            host.update(crop=window.astype(np.float32), flip=flip)
        return params, host

    def graph(self, inputs, params, *, decode_device, device, decoded_only=False):
        from nvidia.dali import fn, types

        images = fn.decoders.image_slice(inputs["image"], params["crop_anchor"], params["crop_shape"],
                                         device=decode_device, output_type=types.RGB, axis_names="WH",
                                         normalized_anchor=False, normalized_shape=False, adjust_orientation=True)
        if decoded_only:
            return {"image": images}
        h, w = self.size
        if not self.letterbox:
            images = fn.resize(images, device=device, resize_x=w, resize_y=h, antialias=True)
            return {"image": self._normalize(images, device=device, mirror=params["flip"])}
        images = fn.resize(images, device=device, resize_x=params["resize_x"], resize_y=params["resize_y"],
                           antialias=True)
        images = self._normalize(images, device=device)
        images = fn.pad(images, device=device, axis_names="HW", shape=[h, w], fill_value=0)
        return {"image": fn.flip(images, device=device, horizontal=params["flip"])}

    def finish(self, decoded, params, out) -> None:
        if not self.letterbox:
            from .host_tail import finish_batch

            finish_batch(self, decoded["image"], params, out["image"])
            return
        from .host_tail import finish_letterbox

        finish_letterbox(self, decoded["image"], params, out["image"])

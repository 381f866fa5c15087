"""``vision.segmentation``: an image and its mask (a stored single-channel PNG, one class id
per pixel) cropped and flipped with the same window, the image resized with antialiasing and
normalized, the mask resized nearest-neighbour (ids are never interpolated).

The window is torchvision's ``RandomResizedCrop`` window (:func:`~fastload.pipeline.crops.
train_params`, a pure function of (seed, epoch, sample index)); both images are decoded
through it (``fn.decoders.image_slice``: the ``mixed`` ROI decoder on a GPU).
"""
from __future__ import annotations

import numpy as np

from ..errors import BadSamples
from .crops import train_params
from .multi import SampleTransform, Spec
from .presets import DEFAULT_MAX_PIXELS, _Normalized, crop_and_flip

__all__ = ["Segmentation", "MASK_DTYPES"]

MASK_DTYPES = ("int64", "uint8")


class Segmentation(SampleTransform, _Normalized):
    """See the module docstring and :func:`fastload.vision.segmentation`."""

    host_outputs = ("crop", "flip")

    def __init__(self, size=512, *, scale=(0.25, 1.0), ratio=(3 / 4, 4 / 3), flip: float = 0.5, crop: bool = True,
                 mean=None, std=None, dtype: str = "float32", layout: str = "CHW", mask_dtype: str = "int64",
                 return_crop: bool = False, image: str = "image", mask: str = "mask",
                 max_pixels: int = DEFAULT_MAX_PIXELS):
        _Normalized.__init__(self, size, mean, std, dtype, layout, max_pixels)
        self.scale, self.ratio, self.flip = crop_and_flip(scale, ratio, flip)
        for name, v in (("crop", crop), ("return_crop", return_crop)):
            if not isinstance(v, bool):
                raise ValueError(f"{name}={v!r} must be True or False")
        self.crop, self.return_crop = crop, return_crop
        if mask_dtype not in MASK_DTYPES:
            raise ValueError(f"mask_dtype={mask_dtype!r} must be one of {MASK_DTYPES}")
        self.mask_dtype = mask_dtype
        self.inputs = {"image": image, "mask": mask}
        self.outputs = {"image": Spec(self.out_shape, self.dtype), "mask": Spec(self.size, mask_dtype)}
        if return_crop:
            self.outputs.update(crop=Spec((4,), "float32"), flip=Spec((), "bool"))

    def describe(self) -> dict:
        return {"kind": "segmentation", **self._common(), "scale": list(self.scale), "ratio": list(self.ratio),
                "flip": self.flip, "crop": self.crop, "mask_dtype": self.mask_dtype,
                "return_crop": self.return_crop, "inputs": dict(self.inputs)}

    def bind(self, fields) -> None:
        super().bind(fields)
        if "mask" not in self._image_inputs:
            raise ValueError(f"{self!r}: mask={self.inputs['mask']!r} must be an image field (a single-channel PNG "
                             f"of class ids), not {fields[self.inputs['mask']]}")

    def param_names(self, decoded_only=False):
        window = {"crop_anchor": np.float32, "crop_shape": np.float32}
        return window if decoded_only else {**window, "flip": np.int32}

    def prepare(self, seed, epoch, index, data):
        (w, h), (mw, mh) = data["image"], data["mask"]
        differ = np.flatnonzero((np.asarray(w) != np.asarray(mw)) | (np.asarray(h) != np.asarray(mh)))
        if len(differ):
            raise BadSamples(differ, [f"its mask {self.inputs['mask']!r} is {int(mw[i])}x{int(mh[i])}, its image "
                                      f"{int(w[i])}x{int(h[i])}; a mask has the size of its image" for i in differ])
        anchor, shape, flip = train_params(seed, epoch, index, w, h, self.scale, self.ratio, self.flip)
        if not self.crop:
            anchor = np.zeros_like(anchor)
            shape = np.stack([np.asarray(w), np.asarray(h)], 1).astype(np.float32)
        params = {"crop_anchor": anchor, "crop_shape": shape, "flip": flip}
        host = {}
        if self.return_crop:
            host = {"crop": np.concatenate([anchor, anchor + shape], 1).astype(np.float32), "flip": flip.astype(bool)}
        return params, host

    def graph(self, inputs, params, *, decode_device, device, decoded_only=False):
        from nvidia.dali import fn, types

        window = dict(axis_names="WH", normalized_anchor=False, normalized_shape=False, adjust_orientation=True)
        images = fn.decoders.image_slice(inputs["image"], params["crop_anchor"], params["crop_shape"],
                                         device=decode_device, output_type=types.RGB, **window)
        masks = fn.decoders.image_slice(inputs["mask"], params["crop_anchor"], params["crop_shape"],
                                        device=decode_device, output_type=types.GRAY, **window)
        if decoded_only:
            return {"image": images, "mask": masks}
        h, w = self.size
        images = fn.resize(images, device=device, resize_x=w, resize_y=h, antialias=True)
        masks = fn.resize(masks, device=device, resize_x=w, resize_y=h, interp_type=types.INTERP_NN, antialias=False)
        masks = fn.squeeze(fn.flip(masks, device=device, horizontal=params["flip"]), device=device, axis_names="C")
        if self.mask_dtype != "uint8":
            masks = fn.cast(masks, device=device, dtype=types.INT64)
        return {"image": self._normalize(images, device=device, mirror=params["flip"]), "mask": masks}

    def finish(self, decoded, params, out) -> None:
        from .host_tail import finish_batch, finish_masks

        finish_batch(self, decoded["image"], params, out["image"])
        finish_masks(decoded["mask"], params, out["mask"])

"""The baseline that ``fastload bench --compare torch``, ``fastload demo`` and
``bench/bench_jpeg.py`` measure fastload against: ``torch.utils.data.DataLoader`` doing the
same work per image with PIL, as a user without fastload writes it (torchvision itself is not
used; see docs/benchmarks.md).

The work per image is the work of the fastload transform it stands beside:

* ``Train``: decode upright (EXIF orientation applied, as DALI decodes), RandomResizedCrop
  with the *same* window as the Loader for the same (seed, epoch, sample index) -- the window
  comes from :func:`fastload.pipeline.crops.train_params` (``random_resized_crop`` over
  ``uniforms``, including its fallback: the central crop with the ratio clamped) -- resize to
  the output size, the same horizontal flip, normalise, float32 CHW;
* ``Eval``: resize the shorter side to ``resize``, center crop, normalise, float32 CHW.

The (epoch, index) of each sample reaches the DataLoader's workers through the sampler
(:class:`EpochSampler` yields ``(epoch, index)`` pairs), so persistent workers draw the
windows of the current epoch without any state shared with the main process.
"""
from __future__ import annotations

import io
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

__all__ = ["EPOCH_KEY", "INDEX_KEY", "EpochSampler", "ImageCollate", "PILImageWork", "TaggedDataset"]

EPOCH_KEY, INDEX_KEY = "__epoch__", "__index__"


class PILImageWork:
    """One image's decode and augmentation with PIL, for a ``fastload.vision`` ``Train`` or
    ``Eval`` transform: ``work(data, index, epoch)`` -> float32 CHW numpy array."""

    def __init__(self, transform, *, seed: int = 0):
        from ..pipeline.presets import Eval, Train

        if not isinstance(transform, (Train, Eval)) or transform.dtype != "float32" or transform.layout != "CHW":
            raise ValueError(f"the PIL baseline does vision.train/vision.eval with dtype='float32', layout='CHW'; "
                             f"got {transform!r}")
        self.transform = transform
        self.train = isinstance(transform, Train)
        self.seed = int(seed)
        self.mean = np.asarray(transform.mean, np.float32)
        self.std = np.asarray(transform.std, np.float32)

    def window(self, index: int, epoch: int, width: int, height: int) -> tuple[int, int, int, int, bool]:
        """(x, y, w, h, flip) of a training crop: what the Loader uses for this sample."""
        from ..pipeline.crops import train_params

        t = self.transform
        anchor, shape, flip = train_params(self.seed, epoch, np.array([index], np.int64), np.array([width]),
                                           np.array([height]), t.scale, t.ratio, t.flip)
        (x, y), (w, h) = anchor[0].astype(int), shape[0].astype(int)
        return int(x), int(y), int(w), int(h), bool(flip[0])

    def __call__(self, data: bytes, index: int = 0, epoch: int = 0) -> np.ndarray:
        from PIL import Image, ImageOps

        img = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")
        W, H = img.size
        oh, ow = self.transform.size
        if self.train:
            x, y, w, h, flip = self.window(index, epoch, W, H)
            img = img.resize((ow, oh), Image.BILINEAR, box=(x, y, x + w, y + h))
            if flip:
                img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        else:
            r = self.transform.resize
            k = r / min(W, H)
            img = img.resize((max(r, round(W * k)), max(r, round(H * k))), Image.BILINEAR)
            w2, h2 = img.size
            left, top = (w2 - ow) // 2, (h2 - oh) // 2
            img = img.crop((left, top, left + ow, top + oh))
        a = (np.asarray(img, np.float32) / 255.0 - self.mean) / self.std
        return np.ascontiguousarray(a.transpose(2, 0, 1))


class EpochSampler:
    """Wraps a sampler of indices (e.g. ``DistributedSampler``) to yield ``(epoch, index)``
    pairs, so that the dataset knows each sample's epoch in any worker process."""

    def __init__(self, sampler):
        self.sampler = sampler
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        e = self.epoch
        return ((e, int(i)) for i in self.sampler)


class TaggedDataset:
    """A map-style dataset over ``fastload.Dataset`` keyed by ``(epoch, index)`` pairs: each
    sample dict also carries its epoch and index (under EPOCH_KEY / INDEX_KEY). The batched
    ``__getitems__`` keeps the one vectorised gather of ``fastload.Dataset``."""

    def __init__(self, ds):
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, key: tuple[int, int]) -> dict:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: Sequence[tuple[int, int]]) -> list[dict]:
        samples = self.ds.__getitems__([i for _, i in keys])
        for s, (e, i) in zip(samples, keys):
            s[EPOCH_KEY], s[INDEX_KEY] = e, i
        return samples


class ImageCollate:
    """``collate_fn`` for :class:`TaggedDataset` samples: the image field through
    :class:`PILImageWork`, stacked as a float32 tensor under "image"; scalar and tensor
    fields stacked as they are."""

    def __init__(self, image_field: str, work: PILImageWork):
        self.field, self.work = image_field, work

    def __call__(self, samples: list[dict]) -> dict[str, Any]:
        import torch

        out = {"image": torch.from_numpy(np.stack([self.work(s[self.field], s[INDEX_KEY], s[EPOCH_KEY])
                                                   for s in samples]))}
        for k, v in samples[0].items():
            if k not in (self.field, EPOCH_KEY, INDEX_KEY) and isinstance(
                    v, (int, float, np.integer, np.floating, np.ndarray)):
                out[k] = torch.as_tensor(np.stack([s[k] for s in samples]))
        return out

"""vision.segmentation through the Loader: the mask against a nearest-neighbour numpy
reference of each sample's window, image and mask aligned after crop and flip, dtypes, and a
mask whose size is not its image's."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import fastload
from fastload import vision
from fastload.errors import DecodeError
from fastload.store import ShardWriter

from test_detection import PALETTE, SIZES, _png, make_boxes_dataset


@pytest.fixture(scope="module")
def seg_ds(tmp_path_factory):
    return make_boxes_dataset(tmp_path_factory.mktemp("seg") / "ds", n=24, seed=4)


def nearest(m: np.ndarray, size: int) -> np.ndarray:
    """``m`` resized to size x size by the source pixel under each output pixel's centre."""
    h, w = m.shape
    ys = np.minimum(np.floor((np.arange(size) + 0.5) * h / size).astype(int), h - 1)
    xs = np.minimum(np.floor((np.arange(size) + 0.5) * w / size).astype(int), w - 1)
    return m[ys][:, xs]


def _mask(ds, i: int) -> np.ndarray:
    return fastload.vision.decode(ds[i]["mask"]).numpy()[..., 0]


def test_masks_match_a_nearest_reference_of_each_window(seg_ds):
    size = 40
    t = vision.segmentation(size, return_crop=True)
    flips = crops = 0
    with fastload.Loader(seg_ds, batch_size=8, transforms=t, seed=2) as lo:
        for b in lo:
            assert b["mask"].dtype == torch.int64 and b["mask"].shape[1:] == (size, size)
            for i, idx in enumerate(b["index"].tolist()):
                x0, y0, x1, y1 = (int(v) for v in b["crop"][i].tolist())
                want = nearest(_mask(seg_ds, idx)[y0:y1, x0:x1], size)
                if b["flip"][i]:
                    want = want[:, ::-1]
                assert np.array_equal(b["mask"][i].numpy(), want), idx
                flips += int(b["flip"][i])
                crops += int((x1 - x0, y1 - y0) != SIZES[idx % len(SIZES)])
    assert 2 < flips < 22 and crops > 5


def test_image_and_mask_stay_aligned(seg_ds):
    """Each region of the image was drawn in the colour of its class id in the mask: after
    crop, resize and flip, the pixels inside a region (its neighbours of the same class) still
    have that colour."""
    t = vision.segmentation(64, dtype="uint8", layout="HWC", mask_dtype="uint8")
    agree = total = 0
    with fastload.Loader(seg_ds, batch_size=6, transforms=t, seed=7) as lo:
        for b in lo:
            assert b["mask"].dtype == torch.uint8
            for img, m in zip(b["image"].numpy().astype(int), b["mask"].numpy()):
                inner = np.ones_like(m, bool)
                for dy in (-1, 0, 1):
                    for dx in (-1, 0, 1):
                        inner &= np.roll(np.roll(m, dy, 0), dx, 1) == m
                inner[[0, -1], :] = inner[:, [0, -1]] = False
                colour = np.where(m[..., None] == 0, 40, PALETTE[m].astype(int))
                ok = np.abs(img - colour).max(-1) < 30
                agree += int(ok[inner].sum())
                total += int(inner.sum())
    assert total > 10_000 and agree / total > 0.99, agree / total


def test_no_crop_mirrors_the_whole_mask(seg_ds):
    t = vision.segmentation(32, crop=False, flip=1.0)
    with fastload.Loader(seg_ds, batch_size=4, transforms=t, shuffle=False) as lo:
        b = next(iter(lo))
    for i in range(4):
        assert np.array_equal(b["mask"][i].numpy(), nearest(_mask(seg_ds, i), 32)[:, ::-1])


def test_a_mask_of_another_size_is_named(tmp_path):
    img = np.zeros((40, 50, 3), np.uint8)
    with ShardWriter(tmp_path / "ds", {"image": "image", "mask": "image"}) as w:
        for i in range(4):
            m = np.zeros((40, 50) if i != 2 else (20, 50), np.uint8)
            w.write({"image": _png(img), "mask": _png(m, "L")}, key=f"s{i}")
    with pytest.raises(DecodeError, match=r"key 's2'.*mask 'mask' is 50x20, its image 50x40"), \
            fastload.Loader(tmp_path / "ds", batch_size=4, transforms=vision.segmentation(16)) as lo:
        next(iter(lo))


def test_bad_segmentation_arguments(seg_ds):
    with pytest.raises(ValueError, match="mask_dtype"):
        vision.segmentation(32, mask_dtype="float32")
    with pytest.raises(ValueError, match="mask='boxes' must be an image field"):
        fastload.Loader(seg_ds, batch_size=4, transforms=vision.segmentation(32, mask="boxes"))

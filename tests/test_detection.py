"""vision.detection through the Loader: boxes against a numpy reference given each sample's
crop window, boxes against the pixels drawn under them, labels with their boxes, exact
scaling without a crop, mirroring, the same crops after a resume at another world size, the
ragged delivery forms, and the arguments' errors."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

import fastload
from fastload import vision
from fastload.errors import DecodeError
from fastload.store import ShardWriter

# one saturated colour per label (1..12): the pixels under a box say whose box it is
PALETTE = np.array([[0, 0, 0], [255, 0, 0], [0, 255, 0], [0, 0, 255], [255, 255, 0], [255, 0, 255],
                    [0, 255, 255], [255, 128, 0], [128, 0, 255], [0, 128, 255], [255, 255, 255],
                    [128, 255, 0], [255, 0, 128]], np.uint8)
SIZES = [(200, 150), (160, 160), (120, 180), (240, 120)]


def _png(a: np.ndarray, mode: str | None = None) -> bytes:
    b = io.BytesIO()
    Image.fromarray(a, mode).save(b, "PNG")
    return b.getvalue()


def make_boxes_dataset(path, n: int = 36, seed: int = 0, bad: int | None = None):
    """Images of several sizes with 0..12 non-overlapping boxes each (one per cell of a 4x3
    grid), each box filled with the colour of its label; the mask holds the label per pixel."""
    rng = np.random.default_rng(seed)
    with ShardWriter(path, {"image": "image", "boxes": "float32[*,4]", "labels": "int64[]", "iscrowd": "bool[]",
                            "mask": "image", "weight": "float32"}, shard_size=60_000) as w:
        for i in range(n):
            W, H = SIZES[i % len(SIZES)]
            img = np.full((H, W, 3), 40, np.uint8)
            mask = np.zeros((H, W), np.uint8)
            cells = rng.permutation(12)[:int(rng.integers(0, 13)) if i % 7 else 0]
            boxes, labels = [], []
            for c in cells:
                cx0, cy0 = (c % 4) * W // 4, (c // 4) * H // 3
                cw, ch = W // 4, H // 3
                bw, bh = int(rng.integers(8, cw - 3)), int(rng.integers(8, ch - 3))
                x0, y0 = cx0 + 1 + int(rng.integers(0, cw - bw - 1)), cy0 + 1 + int(rng.integers(0, ch - bh - 1))
                lab = int(c) + 1
                img[y0:y0 + bh, x0:x0 + bw] = PALETTE[lab]
                mask[y0:y0 + bh, x0:x0 + bw] = lab
                boxes.append([x0, y0, x0 + bw, y0 + bh])
                labels.append(lab)
            enc = _png(img) if i != bad else _png(img)[:120]  # a header, then nothing
            w.write({"image": enc, "boxes": np.array(boxes, np.float32).reshape(-1, 4),
                     "labels": np.array(labels, np.int64), "iscrowd": np.zeros(len(boxes), bool),
                     "mask": _png(mask, "L"), "weight": float(i)}, key=f"img{i:03d}.png")
    return fastload.Dataset(path)


@pytest.fixture(scope="module")
def boxes_ds(tmp_path_factory):
    return make_boxes_dataset(tmp_path_factory.mktemp("det") / "ds")


def reference(ds, index: int, crop: np.ndarray, flip: bool, size: int, hw=None):
    """The boxes and labels of sample ``index`` after the window ``crop`` (x0, y0, x1, y1),
    a resize of the window to ``hw`` (default size x size) and a mirror of the size-wide
    canvas, one box at a time."""
    s = ds[index]
    x0, y0, x1, y1 = (float(v) for v in crop)
    h, w = hw if hw is not None else (size, size)
    out, labs = [], []
    for b, lab in zip(s["boxes"].tolist(), s["labels"].tolist()):
        cx, cy = (b[0] + b[2]) / 2, (b[1] + b[3]) / 2
        if not (x0 < cx < x1 and y0 < cy < y1):
            continue
        bx0, bx1 = [(min(max(v, x0), x1) - x0) * w / (x1 - x0) for v in (b[0], b[2])]
        by0, by1 = [(min(max(v, y0), y1) - y0) * h / (y1 - y0) for v in (b[1], b[3])]
        if flip:
            bx0, bx1 = size - bx1, size - bx0
        out.append([bx0, by0, bx1, by1])
        labs.append(lab)
    return np.array(out, np.float64).reshape(-1, 4), np.array(labs, np.int64)


def _rows(batch, name):
    """Per-sample arrays of a padded ragged key."""
    v, n = batch[name].numpy(), batch[name + "_lengths"].numpy()
    return [v[i, :n[i]] for i in range(len(n))]


def _all(loader):
    return [b for b in loader]


def test_boxes_match_a_numpy_reference_given_each_crop(boxes_ds):
    size = 64
    t = vision.detection(size, return_crop=True)
    with fastload.Loader(boxes_ds, batch_size=8, transforms=t, seed=3) as lo:
        batches = _all(lo)
    assert {"image", "boxes", "boxes_lengths", "labels", "labels_lengths", "crop", "flip", "index", "weight"} \
        == set(batches[0])
    cropped = flipped = dropped = 0
    for b in batches:
        assert b["image"].shape[1:] == (3, size, size) and b["image"].dtype == torch.float32
        assert torch.equal(b["boxes_lengths"], b["labels_lengths"])
        for i, (bx, lab) in enumerate(zip(_rows(b, "boxes"), _rows(b, "labels"))):
            idx = int(b["index"][i])
            crop = b["crop"][i].numpy()
            W, H = SIZES[idx % len(SIZES)]
            assert 0 <= crop[0] < crop[2] <= W and 0 <= crop[1] < crop[3] <= H
            ref, ref_lab = reference(boxes_ds, idx, crop, bool(b["flip"][i]), size)
            np.testing.assert_allclose(bx, ref, atol=1e-3, err_msg=f"sample {idx}")
            assert lab.tolist() == ref_lab.tolist(), idx  # labels stay with their boxes
            assert ((bx >= 0) & (bx <= size)).all() and (bx[:, 2] >= bx[:, 0]).all() and (bx[:, 3] >= bx[:, 1]).all()
            assert float(b["weight"][i]) == idx  # other fields come along, row by row
            cropped += int((crop[2] - crop[0], crop[3] - crop[1]) != (W, H))
            flipped += int(b["flip"][i])
            dropped += len(boxes_ds[idx]["boxes"]) - len(bx)
        pad = b["boxes"].numpy()[np.arange(b["boxes"].shape[1])[None, :] >= b["boxes_lengths"].numpy()[:, None]]
        assert (pad == 0).all()
    assert cropped > 5 and 3 < flipped < 33 and dropped > 0  # the test saw crops, flips and dropped boxes


def test_pixels_under_each_box_have_its_labels_colour(boxes_ds):
    """Image and boxes go through the same crop, resize and flip: the output pixels inside
    each box (2 px in from its edges) have the colour its label was drawn in."""
    with fastload.Loader(boxes_ds, batch_size=12, transforms=vision.detection(96, dtype="uint8", layout="HWC"),
                         seed=5) as lo:
        checked = 0
        for b in lo:
            for i, (bx, lab) in enumerate(zip(_rows(b, "boxes"), _rows(b, "labels"))):
                img = b["image"][i].numpy().astype(np.float64)
                for (x0, y0, x1, y1), lb in zip(bx, lab):
                    xa, xb = int(np.ceil(x0)) + 2, int(np.floor(x1)) - 2
                    ya, yb = int(np.ceil(y0)) + 2, int(np.floor(y1)) - 2
                    if xb <= xa or yb <= ya:
                        continue
                    mean = img[ya:yb, xa:xb].reshape(-1, 3).mean(0)
                    assert np.abs(mean - PALETTE[lb]).max() < 25, (int(b["index"][i]), lb, mean)
                    checked += 1
    assert checked > 50


def test_no_crop_no_flip_scales_boxes_exactly_and_flip_one_mirrors(boxes_ds):
    size = 80
    idx = np.arange(len(boxes_ds))
    for flip in (0.0, 1.0):
        t = vision.detection(size, crop=False, flip=flip)
        with fastload.Loader(boxes_ds, batch_size=36, transforms=t, shuffle=False) as lo:
            b = next(iter(lo))
        assert b["index"].tolist() == idx.tolist()
        for i, bx in enumerate(_rows(b, "boxes")):
            s = boxes_ds[i]
            W, H = SIZES[i % len(SIZES)]
            want = s["boxes"].astype(np.float64) * [size / W, size / H, size / W, size / H]
            if flip:
                want[:, [0, 2]] = size - want[:, [2, 0]]
            np.testing.assert_allclose(bx, want, rtol=1e-6, atol=1e-4)
            assert _rows(b, "labels")[i].tolist() == s["labels"].tolist()
    # the mirrored image is the plain one, mirrored
    with fastload.Loader(boxes_ds, batch_size=4, transforms=vision.detection(size, crop=False, flip=0.0),
                         shuffle=False) as a, \
            fastload.Loader(boxes_ds, batch_size=4, transforms=vision.detection(size, crop=False, flip=1.0),
                            shuffle=False) as m:
        pa, pm = next(iter(a)), next(iter(m))
    assert torch.allclose(pa["image"].flip(-1), pm["image"], atol=1e-5)


def test_letterbox_keeps_the_aspect_and_boxes_follow(boxes_ds):
    size = 64
    t = vision.detection(size, letterbox=True, return_crop=True, dtype="uint8")
    with fastload.Loader(boxes_ds, batch_size=9, transforms=t, seed=2) as lo:
        for b in lo:
            for i, bx in enumerate(_rows(b, "boxes")):
                crop = b["crop"][i].numpy().astype(np.float64)
                cw, ch = crop[2] - crop[0], crop[3] - crop[1]
                s = min(size / cw, size / ch)
                hw = (min(size, max(1, round(ch * s))), min(size, max(1, round(cw * s))))
                ref, _ = reference(boxes_ds, int(b["index"][i]), crop, bool(b["flip"][i]), size, hw)
                np.testing.assert_allclose(bx, ref, atol=1e-3)
                img = b["image"][i]  # padded with 0 below and beside the image (the side it was mirrored to)
                h, w = hw
                if h < size:
                    assert int(img[:, h:, :].max()) == 0
                if w < size:
                    pad = img[:, :, :size - w] if b["flip"][i] else img[:, :, w:]
                    assert int(pad.max()) == 0


@pytest.mark.parametrize("fmt", ["xywh", "cxcywh"])
def test_box_formats(boxes_ds, fmt):
    kw = dict(crop=False, flip=0.0)
    with fastload.Loader(boxes_ds, batch_size=12, transforms=vision.detection(48, **kw), shuffle=False) as a, \
            fastload.Loader(boxes_ds, batch_size=12, transforms=vision.detection(48, box_format=fmt, **kw),
                            shuffle=False) as c:
        xyxy, other = next(iter(a))["boxes"], next(iter(c))["boxes"]
    wh = xyxy[..., 2:] - xyxy[..., :2]
    want = torch.cat([xyxy[..., :2], wh], -1) if fmt == "xywh" else torch.cat([xyxy[..., :2] + wh / 2, wh], -1)
    assert torch.allclose(other, want, atol=1e-5)


def test_packed_boxes_and_pad_value(boxes_ds):
    t = vision.detection(48, return_crop=True)
    with fastload.Loader(boxes_ds, batch_size=8, transforms=t, seed=1) as a, \
            fastload.Loader(boxes_ds, batch_size=8, transforms=t, seed=1, ragged={"boxes": "packed"},
                            pad_value={"labels": -1}) as p:
        for x, y in zip(a, p):
            off = y["boxes_offsets"]
            assert off.dtype == torch.int32 and off.tolist() == [0, *np.cumsum(x["boxes_lengths"].numpy()).tolist()]
            assert torch.equal(torch.cat(_torch_rows(x, "boxes")), y["boxes"])
            lab = y["labels"].numpy()
            assert (lab[np.arange(lab.shape[1])[None, :] >= y["labels_lengths"].numpy()[:, None]] == -1).all()


def _torch_rows(b, name):
    return [b[name][i, :n] for i, n in enumerate(b[name + "_lengths"].tolist())]


def test_the_same_crops_after_a_resume_at_another_world_size(boxes_ds):
    """Stop rank 0 of 1 after 2 batches; 3 ranks resume: every remaining sample gets the same
    window, flip, boxes and pixels as in the uninterrupted run."""
    t = vision.detection(40, return_crop=True)

    def per_index(batches):
        out = {}
        for b in batches:
            for i, idx in enumerate(b["index"].tolist()):
                out[idx] = (b["crop"][i].numpy(), bool(b["flip"][i]), _rows(b, "boxes")[i], b["image"][i].numpy())
        return out

    with fastload.Loader(boxes_ds, batch_size=5, transforms=t, seed=9) as lo:
        lo.set_epoch(1)
        full = per_index(_all(lo))
    with fastload.Loader(boxes_ds, batch_size=5, transforms=t, seed=9) as lo:
        lo.set_epoch(1)
        it = iter(lo)
        head = [next(it), next(it)]
        state = lo.state_dict()
        it.close()
    rest = {}
    for rank in range(3):
        with fastload.Loader(boxes_ds, batch_size=5, transforms=t, seed=9, rank=rank, world_size=3) as lo:
            lo.load_state_dict(state)
            rest.update(per_index(_all(lo)))
    seen = {**per_index(head), **rest}
    assert set(seen) == set(full)
    for idx, (crop, flip, boxes, img) in seen.items():
        fc, ff, fb, fi = full[idx]
        assert np.array_equal(crop, fc) and flip == ff and np.array_equal(boxes, fb), idx
        assert np.array_equal(img, fi), idx


def test_dataset_items_hold_boxes_and_labels_as_arrays(boxes_ds):
    s = boxes_ds[5]
    assert isinstance(s["boxes"], np.ndarray) and s["boxes"].dtype == np.float32 and s["boxes"].shape[1:] == (4,)
    assert isinstance(s["labels"], np.ndarray) and s["labels"].dtype == np.int64
    assert len(s["boxes"]) == len(s["labels"]) == len(s["iscrowd"])
    items = boxes_ds.__getitems__([0, 1, 2])
    assert all(isinstance(x["boxes"], np.ndarray) and x["boxes"].shape == (len(x["labels"]), 4) for x in items)


def test_an_undecodable_image_is_named_or_replaced(tmp_path):
    ds = make_boxes_dataset(tmp_path / "bad", n=10, bad=4)
    t = vision.detection(32)
    with pytest.raises(DecodeError, match="img004.png"), \
            fastload.Loader(ds, batch_size=5, transforms=t, shuffle=False) as lo:
        _all(lo)
    with fastload.Loader(ds, batch_size=5, transforms=t, shuffle=False, on_error="skip") as lo:
        got = torch.cat([b["index"] for b in lo]).tolist()
    assert got == [0, 1, 2, 3, 5, 5, 6, 7, 8, 9]


def test_a_sample_whose_boxes_and_labels_differ_in_number_is_named_or_replaced(tmp_path):
    with ShardWriter(tmp_path / "ds", {"image": "image", "boxes": "float32[*,4]", "labels": "int64[]"}) as w:
        for i in range(6):
            img = np.full((40, 48, 3), 40 + 20 * i, np.uint8)
            labels = np.array([1, 2] if i != 3 else [1], np.int64)  # sample 3: two boxes, one label
            w.write({"image": _png(img), "boxes": np.array([[1, 1, 9, 9], [10, 10, 20, 20]], np.float32),
                     "labels": labels}, key=f"s{i}")
    t = vision.detection(32, crop=False, flip=0.0)
    with pytest.raises(DecodeError, match=r"s3.*2 boxes but 1 labels"), \
            fastload.Loader(tmp_path / "ds", batch_size=3, transforms=t, shuffle=False) as lo:
        _all(lo)
    with fastload.Loader(tmp_path / "ds", batch_size=3, transforms=t, shuffle=False, on_error="skip") as lo:
        got = torch.cat([b["index"] for b in lo]).tolist()
    assert got == [0, 1, 2, 4, 4, 5]


@pytest.mark.parametrize("kw,err", [
    (dict(transforms={"image": vision.detection(32)}), "reads several fields; pass it as transforms= itself"),
    (dict(transforms=vision.detection(32, boxes="weight")), "boxes are a ragged field of items of 4"),
    (dict(transforms=vision.detection(32, labels="nope")), "field 'nope', which the dataset does not have"),
    (dict(transforms=vision.detection(32), fields=["mask"]), "image field 'mask' is not read by"),
    (dict(transforms=vision.detection(32), ragged={"boxes": "ragged"}), r"ragged\['boxes'\]='ragged' must be one of"),
    (dict(transforms=vision.detection(32), fields=["iscrowd"], ragged={"nope": "packed"}),
     "'nope' is not a delivered ragged field"),
])
def test_bad_arguments_are_named(boxes_ds, kw, err):
    with pytest.raises(ValueError, match=err):
        fastload.Loader(boxes_ds, batch_size=4, **kw)


def test_a_stored_ragged_field_named_in_fields_comes_as_stored(boxes_ds):
    with fastload.Loader(boxes_ds, batch_size=4, shuffle=False, transforms=vision.detection(32), fields=["iscrowd"],
                         ragged={"boxes": "packed", "iscrowd": "packed"}) as lo:
        b = next(iter(lo))
    assert set(b) == {"image", "boxes", "boxes_offsets", "labels", "labels_lengths", "iscrowd", "iscrowd_offsets",
                      "index"}
    assert b["iscrowd"].dtype == torch.bool
    assert b["iscrowd_offsets"].tolist() == [0, *np.cumsum([len(boxes_ds[i]["iscrowd"]) for i in range(4)])]


@pytest.mark.parametrize("kw,err", [
    (dict(size=0), r"size=0 must be a positive int"), (dict(size=32, scale=(0.5, 2.0)), "fraction of the image side"),
    (dict(size=32, min_iou=(0.5, 1.5)), "IoU thresholds in"), (dict(size=32, flip=2), "probability"),
    (dict(size=32, box_format="yolo"), "box_format"), (dict(size=32, letterbox=1), "letterbox=1"),
])
def test_bad_detection_arguments(kw, err):
    with pytest.raises(ValueError, match=err):
        vision.detection(**kw)


def test_describe_is_json_and_in_the_state(boxes_ds):
    import json

    t = vision.detection(32, letterbox=True)
    with fastload.Loader(boxes_ds, batch_size=4, transforms=t) as lo:
        state = lo.state_dict()
    assert json.loads(json.dumps(state))["transforms"]["image"]["kind"] == "detection"
    assert state["transforms"]["image"]["letterbox"] is True
    assert "fastload.vision.detection(size=[32, 32]" in repr(t)


def test_images_above_max_pixels_are_refused_before_decoding(boxes_ds):
    with pytest.raises(DecodeError, match=r"image input 'image': the header declares 200x150 pixels, more than "
                                          r"max_pixels=20000"), \
            fastload.Loader(boxes_ds, batch_size=4, shuffle=False,
                            transforms=vision.detection(32, max_pixels=20_000)) as lo:
        next(iter(lo))


def test_a_state_with_other_box_delivery_is_refused(boxes_ds):
    with fastload.Loader(boxes_ds, batch_size=4, transforms=vision.detection(32)) as lo:
        state = lo.state_dict()
    assert state["ragged"]["boxes"]["mode"] == "padded"
    with fastload.Loader(boxes_ds, batch_size=4, transforms=vision.detection(32), ragged="packed") as lo:
        with pytest.raises(ValueError, match="ragged"):
            lo.load_state_dict(state)

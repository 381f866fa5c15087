"""COCO segmentations rasterised by fastload.convert.masks (numpy, no pycocotools) against
independent references: a point-in-polygon test at every pixel centre (PNPOLY), RLE written
by hand, and an encoder of COCO's compressed RLE strings written here from its definition;
then the ``mask`` field of ``convert coco --masks`` against the same references."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest
from PIL import Image

import fastload
from fastload.convert import convert
from fastload.convert.coco import CocoSource
from fastload.convert.masks import (
    decode_rle_string,
    polygon_mask,
    rle_mask,
    segmentation_mask,
)


def pnpoly(xy, h: int, w: int) -> np.ndarray:
    """Reference: pixel (c, r) is in when its centre (c + .5, r + .5) is inside the polygon
    (W. R. Franklin's crossing test, even-odd)."""
    pts = np.asarray(xy, float).reshape(-1, 2)
    py, px = np.mgrid[0:h, 0:w] + 0.5
    inside = np.zeros((h, w), bool)
    j = len(pts) - 1
    for i in range(len(pts)):
        (xi, yi), (xj, yj) = pts[i], pts[j]
        with np.errstate(divide="ignore", invalid="ignore"):
            inside ^= ((yi > py) != (yj > py)) & (px < (xj - xi) * (py - yi) / (yj - yi) + xi)
        j = i
    return inside


def star(cx, cy, r_out, r_in, k, phase=0.1) -> list[float]:
    a = phase + np.arange(2 * k) * np.pi / k
    r = np.where(np.arange(2 * k) % 2 == 0, r_out, r_in)
    return np.stack([cx + r * np.cos(a), cy + r * np.sin(a)], 1).ravel().tolist()


SHAPES = {
    "triangle": [3.3, 2.1, 27.7, 5.2, 11.4, 19.8],
    "concave": [2.2, 2.3, 30.1, 2.6, 30.4, 8.7, 12.6, 9.1, 12.3, 21.4, 2.4, 21.9],
    "star": star(16.3, 12.2, 11.1, 4.3, 7),
    # a pentagram: every other vertex of a regular decagon, visited two apart (0, 4, 8, 2, 6)
    "self-crossing": np.array(star(16.3, 12.2, 11.1, 11.1, 5))[[0, 1, 8, 9, 16, 17, 4, 5, 12, 13]].tolist(),
    "partly outside": [-5.3, -3.1, 40.2, 4.4, 20.7, 30.6],
    "thin": [1.1, 1.3, 31.2, 1.9, 31.3, 2.45, 1.2, 2.2],
}


@pytest.mark.parametrize("name", SHAPES)
def test_polygons_match_a_point_in_polygon_reference(name):
    h, w = 24, 33
    got = polygon_mask(SHAPES[name], h, w)
    want = pnpoly(SHAPES[name], h, w)
    assert want.any() and got.shape == (h, w) and got.dtype == bool
    np.testing.assert_array_equal(got, want)


def test_the_pentagram_centre_is_a_hole_by_the_even_odd_rule():
    m = polygon_mask(SHAPES["self-crossing"], 24, 33)
    assert not m[12, 16] and m.sum() > 50


def test_random_polygons_match_the_reference():
    rng = np.random.default_rng(7)
    for _ in range(20):
        n = int(rng.integers(3, 30))
        ang = np.sort(rng.uniform(0, 2 * np.pi, n))
        rad = rng.uniform(2, 25, n)
        xy = np.stack([30 + rad * np.cos(ang), 22 + rad * np.sin(ang)], 1).ravel()
        np.testing.assert_array_equal(polygon_mask(xy, 45, 61), pnpoly(xy, 45, 61))


def test_several_polygons_of_one_annotation_are_united():
    a, b = SHAPES["triangle"], SHAPES["thin"]
    np.testing.assert_array_equal(segmentation_mask([a, b], 24, 33), pnpoly(a, 24, 33) | pnpoly(b, 24, 33))


# -- RLE ---------------------------------------------------------------------------------
HAND = np.array([[0, 1, 1, 0, 0],
                 [0, 1, 0, 0, 1],
                 [1, 1, 0, 0, 1],
                 [0, 0, 0, 1, 1]], bool)
# column-major: col0 0,0,1,0 | col1 1,1,1,0 | col2 1,0,0,0 | col3 0,0,0,1 | col4 0,1,1,1
HAND_COUNTS = [2, 1, 1, 3, 1, 1, 6, 1, 1, 3]


def test_uncompressed_rle_is_column_major():
    np.testing.assert_array_equal(rle_mask(HAND_COUNTS, 4, 5), HAND)
    np.testing.assert_array_equal(segmentation_mask({"size": [4, 5], "counts": HAND_COUNTS}, 4, 5), HAND)
    np.testing.assert_array_equal(rle_mask([20], 4, 5), np.zeros((4, 5), bool))  # one run of background


def to_string(counts) -> str:
    """COCO's compressed RLE (pycocotools' rleToString, from its definition): each run, less
    the run two before from the fourth on, in 5-bit groups, low first, 0x20 = more follow."""
    out = []
    for i, x in enumerate(counts):
        x = int(x) - (int(counts[i - 2]) if i > 2 else 0)
        more = True
        while more:
            c = x & 0x1F
            x >>= 5
            more = (x != -1) if c & 0x10 else (x != 0)
            out.append(chr(c + (0x20 if more else 0) + 48))
    return "".join(out)


def runs_of(mask: np.ndarray) -> list[int]:
    flat = mask.T.ravel().astype(np.int8)  # column-major
    change = np.flatnonzero(np.diff(flat)) + 1
    edges = np.concatenate([[0], change, [flat.size]])
    runs = np.diff(edges).tolist()
    return ([0] + runs) if flat[0] else runs


def test_compressed_rle_strings_written_by_hand():
    assert decode_rle_string("1231") == [1, 2, 3, 3]
    # from the fourth run on, the difference to the run two before: 1 - 1 = 0 -> '0', 1 - 2 = -1 -> 'O'
    assert decode_rle_string("5120O") == [5, 1, 2, 1, 1]
    # 600 = 0b10010_11000: groups 24 and 18, low first, each with 0x20 (more follow), then 0 ending the
    # number (18 has the sign bit 0x10 set): chr(48 + 24 + 32) chr(48 + 18 + 32) chr(48) = "hb0"
    assert decode_rle_string("hb01") == [600, 1]
    assert to_string([1, 2, 3, 3]) == "1231" and to_string([5, 1, 2, 1, 1]) == "5120O"
    np.testing.assert_array_equal(rle_mask("1231", 3, 3), rle_mask([1, 2, 3, 3], 3, 3))
    np.testing.assert_array_equal(segmentation_mask({"size": [4, 5], "counts": to_string(HAND_COUNTS)}, 4, 5), HAND)


def test_random_masks_through_compressed_and_plain_rle():
    rng = np.random.default_rng(3)
    for shape in [(37, 53), (1, 9), (64, 2)]:
        m = rng.random(shape) < rng.uniform(0.05, 0.95)
        m[: shape[0] // 2, : shape[1] // 3] = True  # long runs: multi-character numbers
        counts = runs_of(m)
        assert sum(counts) == m.size
        np.testing.assert_array_equal(rle_mask(counts, *shape), m)
        np.testing.assert_array_equal(rle_mask(to_string(counts), *shape), m)


@pytest.mark.parametrize("seg, match", [
    ({"size": [4, 5], "counts": [3, 4]}, r"RLE counts cover 7 pixels, not 4x5 = 20"),
    ({"size": [5, 4], "counts": [20]}, r"RLE segmentation has size \[5, 4\].*\[4, 5\] expected"),
    ({"size": [4, 5], "counts": [25, -5]}, r"negative run"),
    ({"size": [4, 5], "counts": "1 "}, r"not an RLE character"),
    ({"size": [4, 5], "counts": "1o"}, r"end in the middle of a number"),
    ([[1, 2, 3, 4]], r"polygon 0 of its segmentation holds 4 values"),
    ([[1, 2, 3, 4, 5, float("nan")]], r"not finite"),
    ([], r"has no segmentation"),
])
def test_broken_segmentations_say_what_is_wrong(seg, match):
    with pytest.raises(ValueError, match=match):
        segmentation_mask(seg, 4, 5)


# -- the mask field of convert coco --masks ------------------------------------------------
def test_convert_masks_hold_category_ids_painted_in_json_order(tmp_path):
    """Two images; the first with a polygon (category 3), a crowd RLE over part of it
    (category 18, painted later: over it) and a second polygon (category 1)."""
    h, w = 24, 33
    (tmp_path / "im").mkdir()
    for name, size in [("a.jpg", (w, h)), ("b.jpg", (20, 10))]:
        buf = io.BytesIO()
        Image.fromarray((np.random.default_rng(0).random((size[1], size[0], 3)) * 255).astype(np.uint8)).save(
            buf, "JPEG")
        (tmp_path / "im" / name).write_bytes(buf.getvalue())
    crowd = np.zeros((h, w), bool)
    crowd[5:15, 10:20] = True
    anns = [{"id": 1, "image_id": 7, "category_id": 3, "iscrowd": 0, "bbox": [3.3, 2.1, 24.4, 17.7],
             "segmentation": [SHAPES["triangle"]]},
            {"id": 2, "image_id": 7, "category_id": 18, "iscrowd": 1, "bbox": [10, 5, 10, 10],
             "segmentation": {"size": [h, w], "counts": to_string(runs_of(crowd))}},
            {"id": 3, "image_id": 7, "category_id": 1, "iscrowd": 0, "bbox": [1.1, 1.3, 30.2, 1.15],
             "segmentation": [SHAPES["thin"]]},
            {"id": 4, "image_id": 8, "category_id": 1, "iscrowd": 1, "bbox": [0, 0, 20, 10],
             "segmentation": {"size": [10, 20], "counts": [0, 200]}}]
    doc = {"images": [{"id": 7, "file_name": "a.jpg", "width": w, "height": h},
                      {"id": 8, "file_name": "b.jpg", "width": 20, "height": 10},
                      {"id": 9, "file_name": "a.jpg", "width": w, "height": h}],  # no annotations: all background
           "annotations": anns,
           "categories": [{"id": 1, "name": "a"}, {"id": 3, "name": "c"}, {"id": 18, "name": "r"}]}
    (tmp_path / "i.json").write_text(json.dumps(doc))
    convert("coco", tmp_path / "i.json", tmp_path / "ds", images=tmp_path / "im", masks=True, progress=False,
            workers=0)
    want = np.zeros((h, w), np.uint8)
    want[pnpoly(SHAPES["triangle"], h, w)] = 3
    want[crowd] = 18
    want[pnpoly(SHAPES["thin"], h, w)] = 1
    ds = fastload.Dataset(tmp_path / "ds")
    assert str(ds.fields["mask"]) == "image"
    masks = []
    for i in range(3):
        with Image.open(io.BytesIO(bytes(ds[i]["mask"]))) as im:
            assert im.format == "PNG" and im.mode == "L"
            masks.append(np.asarray(im))
    np.testing.assert_array_equal(masks[0], want)
    np.testing.assert_array_equal(masks[1], np.ones((10, 20), np.uint8))
    np.testing.assert_array_equal(masks[2], np.zeros((h, w), np.uint8))
    assert ds[0]["iscrowd"].tolist() == [False, True, False] and ds[0]["labels"].tolist() == [3, 18, 1]
    # the mask is made by the check (in the validation workers); read() alone makes the same one
    source = CocoSource(tmp_path / "i.json", tmp_path / "im", masks=True)
    assert [source.read(i)["mask"] for i in range(3)] == [bytes(ds[i]["mask"]) for i in range(3)]

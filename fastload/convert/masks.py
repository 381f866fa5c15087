"""COCO segmentations rasterised with numpy alone (no pycocotools): polygons and RLE.

Three forms of ``segmentation`` are read, as COCO writes them:

* polygons: ``[[x1, y1, x2, y2, ...], ...]`` in pixel coordinates (the image's top-left
  corner is (0, 0), pixel (c, r) covers [c, c+1) x [r, r+1)). A pixel belongs to a polygon
  when its centre (c + 0.5, r + 0.5) lies inside it by the even-odd rule; a centre exactly on
  the outline counts on the polygon's right and top sides (smaller y), not on its left and
  bottom ones, so two polygons sharing an edge never both take a pixel. Several polygons of
  one annotation are united. pycocotools' own rasteriser may differ on boundary pixels;
* uncompressed RLE: ``{"size": [h, w], "counts": [n0, n1, ...]}``: alternating runs of 0
  and 1 (starting with 0) over the pixels in column-major order (down the first column,
  then the next), as COCO's crowd annotations are stored;
* compressed RLE: the same with ``counts`` a string (pycocotools' ``rleToString`` encoding:
  5-bit groups in characters from 48, with each run after the second stored as the difference
  to the run two before).

Errors are ``ValueError`` with a message saying what is wrong; the caller names the annotation.
"""
from __future__ import annotations

import io
from typing import Any

import numpy as np

__all__ = ["check_segmentation", "decode_rle_string", "encode_mask_png", "paint_segmentation", "polygon_mask",
           "rle_mask", "segmentation_mask"]


def decode_rle_string(s: str) -> list[int]:
    """The run lengths of a compressed COCO RLE string (pycocotools' ``rleFrString``)."""
    counts: list[int] = []
    p, n = 0, len(s)
    while p < n:
        x, k, more = 0, 0, True
        while more:
            if p >= n:
                raise ValueError("compressed RLE counts end in the middle of a number")
            c = ord(s[p]) - 48
            if not 0 <= c < 64:
                raise ValueError(f"compressed RLE counts hold {s[p]!r}, which is not an RLE character")
            x |= (c & 0x1F) << (5 * k)
            more = bool(c & 0x20)
            p += 1
            k += 1
            if not more and c & 0x10:
                x |= -1 << (5 * k)
        if len(counts) > 2:
            x += counts[-2]
        counts.append(x)
    return counts


def rle_mask(counts: Any, height: int, width: int) -> np.ndarray:
    """The (height, width) bool mask of RLE ``counts`` (a list of ints, or a compressed string)."""
    if isinstance(counts, str):
        counts = decode_rle_string(counts)
    if not isinstance(counts, (list, tuple)) or not all(isinstance(c, int) and not isinstance(c, bool)
                                                         for c in counts):
        raise ValueError("RLE counts must be a list of integers or a compressed string")
    runs = np.asarray(counts, dtype=np.int64)
    if runs.size and runs.min() < 0:
        raise ValueError(f"RLE counts hold a negative run ({int(runs.min())})")
    total = int(runs.sum())
    if total != height * width:
        raise ValueError(f"RLE counts cover {total} pixels, not {height}x{width} = {height * width}")
    values = np.zeros(len(runs), dtype=bool)
    values[1::2] = True
    return np.repeat(values, runs).reshape(width, height).T  # column-major


def _polygon_region(xy: Any, height: int, width: int) -> tuple[int, int, np.ndarray]:
    """(first row, first column, bool mask) of the pixels of one polygon within the box of
    rows and columns it can cover (the rest of the image is outside it)."""
    pts = np.asarray(xy, dtype=np.float64).reshape(-1, 2)
    x0, y0 = pts[:, 0], pts[:, 1]
    x1, y1 = np.roll(x0, -1), np.roll(y0, -1)
    # each edge crosses the centre lines y = r + 0.5 of rows r with lo <= r + 0.5 < hi
    lo, hi = np.minimum(y0, y1), np.maximum(y0, y1)
    r0 = np.clip(np.ceil(lo - 0.5), 0, height).astype(np.int64)
    r1 = np.clip(np.ceil(hi - 0.5), 0, height).astype(np.int64)
    n = np.maximum(r1 - r0, 0)
    if not n.any():
        return 0, 0, np.zeros((0, 0), dtype=bool)
    edge = np.repeat(np.arange(len(pts)), n)
    rows = (np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)) + r0[edge]
    yc = rows + 0.5
    xe0, ye0, xe1, ye1 = x0[edge], y0[edge], x1[edge], y1[edge]
    xi = xe0 + (yc - ye0) * (xe1 - xe0) / (ye1 - ye0)  # (no horizontal edge crosses a row)
    # a crossing at xi flips every pixel whose centre c + 0.5 lies right of it (c + 0.5 > xi);
    # each row has an even number of crossings, so the columns right of the last flip are out
    start = np.clip(np.floor(xi - 0.5).astype(np.int64) + 1, 0, width)
    top, left = int(rows.min()), int(start.min())
    flips = np.zeros((int(rows.max()) + 1 - top, int(start.max()) + 1 - left), dtype=np.int32)
    np.add.at(flips, (rows - top, start - left), 1)
    return top, left, (np.cumsum(flips[:, :-1], axis=1) & 1).astype(bool)


def polygon_mask(xy: Any, height: int, width: int) -> np.ndarray:
    """The (height, width) bool mask of one polygon ``[x1, y1, x2, y2, ...]`` (pixel centres
    inside by the even-odd rule; see the module docstring)."""
    out = np.zeros((height, width), dtype=bool)
    top, left, region = _polygon_region(xy, height, width)
    out[top:top + region.shape[0], left:left + region.shape[1]] = region
    return out


def paint_segmentation(canvas: np.ndarray, seg: Any, value: int) -> None:
    """Set the pixels of ``canvas`` (height, width) that the COCO segmentation covers to
    ``value`` (polygons: only the rows and columns each can cover are visited)."""
    height, width = canvas.shape
    check_segmentation(seg, height, width)
    if isinstance(seg, dict):
        canvas[rle_mask(seg["counts"], height, width)] = value
        return
    for poly in seg:
        top, left, region = _polygon_region(poly, height, width)
        canvas[top:top + region.shape[0], left:left + region.shape[1]][region] = value


def check_segmentation(seg: Any, height: int, width: int) -> None:
    """ValueError when ``seg`` is not a polygon list or RLE of a ``height`` x ``width`` image
    (the counts of a compressed RLE are decoded only when the mask is made)."""
    if isinstance(seg, dict):
        size, counts = seg.get("size"), seg.get("counts")
        if not (isinstance(size, (list, tuple)) and len(size) == 2 and all(isinstance(v, int) for v in size)):
            raise ValueError(f"RLE segmentation has size {size!r}; COCO's is [height, width]")
        if list(size) != [height, width]:
            raise ValueError(f"RLE segmentation has size {list(size)} ([height, width]), but its image is "
                             f"{width}x{height} (width x height): [{height}, {width}] expected")
        if not isinstance(counts, (str, list)):
            raise ValueError("RLE segmentation has no counts (a list of run lengths or a compressed string)")
        if isinstance(counts, list):
            rle_mask(counts, height, width)  # cheap: checks the runs and their total
        return
    if not isinstance(seg, list) or not seg:
        raise ValueError("has no segmentation (polygons or RLE); --masks needs one for every annotation")
    for k, poly in enumerate(seg):
        if not isinstance(poly, (list, tuple)) or len(poly) < 6 or len(poly) % 2:
            n = len(poly) if isinstance(poly, (list, tuple)) else type(poly).__name__
            raise ValueError(f"polygon {k} of its segmentation holds {n} values; a polygon is at least 3 points "
                             "[x1, y1, x2, y2, x3, y3, ...]")
        try:
            values = np.asarray(poly)  # numbers: int or float (a string or a list inside: another kind)
        except ValueError:
            values = None
        if values is None or values.ndim != 1 or values.dtype.kind not in "iuf" or not np.isfinite(values).all():
            raise ValueError(f"polygon {k} of its segmentation holds values that are not finite numbers")


def segmentation_mask(seg: Any, height: int, width: int) -> np.ndarray:
    """The (height, width) bool mask of a COCO segmentation (polygons united, or RLE)."""
    out = np.zeros((height, width), dtype=bool)
    paint_segmentation(out, seg, True)
    return out


def encode_mask_png(mask: np.ndarray) -> bytes:
    """A (height, width) uint8 array as a single-channel 8-bit PNG."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(mask, dtype=np.uint8), "L").save(buf, "PNG")
    return buf.getvalue()

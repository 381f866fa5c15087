"""coco: COCO instance annotations (``instances_*.json``) and the folder of their images.

``fastload convert coco INSTANCES_JSON IMAGES_DIR DST`` makes one sample per image of the
JSON's ``images`` list, in that order, keyed by its ``file_name`` (a path inside IMAGES_DIR):

* ``image``: the image file's bytes, stored as an image folder stores them (byte for byte,
  EXIF block included: the decoders turn it upright);
* ``image_id`` (int64): the image's COCO id, to match results back to the JSON;
* ``boxes`` (``float32[*,4]``): one ``[x0, y0, x1, y1]`` per annotation, in pixels of the
  image as decoded (after its EXIF orientation), clipped to it;
* ``labels`` (``int64[]``): the annotations' ``category_id``; the categories (id, name,
  supercategory) are in the manifest's metadata ``categories``;
* ``iscrowd`` (``bool[]``);
* with ``--masks``, ``mask``: a single-channel 8-bit PNG of the decoded image's size, each
  pixel the category id of the annotation covering it (0 = background; annotations painted in
  the JSON's order, a later one over an earlier one; crowd regions too). Category ids must be
  1..255 then (an 8-bit pixel, 0 taken by the background): other ids are refused before any
  work. Polygons and RLE are rasterised by masks.py (numpy, no pycocotools).

Annotations are in the frame of the file's pixels as stored (what pycocotools and
torchvision's ``CocoDetection`` see: PIL without EXIF applied), and the JSON's ``width`` and
``height`` must be those of the file. An image with an EXIF orientation has its boxes and mask
turned with it, as the decoders turn the image. Boxes that reach at most 1 pixel past the
image (annotation tools' rounding, as in COCO itself) are clipped (the manifest counts them
as ``clipped_boxes``).

Errors: a bad annotation (a box reaching further outside its image, a negative size, an
unknown category, a broken segmentation with ``--masks``) makes its image a bad sample whose
message names the annotation id; an annotation whose ``image_id`` is no image of the JSON is
a bad sample of its own, keyed ``annotation <id>`` and placed first. Both stop the run, or
with ``--on-error skip`` are left out and listed in ``skipped.jsonl`` like any unreadable
image. Images without annotations are kept with zero boxes, or left out with
``--skip-empty`` (counted as ``empty_images``). A JSON that is not COCO (no ``images`` list,
two images with one id, a category without an integer id) is refused at once.

For the distributed engines the plan writes the parsed annotations as a listing
(``coco.parquet``, one row per sample) and each task reads its rows: the JSON is parsed once.
"""
from __future__ import annotations

import io
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from ..files import NotRegularFile, read_regular
from ..store.format import Field
from ..store.geometry import DEFAULT_MAX_PIXELS, displayed_size, exif_orientation
from .common import ConvertError, Source
from .images import pil_limit, prepare_image

__all__ = ["BOX_TOLERANCE", "LISTING", "CocoSource", "upright_boxes"]

LISTING = "coco.parquet"  # the parsed annotations of a distributed conversion, in its parts directory
BOX_TOLERANCE = 1.0  # pixels a box may reach past its image and still be clipped rather than refused
MAX_MASK_ID = 255    # an 8-bit mask pixel; 0 is the background


def _fields(masks: bool) -> dict[str, Field]:
    f = {"image": Field("image"), "image_id": Field("scalar", "int64"), "boxes": Field("ragged", "float32", (4,)),
         "labels": Field("ragged", "int64"), "iscrowd": Field("ragged", "bool")}
    if masks:
        f["mask"] = Field("image")
    return f


def upright_boxes(boxes: np.ndarray, orientation: int, width: int, height: int) -> np.ndarray:
    """xyxy ``boxes`` in the pixel frame of a ``width`` x ``height`` file, in the frame of the
    image turned upright by its EXIF ``orientation`` (1-8), as the decoders deliver it."""
    b = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    if orientation not in range(2, 9):
        return b.copy()
    W, H = float(width), float(height)
    point = {2: lambda x, y: (W - x, y), 3: lambda x, y: (W - x, H - y), 4: lambda x, y: (x, H - y),
             5: lambda x, y: (y, x), 6: lambda x, y: (H - y, x), 7: lambda x, y: (H - y, W - x),
             8: lambda x, y: (y, W - x)}[orientation]
    ax, ay = point(b[:, 0], b[:, 1])
    bx, by = point(b[:, 2], b[:, 3])
    return np.stack([np.minimum(ax, bx), np.minimum(ay, by), np.maximum(ax, bx), np.maximum(ay, by)], axis=1)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _load(path: Path) -> dict:
    if not path.is_file():
        raise ConvertError(f"{path}: no such file (give the COCO instances JSON, e.g. instances_val2017.json)")
    try:
        with open(path, "rb") as f:
            doc = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ConvertError(f"{path}: not a JSON file ({e})") from None
    except OSError as e:
        raise ConvertError(f"{path}: cannot be read ({e.strerror or e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("images"), list):
        raise ConvertError(f"{path}: not COCO instance annotations (no 'images' list at the top level)")
    for part in ("annotations", "categories"):
        if not isinstance(doc.get(part, []), list):
            raise ConvertError(f"{path}: '{part}' must be a list")
    return doc


def _categories(path: Path, doc: dict, masks: bool) -> tuple[set[int], list[dict]]:
    ids: set[int] = set()
    out = []
    for k, c in enumerate(doc.get("categories", [])):
        if not isinstance(c, dict) or not _is_int(c.get("id")) or not isinstance(c.get("name"), str):
            raise ConvertError(f"{path}: categories[{k}] needs an integer 'id' and a string 'name'")
        if c["id"] in ids:
            raise ConvertError(f"{path}: two categories have id {c['id']}; category ids must be unique")
        ids.add(c["id"])
        out.append({"id": c["id"], "name": c["name"], "supercategory": str(c.get("supercategory", ""))})
        if masks and not 1 <= c["id"] <= MAX_MASK_ID:
            raise ConvertError(f"{path}: category {c['id']} ({c['name']!r}) cannot be a mask pixel: --masks stores "
                               f"each pixel's category id in an 8-bit PNG, 0 being the background, so ids must be "
                               f"1..{MAX_MASK_ID}; renumber the categories, or leave out --masks")
    return ids, out


def _image_entry(root: Path, im: Any, k: int) -> tuple[Any, str | None, int, int, str | None]:
    """(id, file_name or None, width, height, error or None) of ``images[k]``."""
    if not isinstance(im, dict):
        return None, None, 0, 0, f"images[{k}] is not an object"
    iid, name, w, h = im.get("id"), im.get("file_name"), im.get("width"), im.get("height")
    who = f"image {iid}" if _is_int(iid) else f"images[{k}]"
    if not isinstance(name, str) or not name:
        return iid, None, 0, 0, f"{who} has no file_name"
    if os.path.isabs(name) or ".." in Path(name).parts:
        return iid, name, 0, 0, f"{who}: file_name {name!r} is not a path inside {root}"
    if not (_is_int(w) and _is_int(h) and w > 0 and h > 0):
        return iid, name, 0, 0, f"{who} has width {w!r} and height {h!r}; both must be positive integers"
    return iid, name, w, h, None


def _annotation(a: dict, who: str, w: int, h: int, cats: set[int], masks: bool) -> tuple[Any, str | None]:
    """((xyxy box clipped, category, iscrowd, clipped, polygons, RLE as JSON), None) or (None, error);
    with ``masks`` an annotation has polygons (a list of coordinate lists) or an RLE, else neither."""
    from .masks import check_segmentation

    cat, bbox, crowd = a.get("category_id"), a.get("bbox"), a.get("iscrowd", 0)
    if not _is_int(cat) or cat not in cats:
        return None, f"{who}: category_id {cat!r} is not one of the JSON's categories"
    if not (isinstance(bbox, list) and len(bbox) == 4 and all(_is_num(v) for v in bbox)):
        return None, f"{who}: bbox {bbox!r} is not 4 finite numbers [x, y, width, height]"
    x, y, bw, bh = (float(v) for v in bbox)
    if bw < 0 or bh < 0:
        return None, f"{who}: bbox {bbox} has a negative size (width {bw:g}, height {bh:g})"
    t = BOX_TOLERANCE
    if x < -t or y < -t or x + bw > w + t or y + bh > h + t:
        return None, (f"{who}: bbox {bbox} ([x, y, width, height]) reaches outside its image of {w}x{h} "
                      f"pixels (by more than {t:g} pixel)")
    if crowd not in (0, 1) or isinstance(crowd, float):
        return None, f"{who}: iscrowd {crowd!r} must be 0 or 1"
    box = (min(max(x, 0.0), w), min(max(y, 0.0), h), min(max(x + bw, 0.0), w), min(max(y + bh, 0.0), h))
    clipped = box != (x, y, x + bw, y + bh)
    polys, rle = None, None
    if masks:
        seg = a.get("segmentation")
        try:
            check_segmentation(seg, h, w)
        except ValueError as e:
            return None, f"{who}: {e}"
        if isinstance(seg, dict):  # (an RLE: a few per image at most, crowds)
            rle = json.dumps({"size": seg["size"], "counts": seg["counts"]}, separators=(",", ":"))
        else:  # kept as numbers: the listing stores them as Arrow lists
            polys = seg
    return (box, cat, bool(crowd), clipped, polys, rle), None


def parse_instances(path: Path, root: Path, *, masks: bool, skip_empty: bool) -> tuple[pa.Table, dict]:
    """The listing (one row per sample, see ``_TABLE``) and the manifest metadata of a COCO
    instances JSON whose images are under ``root``."""
    doc = _load(path)
    cats, categories = _categories(path, doc, masks)
    images: dict[int, int] = {}  # image id -> its row in entries
    entries = []
    for k, im in enumerate(doc["images"]):
        iid, name, w, h, err = _image_entry(root, im, k)
        if not _is_int(iid):
            raise ConvertError(f"{path}: images[{k}] has id {iid!r}; every image needs an integer id")
        if iid in images:
            raise ConvertError(f"{path}: two images have id {iid} (images[{images[iid]}] and images[{k}]); "
                               "image ids must be unique")
        images[iid] = len(entries)
        entries.append({"id": iid, "name": name, "w": w, "h": h, "errors": [err] if err else [], "anns": []})
    orphans = []
    clipped = 0
    annotations = doc.get("annotations", [])
    for k, a in enumerate(annotations):
        aid = a.get("id") if isinstance(a, dict) else None
        who = f"annotation {aid}" if _is_int(aid) else f"annotations[{k}]"
        if not isinstance(a, dict):
            raise ConvertError(f"{path}: {who} is not an object")
        iid = a.get("image_id")
        e = entries[images[iid]] if _is_int(iid) and iid in images else None
        if e is None:
            orphans.append((who, aid if _is_int(aid) else -1, iid))
            continue
        if e["errors"] and e["w"] == 0:  # the image entry itself is bad: its message says why
            continue
        ann, err = _annotation(a, who, e["w"], e["h"], cats, masks)
        if err is not None:
            e["errors"].append(err)
        else:
            clipped += ann[3]
            e["anns"].append((aid if _is_int(aid) else -1, ann))
    rows: dict[str, list] = {c: [] for c in _TABLE.names}
    for who, _aid, iid in orphans:
        _row(rows, key=who, file=None, iid=iid if _is_int(iid) else -1, w=0, h=0, anns=[], masks=masks,
             error=f"its image_id {iid!r} is not the id of any image in {path.name}")
    empty = 0
    for e in entries:
        if not e["anns"] and not e["errors"]:
            empty += 1
            if skip_empty:
                continue
        err = None
        if e["errors"]:
            more = len(e["errors"]) - 1
            err = e["errors"][0] + (f" (and {more} more bad annotation(s) of this image)" if more else "")
        _row(rows, key=e["name"] if e["name"] is not None else f"image {e['id']}", file=e["name"], iid=e["id"],
             w=e["w"], h=e["h"], anns=e["anns"], masks=masks, error=err)
    meta = {"source": "coco", "file": path.name, "categories": categories, "images_in_json": len(entries),
            "annotations_in_json": len(annotations), "empty_images": empty,
            "empty_images_left_out": bool(skip_empty), "clipped_boxes": clipped, "masks": bool(masks)}
    return _table(rows), meta


_TABLE = pa.schema([("key", pa.string()), ("file", pa.string()), ("image_id", pa.int64()),
                    ("width", pa.int64()), ("height", pa.int64()),
                    ("boxes", pa.list_(pa.list_(pa.float64(), 4))), ("labels", pa.list_(pa.int64())),
                    ("iscrowd", pa.list_(pa.bool_())), ("ann_ids", pa.list_(pa.int64())),
                    # with --masks, per annotation: its polygons, or its RLE as JSON (else null)
                    ("polygons", pa.list_(pa.list_(pa.list_(pa.float64())))), ("rle", pa.list_(pa.string())),
                    ("error", pa.string())])


def _row(rows: dict, *, key, file, iid, w, h, anns, masks, error) -> None:
    rows["key"].append(key)
    rows["file"].append(file)
    rows["image_id"].append(iid)
    rows["width"].append(w)
    rows["height"].append(h)
    rows["boxes"].append([list(a[0]) for _, a in anns])
    rows["labels"].append([a[1] for _, a in anns])
    rows["iscrowd"].append([a[2] for _, a in anns])
    rows["ann_ids"].append([aid for aid, _ in anns])
    rows["polygons"].append([a[4] for _, a in anns] if masks else [])
    rows["rle"].append([a[5] for _, a in anns] if masks else [])
    rows["error"].append(error)


def _table(rows: dict) -> pa.Table:
    return pa.table({n: pa.array(rows[n], type=_TABLE.field(n).type) for n in _TABLE.names}, schema=_TABLE)


def _flat(col: pa.Array, dtype, item: tuple = ()) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, values) of a list column (the values of nested fixed lists flattened to ``item``)."""
    offsets = np.asarray(col.offsets, dtype=np.int64)
    offsets = offsets - offsets[0]  # (a slice of a listing: its offsets start where the slice does)
    values = col.flatten()  # (only the slice's values)
    while pa.types.is_list(values.type) or pa.types.is_fixed_size_list(values.type):
        values = values.flatten()
    return offsets, values.to_numpy(zero_copy_only=False).astype(dtype, copy=False).reshape(-1, *item)


class CocoSource(Source):
    """COCO instances: ``src`` the JSON, ``images`` the folder its ``file_name`` paths are in."""

    def __init__(self, src: str | os.PathLike, images: str | os.PathLike | None = None, *, masks: bool = False,
                 skip_empty: bool = False, max_pixels: int | None = DEFAULT_MAX_PIXELS):
        from .sourcestate import stat_file

        path = Path(src)
        if images is None:
            raise ConvertError("coco needs the folder of the images too: fastload convert coco INSTANCES_JSON "
                               "IMAGES_DIR DST (images=... from Python)")
        root = Path(images)
        if not root.is_dir():
            raise ConvertError(f"{root}: not a directory (the folder the JSON's file_name paths are in)")
        opened = {os.fspath(path): stat_file(path)}  # before reading it
        table, meta = parse_instances(path, root, masks=bool(masks), skip_empty=bool(skip_empty))
        if table.num_rows == 0:
            raise ConvertError(f"{path}: no image to convert ({meta['images_in_json']} image(s) in the JSON"
                               + (f", {meta['empty_images']} without annotations left out by --skip-empty)"
                                  if skip_empty else ")"))
        self._init(path, root, table, meta, bool(masks), max_pixels)
        self.opened = opened

    @classmethod
    def from_listing(cls, src: str | os.PathLike, images: str | os.PathLike, table: pa.Table, metadata: dict,
                     *, masks: bool, max_pixels: int | None) -> CocoSource:
        """The source of rows of a listing the plan wrote (a task of a distributed conversion)."""
        from .sourcestate import stat_file

        self = cls.__new__(cls)
        self._init(Path(src), Path(images), table, dict(metadata), masks, max_pixels)
        self.opened = {os.fspath(src): stat_file(src)}
        return self

    def _init(self, path: Path, root: Path, table: pa.Table, meta: dict, masks: bool, max_pixels) -> None:
        super().__init__(fields=_fields(masks), num_samples=table.num_rows, metadata=meta, max_pixels=max_pixels)
        self.path, self.root, self.masks = path, root, masks
        self.listing = table = table.combine_chunks()
        col = {n: (table.column(n).chunk(0) if table.column(n).num_chunks else pa.array([], _TABLE.field(n).type))
               for n in _TABLE.names}
        self.keys = col["key"].to_pylist()
        self.files = col["file"].to_pylist()
        self.errors = col["error"].to_pylist()
        self.image_ids = col["image_id"].to_numpy(zero_copy_only=False)
        self.sizes = np.stack([col["width"].to_numpy(zero_copy_only=False),
                               col["height"].to_numpy(zero_copy_only=False)], axis=1)
        self.offsets, self.boxes = _flat(col["boxes"], np.float64, (4,))
        _, self.labels = _flat(col["labels"], np.int64)
        _, self.iscrowd = _flat(col["iscrowd"], bool)
        _, self.ann_ids = _flat(col["ann_ids"], np.int64)
        self.polygons, self.rle = col["polygons"], col["rle"]

    # -- Source ---------------------------------------------------------------------------
    def key(self, i: int) -> str:
        return self.keys[i]

    def inputs(self) -> list[str]:
        """The JSON, then the image files in sample order."""
        return [os.fspath(self.path)] + [os.path.join(self.root, f) for f in self.files if f is not None]

    def read(self, i: int) -> dict:
        return self._read(i, self.masks)

    def check(self, i: int) -> tuple[dict[str, tuple[int, int]], dict[str, bytes]]:
        """The image fully decoded, its size checked against the JSON's, and with ``--masks`` the
        mask made here, in the validation workers (``read_checked`` puts it in)."""
        data = self._bytes(i)
        _, size = prepare_image(data, self.max_pixels)  # fully decoded (stored as is: no --max-size)
        orientation = self._orientation(i, data)
        if not self.masks:
            return {"image": size}, {}
        return {"image": size, "mask": size}, {"mask": self._mask(i, orientation)}

    def read_checked(self, i: int, new: dict[str, bytes]) -> dict:
        sample = self._read(i, self.masks and "mask" not in new)
        sample.update(new)
        return sample

    def _read(self, i: int, mask: bool) -> dict:
        data = self._bytes(i)
        orientation = self._orientation(i, data)
        a, b = self.offsets[i], self.offsets[i + 1]
        w, h = (int(v) for v in self.sizes[i])
        sample = {"image": data, "image_id": int(self.image_ids[i]),
                  "boxes": upright_boxes(self.boxes[a:b], orientation, w, h).astype(np.float32),
                  "labels": self.labels[a:b].copy(), "iscrowd": self.iscrowd[a:b].copy()}
        if mask:
            sample["mask"] = self._mask(i, orientation)
        return sample

    # -- helpers --------------------------------------------------------------------------
    def _bytes(self, i: int) -> bytes:
        if self.errors[i] is not None:
            raise ValueError(self.errors[i])
        try:
            return read_regular(self.root / self.files[i], what="image file")
        except NotRegularFile as e:  # the key names the file already
            raise ValueError(f"it {e.detail}") from None
        except OSError as e:
            raise ValueError(f"cannot read file {self.root / self.files[i]} ({e.strerror or e})") from None

    def _orientation(self, i: int, data: bytes) -> int:
        """The EXIF orientation of the image; ValueError when the file's size is not the JSON's."""
        from PIL import Image

        try:
            with pil_limit(None), Image.open(io.BytesIO(data)) as im:
                if im.format == "PNG":
                    im.load()  # a PNG's eXIf chunk may follow its pixels: read only by load()
                raw, orientation, upright = im.size, exif_orientation(im), displayed_size(im)
        except Exception as e:  # PIL raises many types
            raise ValueError(f"not a decodable image ({type(e).__name__}: {e})") from None
        w, h = (int(v) for v in self.sizes[i])
        if tuple(raw) != (w, h):
            hint = (f"; its size after its EXIF orientation ({orientation}) is the JSON's: fastload reads COCO "
                    "annotations in the frame of the file's pixels, as pycocotools and torchvision do, and turns "
                    "them upright itself. Store the image upright (PIL's ImageOps.exif_transpose, then save "
                    "without the orientation) and convert again") if tuple(upright) == (w, h) else \
                "; fix the JSON's width and height, or the file"
            raise ValueError(f"image {int(self.image_ids[i])}: the JSON gives its size as {w}x{h}, but the file "
                             f"is {raw[0]}x{raw[1]}{hint}")
        return orientation

    def _mask(self, i: int, orientation: int) -> bytes:
        """The category-id mask PNG of sample ``i``, upright like the decoded image."""
        from PIL import Image

        from .masks import encode_mask_png, paint_segmentation
        from .resize import transpose_upright

        w, h = (int(v) for v in self.sizes[i])
        a = self.offsets[i]
        out = np.zeros((h, w), dtype=np.uint8)
        polygons, rles = self.polygons[i].as_py(), self.rle[i].as_py()
        for j, (polys, rle) in enumerate(zip(polygons, rles)):  # the JSON's order: a later one paints over
            try:
                paint_segmentation(out, json.loads(rle) if rle is not None else polys, int(self.labels[a + j]))
            except ValueError as e:
                raise ValueError(f"annotation {int(self.ann_ids[a + j])}: {e}") from None
        return encode_mask_png(np.asarray(transpose_upright(Image.fromarray(out, "L"), orientation)))

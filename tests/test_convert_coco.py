"""``fastload convert coco``: COCO instance annotations -> image, image_id, boxes, labels,
iscrowd (and mask). Every test builds its own data: synthetic JPEGs and a JSON written here.
The rasterisation of polygons and RLE against independent references is in
test_convert_coco_masks.py."""
from __future__ import annotations

import io
import json
import random
from pathlib import Path

import numpy as np
import pytest
from _convert import assert_same_rows, load
from PIL import Image, ImageOps

import fastload
from fastload.cli import main as cli_main
from fastload.convert import ConvertError, convert
from fastload.convert.commit import commit
from fastload.convert.plan import make_plan
from fastload.convert.task import run_group
from fastload.store import verify

CATEGORIES = [{"id": 1, "name": "person", "supercategory": "human"}, {"id": 3, "name": "car", "supercategory": "v"},
              {"id": 18, "name": "dog", "supercategory": "animal"}]


def jpeg(w: int, h: int, seed: int, orientation: int = 1, rect: tuple | None = None) -> bytes:
    """A w x h JPEG (pixels as stored) of noise, or black with a white ``rect`` (x0, y0, x1, y1)."""
    rng = np.random.default_rng(seed)
    if rect is None:
        a = (rng.random((h, w, 3)) * 255).astype(np.uint8)
    else:
        a = np.zeros((h, w, 3), np.uint8)
        a[rect[1]:rect[3], rect[0]:rect[2]] = 255
    kw = {}
    if orientation != 1:
        ex = Image.Exif()
        ex[0x0112] = orientation
        kw["exif"] = ex.tobytes()
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "JPEG", quality=95, **kw)
    return buf.getvalue()


def make_coco(root: Path, n: int = 24, seed: int = 0, empty_every: int = 5) -> dict:
    """``root/images/<dir>/<i>.jpg`` and ``root/instances.json``: random sizes, 0-6 boxes
    each (every ``empty_every``-th image has none), boxes inside the image or reaching at most
    half a pixel out (clipped), polygons and one crowd RLE. Returns the JSON document."""
    r = random.Random(seed)
    images, anns = [], []
    aid = 1000
    for i in range(n):
        w, h = r.randint(48, 120), r.randint(40, 100)
        name = f"{'ab'[i % 2]}/{i:03d}.jpg"
        p = root / "images" / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(jpeg(w, h, seed * 1000 + i))
        images.append({"id": 5000 + 7 * i, "file_name": name, "width": w, "height": h, "license": 1})
        k = 0 if i % empty_every == 0 else r.randint(1, 6)
        for j in range(k):
            x, y = r.uniform(0, w - 10), r.uniform(0, h - 10)
            bw, bh = r.uniform(0, w - x), r.uniform(0, h - y)
            if j == 1:  # reaching a little past the right edge: clipped
                bw = w - x + 0.4
            crowd = int(j == 2 and i % 3 == 0)
            seg = ({"size": [h, w], "counts": [h * 2, h * 3, h * (w - 5)]} if crowd else
                   [[x, y, x + bw, y, x + bw / 2, y + bh]])
            anns.append({"id": aid, "image_id": 5000 + 7 * i, "category_id": r.choice(CATEGORIES)["id"],
                         "bbox": [x, y, bw, bh], "iscrowd": crowd, "area": bw * bh, "segmentation": seg})
            aid += 1
    r.shuffle(anns)  # annotations need not be grouped by image
    doc = {"info": {}, "images": images, "annotations": anns, "categories": CATEGORIES}
    (root / "instances.json").write_text(json.dumps(doc))
    return doc


def per_image(doc: dict) -> dict[int, list[dict]]:
    out: dict[int, list] = {im["id"]: [] for im in doc["images"]}
    for a in doc["annotations"]:
        out[a["image_id"]].append(a)
    return out


def xyxy(bbox, w, h) -> list[float]:
    x, y, bw, bh = bbox
    return [min(max(x, 0), w), min(max(y, 0), h), min(max(x + bw, 0), w), min(max(y + bh, 0), h)]


@pytest.fixture(scope="module")
def coco(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("coco")
    make_coco(root)
    return root


@pytest.fixture(scope="module")
def converted(coco, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("converted") / "ds"
    convert("coco", coco / "instances.json", out, images=coco / "images", progress=False, workers=2)
    return out


# -- round trip --------------------------------------------------------------------------
def test_round_trip_holds_every_image_box_label_and_size_of_the_json(coco, converted):
    doc = json.loads((coco / "instances.json").read_text())
    anns = per_image(doc)
    ds = fastload.Dataset(converted)
    assert len(ds) == len(doc["images"])
    assert list(ds.keys(np.arange(len(ds)))) == [im["file_name"] for im in doc["images"]]  # the JSON's order
    for i, im in enumerate(doc["images"]):
        item = ds[i]
        assert int(item["image_id"]) == im["id"]
        assert bytes(item["image"]) == (coco / "images" / im["file_name"]).read_bytes()  # stored byte for byte
        with Image.open(io.BytesIO(bytes(item["image"]))) as pil:
            assert pil.size == (im["width"], im["height"])
        a = anns[im["id"]]  # in the JSON's order
        want = np.array([xyxy(x["bbox"], im["width"], im["height"]) for x in a], np.float32).reshape(-1, 4)
        assert isinstance(item["boxes"], np.ndarray) and item["boxes"].dtype == np.float32
        assert item["boxes"].shape == (len(a), 4)
        np.testing.assert_array_equal(item["boxes"], want)
        assert isinstance(item["labels"], np.ndarray) and item["labels"].dtype == np.int64
        assert item["labels"].tolist() == [x["category_id"] for x in a]
        assert item["iscrowd"].dtype == np.bool_ and item["iscrowd"].tolist() == [bool(x["iscrowd"]) for x in a]
        assert (item["boxes"][:, :2] >= 0).all() and (item["boxes"][:, 2] <= im["width"]).all()
        assert (item["boxes"][:, 3] <= im["height"]).all()
    assert verify(converted) == []


def test_manifest_records_categories_counts_and_schema(coco, converted):
    doc = json.loads((coco / "instances.json").read_text())
    m, _ = load(converted)
    meta = m["metadata"]
    assert meta["categories"] == CATEGORIES
    assert meta["images_in_json"] == len(doc["images"]) and meta["annotations_in_json"] == len(doc["annotations"])
    assert meta["empty_images"] == sum(1 for a in per_image(doc).values() if not a) > 0
    size = {im["id"]: (im["width"], im["height"]) for im in doc["images"]}
    clipped = [a for a in doc["annotations"] if xyxy(a["bbox"], *size[a["image_id"]]) != xyxy(a["bbox"], 1e9, 1e9)]
    assert meta["clipped_boxes"] == len(clipped) > 0
    ds = fastload.Dataset(converted)
    assert {n: str(f) for n, f in ds.fields.items()} == {
        "image": str(ds.fields["image"]), "image_id": "int64", "boxes": "float32[*,4]", "labels": "int64[]",
        "iscrowd": "bool[]"}


def test_skip_empty_leaves_out_images_without_annotations(coco, tmp_path):
    doc = json.loads((coco / "instances.json").read_text())
    anns = per_image(doc)
    r = convert("coco", coco / "instances.json", tmp_path / "ds", images=coco / "images", skip_empty=True,
                progress=False, workers=0)
    kept = [im["file_name"] for im in doc["images"] if anns[im["id"]]]
    assert r["num_samples"] == len(kept) < len(doc["images"]) and r["skipped"] == 0
    ds = fastload.Dataset(tmp_path / "ds")
    assert list(ds.keys(np.arange(len(ds)))) == kept
    assert ds.manifest["metadata"]["empty_images_left_out"] is True
    assert min(len(ds[i]["labels"]) for i in range(len(ds))) >= 1


# -- EXIF orientation ----------------------------------------------------------------------
@pytest.mark.parametrize("masks", [False, True])
def test_exif_rotated_images_have_their_boxes_and_masks_turned_with_them(tmp_path, masks):
    """Raw pixels 60x40 with a white rectangle at (10, 5)-(30, 20), annotated in that frame;
    each EXIF orientation: the stored box (and mask) must cover the white rectangle of the
    image as the decoders deliver it (PIL's exif_transpose, as DALI)."""
    rect = (10, 5, 30, 20)
    images, anns = [], []
    for o in range(1, 9):
        (tmp_path / "im").mkdir(exist_ok=True)
        (tmp_path / "im" / f"o{o}.jpg").write_bytes(jpeg(60, 40, 0, orientation=o, rect=rect))
        images.append({"id": o, "file_name": f"o{o}.jpg", "width": 60, "height": 40})
        x0, y0, x1, y1 = rect
        anns.append({"id": 100 + o, "image_id": o, "category_id": 3, "iscrowd": 0,
                     "bbox": [x0, y0, x1 - x0, y1 - y0], "segmentation": [[x0, y0, x1, y0, x1, y1, x0, y1]]})
    (tmp_path / "i.json").write_text(json.dumps({"images": images, "annotations": anns, "categories": CATEGORIES}))
    convert("coco", tmp_path / "i.json", tmp_path / "ds", images=tmp_path / "im", masks=masks, progress=False,
            workers=0)
    ds = fastload.Dataset(tmp_path / "ds")
    for i, o in enumerate(range(1, 9)):
        item = ds[i]
        upright = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(bytes(item["image"])))).convert("L"))
        assert upright.shape == ((40, 60) if o < 5 else (60, 40))
        ys, xs = np.nonzero(upright > 128)
        white = [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]
        box = item["boxes"][0]
        assert np.abs(box - np.array(white)).max() <= 1, (o, box, white)  # (JPEG edges blur by a pixel)
        assert box[2] - box[0] == (20 if o < 5 else 15) and box[3] - box[1] == (15 if o < 5 else 20)
        if masks:
            with Image.open(io.BytesIO(bytes(item["mask"]))) as pm:
                assert pm.mode == "L" and "exif" not in pm.info
                m = np.asarray(pm)
            assert m.shape == upright.shape and set(np.unique(m).tolist()) == {0, 3}
            ys, xs = np.nonzero(m)
            assert [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1] == box.tolist()  # exactly the box
            assert (m > 0).sum() == 20 * 15


def test_a_json_size_that_is_the_upright_one_is_an_error_that_says_so(tmp_path):
    (tmp_path / "im").mkdir()
    (tmp_path / "im" / "a.jpg").write_bytes(jpeg(60, 40, 0, orientation=6))
    doc = {"images": [{"id": 1, "file_name": "a.jpg", "width": 40, "height": 60}],
           "annotations": [{"id": 9, "image_id": 1, "category_id": 1, "bbox": [1, 1, 5, 5], "iscrowd": 0}],
           "categories": CATEGORIES}
    (tmp_path / "i.json").write_text(json.dumps(doc))
    with pytest.raises(ConvertError, match=r"a\.jpg: image 1: the JSON gives its size as 40x60, but the file is "
                                           r"60x40; its size after its EXIF orientation \(6\)"):
        convert("coco", tmp_path / "i.json", tmp_path / "ds", images=tmp_path / "im", progress=False, workers=0)
    assert not (tmp_path / "ds" / "manifest.json").exists()


# -- bad annotations -----------------------------------------------------------------------
def bad_set(root: Path) -> tuple[Path, Path, dict]:
    """Five good images and one bad annotation of each kind (ids 91-95), plus a good one."""
    (root / "im").mkdir(parents=True)
    images = []
    for i in range(6):
        (root / "im" / f"{i}.jpg").write_bytes(jpeg(50, 40, i))
        images.append({"id": i, "file_name": f"{i}.jpg", "width": 50, "height": 40})
    good = {"category_id": 1, "iscrowd": 0, "segmentation": [[1, 1, 9, 1, 9, 9]]}
    anns = [{**good, "id": 90, "image_id": 5, "bbox": [1, 1, 8, 8]},
            {**good, "id": 91, "image_id": 0, "bbox": [40, 10, 20, 5]},     # reaches 10 px past the right edge
            {**good, "id": 92, "image_id": 77, "bbox": [1, 1, 5, 5]},       # no such image
            {**good, "id": 93, "image_id": 2, "bbox": [5, 5, -3, 4]},       # negative width
            {**good, "id": 94, "image_id": 3, "bbox": [5, 5, 3, 4], "category_id": 2},  # unknown category
            {**good, "id": 95, "image_id": 4, "bbox": [5, 5, 3, 4], "segmentation": [[1, 2, 3]]}]  # bad polygon
    doc = {"images": images, "annotations": anns, "categories": CATEGORIES}
    (root / "i.json").write_text(json.dumps(doc))
    return root / "i.json", root / "im", doc


@pytest.mark.parametrize("drop, match", [
    (None, r"^annotation 92: its image_id 77 is not the id of any image in i\.json"),  # first: the orphans
    (92, (r"^0\.jpg: annotation 91: bbox \[40, 10, 20, 5\] \(\[x, y, width, height\]\) reaches outside its image "
          r"of 50x40 pixels")),
    ((91, 92), r"^2\.jpg: annotation 93: bbox \[5, 5, -3, 4\] has a negative size \(width -3"),
    ((91, 92, 93), r"^3\.jpg: annotation 94: category_id 2 is not one of the JSON's categories"),
])
def test_bad_annotations_are_errors_naming_the_annotation_id(tmp_path, drop, match):
    js, im, doc = bad_set(tmp_path)
    drop = () if drop is None else (drop if isinstance(drop, tuple) else (drop,))
    doc["annotations"] = [a for a in doc["annotations"] if a["id"] not in drop]
    js.write_text(json.dumps(doc))
    with pytest.raises(ConvertError, match=match + r".*use --on-error skip"):
        convert("coco", js, tmp_path / "ds", images=im, progress=False, workers=0)
    assert not (tmp_path / "ds" / "manifest.json").exists()


def test_a_broken_segmentation_is_an_error_only_with_masks(tmp_path):
    js, im, doc = bad_set(tmp_path)
    doc["annotations"] = [a for a in doc["annotations"] if a["id"] in (90, 95)]
    js.write_text(json.dumps(doc))
    r = convert("coco", js, tmp_path / "boxes", images=im, progress=False, workers=0)
    assert r["num_samples"] == 6 and r["skipped"] == 0
    with pytest.raises(ConvertError, match=r"^4\.jpg: annotation 95: polygon 0 of its segmentation holds 3 values"):
        convert("coco", js, tmp_path / "masks", images=im, masks=True, progress=False, workers=0)


def test_on_error_skip_leaves_out_and_reports_every_bad_annotation(tmp_path):
    js, im, _ = bad_set(tmp_path)
    r = convert("coco", js, tmp_path / "ds", images=im, masks=True, on_error="skip", progress=False, workers=0)
    assert r["num_samples"] == 2 and r["skipped"] == 5  # images 1 and 5 kept; 4 images and 1 orphan left out
    report = [json.loads(x) for x in (tmp_path / "ds" / "skipped.jsonl").read_text().splitlines()]
    got = {x["key"]: x["reason"] for x in report}
    assert [x["key"] for x in report] == ["annotation 92", "0.jpg", "2.jpg", "3.jpg", "4.jpg"]
    for key, aid in [("annotation 92", 92), ("0.jpg", 91), ("2.jpg", 93), ("3.jpg", 94), ("4.jpg", 95)]:
        assert f"annotation {aid}" in f"{key}: {got[key]}"
    ds = fastload.Dataset(tmp_path / "ds")
    assert list(ds.keys(np.arange(len(ds)))) == ["1.jpg", "5.jpg"]
    assert ds[1]["boxes"].tolist() == [[1, 1, 9, 9]] and ds[0]["boxes"].shape == (0, 4)


def test_a_missing_image_file_and_a_size_mismatch_are_sample_errors(tmp_path):
    js, im, doc = bad_set(tmp_path)
    doc["annotations"] = [a for a in doc["annotations"] if a["id"] == 90]
    doc["images"][1]["width"] = 51
    js.write_text(json.dumps(doc))
    (im / "3.jpg").unlink()
    r = convert("coco", js, tmp_path / "ds", images=im, on_error="skip", progress=False, workers=0)
    assert r["num_samples"] == 4
    report = {json.loads(x)["key"]: json.loads(x)["reason"] for x in (tmp_path / "ds" / "skipped.jsonl").open()}
    assert "the JSON gives its size as 51x40, but the file is 50x40" in report["1.jpg"]
    assert "cannot read file" in report["3.jpg"] or "no such file" in report["3.jpg"].lower()


def test_refused_before_any_work(tmp_path):
    js, im, doc = bad_set(tmp_path)
    # a category id that is no 8-bit mask pixel
    d = {**doc, "categories": CATEGORIES + [{"id": 300, "name": "big"}]}
    js.write_text(json.dumps(d))
    with pytest.raises(ConvertError, match=r"category 300 \('big'\) cannot be a mask pixel.*ids must be 1\.\.255"):
        convert("coco", js, tmp_path / "ds", images=im, masks=True, progress=False)
    convert("coco", js, tmp_path / "ok", images=im, on_error="skip", progress=False, workers=0)  # fine without masks
    for bad, match in [({**doc, "images": [doc["images"][0]] * 2}, r"two images have id 0"),
                       ({"annotations": []}, r"no 'images' list"),
                       ({**doc, "categories": [{"id": "x", "name": "a"}]}, r"categories\[0\] needs an integer 'id'")]:
        js.write_text(json.dumps(bad))
        with pytest.raises(ConvertError, match=match):
            convert("coco", js, tmp_path / "ds", images=im, progress=False)
    js.write_text("{not json")
    with pytest.raises(ConvertError, match=r"i\.json: not a JSON file"):
        convert("coco", js, tmp_path / "ds", images=im, progress=False)
    js.write_text(json.dumps(doc))
    with pytest.raises(ConvertError, match="needs the folder of the images"):
        convert("coco", js, tmp_path / "ds", progress=False)
    with pytest.raises(ConvertError, match=r"--max-size does not apply to coco sources \(boxes and masks"):
        convert("coco", js, tmp_path / "ds", images=im, max_size=64, progress=False)
    with pytest.raises(ConvertError, match=r"--masks does not apply to imagefolder sources"):
        convert("imagefolder", im, tmp_path / "ds", masks=True, progress=False)
    assert not (tmp_path / "ds").exists()


# -- engines and the distributed core ------------------------------------------------------
def test_the_distributed_core_in_several_groups_equals_the_local_convert(coco, converted, tmp_path):
    """plan (the JSON parsed once, its listing written) -> a task per group reading its rows
    -> commit: the same dataset as the local engine."""
    plan = make_plan("coco", coco / "instances.json", tmp_path / "ds", shard_size=20_000, overwrite=False,
                     resume=False, source_options={"images": str(coco / "images")})
    assert plan.num_groups >= 3 and (tmp_path / "ds" / ".fastload-parts" / "coco.parquet").exists()
    for g in range(plan.num_groups):
        assert run_group(str(tmp_path / "ds"), g)["error"] is None
    commit(plan)
    assert_same_rows(converted, tmp_path / "ds")


def test_the_torch_engine_produces_the_same_dataset_with_masks(coco, tmp_path):
    local = tmp_path / "local"
    convert("coco", coco / "instances.json", local, images=coco / "images", masks=True, progress=False, workers=0)
    r = convert("coco", coco / "instances.json", tmp_path / "torch", images=coco / "images", masks=True,
                engine="torch", workers=2, shard_size="30KB", allow_small_shards=True, progress=False)
    assert r["num_groups"] >= 2
    assert_same_rows(local, tmp_path / "torch")
    assert verify(tmp_path / "torch") == []


def test_resume_refuses_other_coco_options(coco, tmp_path):
    make_plan("coco", coco / "instances.json", tmp_path / "ds", shard_size=20_000, overwrite=False, resume=False,
              source_options={"images": str(coco / "images"), "masks": True})
    with pytest.raises(ConvertError, match=r"--resume: the interrupted conversion used masks=True, this one "
                                           r"masks=None"):
        make_plan("coco", coco / "instances.json", tmp_path / "ds", shard_size=20_000, overwrite=False,
                  resume=True, source_options={"images": str(coco / "images")})


# -- the command line ----------------------------------------------------------------------
def test_cli_convert_coco_takes_json_images_dir_and_dst(coco, converted, tmp_path, capsys):
    js, im = str(coco / "instances.json"), str(coco / "images")
    assert cli_main(["convert", "coco", js, im, str(tmp_path / "ds"), "-q", "--workers", "0"]) == 0
    assert "wrote 24 samples" in capsys.readouterr().out
    assert_same_rows(converted, tmp_path / "ds")
    assert cli_main(["convert", "coco", js, im, str(tmp_path / "m"), "-q", "--masks", "--skip-empty",
                     "--workers", "2"]) == 0  # the masks made in two validation processes
    ds = fastload.Dataset(tmp_path / "m")
    assert "mask" in ds.fields and len(ds) < 24
    convert("coco", js, tmp_path / "m0", images=im, masks=True, skip_empty=True, progress=False, workers=0)
    assert_same_rows(tmp_path / "m0", tmp_path / "m")
    assert cli_main(["convert", "coco", js, str(tmp_path / "x")]) == 2
    assert "coco takes three paths" in capsys.readouterr().err
    assert cli_main(["convert", "imagefolder", im, str(tmp_path / "x"), str(tmp_path / "y")]) == 2
    assert "only for coco sources" in capsys.readouterr().err
    assert cli_main(["convert", "imagefolder", im, str(tmp_path / "x"), "--masks"]) == 2
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_resume_reuses_finished_groups_and_refuses_a_changed_json(coco, converted, tmp_path):
    """A group fails (an image file is missing); the user puts it back; --resume reuses the
    finished groups. A JSON edited since the plan is refused, naming it."""
    import shutil

    from fastload.convert.sourcestate import SourceChanged

    src = tmp_path / "c"
    shutil.copytree(coco, src)
    opts = {"images": str(src / "images")}
    plan = make_plan("coco", src / "instances.json", tmp_path / "ds", shard_size=20_000, overwrite=False,
                     resume=False, source_options=opts)
    last = plan.bounds(plan.num_groups - 1)[0]
    name = json.loads((src / "instances.json").read_text())["images"][last]["file_name"]
    (src / "images" / name).rename(tmp_path / "aside.jpg")
    results = [run_group(str(tmp_path / "ds"), g) for g in range(plan.num_groups)]
    assert [r["error"] is None for r in results] == [True] * (plan.num_groups - 1) + [False]
    assert name in results[-1]["error"]
    (tmp_path / "aside.jpg").rename(src / "images" / name)
    again = make_plan("coco", src / "instances.json", tmp_path / "ds", shard_size=20_000, overwrite=False,
                      resume=True, source_options=opts)
    assert again == plan
    assert [run_group(str(tmp_path / "ds"), g)["reused"] for g in range(plan.num_groups)] == \
        [True] * (plan.num_groups - 1) + [False]
    commit(plan)
    assert_same_rows(converted, tmp_path / "ds")

    plan = make_plan("coco", src / "instances.json", tmp_path / "ds2", shard_size=20_000, overwrite=False,
                     resume=False, source_options=opts)
    (src / "instances.json").write_text((src / "instances.json").read_text() + " ")
    with pytest.raises(SourceChanged, match=r"--resume refused: .*instances\.json"):
        make_plan("coco", src / "instances.json", tmp_path / "ds2", shard_size=20_000, overwrite=False,
                  resume=True, source_options=opts)


def test_the_distributed_core_skips_and_reports_bad_annotations_as_the_local_engine(tmp_path):
    js, im, _ = bad_set(tmp_path)
    convert("coco", js, tmp_path / "local", images=im, masks=True, on_error="skip", progress=False, workers=0)
    plan = make_plan("coco", js, tmp_path / "ds", shard_size=3_000, overwrite=False, resume=False,
                     source_options={"images": str(im), "masks": True})
    assert plan.num_groups >= 2
    for g in range(plan.num_groups):
        assert run_group(str(tmp_path / "ds"), g, "skip")["error"] is None
    r = commit(plan, "skip")
    assert r["num_samples"] == 2 and r["skipped"] == 5
    assert_same_rows(tmp_path / "local", tmp_path / "ds")
    report = [json.loads(x) for x in (tmp_path / "ds" / "skipped.jsonl").read_text().splitlines()]
    assert report == [json.loads(x) for x in (tmp_path / "local" / "skipped.jsonl").read_text().splitlines()]

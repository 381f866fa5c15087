"""fastload convert: every source kind, the Python entry point and the CLI, bad input."""
import io
import json
import tarfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

import fastload
from fastload.convert import ConvertError, convert
from fastload.demo.photos import make_image_folder
from _zygote import run_python


def run_cli(*args, check=None):
    p = run_python("-m", "fastload", *args, timeout=300)  # forked from the tests' launcher (tests/_zygote.py)
    if check is not None:
        assert p.returncode == check, (p.returncode, p.stdout, p.stderr)
    return p


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("src") / "images"
    make_image_folder(root, 30, seed=1, classes=3, min_side=64, max_side=120)
    # A PNG with alpha and a grayscale JPEG, as ImageFolder accepts any image extension.
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 50, 4), dtype=np.uint8)).save(
        root / "astronaut" / "alpha.png")
    Image.fromarray(np.zeros((20, 30), np.uint8)).save(root / "camera" / "gray.jpg")
    (root / "camera" / "notes.txt").write_text("not an image; ignored like torchvision does")
    return root


def _files(root):
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    out = []
    for ci, c in enumerate(classes):
        for p in sorted((root / c).iterdir()):
            if p.suffix in (".jpg", ".png"):
                out.append((f"{c}/{p.name}", ci, p.read_bytes()))
    return classes, out


def test_imagefolder_round_trip(folder, tmp_path):
    r = convert("imagefolder", folder, tmp_path / "ds", progress=False, workers=2)
    classes, files = _files(folder)
    assert r["num_samples"] == len(files) == 32 and r["skipped"] == 0
    ds = fastload.Dataset(tmp_path / "ds")
    assert ds.class_names == classes
    assert ds.label_field == "label"
    assert ds.class_counts.tolist() == np.bincount([ci for _, ci, _ in files]).tolist()
    assert ds.keys(range(len(ds))) == [k for k, _, _ in files]
    b = ds.get_batch(np.arange(len(ds)))
    assert b["image"] == [data for _, _, data in files]
    assert b["label"].tolist() == [ci for _, ci, _ in files]
    w, h = ds.image_sizes("image", np.arange(len(ds)))
    assert [(int(a), int(c)) for a, c in zip(w, h)] == [Image.open(io.BytesIO(d)).size for _, _, d in files]
    assert ds.manifest["metadata"]["ignored_files"] == 1
    assert fastload.verify(tmp_path / "ds") == []


def test_workers_do_not_change_the_output(folder, tmp_path):
    convert("imagefolder", folder, tmp_path / "a", progress=False, workers=0)
    convert("imagefolder", folder, tmp_path / "b", progress=False, workers=2)
    ma = json.loads((tmp_path / "a" / "manifest.json").read_text())
    mb = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert [s["checksum"] for s in ma["shards"]] == [s["checksum"] for s in mb["shards"]]


def test_corrupt_image_raise_names_the_file_and_leaves_nothing(folder, tmp_path):
    import shutil
    src = tmp_path / "src"
    shutil.copytree(folder, src)
    bad = src / "chelsea" / "broken.jpg"
    good = next((src / "chelsea").glob("*.jpg")).read_bytes()
    bad.write_bytes(good[: len(good) // 3])  # truncated JPEG
    (src / "chelsea" / "anim.gif").write_bytes(b"")  # .gif is not an image extension: ignored
    p = run_cli("convert", "imagefolder", src, tmp_path / "out", "-q", "--workers", "2", check=1)
    assert "chelsea/broken.jpg" in p.stderr and "--on-error skip" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out" / "manifest.json").exists()
    assert not list((tmp_path / "out").glob("shard-*"))
    # skip: converted without it, listed in the report, counted on stdout
    p = run_cli("convert", "imagefolder", src, tmp_path / "out2", "-q", "--on-error", "skip", check=0)
    assert "skipped 1 sample" in p.stdout
    report = [json.loads(line) for line in (tmp_path / "out2" / "skipped.jsonl").read_text().splitlines()]
    assert [r["key"] for r in report] == ["chelsea/broken.jpg"]
    assert "not a decodable image" in report[0]["reason"]
    ds = fastload.Dataset(tmp_path / "out2")
    assert len(ds) == 32 and "chelsea/broken.jpg" not in ds.keys(range(len(ds)))
    assert "skipped   1" in run_cli("inspect", tmp_path / "out2", check=0).stdout


def test_max_pixels_refuses_big_images(folder, tmp_path):
    r = convert("imagefolder", folder, tmp_path / "ds", progress=False, on_error="skip", max_pixels=100 * 100)
    assert r["skipped"] > 0
    report = (tmp_path / "ds" / "skipped.jsonl").read_text()
    assert "exceeds max_pixels=10000" in report



def test_imagefolder_refuses_empty_classes_and_a_destination_inside_the_source(folder, tmp_path):
    with pytest.raises(ConvertError, match="inside the source"):
        convert("imagefolder", folder, folder / "out", progress=False)
    assert not (folder / "out").exists()
    src = tmp_path / "src"
    (src / "cat").mkdir(parents=True)
    (src / "dog").mkdir()
    (src / "cat" / "notes.txt").write_text("no images here")
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(src / "dog" / "a.jpg")
    with pytest.raises(ConvertError, match=r"class folder\(s\) 'cat' hold no image files"):
        convert("imagefolder", src, tmp_path / "ds", progress=False)

def test_arrays_npz_npy_and_folder(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((100, 4, 5)).astype(np.float32)
    labels = rng.integers(0, 10, 100)
    flags = rng.random(100) > 0.5
    np.savez(tmp_path / "d.npz", x=x, label=labels, flag=flags)
    r = convert("arrays", tmp_path / "d.npz", tmp_path / "ds", progress=False, shard_size=2000, allow_small_shards=True)
    ds = fastload.Dataset(tmp_path / "ds")
    assert r["num_samples"] == 100 and ds.num_shards > 1
    assert str(ds.fields["x"]) == "float32[4,5]" and str(ds.fields["flag"]) == "bool"
    b = ds.get_batch(np.arange(100)[::-1])
    np.testing.assert_array_equal(b["x"], x[::-1])
    np.testing.assert_array_equal(b["label"], labels[::-1])
    np.testing.assert_array_equal(b["flag"], flags[::-1])
    assert ds.class_counts.tolist() == np.bincount(labels).tolist()
    np.save(tmp_path / "tokens.npy", np.arange(50 * 8, dtype=np.int32).reshape(50, 8))
    convert("arrays", tmp_path / "tokens.npy", tmp_path / "ds2", progress=False)
    assert fastload.Dataset(tmp_path / "ds2")[7]["tokens"].tolist() == list(range(56, 64))
    (tmp_path / "dir").mkdir()
    np.save(tmp_path / "dir" / "a.npy", np.arange(10))
    np.save(tmp_path / "dir" / "b.npy", np.arange(10) * 2.0)
    convert("arrays", tmp_path / "dir", tmp_path / "ds3", progress=False)
    assert fastload.Dataset(tmp_path / "ds3")[3] == {"a": 3, "b": 6.0}


def test_arrays_bad_input(tmp_path):
    np.savez(tmp_path / "uneven.npz", a=np.zeros(3), b=np.zeros(4))
    with pytest.raises(ConvertError, match="disagree on the number of samples"):
        convert("arrays", tmp_path / "uneven.npz", tmp_path / "o1", progress=False)
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    with pytest.raises(ConvertError, match="obj.npy"):
        convert("arrays", tmp_path / "obj.npy", tmp_path / "o2", progress=False)
    (tmp_path / "junk.npz").write_bytes(b"junk")
    with pytest.raises(ConvertError, match="junk.npz: not a readable numpy file"):
        convert("arrays", tmp_path / "junk.npz", tmp_path / "o3", progress=False)


def test_table_parquet_csv_jsonl_with_image_paths_and_string_labels(folder, tmp_path):
    classes, files = _files(folder)
    paths = [str(folder / k) for k, _, _ in files]
    names = [classes[ci] for _, ci, _ in files]
    t = pa.table({"path": paths, "cls": names, "score": np.linspace(0, 1, len(paths)),
                  "vec": pa.array([[i, i + 1] for i in range(len(paths))], pa.list_(pa.int16(), 2)),
                  "caption": [f"photo {i}" for i in range(len(paths))]})
    pq.write_table(t, tmp_path / "t.parquet")
    convert("table", tmp_path / "t.parquet", tmp_path / "ds", progress=False, label="cls")
    ds = fastload.Dataset(tmp_path / "ds")
    assert ds.fields["path"].kind == "image" and ds.fields["caption"].kind == "string"
    assert str(ds.fields["vec"]) == "int16[2]"
    assert ds.class_names == sorted(set(names))
    b = ds.get_batch(np.arange(len(ds)))
    assert b["path"] == [d for _, _, d in files]
    assert [ds.class_names[i] for i in b["cls"]] == names
    np.testing.assert_allclose(b["score"], np.linspace(0, 1, len(paths)))
    assert b["vec"][3].tolist() == [3, 4]
    # CSV and JSON lines, numbers only: the bulk path.
    (tmp_path / "t.csv").write_text("a,b,label\n1,2.5,0\n3,4.5,1\n5,6.5,1\n")
    convert("table", tmp_path / "t.csv", tmp_path / "csv", progress=False)
    d2 = fastload.Dataset(tmp_path / "csv")
    assert d2.get_batch([0, 1, 2])["b"].tolist() == [2.5, 4.5, 6.5] and d2.label_field == "label"
    (tmp_path / "t.jsonl").write_text('{"x": 1, "s": "a"}\n{"x": 2, "s": "b"}\n')
    convert("table", tmp_path / "t.jsonl", tmp_path / "jl", progress=False)
    assert fastload.Dataset(tmp_path / "jl")[1] == {"x": 2, "s": "b"}


def test_table_bad_input(tmp_path):
    (tmp_path / "nulls.csv").write_text("a,b\n1,\n2,3\n")
    with pytest.raises(ConvertError, match="column 'b' has 1 missing value"):
        convert("table", tmp_path / "nulls.csv", tmp_path / "o", progress=False)
    (tmp_path / "t.xlsx").write_text("")
    with pytest.raises(ConvertError, match="unknown table type"):
        convert("table", tmp_path / "t.xlsx", tmp_path / "o", progress=False)
    (tmp_path / "ok.csv").write_text("a\n1\n")
    with pytest.raises(ConvertError, match="--image-column 'nope' is not a column"):
        convert("table", tmp_path / "ok.csv", tmp_path / "o", progress=False, image_columns=["nope"])


def test_webdataset_tar(folder, tmp_path):
    classes, files = _files(folder)
    tar_path = tmp_path / "shard-000.tar"
    with tarfile.open(tar_path, "w") as tf:
        for i, (_k, ci, data) in enumerate(files[:10]):
            for ext, payload in (("jpg", data), ("cls", str(ci).encode()), ("txt", f"caption {i}".encode())):
                info = tarfile.TarInfo(f"s{i:04d}.{ext}")
                info.size = len(payload)
                tf.addfile(info, io.BytesIO(payload))
    convert("webdataset", tar_path, tmp_path / "ds", progress=False, workers=2)
    ds = fastload.Dataset(tmp_path / "ds")
    assert set(ds.fields) == {"cls", "jpg", "txt"} and ds.label_field == "cls"
    b = ds.get_batch(np.arange(10))
    assert b["jpg"] == [d for _, _, d in files[:10]]
    assert b["cls"].tolist() == [ci for _, ci, _ in files[:10]]
    assert b["txt"] == [f"caption {i}" for i in range(10)]
    assert ds.keys([2]) == ["shard-000.tar:s0002"]


def test_writer_errors_are_per_sample_errors(tmp_path):
    """A sample the writer refuses (wrong shape) is skipped or named like an unreadable one."""
    tar_path = tmp_path / "a.tar"
    with tarfile.open(tar_path, "w") as tf:
        for i, n in enumerate(((2,), (3, 2), (2,))):  # the second sample's array has the wrong shape
            buf = io.BytesIO()  # (a first dimension that varies alone would make a ragged field)
            np.save(buf, np.zeros(n, dtype=np.float32))
            for ext, payload in (("npy", buf.getvalue()), ("cls", str(i).encode())):
                info = tarfile.TarInfo(f"s{i}.{ext}")
                info.size = len(payload)
                tf.addfile(info, io.BytesIO(payload))
    with pytest.raises(ConvertError, match=r"a.tar:s1.*got shape \(3, 2\), expected \(2,\).*--on-error skip"):
        convert("webdataset", tar_path, tmp_path / "ds", progress=False)
    assert not (tmp_path / "ds" / "manifest.json").exists()
    r = convert("webdataset", tar_path, tmp_path / "ds2", progress=False, on_error="skip")
    assert r["num_samples"] == 2 and r["skipped"] == 1
    report = [json.loads(line) for line in (tmp_path / "ds2" / "skipped.jsonl").read_text().splitlines()]
    assert [x["key"] for x in report] == ["a.tar:s1"] and "shape" in report[0]["reason"]
    assert fastload.Dataset(tmp_path / "ds2").keys([0, 1]) == ["a.tar:s0", "a.tar:s2"]
    # a negative label is that sample's fault, whenever the shard it lands in is written
    tar_path = tmp_path / "b.tar"
    with tarfile.open(tar_path, "w") as tf:
        for i in range(6):
            for ext, payload in (("npy", _npy(np.zeros(2, np.float32))), ("cls", str(-1 if i == 1 else i).encode())):
                info = tarfile.TarInfo(f"s{i}.{ext}")
                info.size = len(payload)
                tf.addfile(info, io.BytesIO(payload))
    with pytest.raises(ConvertError, match=r"^b.tar:s1: .*class id -1"):
        convert("webdataset", tar_path, tmp_path / "ds3", progress=False, shard_size=40, allow_small_shards=True)
    r = convert("webdataset", tar_path, tmp_path / "ds4", progress=False, on_error="skip", shard_size=40, allow_small_shards=True)
    assert r["num_samples"] == 5 and r["skipped"] == 1
    assert fastload.Dataset(tmp_path / "ds4").class_counts.tolist() == [1, 0, 1, 1, 1, 1]

    # the bulk sources (tables, arrays) too: the bad row is found and named or skipped
    (tmp_path / "neg.csv").write_text("a,label\n1.5,0\n2.5,-1\n3.5,1\n")
    with pytest.raises(ConvertError, match=r"neg.csv:1.*class id -1.*--on-error skip"):
        convert("table", tmp_path / "neg.csv", tmp_path / "t1", progress=False)
    r = convert("table", tmp_path / "neg.csv", tmp_path / "t2", progress=False, on_error="skip")
    assert r["num_samples"] == 2 and r["skipped"] == 1
    d = fastload.Dataset(tmp_path / "t2")
    assert d.keys([0, 1]) == ["neg.csv:0", "neg.csv:2"] and d.get_batch([0, 1])["a"].tolist() == [1.5, 3.5]
    np.savez(tmp_path / "neg.npz", x=np.arange(8, dtype=np.float32).reshape(4, 2),
             label=np.array([0, 1, -3, 1]))
    r = convert("arrays", tmp_path / "neg.npz", tmp_path / "a2", progress=False, on_error="skip")
    assert r["skipped"] == 1 and fastload.Dataset(tmp_path / "a2").keys([2]) == ["3"]
    report = [json.loads(x) for x in (tmp_path / "a2" / "skipped.jsonl").read_text().splitlines()]
    assert [x["key"] for x in report] == ["2"] and "class id -3" in report[0]["reason"]


def test_string_labels_are_found_without_flag_and_index_is_reserved(tmp_path):
    (tmp_path / "s.csv").write_text("w,label\n1.0,dog\n2.0,cat\n3.0,dog\n")
    convert("table", tmp_path / "s.csv", tmp_path / "s", progress=False)
    d = fastload.Dataset(tmp_path / "s")
    assert d.label_field == "label" and d.class_names == ["cat", "dog"]
    assert d.get_batch([0, 1, 2])["label"].tolist() == [1, 0, 1]
    with pytest.raises(ValueError, match=r"'index' is reserved.*batch\['index'\]"):
        fastload.ShardWriter(tmp_path / "i", fields={"x": "float32", "index": "int64"})
    (tmp_path / "i.csv").write_text("x,index\n1.0,5\n")
    with pytest.raises(ValueError, match="'index' is reserved"):
        convert("table", tmp_path / "i.csv", tmp_path / "i2", progress=False)
    tar_path = tmp_path / "w.tar"
    with tarfile.open(tar_path, "w") as tf:
        for i in range(3):
            for ext, payload in (("index", str(10 + i).encode()), ("cls", b"0")):
                info = tarfile.TarInfo(f"s{i}.{ext}")
                info.size = len(payload)
                tf.addfile(info, io.BytesIO(payload))
    convert("webdataset", tar_path, tmp_path / "w", progress=False)
    w = fastload.Dataset(tmp_path / "w")
    assert set(w.fields) == {"source_index", "cls"}
    with fastload.Loader(w, batch_size=3, shuffle=False, device="cpu") as loader:
        b = next(iter(loader))
    assert b["source_index"].tolist() == [10, 11, 12] and b["index"].tolist() == [0, 1, 2]
    with tarfile.open(tmp_path / "x.tar", "w") as tf:  # .index and .source_index would collide
        for ext in ("index", "source_index"):
            info = tarfile.TarInfo(f"s0.{ext}")
            info.size = 1
            tf.addfile(info, io.BytesIO(b"1"))
    with pytest.raises(ConvertError, match=r"\.index and \.source_index would both be stored"):
        convert("webdataset", tmp_path / "x.tar", tmp_path / "x", progress=False)


def _npy(a):
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def test_failed_overwrite_keeps_the_old_dataset_and_workers_are_stopped(folder, tmp_path):
    import shutil

    import psutil
    np.savez(tmp_path / "a.npz", x=np.arange(10, dtype=np.float32))
    convert("arrays", tmp_path / "a.npz", tmp_path / "ds", progress=False)
    src = tmp_path / "src"
    shutil.copytree(folder, src)
    (src / "astronaut" / "0000-bad.jpg").write_bytes(b"not a jpeg")  # fails early, among 33
    before = set(psutil.Process().children(recursive=True))  # (the session's own: the tests' launcher)
    with pytest.raises(ConvertError, match="0000-bad.jpg"):
        convert("imagefolder", src, tmp_path / "ds", overwrite=True, progress=False, workers=2)
    # the validation pool is gone at once, not when the generator is garbage-collected
    assert set(psutil.Process().children(recursive=True)) - before == set()
    ds = fastload.Dataset(tmp_path / "ds")  # the old dataset is still there, whole
    assert list(ds.fields) == ["x"] and len(ds) == 10 and fastload.verify(tmp_path / "ds") == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npz", "ds", "src"]
    # a successful overwrite replaces it
    r = convert("imagefolder", folder, tmp_path / "ds", overwrite=True, progress=False, workers=2)
    assert r["num_samples"] == 32 and len(fastload.Dataset(tmp_path / "ds")) == 32
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npz", "ds", "src"]


def test_cli_bad_invocations_give_one_clear_line(folder, tmp_path):
    p = run_cli("convert", "pictures", folder, tmp_path / "o")
    assert p.returncode == 2 and "invalid choice: 'pictures'" in p.stderr
    p = run_cli("convert", "imagefolder", tmp_path / "missing", tmp_path / "o", check=1)
    assert p.stderr.strip() == f"fastload convert: error: {tmp_path / 'missing'}: no such file or directory"
    p = run_cli("convert", "imagefolder", folder, tmp_path / "o", "--shard-size", "lots", check=1)
    assert "shard_size='lots' is not a size" in p.stderr
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    p = run_cli("convert", "imagefolder", folder, tmp_path / "full", "-q", check=1)
    assert "not empty" in p.stderr and (tmp_path / "full" / "x").read_text() == "keep me"
    run_cli("convert", "imagefolder", folder, tmp_path / "ds", "-q", check=0)
    run_cli("convert", "imagefolder", folder, tmp_path / "ds", "-q", check=1)
    run_cli("convert", "imagefolder", folder, tmp_path / "ds", "-q", "--overwrite", check=0)
    p = run_cli("inspect", tmp_path / "ds", check=0)
    assert "samples   32" in p.stdout and "astronaut" in p.stdout and "(label)" in p.stdout
    assert json.loads(run_cli("inspect", "--json", tmp_path / "ds", check=0).stdout)["num_samples"] == 32
    run_cli("verify", tmp_path / "ds", check=0)
    name = json.loads((tmp_path / "ds" / "manifest.json").read_text())["shards"][0]["file"]  # a new generation's
    shard = tmp_path / "ds" / name
    data = bytearray(shard.read_bytes())
    data[-100] ^= 1
    shard.write_bytes(bytes(data))
    p = run_cli("verify", tmp_path / "ds", check=1)
    assert f"DAMAGED {name}: checksum mismatch" in p.stdout
    p = run_cli("inspect", tmp_path / "nothing", check=1)
    assert "does not exist" in p.stderr


def test_default_workers_are_the_usable_cores(tmp_path, monkeypatch):
    import importlib

    import fastload.errors
    common = importlib.import_module("fastload.convert.common")  # fastload.convert is also the function
    asked = []

    def one_core():
        asked.append(True)
        return 1

    monkeypatch.setattr(common, "usable_cores", one_core)
    np.savez(tmp_path / "a.npz", x=np.arange(4, dtype=np.float32))
    convert("arrays", tmp_path / "a.npz", tmp_path / "ds", progress=False)
    assert asked == [True]
    convert("arrays", tmp_path / "a.npz", tmp_path / "ds2", progress=False, workers=3)
    assert asked == [True]  # an explicit count is taken as given
    assert ConvertError is fastload.errors.ConvertError and issubclass(ConvertError, fastload.errors.FastloadError)



def test_the_convert_package_is_callable_as_the_function(tmp_path):
    """``import fastload.convert`` binds the package to ``fastload.convert`` (over the function,
    when ``fastload/__init__`` binds it lazily); calling it still converts."""
    import importlib
    pkg = importlib.import_module("fastload.convert")
    np.savez(tmp_path / "a.npz", x=np.arange(6, dtype=np.int16))
    r = pkg("arrays", tmp_path / "a.npz", tmp_path / "ds", progress=False)
    assert r["num_samples"] == 6 and fastload.Dataset(tmp_path / "ds")[5] == {"x": 5}
    assert pkg.convert is convert and callable(fastload.convert)

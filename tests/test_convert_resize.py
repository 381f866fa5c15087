"""convert --max-size N: images stored pre-resized (longer side N), the others byte for byte;
every source kind with images, the CLI, and a distributed conversion."""
from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

import fastload
from fastload.convert import ConvertError, convert
from fastload.errors import UsageError
from fastload.demo.photos import photos
from _zygote import python_shim, run_python

N = 128
ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args, check=None):
    p = run_python("-m", "fastload", *args, timeout=300, cwd=ROOT)  # forked from the tests' launcher (tests/_zygote.py)
    if check is not None:
        assert p.returncode == check, (p.returncode, p.stdout, p.stderr)
    return p


def encode(arr: np.ndarray, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, fmt, **kw)
    return buf.getvalue()


def crop(h: int, w: int, seed: int = 0) -> np.ndarray:
    """A real photograph's pixels, ``h`` x ``w`` RGB."""
    img = np.asarray(Image.fromarray(next(iter(photos().values()))).resize((w, h), Image.Resampling.BILINEAR))
    return np.ascontiguousarray(np.roll(img, seed * 17, axis=1))


def upright_marker() -> np.ndarray:
    """A 200x400 (h x w) image, red in its top-left quadrant, blue elsewhere."""
    a = np.zeros((200, 400, 3), np.uint8)
    a[...] = (0, 0, 255)
    a[:100, :200] = (255, 0, 0)
    return a


def rotated_jpeg() -> bytes:
    """upright_marker() stored turned a quarter counterclockwise, with EXIF orientation 6
    (rotate 90 degrees clockwise to display): it displays as upright_marker(), 400x200."""
    exif = Image.Exif()
    exif[0x0112] = 6
    return encode(np.ascontiguousarray(np.rot90(upright_marker())), "JPEG", quality=95, exif=exif.tobytes())


# name -> (bytes, displayed (w, h), format stored when resized)
def sources() -> dict[str, tuple[bytes, tuple[int, int], str]]:
    rgba = np.concatenate([crop(150, 300, 1), np.full((150, 300, 1), 200, np.uint8)], axis=-1)
    return {
        "big.jpg": (encode(crop(300, 600), "JPEG", quality=90), (600, 300), "JPEG"),
        "tall.jpg": (encode(crop(500, 201, 2), "JPEG", quality=90), (201, 500), "JPEG"),
        "rotated.jpg": (rotated_jpeg(), (400, 200), "JPEG"),
        "alpha.png": (encode(rgba, "PNG"), (300, 150), "PNG"),
        "plain.bmp": (encode(crop(160, 160, 3), "BMP"), (160, 160), "JPEG"),
        "small.jpg": (encode(crop(80, 100, 4), "JPEG", quality=75), (100, 80), None),
        "small.png": (encode(crop(N, 60, 5), "PNG"), (60, N), None),  # exactly N: kept
    }


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("resize") / "images"
    for i, (name, (data, _, _)) in enumerate(sorted(sources().items())):
        d = root / ("a" if i % 2 else "b")
        d.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(data)
    return root


def stored(dst: Path, field: str = "image") -> dict[str, tuple[bytes, tuple[int, int]]]:
    """key (an image folder's: the file name alone) -> (stored bytes, recorded (w, h))."""
    ds = fastload.Dataset(dst)
    idx = np.arange(len(ds))
    w, h = ds.image_sizes(field, idx)
    return {k.rsplit("/", 1)[-1]: (d, (int(a), int(b)))
            for k, d, a, b in zip(ds.keys(idx), ds.get_batch(idx)[field], w, h)}


def check_resized(data: bytes, size: tuple[int, int], source: tuple[bytes, tuple[int, int], str | None],
                  max_size: int = N) -> None:
    orig, (ow, oh), fmt = source
    with Image.open(io.BytesIO(data)) as im:
        assert im.size == size  # recorded = decoded (the new file carries no EXIF orientation)
        assert im.getexif().get(0x0112) is None
        if fmt is None:  # small enough: the very same bytes
            assert data == orig and size == (ow, oh)
            return
        assert im.format == fmt and max(size) == max_size
        short, oshort = min(size), min(ow, oh)
        assert abs(short - oshort * max_size / max(ow, oh)) <= 1  # aspect kept within a pixel
        assert (size[0] >= size[1]) == (ow >= oh)


def test_imagefolder_resizes_large_images_and_keeps_small_ones(folder, tmp_path):
    src = sources()
    r = convert("imagefolder", folder, tmp_path / "ds", progress=False, workers=2, max_size=N)
    assert r["num_samples"] == len(src) and r["max_size"] == N and r["resized_images"] == 5
    got = stored(tmp_path / "ds")
    assert sorted(got) == sorted(src)
    for name, (data, size) in got.items():
        check_resized(data, size, src[name])
    md = fastload.Dataset(tmp_path / "ds").manifest["metadata"]
    assert (md["max_size"], md["quality"], md["resized_images"]) == (N, 90, 5)
    assert fastload.verify(tmp_path / "ds") == []
    # EXIF orientation applied before resizing: the stored image is upright (red top-left)
    rot = np.asarray(Image.open(io.BytesIO(got["rotated.jpg"][0])).convert("RGB")).astype(int)
    assert rot.shape == (64, 128, 3)
    assert rot[10, 10, 0] > 200 and rot[10, 10, 2] < 60 and rot[50, 100, 2] > 200 and rot[50, 100, 0] < 60
    # PNG stays PNG and lossless: exactly PIL's Lanczos resize of the source pixels
    png = got["alpha.png"][0]
    want = Image.open(io.BytesIO(src["alpha.png"][0])).resize((N, 64), Image.Resampling.LANCZOS)
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(png))), np.asarray(want))
    # without --max-size nothing changes and nothing is recorded
    convert("imagefolder", folder, tmp_path / "plain", progress=False, workers=0)
    assert all(d == src[k][0] for k, (d, _) in stored(tmp_path / "plain").items())
    assert "max_size" not in fastload.Dataset(tmp_path / "plain").manifest["metadata"]


def test_quality_and_workers(folder, tmp_path):
    convert("imagefolder", folder, tmp_path / "q90", progress=False, workers=0, max_size=N)
    convert("imagefolder", folder, tmp_path / "q90b", progress=False, workers=2, max_size=N)
    a = json.loads((tmp_path / "q90" / "manifest.json").read_text())
    b = json.loads((tmp_path / "q90b" / "manifest.json").read_text())
    assert [s["checksum"] for s in a["shards"]] == [s["checksum"] for s in b["shards"]]
    convert("imagefolder", folder, tmp_path / "q40", progress=False, max_size=N, quality=40)
    q90, q40 = stored(tmp_path / "q90"), stored(tmp_path / "q40")
    assert fastload.Dataset(tmp_path / "q40").manifest["metadata"]["quality"] == 40
    assert len(q40["big.jpg"][0]) < len(q90["big.jpg"][0]) and q40["big.jpg"][1] == q90["big.jpg"][1]
    assert q40["alpha.png"] == q90["alpha.png"]  # PNG: lossless, the quality is for JPEG


@pytest.mark.parametrize("kw, match", [
    ({"max_size": 8}, r"--max-size \(max_size=8\) must be an int >= 16"),
    ({"max_size": 0}, r"--max-size \(max_size=0\) must be an int >= 16"),
    ({"max_size": 256.0}, r"--max-size \(max_size=256.0\) must be an int"),
    ({"max_size": True}, r"--max-size \(max_size=True\) must be an int"),
    ({"max_size": "256"}, r"--max-size \(max_size='256'\) must be an int"),
    ({"quality": 80}, r"--quality \(quality\) applies to images re-encoded by --max-size"),
    ({"max_size": 64, "quality": 0}, r"--quality \(quality=0\) must be an int in \[1, 100\]"),
    ({"max_size": 64, "quality": 101}, r"--quality \(quality=101\) must be an int in \[1, 100\]"),
])
def test_bad_options_are_refused(folder, tmp_path, kw, match):
    with pytest.raises(UsageError, match=match):
        convert("imagefolder", folder, tmp_path / "o", progress=False, **kw)
    assert not (tmp_path / "o").exists()


def test_arrays_take_no_max_size(tmp_path):
    np.savez(tmp_path / "a.npz", x=np.arange(4))
    with pytest.raises(ConvertError, match="--max-size does not apply to arrays sources"):
        convert("arrays", tmp_path / "a.npz", tmp_path / "o", progress=False, max_size=64)


def test_cli(folder, tmp_path):
    p = run_cli("convert", "imagefolder", folder, tmp_path / "ds", "--max-size", N, "--quality", 80, "-q", check=0)
    assert f"5 image(s) with a longer side above {N} pixels were stored re-encoded" in p.stdout
    md = fastload.Dataset(tmp_path / "ds").manifest["metadata"]
    assert (md["max_size"], md["quality"], md["resized_images"]) == (N, 80, 5)
    src = sources()
    for name, (data, size) in stored(tmp_path / "ds").items():
        check_resized(data, size, src[name])
    p = run_cli("convert", "imagefolder", folder, tmp_path / "bad", "--max-size", 8, check=1)
    assert p.stderr.startswith("fastload convert: error: --max-size (max_size=8) must be an int >= 16")
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "bad").exists()
    p = run_cli("convert", "imagefolder", folder, tmp_path / "bad", "--quality", 80, check=1)
    assert "--quality (quality) applies to images re-encoded by --max-size" in p.stderr
    assert "--max-size N" in run_cli("convert", "--help", check=0).stdout


def test_table_paths_and_bytes_and_webdataset(tmp_path):
    src = sources()
    names = sorted(src)
    for n in names:
        (tmp_path / n).write_bytes(src[n][0])
    pq.write_table(pa.table({"path": names, "img": pa.array([src[n][0] for n in names], pa.binary()),
                             "label": np.arange(len(names)) % 2}), tmp_path / "t.parquet")
    r = convert("table", tmp_path / "t.parquet", tmp_path / "t", progress=False, max_size=N)
    assert r["resized_images"] == 10  # two image fields
    ds = fastload.Dataset(tmp_path / "t")
    assert ds.fields["path"].kind == ds.fields["img"].kind == "image"
    for field in ("path", "img"):
        got = stored(tmp_path / "t", field)
        for n in names:
            check_resized(*got[n], src[n])
    jpgs = [n for n in names if n.endswith(".jpg")]
    tar = tmp_path / "shard-000.tar"
    with tarfile.open(tar, "w") as tf:
        for i, n in enumerate(jpgs):
            for ext, payload in (("jpg", src[n][0]), ("cls", str(i % 2).encode())):
                info = tarfile.TarInfo(f"s{i:04d}.{ext}")
                info.size = len(payload)
                tf.addfile(info, io.BytesIO(payload))
    r = convert("webdataset", tar, tmp_path / "w", progress=False, workers=2, max_size=N)
    assert r["num_samples"] == len(jpgs) and r["resized_images"] == 3
    got = stored(tmp_path / "w", "jpg")
    for i, n in enumerate(jpgs):
        check_resized(*got[f"shard-000.tar:s{i:04d}"], src[n])  # (keys hold no "/")
    assert fastload.Dataset(tmp_path / "w").manifest["metadata"]["max_size"] == N


# -- distributed ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def many(tmp_path_factory) -> Path:
    """60 photo crops, longer sides 64-300 px: about half above N."""
    from fastload.demo.photos import make_image_folder

    return make_image_folder(tmp_path_factory.mktemp("many") / "images", 60, seed=5, min_side=64, max_side=300)


def same_datasets(a: Path, b: Path) -> None:
    ma, mb = (json.loads((p / "manifest.json").read_text()) for p in (a, b))
    for m in (ma, mb):
        m.pop("shards"), m.pop("total_bytes"), m.pop("manifest_checksum", None)  # (it covers the shard cut)
    assert ma == mb
    da, db = fastload.Dataset(a), fastload.Dataset(b)
    idx = np.arange(len(da))
    assert len(da) == len(db) and da.keys(idx) == db.keys(idx)
    assert da.get_batch(idx)["image"] == db.get_batch(idx)["image"]
    assert all(np.array_equal(x, y) for x, y in zip(da.image_sizes("image", idx), db.image_sizes("image", idx)))


def test_distributed_tasks_resize_like_local(many, tmp_path):
    from fastload.convert.commit import commit
    from fastload.convert.plan import make_plan
    from fastload.convert.task import run_group

    r = convert("imagefolder", many, tmp_path / "ref", progress=False, workers=0, max_size=N, quality=85)
    assert 10 < r["resized_images"] < 50
    dst = tmp_path / "ds"
    plan = make_plan("imagefolder", many, dst, shard_size=40_000, overwrite=False, resume=False, max_size=N,
                     quality=85)
    assert plan.num_groups >= 3 and plan.metadata["max_size"] == N
    with pytest.raises(ConvertError, match="max_size=128, this one max_size=256"):
        make_plan("imagefolder", many, dst, shard_size=40_000, overwrite=False, resume=True, max_size=256,
                  quality=85)
    for g in range(plan.num_groups):
        assert run_group(dst, g)["error"] is None
    c = commit(plan)
    assert c["resized_images"] == r["resized_images"] and c["max_size"] == N
    same_datasets(tmp_path / "ref", dst)


@pytest.mark.slow
def test_torchrun_resizes_like_local(many, tmp_path):
    convert("imagefolder", many, tmp_path / "ref", progress=False, workers=0, max_size=N)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    # torchrun's agent and ranks forked from the tests' launcher (tests/_zygote.py)
    cmd = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--no-python",
           python_shim(), "-m", "fastload", "convert", "imagefolder", str(many), str(tmp_path / "ds"),
           "--engine=torch", "--shard-size=40KB", "--force-small-shards", "-q", f"--max-size={N}"]
    p = run_python(*cmd, timeout=600, env=env, cwd=ROOT, fork_python=True)
    assert p.returncode == 0, p.stderr
    assert "image(s) with a longer side above 128 pixels were stored re-encoded" in p.stdout
    same_datasets(tmp_path / "ref", tmp_path / "ds")

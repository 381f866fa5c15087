"""The CLI with URLs: convert to s3://, inspect, verify (download or --local), prefetch."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

import fastload
from _remote import BUCKET, make_dataset
from fastload.cli import main


@pytest.fixture
def endpoint_env(moto, s3_env, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{moto.endpoint}")
    return moto


def _arrays(tmp_path, n=500):
    src = tmp_path / "src.npz"
    rng = np.random.default_rng(0)
    np.savez(src, x=rng.standard_normal((n, 16)).astype(np.float32), label=rng.integers(0, 3, n))
    return src


def test_convert_to_s3_then_inspect_verify_prefetch(endpoint_env, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FASTLOAD_CACHE", str(tmp_path / "cache"))
    src = _arrays(tmp_path)
    url = f"s3://{BUCKET}/conv"
    assert main(["convert", "arrays", str(src), url, "--shard-size", "8kB", "--force-small-shards", "-q"]) == 0
    assert f"to {url}" in capsys.readouterr().out
    names = endpoint_env.filesystem().get_file_info(__import__("pyarrow.fs").fs.FileSelector(f"{BUCKET}/conv"))
    assert "manifest.json" in {i.base_name for i in names}
    assert not list((tmp_path / "cache").glob("convert-staging-*"))  # staging removed
    # the same again is refused, --overwrite replaces it
    assert main(["convert", "arrays", str(src), url, "-q"]) == 1
    assert "already holds a fastload dataset" in capsys.readouterr().err
    assert main(["convert", "arrays", str(src), url, "--shard-size", "16kB", "--force-small-shards", "-q", "--overwrite"]) == 0
    capsys.readouterr()

    assert main(["inspect", url]) == 0
    text = capsys.readouterr().out
    assert f"dataset   {url}" in text and "samples   500" in text
    assert main(["inspect", "--json", url]) == 0
    m = json.loads(capsys.readouterr().out)
    assert m["num_samples"] == 500
    names = {i.base_name for i in endpoint_env.filesystem().get_file_info(
        __import__("pyarrow.fs").fs.FileSelector(f"{BUCKET}/conv"))}
    assert names == {s["file"] for s in m["shards"]} | {"manifest.json"}  # old shards of the first upload gone

    assert main(["verify", url]) == 0
    assert "OK" in capsys.readouterr().out
    assert main(["prefetch", url, str(tmp_path / "copy"), "-q"]) == 0
    assert "checksums and Arrow validation passed" in capsys.readouterr().out
    assert fastload.verify(tmp_path / "copy") == []
    assert main(["verify", url, "--local", str(tmp_path / "copy")]) == 0
    capsys.readouterr()
    # damage: a wrong shard upstream, a damaged local copy
    fs = endpoint_env.filesystem()
    first = m["shards"][0]["file"]
    with fs.open_output_stream(f"{BUCKET}/conv/{first}") as f:
        f.write(b"\0" * m["shards"][0]["bytes"])
    assert main(["verify", url]) == 1
    out = capsys.readouterr().out
    assert f"DAMAGED {first}: checksum mismatch" in out
    (tmp_path / "copy" / m["shards"][1]["file"]).unlink()
    assert main(["verify", url, "--local", str(tmp_path / "copy")]) == 1
    assert f"{m['shards'][1]['file']}: not in" in capsys.readouterr().out
    assert main(["prefetch", url, str(tmp_path / "copy")]) == 1  # a dataset is there already
    assert "already holds a dataset" in capsys.readouterr().err


def test_prefetch_resumes_and_refuses_foreign_dirs(endpoint_env, local_ds, tmp_path, capsys):
    from _servers import upload_dir

    upload_dir(endpoint_env.filesystem(), local_ds, f"{BUCKET}/pf")
    url = f"s3://{BUCKET}/pf"
    dest = tmp_path / "copy"
    dest.mkdir()
    (dest / "notes.txt").write_text("mine")
    assert main(["prefetch", url, str(dest), "-q"]) == 1
    assert "is not empty" in capsys.readouterr().err
    (dest / "notes.txt").unlink()
    # an interrupted prefetch: two shards already there, one partial
    for n in ("shard-00000.arrow", "shard-00001.arrow"):
        (dest / n).write_bytes((local_ds / n).read_bytes())
    (dest / ".shard-00002.arrow.part").write_bytes((local_ds / "shard-00002.arrow").read_bytes()[:1000])
    assert main(["prefetch", url, str(dest), "-q"]) == 0
    assert fastload.verify(dest) == []
    with fastload.Dataset(dest) as a, fastload.Dataset(local_ds) as b:
        assert np.array_equal(a.get_batch(np.arange(len(a)))["x"], b.get_batch(np.arange(len(b)))["x"])


def test_cli_with_a_url_does_not_load_torch(endpoint_env, local_ds, tmp_path):
    from _servers import upload_dir

    upload_dir(endpoint_env.filesystem(), local_ds, f"{BUCKET}/lt")
    code = ("import sys; from fastload.cli import main; rc = main(['inspect', 's3://fastload-test/lt']); "
            "assert 'torch' not in sys.modules, 'torch loaded'; sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "FASTLOAD_CACHE": str(tmp_path / "c")})
    assert r.returncode == 0, r.stderr


def _read_all(url, tmp_path, name):
    with fastload.Dataset(url, cache_dir=tmp_path / name) as ds:
        return ds.get_batch(np.arange(len(ds)))


@pytest.mark.parametrize("fail", [True, False])
def test_overwrite_keeps_the_old_dataset_until_the_new_manifest(moto, s3_env, tmp_path, fail):
    """An upload over a dataset writes new shard names, the manifest last, then deletes the
    old shards: interrupted at any shard, the old dataset still opens, whole and equal."""
    from fastload.convert.publish import upload_dataset
    from _servers import FaultProxy

    from fastload.store.report import write_report

    old, new = make_dataset(tmp_path / "old", rows=1000), make_dataset(tmp_path / "new", rows=1500)
    write_report(old / "skipped.jsonl", [{"index": 3, "key": "a.jpg", "reason": "test"}])  # the new one has none
    with FaultProxy(moto.endpoint) as px:
        prefix = f"ow{int(fail)}"  # moto keeps its objects for the whole process
        url = f"s3://{BUCKET}/{prefix}?endpoint_override={px.endpoint}&scheme=http"
        opts = {"max_attempts": 1}
        upload_dataset(old, url, storage_options=opts)
        want = _read_all(url, tmp_path, "c0")
        if fail:  # the third new shard cannot be written
            px.add("status", rf"/{prefix}/shard-00002-[0-9a-f]{{8}}\.arrow", method="PUT", status=400, times=-1)
            with pytest.raises(OSError):
                upload_dataset(new, url, overwrite=True, storage_options=opts, threads=1)
            got = _read_all(url, tmp_path, "c1")
            assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
            assert not px.requests("DELETE"), "nothing of the old dataset was deleted"
            px.clear()
        upload_dataset(new, url, overwrite=True, storage_options=opts)
        got = _read_all(url, tmp_path, "c2")
        assert len(got["y"]) == 1500 and np.array_equal(got["y"], np.arange(1500))
        names = {i.base_name for i in moto.filesystem().get_file_info(
            __import__("pyarrow.fs").fs.FileSelector(f"{BUCKET}/{prefix}"))}
        m = json.loads(moto.filesystem().open_input_stream(f"{BUCKET}/{prefix}/manifest.json").read())
        assert names == {s["file"] for s in m["shards"]} | {"manifest.json"}
        assert all(re.fullmatch(r"shard-\d{5}-[0-9a-f]{8}\.arrow", s["file"]) for s in m["shards"])

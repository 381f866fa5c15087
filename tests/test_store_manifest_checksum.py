"""The manifest protects itself: ``manifest_checksum`` (a hash of its content) is written by
every writer of ``manifest.json`` and checked on open (Dataset, Loader, remote datasets) and
by ``fastload verify``; a manifest without it (an older writer's) still opens."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import fastload
from fastload import manifest_checksum
from fastload.errors import FormatError
from fastload.store import DatasetReader

from _remote import BUCKET, s3_url

KEY = "manifest_checksum"
V1 = Path(__file__).resolve().parent / "data" / "v1"  # written before the key existed


def _write(d: Path, n: int = 12) -> Path:
    with fastload.ShardWriter(d, {"x": "float32[2]", "y": "int64"}, label="y", class_names=["cat", "dog", "eel"],
                              shard_size=100, metadata={"source": "test"}) as w:
        w.write_batch({"x": np.arange(2 * n, dtype=np.float32).reshape(n, 2), "y": np.arange(n) % 3})
    return d


def _sealed_ok(raw: bytes) -> dict:
    """The manifest in ``raw`` carries a checksum that matches its content."""
    m = json.loads(raw)
    assert isinstance(m.get(KEY), str) and m[KEY].startswith("xxh3_128:")
    manifest_checksum.check(m, "test")
    return m


def test_a_class_name_changed_by_one_flipped_byte_is_refused_on_open_and_by_verify(tmp_path, capsys):
    d = _write(tmp_path / "ds")
    mpath = d / "manifest.json"
    raw = mpath.read_bytes()
    i = raw.index(b'"dog"') + 2
    mpath.write_bytes(raw[:i] + bytes([raw[i] ^ 0x01]) + raw[i + 1:])  # "dog" -> "dng": valid JSON, valid schema
    assert json.loads(mpath.read_bytes())["label"]["class_names"] == ["cat", "dng", "eel"]
    for open_ in (DatasetReader, fastload.Dataset, lambda p: fastload.Loader(p, batch_size=4, device="cpu")):
        with pytest.raises(FormatError, match=r"manifest\.json: the manifest's content does not match its "
                                              r"manifest_checksum.*Restore manifest\.json"):
            open_(d)
    problems = fastload.verify(d)
    assert len(problems) == 1 and str(mpath) in problems[0] and "convert the source again" in problems[0]
    from fastload.cli import main
    capsys.readouterr()
    assert main(["verify", str(d)]) == 1
    out = capsys.readouterr().out
    assert f"DAMAGED {mpath}: the manifest's content does not match" in out
    mpath.write_bytes(raw)
    assert fastload.verify(d) == [] and main(["verify", str(d)]) == 0


def test_every_single_byte_flip_is_refused_or_changes_nothing(tmp_path):
    """The class of the bug: any one flipped byte anywhere in the manifest either fails to
    open (FormatError) or leaves the parsed content exactly as written (whitespace)."""
    d = _write(tmp_path / "ds")
    mpath = d / "manifest.json"
    raw = mpath.read_bytes()
    want = json.loads(raw)
    opened_changed = []
    for i in range(len(raw)):
        for bit in (0x01, 0x20):
            flipped = raw[:i] + bytes([raw[i] ^ bit]) + raw[i + 1:]
            mpath.write_bytes(flipped)
            try:
                DatasetReader(d)
            except FormatError:
                continue
            if json.loads(flipped) != want:
                opened_changed.append((i, bit, flipped[max(0, i - 20):i + 20]))
    mpath.write_bytes(raw)
    assert opened_changed == []


def test_a_damaged_checksum_key_is_refused(tmp_path):
    d = _write(tmp_path / "ds")
    mpath = d / "manifest.json"
    raw = mpath.read_text()
    for bad, message in ((raw.replace('"manifest_checksum"', '"manifest_checksuM"'), "holds the key 'manifest_checksuM'"),
                         (raw.replace('"xxh3_128:', '"xxh3_129:'), "must be 'xxh3_128:' and 32 hex digits")):
        mpath.write_text(bad)
        with pytest.raises(FormatError, match=message):
            DatasetReader(d)


def test_a_manifest_without_the_key_still_opens(tmp_path):
    """Backward compatible: datasets written before the key (the v1 fixture) and a manifest
    whose key was removed open and verify; the checksum changes no fingerprint."""
    assert KEY not in json.loads((V1 / "manifest.json").read_text())
    assert len(DatasetReader(V1)) > 0 and fastload.verify(V1, remember=False) == []
    from fastload.loader.loader import dataset_fingerprint
    from fastload.remote.manifest import manifest_fingerprint

    d = _write(tmp_path / "ds")
    fps = dataset_fingerprint(DatasetReader(d)), manifest_fingerprint(DatasetReader(d).manifest)
    m = json.loads((d / "manifest.json").read_text())
    del m[KEY]
    (d / "manifest.json").write_text(json.dumps(m))
    assert DatasetReader(d).manifest == m and fastload.verify(d) == []
    assert (dataset_fingerprint(DatasetReader(d)), manifest_fingerprint(m)) == fps


def test_local_writers_seal_the_manifest(tmp_path):
    """ShardWriter (new and overwrite) and the distributed commit (parts merged: the parts'
    checksums do not carry over) write a sealed manifest; ShardWriter.close returns it."""
    from test_convert_scale import _npz, inline

    d = tmp_path / "ds"
    with fastload.ShardWriter(d, {"x": "int64"}) as w:
        w.write({"x": 1})
    _sealed_ok((d / "manifest.json").read_bytes())
    w = fastload.ShardWriter(d, {"x": "int64"}, overwrite=True)
    w.write({"x": 2})
    assert w.close() == _sealed_ok((d / "manifest.json").read_bytes())
    r = inline("arrays", _npz(tmp_path), tmp_path / "dist", shard_size=3000)
    assert r["num_shards"] > 1
    m = _sealed_ok((tmp_path / "dist" / "manifest.json").read_bytes())
    assert m["num_samples"] == 1000 and fastload.verify(tmp_path / "dist") == []


def test_object_store_writers_seal_and_remote_readers_check(moto, s3_env, tmp_path, monkeypatch):  # noqa: F811
    """upload_dataset (its shards renamed: sealed afresh), the distributed commit into an
    object store, prefetch; a remote manifest whose content was changed is refused by
    RemoteDataset, Dataset(url), prefetch and verify."""
    from fastload.remote import RemoteDataset
    from fastload.convert.publish import prefetch, upload_dataset, verify_remote
    from test_convert_scale import _npz, inline

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{moto.endpoint}")
    monkeypatch.setenv("FASTLOAD_CACHE", str(tmp_path / "cache"))
    fs = moto.filesystem()
    local = _write(tmp_path / "local")
    url = s3_url(moto.endpoint, "up")
    upload_dataset(local, url)
    upload_dataset(local, url, overwrite=True)  # new shard names: the copied checksum would be stale
    m = _sealed_ok(fs.open_input_stream(f"{BUCKET}/up/manifest.json").read())
    assert all(s["file"].count("-") == 2 for s in m["shards"])
    prefetch(url, tmp_path / "copy")
    _sealed_ok((tmp_path / "copy" / "manifest.json").read_bytes())
    assert fastload.verify(tmp_path / "copy") == []
    inline("arrays", _npz(tmp_path), f"s3://{BUCKET}/dist", shard_size=3000)
    _sealed_ok(fs.open_input_stream(f"{BUCKET}/dist/manifest.json").read())

    raw = fs.open_input_stream(f"{BUCKET}/up/manifest.json").read()
    with fs.open_output_stream(f"{BUCKET}/up/manifest.json") as f:
        f.write(raw.replace(b'"eel"', b'"eek"'))
    for open_ in (lambda: RemoteDataset(url), lambda: fastload.Dataset(url, cache_dir=tmp_path / "c2"),
                  lambda: prefetch(url, tmp_path / "copy2"), lambda: verify_remote(url)):
        with pytest.raises(FormatError, match=r"up/manifest\.json: the manifest's content does not match"):
            open_()
    assert not (tmp_path / "copy2" / "manifest.json").exists()

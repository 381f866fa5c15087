"""Conversion into an object store: ``s3://`` on moto (a real S3 server in this process, on
127.0.0.1), with every engine. The local engine converts in a staging directory and uploads;
the distributed engines' tasks upload their own shards and the driver writes the manifest
last (fastload/convert/objstore.py). The output must equal a local ``convert`` sample for
sample, and read back with ``fastload.Dataset(url)``.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow.fs as pafs
import pytest

import fastload
from _remote import BUCKET
from fastload.convert import ConvertError, convert
from fastload.convert.commit import commit
from fastload.convert.plan import load_plan, make_plan
from fastload.convert.task import run_group
from fastload.convert.publish import prefetch
from test_convert_scale import (PARTS, SHARD, _npz, assert_same, corrupt_copy, dali_threads, have_ray,  # noqa: F401
                                heavy_modules, inline, run_engine)


@pytest.fixture
def s3(moto, s3_env, monkeypatch, tmp_path):
    """moto on 127.0.0.1, reached through the environment (as every process of an engine
    finds it: the driver, Ray workers, torchrun ranks and their task processes)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{moto.endpoint}")
    monkeypatch.setenv("FASTLOAD_CACHE", str(tmp_path / "cache"))  # staging and task scratch space
    return moto


def objects(srv, prefix: str) -> dict[str, int]:
    """{key relative to the prefix: size} of every object under BUCKET/prefix."""
    fs = srv.filesystem()
    base = f"{BUCKET}/{prefix}/"
    infos = fs.get_file_info(pafs.FileSelector(base.rstrip("/"), recursive=True, allow_not_found=True))
    return {i.path[len(base):]: i.size for i in infos if i.type == pafs.FileType.File}


def fetch(url: str, dest) -> object:
    """A local, verified copy of the dataset at ``url`` (every checksum checked on the way)."""
    prefetch(url, dest)
    return dest


def check_read_back(url: str, reference) -> None:
    """fastload.Dataset(url) delivers the reference's samples."""
    ds, ref = fastload.Dataset(url), fastload.Dataset(reference)
    assert len(ds) == len(ref)
    idx = np.arange(len(ref))
    assert list(ds.keys(idx)) == list(ref.keys(idx))
    for i in (0, len(ref) // 2, len(ref) - 1):
        a, b = ds[int(i)], ref[int(i)]
        assert a["label"] == b["label"] and bytes(a["image"]) == bytes(b["image"])


def test_the_api_writes_an_s3_destination_to_the_bucket_not_to_a_local_directory(s3, images, reference, tmp_path,
                                                                                   monkeypatch):
    monkeypatch.chdir(tmp_path)
    url = f"s3://{BUCKET}/api"
    r = convert("imagefolder", images, url, workers=0, progress=False)
    assert r["dst"] == url and r["num_samples"] == 300
    assert not (tmp_path / "s3:").exists()  # (it used to become the local directory ./s3:/bucket/api)
    assert "manifest.json" in objects(s3, "api")
    assert_same(reference, fetch(url, tmp_path / "copy"))
    check_read_back(url, reference)


def test_an_http_destination_is_refused_before_any_work(images, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for engine in ("local", "ray", "torch"):
        with pytest.raises(ConvertError, match=r"not over http\(s\)"):
            convert("imagefolder", images, "http://127.0.0.1:9/ds", engine=engine, progress=False)
    assert not list(tmp_path.iterdir())


def test_the_core_into_an_object_store_resumes_and_commits_the_manifest_last(s3, images, reference, tmp_path):
    url = f"s3://{BUCKET}/core"
    src, key = corrupt_copy(images, tmp_path, 150)  # a middle group fails
    with pytest.raises(ConvertError, match=key):
        inline("imagefolder", src, url)
    plan = load_plan(url)
    bad = 150 // plan.group_size
    names = objects(s3, "core")
    assert "manifest.json" not in names and f"{PARTS}/plan.json" in names and f"{PARTS}/files.parquet" in names
    done = sorted(n for n in names if n.startswith(f"{PARTS}/g-"))
    assert done == [f"{PARTS}/g-{g:08d}.json" for g in range(bad)]  # the groups before the bad one
    shards = {n for n in names if n.startswith("shard-")}
    assert shards and all(n.endswith(f"-{plan.token}.arrow") for n in shards)  # under their final names
    # no rerun without --resume or --overwrite; a resume reuses the finished groups
    with pytest.raises(FileExistsError, match="unfinished conversion"):
        make_plan("imagefolder", src, url, shard_size=200_000, overwrite=False, resume=False)
    shutil.copy(images / key, src / key)  # the user fixes the file
    again = make_plan("imagefolder", src, url, shard_size=200_000, overwrite=False, resume=True)
    assert again == plan
    results = [run_group(url, g) for g in range(plan.num_groups)]
    assert [r["reused"] for r in results] == [g < bad for g in range(plan.num_groups)]
    assert all(r["error"] is None for r in results)
    r = commit(plan)
    assert r["num_samples"] == 300 and r["dst"] == url
    names = objects(s3, "core")
    assert not [n for n in names if n.startswith(PARTS)]  # the parts are gone
    m = json.loads(s3.filesystem().open_input_stream(f"{BUCKET}/core/manifest.json").read())
    assert set(names) == {s["file"] for s in m["shards"]} | {"manifest.json"}
    assert_same(reference, fetch(url, tmp_path / "copy"))
    check_read_back(url, reference)


def test_overwrite_in_an_object_store_keeps_the_old_dataset_until_the_new_manifest(s3, images, reference, tmp_path):
    url = f"s3://{BUCKET}/ow"
    convert("arrays", _npz(tmp_path), url, progress=False)  # a dataset to replace
    fs = s3.filesystem()
    with fs.open_output_stream(f"{BUCKET}/ow/README.txt") as f:  # not fastload's: never deleted
        f.write(b"notes")
    old = objects(s3, "ow")
    old_manifest = fastload.Dataset(url).manifest
    with pytest.raises(FileExistsError, match="already holds a fastload dataset"):
        make_plan("imagefolder", images, url, shard_size=200_000, overwrite=False, resume=False)
    plan = make_plan("imagefolder", images, url, shard_size=200_000, overwrite=True, resume=False)
    for g in range(plan.num_groups):
        assert run_group(url, g)["error"] is None
    # every group is uploaded, nothing committed: the old dataset opens, unchanged and whole
    assert fastload.Dataset(url).manifest == old_manifest
    assert all(objects(s3, "ow").get(n) == size for n, size in old.items())
    commit(plan)
    names = objects(s3, "ow")
    assert not {n for n in old if n.startswith("shard-")} & set(names)  # the old shards are deleted
    assert "README.txt" in names and not [n for n in names if n.startswith(PARTS)]
    assert_same(reference, fetch(url, tmp_path / "copy"))


@have_ray
@pytest.mark.slow
def test_ray_into_s3_equals_local_and_retries_a_task_killed_between_upload_and_record(s3, images, reference,
                                                                                         tmp_path, ray_cluster):
    url = f"s3://{BUCKET}/ray"
    code, r, err = run_engine("ray", images, url, tmp_path, fault_group=2, fault_when="put", workers=2, cli=True,
                              cluster=ray_cluster)
    assert code == 0, err
    assert (tmp_path / "faults" / "died-2").exists()  # its shards were uploaded, its record was not ...
    assert r["num_samples"] == 300 and r["tasks_run"] == r["num_groups"]  # ... and the retry redid it
    names = objects(s3, "ray")
    assert "manifest.json" in names and not [n for n in names if n.startswith(PARTS)]
    assert_same(reference, fetch(url, tmp_path / "copy"))
    check_read_back(url, reference)
    assert heavy_modules(tmp_path) == {} and set(dali_threads(tmp_path)) == {1}


@pytest.mark.slow
def test_torchrun_into_s3_replaces_a_dataset_and_equals_local(s3, images, reference, tmp_path):
    url = f"s3://{BUCKET}/torch"
    convert("arrays", _npz(tmp_path), url, progress=False)  # a dataset to replace
    old = {n for n in objects(s3, "torch") if n.startswith("shard-")}
    code, r, err = run_engine("torch", images, url, tmp_path, fault_group=1, fault_when="write", overwrite=True)
    assert code == 0, err
    assert (tmp_path / "faults" / "died-1").exists()
    assert r["world_size"] == 2 and r["num_samples"] == 300 and r["dst"] == url
    names = objects(s3, "torch")
    assert not old & set(names) and not [n for n in names if n.startswith(PARTS)]
    assert_same(reference, fetch(url, tmp_path / "copy"))
    check_read_back(url, reference)

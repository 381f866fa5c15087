"""``convert coco`` into an object store (moto's S3 on 127.0.0.1) with the local engine and
with the distributed core (the plan's listing read from the parts prefix), and on Ray (slow):
each the same dataset as a local conversion."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from _convert import assert_same_rows
from _remote import BUCKET, _aws_sdk_event_loop, moto, s3_env  # noqa: F401
from test_convert_coco import make_coco
from test_convert_s3 import fetch, objects, s3  # noqa: F401
from test_convert_scale import RUN_CONVERT, env_for, have_ray

from fastload.convert import convert
from fastload.convert.commit import commit
from fastload.convert.plan import make_plan
from fastload.convert.task import run_group


@pytest.fixture
def coco(tmp_path):
    make_coco(tmp_path / "c", n=12, seed=4)
    src = {"js": tmp_path / "c" / "instances.json", "images": tmp_path / "c" / "images"}
    convert("coco", src["js"], tmp_path / "local", images=src["images"], masks=True, progress=False, workers=0)
    return src, tmp_path / "local"


def test_coco_into_s3_with_the_local_engine_and_the_distributed_core(s3, coco, tmp_path):  # noqa: F811
    src, local = coco
    url = f"s3://{BUCKET}/coco"
    r = convert("coco", src["js"], url, images=src["images"], masks=True, progress=False, workers=0)
    assert r["dst"] == url and r["num_samples"] == 12
    assert_same_rows(local, fetch(url, tmp_path / "copy"))

    url = f"s3://{BUCKET}/coco-core"
    plan = make_plan("coco", src["js"], url, shard_size=15_000, overwrite=False, resume=False,
                     source_options={"images": str(src["images"]), "masks": True})
    assert plan.num_groups >= 2 and ".fastload-parts/coco.parquet" in objects(s3, "coco-core")
    for g in range(plan.num_groups):
        assert run_group(url, g)["error"] is None
    commit(plan)
    assert not [n for n in objects(s3, "coco-core") if n.startswith(".fastload-parts")]
    assert_same_rows(local, fetch(url, tmp_path / "copy2"))


@pytest.mark.slow
@have_ray
def test_the_ray_engine_produces_the_same_dataset(coco, tmp_path, ray_cluster):
    src, local = coco
    args = {"kind": "coco", "src": str(src["js"]), "dst": str(tmp_path / "ray"), "images": str(src["images"]),
            "masks": True, "engine": "ray", "workers": 2, "shard_size": "15KB", "allow_small_shards": True,
            "progress": False, "ray_address": ray_cluster.address}  # the session's Ray (tests/_ray.py)
    env = env_for(tmp_path)
    p = subprocess.run([sys.executable, "-c", RUN_CONVERT, json.dumps(args)], capture_output=True, text=True, timeout=600,
                       env={**env, **ray_cluster.env(env)}, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["num_groups"] >= 2 and r["num_samples"] == 12
    assert_same_rows(local, tmp_path / "ray")

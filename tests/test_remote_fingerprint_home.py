"""One dataset fingerprint (issue 31): remote/manifest.py's, which the Loader imports."""
from __future__ import annotations

import numpy as np

import fastload


def test_the_loader_s_fingerprint_is_the_manifest_s(tmp_path):
    from fastload.loader.loader import dataset_fingerprint as loader_fp
    from fastload.remote.manifest import dataset_fingerprint, manifest_fingerprint

    assert loader_fp is dataset_fingerprint and fastload.loader.dataset_fingerprint is dataset_fingerprint
    with fastload.ShardWriter(tmp_path / "ds", {"x": "int64"}, shard_size=64) as w:
        for i in range(20):
            w.write({"x": np.int64(i)})
    ds = fastload.Dataset(tmp_path / "ds")
    fp = dataset_fingerprint(ds)
    assert fp == manifest_fingerprint(ds.manifest) and len(fp) == 16 and int(fp, 16) >= 0
    with fastload.Loader(ds, batch_size=4, device="cpu") as lo:
        assert lo.state_dict()["dataset"]["fingerprint"] == fp

"""A dataset of many shards made in seconds, for the scale benchmark and its tests: hard links
to one written shard, each listed under its own name in the manifest (a file takes at most
~65,000 links, so a fresh copy of the shard starts every 50,000)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..store.manifest import manifest_bytes

__all__ = ["link_shards"]


def link_shards(one: Path, path: Path, shards: int) -> Path:
    """``path`` (created): a dataset of ``shards`` hard links to the one shard of the dataset
    at ``one``; returns ``path``."""
    m = json.loads((one / "manifest.json").read_text())
    entry = m["shards"][0]
    path.mkdir()
    for i in range(shards):
        if i % 50_000 == 0:  # a file takes at most ~65,000 links
            src = path / f"source-{i}.arrow"
            shutil.copyfile(one / entry["file"], src)
        os.link(src, path / f"shard-{i:06d}.arrow")
    m["shards"] = [{**entry, "file": f"shard-{i:06d}.arrow"} for i in range(shards)]
    m["num_samples"] = entry["num_samples"] * shards
    m["total_bytes"] = entry["bytes"] * shards
    m.pop("manifest_checksum", None)
    (path / "manifest.json").write_bytes(manifest_bytes(m))
    return path

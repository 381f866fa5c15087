"""Helpers shared by the conversion tests: a dataset's content without its shard cut."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa


def load(path: Path) -> tuple[dict, pa.Table]:
    """(manifest without the shard cut, every row of every shard in order)."""
    m = json.loads((path / "manifest.json").read_text())
    t = pa.concat_tables([pa.ipc.open_file(pa.memory_map(str(path / s["file"]))).read_all() for s in m["shards"]])
    for k in ("shards", "total_bytes", "manifest_checksum"):  # (the checksum covers the shard cut)
        m.pop(k, None)
    return m, t


def assert_same_rows(a: Path, b: Path) -> None:
    """Same manifest (fields, counts, labels, class names, metadata) and the same rows:
    every field, key, label and recorded image size, in the same order."""
    ma, ta = load(a)
    mb, tb = load(b)
    assert ma == mb
    assert ta.schema == tb.schema and ta.num_rows == tb.num_rows
    for name in ta.column_names:
        assert ta.column(name).equals(tb.column(name)), name

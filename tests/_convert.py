"""Helpers shared by the conversion tests: a dataset's content without its shard cut; the
fixtures ``images`` (an image folder of 300 photos in classes) and ``reference`` (it,
converted by the local engine), made once per session: the tests only read them (a test
that changes the folder changes a copy, ``test_convert_scale.corrupt_copy``). A pytest
plugin of tests/conftest.py."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest


@pytest.fixture(scope="session")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fastload.demo.photos import make_image_folder

    root = tmp_path_factory.mktemp("scale") / "images"
    make_image_folder(root, 300, seed=3, min_side=64, max_side=160)
    return root


@pytest.fixture(scope="session")
def reference(images: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fastload.convert import convert

    out = tmp_path_factory.mktemp("ref") / "ds"
    convert("imagefolder", images, out, workers=0, progress=False)
    return out


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

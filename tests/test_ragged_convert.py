"""Ragged fields from every source kind: arrays (.npz pairs, in-memory object arrays),
table (Parquet list columns), webdataset (.npy members of varying length) and the CLI."""
import io
import subprocess
import sys
import tarfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import fastload
from fastload.convert import convert
from fastload.errors import ConvertError

RNG = np.random.default_rng(0)
LENS = RNG.integers(0, 12, 40)
LENS[[0, 7]] = 0
TOKENS = [RNG.integers(0, 50_000, k).astype(np.int32) for k in LENS]
BOXES = [RNG.standard_normal((k % 4, 4)).astype(np.float32) for k in LENS]


def _check(path, tokens="tokens", boxes="boxes"):
    ds = fastload.Dataset(path)
    got = ds.get_batch(np.arange(len(ds)))
    assert ds.fields[tokens].kind == "ragged" and str(ds.fields[tokens]) == "int32[]"
    assert all(a.tobytes() == b.tobytes() and a.dtype == b.dtype for a, b in zip(got[tokens], TOKENS))
    if boxes:
        assert str(ds.fields[boxes]) == "float32[*,4]"
        assert all(a.shape == b.shape and a.tobytes() == b.tobytes() for a, b in zip(got[boxes], BOXES))
    return ds


def test_arrays_npz_pairs_offsets_and_lengths(tmp_path):
    np.savez(tmp_path / "a.npz", tokens=np.concatenate(TOKENS), tokens_offsets=np.concatenate([[0], np.cumsum(LENS)]),
             boxes=np.concatenate(BOXES), boxes_lengths=np.array([len(b) for b in BOXES]), label=np.arange(40) % 3)
    convert("arrays", tmp_path / "a.npz", tmp_path / "ds", progress=False)
    ds = _check(tmp_path / "ds")
    assert ds.label_field == "label" and sorted(ds.fields) == ["boxes", "label", "tokens"]


def test_arrays_from_python_with_object_arrays(tmp_path):
    obj = np.empty(40, dtype=object)
    obj[:] = TOKENS
    convert("arrays", {"tokens": obj, "boxes": np.array(BOXES, dtype=object), "y": np.arange(40)}, tmp_path / "ds",
            progress=False)
    _check(tmp_path / "ds")


def test_arrays_refuse_broken_pairs_and_pickled_object_arrays(tmp_path):
    np.savez(tmp_path / "bad.npz", tokens=np.arange(10, dtype=np.int32), tokens_offsets=np.array([0, 4, 12]))
    with pytest.raises(ConvertError, match="'tokens' and 'tokens_offsets' are not a ragged pair.*rise from 0"):
        convert("arrays", tmp_path / "bad.npz", tmp_path / "ds", progress=False)
    obj = np.empty(2, dtype=object)
    obj[:] = [np.arange(3), np.arange(5)]
    np.save(tmp_path / "obj.npy", obj, allow_pickle=True)
    with pytest.raises(ConvertError, match="never loads: store a ragged field as a pair NAME"):
        convert("arrays", tmp_path / "obj.npy", tmp_path / "ds2", progress=False)


def test_table_parquet_list_columns(tmp_path):
    t = pa.table({
        "tokens": pa.array([x.tolist() for x in TOKENS], pa.list_(pa.int32())),
        "boxes": pa.array([b.tolist() for b in BOXES], pa.list_(pa.list_(pa.float32(), 4))),
        "boxes_nested": pa.array([b.tolist() for b in BOXES], pa.large_list(pa.list_(pa.float32()))),
        "fixed": pa.array([[i, i] for i in range(40)], pa.list_(pa.int64())),
        "label": pa.array(np.arange(40) % 2),
    })
    pq.write_table(t, tmp_path / "t.parquet")
    convert("table", tmp_path / "t.parquet", tmp_path / "ds", progress=False)
    ds = _check(tmp_path / "ds")
    assert str(ds.fields["boxes_nested"]) == "float32[*,4]" and str(ds.fields["fixed"]) == "int64[2]"
    bad = pa.table({"x": pa.array([[[1.0, 2.0]], [[1.0]]], pa.list_(pa.list_(pa.float32())))})
    pq.write_table(bad, tmp_path / "bad.parquet")
    with pytest.raises(ConvertError, match="inner lists of different lengths"):
        convert("table", tmp_path / "bad.parquet", tmp_path / "ds2", progress=False)


def _npy(a):
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def test_webdataset_npy_members_of_varying_length(tmp_path):
    with tarfile.open(tmp_path / "s.tar", "w") as tf:
        for i in range(40):
            for ext, data in (("tokens.npy", _npy(TOKENS[i])), ("boxes.npy", _npy(BOXES[i])), ("cls", b"%d" % (i % 2))):
                info = tarfile.TarInfo(f"s{i:03d}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    convert("webdataset", tmp_path / "s.tar", tmp_path / "ds", progress=False)
    _check(tmp_path / "ds", "tokens_npy", "boxes_npy")


def test_cli_converts_and_inspect_shows_ragged_specs(tmp_path):
    np.savez(tmp_path / "a.npz", tokens=np.concatenate(TOKENS), tokens_offsets=np.concatenate([[0], np.cumsum(LENS)]))
    def run(*a):
        return subprocess.run([sys.executable, "-m", "fastload", *map(str, a)], capture_output=True, text=True)

    p = run("convert", "arrays", tmp_path / "a.npz", tmp_path / "ds")
    assert p.returncode == 0, p.stderr
    _check(tmp_path / "ds", boxes=None)
    p = run("inspect", tmp_path / "ds")
    assert p.returncode == 0 and "int32[]" in p.stdout and "fastload v2" in p.stdout, p.stdout + p.stderr

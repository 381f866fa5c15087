"""Ragged fields in the store: specs, round trips (bytes exact, every dtype, zero-length
samples), the Arrow layout other tools read, shard rolling, bad input, format versions."""
import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import fastload
from fastload.errors import FormatError, SampleError
from fastload.store import DatasetReader, ShardWriter, parse_field, read_manifest
from fastload.store.format import Field
from fastload.store.values import Ragged
from _dtypes import DTYPES, random_values


def _samples(rng, dtype, item, n, max_len=6):
    lens = rng.integers(0, max_len, n)
    lens[::5] = 0  # zero-length samples throughout
    return [random_values(rng, dtype, (int(k), *item)) for k in lens]


@pytest.mark.parametrize("spec, kind, shape", [
    ("int32[]", "ragged", ()), ("int32[*]", "ragged", ()), ("float32[*,4]", "ragged", (4,)),
    ("uint8[*, 2, 3]", "ragged", (2, 3)), ("float32[4]", "tensor", (4,)), ("int64", "scalar", ()),
])
def test_specs(spec, kind, shape):
    f = parse_field(spec)
    assert (f.kind, f.shape) == (kind, shape)
    assert parse_field(str(f)) == f
    assert Field.from_json(json.loads(json.dumps(f.to_json()))) == f


@pytest.mark.parametrize("spec, err", [("int32[4,*]", "only the first dimension"), ("int32[*,0]", "positive"),
                                       ("str[]", "cannot be stored"), ("int32[*,]", "empty dimension")])
def test_bad_ragged_specs(tmp_path, spec, err):
    with pytest.raises(ValueError, match=err):
        ShardWriter(tmp_path / "ds", {"f": spec})


@pytest.mark.parametrize("item", [(), (4,)])
def test_every_dtype_round_trips_bytes_exact(tmp_path, item):
    rng = np.random.default_rng(len(item))
    fields = {f"r_{d}": Field("ragged", d, item) for d in DTYPES}
    data = {n: _samples(rng, f.dtype, item, 23) for n, f in fields.items()}
    with ShardWriter(tmp_path / "ds", fields) as w:
        w.write_batch({n: v[:11] for n, v in data.items()})  # a list of arrays per field
        for i in range(11, 23):
            w.write({n: v[i] for n, v in data.items()})  # one sample at a time
    ds = DatasetReader(tmp_path / "ds")
    got = ds.get_batch(np.arange(23))
    for n, want in data.items():
        for i, (a, b) in enumerate(zip(got[n], want)):
            assert a.dtype == b.dtype and a.shape == b.shape, (n, i)
            assert a.tobytes() == b.tobytes(), (n, i)
        assert np.array_equal(ds.lengths(n), [len(v) for v in want])
        assert ds[5][n].shape == (0, *item)  # a zero-length sample


def test_zero_copy_columns_and_arrow_layout_other_tools_read(tmp_path):
    toks = [np.arange(k, dtype=np.int32) for k in (3, 0, 5)]
    boxes = [np.full((k, 4), k, np.float32) for k in (1, 2, 0)]
    with ShardWriter(tmp_path / "ds", {"t": "int32[]", "b": "float32[*,4]"}) as w:
        w.write_batch({"t": toks, "b": boxes})
    ds = DatasetReader(tmp_path / "ds")
    offsets, values = ds.ragged_column(0, "t")
    assert offsets.tolist() == [0, 3, 3, 8] and values.dtype == np.int32 and not values.flags.writeable
    assert values.base is not None  # a view of the memory map, not a copy
    offsets, values = ds.ragged_column(0, "b")
    assert values.shape == (3, 4) and offsets.tolist() == [0, 1, 3, 3]
    t = pa.ipc.open_file(pa.memory_map(str(tmp_path / "ds" / "shard-00000.arrow"))).read_all()
    assert t.schema.field("t").type == pa.large_list(pa.int32())
    assert t.schema.field("b").type == pa.large_list(pa.list_(pa.float32(), 4))
    assert t.column("t").to_pylist() == [[0, 1, 2], [], [0, 1, 2, 3, 4]]
    assert t.column("b").to_pylist()[1] == [[2.0] * 4] * 2


def test_ragged_batches_in_bulk_roll_shards_by_bytes_and_keep_order(tmp_path):
    rng = np.random.default_rng(1)
    lens = rng.integers(0, 200, 500)
    values = rng.integers(0, 50_000, int(lens.sum()), dtype=np.int32)
    r = Ragged.from_lengths(values, lens)
    with ShardWriter(tmp_path / "ds", {"t": "int32[]", "y": "int64"}, shard_size=20_000) as w:
        w.write_batch({"t": r[:250], "y": np.arange(250)})
        w.write_batch({"t": r[250:], "y": np.arange(250, 500)})
    ds = DatasetReader(tmp_path / "ds")
    m = read_manifest(tmp_path / "ds")
    assert ds.num_shards > 5 and all(s["bytes"] < 20_000 + 2_000 for s in m["shards"])
    assert m["format_version"] == 2 and m["fields"]["t"] == {"kind": "ragged", "dtype": "int32", "shape": []}
    got = ds.get_batch(np.arange(500))
    assert np.array_equal(got["y"], np.arange(500))
    assert np.array_equal(np.concatenate(got["t"]), values) and np.array_equal(ds.lengths("t"), lens)
    assert fastload.verify(tmp_path / "ds") == []  # Arrow's full validation checks the offsets


def test_a_sample_larger_than_the_shard_budget_gets_a_shard_of_its_own(tmp_path):
    big = np.arange(10_000, dtype=np.int64)
    with ShardWriter(tmp_path / "ds", {"t": "int64[]"}, shard_size=1000) as w:
        w.write_batch({"t": [np.arange(3), big, np.arange(2)]})
    ds = DatasetReader(tmp_path / "ds")
    assert ds.shard_sizes.tolist() == [1, 1, 1]
    assert np.array_equal(ds[1]["t"], big)


def test_bad_ragged_values_name_field_and_sample(tmp_path):
    with ShardWriter(tmp_path / "ds", {"t": "uint8[]", "b": "float32[*,4]"}) as w:
        with pytest.raises(SampleError, match=r"field 't' of sample 'k'.*300 does not fit in uint8"):
            w.write({"t": [1, 300], "b": np.zeros((0, 4))}, key="k")
        with pytest.raises(SampleError, match=r"field 'b' of sample 'k'.*shape \(2, 3\), expected \(k, 4\)"):
            w.write({"t": [1], "b": np.zeros((2, 3))}, key="k")
        with pytest.raises(SampleError, match=r"field 't' of sample 'c'.*-1 does not fit"):
            w.write_batch({"t": [[1], [2, 3], [4, -1]], "b": [np.zeros((0, 4))] * 3}, keys=["a", "b", "c"])
        with pytest.raises(SampleError, match="field 't'.*dtype float64, expected uint8"):
            w.write({"t": np.array([1.5]), "b": np.zeros((0, 4))})
        with pytest.raises(SampleError, match="field 't' of the batch: expected one value per sample"):
            w.write_batch({"t": 3, "b": [np.zeros((0, 4))]})
        w.write({"t": [], "b": []}, key="empty")  # empty lists are zero-length samples
    ds = DatasetReader(tmp_path / "ds")
    assert len(ds) == 1 and ds[0]["t"].shape == (0,) and ds[0]["b"].shape == (0, 4)


def test_ragged_offsets_are_checked():
    with pytest.raises(ValueError, match="rise from 0"):
        Ragged(np.arange(5), [0, 3, 2, 5])
    with pytest.raises(ValueError, match="rise from 0"):
        Ragged(np.arange(5), [0, 3])
    r = Ragged.from_lengths(np.arange(6), [2, 0, 4])
    assert r[2].tolist() == [2, 3, 4, 5] and r[1:].offsets.tolist() == [0, 0, 4] and len(r) == 3


def test_version_1_datasets_still_open_and_a_version_1_manifest_cannot_claim_ragged_fields(tmp_path):
    with ShardWriter(tmp_path / "old", {"x": "float32[2]"}) as w:
        w.write({"x": np.ones(2, np.float32)})
    assert read_manifest(tmp_path / "old")["format_version"] == 1
    assert DatasetReader(tmp_path / "old")[0]["x"].tolist() == [1.0, 1.0]
    with ShardWriter(tmp_path / "new", {"t": "int32[]"}) as w:
        w.write({"t": [1, 2]})
    mpath = tmp_path / "new" / "manifest.json"
    m = json.loads(mpath.read_text())
    m["format_version"] = 1
    mpath.write_text(json.dumps(m))
    with pytest.raises(FormatError, match="cannot hold ragged fields"):
        DatasetReader(tmp_path / "new")


V1 = Path(__file__).resolve().parent / "data" / "v1"  # written by the pre-ragged writer (data/make_v1.py)


def _v1_sample(i):
    return {"label": i % 3, "x": np.array([i, -i, 0.5 * i], np.float32),
            "m": (np.arange(4, dtype=np.uint8) + 4 * i).reshape(2, 2), "w": i / 8, "key": f"sample-{i:02d}",
            "blob": bytes(range(i))}


def test_a_dataset_written_by_the_pre_ragged_writer_opens_verifies_and_loads(tmp_path):
    """tests/data/v1 holds the bytes fastload's writer made before format version 2 existed
    (commit 8d7542b): today's reader, verify and Loader read it, every value as written."""
    import shutil

    from PIL import Image

    path = tmp_path / "v1"
    shutil.copytree(V1, path)  # a copy: nothing the test does can touch the committed files
    m = read_manifest(path)
    assert m["format_version"] == 1 and m["label"]["counts"] == [4, 4, 4]
    assert fastload.verify(path, remember=False) == []
    ds = DatasetReader(path)
    assert len(ds) == 12 and ds.num_shards == 3 and ds.label_field == "label"
    for i in range(12):
        got, want = ds[i], _v1_sample(i)
        for k, v in want.items():
            if isinstance(v, np.ndarray):
                assert got[k].dtype == v.dtype and got[k].tobytes() == v.tobytes(), (i, k)
            else:
                assert got[k] == v, (i, k)
        img = np.asarray(Image.open(io.BytesIO(got["image"])))
        assert img.shape == (8, 12, 3) and abs(int(img[0, 0, 0]) - 20 * i) <= 8 and img[0, 0, 1] > 150
    with fastload.Loader(path, batch_size=5, shuffle=False, fields=["x", "m", "w", "label", "key", "blob"]) as loader:
        batches = list(loader)
    assert [len(b["index"]) for b in batches] == [5, 5, 2]
    for b in batches:
        for row, i in enumerate(b["index"].tolist()):
            want = _v1_sample(i)
            assert b["x"][row].numpy().tobytes() == want["x"].tobytes()
            assert b["m"][row].numpy().tobytes() == want["m"].tobytes()
            assert b["w"][row].item() == want["w"] and b["label"][row].item() == want["label"]
            assert b["key"][row] == want["key"] and b["blob"][row] == want["blob"]
    with fastload.Loader(path, batch_size=4, shuffle=False, fields=["image", "label"],
                         transforms={"image": fastload.vision.eval(8, resize=8, dtype="uint8")}) as loader:
        images = [b["image"] for b in loader]
    assert sum(len(x) for x in images) == 12 and tuple(images[0].shape[1:]) in ((8, 8, 3), (3, 8, 8))

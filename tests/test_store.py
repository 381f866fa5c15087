"""The on-disk store: round trips, shard rolling, atomicity, verify, opening cost."""
import json
import re
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pyarrow as pa
import pytest
import torch

import fastload
from fastload.store import FormatError, parse_field, parse_size, read_manifest
from fastload.store.format import Field
from _dtypes import DTYPES


def _write(path, fields, samples, **kw):
    with fastload.ShardWriter(path, fields, **kw) as w:
        for i, s in enumerate(samples):
            w.write(s, key=f"k{i}")
    return fastload.Dataset(path)


def test_every_field_kind_round_trips_bytes_equal(tmp_path):
    rng = np.random.default_rng(0)
    dtypes = DTYPES
    fields = {f"t_{d}": f"{d}[2,3]" for d in dtypes}
    fields.update({f"s_{d}": d for d in dtypes if not d.startswith("complex")})
    fields.update({"img": "image", "raw": "bytes", "txt": "string"})
    from fastload.demo.photos import photos, random_jpeg
    jpeg = random_jpeg(next(iter(photos(["astronaut"]).values())), rng)
    samples = []
    for i in range(7):
        s = {}
        for d in dtypes:
            a = (rng.standard_normal((2, 3)) * 100)
            if d.startswith("complex"):
                a = a + 1j * a
            s[f"t_{d}"] = a.astype(d)
            if not d.startswith("complex"):
                s[f"s_{d}"] = np.asarray(a[0, 0]).astype(d)[()]
        s["img"] = jpeg
        s["raw"] = bytes(rng.integers(0, 256, i * 5, dtype=np.uint8))
        s["txt"] = "héllo ✓ " * i
        samples.append(s)
    ds = _write(tmp_path / "ds", fields, samples, shard_size=2000)
    assert ds.num_shards > 1
    assert len(ds) == 7
    assert {n: str(f) for n, f in ds.fields.items()} == {n: str(parse_field(s)) for n, s in fields.items()}
    for i, s in enumerate(samples):
        got = ds[i]
        for k, v in s.items():
            if isinstance(v, (bytes, str)):
                assert got[k] == v, k
            else:
                assert np.asarray(got[k]).dtype == np.asarray(v).dtype, k
                assert np.asarray(got[k]).tobytes() == np.asarray(v).tobytes(), k
    # Zero-copy column views with the declared shape and dtype.
    col = ds.column(0, "t_float32")
    assert col.shape == (int(ds.shard_sizes[0]), 2, 3) and col.dtype == np.float32
    assert not col.flags.writeable
    assert ds.column(0, "t_bool").dtype == np.bool_
    w, h = ds.image_sizes("img", [0, 6])
    assert w.tolist() == h.tolist() or (w > 0).all()
    from PIL import Image
    import io
    assert (int(w[0]), int(h[0])) == Image.open(io.BytesIO(jpeg)).size
    assert ds.keys([6, 0]) == ["k6", "k0"]


def test_get_batch_is_a_vectorised_gather_across_shards(tmp_path):
    x = np.arange(1000 * 5, dtype=np.float32).reshape(1000, 5)
    y = np.arange(1000, dtype=np.int64) % 7
    with fastload.ShardWriter(tmp_path / "ds", {"x": "float32[5]", "y": "int64"}, shard_size=4096, label="y") as w:
        w.write_batch({"x": x, "y": y})
    ds = fastload.Dataset(tmp_path / "ds")
    assert ds.num_shards == int(np.ceil(1000 * 28 / 4096)) or ds.num_shards > 5
    idx = np.random.default_rng(1).permutation(1000)[:300]
    b = ds.get_batch(idx)
    np.testing.assert_array_equal(b["x"], x[idx])
    np.testing.assert_array_equal(b["y"], y[idx])
    shard, row = ds.locate(idx)
    np.testing.assert_array_equal(ds.shard_starts[shard] + row, idx)
    assert ds.manifest["label"]["counts"] == np.bincount(y).tolist()
    with pytest.raises(IndexError, match="1000 is out of range"):
        ds.get_batch([3, 1000])
    with pytest.raises(IndexError, match="-1"):
        ds.locate([-1])
    assert ds[-1]["y"] == y[-1]


def test_manifest_records_shards_checksums_and_labels(tmp_path):
    with fastload.ShardWriter(tmp_path / "ds", {"x": "uint8[100]", "label": "int64"}, shard_size=1000,
                              label="label", class_names=["a", "b", "c"]) as w:
        w.write_batch({"x": np.zeros((25, 100), np.uint8), "label": np.array([0] * 5 + [2] * 20)})
    m = read_manifest(tmp_path / "ds")
    assert m["format_version"] == 1  # no ragged field: readers of version 1 still open it
    assert m["num_samples"] == 25
    assert [s["num_samples"] for s in m["shards"]] == [9, 9, 7]
    assert all(s["checksum"].startswith("xxh3_128:") for s in m["shards"])
    assert all(s["bytes"] == (tmp_path / "ds" / s["file"]).stat().st_size for s in m["shards"])
    assert m["label"] == {"field": "label", "class_names": ["a", "b", "c"], "counts": [5, 0, 20]}
    assert sorted(os.listdir(tmp_path / "ds")) == ["manifest.json", "shard-00000.arrow", "shard-00001.arrow",
                                                     "shard-00002.arrow"]


def test_shards_are_plain_arrow_readable_by_pyarrow(tmp_path):
    with fastload.ShardWriter(tmp_path / "ds", {"x": "float32[3]", "s": "string"}) as w:
        w.write({"x": np.ones(3, np.float32), "s": "a"})
    t = pa.ipc.open_file(pa.memory_map(str(tmp_path / "ds" / "shard-00000.arrow"))).read_all()
    assert t.column("s").to_pylist() == ["a"]
    assert t.column("x").to_pylist() == [[1.0, 1.0, 1.0]]
    assert t.schema.field("x").type == pa.list_(pa.float32(), 3)


@pytest.mark.parametrize("spec, err", [
    ("float32[0]", "positive"), ("object", "not a numpy dtype|cannot be stored"), ("str[3]", "cannot be stored"),
    ("image[3]", "takes no shape"), ("float32[", "cannot parse"), (3, "must be a Field or a string"),
])
def test_bad_field_specs_are_named(tmp_path, spec, err):
    with pytest.raises(ValueError, match=err):
        fastload.ShardWriter(tmp_path / "ds", {"f": spec})
    assert not (tmp_path / "ds" / "manifest.json").exists()


def test_bad_samples_are_refused_with_the_field_named(tmp_path):
    with fastload.ShardWriter(tmp_path / "ds", {"x": "float32[3]", "img": "image"}) as w:
        with pytest.raises(ValueError, match=r"field 'x' of sample '0': got shape \(4,\), expected \(3,\)"):
            w.write({"x": np.zeros(4), "img": b""})
        with pytest.raises(ValueError, match="lacks field"):
            w.write({"x": np.zeros(3)})
        with pytest.raises(ValueError, match="not a readable image"):
            w.write({"x": np.zeros(3), "img": b"not an image"}, key="bad.jpg")
        with pytest.raises(ValueError, match="label=.*not one of the fields"):
            fastload.ShardWriter(tmp_path / "other", {"x": "int64"}, label="y")
        with pytest.raises(ValueError, match="reserved"):
            fastload.ShardWriter(tmp_path / "other2", {"img": "image", "img_width": "int64"})
        w.abort()
    assert not (tmp_path / "ds").exists()  # abort() took back the directory it made
    with pytest.raises(fastload.errors.FastloadError, match="does not exist"):
        fastload.Dataset(tmp_path / "ds")


def test_parse_size():
    assert parse_size("256MB") == 256_000_000
    assert parse_size("1GiB") == 2**30
    assert parse_size(4096) == 4096
    for bad in ("lots", "0", "3GiB", -1):
        with pytest.raises(ValueError, match="shard_size"):
            parse_size(bad)


def test_refuses_non_empty_destination_and_overwrites_only_its_own(tmp_path):
    d = tmp_path / "ds"
    _write(d, {"x": "int64"}, [{"x": 1}])
    with pytest.raises(FileExistsError, match="not empty.*--overwrite"):
        fastload.ShardWriter(d, {"x": "int64"})
    ds = _write(d, {"x": "int64"}, [{"x": 5}, {"x": 6}], overwrite=True)
    assert ds.get_batch([0, 1])["x"].tolist() == [5, 6]
    user = tmp_path / "mine"
    user.mkdir()
    (user / "thesis.tex").write_text("precious")
    with pytest.raises(FileExistsError, match="thesis.tex"):
        fastload.ShardWriter(user, {"x": "int64"}, overwrite=True)
    assert (user / "thesis.tex").read_text() == "precious"


def test_values_are_never_silently_narrowed(tmp_path):
    w = fastload.ShardWriter(tmp_path / "ds", {"label": "int8", "x": "float16[2]", "u": "uint8"})
    ok = {"label": -128, "x": [1.5, 60000.0], "u": 255}  # the edges of each type fit
    w.write(ok, key="a")
    with pytest.raises(ValueError, match=r"field 'label' of sample 'b': 300 does not fit in int8"):
        w.write(dict(ok, label=300), key="b")
    with pytest.raises(ValueError, match=r"field 'x' of sample 'c': 1000000.0 does not fit in float16"):
        w.write(dict(ok, x=[1.0, 1e6]), key="c")
    with pytest.raises(ValueError, match=r"field 'u' of sample 'd': -1 does not fit in uint8"):
        w.write(dict(ok, u=-1), key="d")
    with pytest.raises(ValueError, match=r"field 'label' of sample 'e': got dtype float64"):
        w.write(dict(ok, label=1.5), key="e")
    with pytest.raises(ValueError, match=r"field 'x' of sample 'f': 2049 does not fit in float16"):
        w.write(dict(ok, x=[2049, 1]), key="f")  # an integer a float field cannot hold exactly
    with pytest.raises(ValueError, match=r"field 'u' of sample 'g': values numpy cannot store"):
        w.write(dict(ok, u=2**70), key="g")
    # a batch names the first offending sample
    batch = {"label": np.array([1, 2, 200]), "x": np.zeros((3, 2)), "u": np.array([1, 2, 3])}
    with pytest.raises(ValueError, match=r"field 'label' of sample 'k2': 200 does not fit"):
        w.write_batch(batch, keys=["k0", "k1", "k2"])
    batch["label"][2] = 3
    w.write_batch(batch)  # in range: int64 -> int8, float64 -> float16 are fine
    w.close()
    b = fastload.Dataset(tmp_path / "ds").get_batch([0, 1, 2, 3])
    assert b["label"].tolist() == [-128, 1, 2, 3] and b["u"].tolist() == [255, 1, 2, 3]
    assert b["x"][0].tolist() == [1.5, 60000.0]


def test_a_failed_overwrite_leaves_the_old_dataset_whole(tmp_path, monkeypatch):
    d = tmp_path / "ds"
    _write(d, {"x": "int64"}, [{"x": 1}, {"x": 2}])
    d.chmod(0o2750)  # a shared dataset directory: its mode survives replacements
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    with pytest.raises(RuntimeError, match="boom"):
        with fastload.ShardWriter(d, {"y": "float32[4]"}, overwrite=True, shard_size=40) as w:
            for i in range(10):
                w.write({"y": np.full(4, i, np.float32)})  # several new shards written...
            raise RuntimeError("boom")  # ...then the conversion fails
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before  # no staging left either
    assert fastload.Dataset(d).get_batch([0, 1])["x"].tolist() == [1, 2]
    # close() itself fails (here: the manifest cannot be written): same
    import fastload.store.transaction as transaction_mod

    def no_space(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(transaction_mod, "write_json_atomic", no_space)
    with pytest.raises(OSError, match="(?i)no space left"):
        _write(d, {"y": "float32[4]"}, [{"y": np.ones(4, np.float32)}], overwrite=True)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before
    # a writer dropped without close() or abort() removes its staging files too
    w = fastload.ShardWriter(d, {"y": "float32[4]"}, overwrite=True, shard_size=40)
    for i in range(5):
        w.write({"y": np.full(4, i, np.float32)})
    assert any(p.name.startswith(".fastload-staging-") for p in d.iterdir())
    del w
    import gc
    gc.collect()
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before
    # while a replacement is being written, the old dataset still opens; it is swapped at close
    w = fastload.ShardWriter(d, {"y": "float32[4]"}, overwrite=True)
    w.write({"y": np.ones(4, np.float32)})
    w.write({"y": np.zeros(4, np.float32)})
    assert len(fastload.Dataset(d)) == 2 and "x" in fastload.Dataset(d).fields
    w.close()
    ds = fastload.Dataset(d)
    assert list(ds.fields) == ["y"] and ds.get_batch([0])["y"].tolist() == [[1, 1, 1, 1]]
    names = sorted(p.name for p in d.iterdir())  # a replacing dataset's shards carry a new generation
    assert names[0] == "manifest.json" and re.fullmatch(r"shard-00000-[0-9a-f]{8}\.arrow", names[1]) and len(names) == 2
    assert (d.stat().st_mode & 0o7777) == 0o2750 and fastload.verify(d) == []
    # through a symlink, and from inside the directory itself
    (tmp_path / "link").symlink_to(d)
    _write(tmp_path / "link", {"z": "int8"}, [{"z": 7}], overwrite=True)
    assert (tmp_path / "link").is_symlink() and list(fastload.Dataset(d).fields) == ["z"]
    monkeypatch.chdir(d)
    _write(".", {"w": "int16"}, [{"w": 9}], overwrite=True)
    assert fastload.Dataset(d).get_batch([0])["w"].tolist() == [9]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds", "link"]


def test_exception_inside_writer_leaves_nothing_that_opens(tmp_path):
    d = tmp_path / "ds"
    with pytest.raises(RuntimeError, match="boom"):
        with fastload.ShardWriter(d, {"x": "uint8[100]"}, shard_size=500) as w:
            for i in range(20):
                w.write({"x": np.full(100, i, np.uint8)})
            raise RuntimeError("boom")
    assert not d.exists()  # the directory it made is taken back too
    d.mkdir()  # one the user made stays, empty
    with pytest.raises(RuntimeError, match="boom"):
        with fastload.ShardWriter(d, {"x": "uint8[100]"}, shard_size=500) as w:
            w.write({"x": np.zeros(100, np.uint8)})
            raise RuntimeError("boom")
    assert os.listdir(d) == []
    with pytest.raises(FormatError):
        fastload.Dataset(d)


def test_killed_writer_leaves_no_dataset_that_opens(tmp_path):
    d = tmp_path / "ds"
    script = textwrap.dedent(f"""
        import numpy as np, fastload, time
        w = fastload.ShardWriter({str(d)!r}, {{"x": "uint8[1000]"}}, shard_size=10_000)
        for i in range(10**9):
            w.write({{"x": np.full(1000, i % 256, np.uint8)}})
            if i == 50:
                print("shards written", flush=True)
            if i > 50:
                time.sleep(0.001)
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "shards written"
        time.sleep(0.2)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert any(n.startswith("shard-") for n in os.listdir(d))
    with pytest.raises(FormatError, match="interrupted"):
        fastload.Dataset(d)


def test_verify_names_a_shard_with_a_flipped_byte(tmp_path):
    d = tmp_path / "ds"
    with fastload.ShardWriter(d, {"x": "float32[64]"}, shard_size=3000) as w:
        w.write_batch({"x": np.random.default_rng(0).standard_normal((40, 64)).astype(np.float32)})
    assert fastload.verify(d) == []
    victim = d / "shard-00001.arrow"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x40
    victim.write_bytes(bytes(data))
    problems = fastload.verify(d)
    assert len(problems) == 1 and problems[0].startswith("shard-00001.arrow: checksum mismatch")
    (d / "shard-00002.arrow").write_bytes(b"garbage")
    problems = fastload.verify(d)
    assert any(p.startswith("shard-00002.arrow: size") for p in problems)
    assert any(p.startswith("shard-00002.arrow: not a valid Arrow IPC file") for p in problems)


def test_opening_a_million_samples_reads_no_shard(tmp_path):
    d = tmp_path / "ds"
    n = 1_000_000
    with fastload.ShardWriter(d, {"x": "uint8[8]", "y": "int32"}, shard_size=1_000_000) as w:
        w.write_batch({"x": np.zeros((n, 8), np.uint8), "y": np.arange(n, dtype=np.int32)})
    ds = fastload.Dataset(d)
    assert ds.num_shards >= 12
    # Replace every shard with garbage: opening, len() and locating (without verification,
    # which reads the shards it locates into) must not notice, since they read only the
    # manifest; the first sample read must name the damaged shard.
    for f in ds.shard_files:
        f.write_bytes(b"x" * 16)
    t0 = time.perf_counter()
    ds = fastload.Dataset(d)
    assert len(ds) == n
    shard, row = ds.locate(np.array([0, n - 1]), verify=False)
    assert shard.tolist() == [0, ds.num_shards - 1]
    assert all(s is None for s in ds._shards)
    assert time.perf_counter() - t0 < 5  # generous; bench/bench_open.py measures it
    with pytest.raises(FormatError, match="shard-00000.arrow"):
        ds[0]


def test_plain_dataloader_with_workers_and_getitems(tmp_path):
    x = np.arange(64 * 3, dtype=np.float32).reshape(64, 3)
    with fastload.ShardWriter(tmp_path / "ds", {"x": "float32[3]", "y": "int64", "s": "string"}, shard_size=300) as w:
        for i in range(64):
            w.write({"x": x[i], "y": i, "s": f"s{i}"})
    ds = fastload.Dataset(tmp_path / "ds")
    assert isinstance(ds, torch.utils.data.Dataset)
    seen = []
    dl = torch.utils.data.DataLoader(ds, batch_size=10, num_workers=2, shuffle=True,
                                     generator=torch.Generator().manual_seed(0))
    for b in dl:
        assert isinstance(b["x"], torch.Tensor) and b["x"].dtype == torch.float32
        np.testing.assert_array_equal(b["x"].numpy(), x[b["y"].numpy()])
        assert b["s"] == [f"s{i}" for i in b["y"].tolist()]
        seen += b["y"].tolist()
    assert sorted(seen) == list(range(64))


def test_format_version_and_damaged_manifest_are_refused(tmp_path):
    d = tmp_path / "ds"
    _write(d, {"x": "int64"}, [{"x": 1}])
    m = json.loads((d / "manifest.json").read_text())
    m["format_version"] = 99
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(FormatError, match="format_version 99"):
        fastload.Dataset(d)
    (d / "manifest.json").write_text("{not json")
    with pytest.raises(FormatError, match="not readable JSON"):
        fastload.Dataset(d)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        fastload.Dataset(tmp_path / "nope")


def test_field_json_round_trip():
    for spec in ["image", "bytes", "string", "int64", "bool", "float16[3,4]", "complex64[2]"]:
        f = parse_field(spec)
        assert Field.from_json(json.loads(json.dumps(f.to_json()))) == f


def test_an_overwrite_killed_while_swapping_leaves_the_new_dataset_findable(tmp_path, monkeypatch, capsys):
    import fastload.store.transaction as transaction_mod
    from fastload.store.recover import main as recover_main
    d = tmp_path / "ds"
    _write(d, {"x": "int64"}, [{"x": 1}])
    real_replace = os.replace

    def dies_at_the_manifest(src, dst):
        if os.fspath(dst) == os.fspath(d / "manifest.json") and ".fastload-staging-" in str(src):
            raise KeyboardInterrupt  # the process is stopped before the new manifest moves up
        real_replace(src, dst)

    monkeypatch.setattr(transaction_mod.os, "replace", dies_at_the_manifest)
    with pytest.raises(KeyboardInterrupt):
        _write(d, {"y": "int8"}, [{"y": 5}, {"y": 6}], overwrite=True)
    monkeypatch.undo()
    with pytest.raises(fastload.FormatError, match=r"interrupted while swapping .*`fastload recover") \
            as e:
        fastload.Dataset(d)
    staged = next(d.glob(".fastload-staging-*"))
    assert staged.name in str(e.value) and str(d) in str(e.value)
    assert recover_main([str(d)]) == 0  # the recovery the message describes: nothing was lost, nothing old left
    assert "finished an overwrite" in capsys.readouterr().out
    assert fastload.Dataset(d).get_batch([0, 1])["y"].tolist() == [5, 6] and fastload.verify(d) == []
    assert sorted(p.name for p in d.iterdir() if p.name != "manifest.json") == \
        sorted(s["file"] for s in fastload.Dataset(d).manifest["shards"])
    # an interrupted swap that is not recovered: the next overwrite finishes it, then replaces it
    monkeypatch.setattr(transaction_mod.os, "replace", dies_at_the_manifest)
    with pytest.raises(KeyboardInterrupt):
        _write(d, {"y": "int8"}, [{"y": 7}], overwrite=True)
    monkeypatch.undo()
    _write(d, {"z": "int8"}, [{"z": 1}], overwrite=True)
    names = sorted(p.name for p in d.iterdir())
    assert len(names) == 2 and names[0] == "manifest.json" and names[1].startswith("shard-00000")
    assert fastload.Dataset(d).get_batch([0])["z"].tolist() == [1] and fastload.verify(d) == []


# -- the file transaction: what --overwrite may delete ------------------------------------
def test_own_files_include_shards_of_any_count_and_nothing_else():
    from fastload.store.format import shard_name
    from fastload.store.transaction import is_own_file
    for i in (0, 1, 99_999, 100_000, 123_456, 10**7):
        name = shard_name(i)
        assert is_own_file(name) and is_own_file(f".{name}.tmp"), name
    assert shard_name(123_456) == "shard-123456.arrow"
    for own in ("manifest.json", "skipped.jsonl", ".manifest.json.tmp", ".skipped.jsonl.tmp",
                ".fastload-staging-0123456789ab"):
        assert is_own_file(own), own
    for foreign in ("shard-1234.arrow", "shard-00001.arrow.bak", "my-shard-00001.arrow", "shard-０００００.arrow",
                    "manifest.json\n", "manifest.json.bak", ".fastload-staging-xyz", "thesis.tex",
                    "shard-00000.arrow/", ".shard-00000.arrow"):
        assert not is_own_file(foreign), foreign


def test_overwrite_replaces_a_dataset_with_100000_or_more_shards(tmp_path):
    from fastload.store.format import shard_name
    d = tmp_path / "ds"
    _write(d, {"x": "int64"}, [{"x": 1}])
    # the last shards of a huge dataset (and a leftover of an interrupted write) are fastload's own
    for name in (shard_name(99_999), shard_name(100_000), shard_name(123_456), f".{shard_name(100_001)}.tmp"):
        (d / name).write_bytes(b"old shard")
    ds = _write(d, {"x": "int64"}, [{"x": 7}], overwrite=True)
    assert ds.get_batch([0])["x"].tolist() == [7]
    names = sorted(p.name for p in d.iterdir())
    assert names[0] == "manifest.json" and re.fullmatch(r"shard-00000-[0-9a-f]{8}\.arrow", names[1]) and len(names) == 2
    # a file that only looks like a shard is the user's: refused, kept
    (d / "shard-123.arrow").write_text("mine")
    with pytest.raises(FileExistsError, match="shard-123.arrow"):
        fastload.ShardWriter(d, {"x": "int64"}, overwrite=True)
    assert (d / "shard-123.arrow").read_text() == "mine" and fastload.Dataset(d).get_batch([0])["x"].tolist() == [7]


def test_a_failed_shard_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    from fastload.store.transaction import write_atomic
    target = tmp_path / "shard-00000.arrow"
    with pytest.raises(RuntimeError, match="disk"):
        with write_atomic(target) as f:
            f.write(b"half a shard")
            raise RuntimeError("disk went away")
    assert list(tmp_path.iterdir()) == []
    with write_atomic(target) as f:
        f.write(b"abc")
    import xxhash
    assert target.read_bytes() == b"abc" and f.nbytes == 3 and f.hash.hexdigest() == xxhash.xxh3_128(b"abc").hexdigest()
    assert list(tmp_path.iterdir()) == [target]


# -- one exception base ---------------------------------------------------------------------
def test_store_errors_are_fastload_errors(tmp_path):
    import fastload.errors as errors
    import fastload.store
    assert fastload.store.FormatError is errors.FormatError and fastload.store.SampleError is errors.SampleError
    with pytest.raises(errors.FastloadError, match="manifest.json is missing"):
        fastload.store.DatasetReader(tmp_path)
    with fastload.ShardWriter(tmp_path / "ds", {"x": "float32[2]"}) as w:
        with pytest.raises(errors.SampleError, match="field 'x' of sample 'bad'"):
            w.write({"x": [1.0, 2.0, 3.0]}, key="bad")
        w.write({"x": [1.0, 2.0]})
    m = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    m["fields"]["x"] = {"kind": "tensor", "dtype": "float32", "shape": [0]}
    (tmp_path / "ds" / "manifest.json").write_text(json.dumps(m))
    for open_or_verify in (fastload.store.DatasetReader, fastload.verify):
        with pytest.raises(errors.FormatError, match=r"manifest.json: fields\['x'\] is not a valid field description"):
            open_or_verify(tmp_path / "ds")


# -- the torch-free reader and the torch Dataset --------------------------------------------
def test_reader_reads_without_torch_and_dataset_is_the_same_reader_for_torch(tmp_path):
    import pickle

    from fastload.store import DatasetReader
    from fastload.store.dataset import Dataset
    x = np.arange(30, dtype=np.int16).reshape(10, 3)
    with fastload.ShardWriter(tmp_path / "ds", {"x": "int16[3]", "s": "string"}, shard_size=40) as w:
        for i in range(10):
            w.write({"x": x[i], "s": f"s{i}"}, key=f"k{i}")
    r = DatasetReader(tmp_path / "ds")
    assert not isinstance(r, torch.utils.data.Dataset)
    assert r.num_shards > 1 and len(r) == 10
    np.testing.assert_array_equal(r.get_batch([9, 0, 4])["x"], x[[9, 0, 4]])
    assert r[-1]["x"].tolist() == [27, 28, 29] and r[-1]["s"] == "s9" and r.keys([3]) == ["k3"]
    assert [s["s"] for s in r.__getitems__([2, 7])] == ["s2", "s7"]
    assert repr(r).startswith(f"fastload.store.DatasetReader({str(tmp_path / 'ds')!r}, 10 samples")
    ds = fastload.Dataset(tmp_path / "ds")
    assert type(ds) is Dataset and fastload.Dataset is Dataset and isinstance(ds, DatasetReader)
    assert isinstance(ds, torch.utils.data.Dataset) and repr(ds).startswith("fastload.Dataset(")
    # both pickle as their path only, and come back as the same class
    for obj in (r, ds):
        obj.get_batch([0, 9])  # shards mapped: still only the path is pickled
        blob = pickle.dumps(obj)
        assert b"s9" not in blob and len(blob) < 300
        back = pickle.loads(blob)
        assert type(back) is type(obj) and back.get_batch([9])["s"] == ["s9"]


def _run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300)


def test_store_convert_and_verify_never_import_torch_or_dali(tmp_path):
    """With ``fastload/__init__`` bypassed (another module's job), the store and convert
    themselves import neither torch nor DALI: write, read, verify and convert (with worker
    processes) run, and only ``fastload.store.Dataset`` brings torch in. Converting images
    imports DALI (never torch): each image is also decoded by the Loader's decoder, DALI on
    the CPU, in the main process (issue 19)."""
    from PIL import Image
    src = tmp_path / "src"
    for c in ("a", "b"):
        (src / c).mkdir(parents=True)
        for i in range(40):
            Image.fromarray(np.full((8, 8, 3), i, np.uint8)).save(src / c / f"{i}.jpg")
    pkg_dir = os.path.dirname(fastload.__file__)
    p = _run_python(f"""
        import sys, types
        pkg = types.ModuleType("fastload")  # the package without its __init__
        pkg.__path__ = [{pkg_dir!r}]
        sys.modules["fastload"] = pkg
        import numpy as np
        import fastload.store, fastload.convert, fastload.store.full_check
        from fastload.store import DatasetReader, ShardWriter, verify
        from fastload.convert import convert

        def heavy():
            return sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "nvidia") or "dali" in m)

        assert heavy() == [], heavy()
        with ShardWriter({str(tmp_path / 'ds')!r}, {{"x": "float32[2]"}}) as w:
            w.write_batch({{"x": np.ones((5, 2), np.float32)}})
        assert DatasetReader({str(tmp_path / 'ds')!r}).get_batch([4])["x"].tolist() == [[1.0, 1.0]]
        assert verify({str(tmp_path / 'ds')!r}) == []
        for workers in (0, 2):
            r = convert("imagefolder", {str(src)!r}, {str(tmp_path)!r} + f"/img{{workers}}", workers=workers,
                        progress=False)
            assert r["num_samples"] == 80, r
        assert [m for m in heavy() if not m.startswith("nvidia")] == [], heavy()
        from fastload.store import Dataset  # PEP 562: torch only now
        assert "torch" in sys.modules and issubclass(Dataset, DatasetReader)
        print("ok")
    """)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr


def test_importing_the_store_and_convert_through_the_package_imports_no_torch():
    p = _run_python("""
        import sys
        import fastload.store, fastload.convert, fastload.store.full_check
        assert not [m for m in sys.modules if m.split(".")[0] == "torch" or "dali" in m], "torch/DALI imported"
    """)
    assert p.returncode == 0, p.stderr


def test_undecodable_keys_are_escaped_one_to_one(tmp_path):
    """Keys Arrow cannot store as UTF-8 (a file name's undecodable bytes, carried as lone
    surrogates) are escaped as convert escapes names: two different names never share a key,
    and each key reads back to its name."""
    from fastload.store.keys import unescape_key

    names = [b"a\xff".decode("utf-8", "surrogateescape"), "a\\xff" + b"\xfe".decode("utf-8", "surrogateescape"),
             b"a\\\xff".decode("utf-8", "surrogateescape")]
    with fastload.ShardWriter(tmp_path / "ds", {"x": "int64"}) as w:
        for i, n in enumerate(names):
            w.write({"x": i}, key=n)
        w.write({"x": 3}, key="plain\\name")  # valid UTF-8: stored as given
    ds = fastload.Dataset(tmp_path / "ds")
    keys = ds.keys(list(range(4)))
    assert len(set(keys[:3])) == 3 and all(k.isprintable() for k in keys[:3])
    assert [unescape_key(k) for k in keys[:3]] == names
    assert keys[3] == "plain\\name"

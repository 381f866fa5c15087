"""A local dataset of more shards than a process may map (issue 30): the reader keeps a
bounded set mapped (fastload/store/mapped.py) and the Loader's ring installs shards as
batches need them (fastload/loader/shards.py), so 100,000 shards load with a few thousand
mappings, every sample exactly once and intact."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import fastload
from fastload.errors import FormatError
from fastload.bench.linked import link_shards
from fastload.store.mapped import ENV_LIMIT, mapped_shard_limit


def shard_maps(folder: Path) -> int:
    """Memory mappings of this process onto files of ``folder`` (/proc/self/maps)."""
    prefix = str(folder.resolve()) + "/"
    with open("/proc/self/maps") as fh:
        return sum(1 for line in fh if prefix in line)


def linked_dataset(folder: Path, shards: int, rows: int) -> Path:
    """A dataset of ``shards`` shards of ``rows`` rows (``x`` int32: the row in its shard),
    made in seconds: one shard written, then hard links to it, each listed under its own
    name in the manifest."""
    one = folder / "one"
    with fastload.ShardWriter(one, {"x": "int32"}) as w:
        w.write_batch({"x": np.arange(rows, dtype=np.int32)})
    return link_shards(one, folder / "many", shards)


@pytest.fixture(scope="module")
def distinct_source(tmp_path_factory):
    """120 shards of 5 rows, each row its own: x int64 (the global index), tok int32[] ragged."""
    path = tmp_path_factory.mktemp("many") / "ds"
    with fastload.ShardWriter(path, {"x": "int64", "tok": "int32[]"}, shard_size=5 * 8) as w:
        for i in range(600):
            w.write({"x": i, "tok": np.full(i % 7 + 1, i, np.int32)})
    ds = fastload.Dataset(path)
    assert ds.num_shards >= 100, ds.shard_sizes
    return path


@pytest.fixture()
def distinct(distinct_source, tmp_path):
    """A copy of ``distinct_source`` this test may damage."""
    return Path(shutil.copytree(distinct_source, tmp_path / "ds"))


def test_the_limit_comes_from_the_environment_or_the_map_count(monkeypatch):
    monkeypatch.delenv(ENV_LIMIT, raising=False)
    with open("/proc/sys/vm/max_map_count") as fh:
        count = int(fh.read())
    assert mapped_shard_limit() == max(16, min(4096, count // 4))
    monkeypatch.setenv(ENV_LIMIT, "12")
    assert mapped_shard_limit() == 12
    monkeypatch.setenv(ENV_LIMIT, "0")
    with pytest.raises(ValueError, match=ENV_LIMIT):
        mapped_shard_limit()


@pytest.mark.parametrize("verify", ["off", "first-use"])
def test_a_loader_past_the_limit_reads_every_sample_once_with_few_mappings(distinct, monkeypatch, verify):
    monkeypatch.setenv(ENV_LIMIT, "16")
    ds = fastload.Dataset(distinct, verify=verify)
    # batches of 8 rows touch up to 8 shards each, and several batches are in flight: more
    # shards than the limit are needed at once now and then, and none of them may be dropped
    with fastload.Loader(ds, batch_size=8, shuffle=True, seed=3, device="cpu", threads=2, prefetch=6,
                         fields=["x", "tok"]) as lo:
        for epoch in range(2):
            lo.set_epoch(epoch)
            seen, most = [], 0
            for b in lo:
                idx = b["index"].numpy()
                assert np.array_equal(b["x"].numpy(), idx)
                lengths, tok = b["tok_lengths"].numpy(), b["tok"].numpy()  # padded rows
                assert np.array_equal(lengths, idx % 7 + 1)
                for k, i in enumerate(idx):
                    assert np.array_equal(tok[k, :lengths[k]], np.full(i % 7 + 1, i, np.int32))
                seen.append(idx)
                most = max(most, shard_maps(distinct))
                installed = lo.stats()["ring"]["shards_installed"]
                assert installed <= 16 + 6 * 8 + 8, installed
            assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(600))
            # the reader's 16 and the ring's installed ones (mostly the same shards)
            assert most <= 16 + 16 + 7 * 8, most
            assert ds.mapped_shards <= 16
        assert ds._maps.dropped > 0


def test_a_loader_within_the_limit_maps_every_shard_up_front(distinct, monkeypatch):
    monkeypatch.setenv(ENV_LIMIT, "1000")
    ds = fastload.Dataset(distinct, verify="off")
    with fastload.Loader(ds, batch_size=8, shuffle=False, device="cpu", fields=["x"]) as lo:
        next(iter(lo))
        assert "shards_installed" not in lo.stats()["ring"]  # no lazy installation
        assert ds.mapped_shards == ds.num_shards


def test_a_shard_replaced_after_it_was_dropped_is_refused(distinct, monkeypatch):
    monkeypatch.setenv(ENV_LIMIT, "2")
    ds = fastload.Dataset(distinct, verify="off")
    first = ds.column(0, "x").copy()
    ds.column(1, "x")
    ds.column(2, "x")  # drops shard 0
    assert ds.mapped_shards == 2 and ds._shards[0] is None
    f = ds.shard_files[0]
    tmp = f.with_suffix(".new")
    shutil.copyfile(f, tmp)  # the same bytes, another file
    os.replace(tmp, f)
    with pytest.raises(FormatError, match=r"changed while the dataset was open.*reopen the dataset") as e:
        ds.column(0, "x")
    assert str(f) in str(e.value)
    again = fastload.Dataset(distinct, verify="off")  # reopened: read as it is now
    assert np.array_equal(again.column(0, "x"), first)


def test_an_unchanged_shard_is_mapped_again_after_it_was_dropped(distinct, monkeypatch):
    monkeypatch.setenv(ENV_LIMIT, "2")
    ds = fastload.Dataset(distinct, verify="first-use")
    a = ds.column(0, "x")
    for s in (1, 2, 3):
        ds.column(s, "x")
    assert ds._shards[0] is None
    assert np.array_equal(ds.column(0, "x"), a)  # the view handed out still reads its own mapping
    assert ds.verify_stats()["shards_hashed"] == 4  # verified once, not again when mapped again


def test_a_truncated_shard_not_mapped_yet_fails_naming_it(distinct, monkeypatch):
    monkeypatch.setenv(ENV_LIMIT, "16")
    ds = fastload.Dataset(distinct, verify="off")
    bad = ds.num_shards - 3
    os.truncate(ds.shard_files[bad], 100)
    with fastload.Loader(ds, batch_size=8, shuffle=False, device="cpu", fields=["x"]) as lo:
        seen = 0
        with pytest.raises(FormatError, match=str(ds.shard_files[bad])):
            for b in lo:
                assert np.array_equal(b["x"].numpy(), b["index"].numpy())
                seen += len(b["index"])
        assert seen < int(ds.shard_starts[bad + 1])


@pytest.mark.slow
def test_a_loader_reads_100000_shards_with_a_bounded_number_of_mappings(tmp_path):
    """Before: ``FormatError ... cannot be memory-mapped: Cannot allocate memory`` at the
    first batch (every shard mapped up front, past vm.max_map_count)."""
    path = linked_dataset(tmp_path, 100_000, 4)
    ds = fastload.Dataset(path, verify="off")
    limit = mapped_shard_limit()
    assert ds.num_shards > limit
    with fastload.Loader(ds, batch_size=64, shuffle=True, seed=1, device="cpu", threads=2) as lo:
        most, n = 0, 0
        for k, b in enumerate(lo):
            idx = b["index"].numpy()
            assert np.array_equal(b["x"].numpy(), idx % 4)
            n += len(idx)
            if k % 20 == 0:
                most = max(most, shard_maps(path))
            if k == 150:  # ~9,600 shards touched: past the limit
                break
        assert n == 151 * 64
        assert most <= 2 * limit + 64 * 16, (most, limit)
        assert lo.stats()["ring"]["shards_installed"] <= limit + 64 * 16
    assert ds.mapped_shards <= limit


def test_the_schema_check_remembers_only_a_schema_that_holds_the_fields():
    from fastload.store.format import arrow_schema, parse_field
    from fastload.store.shard import SchemaCheck

    good = {"x": parse_field("float32[16]", "x")}
    other = {"x": parse_field("float32[8,2]", "x")}  # the same Arrow type, another shape in the metadata
    check = SchemaCheck(good)
    assert check(arrow_schema(other)) is not None  # nothing remembered from a mismatch
    assert check(arrow_schema(good)) is None
    assert check(arrow_schema(good)) is None  # (remembered)
    assert "x" in check(arrow_schema(other))  # still refused once a good schema is remembered


def test_an_undecodable_image_replaced_from_a_dropped_shard_is_installed_again(tmp_path, monkeypatch):
    """on_error="skip" replaces an undecodable image by the next sample: here the last
    sample's replacement is sample 0, whose shard the ring dropped long before."""
    from _images import jpeg

    from fastload import vision

    monkeypatch.setenv(ENV_LIMIT, "1")
    rng = np.random.default_rng(0)
    with fastload.ShardWriter(tmp_path / "ds", {"image": "image", "label": "int64"}, shard_size=1) as wr:
        for i in range(6):
            if i == 5:  # its own shard; bytes that are not an image, with a plausible recorded size
                wr.write({"image": b"\xff\xd8\xff" + b"junk" * 50, "label": 5}, image_sizes={"image": (64, 64)})
            else:
                wr.write({"image": jpeg(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)), "label": i})
    ds = fastload.Dataset(tmp_path / "ds")
    assert ds.num_shards == 6
    with fastload.Loader(ds, batch_size=1, shuffle=False, prefetch=1, device="cpu", on_error="skip",
                         transforms={"image": vision.eval(16, resize=16)}) as lo:
        got = [(int(b["index"][0]), int(b["label"][0])) for b in lo]
        assert lo.stats()["replaced_samples"] == 1
    assert got == [(0, 0), (1, 1), (2, 2), (3, 3), (4, 4), (0, 0)]  # the raw field follows the replacement


def test_passes_ended_early_on_an_image_dataset_leave_no_shard_held_for_good(tmp_path, monkeypatch):
    """A pass ended early drops the batches its feeder held (prepared, never delivered); their
    shards must not stay installed for good, or after enough early ends every shard would."""
    from _images import jpeg

    from fastload import vision

    monkeypatch.setenv(ENV_LIMIT, "4")
    rng = np.random.default_rng(1)
    with fastload.ShardWriter(tmp_path / "ds", {"image": "image", "label": "int64"}, shard_size=1) as wr:
        for i in range(40):
            wr.write({"image": jpeg(rng.integers(0, 255, (24, 24, 3), dtype=np.uint8)), "label": i})
    ds = fastload.Dataset(tmp_path / "ds")
    assert ds.num_shards == 40
    with fastload.Loader(ds, batch_size=1, prefetch=6, device="cpu", seed=3,
                         transforms={"image": vision.eval(16, resize=16)}) as lo:
        for epoch in range(15):  # each pass: one batch, then break (its feeder's batches dropped)
            lo.set_epoch(epoch)
            next(iter(lo))
        lo.set_epoch(100)
        most = 0
        for b in lo:  # a whole pass: shards are dropped again as batches are delivered
            assert int(b["label"][0]) == int(b["index"][0])
            most = max(most, lo.stats()["ring"]["shards_installed"])
        assert most <= 4 + 6 + 4, most  # the limit, the batches in flight and a margin (not all 40)

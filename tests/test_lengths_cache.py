"""A local dataset's ragged lengths kept in the node's cache directory and memory-mapped
(never one copy per rank): read from the shards once, then from the file; a damaged file is
read again; without a writable cache directory they are held in memory, with a warning."""
import logging

import numpy as np
import pytest

import fastload
from fastload.store import ShardWriter
from fastload.store import lengths as lengths_mod


@pytest.fixture
def ds(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTLOAD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(lengths_mod, "MAP_MIN", 10)
    docs = [np.arange(i % 13, dtype=np.int32) for i in range(500)]
    with ShardWriter(tmp_path / "ds", {"tokens": "int32[]"}, shard_size=64) as w:
        w.write_batch({"tokens": docs})
    return tmp_path / "ds", np.array([len(d) for d in docs])


def test_lengths_are_kept_and_mapped_then_read_from_the_file(ds, monkeypatch):
    path, want = ds
    first = fastload.Dataset(path).lengths("tokens")
    assert isinstance(first, np.memmap) and np.array_equal(first, want) and not first.flags.writeable
    kept = lengths_mod.local_lengths_path(fastload.Dataset(path), "tokens")
    assert kept.exists() and not list(kept.parent.glob(".*.tmp"))  # renamed into place, nothing left over
    again = fastload.Dataset(path)
    monkeypatch.setattr(type(again), "ragged_column", lambda *a, **k: pytest.fail("read the shards again"))
    v = again.lengths("tokens")
    assert isinstance(v, np.memmap) and np.array_equal(v, want)


def test_a_damaged_file_is_read_again(ds, caplog):
    path, want = ds
    kept = lengths_mod.local_lengths_path(fastload.Dataset(path), "tokens")
    kept.parent.mkdir(parents=True)
    np.save(kept, np.zeros(7, np.int64))  # another shape: not these lengths
    with caplog.at_level(logging.WARNING, logger="fastload"):
        v = fastload.Dataset(path).lengths("tokens")
    assert np.array_equal(v, want) and "does not hold 500 lengths" in caplog.text
    assert np.array_equal(np.load(kept), want)


def test_without_a_writable_cache_directory_they_are_held_in_memory(ds, tmp_path, monkeypatch, caplog):
    path, want = ds
    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("FASTLOAD_CACHE", str(tmp_path / "afile"))  # a file: no directory can be made in it
    with caplog.at_level(logging.WARNING, logger="fastload"):
        v = fastload.Dataset(path).lengths("tokens")
    assert not isinstance(v, np.memmap) and np.array_equal(v, want)
    assert "could not keep the lengths of 'tokens'" in caplog.text and "FASTLOAD_CACHE" in caplog.text


def test_a_small_dataset_holds_them_in_memory(ds, monkeypatch):
    path, want = ds
    monkeypatch.setattr(lengths_mod, "MAP_MIN", 10**6)
    v = fastload.Dataset(path).lengths("tokens")
    assert not isinstance(v, np.memmap) and np.array_equal(v, want)
    assert not lengths_mod.local_lengths_path(fastload.Dataset(path), "tokens").exists()


def test_a_mixtures_lengths_are_kept_and_mapped_too(ds, tmp_path):
    path, want = ds
    docs = [np.arange(i % 5, dtype=np.int32) for i in range(40)]
    with ShardWriter(tmp_path / "small", {"tokens": "int32[]"}, shard_size=16) as w:
        w.write_batch({"tokens": docs})
    mix = fastload.Mixture({"a": fastload.Dataset(path), "b": fastload.Dataset(tmp_path / "small")}, [0.5, 0.5],
                           epoch_size=100)
    v = mix.reader.lengths("tokens")
    assert isinstance(v, np.memmap) and np.array_equal(v, np.concatenate([want, [len(d) for d in docs]]))
    again = fastload.Mixture({"a": fastload.Dataset(path), "b": fastload.Dataset(tmp_path / "small")}, [0.5, 0.5],
                             epoch_size=100).reader.lengths("tokens")
    assert isinstance(again, np.memmap) and again.filename == v.filename  # the same file, once per node

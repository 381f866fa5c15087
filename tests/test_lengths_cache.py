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


# -- the kept machinery (fastload.runtime.kept) under failure -------------------------------
def test_a_killed_builders_temporary_file_is_deleted_by_the_next_builder(tmp_path, caplog):
    """A builder killed mid-build (SIGKILL) leaves its full-size temporary file; the next
    process that takes the folder's lock deletes it. A live builder's file (flocked) and one
    of another host (a directory shared over NFS) stay."""
    import fcntl
    import os
    import signal
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    from fastload.runtime import kept

    folder = tmp_path / "t"
    root = Path(__file__).resolve().parent.parent
    child = textwrap.dedent(f"""
        import os, signal, numpy as np
        from pathlib import Path
        from fastload.runtime.kept import kept_arrays
        def build(alloc):
            alloc("cdf")[:] = 1
            os.kill(os.getpid(), signal.SIGKILL)
        kept_arrays(Path({str(folder)!r}), {{"cdf": (np.float64, (100_000,))}}, build, what="t", holds="t")
        """)
    p = subprocess.run([sys.executable, "-c", child], env={**os.environ, "PYTHONPATH": str(root)}, timeout=120)
    assert p.returncode == -signal.SIGKILL
    (left,) = [f for f in folder.iterdir() if f.name.endswith(".tmp")]
    assert left.stat().st_size > 800_000  # allocated at full size
    host = kept._host()
    assert left.name.startswith(f".cdf.npy.{host}.")
    live, other = folder / f".cdf.npy.{host}.1.2.tmp", folder / ".cdf.npy.another-host.3.4.tmp"
    live.write_bytes(b"x" * 100)
    other.write_bytes(b"x" * 100)
    fd = os.open(live, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a live builder (one that stopped waiting for the folder's lock)
    try:
        with caplog.at_level(logging.WARNING, logger="fastload"):
            got = kept.kept_arrays(folder, {"cdf": (np.float64, (100_000,))}, lambda alloc: alloc("cdf").fill(2),
                                   what="t", holds="t")
    finally:
        os.close(fd)
    assert np.all(got["cdf"] == 2)
    assert sorted(f.name for f in folder.iterdir()) == sorted([".lock", "cdf.npy", live.name, other.name])
    assert f"deleted {left}" in caplog.text and "died while building t" in caplog.text


def test_an_error_of_the_build_itself_is_raised_once_not_blamed_on_the_cache(tmp_path, caplog):
    from fastload.runtime import kept

    calls = []

    def build(alloc):
        calls.append(1)
        alloc("lengths")[:] = 0
        raise FileNotFoundError(2, "No such file or directory", "/data/ds/shard-00007.arrow")

    with caplog.at_level(logging.WARNING, logger="fastload"), pytest.raises(FileNotFoundError, match="shard-00007"):
        kept.kept_arrays(tmp_path / "k", {"lengths": (np.int64, (10,))}, build, what="the lengths", holds="10")
    assert calls == [1] and "FASTLOAD_CACHE" not in caplog.text
    assert sorted(f.name for f in (tmp_path / "k").iterdir()) == [".lock"]  # its temporary file deleted


def test_a_full_disk_while_building_falls_back_to_memory(tmp_path, monkeypatch, caplog):
    import errno

    from fastload.runtime import kept

    def full(path, nbytes):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(kept, "_reserve", full)
    with caplog.at_level(logging.WARNING, logger="fastload"):
        got = kept.kept_arrays(tmp_path / "k", {"v": (np.int64, (10,))}, lambda alloc: alloc("v").fill(7),
                               what="the values", holds="10")
    assert not isinstance(got["v"], np.memmap) and np.all(got["v"] == 7) and not got["v"].flags.writeable
    assert "could not keep the values" in caplog.text and "No space left" in caplog.text
    assert sorted(f.name for f in (tmp_path / "k").iterdir()) == [".lock"]


@pytest.mark.parametrize("which", ["lengths", "values"])
def test_every_kept_table_waits_for_another_builder_as_long_as_its_size_needs(ds, monkeypatch, which):
    """kept_lengths / kept_values wait build_wait_s(n) for the node's builder, like the tables
    (not a fixed 600 s, too short at 10^10 rows)."""
    from fastload.runtime import kept

    path, want = ds
    waits = []

    def lock(self, timeout):
        waits.append(timeout)
        return False  # (as if the other builder were still at work)

    monkeypatch.setattr(kept.Flock, "lock", lock)
    monkeypatch.setattr(kept.Flock, "try_lock", lambda self: False)
    reader = fastload.Dataset(path)
    if which == "lengths":
        v = reader.lengths("tokens")
    else:
        with ShardWriter(path.parent / "sc", {"x": "float32"}, shard_size=64) as w:
            w.write_batch({"x": np.arange(500, dtype=np.float32)})
        reader, want = fastload.Dataset(path.parent / "sc"), np.arange(500, dtype=np.float32)
        v = lengths_mod.kept_values(reader, "x")
    assert np.array_equal(v, want)
    assert waits == [kept.build_wait_s(500)]
    assert kept.build_wait_s(10**10) > 5000


def test_a_remote_datasets_weight_field_is_kept_once_per_node_in_its_cache(remote_url, local_ds, tmp_path,
                                                                           monkeypatch):
    """Loader(remote, weights="y"): the field's values are read shard by shard into the
    dataset's cache directory (values-y.npy, beside its lengths) and memory-mapped by every
    rank, not read whole into each rank's memory; a later Loader reads the file, not the
    shards; the draws equal those of the same dataset read locally."""
    from fastload.store.reader import DatasetReader

    local = fastload.Dataset(local_ds)
    want = local.get_batch(np.arange(len(local)), fields=["y"])["y"]
    kw = dict(batch_size=50, weights="y", seed=5, device="cpu")

    def run(path, **more):
        with fastload.Loader(path, **kw, **more) as lo:
            values = lo.sampler.weights
            return values, np.concatenate([b["y"].numpy() for b in lo])

    cache = tmp_path / "c"
    values, got = run(remote_url, cache_dir=cache)
    assert _is_mapped(values) and not values.flags.writeable and np.array_equal(values, want)
    (kept,) = list(cache.rglob("values-y.npy"))
    assert np.array_equal(np.load(kept), want) and not list(kept.parent.glob(".*.tmp"))
    with monkeypatch.context() as m:
        m.setattr(DatasetReader, "column", lambda *a, **k: pytest.fail("read the shards again"))
        with fastload.Loader(remote_url, cache_dir=cache, **kw) as lo:
            assert _is_mapped(lo.sampler.weights) and np.array_equal(lo.sampler.weights, want)
    monkeypatch.setenv("FASTLOAD_CACHE", str(tmp_path / "fl"))
    assert np.array_equal(run(local_ds)[1], got)


def _is_mapped(a) -> bool:
    import mmap

    while a is not None:
        if isinstance(a, mmap.mmap):
            return True
        a = getattr(a, "base", None)
    return False

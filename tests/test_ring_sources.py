"""The ring with shard sources installed and dropped while it runs (remote datasets map a
shard when it arrives in the cache and release it after its last use)."""
from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

from fastload.ring import Ring


def _shards(n=3, rows=50, dim=4):
    return [np.arange(s * 1000, s * 1000 + rows * dim, dtype=np.float32).reshape(rows, dim) for s in range(n)]


def test_unloaded_shards_fail_by_name_until_installed():
    x = _shards()
    with Ring({"x": (np.float32, (4,))}, 8, {"x": [x[0], None, None]}, shard_rows=[50, 50, 50], threads=2) as r:
        r.submit([0] * 4, [0, 1, 2, 3])
        assert np.array_equal(r.get_arrays()["x"], x[0][:4])
        r.submit([0, 1], [5, 6])
        with pytest.raises(ValueError, match="shard 1 is not loaded"):
            r.get_arrays()
        r.set_source(1, {"x": x[1]})
        r.submit([1, 0, 1], [7, 7, 49])
        assert np.array_equal(r.get_arrays()["x"], np.stack([x[1][7], x[0][7], x[1][49]]))


def test_drop_releases_the_array_and_later_batches_fail():
    x = _shards()
    a = x[2]
    before = sys.getrefcount(a)
    with Ring({"x": (np.float32, (4,)), "i": (np.int64, ())}, 8, {"x": [x[0], x[1], None]}, index_field="i",
              shard_rows=[50, 50, 50], threads=1) as r:
        r.set_source(2, {"x": a})
        assert sys.getrefcount(a) > before  # the ring holds the buffer
        r.submit([2], [3], index=[103])
        b = r.get_arrays()
        assert np.array_equal(b["x"], a[3:4]) and b["i"].tolist() == [103]
        del b
        r.set_source(2, None)
        assert sys.getrefcount(a) == before  # ...and let it go: the file could be unmapped now
        r.submit([2], [3], index=[103])
        with pytest.raises(ValueError, match="shard 2 is not loaded"):
            r.get_arrays()
        # external fills gather through the same sources
        with r.acquire() as slot:
            with pytest.raises(ValueError, match="shard 2 is not loaded"):
                slot.gather([2], [0], index=[100])
            slot.gather([1], [0], index=[50])
            slot.commit(1)
        assert np.array_equal(r.get_arrays()["x"], x[1][:1])


def test_bad_set_source_arguments():
    x = _shards()
    with Ring({"x": (np.float32, (4,))}, 8, {"x": [x[0], None, None]}, shard_rows=[50, 50, 50]) as r:
        with pytest.raises(ValueError, match="in \\[0, 3\\)"):
            r.set_source(3, {"x": x[0]})
        with pytest.raises(ValueError, match="exactly the sourced fields"):
            r.set_source(1, {"y": x[0]})
        with pytest.raises(ValueError, match="source has 10 rows, the shard 50"):
            r.set_source(1, {"x": x[0][:10]})
        with pytest.raises(ValueError, match="dtype float64"):
            r.set_source(1, {"x": x[0].astype(np.float64)})
    with pytest.raises(ValueError, match="source has 49 rows, the shard 50"):
        Ring({"x": (np.float32, (4,))}, 8, {"x": [x[0][:49], None, None]}, shard_rows=[50, 50, 50])


def test_install_and_drop_while_producers_gather():
    """Shard 0 is dropped and installed again and again while batches of shards 0 and 1
    are gathered: every batch is either right or fails naming shard 0, nothing crashes."""
    x = _shards(2, rows=400, dim=256)
    stop = threading.Event()
    with Ring({"x": (np.float32, (256,))}, 64, {"x": [x[0], x[1]]}, shard_rows=[400, 400], threads=2,
              min_part_bytes=4096) as r:

        def flip():
            while not stop.is_set():
                r.set_source(0, None)
                r.set_source(0, {"x": x[0]})

        t = threading.Thread(target=flip, name="fastload-test-flip")
        t.start()
        rng = np.random.default_rng(0)
        ok = failed = 0
        try:
            for _ in range(300):
                shard = rng.integers(0, 2, 64)
                row = rng.integers(0, 400, 64)
                r.submit(shard, row)
                try:
                    got = r.get_arrays()["x"]
                except ValueError as e:
                    assert "shard 0 is not loaded" in str(e)
                    failed += 1
                    continue
                want = np.stack([x[s][i] for s, i in zip(shard, row)])
                assert np.array_equal(got, want)
                ok += 1
        finally:
            stop.set()
            t.join()
        assert ok > 0
        # batches of shard 1 alone never fail
        for _ in range(20):
            r.submit(np.ones(64, np.int64), rng.integers(0, 400, 64))
            r.get_arrays()


def test_the_core_asserts_what_python_checked():
    """One validation layer: Python (above) checks the user's arguments with messages; the
    C++ core only asserts its invariants, once, so a caller bypassing Python still cannot
    index out of range."""
    x = _shards()
    with Ring({"x": (np.float32, (4,))}, 8, {"x": [x[0], None, None]}, shard_rows=[50, 50, 50]) as r:
        core = r._core
        with pytest.raises(IndexError, match="set_source: shard 3 is out of range \\(3 shards\\)"):
            core.set_source(3, [x[1]])
        with pytest.raises(IndexError, match="shard -1 is out of range"):
            core.set_source(-1, [None])
        with pytest.raises(ValueError, match="one entry per field"):
            core.set_source(1, [])
        with pytest.raises(ValueError, match="wrong number of rows"):
            core.set_source(1, [x[1][:10]])
        core.set_source(1, [x[1]])  # what ringspec.shard_sources hands down
        r.submit([1], [4])
        assert np.array_equal(r.get_arrays()["x"], x[1][4:5])

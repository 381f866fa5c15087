"""The ring with shard sources installed and dropped while it runs (remote datasets map a
shard when it arrives in the cache and release it after its last use)."""
from __future__ import annotations

import re
import sys
import threading
import time

import numpy as np
import pytest

from fastload.ring.ring import Ring


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
            k = 0
            while not stop.is_set():
                r.set_source(0, None)
                r.set_source(0, {"x": x[0]})
                # every other time a moment loaded: without it a loaded machine could keep
                # shard 0 dropped at every batch (CI once saw 0 of 300 succeed)
                k += 1
                if k % 2:
                    stop.wait(0.0002)

        t = threading.Thread(target=flip, name="fastload-test-flip")
        t.start()
        rng = np.random.default_rng(0)
        ok = failed = 0
        try:
            # at least 300 batches, more (up to a deadline) until one succeeded
            deadline = time.monotonic() + 60
            n = 0
            while n < 300 or (ok == 0 and time.monotonic() < deadline):
                n += 1
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


# -- ragged fields -------------------------------------------------------------------------
def _ragged(rng, rows=50, max_len=9, base=0):
    lens = rng.integers(0, max_len, rows)
    off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    return (np.arange(base, base + off[-1], dtype=np.int32), off)


def _want(pairs, shard, row, start=None, count=None):
    """(values, offsets) of a packed batch, in numpy."""
    items = []
    for i, (s, r) in enumerate(zip(shard, row)):
        v, o = pairs[s]
        x = v[o[r]:o[r + 1]]
        if start is not None:
            x = x[start[i]:]
            if count[i] >= 0:
                x = x[:count[i]]
        items.append(x)
    return np.concatenate(items), np.concatenate([[0], np.cumsum([len(x) for x in items])])


def _ragged_ring(pairs, x, **kw):
    from fastload.ring.ring import RaggedField

    return Ring({"x": (np.float32, (4,)), "tok": RaggedField(np.int32, capacity=kw.pop("capacity", 64))}, 8,
                {"x": x, "tok": pairs}, shard_rows=[50] * len(x), **kw)


def test_ragged_shards_installed_and_dropped():
    rng = np.random.default_rng(1)
    x = _shards()
    t = [_ragged(rng, base=1000 * s) for s in range(3)]
    with _ragged_ring([t[0], None, None], [x[0], None, None], threads=2) as r:
        r.submit([0, 0], [3, 9])
        b = r.get_arrays()
        want = _want(t, [0, 0], [3, 9])
        assert np.array_equal(b["tok"], want[0]) and np.array_equal(b["tok_offsets"], want[1])
        r.submit([0, 1], [1, 1])
        with pytest.raises(ValueError, match="shard 1 is not loaded"):
            r.get_arrays()
        with pytest.raises(ValueError, match="exactly the sourced fields"):
            r.set_source(1, {"x": x[1]})
        with pytest.raises(ValueError, match="shard 1: offsets hold 49 rows, the shard 50"):
            r.set_source(1, {"x": x[1], "tok": (t[1][0], t[1][1][:50])})
        with pytest.raises(ValueError, match="'tok' shard 1: a ragged field's source is a \\(values, offsets\\)"):
            r.set_source(1, {"x": x[1], "tok": t[1][0]})
        r.set_source(1, {"x": x[1], "tok": t[1]})
        r.set_source(2, {"x": x[2], "tok": t[2]})
        shard, row = [2, 1, 0, 1], [49, 0, 7, 33]
        r.submit(shard, row, start=[1, 0, 2, 0], count=[-1, 3, 1, 0])
        b = r.get_arrays()
        want = _want(t, shard, row, [1, 0, 2, 0], [-1, 3, 1, 0])
        assert np.array_equal(b["tok"], want[0]) and np.array_equal(b["tok_offsets"], want[1])
        assert np.array_equal(b["x"], np.stack([x[s][i] for s, i in zip(shard, row)]))
        a = t[2][0]
        before = sys.getrefcount(a)
        r.set_source(2, None)
        assert sys.getrefcount(a) == before - 1  # the ring let the values go
        r.submit([2], [0])
        with pytest.raises(ValueError, match="shard 2 is not loaded"):
            r.get_arrays()


@pytest.mark.parametrize("how", ["dropped", "replaced"])
def test_a_ragged_batch_planned_before_a_swap_is_not_copied_after_it(how):
    """A ragged batch is planned (its offsets read) in submit and copied when it gets a slot:
    a swap in between fails the batch naming the shard, never mixes two sources."""
    rng = np.random.default_rng(2)
    x = _shards()
    t = [_ragged(rng, base=1000 * s) for s in range(3)]
    other = _ragged(rng, base=5000)
    with _ragged_ring(t, x, threads=1, slots=1, max_slots=1) as r:
        fill = r.acquire()  # holds the only slot: the next batch is planned and waits
        r.submit([1, 0], [4, 4])
        r.set_source(1, None if how == "dropped" else {"x": x[1], "tok": other})
        fill.commit(1)
        r.get_arrays()
        with pytest.raises(ValueError, match=f"shard 1 was {how} \\(set_source\\) after the batch was planned"):
            r.get_arrays()
        if how == "replaced":  # batches planned after the swap read the new source
            r.submit([1, 0], [4, 4])
            got = r.get_arrays()["tok"]
            assert np.array_equal(got, _want([t[0], other], [1, 0], [4, 4])[0])


@pytest.mark.parametrize("padded", [False, True])
def test_ragged_swaps_while_batches_are_planned_and_gathered(padded):
    """Stress: shard 0's sources go A -> None -> B -> ... in one thread while another submits
    many batches (plans read the offsets) and producers gather them in parts. Every batch
    equals the batch gathered from A alone or from B alone, or fails naming shard 0."""
    from fastload.ring.ring import RaggedField

    rng = np.random.default_rng(3)
    rows = 300
    pair_a = _ragged(rng, rows, max_len=40, base=0)
    pair_b = _ragged(rng, rows, max_len=40, base=100_000)
    pair_1 = _ragged(rng, rows, max_len=40, base=200_000)
    xa, xb, x1 = (rng.standard_normal((rows, 4)).astype(np.float32) for _ in range(3))
    fields = {"x": (np.float32, (4,)), "tok": RaggedField(np.int32, padded=padded, pad_value=-1, capacity=2048)}
    stop = threading.Event()
    errors: list[BaseException] = []
    with Ring(fields, 96, {"x": [xa, x1], "tok": [pair_a, pair_1]}, shard_rows=[rows, rows], threads=2,
              min_part_bytes=1024) as r:

        def flip():
            try:
                while not stop.is_set():
                    r.set_source(0, None)
                    r.set_source(0, {"x": xb, "tok": pair_b})
                    r.set_source(0, {"x": xa, "tok": pair_a})
                    time.sleep(0.0002)  # some batches go through between swaps
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)

        th = threading.Thread(target=flip, name="fastload-test-flip")
        th.start()
        seen = {"a": 0, "b": 0, "failed": 0}
        try:
            deadline = time.monotonic() + 60
            done = 0  # at least 150 rounds, and until both outcomes were seen (a loaded machine)
            while done < 150 or (min(seen["a"] + seen["b"], seen["failed"]) < 5 and time.monotonic() < deadline):
                done += 1
                n = 4
                shard = rng.integers(0, 2, 96 * n)
                row = rng.integers(0, rows, 96 * n)
                r.submit_many(shard, row)
                for k in range(n):
                    s, w = shard[96 * k:96 * (k + 1)], row[96 * k:96 * (k + 1)]
                    try:
                        b = r.get_arrays()
                    except ValueError as e:
                        assert re.search(r"shard 0 (is not loaded|was dropped|was replaced)", str(e)), str(e)
                        seen["failed"] += 1
                        continue
                    got = (b["tok"].copy(), b["tok_offsets"].copy(), b["x"].copy())
                    del b
                    matched = None
                    for name, pa_, xx in (("a", pair_a, xa), ("b", pair_b, xb)):
                        v, o = _want([pa_, pair_1], s, w)
                        if padded:
                            width = int(np.diff(o).max())
                            pad = np.full((len(s), width), -1, np.int32)
                            for i in range(len(s)):
                                pad[i, :o[i + 1] - o[i]] = v[o[i]:o[i + 1]]
                            v = pad
                        xs = np.stack([(xx if q == 0 else x1)[i] for q, i in zip(s, w)])
                        if (got[0].shape == v.shape and np.array_equal(got[0], v) and np.array_equal(got[1], o)
                                and np.array_equal(got[2], xs)):
                            matched = name
                            break
                    assert matched is not None, "a batch mixes sources or is damaged"
                    seen[matched] += 1
        finally:
            stop.set()
            th.join()
        assert not errors
        assert seen["a"] + seen["b"] > 0 and seen["failed"] > 0, seen
        # with the flipping over, every batch succeeds
        r.set_source(0, {"x": xa, "tok": pair_a})
        r.submit_many(np.zeros(96, np.int64), np.arange(96))
        assert np.array_equal(r.get_arrays()["x"], xa[:96])

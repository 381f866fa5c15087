"""The ragged gather in C++: the kernel alone against numpy, then through the ring (split
parts, overflow past the slot region, copies, windows, external fills, errors)."""
import gc

import numpy as np
import pytest

from fastload import _C
from fastload.ring.ring import RaggedField, Ring


def _shards(rng, item=(), dtype=np.int32, nshards=3, rows=40, max_len=12):
    out = []
    for _ in range(nshards):
        lens = rng.integers(0, max_len, rows)
        lens[::7] = 0
        off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        vals = rng.integers(0, 1000, (int(off[-1]), *item)).astype(dtype)
        out.append((vals, off))
    return out


def reference(shards, shard, row, *, start=None, count=None, padded=False, pad=0, max_items=None, multiple=1):
    """The batch in pure numpy: each row's items (window, then truncation), packed or padded."""
    items = []
    for i, (s, r) in enumerate(zip(shard, row)):
        vals, off = shards[s]
        x = vals[off[r]:off[r + 1]]
        if start is not None:
            x = x[start[i]:]
        if count is not None and count[i] >= 0:
            x = x[:count[i]]
        if max_items is not None:
            x = x[:max_items]
        items.append(x)
    offsets = np.concatenate([[0], np.cumsum([len(x) for x in items])]).astype(np.int64)
    item_shape = shards[0][0].shape[1:]
    if not padded:
        return (np.concatenate(items) if items else np.empty((0, *item_shape), shards[0][0].dtype)), offsets
    width = max(len(x) for x in items)
    width = max(-(-width // multiple) * multiple, multiple if multiple > 1 else 0)
    out = np.full((len(items), width, *item_shape), pad, dtype=shards[0][0].dtype)
    for k, x in enumerate(items):
        out[k, :len(x)] = x
    return out, offsets


@pytest.mark.parametrize("dtype, item", [(np.int32, ()), (np.float32, (4,)), (np.uint8, ()), (np.float64, (2, 3)),
                                         (np.int16, ())])
@pytest.mark.parametrize("padded", [False, True])
def test_kernel_equals_numpy(dtype, item, padded):
    rng = np.random.default_rng(0)
    shards = _shards(rng, item, dtype)
    shard, row = rng.integers(0, 3, 64), rng.integers(0, 40, 64)
    kw = dict(dtype=np.dtype(dtype), item_shape=list(item))
    for max_items, multiple in [(None, 1), (5, 1), (None, 8), (3, 4)]:
        pad = np.asarray(7, dtype).tobytes() if padded else b""
        v, o = _C.gather_ragged(shards, shard, row, padded=padded, pad=pad,
                                max_items=-1 if max_items is None else max_items, multiple=multiple, **kw)
        rv, ro = reference(shards, shard, row, padded=padded, pad=7, max_items=max_items, multiple=multiple)
        assert v.dtype == rv.dtype and v.shape == rv.shape and v.tobytes() == rv.tobytes()
        assert np.array_equal(o, ro)


def test_kernel_windows_zero_length_rows_and_coalesced_runs():
    rng = np.random.default_rng(1)
    shards = _shards(rng)
    shard = np.array([0, 0, 0, 1, 2, 2, 0])
    row = np.array([1, 2, 3, 0, 7, 8, 5])  # consecutive rows: one copy each run
    start = np.array([0, 2, 0, 100, 1, 0, 3])  # 100: past the end -> zero items
    count = np.array([-1, 3, 0, 5, -1, 2, 1])
    v, o = _C.gather_ragged(shards, shard, row, start=start, count=count, dtype=np.dtype(np.int32))
    rv, ro = reference(shards, shard, row, start=start, count=count)
    assert np.array_equal(v, rv) and np.array_equal(o, ro)
    with pytest.raises(ValueError, match="window start -1 is negative"):
        _C.gather_ragged(shards, shard[:1], row[:1], start=np.array([-1]), dtype=np.dtype(np.int32))
    with pytest.raises(IndexError, match="sample 1: row 40 is out of range for shard 0"):
        _C.gather_ragged(shards, np.array([0, 0]), np.array([0, 40]), dtype=np.dtype(np.int32))


def test_kernel_refuses_offsets_past_the_values():
    vals = np.arange(5, dtype=np.int32)
    with pytest.raises(ValueError, match="do not fit its 5 items"):
        _C.gather_ragged([(vals, np.array([0, 2, 9], np.int64))], np.array([0, 0]), np.array([0, 1]),
                         dtype=np.dtype(np.int32))


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("capacity", [None, 5])  # 5: almost every batch overflows its slot region
def test_ring_batches_equal_numpy_with_split_parts_and_overflow(padded, capacity):
    rng = np.random.default_rng(2)
    shards = _shards(rng, (2,), np.float32, nshards=4, rows=300, max_len=40)
    x = [rng.standard_normal((300, 3)).astype(np.float32) for _ in range(4)]
    n, bs = 2000, 64
    shard, row = rng.integers(0, 4, n), rng.integers(0, 300, n)
    fields = {"x": (np.float32, (3,)), "r": RaggedField(np.float32, (2,), padded=padded, pad_value=-1.5,
                                                        capacity=capacity), "index": (np.int64, ())}
    with Ring(fields, bs, {"x": x, "r": shards}, index_field="index", threads=3, min_part_bytes=512) as ring:
        ring.submit_many(shard, row, index=np.arange(n))
        for k in range(0, n, bs):
            b = ring.get()
            sl = slice(k, k + bs)
            rv, ro = reference(shards, shard[sl], row[sl], padded=padded, pad=-1.5)
            assert b["r"].numpy().tobytes() == rv.tobytes() and tuple(b["r"].shape) == rv.shape
            assert np.array_equal(b["r_offsets"].numpy(), ro)
            assert np.array_equal(b["x"].numpy(), np.stack([x[s][r] for s, r in zip(shard[sl], row[sl])]))
            assert np.array_equal(b["index"].numpy(), np.arange(n)[sl])


def test_held_ragged_batches_stay_intact_through_growth_and_copies():
    rng = np.random.default_rng(3)
    shards = _shards(rng, nshards=1, rows=200)
    shard, row = np.zeros(200, np.int64), rng.permutation(200)
    with Ring({"r": RaggedField(np.int32)}, 10, {"r": shards}, threads=1, slots=2, max_slots=3) as ring:
        ring.submit_many(shard, row)
        held = [ring.get() for _ in range(20)]  # more than max_slots: the rest come as copies
        assert ring.stats()["copies"] > 0
        for k, b in enumerate(held):
            rv, ro = reference(shards, shard[k * 10:k * 10 + 10], row[k * 10:k * 10 + 10])
            assert np.array_equal(b["r"].numpy(), rv) and np.array_equal(b["r_offsets"].numpy(), ro)
        del held, b
        gc.collect()


def test_windows_through_the_ring_and_errors_for_one_batch_only():
    rng = np.random.default_rng(4)
    shards = _shards(rng, nshards=2)
    with Ring({"r": RaggedField(np.int32), "index": (np.int64, ())}, 8, {"r": shards}, index_field="index",
              threads=2) as ring:
        ring.submit([0, 1, 1], [3, 4, 5], index=[0, 1, 2], start=[1, 0, 2], count=[2, -1, 1])
        ring.submit([0, 0], [1, 99], index=[3, 4])  # row 99 does not exist
        ring.submit([1], [0], index=[5])
        b = ring.get()
        rv, ro = reference(shards, [0, 1, 1], [3, 4, 5], start=[1, 0, 2], count=[2, -1, 1])
        assert np.array_equal(b["r"].numpy(), rv) and np.array_equal(b["r_offsets"].numpy(), ro)
        with pytest.raises(IndexError, match="batch 1, sample 1: row 99 is out of range for shard 0"):
            ring.get()
        assert ring.get()["index"].tolist() == [5]
        with pytest.raises(ValueError, match="start has 1 entries for 2 rows"):
            ring.submit([0, 0], [1, 2], index=[0, 1], start=[0])


def test_external_fill_gathers_ragged_fields_beside_written_ones():
    rng = np.random.default_rng(5)
    shards = _shards(rng, nshards=1)
    fields = {"r": RaggedField(np.int32, padded=True, pad_value=-1), "img": (np.uint8, (2,)),
              "index": (np.int64, ())}
    with Ring(fields, 4, {"r": shards}, index_field="index", threads=1) as ring:
        with ring.acquire() as slot:
            assert set(slot.arrays) == {"img", "index"}  # the ring writes the ragged field itself
            slot.gather([0, 0, 0], [2, 0, 9], index=[10, 11, 12])
            slot.arrays["img"][:3] = 5
            slot.commit(3)
        b = ring.get()
        rv, ro = reference(shards, [0, 0, 0], [2, 0, 9], padded=True, pad=-1)
        assert np.array_equal(b["r"].numpy(), rv) and np.array_equal(b["r_offsets"].numpy(), ro)
        assert b["img"].tolist() == [[5, 5]] * 3 and b["index"].tolist() == [10, 11, 12]


def test_ragged_field_arguments_are_checked():
    vals, off = np.arange(4, dtype=np.int32), np.array([0, 4], np.int64)
    with pytest.raises(ValueError, match="pad_value=300 is not a value of dtype uint8"):
        Ring({"r": RaggedField(np.uint8, padded=True, pad_value=300)}, 2, {"r": [(vals.astype(np.uint8), off)]})
    with pytest.raises(ValueError, match="offsets must be a contiguous 1-d int64"):
        Ring({"r": RaggedField(np.int32)}, 2, {"r": [(vals, off.astype(np.int32))]})
    with pytest.raises(ValueError, match="multiple=0 must be an int >= 1"):
        Ring({"r": RaggedField(np.int32, multiple=0)}, 2, {"r": [(vals, off)]})
    with pytest.raises(ValueError, match="'r_offsets'.*also a field name"):
        Ring({"r": RaggedField(np.int32), "r_offsets": (np.int64, ())}, 2, {"r": [(vals, off)]})


def _positions_reference(shards, shard, row, start, count):
    """Each gathered item's place in its sample: the window start, then one more per item."""
    out = []
    for s, r, st, c in zip(shard, row, start, count):
        off = shards[s][1]
        n = int(off[r + 1] - off[r])
        first = min(st, n)
        k = n - first if c < 0 else min(n - first, c)
        out.append(np.arange(first, first + k))
    return np.concatenate(out).astype(np.int64) if out else np.empty(0, np.int64)


@pytest.mark.parametrize("capacity", [None, 7])  # 7: most batches overflow into memory of their own
def test_positions_of_windows_in_slots_own_memory_copies_and_split_parts(capacity):
    """A packed field with positions=True: the producers write each item's position in its
    sample beside the items — in the slot, in a batch's own memory past the slot region, in
    the copies of batches delivered while the caller holds every slot, and split across
    producer threads; batches of varying sizes submitted as one run (submit_sizes)."""
    rng = np.random.default_rng(6)
    shards = _shards(rng, nshards=3, rows=60, max_len=30)
    n = 600
    shard, row = rng.integers(0, 3, n), rng.integers(0, 60, n)
    start, count = rng.integers(0, 12, n), rng.integers(-1, 9, n)
    sizes = rng.integers(1, 17, 80)
    sizes = sizes[np.cumsum(sizes) <= n]
    m = int(sizes.sum())
    fields = {"r": RaggedField(np.int32, capacity=capacity, positions=True), "index": (np.int64, ())}
    with Ring(fields, 16, {"r": shards}, index_field="index", threads=3, slots=2, max_slots=3,
              min_part_bytes=64) as ring:
        assert ring.submit_sizes(shard[:m], row[:m], sizes, index=np.arange(m), start=start[:m],
                                 count=count[:m]) == len(sizes)
        held = [ring.get() for _ in sizes]  # more than max_slots held: later ones are copies
        assert ring.stats()["copies"] > 0
        a = 0
        for k, b in enumerate(held):
            sl = slice(a, a + sizes[k])
            rv, ro = reference(shards, shard[sl], row[sl], start=start[sl], count=count[sl])
            assert np.array_equal(b["r"].numpy(), rv) and np.array_equal(b["r_offsets"].numpy(), ro), k
            want = _positions_reference(shards, shard[sl], row[sl], start[sl], count[sl])
            assert b["r_positions"].dtype.itemsize == 8 and np.array_equal(b["r_positions"].numpy(), want), k
            assert b["index"].tolist() == list(range(a, a + sizes[k]))
            a += sizes[k]
        del held, b
        gc.collect()
    with pytest.raises(ValueError, match="positions are delivered for a packed field"):
        Ring({"r": RaggedField(np.int32, padded=True, positions=True)}, 2, {"r": shards})
    with pytest.raises(ValueError, match="sizes must be between 1 and batch_size=2"):
        with Ring({"r": RaggedField(np.int32)}, 2, {"r": shards}) as ring:
            ring.submit_sizes([0, 0, 0], [1, 2, 3], [3])

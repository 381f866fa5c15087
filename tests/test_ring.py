"""Tests of the C++ ring buffer (fastload._C) through its Python face (fastload.ring.ring.Ring).

Sources are plain numpy arrays split into shards, exactly what Dataset.column() hands the
ring; the expected bytes of every batch come from numpy fancy indexing of the same data.
"""
from __future__ import annotations

import gc
import logging
import signal
import sys
import threading
import weakref
import _thread

import numpy as np
import pytest
import torch

from fastload.ring.ring import FillSlot, Ring

FIELDS = {
    "x": (np.float32, (784,)),
    "y": (np.int64, ()),
    "img": (np.uint8, (3, 32, 32)),
}


def make_data(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((n, 784), dtype=np.float32),
        "y": rng.integers(-(2**62), 2**62, n, dtype=np.int64),
        "img": rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8),
    }


def split(data: dict[str, np.ndarray], sizes: list[int]) -> dict[str, list[np.ndarray]]:
    """Per-field shard arrays (read-only views, like memory-mapped Arrow columns)."""
    cuts = np.cumsum(sizes)[:-1]
    out = {}
    for k, v in data.items():
        parts = np.split(v, cuts)
        for p in parts:
            p.flags.writeable = False
        out[k] = parts
    return out


def locate(sizes: list[int], indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Global index -> (shard, row), as Dataset.locate does."""
    starts = np.concatenate([[0], np.cumsum(sizes)])
    shard = np.searchsorted(starts, indices, side="right") - 1
    return shard.astype(np.int64), (indices - starts[shard]).astype(np.int64)


def batches_of(order: np.ndarray, batch_size: int) -> list[np.ndarray]:
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def slot_of(ring: Ring, t: torch.Tensor) -> int | None:
    """The ring slot whose memory holds tensor `t`, or None (a copy)."""
    for i in range(ring.num_slots):
        mem = ring._core.slot_memory(i)
        start = mem.ctypes.data
        if start <= t.data_ptr() < start + mem.nbytes:
            return i
    return None


def assert_batch(batch: dict, data: dict[str, np.ndarray], idx: np.ndarray) -> None:
    assert set(batch) == set(data)
    for k, v in data.items():
        t = batch[k]
        assert isinstance(t, torch.Tensor)
        assert tuple(t.shape) == (len(idx),) + v.shape[1:], k
        assert t.numpy().tobytes() == v[idx].tobytes(), f"field {k!r} differs"


@pytest.fixture
def shards():
    sizes = [500, 317, 183]
    data = make_data(sum(sizes))
    return sizes, data, split(data, sizes)


def test_every_row_in_order_across_shards_with_partial_last_batch(shards):
    sizes, data, sources = shards
    order = np.random.default_rng(1).permutation(sum(sizes))
    bs = 64
    expected = batches_of(order, bs)
    assert len(expected[-1]) == 1000 % 64  # a partial last batch
    with Ring(FIELDS, bs, sources, threads=2, slots=3) as ring:
        for idx in expected:
            ring.submit(*locate(sizes, idx))
        assert ring.pending == len(expected)
        got = 0
        for batch, idx in zip(ring, expected):
            assert_batch(batch, data, idx)
            got += 1
        assert got == len(expected) and ring.pending == 0
        s = ring.stats()
        assert s["delivered"] == len(expected) and s["grown"] == 0 and s["copies"] == 0


def test_dtypes_and_zero_copy_view(shards):
    sizes, data, sources = shards
    with Ring(FIELDS, 8, sources, threads=1, slots=2) as ring:
        ring.submit(*locate(sizes, np.arange(8)))
        arrays = ring.get_arrays()
        assert {k: a.dtype for k, a in arrays.items()} == {k: np.dtype(d) for k, (d, _) in FIELDS.items()}
        assert all(a.flags.c_contiguous and a.flags.writeable for a in arrays.values())
        ring.submit(*locate(sizes, np.arange(8, 16)))
        batch = ring.get()
        # The tensors and the slot are one piece of memory: no copy on the way out.
        assert type(arrays["x"].base).__name__ == "SlotLease"
        assert slot_of(ring, batch["x"]) is not None
        assert slot_of(ring, batch["x"]) == slot_of(ring, batch["img"]) != slot_of(ring, torch.from_numpy(arrays["y"]))
        assert batch["y"].dtype == torch.int64 and batch["img"].dtype == torch.uint8


def test_many_small_batches_with_split_parts_keep_order(shards):
    """Several producers, batches split into several parts: still strictly in order."""
    sizes, data, sources = shards
    order = np.random.default_rng(2).permutation(sum(sizes))
    with Ring(FIELDS, 50, sources, threads=4, slots=3, min_part_bytes=1) as ring:
        for idx in batches_of(order, 50):
            ring.submit(*locate(sizes, idx))
        for idx in batches_of(order, 50):
            assert_batch(ring.get(), data, idx)
    with Ring(FIELDS, 1, sources, threads=3, slots=4) as ring:
        for i in order[:300]:
            ring.submit(*locate(sizes, np.array([i])))
        for i in order[:300]:
            assert_batch(ring.get(), data, np.array([i]))


def test_sequential_runs_crossing_shard_boundaries(shards):
    """Unshuffled batches hit the run-coalescing path, including runs cut by a shard edge."""
    sizes, data, sources = shards
    order = np.arange(sum(sizes))
    with Ring(FIELDS, 96, sources, threads=2) as ring:
        for idx in batches_of(order, 96):
            ring.submit(*locate(sizes, idx))
        for idx in batches_of(order, 96):
            assert_batch(ring.get(), data, idx)
        # A batch with repeats and a run broken by a repeated row.
        idx = np.array([499, 500, 501, 501, 502, 0, 1, 999, 999])
        ring.submit(*locate(sizes, idx))
        assert_batch(ring.get(), data, idx)


def test_workload_larger_than_the_ring_recycles_slots_without_growing(shards):
    sizes, data, sources = shards
    rng = np.random.default_rng(3)
    order = np.concatenate([rng.permutation(sum(sizes)) for _ in range(3)])  # 3 epochs
    expected = batches_of(order, 10)  # 300 batches through 3 slots
    with Ring(FIELDS, 10, sources, threads=2, slots=3) as ring:
        for idx in expected:
            ring.submit(*locate(sizes, idx))
        for batch, idx in zip(ring, expected):  # the loop holds one batch during get()
            assert_batch(batch, data, idx)
        s = ring.stats()
        assert s["delivered"] == 300 and s["slots"] == 3 and s["grown"] == 0 and s["copies"] == 0


def test_held_batch_never_changes(shards):
    sizes, data, sources = shards
    order = np.random.default_rng(4).permutation(sum(sizes))
    expected = batches_of(order, 16)
    with Ring(FIELDS, 16, sources, threads=2, slots=3) as ring:
        for idx in expected:
            ring.submit(*locate(sizes, idx))
        held = ring.get()
        held_slice = held["img"][3:9]  # a view derived from the batch also pins the slot
        before = {k: v.numpy().tobytes() for k, v in held.items()}
        held_slot = slot_of(ring, held["x"])
        del held["x"], held["y"]  # some tensors of the batch dropped, others kept
        for idx in expected[1:]:
            assert_batch(ring.get(), data, idx)
            assert held["img"].numpy().tobytes() == before["img"]
        assert held_slice.numpy().tobytes() == data["img"][expected[0][3:9]].tobytes()
        assert ring.stats()["in_use"] == 1  # only the held batch's slot
        del held
        assert ring.stats()["in_use"] == 1  # the slice still holds it
        del held_slice
        s = ring.stats()
        assert s["in_use"] == 0 and s["free"] == s["slots"]
        assert held_slot is not None


def test_ring_grows_then_copies_when_user_holds_every_batch(shards, caplog):
    sizes, data, sources = shards
    order = np.random.default_rng(5).permutation(sum(sizes))
    expected = batches_of(order, 20)[:12]
    with Ring(FIELDS, 20, sources, threads=2, slots=2, max_slots=5) as ring:
        for idx in expected:
            ring.submit(*locate(sizes, idx))
        with caplog.at_level(logging.WARNING, logger="fastload.ring.ring"):
            kept = [ring.get() for _ in expected]  # never deadlocks, never overwrites
        views = [slot_of(ring, b["img"]) for b in kept]
        assert None not in views[:4] and len(set(views[:4])) == 4  # 4 distinct slots
        assert views[4:] == [None] * (len(expected) - 4)  # then copies
        s = ring.stats()
        assert s["slots"] == 5 and s["grown"] == 3
        assert s["copies"] == len(expected) - (5 - 1)  # the cap keeps one slot for producers
        assert "delivered as copies" in caplog.text
        for batch, idx in zip(kept, expected):
            assert_batch(batch, data, idx)
        del kept, batch
        gc.collect()
        s = ring.stats()
        assert s["in_use"] == 0 and s["free"] == 5
        # With the slots back, batches are zero-copy again.
        ring.submit(*locate(sizes, expected[0]))
        b = ring.get()
        assert slot_of(ring, b["x"]) is not None
        assert_batch(b, data, expected[0])


def test_producer_errors_reach_get_for_that_batch_only(shards):
    sizes, data, sources = shards
    with Ring(FIELDS, 4, sources, threads=2) as ring:
        good = np.array([1, 2, 3, 4])
        ring.submit(*locate(sizes, good))
        ring.submit(np.array([0, 1, 1]), np.array([0, 5, 317]))  # row 317 of a 317-row shard
        ring.submit(np.array([0, 7]), np.array([0, 0]))  # no shard 7
        ring.submit(np.array([2]), np.array([-1]))
        ring.submit(*locate(sizes, good + 10))
        assert_batch(ring.get(), data, good)
        with pytest.raises(IndexError, match=r"batch 1, sample 2: row 317 is out of range for shard 1 \(317 rows\)"):
            ring.get()
        with pytest.raises(IndexError, match=r"shard 7 is out of range \(the ring has 3 shards\)"):
            ring.get()
        with pytest.raises(IndexError, match=r"row -1 is out of range for shard 2"):
            ring.get()
        assert_batch(ring.get(), data, good + 10)
        s = ring.stats()
        assert s["free"] + s["in_use"] == s["slots"] and s["in_use"] <= 1


def test_submit_validates_arguments(shards):
    sizes, _, sources = shards
    with Ring(FIELDS, 4, sources, threads=1, slots=2) as ring:
        with pytest.raises(ValueError, match="shard must be an integer array, got dtype float64"):
            ring.submit(np.zeros(2), np.zeros(2, np.int64))
        with pytest.raises(ValueError, match="same length"):
            ring.submit(np.zeros(2, np.int64), np.zeros(3, np.int64))
        with pytest.raises(ValueError, match="between 1 and batch_size=4 rows, got 5"):
            ring.submit(np.zeros(5, np.int64), np.zeros(5, np.int64))
        with pytest.raises(ValueError, match="got 0"):
            ring.submit(np.zeros(0, np.int64), np.zeros(0, np.int64))
        with pytest.raises(ValueError, match="row must be 1-D"):
            ring.submit(np.zeros(2, np.int64), np.zeros((2, 1), np.int64))
        ring.submit(np.array([0, 0], np.int32), [3, 4])  # any integer dtype / list is fine
        assert ring.get()["y"].numpy().tobytes() == sources["y"][0][[3, 4]].tobytes()
        assert ring.stats()["submitted"] == 1


def test_constructor_validates_fields_and_sources(shards):
    sizes, data, sources = shards
    with pytest.raises(ValueError, match=r"field 'x' shard 1: source dtype float64 != field dtype float32"):
        Ring(FIELDS, 4, {**sources, "x": [sources["x"][0], sources["x"][1].astype(np.float64), sources["x"][2]]})
    with pytest.raises(ValueError, match=r"field 'img' shard 0: source shape \(500, 3, 32, 31\)"):
        Ring(FIELDS, 4, {**sources, "img": [np.zeros((500, 3, 32, 31), np.uint8)] + sources["img"][1:]})
    with pytest.raises(ValueError, match=r"field 'x' shard 0: source must be C-contiguous"):
        Ring(FIELDS, 4, {**sources, "x": [np.asfortranarray(sources["x"][0])] + sources["x"][1:]})
    with pytest.raises(ValueError, match="field 'y' has shard sizes"):
        Ring(FIELDS, 4, {**sources, "y": sources["y"][:2]})
    with pytest.raises(ValueError, match=r"sources has fields \['z'\]"):
        Ring(FIELDS, 4, {**sources, "z": [data["y"]]})
    with pytest.raises(ValueError, match="batch_size=0 must be an int > 0"):
        Ring(FIELDS, 0, sources)
    with pytest.raises(ValueError, match="threads=0"):
        Ring(FIELDS, 4, sources, threads=0)
    with pytest.raises(ValueError, match="max_slots=2 must be an int >= slots=3"):
        Ring(FIELDS, 4, sources, slots=3, max_slots=2)
    with pytest.raises(ValueError, match="field 'q': 'nope' is not a numpy dtype"):
        Ring({"q": ("nope", ())}, 4)
    with pytest.raises(ValueError, match="need a 8,000,000,000,000,000-byte slot; lower batch_size"):
        Ring({"x": (np.uint8, (1000,))}, 8 * 10**12)  # checked before any allocation
    with pytest.raises(ValueError, match="index_field='y' must be an int64 scalar field without sources"):
        Ring(FIELDS, 4, sources, index_field="y")
    with pytest.raises(ValueError, match="field 'img' has no sources"):
        with Ring(FIELDS, 4, {"x": sources["x"], "y": sources["y"]}, threads=1) as ring:
            ring.submit([0], [0])


def test_memory_mapped_and_bool_sources(tmp_path):
    n = 300
    rng = np.random.default_rng(6)
    feats = rng.standard_normal((n, 5, 7)).astype(np.float16)
    path = tmp_path / "feats.bin"
    feats.tofile(path)
    mm = np.memmap(path, dtype=np.float16, mode="r", shape=(n, 5, 7))
    flags = rng.integers(0, 2, n).astype(bool)
    fields = {"f": (np.float16, (5, 7)), "b": (np.bool_, ())}
    idx = rng.permutation(n)[:128]
    with Ring(fields, 128, {"f": [mm], "b": [flags]}, threads=2) as ring:
        ring.submit(np.zeros(128, np.int64), idx)
        batch = ring.get()
        assert batch["f"].numpy().tobytes() == feats[idx].tobytes()
        assert batch["b"].dtype == torch.bool and np.array_equal(batch["b"].numpy(), flags[idx])
    del mm


def test_external_fill_keeps_order_with_submitted_batches(shards):
    sizes, data, sources = shards
    with Ring(FIELDS, 8, sources, threads=2, slots=3) as ring:
        ring.submit(*locate(sizes, np.arange(8)))
        slot = ring.acquire()
        assert isinstance(slot, FillSlot)
        assert slot.arrays["x"].shape == (8, 784) and slot.arrays["img"].shape == (8, 3, 32, 32)
        ring.submit(*locate(sizes, np.arange(8, 16)))
        # Fill 5 rows by hand: labels through the torch view, the rest through numpy.
        slot.tensors["y"][:5] = torch.arange(100, 105)
        slot.arrays["x"][:5] = 1.5
        slot.arrays["img"][:5] = 7
        slot.commit(5)
        with pytest.raises(RuntimeError, match="already committed"):
            slot.commit(5)
        assert_batch(ring.get(), data, np.arange(8))
        b = ring.get()
        assert b["y"].tolist() == [100, 101, 102, 103, 104]
        assert (b["x"] == 1.5).all() and b["x"].shape == (5, 784) and (b["img"] == 7).all()
        assert_batch(ring.get(), data, np.arange(8, 16))


def test_external_fill_gather_mixes_gathered_and_written_fields(shards):
    sizes, data, sources = shards
    # "img" has no source: it is what an image decoder would write into the slot.
    fields = {"y": FIELDS["y"], "img": FIELDS["img"]}
    with Ring(fields, 6, {"y": sources["y"]}, threads=1, slots=2) as ring:
        idx = np.array([999, 3, 500, 42])
        with ring.acquire() as slot:
            slot.gather(*locate(sizes, idx))
            slot.arrays["img"][: len(idx)] = data["img"][idx]
            slot.commit(len(idx))
        b = ring.get()
        assert b["y"].numpy().tobytes() == data["y"][idx].tobytes()
        assert b["img"].numpy().tobytes() == data["img"][idx].tobytes()
        with ring.acquire() as slot:
            with pytest.raises(IndexError, match="row 5000 is out of range for shard 0"):
                slot.gather(np.array([0]), np.array([5000]))
            slot.fail("decoder exploded on sample 17")
        with pytest.raises(RuntimeError, match="decoder exploded on sample 17"):
            ring.get()


def test_external_fill_errors_reach_the_consumer(shards):
    sizes, data, sources = shards
    with Ring(FIELDS, 4, sources, threads=1, slots=2) as ring:
        with pytest.raises(ZeroDivisionError) as inside:
            with ring.acquire():
                1 / 0  # noqa: B018  (raises)
        with pytest.raises(ZeroDivisionError, match="division by zero") as e:  # the block's own error
            ring.get()
        assert e.value is inside.value
        slot = ring.acquire()
        del slot  # dropped without commit(): the consumer gets an error, not a hang
        with pytest.raises(RuntimeError, match="dropped without commit"):
            ring.get()
        ring.submit(*locate(sizes, np.arange(4)))
        assert_batch(ring.get(), data, np.arange(4))
        with pytest.raises(ValueError, match="rows must be between 1 and batch_size=4"):
            ring.acquire().commit(5)  # (the handle is then dropped: an error batch)
        with pytest.raises(RuntimeError):
            ring.get()


def test_written_fill_views_pin_the_slot_after_commit(shards):
    sizes, data, sources = shards
    with Ring(FIELDS, 4, sources, threads=1, slots=2) as ring:
        slot = ring.acquire()
        kept = slot.arrays["y"]  # the filler keeps a view past commit
        kept[:] = [1, 2, 3, 4]
        slot.commit(4)
        b = ring.get()
        del b
        assert ring.stats()["in_use"] == 1  # still held through `kept`
        del kept
        assert ring.stats()["in_use"] == 0


def test_get_with_nothing_pending_and_use_after_close(shards):
    sizes, _, sources = shards
    ring = Ring(FIELDS, 4, sources, threads=2)
    with pytest.raises(RuntimeError, match="no batch is pending"):
        ring.get()
    ring.submit([0], [0])
    batch = ring.get()
    ring.close()
    ring.close()  # idempotent
    assert ring.closed
    with pytest.raises(RuntimeError, match="closed"):
        ring.submit([0], [0])
    with pytest.raises(RuntimeError, match="closed"):
        ring.get()
    with pytest.raises(RuntimeError, match="closed"):
        ring.acquire()
    # A batch returned before close() stays valid.
    assert batch["y"].numpy().tobytes() == sources["y"][0][:1].tobytes()


def test_early_break_and_close_join_all_threads(shards):
    """The conftest fixture fails this test if any producer thread survives."""
    sizes, data, sources = shards
    order = np.random.default_rng(7).permutation(sum(sizes))
    with Ring(FIELDS, 32, sources, threads=3) as ring:
        for idx in batches_of(order, 32):
            ring.submit(*locate(sizes, idx))
        for i, _batch in enumerate(ring):
            if i == 2:
                break
    assert ring.closed and ring.pending == len(batches_of(order, 32)) - 3


def test_del_and_gc_join_threads_even_with_batches_held(shards):
    sizes, data, sources = shards
    ring = Ring(FIELDS, 16, sources, threads=2)
    for idx in batches_of(np.arange(160), 16):
        ring.submit(*locate(sizes, idx))
    held = ring.get()
    del ring  # pending work and a held batch: threads must still stop now
    gc.collect()
    assert_batch(held, data, np.arange(16))  # the held batch outlives its ring


def test_exception_inside_loop_closes_ring(shards):
    sizes, data, sources = shards
    with pytest.raises(KeyError):
        with Ring(FIELDS, 16, sources, threads=2) as ring:
            for idx in batches_of(np.arange(320), 16):
                ring.submit(*locate(sizes, idx))
            for batch in ring:
                batch["missing"]
    assert ring.closed


def test_ctrl_c_interrupts_a_blocked_get(shards):
    sizes, data, sources = shards
    with Ring(FIELDS, 4, sources, threads=1, slots=2) as ring:
        slot = ring.acquire()  # never committed: the next get() would wait forever
        # Ctrl-C every 0.2 s until get() raises: a single simulated Ctrl-C can be consumed by
        # Python code that swallows exceptions (a finalizer run by the GC between the timer
        # and the wait). The handler turns an interrupt into KeyboardInterrupt only inside the
        # ring's get path (not in a finalizer, not in this test's own code), and only once: a
        # later interrupt already on its way (while the first one propagates, or while the
        # interrupter stops) is ignored instead of aborting the test run. It is installed for
        # this test also because a process started as a background job of a non-interactive
        # shell (CI runners do this) inherits SIGINT ignored, where interrupt_main() does nothing.
        done = threading.Event()
        ring_file = sys.modules[Ring.__module__].__file__

        def on_sigint(signum, frame):
            code = frame.f_code if frame is not None else None
            if done.is_set() or code is None or code.co_filename != ring_file or code.co_name == "__del__":
                return
            done.set()
            raise KeyboardInterrupt

        previous = signal.signal(signal.SIGINT, on_sigint)

        def interrupter():
            while not done.wait(0.2):
                _thread.interrupt_main()

        t = threading.Thread(target=interrupter, daemon=True)
        t.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                ring.get()
        finally:
            done.set()
            t.join()
            signal.signal(signal.SIGINT, previous)  # (runs a pending interrupt's handler first: ignored)
        slot.commit(1)
        ring.get()  # the ring still works after the interrupt


def test_index_field_travels_with_the_batch(shards):
    """The int64 index field receives the indices given to submit() / FillSlot.gather(), in
    the slot, so batch["index"] needs no separate copy."""
    sizes, data, sources = shards
    fields = {**FIELDS, "index": (np.int64, ())}
    order = np.random.default_rng(3).permutation(sum(sizes))
    with Ring(fields, 64, sources, index_field="index", threads=2) as ring:
        ring.submit_many(*locate(sizes, order), index=order)
        got = []
        for idx in batches_of(order, 64):
            b = ring.get()
            assert b["index"].dtype == torch.int64 and np.array_equal(b["index"].numpy(), idx)
            assert b["x"].numpy().tobytes() == data["x"][idx].tobytes()
            got.append(b["index"].numpy().copy())
        assert np.array_equal(np.concatenate(got), order)
        with pytest.raises(ValueError, match="needs index="):
            ring.submit(*locate(sizes, order[:4]))
        with ring.acquire() as slot:
            slot.gather(*locate(sizes, order[:3]), index=order[:3] + 7)
            slot.commit(3)
        assert ring.get()["index"].tolist() == (order[:3] + 7).tolist()
    with Ring(FIELDS, 4, sources) as ring, pytest.raises(ValueError, match="needs a ring with an index_field"):
        ring.submit([0], [0], index=[5])


def test_submit_indices_locates_in_cpp_as_dataset_locate_does():
    """Global indices -> batches, the ring locating them from its rows per shard (empty
    shards included): the same rows and index field as locate() + submit_many(); an index
    out of range raises naming it and submits nothing; without an index field too."""
    sizes = [500, 0, 317, 1, 0, 182]
    data = make_data(sum(sizes))
    sources = split(data, sizes)
    fields = {**FIELDS, "index": (np.int64, ())}
    order = np.random.default_rng(4).permutation(sum(sizes))
    order[:3] = [500, 817, 999]  # the first row of a shard after empty ones, a one-row shard, the last row
    with Ring(fields, 64, sources, index_field="index", threads=2) as ring:
        assert ring.submit_indices(order, 50) == 20
        for idx in batches_of(order, 50):
            b = ring.get()
            assert np.array_equal(b["index"].numpy(), idx)
            assert_batch({k: v for k, v in b.items() if k != "index"}, data, idx)
        for bad in (-1, sum(sizes)):
            with pytest.raises(IndexError, match=f"sample index {bad} is out of range"):
                ring.submit_indices(np.array([3, bad, 4]))
        assert ring.pending == 0
        with pytest.raises(ValueError, match="batch_size"):
            ring.submit_indices(order, 65)
    one = {k: [v] for k, v in make_data(40).items()}
    with Ring(FIELDS, 8, one) as ring:  # one shard, no index field
        ring.submit_indices(np.arange(39, -1, -1))
        got = np.concatenate([b["y"].numpy() for b in ring])
    assert np.array_equal(got, one["y"][0][::-1])


def test_a_failed_fill_raises_its_own_exception_for_that_batch(shards):
    """fail(exception) hands the very exception to the consumer (typed, not a string)."""
    sizes, data, sources = shards

    class Boom(Exception):
        pass

    with Ring({"y": FIELDS["y"]}, 4, {"y": sources["y"]}, threads=1, slots=2) as ring:
        err = Boom("sample 3 is bad")
        ring.acquire().fail(err)
        ring.submit([0], [1])
        with pytest.raises(Boom) as e:
            ring.get()
        assert e.value is err and str(e.value) == "sample 3 is bad"
        assert ring.get()["y"].numpy().tobytes() == sources["y"][0][1:2].tobytes()
        # nothing is kept once the batch is delivered...
        gone = weakref.ref(err)
        del err, e
        gc.collect()
        assert gone() is None
        # ...or dropped by drain() (any BaseException: a feeder thread's too)
        dropped = Boom("dropped by drain")
        ring.acquire().fail(dropped)
        ring.acquire().fail(KeyboardInterrupt())
        gone = weakref.ref(dropped)
        del dropped
        assert ring.drain() and ring.pending == 0
        gc.collect()
        assert gone() is None


def test_a_failed_fill_is_kept_apart_from_later_batches_and_freed_at_close(shards):
    sizes, data, sources = shards

    class Boom(Exception):
        pass

    ring = Ring({"y": FIELDS["y"]}, 4, {"y": sources["y"]}, threads=1, slots=3)
    a, b = Boom("first"), Boom("second")
    for err in (a, b):
        ring.acquire().fail(err)
    ring.submit([0], [2])
    with pytest.raises(Boom, match="first"):
        ring.get()
    with pytest.raises(Boom, match="second") as e:
        ring.get()
    assert e.value is b and ring.get()["y"].numpy().tobytes() == sources["y"][0][2:3].tobytes()
    del e, err
    kept = Boom("never delivered")
    ring.acquire().fail(kept)
    refs = [weakref.ref(x) for x in (a, b, kept)]
    del a, b, kept
    ring.close()
    gc.collect()
    assert [r() for r in refs] == [None, None, None]


def test_an_abandoned_ring_whose_fill_error_refers_to_it_is_collected(shards):
    """The binding keeps a failed fill's exception for the consumer; an exception that
    reaches back to the ring (its traceback's frames often do) must not keep it alive
    forever: the garbage collector sees the reference and the ring's threads end."""
    sizes, data, sources = shards

    class Boom(Exception):
        pass

    ring = Ring({"y": FIELDS["y"]}, 4, {"y": sources["y"]}, threads=2, slots=2)
    err = Boom("refers to its ring")
    err.ring = ring  # a cycle through the C++ side
    ring.acquire().fail(err)
    alive = weakref.ref(ring)
    del ring, err
    gc.collect()
    assert alive() is None  # (the conftest fixture checks that its producer threads ended)


def test_gather_kernel_alone_equals_numpy():
    """fastload._C.gather_rows is the ring's kernel without the ring: rows of per-shard
    sources into destination arrays, runs coalesced, every row checked first."""
    from fastload import _C

    rng = np.random.default_rng(5)
    sizes = [7, 1, 30, 12]
    data = {"a": rng.standard_normal((50, 3, 5)).astype(np.float32), "b": rng.integers(0, 9, 50).astype(np.int8)}
    srcs = split(data, sizes)
    order = np.concatenate([np.arange(10, 22), rng.permutation(50)[:20], [49, 0]])  # a run, then random
    shard, row = locate(sizes, order)
    out = [np.full((len(order), 3, 5), np.nan, np.float32), np.zeros(len(order), np.int8),
           np.zeros(len(order), np.int64)]
    _C.gather_rows(out, [srcs["a"], srcs["b"], None], shard, row, order, 2)
    assert out[0].tobytes() == data["a"][order].tobytes()
    assert np.array_equal(out[1], data["b"][order]) and np.array_equal(out[2], order)
    before = [o.copy() for o in out]
    bad_row = row.copy()
    bad_row[5] = sizes[shard[5]]
    with pytest.raises(IndexError, match=rf"sample 5: row {sizes[shard[5]]} is out of range for shard {shard[5]}"):
        _C.gather_rows(out, [srcs["a"], srcs["b"], None], shard, bad_row, order, 2)
    assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(out, before))  # nothing copied



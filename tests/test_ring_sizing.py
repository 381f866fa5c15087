"""One sizing policy (issue 31): fastload/ring/size.py is the one home of the threads, the
prefetch, the slot count and the slot bytes, and a Ring alone, a Loader and doctor all use it."""
from __future__ import annotations

import numpy as np
import pytest

import fastload
from fastload.ring import size


def _raw(path, n=100):
    with fastload.ShardWriter(path, {"x": "float32[300]", "y": "int16[3]"}) as w:
        w.write_batch({"x": np.zeros((n, 300), np.float32), "y": np.zeros((n, 3), np.int16)})
    return path


def test_slots_are_batches_in_flight_plus_two_for_a_ring_alone_and_a_loader(tmp_path):
    assert [size.ring_slots(k) for k in (0, 1, 2, 5, 8)] == [3, 3, 4, 7, 10]
    assert all(size.default_slots(t) == size.ring_slots(t + 1) == t + 3 for t in range(1, 9))
    with fastload.Loader(_raw(tmp_path / "ds"), batch_size=16, prefetch=3) as lo:
        next(iter(lo))
        assert lo.options.slots == size.ring_slots(3) == lo.stats()["ring"]["slots"]


@pytest.mark.parametrize("batch_size", [1, 7, 16, 100])
def test_the_slot_byte_formula_bounds_the_ring_s_real_slot_within_its_alignment(tmp_path, batch_size):
    """The Loader sizes (and checks the memory of) its slots with size.slot_bytes before the
    ring exists: never below what csrc/ring.cpp allocates, never more than a page and the
    fields' alignment above it. The index's 8 bytes a row are counted."""
    with fastload.Loader(_raw(tmp_path / "ds"), batch_size=batch_size, shuffle=False) as lo:
        next(iter(lo))
        real = lo.stats()["ring"]["slot_bytes"]
        row = 300 * 4 + 3 * 2
        est = size.slot_bytes(lo.options.slot_rows, row, 2)
    assert size.batch_bytes(batch_size, row) == batch_size * (row + size.INDEX_BYTES)
    assert real <= est < real + size.SLOT_ALIGN + size.FIELD_ALIGN * 3
    assert est % size.SLOT_ALIGN == 0


def test_a_loader_s_default_threads_and_prefetch_come_from_ring_size(tmp_path, monkeypatch):
    monkeypatch.setattr(size, "default_threads", lambda: 5)
    with fastload.Loader(_raw(tmp_path / "ds"), batch_size=16) as lo:
        assert lo.threads == size.default_gather_threads() == 4
        assert lo.prefetch == size.default_prefetch(4, size.batch_bytes(16, 300 * 4 + 3 * 2))


def test_doctor_s_page_locked_bytes_use_the_same_formula(tmp_path):
    from fastload.doctor import probe
    from fastload.doctor.facts import Facts

    f = Facts(device="cuda", dataset=str(_raw(tmp_path / "ds")), gather_threads=2)
    probe._dataset(f, 32)
    batch = size.batch_bytes(32, 300 * 4 + 3 * 2)
    assert f.pinned_bytes == size.ring_slots(size.default_prefetch(2, batch)) * batch

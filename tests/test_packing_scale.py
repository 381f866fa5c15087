"""A packed pass computed in chunks as it advances: each batch's pieces equal the whole-epoch
computation's (empty documents, chunk boundaries, wrap-around, resume at any token), the
piece bound equals the sorted-lengths formula, and a plan over 10^8 documents reaches its
first row in milliseconds and a few MB."""
import importlib.util
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from fastload.sampling import packing
from fastload.sampling.order import Shuffled
from fastload.sampling.packing import max_pieces, pack_bounds, pack_plan, pieces, token_total


def _cum(stream, lengths, max_length=None):
    tok = np.asarray(lengths)[np.asarray(stream)].astype(np.int64)
    if max_length is not None:
        tok = np.minimum(tok, max_length)
    return np.concatenate([[0], np.cumsum(tok)])


@pytest.mark.parametrize("shuffled", [False, True])
def test_every_batch_equals_the_whole_epoch_computation(monkeypatch, shuffled):
    """Small chunks (7 documents) so batches span chunks; empty and long documents; every
    world size, rank, drop_last, a start inside the epoch, max_length, a known total or
    one counted from the stream."""
    monkeypatch.setattr(packing, "CHUNK", 7)
    rng = np.random.default_rng(0)
    for trial in range(60):
        n = int(rng.integers(1, 60))
        lengths = rng.integers(0, 30, n) * (rng.random(n) < 0.85)
        max_length = None if trial % 3 else int(rng.integers(1, 20))
        stream = Shuffled(n, seed=trial, epoch=1) if shuffled else rng.integers(0, n, int(rng.integers(1, 80)))
        cum = _cum(stream, lengths, max_length)
        total = int(cum[-1])
        rows, length, world = int(rng.integers(1, 4)), int(rng.integers(1, 40)), int(rng.integers(1, 4))
        drop_last = bool(rng.integers(0, 2))
        start = int(rng.integers(0, max(total, 1)))
        for rank in range(world):
            known = token_total(lengths, max_length) if shuffled else None
            plan = pack_plan(0, start, stream, lengths, rows=rows, length=length, world_size=world, rank=rank,
                             drop_last=drop_last, max_length=max_length, total=known)
            want = pack_bounds(start, total, world, rank, rows, length, drop_last)
            assert list(plan.bounds) == want and plan.total == total
            if want:
                assert plan.most_pieces <= max_pieces(lengths, rows, length, max_length)
            for k, (req, after) in enumerate(plan.requests()):
                docs, first, count = pieces(cum, want[k][0], want[k][1], length)
                assert req.positions.tolist() == docs.tolist(), (trial, rank, k)
                assert req.start.tolist() == first.tolist() and req.count.tolist() == count.tolist()
                assert req.index.tolist() == np.asarray(stream)[docs].tolist()
                assert req.position == want[k][0] and after == want[k][2]
            assert np.array_equal(plan.cum, cum) and np.array_equal(plan.stream, np.asarray(stream))


def test_the_piece_bound_equals_the_sorted_lengths_formula():
    rng = np.random.default_rng(1)
    for _ in range(300):
        n = int(rng.integers(1, 50))
        lengths = rng.integers(0, 40, n) * (rng.random(n) < 0.8)
        rows, length = int(rng.integers(1, 5)), int(rng.integers(1, 50))
        max_length = None if rng.random() < 0.5 else int(rng.integers(1, 30))
        tok = lengths if max_length is None else np.minimum(lengths, max_length)
        nz = np.sort(tok[tok > 0])
        if nz.sum() == 0:
            want = max(1, rows)
        else:
            passes, rest = divmod(rows * length, int(nz.sum()))
            whole = passes * len(nz) + int(np.searchsorted(np.cumsum(nz), rest, side="right"))
            want = min(rows * length, rows + whole + 1)
        assert max_pieces(lengths, rows, length, max_length) == want


def _bench_scale():
    spec = importlib.util.spec_from_file_location("bench_scale", Path(__file__).parent.parent / "bench" / "bench_scale.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_plan_over_1e8_documents_reaches_its_first_rows_fast_and_small():
    n = 10**8
    lengths = _bench_scale().GeneratedLengths(n)  # hashed from the index: nothing held
    stream = Shuffled(n, seed=3, epoch=2)
    total = 2049 * n // 2  # about: the exact count is what the plan is told
    tracemalloc.start()
    t0 = time.perf_counter()
    plan = pack_plan(2, 0, stream, lengths, rows=8, length=4096, world_size=1024, rank=1000, drop_last=True,
                     total=total)
    first = plan.request(0)
    resumed = pack_plan(2, 5 * plan.bounds.step + 12345, stream, lengths, rows=8, length=4096, world_size=1024,
                        rank=1000, drop_last=True, total=total).request(0)
    took = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert took < 2.0 and peak < 20 * 2**20, (took, peak)
    assert int(first.count.sum()) == 8 * 4096 and len(first.index) > 8
    # the first batch against the definition, from the documents before its tokens
    b, e, _ = plan.bounds[0]
    docs_needed = int(first.positions.max()) + 1
    head = stream[0:docs_needed]
    cum = np.concatenate([[0], np.cumsum(lengths[head])])
    cum = np.append(cum, np.iinfo(np.int64).max // 2)  # the documents after: far away
    d, f, c = pieces(cum, b, e, 4096)
    assert first.positions.tolist() == d.tolist() and first.start.tolist() == f.tolist()
    assert first.count.tolist() == c.tolist() and first.index.tolist() == head[d].tolist()
    assert int(resumed.count.sum()) == 8 * 4096 and resumed.position == 5 * plan.bounds.step + 12345 + 1000 * 8 * 4096


def test_a_counted_total_is_kept_with_its_stream(monkeypatch):
    """A stream that does not read every sample once (a mixture's, weighted draws) has its
    token count counted by one pass over it: once per stream, not once per plan (len(loader)
    and each pass make one)."""
    lengths = np.arange(50) % 7
    stream = Shuffled(50, seed=1, epoch=0)
    first = pack_plan(0, 0, stream, lengths, rows=2, length=8, world_size=1, rank=0, drop_last=False)
    assert first.total == int(lengths.sum())
    monkeypatch.setattr(packing.TokenStream, "_tokens", lambda *a: pytest.fail("counted again"))
    again = pack_plan(0, 0, stream, lengths, rows=2, length=8, world_size=1, rank=0, drop_last=False)
    assert again.total == first.total and len(again) == len(first)
    other = Shuffled(50, seed=1, epoch=1)  # another epoch's stream: counted (fails here)
    with pytest.raises(pytest.fail.Exception):
        pack_plan(0, 0, other, lengths, rows=2, length=8, world_size=1, rank=0, drop_last=False)


def test_an_epochs_token_total_is_not_taken_from_a_dead_arrays_reused_id():
    """The per-stream memo of token totals is keyed by ``id(lengths)``; an id is reused once
    its array dies, so an entry left by a dead array (planted here under the live array's id)
    must not be read as the live one's total."""
    import gc
    import weakref

    from fastload.sampling import packing
    from fastload.sampling.order import Shuffled

    stream = Shuffled(1000, 0, 0)
    lengths = np.full(1000, 3, np.int64)
    dead = np.ones(1000, np.int64)
    ref = weakref.ref(dead)
    del dead
    gc.collect()
    packing._STREAM_TOTALS.setdefault(stream, {})[(id(lengths), 1000, None)] = (ref, 1000)
    assert packing.TokenStream(stream, lengths, None).total == 3000
    assert packing.TokenStream(stream, lengths, None).total == 3000  # (now kept for the live one)

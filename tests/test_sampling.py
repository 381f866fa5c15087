"""fastload.Sampler: DistributedSampler parity, exactly-once coverage, resume at any world
size, weighted and class-balanced sampling, bad arguments."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler

from fastload import Sampler
from fastload.sampling import rank_batch_bounds


def rank_batches(n, world, rank, **kw):
    return list(Sampler(n, world_size=world, rank=rank, **kw))


def all_ranks(n, world, **kw):
    return [rank_batches(n, world, r, **kw) for r in range(world)]


def flat(batches):
    return np.concatenate(batches) if batches else np.empty(0, np.int64)


class _Sized:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 3000), world=st.integers(1, 64), batch=st.integers(1, 97),
       drop_last=st.booleans(), seed=st.integers(0, 2**32), shuffle=st.booleans())
def test_coverage_matches_distributed_sampler(n, world, batch, drop_last, seed, shuffle):
    ranks = all_ranks(n, world, batch_size=batch, drop_last=drop_last, seed=seed, shuffle=shuffle)
    ref = DistributedSampler(_Sized(n), num_replicas=world, rank=0, shuffle=False, drop_last=drop_last)
    counts = [len(flat(b)) for b in ranks]
    assert counts == [ref.num_samples] * world
    assert len({len(b) for b in ranks}) == 1  # same number of batches on every rank: no DDP hang
    for b in ranks:
        assert all(len(x) == batch for x in b[:-1])
        assert all(x.dtype == np.int64 for x in b)
    every = np.concatenate([flat(b) for b in ranks])
    if drop_last:
        assert len(np.unique(every)) == len(every) == (n // world) * world  # disjoint
    else:
        assert set(every.tolist()) == set(range(n))  # union is the whole dataset
        pad = len(every) - n
        # the repeats are exactly the padding: the first `pad` positions of the stream (wrapping)
        stream = Sampler(n, batch_size=batch, seed=seed, shuffle=shuffle).stream()
        extra = np.bincount(every, minlength=n) - 1
        expect = np.bincount(stream[np.arange(pad) % n], minlength=n) if pad else np.zeros(n, np.int64)
        assert (extra == expect).all()
    # reproducible, and a pure function of the arguments
    again = all_ranks(n, world, batch_size=batch, drop_last=drop_last, seed=seed, shuffle=shuffle)
    assert all(np.array_equal(a, b) for x, y in zip(ranks, again) for a, b in zip(x, y))


def test_counts_equal_distributed_sampler_exhaustively():
    for n in range(1, 70):
        for world in range(1, 12):
            for drop_last in (False, True):
                ref = DistributedSampler(_Sized(n), num_replicas=world, rank=world - 1, drop_last=drop_last)
                s = Sampler(n, batch_size=4, world_size=world, rank=world - 1, drop_last=drop_last)
                assert s.num_samples_per_rank == ref.num_samples == len(list(ref)) == len(flat(list(s))), \
                    (n, world, drop_last)


def test_no_shuffle_is_natural_order_partitioned():
    ranks = all_ranks(10, 2, batch_size=2, shuffle=False)
    assert [b.tolist() for b in ranks[0]] == [[0, 1], [4, 5], [8]]
    assert [b.tolist() for b in ranks[1]] == [[2, 3], [6, 7], [9]]
    single = flat(rank_batches(10, 1, 0, batch_size=3, shuffle=False))
    assert single.tolist() == list(range(10))


def test_epochs_and_seeds_differ_and_set_epoch_is_deterministic():
    s = Sampler(1000, batch_size=100, seed=1)
    e0 = flat(list(s))
    s.set_epoch(1)
    e1 = flat(list(s))
    assert not np.array_equal(e0, e1) and sorted(e0) == sorted(e1)
    s.set_epoch(0)
    assert np.array_equal(flat(list(s)), e0)
    assert not np.array_equal(flat(list(Sampler(1000, batch_size=100, seed=2))), e0)
    # without set_epoch a second pass repeats the epoch (DistributedSampler's behaviour)
    assert np.array_equal(flat(list(s)), e0)


def test_drop_last_batch_gives_static_shapes():
    b = rank_batches(103, 2, 1, batch_size=10, drop_last_batch=True)
    assert [len(x) for x in b] == [10] * 5
    assert len(Sampler(103, batch_size=10, world_size=2, rank=1, drop_last_batch=True)) == 5


def test_len_is_batches_of_the_next_iteration():
    s = Sampler(100, batch_size=8, world_size=3, rank=2)
    assert len(s) == len(list(s)) == s.batches_per_epoch == 5
    it = iter(s)
    next(it), next(it)
    st_ = s.state_dict()
    t = Sampler(100, batch_size=8, world_size=3, rank=2)
    t.load_state_dict(st_)
    assert len(t) == len(list(t)) == 3


# -- resume ------------------------------------------------------------------------------------
def run_until(n, world, steps, **kw):
    """Every rank reads `steps` batches; returns (samples read, rank-0 state)."""
    read = []
    state = None
    for r in range(world):
        s = Sampler(n, world_size=world, rank=r, **kw)
        s.set_epoch(3)
        it = iter(s)
        for _ in range(steps):
            try:
                read.append(next(it))
            except StopIteration:
                break
        if r == 0:
            state = json.loads(json.dumps(s.state_dict()))  # it must survive JSON
    return flat(read), state


def resume(n, world, state, **kw):
    out = []
    for r in range(world):
        s = Sampler(n, world_size=world, rank=r, **kw)
        s.load_state_dict(state)
        s.set_epoch(state["epoch"])  # the usual loop calls set_epoch: it keeps the position
        out.append(list(s))
    return out


@pytest.mark.parametrize("old,new", [(4, 2), (2, 4), (4, 3), (1, 8), (3, 3), (8, 1)])
@pytest.mark.parametrize("n", [1000, 997])
def test_resume_exactly_once_across_world_sizes(old, new, n):
    kw = dict(batch_size=16, seed=7)
    per_step = 16 * old
    total_steps = Sampler(n, world_size=old, **kw).batches_per_epoch
    for steps in (0, 1, total_steps // 2, total_steps - 1, total_steps):  # first, mid, last, boundary
        before, state = run_until(n, old, steps, **kw)
        assert state["consumed"] == min(steps * per_step, -(-n // old) * old)
        after = flat([flat(b) for b in resume(n, new, state, **kw)])
        union = np.concatenate([before, after])
        # exactly once, up to padding: every sample at least once, repeats only from padding
        counts = np.bincount(union, minlength=n)
        assert counts.min() == 1, (old, new, steps)
        pad_before = (-(n) % old) if steps == total_steps else 0
        assert counts.sum() - n <= max(pad_before, (-(n - state["consumed"])) % new if state["consumed"] < n else 0)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_resume_same_world_equals_uninterrupted(world, drop_last):
    n, kw = 1001, dict(batch_size=10, seed=3, drop_last=drop_last)
    full = []
    for r in range(world):
        s = Sampler(n, world_size=world, rank=r, **kw)
        s.set_epoch(3)
        full.append(list(s))
    for steps in (0, 1, 13, len(full[0]) - 1, len(full[0])):
        _, state = run_until(n, world, steps, **kw)
        rest = resume(n, world, state, **kw)
        for r in range(world):
            assert len(rest[r]) == len(full[r]) - steps
            assert all(np.array_equal(a, b) for a, b in zip(rest[r], full[r][steps:]))


def test_resume_with_drop_last_reads_each_sample_at_most_once():
    n, kw = 1003, dict(batch_size=8, seed=1, drop_last=True)
    before, state = run_until(n, 4, 7, **kw)
    after = flat([flat(b) for b in resume(n, 3, state, **kw)])
    union = np.concatenate([before, after])
    assert len(np.unique(union)) == len(union)
    assert len(union) >= n - 4  # at most the world-size tail is dropped


def test_resume_then_next_epoch_is_full():
    s = Sampler(100, batch_size=10, world_size=2, rank=0)
    s.set_epoch(5)
    it = iter(s)
    next(it)
    t = Sampler(100, batch_size=10, world_size=2, rank=0)
    t.load_state_dict(s.state_dict())
    assert len(list(t)) == 4
    t.set_epoch(6)
    assert len(list(t)) == 5
    # a state at the epoch boundary resumes to nothing left of that epoch
    u = Sampler(100, batch_size=10, world_size=2, rank=0)
    u.load_state_dict(t.state_dict())
    assert list(u) == []


def test_resume_refuses_a_different_order_naming_the_difference():
    s = Sampler(100, batch_size=10, seed=1)
    state = s.state_dict()
    with pytest.raises(ValueError, match="seed"):
        Sampler(100, batch_size=10, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="num_samples"):
        Sampler(101, batch_size=10, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="version"):
        Sampler(100, batch_size=10, seed=1).load_state_dict({**state, "version": 99})
    with pytest.raises(ValueError, match="weights"):
        Sampler(100, batch_size=10, seed=1, weights=np.ones(100)).load_state_dict(state)
    # world size and batch size may change
    Sampler(100, batch_size=7, world_size=3, rank=1, seed=1).load_state_dict(state)


# -- weighted ----------------------------------------------------------------------------------
def test_weighted_frequencies_match_weights_chi_square_1e7():
    n = 10_000_000
    classes = np.arange(n) % 10
    class_w = np.arange(1, 11, dtype=np.float64)  # class k weighs k+1
    w = class_w[classes]
    t0 = time.process_time()  # CPU time: what other processes on a loaded machine take does not count
    s = Sampler(n, batch_size=4096, weights=w, seed=123)
    draws = s.stream()
    elapsed = time.process_time() - t0
    observed = np.bincount(classes[draws], minlength=10)
    expected = n * class_w / class_w.sum()
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    # 9 degrees of freedom: P(chi2 > 27.88) = 0.001
    assert chi2 < 27.88, (chi2, observed)
    assert elapsed < 10, elapsed  # "a few seconds" of CPU; it is ~1.5 s here
    assert len(draws) == n and draws.max() < n


def test_weighted_zero_weight_never_drawn_and_partitioned_across_ranks():
    n = 5000
    w = np.ones(n)
    w[::2] = 0
    ranks = all_ranks(n, 4, batch_size=32, weights=w, seed=5)
    every = np.concatenate([flat(b) for b in ranks])
    assert (every % 2 == 1).all()
    assert len(every) == n
    # identical stream on every rank: the ranks' reads interleave into one stream
    assert sorted(every.tolist()) == sorted(Sampler(n, batch_size=32, weights=w, seed=5).stream().tolist())


def test_weighted_without_replacement_is_a_permutation_of_positive_weights():
    n = 1000
    w = np.random.default_rng(0).random(n)
    w[:100] = 0
    s = Sampler(n, batch_size=10, weights=w, replacement=False, seed=3)
    st_ = s.stream()
    assert len(st_) == 900 and len(np.unique(st_)) == 900 and st_.min() >= 100
    # heavier samples come earlier on average
    first = st_[:300]
    assert w[first].mean() > w[st_[-300:]].mean()
    with pytest.raises(ValueError, match="num_draws"):
        Sampler(n, batch_size=10, weights=w, replacement=False, num_draws=901)


def test_weighted_beyond_2_pow_24():
    n = 2**24 + 10
    w = np.zeros(n, np.float32)
    w[-5:] = 1.0  # only indices beyond 2^24 can be drawn
    s = Sampler(n, batch_size=1, weights=w, num_draws=1000, seed=0)
    st_ = s.stream()
    assert st_.min() >= n - 5 and len(np.unique(st_)) == 5


# -- class-balanced ----------------------------------------------------------------------------
def test_class_balanced_batches():
    rng = np.random.default_rng(0)
    labels = rng.choice(4, size=10_000, p=[0.85, 0.1, 0.04, 0.01])
    for world in (1, 3):
        for r in range(world):
            s = Sampler(len(labels), batch_size=32, world_size=world, rank=r, balance_labels=labels, seed=2)
            batches = list(s)
            for b in batches[:-1]:
                counts = np.bincount(labels[b], minlength=4)
                assert counts.tolist() == [8, 8, 8, 8], counts
    # batch size not a multiple of the class count: within one of each other, equal overall
    s = Sampler(len(labels), batch_size=10, balance_labels=labels, seed=2)
    batches = list(s)
    for b in batches[:-1]:
        c = np.bincount(labels[b], minlength=4)
        assert c.max() - c.min() <= 1
    total = np.bincount(labels[flat(batches)], minlength=4)
    assert total.max() - total.min() <= 4
    # the minority class repeats in reshuffled passes: all of its samples are used
    minority = np.flatnonzero(labels == 3)
    assert set(flat(batches)[labels[flat(batches)] == 3].tolist()) == set(minority.tolist())


def test_class_balanced_resume_same_world():
    labels = np.arange(999) % 3
    kw = dict(batch_size=12, seed=4, balance_labels=labels)
    full = [list(Sampler(999, world_size=2, rank=r, **kw)) for r in range(2)]
    s = [Sampler(999, world_size=2, rank=r, **kw) for r in range(2)]
    for x in s:
        it = iter(x)
        for _ in range(5):
            next(it)
    t = Sampler(999, world_size=2, rank=1, **kw)
    t.load_state_dict(s[0].state_dict())
    rest = list(t)
    assert all(np.array_equal(a, b) for a, b in zip(rest, full[1][5:]))
    with pytest.raises(ValueError, match="balance_batch_size"):
        Sampler(999, batch_size=6, seed=4, balance_labels=labels).load_state_dict(s[0].state_dict())


# -- shard-window shuffle ----------------------------------------------------------------------
def test_window_shuffle_keeps_locality():
    sizes = [100] * 20
    s = Sampler(2000, batch_size=50, shuffle_mode="window", shard_sizes=sizes, window=2, seed=0)
    stream = s.stream()
    assert sorted(stream.tolist()) == list(range(2000))
    shards = stream // 100
    for w0 in range(0, 2000, 200):  # each window of 200 positions reads exactly 2 shards
        assert len(np.unique(shards[w0:w0 + 200])) == 2
    s.set_epoch(1)
    assert not np.array_equal(s.stream(), stream)
    with pytest.raises(ValueError, match="shard_sizes"):
        Sampler(2000, batch_size=50, shuffle_mode="window")
    with pytest.raises(ValueError, match="shard_sizes"):
        Sampler(2000, batch_size=50, shuffle_mode="window", shard_sizes=[100] * 3)


# -- bad arguments -----------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    (dict(batch_size=0), "batch_size=0"),
    (dict(batch_size=-3), "batch_size=-3"),
    (dict(batch_size=2, rank=4, world_size=4), "rank=4"),
    (dict(batch_size=2, world_size=0), "world_size=0"),
    (dict(batch_size=2, weights=np.r_[1.0, -1.0, 1.0, 1.0]), r"weights\[1\]=-1.0 is negative"),
    (dict(batch_size=2, weights=np.zeros(4)), "all zero"),
    (dict(batch_size=2, weights=np.ones(3)), r"shape \(3,\).*\(4,\)"),
    (dict(batch_size=2, weights=np.r_[1.0, np.nan, 1.0, 1.0]), r"weights\[1\]=nan is not finite"),
    (dict(batch_size=2, shuffle_mode="bogus"), "shuffle_mode='bogus'"),
    (dict(batch_size=2, num_draws=5), "num_draws"),
    (dict(batch_size=2, seed=-1), "seed=-1"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Sampler(4, **kwargs)


def test_rank_batch_bounds_padding_positions():
    # 5 samples, 2 ranks: 3 each, the 6th position wraps to position 0
    b0 = rank_batch_bounds(0, 5, 2, 0, 10, False)
    b1 = rank_batch_bounds(0, 5, 2, 1, 10, False)
    assert b0 == [(0, 3, 6)] and b1 == [(3, 6, 6)]


def test_torch_generator_not_used_and_tensor_friendly():
    s = Sampler(10, batch_size=4)
    b = next(iter(s))
    assert torch.from_numpy(b).dtype == torch.int64


# -- real ranks --------------------------------------------------------------------------------
def test_real_gloo_ranks_cover_the_epoch_exactly_once_and_resume_on_fewer_ranks():
    from _dist import run_ranks

    n, kw = 1003, dict(batch_size=8, seed=11, epoch=2)
    full = run_ranks(3, "dist_jobs:sampler_epoch", {"n": n, **kw})
    assert [r["rank"] for r in full] == [0, 1, 2] and all(r["world_size"] == 3 for r in full)
    read = np.array(full[0]["read"])
    assert all(r["read"] == full[0]["read"] for r in full)  # the collective saw the same data
    counts = np.bincount(read, minlength=n)
    assert counts.min() == 1 and counts.sum() == -(-n // 3) * 3  # exactly once + DistributedSampler padding
    # stop after 10 steps on 3 ranks, continue on 2: the union is the epoch, exactly once
    part = run_ranks(3, "dist_jobs:sampler_epoch", {"n": n, "stop_after": 10, **kw})
    state = part[0]["state"]
    assert state["consumed"] == 10 * 8 * 3
    rest = run_ranks(2, "dist_jobs:sampler_epoch", {"n": n, "state": state, **kw})
    union = np.concatenate([part[0]["read"], rest[0]["read"]])
    counts = np.bincount(union, minlength=n)
    assert counts.min() == 1 and counts.sum() - n <= 1  # (n - 240) is odd: one padded sample on 2 ranks


def test_permutation_is_uniform_and_pinned_across_machines():
    import itertools

    from fastload.sampling import permutation

    from fastload.sampling.order import Shuffled

    # The stream is part of the resume contract: the same on every machine and release
    # (sampler state version 3: the keyed bijection of bijection.py).
    assert permutation(12, 0, 0).tolist() == [3, 8, 0, 9, 5, 1, 7, 4, 6, 11, 2, 10]
    assert permutation(12, 7, 3).tolist() == [5, 1, 7, 4, 3, 6, 9, 2, 11, 8, 0, 10]
    assert Shuffled(10**10, 0, 0).at([0, 1, 9_999_999_999]).tolist() == [1888803818, 3237225046, 8868358798]
    assert permutation(0, 0, 0).size == 0 and permutation(1, 0, 0).tolist() == [0]
    # All 24 orders of 4 items equally likely over 24,000 epochs: chi-square, 23 degrees of
    # freedom, P(chi2 > 49.73) = 0.001.
    index = {p: i for i, p in enumerate(itertools.permutations(range(4)))}
    counts = np.zeros(24)
    for epoch in range(24_000):
        counts[index[tuple(permutation(4, 11, epoch).tolist())]] += 1
    chi2 = float(((counts - 1000) ** 2 / 1000).sum())
    assert chi2 < 49.73, (chi2, counts)
    # Every item equally likely at every position of a larger permutation (chi-square per
    # position, 19 dof, P(> 43.82) = 0.001; Bonferroni-free as the threshold is loose).
    n, epochs = 20, 4000
    pos = np.zeros((n, n))
    for epoch in range(epochs):
        pos[np.arange(n), permutation(n, 3, epoch)] += 1
    chi2 = ((pos - epochs / n) ** 2 / (epochs / n)).sum(axis=1)
    assert (chi2 < 43.82).mean() >= 0.95, chi2


def test_start_position_is_where_the_next_pass_begins():
    """Sampler.start_position(): a loaded mid-epoch position until a pass begins (or another
    epoch is set), else 0; it only reads (the Loader's len() and the remote cache's schedule
    ask it before a pass)."""
    s = Sampler(100, batch_size=10, seed=1)
    assert s.start_position() == 0
    it = iter(s)
    next(it), next(it)
    state = s.state_dict()
    t = Sampler(100, batch_size=10, seed=1)
    t.load_state_dict(state)
    assert t.start_position() == t.start_position() == 20 and len(t) == 8
    t.set_epoch(state["epoch"])  # the same epoch keeps the loaded position
    assert t.start_position() == 20
    epoch, start, _ = t.begin_pass()
    assert start == 20 and t.start_position() == 0  # taken by the pass
    t.load_state_dict(state)
    t.set_epoch(1)
    assert t.start_position() == 0


def test_the_next_epochs_order_is_prepared_in_the_background_and_equal(monkeypatch):
    import threading

    from fastload.sampling import sampler as sampler_mod

    monkeypatch.setattr(sampler_mod, "PREPARE_MIN_NS", 0)  # (small orders are computed when asked for)

    fresh = Sampler(10_000, batch_size=32, seed=5)
    s = Sampler(10_000, batch_size=32, seed=5, weights=None)
    s.prepare(1)  # a per-position order: nothing to compute until someone reads whole streams
    assert s._ahead is None
    s.stream(0)  # (a remote cache's plan does)
    calls = []
    real = s._compute
    s._compute = lambda e: calls.append((e, threading.current_thread().name)) or real(e)
    s.prepare(1)
    s.set_epoch(1)
    assert np.array_equal(s.stream(), fresh.stream(1))
    assert calls == [(1, "fastload-order")]  # computed once, by the background thread
    s.prepare(2)
    s.join_ahead()  # a prepared epoch that is not asked for is dropped, never used stale
    s.set_epoch(2)
    assert np.array_equal(s.stream(), fresh.stream(2)) and calls[-1] == (2, "MainThread")
    calls.clear()
    natural = Sampler(100, batch_size=4, shuffle=False)
    natural.prepare(1)  # the natural order: nothing to prepare
    assert natural._ahead is None
    monkeypatch.undo()
    cheap = Sampler(10_000, batch_size=4, seed=5)
    cheap.stream(0)
    cheap.prepare(1)  # 10,000 samples: ~0.3 ms to compute, less than starting a thread
    assert cheap._ahead is None
    monkeypatch.setattr(sampler_mod, "PREPARE_MIN_NS", 0)
    weighted = Sampler(1000, batch_size=8, weights=np.arange(1000) + 1.0, seed=2)
    weighted.prepare(3)
    weighted.set_epoch(3)
    assert np.array_equal(weighted.stream(), Sampler(1000, batch_size=8, weights=np.arange(1000) + 1.0,
                                                     seed=2).stream(3))


def test_a_prepared_order_that_failed_is_computed_again_where_it_is_asked_for(monkeypatch):
    from fastload.sampling import sampler as sampler_mod

    monkeypatch.setattr(sampler_mod, "PREPARE_MIN_NS", 0)
    s = Sampler(1000, batch_size=8, seed=1)
    s.stream(0)  # whole streams are read: prepare() computes them ahead
    real = s._compute
    boom = {"n": 0}

    def compute(e):
        boom["n"] += 1
        if boom["n"] == 1:
            raise MemoryError("no memory in the background")
        return real(e)
    s._compute = compute
    s.prepare(1)
    s.set_epoch(1)
    assert np.array_equal(s.stream(), Sampler(1000, batch_size=8, seed=1).stream(1)) and boom["n"] == 2

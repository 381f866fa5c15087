"""Weighted and class-balanced draws computed per position (issue 30). Weighted (with
replacement): each position's draw is the inverse CDF of a counter-based uniform, found from
a guide table built once per sampler; the draws equal a plain binary search's. Balanced:
every chunk of batch_size positions holds each class equally often, each class read in
passes of its own keyed bijection. Either way num_draws = 10^10 costs nothing per draw."""
from __future__ import annotations

import tracemalloc

import numpy as np

from fastload import Sampler
from fastload.sampling.draws import weighted_draws
from fastload.sampling.order import Balanced, Weighted, uniforms
from fastload.sampling.tables import balance_table, weight_table


def _reference(table, stream, positions):
    cdf, _, last = table
    u = uniforms(stream.key, positions) * cdf[-1]
    return np.minimum(np.searchsorted(cdf, u, side="right"), last)


def test_guided_search_equals_binary_search_on_awkward_weights():
    rng = np.random.default_rng(0)
    heavy = rng.pareto(0.5, 200_000)  # a few weights dominate: long runs of tiny slices
    heavy[::3] = 0
    cases = [heavy, np.r_[np.zeros(1000), 1.0, np.zeros(10**5), 1e-300, 5.0, np.zeros(7)],
             np.arange(100_000) % 10 + 1.0, rng.random(3), np.array([0.0, 2.0])]
    for w in cases:
        table = weight_table(w)
        s = Weighted(table, 300_000, 2, 1)
        pos = np.arange(300_000)
        got = s.at(pos)
        assert np.array_equal(got, _reference(table, s, pos))
        assert (w[got] > 0).all()
        assert np.array_equal(np.asarray(s), got)  # materialised in chunks: the same draws
        assert np.array_equal(weighted_draws(w, 300_000, True, 2, 1), got)


def test_ten_billion_draws_cost_nothing_per_draw():
    n = 1_000_000
    w = np.arange(n) % 10 + 1.0
    per_sample = 56  # the sampler's own copy of the weights (8), their digest, the table (12 bytes) and its
    # build's temporaries (one chunk of 2^20: here all the samples); measured 60 (52 without the copy)
    tracemalloc.start()
    try:
        s = Sampler(n, batch_size=256, world_size=1024, rank=7, weights=w, num_draws=10**10, seed=3)
        first = next(iter(s))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < per_sample * n + 8 * 2**20, peak  # per sample, and a few chunks: nothing per draw
    st = s.order_stream()
    assert len(st) == 10**10
    assert np.array_equal(first, st.at(7 * 256 + np.arange(256)))
    # far positions, and the frequencies of a million of them follow the weights
    far = st.at(np.arange(10**10 - 1_000_000, 10**10))
    counts = np.bincount(far % 10, minlength=10)
    expected = 1_000_000 * np.arange(1, 11) / 55
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 27.88, chi2  # 9 dof, P = 0.001


def test_epochs_and_seeds_give_other_draws_and_resume_continues_them():
    w = np.arange(1, 1001, dtype=float)
    a = Sampler(1000, batch_size=10, weights=w, seed=1)
    e0 = a.stream(0)
    assert not np.array_equal(e0, a.stream(1))
    assert not np.array_equal(e0, Sampler(1000, batch_size=10, weights=w, seed=2).stream(0))
    it = iter(a)
    first = [next(it) for _ in range(30)]
    b = Sampler(1000, batch_size=7, world_size=3, rank=2, weights=w, seed=1)
    b.load_state_dict(a.state_dict())
    assert np.array_equal(next(iter(b)), e0[300 + 14:300 + 21])
    assert np.array_equal(np.concatenate(first), e0[:300])


# -- class-balanced -------------------------------------------------------------------------
def test_balanced_chunks_and_passes_per_position():
    rng = np.random.default_rng(0)
    labels = rng.choice(4, size=10_000, p=[0.85, 0.1, 0.04, 0.01])
    table = balance_table(labels)
    sizes = np.bincount(labels)
    for batch in (32, 10, 4):
        s = Balanced(table, 20_000, batch, 2, 0)
        a = np.asarray(s)
        assert np.array_equal(s.at(np.arange(20_000)[::-3]), a[::-3])  # any positions, any order
        cls = labels[a]
        for c0 in range(0, 20_000, batch):
            counts = np.bincount(cls[c0:c0 + batch], minlength=4)
            assert counts.min() >= batch // 4 and counts.max() <= -(-batch // 4), (batch, counts)
        for k in range(4):  # class k read in passes of its samples, each pass without repeats
            seq = a[cls == k]
            for p0 in range(0, len(seq) - sizes[k] + 1, sizes[k]):
                assert np.array_equal(np.sort(seq[p0:p0 + sizes[k]]), np.flatnonzero(labels == k))
        total = np.bincount(cls, minlength=4)
        assert total.max() - total.min() <= 4, total
    assert not np.array_equal(np.asarray(Balanced(table, 1000, 8, 2, 1)), np.asarray(Balanced(table, 1000, 8, 2, 0)))


def test_balanced_ten_billion_draws_on_1024_ranks():
    labels = np.arange(1_000_000) % 7
    tracemalloc.start()
    try:
        s = Sampler(len(labels), batch_size=70, world_size=1024, rank=1000, balance_labels=labels,
                    num_draws=10**10, seed=5)
        first = next(iter(s))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * len(labels) + 16 * 2**20, peak  # per sample (labels, the class table): nothing per draw
    assert np.bincount(labels[first], minlength=7).tolist() == [10] * 7
    st = s.order_stream()
    assert np.array_equal(first, st.at(1000 * 70 + np.arange(70)))
    end = 10**10 // 70 * 70
    far = st.at(np.arange(end - 70 * 1000, end))  # the last 1000 whole chunks
    per_chunk = np.bincount(labels[far] + 7 * np.repeat(np.arange(1000), 70), minlength=7000).reshape(1000, 7)
    assert (per_chunk == 10).all()
    t = Sampler(len(labels), batch_size=70, world_size=3, rank=2, balance_labels=labels, num_draws=10**10, seed=5)
    t.load_state_dict(s.state_dict(consumed=123_456 * 70 * 1024))
    assert np.array_equal(next(iter(t)), st.at(123_456 * 70 * 1024 + 2 * 70 + np.arange(70)))

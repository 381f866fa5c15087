"""Weighted draws with replacement computed per position (issue 30): each position's draw is
the inverse CDF of a counter-based uniform, found from a guide table built once per sampler,
so num_draws = 10^10 costs nothing per draw; the draws equal a plain binary search's."""
from __future__ import annotations

import tracemalloc

import numpy as np

from fastload import Sampler
from fastload.sampling.draws import weighted_draws
from fastload.sampling.order import Weighted, uniforms, weight_table


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
    per_sample = 48  # the weights as float64, their digest, the table (12 bytes) and its build's temporaries
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

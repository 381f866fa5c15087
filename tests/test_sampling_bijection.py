"""The per-position shuffle (issue 30): the keyed bijection of sampling/bijection.py is a
permutation (exhaustively for small N), uniform over keys (chi-square), without correlation
between adjacent positions; the Sampler built on it splits 10^10 positions over 1,024 ranks
in disjoint shares, reaches its first batch without memory per sample, and resumes at any
position and world size in O(1). Old states are refused, saying why."""
from __future__ import annotations

import itertools
import time
import tracemalloc

import numpy as np
import pytest

from fastload import Sampler
from fastload.sampling import SAMPLER_STATE_VERSION, per_rank_count
from fastload.sampling import bijection as bijection_module
from fastload.sampling.bijection import FEW_ROUNDS, ROUNDS, SMALL_BITS, bijection, derive_keys, round_keys
from fastload.sampling.order import Natural, Shuffled, Windowed
from fastload.sampling.streams import PERMUTATION, seed_sequence

BIG = 10**10


def _keys(seeds, n_each):
    """Round keys of ``seeds`` (one stream each, epoch 0), repeated ``n_each`` times per seed:
    (ROUNDS, len(seeds) * n_each), for one vectorised call over many keys."""
    k = np.stack([seed_sequence(int(s), 0, PERMUTATION).generate_state(ROUNDS, np.uint64) for s in seeds], 1)
    return np.repeat(k, n_each, axis=1)


# -- a permutation --------------------------------------------------------------------------
def test_every_small_n_is_a_permutation_exhaustively():
    for n in range(1, 2049):
        p = bijection(np.arange(n), n, round_keys(n, 1, PERMUTATION))
        assert p.dtype == np.int64
        assert np.array_equal(np.sort(p), np.arange(n)), n


def test_per_element_domains_and_keys_equal_one_bijection_each():
    sizes = np.array([1, 2, 3, 5, 16, 17, 1023, 1024, 1025, 5000])
    keys = derive_keys(round_keys(3, 4, PERMUTATION), np.arange(len(sizes)))
    n = np.repeat(sizes, sizes)
    k = np.repeat(keys, sizes, axis=1)
    pos = np.concatenate([np.arange(s) for s in sizes])
    got = bijection(pos, n, k)
    at = 0
    for i, s in enumerate(sizes.tolist()):
        alone = bijection(np.arange(s), s, keys[:, i])
        assert np.array_equal(got[at:at + s], alone), s
        assert np.array_equal(np.sort(alone), np.arange(s))
        at += s


def test_the_inverse_undoes_the_bijection():
    for n in (1, 2, 3, 10, 1024, 1025, 99_991, BIG):
        k = round_keys(3, n % 1000, PERMUTATION)
        x = np.arange(min(n, 50_000)) + (n - min(n, 50_000)) // 2
        y = bijection(x, n, k)
        assert np.array_equal(bijection(y, n, k, inverse=True), x), n
        assert np.array_equal(bijection(bijection(x, n, k, inverse=True), n, k), x), n


def test_the_extension_computes_the_numpy_reference_bit_for_bit():
    """fastload._C.feistel (csrc/feistel.cpp) gives the numbers of the numpy implementation
    (the order every state since version 3 names) over random domains, positions, shared,
    per-element and derived (``sub``) keys, forward and inverse; it refuses a position outside
    its domain instead of walking forever."""
    assert bijection_module._feistel is not None, "the extension lacks feistel: rebuild it (setup.py build_ext)"
    rng = np.random.default_rng(30)
    for trial in range(240):
        m = int(rng.integers(1, 2000))
        if trial % 3 == 0:  # one domain, from 1 to 2^62
            n = int(rng.integers(1, 2 ** int(rng.integers(1, 63))))
            x = rng.integers(0, n, m)
        else:  # a domain per element
            n = rng.integers(1, 2 ** int(rng.integers(1, 40)), m)
            x = (rng.random(m) * n).astype(np.int64)
        shared = trial % 2 == 1
        keys = rng.integers(0, 2**63, ROUNDS if shared else (ROUNDS, m), dtype=np.uint64)
        inverse = trial % 4 == 1
        got = bijection(x, n, keys, inverse=inverse)
        assert got.dtype == np.int64
        assert np.array_equal(got, bijection_module._bijection_numpy(x, n, keys, inverse=inverse)), trial
        if shared:
            # unique sub-streams, or runs of a few (the extension derives a run's keys once, as many rounds as
            # its domains need: a large domain's 6, then a small one's 12)
            sub = rng.integers(0, 2**40, m) if trial % 4 == 3 else np.sort(rng.integers(0, 4, m))
            want = bijection_module._bijection_numpy(x, n, derive_keys(keys, sub), inverse=inverse)
            assert np.array_equal(bijection(x, n, keys, sub=sub, inverse=inverse), want), trial
    k = round_keys(1, 0, PERMUTATION)
    for bad in ([0, 10], [-1]):
        with pytest.raises(IndexError, match=r"outside \[0, 10\)"):
            bijection(np.array(bad), 10, k)


# the streams of state version 3 as the numpy implementation computed them before the extension
# (length, first indices, xxh3-64 of the int64 stream): an order that changes must bump the
# sampler state version (fastload/sampling/state.py), not these numbers
PINNED = {
    "balanced": (3001, [2126, 2811, 1403, 2935, 108, 1773], "b39b59068c9444a3"),
    "window": (515, [21, 316, 254, 476, 255, 437], "6b6a44fe7b12859e"),
    "mixture-batch-None": (5000, [914, 640, 324, 933, 674, 434], "fca46d0e61c0505d"),
    "mixture-epoch-None": (3000, [701, 512, 907, 388, 908, 7], "054b521ade404308"),
    "mixture-batch-1": (1003, [998, 797, 131, 908, 786, 182], "bc952a3529aeaa27"),
    "dataset-draws": (5000, [1226, 798, 1075, 1104, 740, 266], "0623843ac82f5ce0"),
}


def _pinned_streams():
    from fastload.sampling.mixture import MixtureOrder, MixtureSampler, dataset_draws

    labels = np.arange(3000) % 7
    yield "balanced", Sampler(3000, balance_labels=labels, batch_size=32, seed=5, num_draws=3001).order_stream(2)
    sizes = [40, 7, 100, 55, 1, 300, 12]
    yield "window", Sampler(sum(sizes), shuffle_mode="window", shard_sizes=sizes, window=3, batch_size=4,
                            seed=5).order_stream(1)
    sz = np.array([600, 300, 100], np.int64)
    for per, epoch_size, stop in (("batch", 5000, None), ("epoch", 3000, None), ("batch", None, 1)):
        order = MixtureOrder(("a", "b", "c"), sz, np.array([0, 600, 900]), np.array([0.5, 0.3, 0.2]), per,
                             epoch_size, stop)
        yield f"mixture-{per}-{stop}", MixtureSampler(order, batch_size=24, seed=9).order_stream(3)
    yield "dataset-draws", dataset_draws(1234, 5, 2, 1000, 5000, True)


@pytest.mark.parametrize("extension", [True, False])
def test_every_stream_kind_keeps_its_pinned_order_with_or_without_the_extension(extension, monkeypatch):
    """Class-balanced, window and mixture streams (whose bijections take keys per element and
    derived per sub-stream) give the numbers they gave in numpy before fastload._C.feistel,
    and the numpy fallback (an extension built without it) gives them too."""
    import xxhash

    if not extension:
        monkeypatch.setattr(bijection_module, "_feistel", None)
    for name, stream in _pinned_streams():
        a = np.asarray(stream, dtype=np.int64)
        assert (len(a), a[:6].tolist(), xxhash.xxh3_64_hexdigest(a.tobytes())) == PINNED[name], name


def test_large_domains_are_injective_on_samples_and_in_range():
    for n in (2**31 - 1, 2**31, 2**33 + 1, BIG, 2**62 - 3):
        s = Shuffled(n, 5, 2)
        pos = np.unique(np.random.default_rng(n % 1000).integers(0, n, 200_000))
        pos = np.concatenate([pos, [0, n - 1]])
        idx = s.at(pos)
        assert idx.min() >= 0 and idx.max() < n
        assert len(np.unique(idx)) == len(np.unique(pos)), n  # distinct positions, distinct indices


def test_rounds_follow_the_domain_size():
    """Domains up to SMALL_BITS bits take all ROUNDS rounds, larger ones FEW_ROUNDS: keys
    beyond FEW_ROUNDS change only small domains' orders."""
    k = round_keys(1, 2, PERMUTATION)
    k2 = k.copy()
    k2[FEW_ROUNDS:] ^= np.uint64(12345)
    small, large = 2**SMALL_BITS, 2**SMALL_BITS + 1
    assert not np.array_equal(bijection(np.arange(small), small, k), bijection(np.arange(small), small, k2))
    assert np.array_equal(bijection(np.arange(large), large, k), bijection(np.arange(large), large, k2))


# -- uniform --------------------------------------------------------------------------------
@pytest.mark.parametrize("n,seeds", [(3, 30_000), (10, 20_000), (37, 10_000), (200, 5_000), (1500, 1_000)])
def test_each_index_lands_uniformly_over_positions_chi_square(n, seeds):
    """Over many seeds, the (position, index) table is flat: chi-square with (n-1)^2 degrees
    of freedom, normal approximation, |z| < 4.5 (P ~ 1e-5 per case)."""
    pos = np.tile(np.arange(n), seeds)
    idx = bijection(pos, np.full(len(pos), n), _keys(range(seeds), n))
    table = np.bincount(pos * n + idx, minlength=n * n).astype(float)
    exp = seeds / n
    chi2 = float(((table - exp) ** 2 / exp).sum())
    dof = (n - 1) ** 2
    z = (chi2 - dof) / np.sqrt(2 * dof)
    assert abs(z) < 4.5, (n, chi2, dof, z)


@pytest.mark.parametrize("n", [3, 4])
def test_every_order_of_a_few_items_is_equally_likely(n):
    """All n! orders equally often over many epochs (chi-square, n!-1 dof, P(>x) = 0.001)."""
    index = {p: i for i, p in enumerate(itertools.permutations(range(n)))}
    epochs = 1000 * len(index)
    counts = np.zeros(len(index))
    for e in range(epochs):
        counts[index[tuple(Shuffled(n, 11, e).at(np.arange(n)).tolist())]] += 1
    chi2 = float(((counts - 1000) ** 2 / 1000).sum())
    assert chi2 < {3: 20.52, 4: 49.73}[n], (chi2, counts)


def test_a_large_epoch_is_uniform_over_index_ranges():
    """At N = 10^10, 10^6 consecutive positions spread evenly over 100 index ranges
    (chi-square, 99 dof, P(> 148.2) = 0.001) and over the positions' own ranges."""
    s = Shuffled(BIG, 3, 0)
    for start in (0, BIG // 2, BIG - 1_000_000):
        idx = s.at(np.arange(start, start + 1_000_000))
        counts = np.bincount(idx // (BIG // 100), minlength=100)
        chi2 = float(((counts - 10_000) ** 2 / 10_000).sum())
        assert chi2 < 148.2, (start, chi2)


# -- uncorrelated ---------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1000, 10**6, BIG])
def test_adjacent_positions_are_uncorrelated(n):
    """Pearson correlation of indices at positions p and p+1 (and p and p+B, B a batch) and of
    the index with its position: all within 5 standard errors of 0; and the gap between
    neighbours is as often small as for independent draws."""
    m = min(n, 200_000)
    rng = np.random.default_rng(0)
    for seed in (0, 1, 2):
        s = Shuffled(n, seed, 7)
        pos = np.arange(m) if n == m else np.sort(rng.integers(0, n - 300, m))
        x = s.at(pos).astype(float)
        for lag in (1, 256):
            if n == m:
                a, b = x[:-lag], x[lag:]
            else:
                a, b = x, s.at(pos + lag).astype(float)
            r = np.corrcoef(a, b)[0, 1]
            assert abs(r) < 5 / np.sqrt(len(a)), (n, seed, lag, r)
        r_pos = np.corrcoef(pos.astype(float), x)[0, 1]
        assert abs(r_pos) < 5 / np.sqrt(len(x)), (n, seed, r_pos)
        if n > m:  # independent uniforms: P(|a - b| < n/100) = 0.0199
            near = np.mean(np.abs(x - s.at(pos + 1)) < n / 100)
            assert abs(near - 0.0199) < 5 * np.sqrt(0.0199 / m), near


# -- the Sampler at 10^10 -------------------------------------------------------------------
def test_ranks_shares_are_disjoint_at_ten_billion():
    world, batch = 1024, 256
    seen = []
    for rank in (0, 1, 511, 1023):
        s = Sampler(BIG, batch_size=batch, world_size=world, rank=rank, seed=9)
        it = iter(s)
        seen += [next(it) for _ in range(8)]
        # rank r's k-th batch is the stream's positions of step k's r-th block
        st = s.order_stream()
        assert np.array_equal(seen[-1], st.at(7 * batch * world + rank * batch + np.arange(batch)))
    every = np.concatenate(seen)
    assert len(np.unique(every)) == len(every) == 4 * 8 * batch
    assert every.min() >= 0 and every.max() < BIG


def test_first_batch_at_ten_billion_needs_no_memory_per_sample():
    tracemalloc.start()
    try:
        t0 = time.perf_counter()
        s = Sampler(BIG, batch_size=256, world_size=1024, rank=0)
        first = next(iter(s))
        elapsed = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(first) == 256 and len(s) == -(-per_rank_count(BIG, 1024, False) // 256)
    assert peak < 5 * 2**20, peak  # a few batches of int64 and the pass's bookkeeping; < 50 MB asked
    assert elapsed < 1.0, elapsed  # ~10 ms alone (bench_scale.py measures it); loose on a shared machine


def test_a_whole_epoch_plan_is_O1_even_with_a_billion_batches():
    s = Sampler(BIG, batch_size=1, world_size=1, rank=0, seed=1)
    t0 = time.perf_counter()
    plan = s.plan(3)
    assert len(plan) == BIG and plan.bounds[-1] == (BIG - 1, BIG, BIG)
    assert plan.indices(BIG - 1).tolist() == [int(plan.stream.at([BIG - 1])[0])]
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.parametrize("new_world", [1024, 1000, 7, 1])
def test_resume_at_a_random_position_and_another_world_size_is_O1(new_world):
    world, batch = 1024, 256
    s = Sampler(BIG, batch_size=batch, world_size=world, rank=0, seed=4)
    s.set_epoch(2)
    steps = 12_345
    state = s.state_dict(consumed=steps * batch * world)
    assert state["version"] == SAMPLER_STATE_VERSION
    for rank in sorted({0, new_world // 2, new_world - 1}):
        t = Sampler(BIG, batch_size=batch, world_size=new_world, rank=rank, seed=4)
        t0 = time.perf_counter()
        t.load_state_dict(state)
        t.set_epoch(2)
        c = state["consumed"]
        assert len(t) == -(-per_rank_count(BIG - c, new_world, False) // batch)  # what is left of the epoch
        got = next(iter(t))
        assert time.perf_counter() - t0 < 1.0
        # the next step after the saved position: rank r reads the r-th block of B positions
        expect = Sampler(BIG, batch_size=batch, seed=4).order_stream(2).at(c + rank * batch + np.arange(batch))
        assert np.array_equal(got, expect)


def test_resume_same_world_equals_uninterrupted_at_large_n():
    kw = dict(batch_size=64, world_size=16, seed=2)
    n = 10**9 + 7
    full = Sampler(n, rank=5, **kw)
    it = iter(full)
    ref = [next(it) for _ in range(40)]
    state = full.state_dict(consumed=25 * 64 * 16)
    t = Sampler(n, rank=5, **kw)
    t.load_state_dict(state)
    it = iter(t)
    assert all(np.array_equal(next(it), b) for b in ref[25:])


def test_an_older_state_version_is_refused_saying_why():
    s = Sampler(100, batch_size=10)
    state = s.state_dict()
    for old in (1, 2):
        with pytest.raises(ValueError, match=rf"version {old} was saved by an older fastload.*orders differ"):
            Sampler(100, batch_size=10).load_state_dict({**state, "version": old})
    with pytest.raises(ValueError, match="version 'x' is not"):
        Sampler(100, batch_size=10).load_state_dict({**state, "version": "x"})


# -- the kinds of stream --------------------------------------------------------------------
def test_streams_read_like_arrays():
    s = Shuffled(1000, 1, 1)
    a = np.asarray(s)
    assert a.dtype == np.int32 and np.array_equal(np.sort(a), np.arange(1000))
    assert s[5] == a[5] and s[-1] == a[-1]
    assert np.array_equal(s[10:20], a[10:20]) and np.array_equal(s[::-7], a[::-7])
    assert np.array_equal(s[np.array([3, -2])], a[[3, -2]])
    assert s.same(Shuffled(1000, 1, 1)) and not s.same(Shuffled(1000, 1, 2)) and s.same(a)
    assert np.array_equal(np.asarray(Natural(5)), np.arange(5))
    with pytest.raises(IndexError, match=r"\[0, 1000\)"):
        s.at([1000])


def test_window_stream_reads_each_window_of_shards_in_turn_and_is_a_permutation():
    rng = np.random.default_rng(1)
    sizes = rng.integers(0, 60, 97).tolist()  # empty shards too
    n = sum(sizes)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    for window in (1, 3, 10, 200):
        w = Windowed(sizes, window, 5, 1)
        a = np.asarray(w)
        assert np.array_equal(np.sort(a), np.arange(n))
        shard = np.searchsorted(starts, a, side="right") - 1
        # the windows' shards, in the shard order, each window's samples together
        order = w.order.tolist()
        pos = 0
        for w0 in range(0, len(order), window):
            group = order[w0:w0 + window]
            k = sum(sizes[g] for g in group)
            assert set(shard[pos:pos + k].tolist()) == {g for g in group if sizes[g]}
            pos += k
        assert np.array_equal(w.at(np.arange(n)[::-1]), a[::-1])  # per position, any order of asking
    assert not Windowed(sizes, 3, 5, 2).same(Windowed(sizes, 3, 5, 1))


def test_window_stream_at_ten_billion_holds_only_per_shard_tables():
    sizes = np.full(100_000, BIG // 100_000)
    tracemalloc.start()
    try:
        s = Sampler(BIG, batch_size=256, world_size=1024, rank=3, shuffle_mode="window", shard_sizes=sizes,
                    window=8, seed=1)
        b = next(iter(s))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 30 * 2**20, peak  # ~ a few arrays of 100,000 shards; nothing per sample
    shard = b // (BIG // 100_000)
    assert len(np.unique(shard)) <= 8  # one window of 8 shards holds the first 10^7 positions

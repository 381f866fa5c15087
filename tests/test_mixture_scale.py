"""A mixture's stream per position: the counts of runs before any position in O(log) equal
the counts summed run by run, the stream equals the definition computed whole (each
dataset's t-th position in stream order reads its t-th draw), and a mixture epoch of 10^10
positions reaches its first batch and any resume point in milliseconds with no array over
the epoch."""
import time
import tracemalloc

import numpy as np
import pytest

from fastload.sampling.mixture import BatchCounts, MixtureOrder, MixtureSampler, dataset_draws


def test_the_counts_before_a_run_equal_the_runs_summed():
    rng = np.random.default_rng(0)
    for _ in range(40):
        n = int(rng.integers(1, 6))
        w = rng.random(n) + 0.01
        w /= w.sum()
        b = int(rng.integers(1, 40))
        bc = BatchCounts(w, b)
        c = bc.counts(np.arange(500))
        assert (c.sum(axis=1) == b).all()
        assert (c >= np.floor(w * b) - 1e-9).all() and (c <= np.ceil(w * b) + 1e-9).all()
        cum = np.concatenate([np.zeros((1, n), np.int64), np.cumsum(c, axis=0)])
        for t in rng.integers(0, 501, 10).tolist():
            assert bc.before(t).tolist() == cum[t].tolist()
        assert np.abs(cum[-1] - 500 * b * w).max() < 3  # the proportions hold to a few samples


def test_the_counts_before_many_runs_summed_in_pieces_equal_floor_sums():
    """MixtureLayout._before sums the runs' counts between the runs asked for (in pieces of
    SPAN_PIECE runs) when they are not too far apart: the same as each run's floor sums,
    across piece boundaries, for a rank's runs at several world sizes and for a stretch."""
    from fastload.sampling.mixture import SPAN_PIECE, MixtureLayout

    w = np.array([0.5, 0.3, 0.15, 0.05])
    lay = MixtureLayout(w, np.array([10**9] * 4), batch_size=256, per="batch", seed=1, epoch_size=10**12,
                        stop_on=None)
    for first, step, count in [(7, 1024, 300), (3, 1, 2 * SPAN_PIECE + 5), (SPAN_PIECE - 2, 977, 200), (5, 8, 40)]:
        runs = first + step * np.arange(count, dtype=np.int64)
        got = lay._before(runs)
        check = np.random.default_rng(step).choice(count, 25, replace=False)
        want = np.stack([lay.counts.before(int(c)) for c in runs[check]])
        assert np.array_equal(got[check], want), (first, step)
        assert (np.diff(got, axis=0) >= 0).all()


def test_the_counts_summed_over_many_datasets_stay_in_bounded_memory():
    """With 1,000 datasets a piece of SPAN_PIECE runs' counts would be 65,537 x 1,001 int64
    (525 MB; the reviewer measured a 1.1 GB peak): pieces shrink with the number of datasets
    (SPAN_ELEMENTS counts at a time) and give the same counts as the floor sums."""
    import tracemalloc

    from fastload.sampling.mixture import SPAN_ELEMENTS, MixtureLayout

    n = 1000
    w = np.random.default_rng(3).random(n) + 0.01
    lay = MixtureLayout(w / w.sum(), np.array([10**9] * n), batch_size=2048, per="batch", seed=2,
                        epoch_size=10**13, stop_on=None)
    runs = 11 + 900 * np.arange(64, dtype=np.int64)  # summed, not floor sums (900 < SPAN_PER_RUN apart)
    tracemalloc.start()
    try:
        got = lay._before(runs)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    for i in (0, 1, 31, 63):
        assert np.array_equal(got[i], lay.counts.before(int(runs[i]))), i
    assert peak < 8 * SPAN_ELEMENTS * 6, f"{peak / 2**20:.0f} MB at the peak"


def _order(sizes, weights, per="batch", epoch_size=None, stop_on=None):
    sizes = np.asarray(sizes, dtype=np.int64)
    w = np.asarray(weights, dtype=np.float64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    return MixtureOrder(tuple(f"d{i}" for i in range(len(sizes))), sizes, starts, w / w.sum(), per, epoch_size,
                        stop_on)


@pytest.mark.parametrize("stop_on", [None, 1])
def test_the_stream_equals_the_definition_computed_whole(stop_on):
    """per="batch": the layout of every run (its counts, its slots shuffled), then each
    dataset's positions in stream order read its draws one after the other, epoch ``e``
    starting at draw ``e * (its positions per epoch)``: the old whole-epoch computation."""
    order = _order([37, 11, 5], [0.5, 0.3, 0.2], epoch_size=None if stop_on is not None else 203, stop_on=stop_on)
    for b in (1, 7, 16):
        s = MixtureSampler(order, batch_size=b, seed=5)
        lay = s.layout
        runs = -(-len(s.order_stream(0)) // b)
        ids = lay._runs(np.arange(runs))[0].ravel()[:lay.length]
        for r in range(runs):  # each run holds its counts
            assert np.bincount(ids[r * b:(r + 1) * b], minlength=3).tolist() == \
                (lay.counts.counts([r])[0].tolist() if (r + 1) * b <= lay.length else
                 np.bincount(ids[r * b:], minlength=3).tolist())
        if stop_on is not None:
            assert ids[-1] == stop_on and (ids == stop_on).sum() == order.sizes[stop_on]
        for e in (0, 3):
            want = np.empty(len(ids), np.int64)
            counts = np.bincount(ids, minlength=3)
            for i in range(3):
                where = np.flatnonzero(ids == i)
                want[where] = order.starts[i] + dataset_draws(int(order.sizes[i]), 5, i, e * int(counts[i]),
                                                              len(where), True)
            assert np.asarray(s.order_stream(e)).tolist() == want.tolist(), (b, e)
            pos = np.random.default_rng(e).integers(0, len(ids), 50)
            assert s.order_stream(e).at(pos).tolist() == want[pos].tolist()  # any positions, any order


def test_per_epoch_reads_exact_totals_in_a_keyed_order():
    order = _order([30, 20], [0.7, 0.3], per="epoch", epoch_size=100)
    s = MixtureSampler(order, batch_size=8, seed=2)
    for e in range(3):
        got = np.asarray(s.order_stream(e))
        src = (got >= 30).astype(int)
        assert np.bincount(src).tolist() == [70, 30]
        web = got[src == 0]  # draws 70e..70e+69 of dataset 0's passes, each draw once
        want = dataset_draws(30, 2, 0, 70 * e, 70, True)
        assert sorted(web.tolist()) == sorted(want.tolist())
    assert not np.array_equal(np.asarray(s.order_stream(0)) >= 30, np.asarray(s.order_stream(1)) >= 30)


@pytest.mark.parametrize("per", ["batch", "epoch"])
def test_a_mixture_epoch_of_1e10_positions_reaches_any_batch_fast_and_small(per):
    order = _order([6 * 10**9, 3 * 10**9, 10**9], [0.5, 0.3, 0.2], per=per, epoch_size=10**10)
    tracemalloc.start()
    t0 = time.perf_counter()
    s = MixtureSampler(order, batch_size=256, world_size=1024, rank=7, seed=1)
    first = next(iter(s))
    state = s.state_dict(consumed=9_876 * 256 * 1024)
    r = MixtureSampler(order, batch_size=256, world_size=1024, rank=7, seed=1)
    r.load_state_dict(state)
    resumed = next(iter(r))
    took = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert took < 2.0 and peak < 20 * 2**20, (took, peak)
    assert len(first) == len(resumed) == 256
    src = np.searchsorted(order.starts, resumed, side="right") - 1
    if per == "batch":  # the run's counts exactly
        run = 9_876 * 1024 + 7
        assert np.bincount(src, minlength=3).tolist() == s.layout.counts.counts([run])[0].tolist()
    want = r.order_stream(0).at(np.arange(run := 9_876 * 256 * 1024 + 7 * 256, run + 256))
    assert resumed.tolist() == want.tolist()
    old = {**state, "mixture": {k: v for k, v in state["mixture"].items() if k != "order"}}
    with pytest.raises(ValueError, match="saved with mixture=.*'order': 'per-position'"):
        r.load_state_dict(old)  # a state of the array layout (before) is refused, naming the difference


@pytest.mark.parametrize("per,stop_on", [("batch", None), ("batch", 2), ("epoch", None), ("epoch", 0)])
def test_a_mixture_epochs_token_count_equals_its_stream_summed(per, stop_on):
    """Packing over a mixture counts the epoch's tokens from each dataset's passes (whole
    passes from the lengths' sum): equal to the lengths of the stream's samples summed."""
    order = _order([37, 11, 5], [0.5, 0.3, 0.2], per=per, epoch_size=None if stop_on is not None else 301,
                   stop_on=stop_on)
    lengths = np.random.default_rng(4).integers(0, 50, 53)
    for shuffle in (True, False):
        s = MixtureSampler(order, batch_size=8, seed=3, shuffle=shuffle)
        for e in (0, 1, 5):
            st = s.order_stream(e)
            for max_length in (None, 20):
                tok = lengths[np.asarray(st)]
                want = int((tok if max_length is None else np.minimum(tok, max_length)).sum())
                assert st.token_total(lengths, max_length) == want, (shuffle, e, max_length)


def test_a_mixture_epochs_token_count_stops_when_its_check_says_so(monkeypatch):
    """A background planner counting the next epoch's tokens (TokenStream.count(check)) over
    a mixture's stream: ``check()`` runs before each dataset's sum and each chunk of draws
    (a stop raises there and ends the count), and changes nothing when it does not raise."""
    import fastload.sampling.mixture as mixture
    from fastload.sampling.packing import TokenStream

    monkeypatch.setattr(mixture, "CHUNK", 4)
    order = _order([37, 11, 5], [0.5, 0.3, 0.2], per="epoch", epoch_size=301)
    lengths = np.random.default_rng(5).integers(0, 50, 53)
    stream = lambda: MixtureSampler(order, batch_size=8, seed=3, shuffle=True).order_stream(1)  # noqa: E731
    st = stream()  # (a new one each time: a stream keeps its count)
    calls = []
    assert TokenStream(st, lengths).count(lambda: calls.append(1)) == int(lengths[np.asarray(st)].sum())
    assert len(calls) > 3  # one per dataset, one per chunk of a partial pass

    class Stop(Exception):
        pass

    def stop_at_third():
        calls.append(1)
        if len(calls) == 3:
            raise Stop

    calls.clear()
    with pytest.raises(Stop):
        TokenStream(stream(), lengths).count(stop_at_third)
    assert len(calls) == 3

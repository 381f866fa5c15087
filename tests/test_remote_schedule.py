"""The first-use schedule and the admission rule, against brute force (no server needed)."""
from __future__ import annotations

import numpy as np
import pytest

from fastload.remote.schedule import admission_times, epoch_end, epoch_uses, minimum_budget, sampler_uses, token_uses
from fastload.sampling import Sampler, window_permutation


def _brute_uses(stream, starts, start, end):
    first, last = {}, {}
    for p in range(start, end):
        s = int(np.searchsorted(starts, stream[p % len(stream)], side="right") - 1)
        first.setdefault(s, p)
        last[s] = p
    order = sorted(first, key=first.get)
    return order, [first[s] for s in order], [last[s] for s in order]


@pytest.mark.parametrize("start,end,chunk", [(0, None, 1 << 22), (37, 260, 16), (0, 331, 7), (250, 300, 64)])
def test_epoch_uses_equal_brute_force(start, end, chunk):
    rng = np.random.default_rng(1)
    sizes = rng.integers(1, 30, size=17)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    stream = rng.permutation(int(sizes.sum()))
    end_ = len(stream) if end is None else end  # end > len: wrap-around padding
    u = epoch_uses(stream, starts, start=start, end=end_, chunk=chunk)
    order, first, last = _brute_uses(stream, starts, start, end_)
    assert u.shards.tolist() == order
    assert u.first.tolist() == first
    assert u.last.tolist() == last


@pytest.mark.parametrize("start,end", [(0, None), (13, 200), (0, 1000), (150, 151), (390, 2900)])
def test_token_uses_equal_brute_force(start, end):
    """A packed pass counts tokens: a shard is used from the first to the last token of its
    documents in the range (wrapping around the token stream, any number of times)."""
    rng = np.random.default_rng(4)
    sizes = rng.integers(1, 12, size=9)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    stream = rng.permutation(int(sizes.sum()))
    lengths = rng.integers(0, 9, size=len(stream))  # empty documents included
    cum = np.concatenate([[0], np.cumsum(lengths[stream])])
    tokens = np.repeat(stream, lengths[stream])  # the document each token belongs to
    end_ = int(cum[-1]) if end is None else end
    u = token_uses(stream, cum, starts, start=start, end=end_)
    order, first, last = _brute_uses(tokens, starts, start, end_)
    assert u.shards.tolist() == order and u.first.tolist() == first and u.last.tolist() == last


def test_epoch_end_is_what_the_ranks_consume():
    from fastload.sampling import rank_batch_bounds

    for n, w, b, drop_last, dlb in [(1000, 3, 32, False, False), (1000, 3, 32, True, False),
                                    (1000, 4, 30, False, True), (7, 4, 2, False, False)]:
        for start in (0, 5, 90, 999):
            if start >= n:
                continue
            got = epoch_end(n, world_size=w, batch_size=b, drop_last=drop_last, drop_last_batch=dlb, start=start)
            for r in range(w):
                bounds = rank_batch_bounds(start, n, w, r, b, drop_last, dlb)
                assert (bounds[-1][2] if bounds else start) == got
                assert all(e <= got for _, e, _ in bounds)
            if not drop_last and not dlb:  # every position read (padding wraps around)
                assert got >= n


def test_epoch_end_dropping_the_last_batch_builds_no_list_of_batches():
    # 10^13 positions over 1,024 ranks: ~38 million batches a rank (a list of them: gigabytes)
    n, w, b = 10**13 + 12345, 1024, 256
    got = epoch_end(n, world_size=w, batch_size=b, drop_last_batch=True, start=7)
    per = -(-(n - 7) // w)  # padded to a multiple of the ranks
    assert got == 7 + (per // b) * b * w


def test_sampler_uses_cover_every_rank_of_the_node():
    sizes = [100] * 10
    s = Sampler(1000, batch_size=16, world_size=4, rank=2, shuffle_mode="window", shard_sizes=sizes, window=2, seed=5)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    u = sampler_uses(s, starts)
    # every shard a rank of the node reads is in the schedule, first used no later than any rank reads it
    for r in range(4):
        sr = Sampler(1000, batch_size=16, world_size=4, rank=r, shuffle_mode="window", shard_sizes=sizes, window=2,
                     seed=5)
        for idx in sr:
            sh = set((np.searchsorted(starts, idx, side="right") - 1).tolist())
            assert sh <= set(u.shards.tolist())
    # window mode: the shards come window by window, in the window order
    assert len(u) == 10 and sorted(u.shards.tolist()) == list(range(10))


def _residency(shards, first, last, admit, sizes, t):
    """Bytes of shards resident at T=t in the admission model (admitted, last use not passed)."""
    until = {}
    for s, a, la in zip(shards, admit, last):
        if a <= t:
            until[s] = max(until.get(s, -1), la)
    return sum(int(sizes[s]) for s, u in until.items() if u >= t)


@pytest.mark.parametrize("mode", ["window1", "window3", "full"])
def test_admission_in_order_within_budget_and_in_time(mode):
    rng = np.random.default_rng(3)
    sizes = rng.integers(50, 120, size=24)
    rows = rng.integers(20, 40, size=24)
    starts = np.concatenate([[0], np.cumsum(rows)])
    n = int(rows.sum())
    stream = (window_permutation(rows, int(mode[-1]), 0, 0) if mode.startswith("window") else rng.permutation(n))
    u = epoch_uses(stream, starts)
    ahead = 40
    need, at = minimum_budget(u.shards, u.first, u.last, sizes, ahead)
    # the minimum is exact: at its moment, that many bytes are required at once
    required = {int(s) for s, f, la in zip(u.shards, u.first, u.last) if f - ahead <= at <= la}
    assert need == sum(int(sizes[s]) for s in required)
    if mode == "full":
        assert need > 0.8 * sizes.sum()  # a full shuffle needs (nearly) every shard at once
    else:
        assert need < 0.6 * sizes.sum()
    for limit in (need, need + int(sizes.max()), int(sizes.sum())):
        adm = admission_times(u.shards, u.first, u.last, sizes, limit, 0)
        assert np.all(np.diff(adm) >= 0), "admission must follow first-use order"
        assert np.all(adm <= np.maximum(u.first - ahead, 0)), "a shard must be admitted by the time it is required"
        for t in sorted(set(adm.tolist()) | set((u.last + 1).tolist())):
            assert _residency(u.shards, u.first, u.last, adm, sizes, t) <= limit
    # the whole dataset fits: everything admitted at once (a mirror, in first-use order)
    assert np.all(admission_times(u.shards, u.first, u.last, sizes, int(sizes.sum()), 0) == 0)


def test_minimum_budget_of_windows():
    rows = [10] * 12
    sizes = np.full(12, 100)
    starts = np.concatenate([[0], np.cumsum(rows)])
    for w in (1, 2, 4):
        u = epoch_uses(window_permutation(rows, w, 0, 0), starts)
        # with a look-ahead of half a window, two windows overlap at a window boundary (a shard
        # whose samples all came early in its window is released before the boundary)
        need = minimum_budget(u.shards, u.first, u.last, sizes, ahead=5)[0]
        assert w * 100 < need <= 2 * w * 100 and (w > 1 or need == 200)
        # without any look-ahead one window at a time is enough
        assert minimum_budget(u.shards, u.first, u.last, sizes, ahead=0)[0] == w * 100

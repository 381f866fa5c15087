"""A pass follows its sampler at the first ``next()``, as a ``DataLoader``'s does.

A fastload pass is planned (its first batches requested) at ``iter(loader)``; PyTorch
Lightning calls ``iter(loader)`` and only then ``loader.sampler.set_epoch(epoch)`` when a fit
begins and when it reloads its dataloaders. A pass whose sampler was moved to another epoch
before its first batch is therefore re-planned for that epoch: the same batches as a Loader
set to that epoch before ``iter()``, with what had been requested for the old plan dropped
(threads joined, ring slots freed), a remote cache planned for the new pass, packing and
mixtures alike. The epoch set to the pass's own changes nothing (a loaded position stays).
"""
from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
import torch

import fastload
from fastload import Loader, vision
from fastload.errors import PassEnded


def _indices(it, limit=None) -> list[list[int]]:
    return [b["index"].tolist() for b in itertools.islice(it, limit)]


def _set_before_iter(make, epoch: int) -> list[list[int]]:
    with make() as lo:
        lo.set_epoch(epoch)
        return _indices(lo)


def _set_between_iter_and_next(make, epoch: int) -> list[list[int]]:
    with make() as lo:
        it = iter(lo)
        lo.sampler.set_epoch(epoch)  # as Lightning does (on the sampler, not lo.set_epoch)
        got = _indices(it)
        assert lo.epoch == epoch and lo.state_dict()["sampler"]["epoch"] == epoch
        return got


@pytest.fixture
def small_ds(tmp_path):
    with fastload.ShardWriter(tmp_path / "ds", {"x": "float32[4]", "label": "int64"}, shard_size=400) as w:
        w.write_batch({"x": np.zeros((100, 4), np.float32), "label": np.arange(100)})
    return tmp_path / "ds"


def test_the_epoch_set_on_the_sampler_after_iter_is_the_passs(small_ds):
    def make():
        return Loader(small_ds, batch_size=16, seed=5, fields=["label"], prefetch=3)

    want = _set_before_iter(make, 3)
    assert want != _set_before_iter(make, 0)
    assert sorted(i for b in want for i in b) == list(range(100))
    assert _set_between_iter_and_next(make, 3) == want
    with make() as lo:  # moved and moved back before the first next(): the plan made at iter() stands
        it = iter(lo)
        lo.sampler.set_epoch(3)
        lo.sampler.set_epoch(0)
        assert _indices(it) == _set_before_iter(make, 0)
    with make() as lo:  # once a batch is taken the pass is the old epoch's, as a DataLoader's
        it = iter(lo)
        first = _indices(it, 1)
        lo.sampler.set_epoch(3)
        assert first + _indices(it) == _set_before_iter(make, 0)


def test_a_loaded_position_stays_for_its_own_epoch_and_another_epoch_starts_at_zero(small_ds):
    def make():
        return Loader(small_ds, batch_size=16, seed=5, fields=["label"], prefetch=3)

    with make() as lo:
        lo.set_epoch(2)
        it = iter(lo)
        _indices(it, 3)
        state = lo.state_dict()
    assert state["sampler"]["consumed"] == 48
    with make() as lo:
        lo.load_state_dict(state)
        it = iter(lo)
        lo.sampler.set_epoch(2)
        assert lo.state_dict()["sampler"]["consumed"] == 48  # before the first batch, still the loaded one
        assert _indices(it) == _set_before_iter(make, 2)[3:]
    with make() as lo:
        lo.load_state_dict(state)
        it = iter(lo)
        lo.sampler.set_epoch(4)
        assert lo.state_dict()["sampler"]["consumed"] == 0
        assert _indices(it) == _set_before_iter(make, 4)
        end = lo.state_dict()["sampler"]
    with make() as lo:
        lo.set_epoch(4)
        _indices(lo)
        assert end == lo.state_dict()["sampler"]  # epoch 4, at its end
    with make() as lo:  # a state taken at its epoch's end: nothing, unless the epoch is moved
        lo.set_epoch(2)
        _indices(lo)
        end = lo.state_dict()
        lo.load_state_dict(end)
        assert _indices(lo) == []
        lo.load_state_dict(end)
        it = iter(lo)
        lo.sampler.set_epoch(3)
        assert _indices(it) == _set_before_iter(make, 3)


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_a_loaded_position_is_used_up_at_the_first_next_not_at_iter(tmp_path, packed):
    """``load_state_dict``, then an ``iter()`` dropped before its first ``next()`` (Lightning's
    check that the loader is iterable), or one ended by another ``iter()``: the pass iterated
    next still resumes from the loaded position (it used to begin the epoch again). Once a pass
    reached its first ``next()``, the position is used up."""
    rng = np.random.default_rng(0)
    docs = [np.arange(int(rng.integers(1, 20)), dtype=np.int32) + 100 * i for i in range(40)]
    with fastload.ShardWriter(tmp_path / "ds", {"tokens": "int32[]"}, shard_size=300) as w:
        w.write_batch({"tokens": docs})

    def make():
        kw = dict(pack_to=16) if packed else dict(fields=["tokens"])
        return Loader(tmp_path / "ds", batch_size=2, seed=4, prefetch=2, **kw)

    def rows(it, limit=None):
        return [b["tokens"].tolist() for b in itertools.islice(it, limit)]

    with make() as lo:
        lo.set_epoch(1)
        want = rows(lo)
        it = iter(lo)
        rows(it, 3)
        state = lo.state_dict()
    with make() as lo:
        lo.load_state_dict(state)
        assert len(lo) == len(want) - 3  # before a pass is planned: what is left of the epoch
        iter(lo)  # dropped untouched
        assert len(lo) == len(want)  # once planned, the whole epoch's, as a DataLoader's (Lightning
        held = iter(lo)               # counts a resumed epoch's batches up to it)
        assert rows(iter(lo)) == want[3:]  # (ended the held pass, untouched too)
        with pytest.raises(PassEnded):
            next(held)
        assert rows(lo) == want  # used up by the pass that began


def test_for_b_in_a_loader_nobody_holds_and_a_pass_ended_before_its_first_next(small_ds):
    got = []
    for b in Loader(small_ds, batch_size=16, seed=5, fields=["label"]):  # the pass holds its Loader
        got.append(b["index"].tolist())
    assert sorted(i for b in got for i in b) == list(range(100))
    with Loader(small_ds, batch_size=16, seed=5, fields=["label"]) as lo:
        it = iter(lo)
        lo.sampler.set_epoch(3)
        lo.set_epoch(4)  # the Loader's own set_epoch ends the pass, as always
        with pytest.raises(PassEnded, match=r"set_epoch\(4\)"):
            next(it)
        it = iter(lo)
        lo.close()
        with pytest.raises(PassEnded, match="closed"):
            next(it)


def test_a_mixture_follows_the_sampler(tmp_path):
    paths = []
    for k, n in (("a", 60), ("b", 40)):
        with fastload.ShardWriter(tmp_path / k, {"v": "int64"}) as w:
            w.write_batch({"v": np.arange(n) + (1000 if k == "b" else 0)})
        paths.append(tmp_path / k)

    def make():
        return Loader(paths, mix=[0.5, 0.5], epoch_size=80, batch_size=10, seed=2, prefetch=2)

    def values(epoch, between):
        with make() as lo:
            if not between:
                lo.set_epoch(epoch)
            it = iter(lo)
            if between:
                lo.sampler.set_epoch(epoch)
            return [(b["v"].tolist(), b["source"].tolist()) for b in it]

    assert values(3, True) == values(3, False) != values(0, False)


def test_packed_rows_follow_the_sampler(tmp_path):
    rng = np.random.default_rng(0)
    docs = [np.arange(int(rng.integers(1, 20)), dtype=np.int32) + 100 * i for i in range(40)]
    with fastload.ShardWriter(tmp_path / "ds", {"tokens": "int32[]"}, shard_size=300) as w:
        w.write_batch({"tokens": docs})

    def make():
        return Loader(tmp_path / "ds", batch_size=2, pack_to=16, seed=4, prefetch=2)

    def rows(epoch, between):
        with make() as lo:
            if not between:
                lo.set_epoch(epoch)
            it = iter(lo)
            if between:
                lo.sampler.set_epoch(epoch)
            got = [(b["tokens"].tolist(), b["tokens_offsets"].tolist()) for b in it]
            return got, len(lo)

    want, n = rows(3, False)
    assert rows(3, True) == (want, n) and len(want) == n and rows(0, False)[0] != want


def test_a_pass_taken_over_from_the_look_ahead_and_then_moved_leaves_nothing_behind(image_ds):
    """Epoch 0 again is requested ahead while epoch 0 ends (set_epoch was never called); the
    next pass takes those requests over at iter(), then the sampler moves to epoch 5: they are
    dropped, the feeder is made anew (its old threads joined), and epoch 5 is a fresh Loader's. (conftest
    fails the test if a thread outlives it.)"""
    kw = dict(batch_size=8, transforms={"image": vision.train(32)}, seed=3, prefetch=4)

    def feeders() -> int:
        return sum(t.name.startswith("fastload-feeder") for t in threading.enumerate())

    with Loader(image_ds, **kw) as lo:
        lo.set_epoch(5)
        want, fresh = [], set()
        for b in lo:
            want.append({k: v.clone() for k, v in b.items()})
            fresh.add(feeders())
    with Loader(image_ds, **kw) as lo:
        _indices(lo)
        it = iter(lo)
        assert lo.stats()["batches_ahead"] == kw["prefetch"]  # taken over
        lo.sampler.set_epoch(5)
        got = []
        for b in it:
            got.append({k: v.clone() for k, v in b.items()})
            assert {feeders()} == fresh  # the old feeder's threads were joined
        assert lo.stats()["batches_ahead"] == 0
        for _ in range(2):  # the ring's slots all came back: more whole epochs run
            assert len(_indices(lo)) == len(lo)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a["index"], b["index"]) and torch.equal(a["image"], b["image"])


def test_a_remote_pass_follows_the_sampler_with_its_cache_planned_for_it(remote_url, local_ds, tmp_path):
    kw = dict(batch_size=50, seed=3, shuffle_mode="window", window=1, device="cpu", prefetch=2, threads=1)
    with Loader(local_ds, **kw) as lo:
        lo.set_epoch(3)
        want = _indices(lo)
        shard_bytes = max(s["bytes"] for s in lo.dataset.manifest["shards"])
    with Loader(remote_url, cache_dir=tmp_path / "c", cache_limit=3 * shard_bytes, **kw) as lo:
        it = iter(lo)
        lo.sampler.set_epoch(3)
        assert _indices(it) == want
        assert lo.stats()["bytes_downloaded"] > 0


def test_an_error_planning_the_moved_pass_is_raised_by_its_first_next_then_passended(small_ds, monkeypatch):
    with Loader(small_ds, batch_size=16, seed=5, fields=["label"]) as lo:
        it = iter(lo)
        lo.sampler.set_epoch(3)

        def boom(epoch):
            raise OSError(f"no source for epoch {epoch}")

        monkeypatch.setattr(lo._machinery, "source", boom)
        with pytest.raises(OSError, match="epoch 3"):
            next(it)
        with pytest.raises(PassEnded, match="first next.*OSError"):
            next(it)
        monkeypatch.undo()
        assert _indices(lo) == _set_before_iter(
            lambda: Loader(small_ds, batch_size=16, seed=5, fields=["label"]), 3)

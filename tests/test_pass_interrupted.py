"""A KeyboardInterrupt (or any error) at any point of a pass's bookkeeping: the batch being
handed over is either delivered and counted, or not delivered and the pass ends (``PassEnded``
from every later ``next()``), the position before it; and whatever requests a pass, an Ahead
or a pass dropped before its first ``next()`` held end up owned (taken over or closed): none is
left in the shared feeder for the next pass to receive as its own."""
from __future__ import annotations

import gc
import itertools

import pytest

import fastload.loader.epoch as epoch_mod
from fastload import Loader, vision
from fastload.errors import PassEnded
from fastload.loader.stats import Stats
from fastload.sampling import EpochPlan

KW = dict(batch_size=8, transforms={"image": vision.train(32)}, seed=3, prefetch=4)


def _index(it, limit=None):
    return [tuple(b["index"].tolist()) for b in itertools.islice(it, limit)]


def _fresh(ds, epoch):
    with Loader(ds, **KW) as lo:
        lo.set_epoch(epoch)
        return _index(lo)


def _once(monkeypatch, owner, name, orig, nth=1):
    """Patch ``owner.name`` to raise KeyboardInterrupt at its ``nth`` call (then restored);
    returns the calls."""
    calls = []

    def interrupted(*args, **kw):
        calls.append(1)
        if len(calls) == nth:
            monkeypatch.setattr(owner, name, orig)
            raise KeyboardInterrupt
        return orig(*args, **kw)
    monkeypatch.setattr(owner, name, interrupted)
    return calls


@pytest.mark.parametrize("where", ["after_get", "counting"])
def test_ctrl_c_while_a_batch_is_handed_over_ends_the_pass_before_it(image_ds, monkeypatch, where):
    """Just after the source's ``get()`` returned (before the pass took note of it), or while
    the batch is counted: the pass ends at that batch (it used to go on, its requests one behind:
    a batch skipped, then IndexError instead of PassEnded)."""
    want = _fresh(image_ds, 0)
    with Loader(image_ds, **KW) as lo:
        lo.set_epoch(0)
        it = iter(lo)
        got = _index(it, 2)
        if where == "after_get":  # the 2nd clock read of a next(): the one after get() returned
            calls = _once(monkeypatch, epoch_mod, "perf_counter", epoch_mod.perf_counter, nth=2)
        else:
            calls = _once(monkeypatch, Stats, "delivered", Stats.delivered)
        with pytest.raises(KeyboardInterrupt):
            next(it)
        assert calls
        for _ in range(2):
            with pytest.raises(PassEnded, match="batch 3.*KeyboardInterrupt"):
                next(it)
        state = lo.state_dict()
        assert state["sampler"]["consumed"] == 16  # the position before the batch not delivered
        lo.load_state_dict(state)
        got += _index(lo)
    assert got == want


def test_ctrl_c_while_the_next_pass_decides_on_the_ahead_leaves_nothing_in_the_feeder(image_ds, monkeypatch):
    """A KeyboardInterrupt while ``iter()`` compares the Ahead held with its plan (the slot used to
    be emptied first: the Ahead's requests stayed in the feeder, and the next pass received them
    as its own, its first batches twice)."""
    want = _fresh(image_ds, 1)
    with Loader(image_ds, **KW) as lo:
        lo.set_epoch(0)
        _index(lo)  # epoch 1 requested ahead
        lo.set_epoch(1)
        calls = _once(monkeypatch, EpochPlan, "same_pass", EpochPlan.same_pass)
        with pytest.raises(KeyboardInterrupt):
            iter(lo)
        assert calls
        assert _index(lo) == want
        lo.set_epoch(2)
        assert _index(lo) == _fresh(image_ds, 2)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # raised in __del__
def test_ctrl_c_while_a_dropped_pass_hands_its_requests_back(image_ds, monkeypatch):
    """A KeyboardInterrupt while a pass dropped before its first ``next()`` hands its requests to
    the slot (in its ``close()``): they are the slot's (taken over by the next pass), never
    left unowned in the feeder (they used to be: the next pass received them as its own)."""
    want = _fresh(image_ds, 0)
    with Loader(image_ds, **KW) as lo:
        it = iter(lo)
        calls = _once(monkeypatch, lo._stats, "end_epoch", lo._stats.end_epoch)
        del it  # (the interrupt is reported as unraisable by __del__)
        gc.collect()
        assert calls
        got = _index(lo)
        assert lo.stats()["batches_ahead"] == KW["prefetch"]
    assert got == want

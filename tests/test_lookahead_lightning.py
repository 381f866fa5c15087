"""The look-ahead under PyTorch Lightning's call order: no decode wasted, every epoch's first
batches requested while the epoch before ended.

Lightning (2.x, ``fit_loop.py`` / ``training_epoch_loop.py``) never calls ``loader.set_epoch``: it
calls ``loader.sampler.set_epoch(e)`` — before ``iter(loader)`` in an epoch after the first, just
after it when a fit begins and when it reloads its dataloaders (then ``iter()`` at the old epoch,
``sampler.set_epoch(e)``, ``iter()`` again). The look-ahead used to guess the epoch after a pass
from ``loader.set_epoch`` alone, and a pass planned at ``iter()`` closed an Ahead of another
epoch at once, then its own requests were dropped by the re-plan at the first ``next()``: up to
2 x ``prefetch`` decodes thrown away and a cold first batch, every epoch; and the pass of the
``iter()`` Lightning makes only to check that the loader is iterable (dropped at once) threw its
``prefetch`` batches away when a fit began. Counted here at the image feeder
(``ImageFeeder.put``: each batch requested for decoding, by the epoch it was requested for), in
Lightning's own orders and in a real ``Trainer.fit``.
"""
from __future__ import annotations

import collections
import gc
import itertools
import json
import os
from pathlib import Path

import pytest
import torch

from fastload import Loader, vision
from fastload.errors import PassEnded
from fastload.loader.feeder import ImageFeeder
from fastload.loader.host import HostSource
from _zygote import run_python

KW = dict(batch_size=8, transforms={"image": vision.train(32)}, seed=3, prefetch=4)
EPOCHS = 4
HERE = Path(__file__).resolve().parent


@pytest.fixture
def puts(monkeypatch):
    """Batches put to the image feeder, by the epoch they were requested for."""
    counted: collections.Counter = collections.Counter()
    put = ImageFeeder.put

    def counting(self, idx, epoch):
        counted[epoch] += 1
        return put(self, idx, epoch)

    monkeypatch.setattr(ImageFeeder, "put", counting)
    return counted


def _take(it, limit=None):
    return [{k: v.clone() for k, v in b.items()} for b in itertools.islice(it, limit)]


def _fresh(ds, epoch):
    with Loader(ds, **KW) as lo:
        lo.set_epoch(epoch)
        return _take(lo)


def _same(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a["index"], b["index"]) and torch.equal(a["image"], b["image"])


# Each order: what the script does to begin epoch ``e``; returns the pass it then iterates.
def _lightning(lo, e):
    """Lightning without reloading: when the fit begins, ``iter()`` once to check the loader
    (dropped at once), ``iter()``, then ``sampler.set_epoch(0)``; later ``sampler.set_epoch(e)``
    then ``iter()``."""
    if e == 0:
        iter(lo)  # _check_dataloader_iterable
        it = iter(lo)
        lo.sampler.set_epoch(0)
        return it
    lo.sampler.set_epoch(e)
    return iter(lo)


def _lightning_reload(lo, e):
    """``reload_dataloaders_every_n_epochs=1`` (the data module returns the same Loader):
    every epoch after the first begins with ``iter()`` twice at the old epoch, then
    ``sampler.set_epoch(e)``, then ``iter()`` again."""
    if e == 0:
        return _lightning(lo, 0)
    iter(lo)
    it = iter(lo)  # held (by Lightning's data fetcher) until the next iter() returns
    lo.sampler.set_epoch(e)
    it = iter(lo)
    return it


def _iter_then_set(lo, e):
    """``iter()`` at the old epoch, then ``sampler.set_epoch(e)``, then ``next()``."""
    it = iter(lo)
    lo.sampler.set_epoch(e)
    return it


def _loader_set_epoch(lo, e):
    """The plain loop: ``loader.set_epoch(e)``, then ``iter()``."""
    lo.set_epoch(e)
    return iter(lo)


@pytest.mark.parametrize("begin", [_lightning, _lightning_reload, _iter_then_set, _loader_set_epoch],
                         ids=lambda f: f.__name__.strip("_"))
def test_each_epoch_is_requested_once_and_begins_from_the_look_ahead(image_ds, puts, begin):
    fresh = {e: _fresh(image_ds, e) for e in range(EPOCHS)}
    puts.clear()
    with Loader(image_ds, **KW) as lo:
        n = len(lo)
        for e in range(EPOCHS):
            got = _take(begin(lo, e))
            _same(got, fresh[e])
            ahead = lo.stats()["batches_ahead"]
            # epoch 0 of a fit: the requests of the pass Lightning made only to check the loader
            checked = begin in (_lightning, _lightning_reload)
            assert ahead == (KW["prefetch"] if e or checked else 0), (e, ahead, dict(puts))
    assert [puts[e] for e in range(EPOCHS)] == [n] * EPOCHS, dict(puts)  # no batch requested twice
    assert puts[EPOCHS] == KW["prefetch"] and len(puts) == EPOCHS + 1, dict(puts)  # the last guess, unused


def test_a_waiting_pass_whose_sampler_stays_reads_its_own_epoch(image_ds, puts):
    """``iter()`` while epoch 1 is requested ahead, the sampler left at epoch 0: the pass
    requests nothing until its first ``next()``, then closes epoch 1's batches and reads
    epoch 0 again, exactly."""
    want = _fresh(image_ds, 0)
    puts.clear()
    with Loader(image_ds, **KW) as lo:
        lo.set_epoch(0)
        _take(lo)
        it = iter(lo)
        assert it.waiting and dict(puts) == {0: len(lo), 1: KW["prefetch"]}  # nothing requested for it yet
        _same(_take(it), want)
        assert lo.stats()["batches_ahead"] == 0
        # epoch 1's were closed unused; epoch 0 was requested again, then (no set_epoch since the
        # pass before began) guessed once more
        assert puts[1] == KW["prefetch"] and puts[0] == 2 * len(lo) + KW["prefetch"]
        lo.set_epoch(1)  # and the epochs go on, whole
        _same(_take(lo), _fresh(image_ds, 1))


def test_a_waiting_pass_moved_to_another_epoch_reads_that_epoch(image_ds):
    with Loader(image_ds, **KW) as lo:
        lo.set_epoch(0)
        _take(lo)  # epoch 1 requested ahead
        it = iter(lo)
        lo.sampler.set_epoch(4)
        _same(_take(it), _fresh(image_ds, 4))
        assert lo.stats()["batches_ahead"] == 0
        lo.sampler.set_epoch(5)  # guessed from the sampler's set_epoch: taken over
        _same(_take(lo), _fresh(image_ds, 5))
        assert lo.stats()["batches_ahead"] == KW["prefetch"]


def test_a_waiting_pass_keeps_a_loaded_mid_epoch_position(image_ds):
    with Loader(image_ds, **KW) as lo:
        lo.set_epoch(0)
        _take(lo, 3)
        state = lo.state_dict()
    with Loader(image_ds, **KW) as lo:
        lo.set_epoch(0)
        _take(lo)  # epoch 1 requested ahead
        lo.load_state_dict(state)  # epoch 0 after its third batch
        it = iter(lo)
        assert it.waiting
        _same(_take(it), _fresh(image_ds, 0)[3:])


@pytest.mark.parametrize("end", ["close", "set_epoch", "dropped", "new_pass"])
def test_a_waiting_pass_ended_before_its_first_next(image_ds, end):
    """Whatever ends a waiting pass, the Ahead it left in place is taken over by the pass it
    was requested for, or closed with the Loader (conftest fails the test if a thread is left)."""
    lo = Loader(image_ds, **KW)
    lo.set_epoch(0)
    _take(lo)
    it = iter(lo)
    assert it.waiting
    if end == "close":
        lo.close()
        with pytest.raises(PassEnded, match="closed"):
            next(it)
        return
    if end == "set_epoch":
        lo.set_epoch(1)
    elif end == "dropped":
        del it
        gc.collect()
        lo.sampler.set_epoch(1)
    else:
        lo.sampler.set_epoch(1)
    _same(_take(iter(lo)), _fresh(image_ds, 1))
    assert lo.stats()["batches_ahead"] == KW["prefetch"]
    lo.close()


@pytest.mark.parametrize("then", ["same_pass", "sampler_moved", "set_epoch", "close", "other_thread"])
def test_a_pass_dropped_before_its_first_next_leaves_its_requests_to_the_next(image_ds, puts, then):
    """``iter(loader)`` dropped at once (Lightning's check that the loader is iterable): what it
    requested is taken over by the next pass when it is the same pass, else closed; a pass made
    in another thread is simply closed. (conftest fails the test if a thread is left.)"""
    import threading

    epoch = {"sampler_moved": 3, "set_epoch": 2}.get(then, 0)
    want = _fresh(image_ds, epoch)
    puts.clear()
    with Loader(image_ds, **KW) as lo:
        n = len(lo)
        if then == "other_thread":
            made = []
            t = threading.Thread(target=lambda: made.append(iter(lo)))
            t.start()
            t.join()
            made.clear()  # dropped here, not in the thread that made it
        else:
            iter(lo)
        assert dict(puts) == {0: KW["prefetch"]}
        if then == "close":
            return
        if then == "sampler_moved":
            lo.sampler.set_epoch(epoch)
        elif then == "set_epoch":
            lo.set_epoch(epoch)
        it = iter(lo)
        got = _take(it)
        taken = then == "same_pass"
        assert lo.stats()["batches_ahead"] == (KW["prefetch"] if taken else 0)
    _same(got, want)
    want_puts = collections.Counter({0: 0 if taken else KW["prefetch"]})  # the dropped pass's, unless taken over
    want_puts[epoch] += n
    want_puts[epoch + 1 if epoch else 0] += KW["prefetch"]  # the guess as the pass ended (set_epoch: the next)
    assert puts == want_puts


@pytest.mark.parametrize("where", ["taking_over", "refilling"])
def test_ctrl_c_while_a_waiting_pass_takes_the_look_ahead_over(image_ds, monkeypatch, where):
    """A KeyboardInterrupt at the first next() of a waiting pass whose sampler was moved to the
    Ahead's epoch, while it takes the Ahead over, or while it requests the batches after the
    first (the first not handed over): the pass ends (PassEnded after), the position stays
    before that batch, what was requested is dropped and the next epochs are whole."""
    from fastload.loader.epoch import LookAhead

    cls, name = (LookAhead, "after") if where == "taking_over" else (HostSource, "put")
    orig = getattr(cls, name)

    def interrupted(*args):
        monkeypatch.setattr(cls, name, orig)  # once
        raise KeyboardInterrupt

    with Loader(image_ds, **KW) as lo:
        lo.set_epoch(0)
        _take(lo)
        it = iter(lo)
        lo.sampler.set_epoch(1)
        monkeypatch.setattr(cls, name, interrupted)
        with pytest.raises(KeyboardInterrupt):
            next(it)
        assert getattr(cls, name) is orig  # it was reached
        with pytest.raises(PassEnded, match="KeyboardInterrupt"):
            next(it)
        assert lo.state_dict()["sampler"] == {**lo.state_dict()["sampler"], "epoch": 1, "consumed": 0}
        _same(_take(lo), _fresh(image_ds, 1))  # the state_dict's pass: epoch 1 from its start
        for e in (2, 3):
            lo.set_epoch(e)
            _same(_take(lo), _fresh(image_ds, e))


@pytest.mark.slow
@pytest.mark.parametrize("reload", [False, True], ids=["fit", "reload_every_epoch"])
def test_a_lightning_fit_decodes_each_epoch_once(image_ds, tmp_path, reload):
    """A real ``Trainer.fit`` (in a child process: tests/lightning_lookahead.py) over an image
    Loader: every epoch's batches were requested once, and every epoch began from batches
    requested before (the first: by the pass Lightning makes only to check the loader; the
    others: while the epoch before ended)."""
    pytest.importorskip("lightning", reason="pip install 'fastload[test]' (lightning)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
           "CUDA_VISIBLE_DEVICES": ""}
    args = [HERE / "lightning_lookahead.py", image_ds.path, "--epochs", EPOCHS,
            "--batch-size", KW["batch_size"], "--prefetch", KW["prefetch"]]
    # forked from the tests' launcher (tests/_zygote.py) that imported lightning: no start-up
    p = run_python(*args, *(["--reload"] if reload else []), env=env, timeout=300, cwd=tmp_path,
                   preload=("lightning",))
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    n = got["delivered"]["0"]
    puts = {int(e): k for e, k in got["puts"].items()}
    assert [got["delivered"][str(e)] for e in range(EPOCHS)] == [n] * EPOCHS
    assert [puts[e] for e in range(EPOCHS)] == [n] * EPOCHS, got
    assert puts[EPOCHS] == KW["prefetch"] and len(puts) == EPOCHS + 1, got
    assert [got["ahead"][str(e)] for e in range(EPOCHS)] == [KW["prefetch"]] * EPOCHS, got


@pytest.mark.parametrize("then", ["iter", "sampler_set_epoch", "set_epoch"])
def test_a_pass_dropped_before_its_first_next_keeps_a_loaded_position(image_ds, then):
    """``load_state_dict``, then Lightning's check ``iter()`` dropped at once: the loaded position
    is not used up by a pass that never began (it used to be: the resumed pass began the epoch
    again, its first batches delivered twice), whether the sampler's epoch is set again (to the
    loaded one) before or after the next ``iter()``."""
    want = _fresh(image_ds, 0)
    with Loader(image_ds, **KW) as lo:
        lo.set_epoch(0)
        _take(lo, 3)
        state = lo.state_dict()
    with Loader(image_ds, **KW) as lo:
        lo.load_state_dict(state)
        iter(lo)  # dropped untouched
        gc.collect()
        if then == "set_epoch":
            lo.set_epoch(0)
        it = iter(lo)
        if then == "sampler_set_epoch":  # Lightning's order when a fit resumes
            lo.sampler.set_epoch(0)
        got = _take(it)
        assert lo.stats()["batches_ahead"] == KW["prefetch"]  # the dropped pass's requests, taken over
        assert lo.state_dict()["sampler"]["consumed"] == 60  # the epoch complete
        again = _take(lo)  # the loaded position was used up by the pass that began
    _same(got, want[3:])
    _same(again, want)


def test_a_pass_dropped_before_its_first_next_does_not_use_up_set_epoch(image_ds, puts):
    """``set_epoch``, then an ``iter()`` dropped untouched (a framework's probe): the pass that
    takes its requests over still guesses the next epoch (it used to guess the same one again:
    the next epoch's first batches decoded twice, epoch 1 begun cold)."""
    with Loader(image_ds, **KW) as lo:
        n = len(lo)
        ahead = []
        for e in range(3):
            lo.set_epoch(e)
            if e == 0:
                iter(lo)  # dropped
            _take(lo)
            ahead.append(lo.stats()["batches_ahead"])
    assert ahead == [KW["prefetch"]] * 3
    assert puts == {0: n, 1: n, 2: n, 3: KW["prefetch"]}

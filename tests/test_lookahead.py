"""The Loader's look-ahead (loader/epoch.py): with image fields, the next epoch's first
batches are requested while the current epoch's last ones are consumed. Whatever the guess
and however a pass ends, every epoch delivers exactly what a fresh Loader delivers for it."""
from __future__ import annotations

import gc
import itertools
import threading

import numpy as np
import pytest
import torch

import fastload
from fastload import DecodeError, Loader, Sampler, vision
from fastload.demo.photos import photos
from _images import jpeg

KW = dict(batch_size=8, transforms={"image": vision.train(32)}, seed=3, prefetch=4)


def _take(loader, limit=None):
    return [{k: v.clone() for k, v in b.items()} for b in itertools.islice(loader, limit)]


def _fresh(ds, epoch, **kw):
    """Epoch ``epoch`` from a Loader that never ran another one (nothing requested ahead)."""
    with Loader(ds, **{**KW, **kw}) as lo:
        lo.set_epoch(epoch)
        return _take(lo)


def _same(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a["index"], b["index"])
        assert torch.equal(a["label"], b["label"]) and torch.equal(a["image"], b["image"])


def test_each_epoch_equals_a_fresh_loaders_and_its_first_batches_were_requested_ahead(image_ds):
    with Loader(image_ds, **KW) as lo:
        for e in range(3):
            lo.set_epoch(e)
            _same(_take(lo), _fresh(image_ds, e))
            ahead = lo.stats()["batches_ahead"]
            assert ahead == (0 if e == 0 else KW["prefetch"]), (e, ahead)  # all in flight when the last is taken


def test_without_set_epoch_the_same_epoch_is_requested_ahead(image_ds):
    with Loader(image_ds, **KW) as lo:
        first = _take(lo)
        again = _take(lo)
        assert lo.stats()["batches_ahead"] > 0
    _same(first, again)


def test_a_wrong_guess_is_discarded(image_ds):
    with Loader(image_ds, **KW) as lo:
        lo.set_epoch(0)
        _take(lo)  # epoch 1 is requested ahead
        lo.set_epoch(7)
        _same(_take(lo), _fresh(image_ds, 7))
        assert lo.stats()["batches_ahead"] == 0
        _take(lo)  # set_epoch(7) was called: epoch 8 is guessed, this pass re-reads 7
        assert lo.stats()["batches_ahead"] == 0


def test_load_state_dict_after_a_look_ahead_resumes_exactly(image_ds):
    with Loader(image_ds, **KW) as lo:
        lo.set_epoch(1)
        _take(lo, 3)
        state = lo.state_dict()
    with Loader(image_ds, **KW) as lo:
        lo.set_epoch(0)
        _take(lo)  # epoch 1 requested ahead from its start
        lo.load_state_dict(state)
        lo.set_epoch(1)
        rest = _take(lo)
    _same(rest, _fresh(image_ds, 1)[3:])


@pytest.mark.parametrize("stop", ["break", "exception"])
def test_a_pass_ended_early_after_its_look_ahead_began(image_ds, stop):
    """The last batches of epoch 0 are left in flight with epoch 1's first ones: both are
    dropped, the feeder is made anew, and epoch 1 is whole."""
    with Loader(image_ds, **KW) as lo:
        lo.set_epoch(0)
        it = iter(lo)
        for _ in range(6):  # sampling done after 4: epoch 1's first batches are requested
            next(it)
        if stop == "exception":
            with pytest.raises(ZeroDivisionError):
                for _b in it:
                    1 / 0  # noqa: B018  (raises)
        lo.set_epoch(1)
        _same(_take(lo), _fresh(image_ds, 1))
        assert lo.stats()["batches_ahead"] == 0


@pytest.mark.parametrize("where", ["get_batch", "wait_acquired"])
def test_ctrl_c_inside_the_last_batchs_get_leaves_the_next_epoch_whole(image_ds, monkeypatch, where):
    """Ctrl-C while the last batch of an epoch is being taken (its request gone, its ring
    batch or the feeder's record of it not yet): the feeder is out of step with the ring, so
    it is closed and drained, not kept for the next epoch (which would deliver this epoch's
    last batch first, or raw fields with another batch's images)."""
    from fastload.loader.feeder import ImageFeeder
    from fastload.ring.ring import Ring

    cls, name = (Ring, "get_batch") if where == "get_batch" else (ImageFeeder, "wait_acquired")
    orig = getattr(cls, name)
    calls = {"n": 0}

    def interrupted(self):
        calls["n"] += 1
        if calls["n"] == 8:  # the last batch of the epoch
            raise KeyboardInterrupt
        return orig(self)

    with Loader(image_ds, **KW) as lo:
        lo.set_epoch(0)
        monkeypatch.setattr(cls, name, interrupted)
        with pytest.raises(KeyboardInterrupt):
            _take(lo)
        monkeypatch.setattr(cls, name, orig)
        for e in (1, 2):
            lo.set_epoch(e)
            _same(_take(lo), _fresh(image_ds, e))


def test_closing_or_dropping_a_loader_with_batches_ahead_leaves_no_thread(image_ds):
    """(conftest's autouse fixture fails the test if a thread outlives it.)"""
    lo = Loader(image_ds, **KW)
    lo.set_epoch(0)
    _take(lo)
    assert any(t.name.startswith("fastload-feeder") for t in threading.enumerate())
    lo.close()
    lo = Loader(image_ds, **KW)
    lo.set_epoch(0)
    _take(lo)
    del lo
    gc.collect()


def test_an_undecodable_image_requested_ahead_fails_in_its_own_epoch(tmp_path):
    """Rank 0 of 2 does not read sample 5 in epoch 0 and reads it in epoch 1's first batch:
    epoch 0 ends cleanly although epoch 1's first batch (requested ahead) failed to decode;
    the error comes with that batch, naming the sample."""
    n, bs = 12, 2
    seed = next(s for s in range(1000) if _bad_only_in_next_first_batch(n, bs, s, bad=5))
    p = photos(["chelsea"])["chelsea"]
    with fastload.ShardWriter(tmp_path / "ds", {"image": "image", "label": "int64"}, label="label") as wr:
        for i in range(n):
            if i == 5:
                wr.write({"image": b"\xff\xd8\xff" + b"junk" * 50, "label": 0}, key="bad/005.jpg",
                         image_sizes={"image": (64, 64)})
            else:
                wr.write({"image": jpeg(p[i * 10:i * 10 + 100, :120]), "label": 1}, key=f"ok/{i:03d}.jpg")
    ds = fastload.Dataset(tmp_path / "ds")
    with Loader(ds, batch_size=bs, transforms={"image": vision.eval(32)}, seed=seed, rank=0, world_size=2,
                prefetch=3) as lo:
        lo.set_epoch(0)
        assert 5 not in torch.cat([b["index"] for b in _take(lo)]).tolist()
        lo.set_epoch(1)
        it = iter(lo)
        assert lo.stats()["batches_ahead"] > 0
        with pytest.raises(DecodeError, match="bad/005.jpg"):
            next(it)
    ds.close()


def _bad_only_in_next_first_batch(n: int, bs: int, seed: int, bad: int) -> bool:
    s = Sampler(n, batch_size=bs, world_size=2, rank=0, seed=seed)
    s.set_epoch(0)
    first_epoch = np.concatenate(list(s))
    s.set_epoch(1)
    return bad not in first_epoch and bad in next(iter(s))


def test_raw_fields_only_request_nothing_ahead(tmp_path):
    """Without image fields a first batch is one gather: nothing is requested ahead."""
    with fastload.ShardWriter(tmp_path / "ds", {"x": "float32[3]"}) as wr:
        wr.write_batch({"x": np.zeros((40, 3), np.float32)})
    with Loader(tmp_path / "ds", batch_size=8) as lo:
        for e in range(2):
            lo.set_epoch(e)
            assert len(_take(lo)) == 5 and lo.stats()["batches_ahead"] == 0

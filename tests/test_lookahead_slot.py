"""The look-ahead's home (issue 31): ``LookAhead`` (loader/epoch.py) owns the one Ahead slot,
built from a sampler and a source per epoch; ``EpochPlan.same_pass`` decides whether a pass
requested ahead is the one beginning. Nothing here needs a Loader: the iterator reaches only
these values, never back into the Loader."""
from __future__ import annotations

import gc
import weakref


import fastload
from fastload.loader.epoch import LookAhead
from fastload.sampling import EpochPlan, Sampler


class _Source:
    amortize = False

    def __init__(self, epoch):
        self.epoch, self.put_calls, self.closed, self.feeder_alive = epoch, [], False, True

    def put(self, batches):
        self.put_calls.append(list(batches))

    def close(self):
        self.closed = True


def _look(enabled=True):
    s = Sampler(20, batch_size=4, seed=1)
    made = []

    def source(epoch):
        made.append(_Source(epoch))
        return made[-1]
    return s, LookAhead(s, source, enabled=enabled), made


def test_same_pass_compares_epoch_start_batches_and_stream_values():
    s = Sampler(20, batch_size=4, seed=1)
    a = s.plan(2)
    assert a.same_pass(s.plan(2))  # another array with the same values
    assert a.same_pass(EpochPlan(a.epoch, a.start, a.stream.copy(), a.bounds))
    assert not a.same_pass(s.plan(3))
    assert not a.same_pass(EpochPlan(a.epoch, 4, a.stream, a.bounds))
    assert not a.same_pass(EpochPlan(a.epoch, a.start, a.stream, a.bounds[1:]))
    assert not a.same_pass(EpochPlan(a.epoch, a.start, a.stream[::-1].copy(), a.bounds))
    assert not a.same_pass(None)


def test_one_ahead_is_held_and_taken_over_by_the_same_pass_only():
    s, look, made = _look()
    request = look.after(0)  # no set_epoch: the same epoch is guessed
    ahead = request()
    assert ahead is not None and ahead.plan.epoch == 0 and made[-1].epoch == 0
    assert request() is None  # one slot
    ahead.fill(2)
    assert len(made[-1].put_calls[0]) == 2 and ahead.afters == [4, 8]
    assert look.take(s.plan(0)) is ahead and not made[-1].closed
    assert look.take(s.plan(0)) is None  # taken once
    look.after(0)()
    assert look.take(s.plan(1)) is None and made[-1].closed  # another pass: closed unused


def test_set_epoch_guides_the_guess_and_drops_an_ahead_of_another_epoch():
    s, look, made = _look()
    s.set_epoch(4)  # the Loader's set_epoch: the sampler's, then the LookAhead's
    look.set_epoch(4)
    ahead = look.after(4)()
    assert ahead.plan.epoch == 5  # set_epoch before the pass: the next epoch is guessed
    look.set_epoch(5)
    assert not made[-1].closed  # the guess was right: kept
    look.set_epoch(9)
    assert made[-1].closed  # wrong: its work stops now
    request = look.after(9)
    s.set_epoch(9)  # on the sampler alone, after the pass began (PyTorch Lightning's order) counts too
    assert request().plan.epoch == 10
    look.drop()
    look.after(9)  # epoch 9 again (the pass before it began before set_epoch(9): 10 would be guessed)
    assert look.after(9)().plan.epoch == 9  # and again: no set_epoch since the pass before began


def test_disabled_or_closed_requests_nothing():
    _, look, made = _look(enabled=False)
    assert look.after(0) is None and not made
    _, look, made = _look()
    request = look.after(0)
    _ahead = request()  # held until close()
    look.close()
    assert made[-1].closed and request() is None


def test_a_loader_s_iterator_holds_the_look_ahead_not_the_loader(tmp_path):
    """The request the iterator calls is the LookAhead's; once the pass is over, a dropped
    Loader is collected although its iterator is still referenced."""
    from fastload import vision
    from _images import write_photo_crops

    ds = fastload.Dataset(write_photo_crops(tmp_path / "ds", 12, "50KB"))
    lo = fastload.Loader(ds, batch_size=4, transforms={"image": vision.eval(16)}, prefetch=2)
    it = iter(lo)
    next(it)  # (given at the first next(): a pass dropped before it never begins the guess)
    request = it._lookahead  # noqa: SLF001
    assert isinstance(request.func.__self__, LookAhead)
    assert sum(1 for _ in it) == 2
    ref = weakref.ref(lo)
    del lo, request
    gc.collect()
    assert ref() is None
    ds.close()

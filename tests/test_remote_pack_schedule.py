"""The partial schedules a pass's scan hands a remote cache as it goes (issue 30), checked at
every step against the exact schedule of the pass scanned whole (materialised), over many
small and awkward configurations (hypothesis): documents longer than a row, documents and
windows across chunks, padding that reads the stream again, resumed passes, several ranks;
and what the background planner tells the reader it may read (``_Planner.known``)."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _remote import PlannedCache, PlannerOwner
from fastload.remote.schedule import PackScan, PassScan, epoch_uses, token_uses
from fastload.sampling.order import Natural, Shuffled, Windowed
from fastload.sampling.packing import pack_plan


def _stream(kind: str, rows: np.ndarray, seed: int, epoch: int):
    n = int(rows.sum())
    if kind == "natural":
        return Natural(n)
    if kind == "shuffled":
        return Shuffled(n, seed, epoch)
    return Windowed(rows, int(kind[len("window"):]), seed, epoch)


def _check_steps(scan, exact, step) -> int:
    """Step ``scan`` to its end (``step()`` once per state) and check every state against
    ``exact``: every shard first used before the horizon is known, the shards known are a
    prefix of the exact first-use order with their exact first uses, each last use in
    ``uses()`` no earlier than the exact one (what the cache may evict by) and in ``seen()``
    no later, last uses only ever earlier; at the end, the exact schedule. Returns the steps."""
    prev, steps = None, 0
    while True:
        u, low = scan.uses(), scan.seen()
        k = len(u)
        before = int(np.sum(exact.first < scan.horizon)) if not scan.done else len(exact)
        assert k >= before, (scan.horizon, k, before)  # what the planner tells the reader it may read
        assert u.shards.tolist() == exact.shards[:k].tolist() and u.first.tolist() == exact.first[:k].tolist()
        assert np.all(u.last >= exact.last[:k]), (scan.horizon, u.last - exact.last[:k])
        assert np.all(low.last <= exact.last[:k]) and np.all(u.last < exact.end)
        assert (u.start, u.end) == (exact.start, exact.end)
        if prev is not None:
            assert k >= len(prev) and np.all(u.last[:len(prev)] <= prev.last)
        if scan.done:
            break
        prev = u
        h = scan.horizon
        step(scan)
        assert scan.horizon > h  # a step always scans on
        steps += 1
    assert u.shards.tolist() == exact.shards.tolist() and u.last.tolist() == exact.last.tolist()
    return steps


KINDS = st.sampled_from(["natural", "shuffled", "window1", "window2", "window3"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=KINDS, shards=st.integers(1, 9), most=st.integers(1, 12), longest=st.integers(0, 200),
       length=st.integers(1, 40), rows=st.integers(1, 3), world=st.integers(1, 40), drop_last=st.booleans(),
       chunk=st.integers(1, 9), resume=st.floats(0, 1), epoch=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_every_state_of_a_pack_scan_is_conservative(kind, shards, most, longest, length, rows, world, drop_last,
                                                   chunk, resume, epoch, seed):
    """A packed pass's scan, a chunk of ``chunk`` documents per step: at every step, what
    the cache is handed never lets it evict a shard before its last use."""
    import fastload.sampling.packing as packing

    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, most + 1, size=shards)
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    n = int(starts[-1])
    lengths = rng.integers(0, longest + 1, size=n)  # empty documents, and longer than a row
    stream = _stream(kind, sizes, seed % 7, epoch)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(packing, "CHUNK", chunk)
        total = int(np.minimum(lengths, 10**9).sum())
        step = rows * length * world
        start = min(int(resume * total) // step * step, total)  # a resume is at a step's boundary
        if rng.random() < 0.3:
            start = int(resume * total)  # ... or anywhere
        plan = pack_plan(epoch, start, stream, lengths, rows=rows, length=length, world_size=world,
                         rank=int(rng.integers(world)), drop_last=drop_last)
        end = plan.bounds[-1][2] if len(plan.bounds) else plan.start
        exact = token_uses(plan.stream, plan.cum, starts, epoch=epoch, start=plan.start, end=end)
        _check_steps(PackScan(plan, starts), exact, lambda s: s.step(1))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=KINDS, shards=st.integers(1, 9), most=st.integers(1, 40), chunk=st.integers(1, 17),
       start=st.floats(0, 1), extra=st.integers(0, 300), epoch=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_every_state_of_a_pass_scan_is_conservative(kind, shards, most, chunk, start, extra, epoch, seed):
    """The same of a sampler pass's scan (positions count samples; padding past the stream
    reads it again), ``chunk`` positions per step."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, most + 1, size=shards)
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    n = int(starts[-1])
    stream = _stream(kind, sizes, seed % 7, epoch)
    s0, end = int(start * n), n + extra
    exact = epoch_uses(np.asarray(stream).copy(), starts, epoch=epoch, start=s0, end=end)
    _check_steps(PassScan(stream, starts, epoch=epoch, start=s0, end=end, chunk=chunk), exact,
                 lambda s: s.step(int(rng.integers(1, 3 * chunk))))


@pytest.mark.parametrize("packed", [False, True])
def test_the_planner_tells_the_reader_only_what_the_caches_were_handed(monkeypatch, packed):
    """_Planner stepped one chunk at a time under the test's control: ``known`` (what the
    reader may read up to) never passes what the cache was handed, and what it was handed
    is conservative for every position before ``known``; a reader asking for a position
    the scan has not reached waits (``wait_known``) and gets it, with the uses, as soon as
    the scan is past it, whatever the update schedule (EVERY_S: never by time; a clock that
    stands still: the throttle never holds an update back, see test_remote_planner.py)."""
    import fastload.loader.remote as lr
    import fastload.sampling.packing as packing

    monkeypatch.setattr(packing, "CHUNK", 5)
    monkeypatch.setattr(lr, "SCAN", 1)
    monkeypatch.setattr(lr._Planner, "EVERY_S", 1e9)
    monkeypatch.setattr(lr._Planner, "_clock", staticmethod(lambda: 0.0))
    rng = np.random.default_rng(3)
    sizes = rng.integers(3, 9, size=12)
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    n = int(starts[-1])
    if packed:
        lengths = rng.integers(0, 40, size=n)

        def scan_of(epoch):
            plan = pack_plan(epoch, 0, Windowed(sizes, 2, 1, epoch), lengths, rows=2, length=16, world_size=1,
                             rank=0, drop_last=False)
            end = plan.bounds[-1][2]
            return PackScan(plan, starts), token_uses(plan.stream, plan.cum, starts, epoch=epoch, end=end)
    else:
        def scan_of(epoch):
            stream = Windowed(sizes, 2, 1, epoch)
            return (PassScan(stream, starts, epoch=epoch, chunk=4),
                    epoch_uses(np.asarray(stream).copy(), starts, epoch=epoch))

    (scan, exact), (nxt, _) = scan_of(0), scan_of(1)
    cls = type(scan)
    gate, stepped = threading.Semaphore(0), threading.Semaphore(0)
    step = cls.step

    def gated(self, positions=None):
        if threading.current_thread().name == "fastload-plan":
            assert gate.acquire(timeout=30)
            step(self, positions)
            stepped.release()
        else:
            step(self, positions)

    monkeypatch.setattr(cls, "step", gated)
    scan.step(1)  # what the training thread scans before the pass starts
    h0 = scan.horizon
    cache = PlannedCache()
    planner = lr._Planner(PlannerOwner(cache, nxt), scan, [1])
    try:
        def handed_ok():
            assert planner.error is None, planner.error
            assert cache.updates or planner.known == h0
            if cache.updates:
                uses = cache.updates[-1][0]
                known_exact = exact.first < planner.known
                assert set(exact.shards[known_exact].tolist()) <= set(uses.shards.tolist())
                last = dict(zip(uses.shards.tolist(), uses.last.tolist()))
                assert all(last[s] >= la for s, la in zip(exact.shards.tolist(), exact.last.tolist()) if s in last)

        waits = 0
        while planner.known < scan.end:
            handed_ok()
            want = planner.known + 1
            got = threading.Event()
            reader = threading.Thread(target=lambda w=want, g=got: (planner.wait_known(w), g.set()))
            reader.start()
            for _ in range(3000):  # the reader waits before the scan goes on
                if planner._wanted >= want:
                    break
                got.wait(0.01)
            assert planner._wanted >= want
            while not got.is_set():  # one chunk at a time until the reader may go on
                gate.release()
                assert stepped.acquire(timeout=30)
                got.wait(10 if scan.horizon >= want else 0.01)  # (returns once set: generous for a loaded machine)
                assert got.is_set() or scan.horizon < want or planner.known >= want
            reader.join()
            assert planner.known >= want
            waits += 1
        handed_ok()
        assert waits >= 3
        assert cache.updates[-1][0].same_as(exact)  # the exact schedule once the scan is over
    finally:
        planner._stop.set()
        for _ in range(1000):
            gate.release()
        planner.stop()

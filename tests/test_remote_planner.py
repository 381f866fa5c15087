"""The background planner of a long remote pass (``fastload.loader.remote._Planner``): how a
reader's waits on it are counted in the stats, end when the Loader closes, and are served by
its updates; how it stops (bounded, and promptly while it counts the next epoch's tokens).

The planner thread's steps run one at a time under the test's control (``_Steps``), and its
update schedule reads a clock the test sets: nothing depends on how fast the machine is."""
from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest

import fastload
import fastload.loader.remote as lr
from _remote import PlannedCache, PlannerOwner, batches
from fastload.errors import PassEnded
from fastload.remote.schedule import PackScan, PassScan
from fastload.sampling.order import Windowed
from fastload.sampling.packing import TokenStream, pack_plan

PLAN = "fastload-plan"  # the planner thread's name


class _Steps:
    """The planner thread's steps of ``cls`` scans, one per :meth:`step` (it then comes back
    to the gate: its update, if any, is made); :meth:`open` lets it run freely."""

    def __init__(self, monkeypatch, cls=PassScan):
        self._gate, self._arrived = threading.Semaphore(0), threading.Semaphore(0)
        self._open = False
        step = cls.step

        def gated(scan, positions=None):
            if threading.current_thread().name == PLAN and not self._open:
                self._arrived.release()
                self._gate.acquire(timeout=60)
            step(scan, positions)

        monkeypatch.setattr(cls, "step", gated)

    def at_gate(self) -> None:
        assert self._arrived.acquire(timeout=30), "the planner never came to its next step"

    def step(self) -> None:
        self._gate.release()
        self.at_gate()

    def open(self) -> None:
        self._open = True
        self._gate.release()
        self._gate.release()


def _reader(planner, position: int) -> tuple[threading.Event, dict]:
    """``planner.wait_known(position)`` in a thread, returned once it waits (or is done):
    (done, {"error": what it raised})."""
    done, out = threading.Event(), {}

    def run():
        try:
            planner.wait_known(position)
        except BaseException as e:  # noqa: BLE001 - what the test checks
            out["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name="test-reader", daemon=True).start()
    for _ in range(3000):
        if done.is_set() or planner._wanted >= position:
            break
        done.wait(0.01)
    return done, out


def _pass(sizes, epoch: int = 0) -> PassScan:
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return PassScan(Windowed(sizes, 2, 1, epoch), starts, epoch=epoch, chunk=4)


def _held_planner(monkeypatch, planners, cache: PlannedCache | None = None) -> tuple[_Steps, lr._Planner]:
    """A planner of a 1,500-position pass whose first 800 positions are known (scanned before
    it starts), its thread held at the gate before its next step (:class:`_Steps`)."""
    steps = _Steps(monkeypatch)
    planners.append(steps)
    scan = _pass(np.full(60, 25))
    scan.step(800)
    planner = lr._Planner(PlannerOwner(PlannedCache() if cache is None else cache, _pass(np.full(60, 25), 1)),
                          scan, [1])
    planners.append(planner)
    steps.at_gate()
    return steps, planner


@pytest.fixture
def planners():
    """Planners (and _Steps) made by the test: stopped, let go, their threads gone at its end."""
    made: list = []
    yield made
    for p in made:
        if isinstance(p, _Steps):
            p.open()
        else:
            p._stop.set()
    for p in made:
        if not isinstance(p, _Steps):
            p._thread.join(30)
            assert not p._thread.is_alive()


# -- 1. the reader's waits are counted in the Loader's stats --------------------------------
def test_a_wait_for_the_plan_is_counted_in_the_stats(remote_url, tmp_path, monkeypatch):
    """The planner held at its first step until the reader has waited for it 0.3 s: the
    epoch's stats count that wait (``plan_wait_s``, ``plan_waits``), and the log line says it."""
    from fastload.loader.epoch import _download_line

    monkeypatch.setattr(lr, "SYNC_POSITIONS", 100)
    monkeypatch.setattr(lr, "SCAN", 40)
    release, held = threading.Event(), []
    step = PassScan.step

    def holding(scan, positions=None):
        if threading.current_thread().name == PLAN and not held:
            held.append(True)
            assert release.wait(60)
        step(scan, positions)

    monkeypatch.setattr(PassScan, "step", holding)
    kw = dict(batch_size=50, seed=3, device="cpu", prefetch=2, threads=1)
    with fastload.Loader(remote_url, cache_dir=tmp_path / "c", **kw) as lo:
        planner = lo._remote._planner
        assert planner is not None, "a pass longer than SYNC_POSITIONS is planned in the background"

        def watch():  # the reader blocked on the held planner: 0.3 s more, then the planner goes on
            for _ in range(6000):
                if planner._wanted > planner.known:
                    time.sleep(0.3)
                    break
                time.sleep(0.005)
            release.set()

        watcher = threading.Thread(target=watch, name="test-watcher")
        watcher.start()
        try:
            got = batches(lo, epochs=(0,))
        finally:
            release.set()
            watcher.join()
        st = lo.stats()
    assert len(got) == len(lo)
    assert st["plan_waits"] >= 1 and st["plan_wait_s"] >= 0.3, st
    assert "s for the plan of a long pass" in _download_line(st)
    assert "for the plan" not in _download_line(dict(st, plan_waits=0))


def test_the_planner_counts_each_wait_and_its_time(monkeypatch, planners):
    """``wait_s`` / ``waits``: a reader's wait for a position not known yet counts once,
    with its time; a position known already counts nothing."""
    clock = [0.0]
    monkeypatch.setattr(lr._Planner, "_clock", staticmethod(lambda: clock[0]))
    monkeypatch.setattr(lr, "SCAN", 1)
    steps, planner = _held_planner(monkeypatch, planners)
    planner.wait_known(800)  # known: no wait
    assert (planner.wait_s, planner.waits) == (0.0, 0)
    done, out = _reader(planner, 801)
    time.sleep(0.05)  # (at least this long, however loaded the machine)
    steps.step()
    assert done.wait(30) and not out
    assert planner.waits == 1 and planner.wait_s >= 0.05


# -- 2. a wait ended by a stop raises PassEnded ----------------------------------------------
def test_a_reader_waiting_when_the_planner_stops_gets_pass_ended(monkeypatch, planners):
    """A reader waiting for the plan when another thread stops the planner (a Loader closed
    meanwhile) raises PassEnded at once, not a later error of the closed cache; a wait for
    what is known, a stopped planner's included, and a normal end, still return."""
    monkeypatch.setattr(lr, "SCAN", 1)
    monkeypatch.setattr(lr._Planner, "EVERY_S", 1e9)  # (no update because a second went by on a loaded machine)
    steps, planner = _held_planner(monkeypatch, planners)
    done, out = _reader(planner, 900)
    assert not done.is_set()
    stopper = threading.Thread(target=planner.stop, name="test-stopper")  # (joins the held thread: apart)
    stopper.start()
    try:
        assert done.wait(30)
    finally:
        steps.open()
        stopper.join(30)
    assert isinstance(out.get("error"), PassEnded), out
    assert "closed" in str(out["error"]) and "900" in str(out["error"])
    planner.wait_known(800)  # known before the stop: no error
    with pytest.raises(PassEnded):
        planner.wait_known(801)

    done_scan = _pass(np.full(20, 25))  # a pass planned to its end, then stopped
    done_scan.step(100)
    finished = lr._Planner(PlannerOwner(PlannedCache(), _pass(np.full(20, 25), 1)), done_scan, [1])
    planners.append(finished)
    finished.wait_known(done_scan.end + 50)  # (past the end: up to the end)
    assert finished.known == done_scan.end
    finished.stop()
    finished.wait_known(done_scan.end)


def test_a_loader_closed_while_its_reader_waits_for_the_plan(remote_url, tmp_path, monkeypatch):
    """Loader.close() from another thread while the training loop's next() waits for the
    planner: that next() raises PassEnded saying the Loader was closed, at once."""
    monkeypatch.setattr(lr, "SYNC_POSITIONS", 100)
    monkeypatch.setattr(lr, "SCAN", 40)
    planner_box: list = []
    step = PassScan.step

    def holding(scan, positions=None):  # the planner held until it is stopped
        if threading.current_thread().name == PLAN:
            for _ in range(6000):
                if planner_box and planner_box[0]._stop.is_set():
                    break
                time.sleep(0.005)
        step(scan, positions)

    monkeypatch.setattr(PassScan, "step", holding)
    kw = dict(batch_size=50, seed=3, device="cpu", prefetch=2, threads=1)
    lo = fastload.Loader(remote_url, cache_dir=tmp_path / "c", **kw)
    try:
        planner = lo._remote._planner
        planner_box.append(planner)
        out: dict = {}

        def read():
            try:
                for _ in lo:
                    pass
            except BaseException as e:  # noqa: BLE001 - what the test checks
                out["error"] = e

        reader = threading.Thread(target=read, name="test-loop")
        reader.start()
        for _ in range(6000):
            if planner._wanted > planner.known or not reader.is_alive():
                break
            time.sleep(0.005)
        assert planner._wanted > planner.known, "the reader never waited for the held planner"
    finally:
        lo.close()
    reader.join(30)
    assert not reader.is_alive()
    assert isinstance(out.get("error"), PassEnded), out
    assert "closed" in str(out["error"])


# -- 3. updates for a waiting reader ---------------------------------------------------------
def test_a_waiting_reader_is_updated_at_once_then_within_the_throttle(monkeypatch, planners):
    """Each update costs 1 s of the planner's clock, each chunk scanned 1 s. A reader that
    waits for a position the scan has passed gets its update at that step, though the last
    update was just made, unless that update was itself for a waiting reader: a reader that
    waits at every chunk (faster than the scan) is updated once per THROTTLE chunks, so the
    updates take a tenth of the time, not half of it, and each tells it THROTTLE chunks more."""
    clock = [0.0]
    monkeypatch.setattr(lr._Planner, "_clock", staticmethod(lambda: clock[0]))
    monkeypatch.setattr(lr._Planner, "EVERY_S", 1e9)
    monkeypatch.setattr(lr, "SCAN", 1)

    class Costly(PlannedCache):
        def update(self, pass_no, uses, next_uses=None):
            clock[0] += 1.0
            return super().update(pass_no, uses, next_uses)

    cache = Costly()
    # 800 positions scanned first: (mark = 1600 > end: no update for scanning as far again)
    steps, planner = _held_planner(monkeypatch, planners, cache)

    def wait_for_next(*, most: int = 100) -> int:
        """A reader waiting for the first position not known: the steps until it may go on."""
        want = planner.known + 1
        done, _ = _reader(planner, want)
        assert not done.is_set()
        for n in range(1, most + 1):
            clock[0] += 1.0
            steps.step()
            if planner.known >= want:
                assert done.wait(30)
                return n
        raise AssertionError(f"not updated within {most} steps")

    assert wait_for_next() == 1  # the first wait: at once
    t0, updates0 = clock[0], len(cache.updates)
    throttled = [wait_for_next() for _ in range(4)]  # waiting at every chunk
    assert throttled == [lr._Planner.THROTTLE] * 4, throttled
    update_s = len(cache.updates) - updates0
    assert update_s / (clock[0] - t0) <= 0.1 + 1e-9
    # an update of the planner's own (a second went by) just made; then a reader waits: at once
    planner.EVERY_S = 0.0
    clock[0] += 100.0
    before = len(cache.updates)
    steps.step()
    assert len(cache.updates) == before + 1
    planner.EVERY_S = 1e9
    assert wait_for_next() == 1
    steps.open()


# -- 4. stop: bounded, and prompt while counting ---------------------------------------------
def test_stop_is_bounded_and_warns_when_the_thread_does_not_end(monkeypatch, planners, caplog):
    """A planner thread that does not come back (held in a step): stop(timeout) returns
    False after the timeout with a warning naming the thread; the Loader's bound is its
    caches' retry.close_s."""
    steps, planner = _held_planner(monkeypatch, planners)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="fastload"):
        assert planner.stop(timeout=0.2) is False
    assert 0.2 <= time.monotonic() - t0 < 20
    assert "did not end within 0.2 s" in caplog.text and PLAN in caplog.text
    steps.open()
    planner._thread.join(30)
    assert not planner._thread.is_alive()

    class Policy:
        close_s = 0.7

    class Cache:
        policy = Policy()

    class Stopped:
        wait_s, waits = 0.5, 2

        def stop(self, timeout):
            self.timeout = timeout

    class Owner:  # what RemoteShards._stop_planner reads
        _caches = [Cache()]
        _planner = Stopped()
        _lock = threading.Lock()
        _plan_wait_s, _plan_waits = 1.0, 1

    owner = Owner()
    stopped = owner._planner
    lr.RemoteShards._stop_planner(owner)  # type: ignore[arg-type]
    assert stopped.timeout == 0.7 and owner._planner is None
    assert (owner._plan_wait_s, owner._plan_waits) == (1.5, 3)  # its reader's waits still counted


def test_stop_ends_the_count_of_the_next_epochs_tokens_at_once(monkeypatch, planners):
    """The next epoch's packed plan counts its tokens chunk by chunk (a stream that does not
    read every sample once): a stop during that count ends it before the next chunk, and
    the planner plans nothing more."""
    import fastload.sampling.packing as packing

    monkeypatch.setattr(packing, "CHUNK", 5)
    rng = np.random.default_rng(11)
    sizes = np.full(40, 50)
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    lengths = rng.integers(1, 30, size=int(starts[-1]))

    def packed(epoch, start, check=None):
        plan = pack_plan(epoch, start, Windowed(sizes, 2, 987_001, epoch), lengths, rows=2, length=16, world_size=1,
                         rank=0, drop_last=False, check=check)
        return PackScan(plan, starts)

    counted, entered, made = [], threading.Event(), []
    tokens = TokenStream._tokens

    def counting(self, j, idx=None):
        if threading.current_thread().name == PLAN:
            counted.append(j)
            if len(counted) == 1:
                entered.set()
                for _ in range(6000):  # until stopped (the planner's thread may begin before it is assigned)
                    if made and made[0]._stop.is_set():
                        break
                    time.sleep(0.005)
        return tokens(self, j, idx)

    monkeypatch.setattr(TokenStream, "_tokens", counting)
    scan = packed(0, 0)
    scan.step()  # this pass: planned whole (its tokens counted here), the next epoch's is the planner's
    assert scan.done
    cache = PlannedCache()
    planner = lr._Planner(PlannerOwner(cache, packed), scan, [1])
    made.append(planner)
    planners.append(planner)
    assert entered.wait(30)
    assert planner.stop(timeout=30) is True
    assert counted == [counted[0]], f"{len(counted) - 1} chunks counted after the stop"
    assert planner.error is None and not cache.updates


def test_a_stop_landing_while_the_planner_steps_tells_the_reader_nothing_more(monkeypatch, planners):
    """The reviewer's interleaving: a reader waits for position 801, a stop (Loader.close in
    another thread) lands while the planner is in its step; the step's update tells no cache
    (stopped) and so must not tell the reader either: its wait raises PassEnded, never returns
    as if 801 were planned."""
    monkeypatch.setattr(lr, "SCAN", 1)
    cache = PlannedCache()
    steps, planner = _held_planner(monkeypatch, planners, cache)
    planner._wanted = 801  # (what wait_known(801) sets before it waits)
    planner._stop.set()  # (what stop() sets first, before it joins)
    steps.open()
    planner._thread.join(30)
    assert not planner._thread.is_alive()
    assert planner.known == 800 and not cache.updates
    with pytest.raises(PassEnded):
        planner.wait_known(801)

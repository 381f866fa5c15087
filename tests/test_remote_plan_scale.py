"""A remote cache's plan at scale (issue 30): the first-use schedule is computed from the
per-position order in chunks, never from the epoch's stream materialised, and equals the
schedule of the materialised stream exactly."""
from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest

import fastload
from _remote import assert_same, batches
from fastload.remote.schedule import epoch_end, epoch_uses, pack_uses, sampler_uses, token_uses
from fastload.sampling import Sampler
from fastload.sampling.order import Natural, Shuffled, Stream, Windowed
from fastload.sampling.packing import pack_plan


def _same(a, b):
    assert a.shards.tolist() == b.shards.tolist()
    assert a.first.tolist() == b.first.tolist() and a.last.tolist() == b.last.tolist()
    assert (a.start, a.end) == (b.start, b.end)


@pytest.mark.parametrize("kind", ["natural", "shuffled", "window"])
@pytest.mark.parametrize("uniform", [True, False])
@pytest.mark.parametrize("start,extra", [(0, 0), (0, 7), (1234, 0), (4999, 13), (3, 10_000)])
def test_uses_of_a_stream_equal_those_of_its_array(kind, uniform, start, extra):
    """Per position (chunks of 97 positions, so that chunks, shards and wrap-around padding
    cross one another) equals the materialised stream, for every kind of order: the natural
    one (no position scanned), the shuffle and windows, with equal shards (a division) or not
    (a search), from a resumed position, past the stream's end (padding), several times."""
    rng = np.random.default_rng(7)
    rows = np.full(40, 125) if uniform else rng.integers(0, 300, size=40)  # empty shards included
    if uniform:
        rows[-1] = 60  # the last shard may be shorter
    starts = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
    n = int(starts[-1])
    stream: Stream = (Natural(n) if kind == "natural" else Shuffled(n, 3, 1) if kind == "shuffled"
                      else Windowed(rows, 3, 3, 1))
    end = n + extra
    got = epoch_uses(stream, starts, start=start, end=end, chunk=97)
    want = epoch_uses(np.asarray(stream).copy(), starts, start=start, end=end, chunk=1 << 20)
    _same(got, want)
    # and the brute force of the old test (tests/test_remote_schedule.py) on a small end
    arr = np.asarray(stream)
    pos = np.arange(start, end)
    sh = np.searchsorted(starts, arr[pos % n], side="right") - 1
    first = {}
    for p, s in zip(pos.tolist(), sh.tolist()):
        first.setdefault(s, p)
    assert got.shards.tolist() == sorted(first, key=first.get)


@pytest.mark.parametrize("start,world,drop_last", [(0, 3, False), (777_777, 8, False), (0, 5000, False),
                                                   (123_456, 4, True)])
def test_pack_uses_read_the_token_stream_in_chunks(start, world, drop_last):
    """A packed pass's schedule from its token stream's chunks (several of 65,536 documents)
    equals the one from its materialised documents and token counts."""
    rng = np.random.default_rng(11)
    n = 150_000
    rows = rng.integers(1, 9000, size=30)
    rows = np.round(rows / rows.sum() * n).astype(np.int64)
    rows[-1] += n - rows.sum()
    starts = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
    lengths = rng.integers(0, 40, size=n)  # empty documents included
    plan = pack_plan(0, start, Shuffled(n, 5, 0), lengths, rows=4, length=256, world_size=world, rank=0,
                     drop_last=drop_last)
    end = plan.bounds[-1][2] if len(plan.bounds) else plan.start
    want = token_uses(plan.stream, plan.cum, starts, start=plan.start, end=end)
    got = pack_uses(plan, starts)
    _same(got, want)
    assert len(got) > 0


def _forbid_materialising(monkeypatch):
    def refuse(self, *a, **k):
        raise AssertionError(f"{type(self).__name__} of {len(self):,} positions materialised")

    monkeypatch.setattr(Stream, "__array__", refuse)


def test_sampler_uses_never_materialise_the_stream(monkeypatch):
    """The plan of a pass (and the next epoch's) of a sampler: no stream held whole."""
    _forbid_materialising(monkeypatch)
    rows = [1000] * 50
    starts = np.concatenate([[0], np.cumsum(rows)])
    for kw in (dict(), dict(shuffle_mode="window", shard_sizes=rows, window=2), dict(shuffle=False)):
        s = Sampler(50_000, batch_size=32, world_size=3, rank=1, seed=2, **kw)
        for e in (0, 1):
            u = sampler_uses(s, starts, epoch=e)
            assert sorted(u.shards.tolist()) == list(range(50))
            assert u.end == epoch_end(50_000, world_size=3, batch_size=32)


@pytest.mark.slow
def test_the_plan_of_a_large_pass_holds_no_array_over_its_positions():
    """10^7 positions over 1,000 shards: the largest memory the plan holds at once (Python
    allocations and numpy's, tracemalloc's peak) stays a few MB, not ~40-80 MB of indices (the
    stream materialised: what the plan cost before)."""
    n, shards = 10**7, 1000
    starts = np.arange(shards + 1, dtype=np.int64) * (n // shards)
    s = Sampler(n, batch_size=256, world_size=1024, rank=0, seed=1)
    tracemalloc.start()
    try:
        u = sampler_uses(s, starts)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(u) == shards and u.first.max() < 100_000 and u.last.min() > n - 100_000
    assert peak < 24 * 2**20, f"planning held {peak / 2**20:.1f} MB at once"


def test_a_remote_loader_never_materialises_its_stream(remote_url, local_ds, tmp_path, monkeypatch):
    """A Loader over a URL plans every pass (the warm start, each epoch, the next epoch's, a
    resume) from the per-position order: the batches equal the local dataset's, and no
    stream is ever held whole."""
    kw = dict(batch_size=50, seed=3, device="cpu", prefetch=2, threads=1)
    with fastload.Loader(local_ds, **kw) as lo:
        want = batches(lo, epochs=(0, 1))
    _forbid_materialising(monkeypatch)
    with fastload.Loader(remote_url, cache_dir=tmp_path / "c", **kw) as lo:
        got = batches(lo, epochs=(0,))
        it = iter(lo.set_epoch(1) or lo)
        got += [{k: v.numpy().copy() for k, v in next(it).items()} for _ in range(7)]
        state = lo.state_dict()
    with fastload.Loader(remote_url, cache_dir=tmp_path / "c2", **kw) as lo:
        lo.load_state_dict(json.loads(json.dumps(state)))
        got += [{k: v.numpy().copy() for k, v in b.items()} for b in lo]
    assert_same(got, want)


@pytest.mark.parametrize("kind", ["shuffled", "window1", "window3", "natural"])
def test_a_pass_scan_knows_more_at_each_step_and_never_too_little(kind):
    """At every step of a scan: the shards known are a prefix of the exact first-use order
    (exact first uses), each last use in :meth:`uses` no earlier than the exact one and in
    :meth:`seen` no later; a window's shards get their exact last use once the scan is past
    their window; at the end, the exact schedule."""
    from fastload.remote.schedule import PassScan

    rng = np.random.default_rng(5)
    rows = rng.integers(20, 60, size=30)
    starts = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
    n = int(starts[-1])
    stream = (Shuffled(n, 1, 2) if kind == "shuffled" else Natural(n) if kind == "natural"
              else Windowed(rows, int(kind[-1]), 1, 2))
    end = n + 17  # padding: the first positions again
    exact = epoch_uses(np.asarray(stream).copy(), starts, start=40, end=end)
    scan = PassScan(stream, starts, start=40, end=end, chunk=13)
    last_of = dict(zip(exact.shards.tolist(), exact.last.tolist()))
    prev = None
    while True:
        u, low = scan.uses(), scan.seen()
        k = len(u)
        assert u.shards.tolist() == exact.shards[:k].tolist() and u.first.tolist() == exact.first[:k].tolist()
        assert np.all(u.last >= exact.last[:k]) and np.all(low.last <= exact.last[:k])
        assert np.all(u.last < end)
        if prev is not None:  # only ever more, and earlier last uses
            assert len(u) >= len(prev) and np.all(u.last[:len(prev)] <= prev.last)
        if kind.startswith("window"):
            for s, la in zip(u.shards.tolist(), u.last.tolist()):
                if scan.horizon >= scan.bound[s]:
                    assert la == last_of[s]
        if scan.done:
            break
        prev = u
        scan.step(50)
    _same(scan.uses(), exact)


def test_the_timeline_takes_a_pass_as_its_scan_goes_on():
    """Timeline.update: the download queue keeps its place, admissions only move earlier, and
    the end is the exact schedule's admission; a use list that is not an extension is refused."""
    from fastload.remote.cache_timeline import Timeline
    from fastload.remote.schedule import PassScan, admission_times

    rows = [30] * 20
    starts = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
    sizes = np.full(20, 100, np.int64)
    stream = Windowed(rows, 2, 0, 0)
    exact = epoch_uses(stream, starts)
    limit = 500
    scan = PassScan(stream, starts, chunk=16)
    scan.step(100)
    tl = Timeline(sizes, ahead=10)
    tl.plan(scan.uses(), None, limit)
    j = tl.next_use()
    tl.take(j, 0)
    before = tl._u_admit.copy()
    while not scan.done:
        scan.step(100)
        tl.update(scan.uses(), None, limit)
        assert tl.next_use() == j + 1
        assert np.all(tl._u_admit[:len(before)] <= before)
        before = tl._u_admit.copy()
    nxt = epoch_uses(Windowed(rows, 2, 0, 1), starts, epoch=1)
    tl.update(scan.uses(), nxt, limit)
    want = admission_times(exact.shards, exact.first, exact.last, sizes, limit, 0)
    assert tl._u_admit[:len(exact)].tolist() == want.tolist()
    assert len(tl._u_shard) == len(exact) + len(nxt)
    with pytest.raises(ValueError, match="extended"):
        tl.update(epoch_uses(Windowed(rows, 2, 9, 0), starts), None, limit)


@pytest.mark.parametrize("mode,window,limit_shards", [("window", 1, 4), ("window", 2, 6), ("full", None, None)])
def test_a_remote_loader_reads_while_its_plan_is_scanned(remote_url, local_ds, tmp_path, monkeypatch, mode, window,
                                                         limit_shards):
    """A pass longer than what is scanned before it starts (here: 100 positions of 3,000;
    at scale 2^22) is planned as its scan goes on in the background (slowed down here, so
    that the reader reads while it does): the batches equal the local dataset's over two
    epochs and a resume, the budget holds at every moment, and shards are evicted."""
    import time

    import fastload.loader.remote as lr
    from _remote import read_while_planned
    from fastload.remote.schedule import PassScan

    kw = dict(batch_size=50, seed=3, shuffle_mode=mode, window=window, device="cpu", prefetch=2, threads=1)
    with fastload.Loader(local_ds, **kw) as lo:
        want = batches(lo, epochs=(0, 1))
        shard_bytes = max(s["bytes"] for s in lo.dataset.manifest["shards"])
    monkeypatch.setattr(lr, "SYNC_POSITIONS", 100)
    monkeypatch.setattr(lr, "SCAN", 40)
    monkeypatch.setattr(lr._Planner, "EVERY_S", 0.0)  # the caches updated at every step
    step = PassScan.step

    def slow(self, positions=None):
        time.sleep(0.003)
        return step(self, positions)

    monkeypatch.setattr(PassScan, "step", slow)
    updates = []
    update = lr._Planner._update
    monkeypatch.setattr(lr._Planner, "_update", lambda self, nxt: (updates.append(self._scan.horizon),
                                                                   update(self, nxt))[1])
    limit = None if limit_shards is None else limit_shards * shard_bytes
    got, scanning, peak, st = read_while_planned(remote_url, tmp_path / "c", limit, kw)
    assert_same(got, want)
    assert len(updates) > 20 and sum(scanning) >= 5, (len(updates), sum(scanning))  # read while planned
    if limit is not None:
        assert peak <= limit, f"{peak} bytes on disk > cache_limit {limit}"
        assert st["evictions"] > 0


def test_a_budget_found_too_small_as_the_plan_is_scanned_stops_the_reader(remote_url, tmp_path, monkeypatch):
    """The budget is checked on what is scanned before the pass starts (a full shuffle needs
    every shard from its first positions on: refused at construction, as before); a need
    found later by the background scan (here: the next window) fails the reader at once with
    CacheTooSmall naming the minimum, not a download timeout."""
    import time

    import fastload.loader.remote as lr
    from fastload.errors import CacheTooSmall

    monkeypatch.setattr(lr, "SYNC_POSITIONS", 100)
    kw = dict(batch_size=50, seed=3, device="cpu", prefetch=2, download_timeout=60)
    with fastload.Dataset(remote_url, cache_dir=tmp_path / "x") as ds:
        one = max(s["bytes"] for s in ds.manifest["shards"])
    with pytest.raises(CacheTooSmall):
        fastload.Loader(remote_url, cache_dir=tmp_path / "c", cache_limit=4 * one, **kw)
    t0 = time.monotonic()
    with fastload.Loader(remote_url, cache_dir=tmp_path / "c", cache_limit=one, shuffle_mode="window", window=1,
                         **kw) as lo:
        with pytest.raises(CacheTooSmall, match="too small") as e:
            for _ in lo:
                pass
    assert e.value.minimum > one and time.monotonic() - t0 < 30


def test_a_resumed_pass_is_planned_as_its_scan_goes_on(remote_url, local_ds, tmp_path, monkeypatch):
    """A resume (an empty cache, a tight budget, window mode) whose pass is scanned in the
    background from the resumed position: every remaining batch equals the local dataset's."""
    import fastload.loader.remote as lr

    kw = dict(batch_size=40, seed=5, shuffle_mode="window", window=1, device="cpu", prefetch=2)
    with fastload.Loader(local_ds, **kw) as lo:
        want = batches(lo)
    monkeypatch.setattr(lr, "SYNC_POSITIONS", 100)
    monkeypatch.setattr(lr, "SCAN", 64)
    monkeypatch.setattr(lr._Planner, "EVERY_S", 0.0)
    with fastload.Loader(remote_url, cache_dir=tmp_path / "c1", cache_limit="150kB", **kw) as lo:
        it = iter(lo)
        first = [{k: v.numpy().copy() for k, v in next(it).items()} for _ in range(30)]
        state = lo.state_dict()
    with fastload.Loader(remote_url, cache_dir=tmp_path / "c2", cache_limit="150kB", **kw) as lo:
        lo.load_state_dict(json.loads(json.dumps(state)))
        rest, starts = [], []
        for b in lo:
            rest.append({k: v.numpy().copy() for k, v in b.items()})
            planner = lo._remote._planner
            starts.append(None if planner is None else planner._scan.start)
    assert_same(first + rest, want)
    assert starts[0] == 30 * 40  # (the pass planned from the resumed position, in the background)


def test_a_pass_resumed_near_the_end_leaves_the_next_epoch_to_the_background(remote_url, local_ds, tmp_path,
                                                                            monkeypatch):
    """A resume at the last batch of a long epoch (here: 3,000 positions scanned 100 before a
    pass starts; at scale 10^10 and 2^22): the training thread scans what is left of the pass,
    never the next epoch (it used to, whole, before the first batch: ~15 min at 10^10); the
    background scan hands the caches the next epoch's exact schedule, and the batches of the
    pass and of the next epoch equal the local dataset's."""
    import threading

    import fastload.loader.remote as lr
    from fastload.remote.schedule import PassScan

    kw = dict(batch_size=50, seed=3, shuffle_mode="window", window=1, device="cpu", prefetch=2, threads=1)
    with fastload.Loader(local_ds, **kw) as lo:
        want = batches(lo, epochs=(0, 1))
    n = len(want) // 2
    monkeypatch.setattr(lr, "SYNC_POSITIONS", 100)
    with fastload.Loader(remote_url, cache_dir=tmp_path / "c1", **kw) as lo:
        it = iter(lo)
        for _ in range(n - 1):
            next(it)
        state = lo.state_dict()
    scanned: dict[str, int] = {}
    step = PassScan.step

    def counted(self, positions=None):
        h0 = self.horizon
        step(self, positions)
        name = threading.current_thread().name
        scanned[name] = scanned.get(name, 0) + self.horizon - h0

    monkeypatch.setattr(PassScan, "step", counted)
    monkeypatch.setattr(lr, "SCAN", 40)
    monkeypatch.setattr(lr._Planner, "EVERY_S", 0.0)
    nexts = []  # the next epoch's shards handed to the caches at each update
    update = lr._Planner._update
    monkeypatch.setattr(lr._Planner, "_update", lambda self, nxt: (nexts.append(None if nxt is None else len(nxt[0])),
                                                                   update(self, nxt))[1])
    with fastload.Loader(remote_url, cache_dir=tmp_path / "c2", **kw) as lo:
        lo.load_state_dict(json.loads(json.dumps(state)))
        it = iter(lo)
        got = [{k: v.numpy().copy() for k, v in next(it).items()}]
        # the warm start's first 100 positions of epoch 0 and the last batch's 50: not the next epoch's 3,000
        assert scanned.get("MainThread", 0) <= 150, scanned
        planner = lo._remote._planner
        assert planner is not None and planner._scan.done and planner._nxt is not None
        planner._thread.join(60)
        cache = lo.dataset.cache
        planned = [p for p in cache.timeline._passes if p["k"] == cache.pass_no + 1]
        got += [{k: v.numpy().copy() for k, v in b.items()} for b in it]
        lo.set_epoch(1)
        got += [{k: v.numpy().copy() for k, v in b.items()} for b in lo]
    assert scanned.get("fastload-plan", 0) >= 3000, scanned
    exact = sampler_uses(lo.sampler, lo.dataset.shard_starts, epoch=1, start=0)
    assert len(planned) == 1 and planned[0]["uses"].same_as(exact)
    # ... and what its scan knew before, as it went (the first shards of the next epoch early)
    assert any(k is not None and k < len(exact) for k in nexts), nexts
    assert_same(got, want[n - 1:])


@pytest.mark.parametrize("kind", ["shuffled", "window1", "window3", "natural"])
@pytest.mark.parametrize("start,world", [(0, 3), (5_000, 7), (0, 100), (0, 400)])
def test_a_pack_scan_knows_more_at_each_step_and_never_too_little(monkeypatch, kind, start, world):
    """A packed pass's scan (positions count tokens; chunks of 97 documents here), stepped a
    chunk at a time: the shards known are a prefix of the exact first-use order (exact first
    uses), each last use in uses() no earlier than the exact one and in seen() no later, the
    last uses only ever earlier; in window (and natural) order, shards get their exact last use
    before the scan is over; at the end, the exact schedule. From the start, resumed, and
    with padding that reads the stream's first documents again (100 ranks: a part of the
    stream; 400: all of it, whose last uses are then known at the end only)."""
    import fastload.sampling.packing as packing
    from fastload.remote.schedule import PackScan

    monkeypatch.setattr(packing, "CHUNK", 97)
    rng = np.random.default_rng(9)
    rows = rng.integers(30, 90, size=25)
    starts = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
    n = int(starts[-1])
    lengths = rng.integers(0, 30, size=n)  # empty documents included
    stream = (Shuffled(n, 1, 2) if kind == "shuffled" else Natural(n) if kind == "natural"
              else Windowed(rows, int(kind[-1]), 1, 2))
    plan = pack_plan(0, start, stream, lengths, rows=2, length=64, world_size=world, rank=0, drop_last=False)
    end = plan.bounds[-1][2] if len(plan.bounds) else plan.start
    exact = token_uses(plan.stream, plan.cum, starts, start=plan.start, end=end)
    scan = PackScan(plan, starts)
    prev, steps, early = None, 0, 0
    while True:
        u, low = scan.uses(), scan.seen()
        k = len(u)
        assert u.shards.tolist() == exact.shards[:k].tolist() and u.first.tolist() == exact.first[:k].tolist()
        assert np.all(u.last >= exact.last[:k]) and np.all(low.last <= exact.last[:k]) and np.all(u.last < end)
        if prev is not None:
            assert len(u) >= len(prev) and np.all(u.last[:len(prev)] <= prev.last)
        if scan.done:
            break
        early += int(np.sum(u.last < end - 1))
        prev = u
        scan.step(1)
        steps += 1
    _same(scan.uses(), exact)
    assert steps > 5
    if kind != "shuffled" and world < 400:
        assert early > 0  # exact last uses known as the scan went, not only at its end


@pytest.mark.parametrize("mode,window,limit_shards", [("window", 1, 4), ("full", None, None)])
def test_a_pass_is_never_read_ahead_of_its_plan(remote_url, local_ds, tmp_path, monkeypatch, mode, window,
                                                 limit_shards):
    """The background planner of each pass held half a second (a loaded machine): the reader
    waits at the first batch past what the caches were told, so every shard a prepared batch
    reads is planned, its use spanning the batch (never released or evicted under a batch in
    flight); the batches equal the local dataset's over two epochs."""
    import fastload.loader.remote as lr
    from _remote import read_ahead_of_planner
    from fastload.remote.schedule import PassScan

    kw = dict(batch_size=50, seed=3, shuffle_mode=mode, window=window, device="cpu", prefetch=2, threads=1)
    with fastload.Loader(local_ds, **kw) as lo:
        want = batches(lo, epochs=(0, 1))
        shard_bytes = max(s["bytes"] for s in lo.dataset.manifest["shards"])
    monkeypatch.setattr(lr, "SYNC_POSITIONS", 100)
    monkeypatch.setattr(lr, "SCAN", 40)
    monkeypatch.setattr(lr._Planner, "EVERY_S", 0.0)
    limit = None if limit_shards is None else limit_shards * shard_bytes
    got, scanning, violations = read_ahead_of_planner(remote_url, tmp_path / "c", limit, kw, monkeypatch, PassScan,
                                                    step_s=0.003)
    assert not violations, violations[:5]
    assert_same(got, want)
    assert sum(scanning) >= 5, sum(scanning)


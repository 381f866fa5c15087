"""Getting shards into the cache: the download threads, admission, and ``ensure``.

Part of :mod:`fastload.remote.cache`. :class:`Fetcher` owns the downloading of one cache:

* the background threads downloading, in first-use order, the shards this rank owns once
  the node's slowest rank is far enough (their admission time on the :class:`Timeline`);
* admitting a download: under the node-wide admission lock, count the bytes really on disk,
  make room if needed (:class:`~fastload.remote.cache_timeline.Eviction`), and reserve the shard's room by creating its
  partial file;
* downloading one shard under its own flock (another process downloading it: wait for it);
* :meth:`Fetcher.ensure`: the local path of a shard, fetched now, or waited for while its
  owner rank fetches it (fetched here after ``owner_grace_s``, or at once if that rank died);
* its generations: :meth:`~Fetcher.begin_stop` / :meth:`~Fetcher.end_stop` stop one (its stop
  event, downloader and threads), :meth:`~Fetcher.new_generation` makes the next.

Every wait here ends by the shard's deadline (``download_timeout``): for another process's
download (its flock), for the admission lock (a stopped process may hold it), for room in
the budget, for the server. Room held by partial downloads nobody writes any more (their
process was killed) is taken back when a download needs it: their shard's flock is free.

It uses the directory (:class:`~fastload.remote.cache_files.CacheFiles`), the node's ranks
(:class:`~fastload.remote.cache_ranks.NodeRanks`) and the schedule
(:class:`~fastload.remote.cache_timeline.Timeline`) through their methods, under the
condition ``cond`` it shares with the cache.
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable

from ..errors import DownloadError, DownloadTimeout, FastloadError, RemoteError, format_bytes
from .cache_files import CacheFiles
from .cache_ranks import NodeRanks
from .cache_timeline import Eviction, Timeline
from .download import Cancelled, Downloader, DownloadCounters
from .pacing import RetryPolicy

__all__ = ["Fetcher"]

logger = logging.getLogger("fastload")


class Fetcher:
    """The downloads of one cache (see the module docstring); ``eviction`` makes room for
    them."""

    def __init__(self, remote, files: CacheFiles, ranks: NodeRanks, timeline: Timeline, eviction: Eviction,
                 cond: threading.Condition, *, policy: RetryPolicy, threads: int, chunk_bytes: int, fsync: bool,
                 poll_s: float):
        self._remote = remote
        self._files = files
        self._ranks = ranks
        self._timeline = timeline
        self._eviction = eviction
        self._cond = cond
        self.policy = policy
        self.threads = max(1, int(threads))
        self._poll = float(poll_s)
        self._downloader_kw = dict(threads=threads, policy=policy, chunk_bytes=chunk_bytes, fsync=fsync)
        self.counters = DownloadCounters()
        self._stop = threading.Event()
        self.downloader = Downloader(remote.transport, stop=self._stop, counters=self.counters,
                                     **self._downloader_kw)
        self._workers: list[threading.Thread] = []
        self._inflight: set[int] = set()
        self._fetched: set[int] = set()  # downloaded by this process, not yet counted by the prefetcher
        self._errors: dict[int, BaseException] = {}
        self._hooks: list[Callable[[int, Path], None]] = []
        self.closed = False
        self.failed: BaseException | None = None  # the plan failed: ensure() raises it
        # counters
        self.cache_hits = 0
        self.downloads = 0
        self.wait_s = 0.0
        self.self_fetches = 0

    @property
    def busy(self) -> set[int]:
        """The shards this process is downloading (their files are kept)."""
        return self._inflight

    def on_fetched(self, fn: Callable[[int, Path], None]) -> None:
        self._hooks.append(fn)

    def _node_position(self, force: bool = False) -> int:
        t = self._timeline
        return self._ranks.refresh(t.my_t, t.hold, force=force)

    # -- ensure ------------------------------------------------------------------------------
    def ensure(self, shard: int, timeout: float | None = None) -> Path:
        """The local path of ``shard``, downloading it (or waiting for the rank that does)
        first. Raises :class:`DownloadError` / :class:`DownloadTimeout` naming the shard."""
        shard = int(shard)
        path = self._files.path(shard)
        if path.exists():
            return path
        if self.closed:
            raise RemoteError(f"the cache of {self._files.url} is closed")
        t0 = time.monotonic()
        deadline = t0 + (self.policy.timeout_s if timeout is None else float(timeout))
        try:
            while True:
                if path.exists():
                    return path
                if self.closed:
                    raise Cancelled()
                take = False
                with self._cond:
                    err = self._errors.get(shard) or self.failed
                    if err is not None:
                        raise err
                    if shard not in self._inflight:
                        waited = time.monotonic() - t0
                        planned = self._timeline.planned(shard)
                        if not planned or self._ranks.fetch_for_owner(shard, waited):
                            if planned and not self._ranks.mine(shard):
                                self.self_fetches += 1
                            self._inflight.add(shard)
                            take = True
                    if not take:
                        if time.monotonic() >= deadline:
                            raise self._timeout(shard, t0)
                        self._cond.wait(self._poll)
                        continue
                try:
                    self._obtain(shard, deadline, stop=self._stop, downloader=self.downloader)
                finally:
                    with self._cond:
                        self._inflight.discard(shard)
                        self._cond.notify_all()
        except Cancelled:
            raise RemoteError(f"the cache of {self._files.url} was closed while shard {self._files.names[shard]} "
                              "was being fetched") from None
        finally:
            self.wait_s += time.monotonic() - t0

    # -- the download threads ----------------------------------------------------------------
    def start(self) -> None:
        """Start this generation's download threads (once)."""
        if self._workers:
            return
        # this generation's stop event and downloader: a thread left behind by stop() (blocked
        # in a read) keeps the ones that told it to stop, never the next generation's
        stop, downloader = self._stop, self.downloader
        for i in range(self.threads):
            t = threading.Thread(target=self._worker, args=(stop, downloader), name=f"fastload-download-{i}",
                                 daemon=True)
            t.start()
            self._workers.append(t)

    def _worker(self, stop: threading.Event, downloader: Downloader) -> None:
        timeline, ranks = self._timeline, self._ranks
        while not stop.is_set():
            with self._cond:
                j = timeline.next_use()
                if j is None:
                    self._cond.wait(0.1)
                    continue
                node_t = self._node_position()
                if timeline.admitted_at(j) > node_t:
                    self._cond.wait(self._poll if ranks.local_world_size > 1 else 0.1)
                    continue
                s = timeline.take(j, node_t)
                if s is None or s in self._inflight:
                    continue
                if self._files.path(s).exists():
                    if ranks.mine(s) and s not in self._fetched:
                        self.cache_hits += 1  # there before this run needed it (an earlier run, epoch, rank)
                    self._fetched.discard(s)
                    continue
                if not ranks.mine(s) and ranks.is_alive(ranks.owner(s)):
                    continue  # the owner fetches it
                self._inflight.add(s)
            try:
                self._obtain(s, time.monotonic() + self.policy.timeout_s, priority=j, stop=stop, downloader=downloader)
            except Cancelled:
                return
            except BaseException as e:  # kept for the reader: ensure() raises it, naming the shard
                if not isinstance(e, FastloadError):
                    name, url = self._files.names[s], self._remote.shard_url(s)
                    e = DownloadError(f"shard {name} from {url} failed: {type(e).__name__}: {e}", shard=name, url=url)
                with self._cond:
                    self._errors[s] = e
            finally:
                with self._cond:
                    self._inflight.discard(s)
                    self._cond.notify_all()

    # -- one shard ---------------------------------------------------------------------------
    def _obtain(self, s: int, deadline: float, priority: float = -1, *, stop: threading.Event,
                downloader: Downloader) -> None:
        """Download shard ``s`` unless it is (or gets) there: under its flock, after the
        budget admitted it. The caller has put ``s`` in the shards in flight."""
        files = self._files
        path = files.path(s)
        lock = files.shard_lock(s)
        try:
            while not lock.try_lock():  # another process (or a thread left behind) downloads it
                if path.exists():
                    return
                if stop.is_set():
                    raise Cancelled()
                if time.monotonic() >= deadline:
                    raise self._timeout(s, deadline - self.policy.timeout_s)
                time.sleep(self._poll)
            if path.exists():
                return
            part = files.part(s)
            self._reserve(s, part, deadline, stop)
            downloader.fetch(files.names[s], path, size=int(files.sizes[s]), checksum=self._remote.checksums[s],
                             part=part, label=files.names[s], deadline=deadline, priority=priority)
            for fn in self._hooks:  # e.g. the reader remembers the shard as verified
                try:
                    fn(s, path)
                except Exception:  # a hook must not fail the download
                    logger.exception("fastload: fetch hook failed for shard %s", files.names[s])
            with self._cond:
                self.downloads += 1
                self._fetched.add(s)
                self._errors.pop(s, None)
        finally:
            lock.close()

    def _reserve(self, s: int, part: Path, deadline: float, stop: threading.Event) -> None:
        """Wait until shard ``s`` fits in the budget next to what is on disk, then create its
        partial file (which counts at full size for every other process from then on).
        Partial files of downloads that nobody writes any more are taken back first."""
        files = self._files
        size = int(files.sizes[s])
        t0 = time.monotonic()
        while True:
            if not files.lock_admission(deadline):
                raise DownloadTimeout(f"shard {files.names[s]} could not be admitted: "
                                      + files.admission_stuck(time.monotonic() - t0),
                                      shard=files.names[s], url=self._remote.shard_url(s))
            try:
                node_t = self._node_position(force=True)
                complete, partial = files.present()
                own_part = size if part.exists() else 0
                used = sum(complete.values()) + partial - own_part
                if used + size > files.limit and files.reclaim_stale_parts(keep=s, busy=self._inflight):
                    complete, partial = files.present()
                    used = sum(complete.values()) + partial - own_part
                if used + size > files.limit:
                    self._eviction.evict(node_t, used + size - files.limit, busy=self._inflight)
                    complete, partial = files.present()
                    used = sum(complete.values()) + partial - own_part
                if used + size <= files.limit:
                    part.touch()
                    return
            finally:
                files.unlock_admission()
            if stop.is_set():
                raise Cancelled()
            if self.failed is not None:
                raise self.failed
            if time.monotonic() >= deadline:
                raise DownloadTimeout(
                    f"shard {files.names[s]} ({format_bytes(size)}) waited until its deadline for room in the cache: "
                    f"cache_limit={format_bytes(files.limit)} holds {format_bytes(used)} of shards still in use "
                    f"in {files.dir}; raise cache_limit (or download_timeout=), or check that every local rank "
                    "is making progress", shard=files.names[s], url=self._remote.shard_url(s))
            with self._cond:
                self._cond.wait(self._poll * 5)

    def _timeout(self, s: int, t0: float) -> DownloadTimeout:
        owner = self._ranks.owner(s)
        who = "" if self._ranks.mine(s) else f" (waiting for local rank {owner}, which downloads it)"
        name = self._files.names[s]
        return DownloadTimeout(
            f"shard {name} was not in the cache {self._files.dir} after {time.monotonic() - t0:.0f}s{who}; "
            f"it comes from {self._remote.shard_url(s)}: check the network and the server, or raise "
            "download_timeout= (fastload.Dataset / Loader)", shard=name, url=self._remote.shard_url(s))

    # -- generations -------------------------------------------------------------------------
    def begin_stop(self) -> tuple:
        """Tell this generation's threads to stop (nothing waits here); returns what
        :meth:`end_stop` joins."""
        stop, downloader, workers = self._stop, self.downloader, self._workers
        deadline = time.monotonic() + self.policy.close_s
        downloader.finish_by(deadline - 0.25 * self.policy.close_s)  # requests in flight: then they end
        stop.set()
        with self._cond:
            self._cond.notify_all()
        return stop, downloader, workers, deadline

    def end_stop(self, begun: tuple) -> None:
        """Join what :meth:`begin_stop` stopped, until its deadline; a thread still blocked
        in a read of the server then is left behind, with a warning."""
        stop, downloader, workers, deadline = begun
        left = []
        for t in workers:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                left.append(t)
        left += downloader.close(deadline)
        self._workers = []
        if left:
            logger.warning("fastload: %d download thread(s) of %s were still blocked in a read from the server "
                           "%.1fs after the cache was stopped; they were left behind (daemon threads that end when "
                           "the read returns and write nothing more): %s", len(left), self._files.url,
                           self.policy.close_s, ", ".join(t.name for t in left))

    def new_generation(self) -> None:
        """A new stop event and downloader for the next pass (never shared with a thread
        left behind by the last one)."""
        old = self.downloader
        self._stop = threading.Event()
        self.downloader = Downloader(self._remote.transport, stop=self._stop, counters=self.counters,
                                     **{**self._downloader_kw, "chunk_bytes": old.chunk})

    def after_fork(self, cond: threading.Condition) -> None:
        """In a forked child: none of the download or range threads exist here, and their
        locks may be held. Start afresh: the cache's new condition, no thread, no download
        in flight, new counters and downloader."""
        self._cond = cond
        self._workers, self._inflight, self._fetched, self._errors = [], set(), set(), {}
        self.counters = DownloadCounters()
        self.new_generation()

"""The node-local shard cache: whole shards, fetched in the sampler's exact first-use order.

Layout (one directory per dataset content, shared by every local rank of a node)::

    <cache_dir>/<fingerprint>/
        remote.json                 URL + manifest as fetched (deliberately *not* manifest.json:
                                    a partial cache never opens as a complete local dataset)
        shard-00003.arrow           complete, verified shards (atomic rename)
        .shard-00004.arrow.part     a download in progress (or a crashed one, resumed later)
        .locks/shard-00004.lock     kernel flock: held while a process downloads that shard
        .locks/admission.lock       kernel flock: one process at a time checks the budget
        .locks/alive-<local rank>   kernel flock: held while a rank's cache is open
        .progress/rank-<local rank> how far that rank has read (position on the timeline)

How a run uses it:

* :meth:`ShardCache.plan` gets a pass's :class:`~fastload.remote.schedule.EpochUses` (and the
  predicted next pass) and computes, identically on every local rank, when each shard may be
  downloaded under ``limit`` (strictly in first-use order); a budget too small for the
  order is refused here (:class:`~fastload.errors.CacheTooSmall`).
* Background threads download the shards this rank owns (shard ``i`` belongs to local rank
  ``i % local_world_size``) as soon as the node's slowest rank is far enough: several at a
  time, hashed while they arrive, checked against the manifest, renamed into place.
* :meth:`ShardCache.ensure` returns a shard's local path, blocking until it is there (time
  counted in ``download_wait_s``). A shard owned by another rank is waited for; if that
  rank's process is gone (its ``alive`` flock is free) or never comes, this rank fetches it.
* :meth:`ShardCache.advance` reports the consumed position. Once every local rank is past a
  shard's last use (and no later use is admitted), the shard is deleted: exact eviction. A
  process drops its own mappings first (``on_release`` callbacks): a mapped, unlinked file
  would still hold its blocks.

Before any download starts, the process holding the admission lock counts the bytes really
on disk (complete shards plus in-progress downloads at their full size) and starts only if
the new shard fits: the budget holds even while ranks disagree for a moment.

Where it lives: this module has :class:`ShardCache`'s construction and its pass lifecycle
(:meth:`~ShardCache.plan`, :meth:`~ShardCache.advance`, :meth:`~ShardCache.stop`,
:meth:`~ShardCache.close`, stats); the rest of the class comes from mixins, one per concern:
:mod:`~fastload.remote.cache_files` (the directory, sizes, flocks; :func:`default_cache_dir`,
:func:`parse_bytes`), :mod:`~fastload.remote.cache_ranks` (the node's ranks and their
positions), :mod:`~fastload.remote.cache_timeline` (admission times, release, eviction) and
:mod:`~fastload.remote.cache_fetch` (download threads, the budget check, :meth:`~ShardCache.ensure`).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..runtime import lifecycle
from ..errors import CacheTooSmall, RemoteError, format_bytes
from .cache_fetch import _Fetching
from .cache_files import CACHE_ENV, _CacheFiles, _Flock, _write_atomic, default_cache_dir, parse_bytes
from .cache_ranks import _NodeRanks
from .cache_timeline import _Timeline
from .download import Downloader, DownloadCounters, RetryPolicy
from .manifest import RemoteDataset
from .schedule import EpochUses, minimum_budget

__all__ = ["ShardCache", "default_cache_dir", "parse_bytes", "format_bytes", "stop_caches"]

logger = logging.getLogger("fastload")


class ShardCache(_CacheFiles, _NodeRanks, _Timeline, _Fetching):
    """The node-local cache of one remote dataset (see the module docstring).

    Args:
        remote: the dataset (manifest + transport).
        cache_dir: the root shared by the node's ranks (default :func:`default_cache_dir`).
        limit: byte budget for shards on disk (int or '200GB'); default: the whole dataset
            when it fits in 80% of the free disk, else 80% of the free disk.
        ahead: how many positions before reporting them consumed the reader asks for shards
            (its prefetch; the Loader passes ``(prefetch + 2) * batch_size * world_size``).
        threads: downloads in flight at most (adapted down on throttling).
        local_rank, local_world_size: this process among the node's ranks (default: the
            ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` environment variables, else 0 / 1).
        retry: attempts, backoff and the per-shard deadline (:class:`RetryPolicy`).
        owner_grace_s: how long to wait for another live rank to download a shard this rank
            needs before fetching it itself.
    """

    def __init__(self, remote: RemoteDataset, *, cache_dir: str | os.PathLike | None = None,
                 limit: int | str | None = None, ahead: int = 0, threads: int = 4,
                 local_rank: int | None = None, local_world_size: int | None = None,
                 retry: RetryPolicy | None = None, chunk_bytes: int = 8 << 20, owner_grace_s: float = 30.0,
                 poll_s: float = 0.01, fsync: bool = True):
        from ..runtime.system import local_world_size as _lws

        self.remote = remote
        self.root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        self.dir = self.root / remote.fingerprint
        self.sizes = np.asarray(remote.shard_bytes, dtype=np.int64)
        self.names = list(remote.shard_files)
        self._index = {n: i for i, n in enumerate(self.names)}
        self.num_shards = len(self.names)
        lws = _lws() if local_world_size is None else int(local_world_size)
        if lws < 1:
            raise ValueError(f"local_world_size={local_world_size!r} must be >= 1")
        if local_rank is None:
            v = os.environ.get("LOCAL_RANK", "").strip()
            local_rank = int(v) if v.isdigit() else 0
        if not 0 <= int(local_rank) < lws:
            raise ValueError(f"local_rank={local_rank!r} must be in [0, local_world_size={lws})")
        self.local_rank, self.local_world_size = int(local_rank), lws
        self.ahead = max(0, int(ahead))
        self.policy = retry or RetryPolicy()
        self.owner_grace_s = float(owner_grace_s)
        self._poll = float(poll_s)

        try:
            for d in (self.dir, self.dir / ".locks", self.dir / ".progress"):
                d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RemoteError(f"cannot create the cache directory {self.dir} ({e}); pass cache_dir= "
                              f"(or set ${CACHE_ENV}) to a writable local directory") from None
        self._write_remote_json()
        self._check_present()
        self.set_limit(self._resolve_limit(limit))

        self._stop = threading.Event()
        self.counters = DownloadCounters()
        self._downloader_kw = dict(threads=threads, policy=self.policy, chunk_bytes=chunk_bytes, fsync=fsync)
        self.downloader = Downloader(remote.transport, stop=self._stop, counters=self.counters, **self._downloader_kw)
        self._threads_n = max(1, int(threads))
        self._cond = threading.Condition()
        self._admit_lock = threading.Lock()
        self._admission = _Flock(self.dir / ".locks" / "admission.lock")
        self._alive = _Flock(self.dir / ".locks" / f"alive-{self.local_rank}")
        self._claim_alive()
        self._peer_alive = {r: _Flock(self.dir / ".locks" / f"alive-{r}")
                            for r in range(lws) if r != self.local_rank}
        self._progress_path = self.dir / ".progress" / f"rank-{self.local_rank}"
        self._t_open, self._t_open_mono = time.time(), time.monotonic()

        self._clear_timeline()
        self._pass = 0
        self._base_next = 0
        self._my_t = 0
        self._cur_base = self._cur_start = self._cur_len = 0
        self._rank_t: list[int] = [0]  # timeline positions of the live local ranks (this one first)
        self._node_t = 0
        self._node_t_at = 0.0
        self._release_ptr = 0
        self._inflight: set[int] = set()
        self._fetched: set[int] = set()  # downloaded by this process, not yet counted by the prefetcher
        self._errors: dict[int, BaseException] = {}
        self._released: set[int] = set()
        self._release_hooks: list[Callable[[int], None]] = []
        self._fetch_hooks: list[Callable[[int, Path], None]] = []
        self._workers: list[threading.Thread] = []
        self._closed = False
        # counters
        self.cache_hits = 0
        self.evictions = 0
        self.downloads = 0
        self.wait_s = 0.0
        self.self_fetches = 0
        lifecycle.track(self)

    # -- public ----------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return self.remote.url

    def path(self, shard: int) -> Path:
        return self.dir / self.names[shard]

    def owner(self, shard: int) -> int:
        return int(shard) % self.local_world_size

    def on_release(self, fn: Callable[[int], None]) -> None:
        """Call ``fn(shard)`` when this process no longer needs a shard (its last use is
        behind the reader) and before this process deletes one: drop mappings there."""
        self._release_hooks.append(fn)

    def on_fetched(self, fn: Callable[[int, Path], None]) -> None:
        """Call ``fn(shard, path)`` (in a download thread) after this process downloaded a
        shard and found it equal to the manifest's checksum, before anything reads it."""
        self._fetch_hooks.append(fn)

    def remove_release_hook(self, fn: Callable[[int], None]) -> None:
        try:
            self._release_hooks.remove(fn)
        except ValueError:
            pass

    def probe(self) -> dict[str, float]:
        """Cumulative counters (for a Loader's per-epoch stats)."""
        c = self.counters
        return {"bytes_downloaded": c.bytes, "download_wait_s": self.wait_s, "download_busy_s": c.busy_s,
                "cache_hits": self.cache_hits, "evictions": self.evictions, "retries": c.retries,
                "downloads": self.downloads}

    def _clear_timeline(self) -> None:
        """No pass planned: the timeline (see schedule.py: the uses of the kept passes, in
        first-use order, and the events and releases along it) is empty."""
        self._passes: list[dict] = []  # {"k", "base", "uses"} of the kept passes
        self._u_shard = self._u_first = self._u_last = self._u_admit = np.zeros(0, np.int64)
        self._by_shard: dict[int, np.ndarray] = {}
        self._by_last = np.zeros(0, np.int64)
        self._events, self._next_event = np.zeros(0, np.int64), np.iinfo(np.int64).max
        self._next = 0  # next use for the prefetch threads

    def stop(self) -> None:
        """Stop and join the download threads (a Loader closing); ``ensure()`` still works,
        and the next :meth:`plan` starts them again (:func:`stop_caches` stops several at once).

        Returns within ``retry.close_s`` (default 2 s) whatever the server does: nothing new
        starts, requests already in flight may finish during the first 3/4 of it (a healthy
        transfer is not wasted), then every download ends (each wait for the server is
        bounded; an http(s) stream's socket is shut down), and a thread still blocked in a
        read of the server is left behind with a warning (a daemon thread; its download is
        over, it writes nothing more and ends when the read returns). The next pass gets a
        new stop event and downloader, never shared with a thread left behind."""
        self._end_stop(self._begin_stop())

    def _begin_stop(self) -> tuple:
        """Tell this generation's threads to stop (nothing waits here)."""
        with self._cond:
            self._clear_timeline()
        stop, downloader, workers = self._stop, self.downloader, self._workers
        deadline = time.monotonic() + self.policy.close_s
        downloader.finish_by(deadline - 0.25 * self.policy.close_s)  # requests in flight: then they end
        stop.set()
        with self._cond:
            self._cond.notify_all()
        return stop, downloader, workers, deadline

    def _end_stop(self, begun: tuple) -> None:
        """Join what :meth:`_begin_stop` stopped, until its deadline; start a new generation."""
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
                           "the read returns and write nothing more): %s", len(left), self.url, self.policy.close_s,
                           ", ".join(t.name for t in left))
        if self.local_world_size > 1 and self._alive.fd is not None:
            _write_atomic(self._progress_path, "done\n")  # peers stop counting this rank
        if not self._closed:  # a new generation for the next pass
            self._stop = threading.Event()
            self.downloader = Downloader(self.remote.transport, stop=self._stop, counters=self.counters,
                                         **{**self._downloader_kw, "chunk_bytes": downloader.chunk})

    def set_limit(self, limit: int) -> None:
        """A new byte budget (before a pass is planned: a mixture shares one budget out)."""
        biggest = int(self.sizes.max()) if self.num_shards else 0
        if int(limit) < biggest:
            raise CacheTooSmall(f"cache_limit={format_bytes(limit)} is smaller than the largest shard of {self.url} "
                                f"({format_bytes(biggest)}); raise cache_limit", minimum=biggest)
        self.limit = int(limit)
        # the whole dataset fits: a mirror, nothing is deleted (a rerun reads it all locally)
        self.mirror = self.limit >= int(self.sizes.sum())

    def minimum_limit(self, uses: EpochUses) -> int:
        """The smallest ``limit`` that lets ``uses`` be read (see schedule.minimum_budget)."""
        return minimum_budget(uses.shards, uses.first, uses.last, self.sizes, self.ahead)[0]

    def plan(self, uses: EpochUses, next_uses: EpochUses | None = None) -> None:
        """Start a pass: ``uses`` (positions from ``uses.start``), and optionally the next
        pass's uses, fetched with what the budget leaves before this pass ends. Raises
        :class:`CacheTooSmall` when the budget cannot hold what the order needs at once."""
        self._check_open()
        need = self.minimum_limit(uses)
        if need > self.limit:
            raise CacheTooSmall(self._too_small_message(uses, need), minimum=need)
        with self._cond:
            self._pass += 1
            base = self._base_next
            length = uses.end - uses.start
            cur = {"k": self._pass, "base": base, "uses": uses}
            nxt = None
            if next_uses is not None:
                nxt = {"k": self._pass + 1, "base": base + length, "uses": next_uses}
            prev = [p for p in self._passes if p["k"] == self._pass - 1]
            self._passes = prev + [cur] + ([nxt] if nxt else [])
            self._base_next = base + length
            self._cur_base, self._cur_start, self._cur_len = base, uses.start, length
            self._rebuild_timeline(len(prev), base)
            self._my_t = base
            self._release_ptr = 0
            self._released.clear()
            self._write_progress()
            self._cond.notify_all()
        self._start_workers()

    def advance(self, consumed: int) -> None:
        """The global position consumed in the current pass (every position below it is
        done on this rank; the Loader passes what it has delivered)."""
        if not self._passes:
            return
        base, start = self._cur_base, self._cur_start
        t = base + min(self._cur_len, max(0, int(consumed) - start))
        if t <= self._my_t:
            return
        self._my_t = t
        if t >= self._next_event:
            self._on_event()

    def reopen_state(self) -> dict[str, Any]:
        """What another process needs to open this dataset's cache the same way (a pickled
        Dataset): the transport's secret-free description, the fingerprint and the settings."""
        return {"remote": self.remote.transport.describe(), "fingerprint": self.remote.fingerprint,
                "cache_dir": str(self.root), "cache_limit": self.limit, "download_timeout": self.policy.timeout_s,
                "download_threads": self._threads_n}

    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {"bytes_downloaded": c.bytes, "download_wait_s": self.wait_s, "download_MBps": c.mbps(),
                "cache_hits": self.cache_hits, "evictions": self.evictions, "retries": c.retries,
                "downloads": self.downloads, "throttled": c.throttled, "credential_reloads": c.rebuilds,
                "checksum_failures": c.checksum_failures, "downloads_in_flight_limit": self.downloader.concurrency.limit,
                "self_fetches": self.self_fetches, "cache_limit": self.limit}

    def _after_fork_in_child(self) -> None:
        """In a process forked from this cache's (a DataLoader worker): none of the download
        or range threads exist here, and their locks may be held. Start afresh as an
        on-demand cache of the same directory (no plan: the parent's pass is the parent's):
        new locks, new downloader, and the cross-process flocks opened again (a flock is
        shared with the parent through an inherited descriptor, so it would not exclude it)."""
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._admit_lock = threading.Lock()
        self._workers, self._inflight, self._fetched, self._errors = [], set(), set(), {}
        self._clear_timeline()
        self.counters = DownloadCounters()
        self.downloader = Downloader(self.remote.transport, stop=self._stop, counters=self.counters,
                                     **{**self._downloader_kw, "chunk_bytes": self.downloader.chunk})
        self._alive.close()  # the parent's: this copy neither holds nor releases it
        for f in (self._admission, *self._peer_alive.values()):
            f.close()
        if not self._closed:
            self._admission = _Flock(self.dir / ".locks" / "admission.lock")
            self._peer_alive = {r: _Flock(f.path) for r, f in self._peer_alive.items()}

    def close(self) -> None:
        """Stop and join the download threads, leave the node (peers stop counting this
        rank), and release the locks. Complete shards stay for the next run."""
        if self._closed:
            return
        self._closed = True
        lifecycle.untrack(self)
        self.stop()
        for f in (self._alive, self._admission, *self._peer_alive.values()):
            f.close()

    def __enter__(self) -> "ShardCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # -- messages --------------------------------------------------------------------------
    def _too_small_message(self, uses: EpochUses, need: int, hint: str | None = None) -> str:
        return (f"cache_limit={format_bytes(self.limit)} is too small for this order of {self.url}: reading it needs "
                f"{format_bytes(need)} of shards on disk at the same time (of {format_bytes(int(self.sizes.sum()))} "
                f"in all). Raise cache_limit to at least {format_bytes(need)} ({need} bytes), or "
                + (hint or "read in shard windows with shuffle_mode=\"window\" (a window of w shards needs about "
                            "2*w+1 shards of cache), which keeps only a few shards in use at a time"))

    def _check_open(self) -> None:
        if self._closed:
            raise RemoteError(f"the cache of {self.url} is closed")


def stop_caches(caches) -> None:
    """:meth:`ShardCache.stop` of several caches (a mixture's) at once: all are told to stop
    first, then joined, so the whole takes one ``close_s`` (the longest), not their sum."""
    begun = [c._begin_stop() for c in caches]
    for c, b in zip(caches, begun):
        c._end_stop(b)

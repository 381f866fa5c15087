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

Where it lives: :class:`ShardCache` composes four collaborators, each owning its state:
:class:`~fastload.remote.cache_files.CacheFiles` (the directory, its byte budget, sizes,
flocks, the admission lock; :func:`default_cache_dir`, :func:`parse_bytes`),
:class:`~fastload.remote.cache_ranks.NodeRanks` (the node's ranks and their positions),
:class:`~fastload.remote.cache_timeline.Timeline` (admission times, release, which shards
may be evicted) and :class:`~fastload.remote.cache_fetch.Fetcher` (download threads, the
budget check, :meth:`~ShardCache.ensure`). This module has the construction, the pass
lifecycle (:meth:`~ShardCache.plan`, :meth:`~ShardCache.advance`, :meth:`~ShardCache.stop`,
:meth:`~ShardCache.close`) and stats; :class:`~fastload.remote.cache_timeline.Eviction`
carries the timeline's choice out on the files. One condition (``ShardCache._cond``) guards what the download threads share.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ..runtime import lifecycle
from ..errors import CacheTooSmall, RemoteError, format_bytes
from .cache_fetch import Fetcher
from .cache_files import CacheFiles, default_cache_dir, parse_bytes
from .cache_ranks import NodeRanks
from .cache_timeline import Eviction, Timeline
from .download import RetryPolicy
from .manifest import RemoteDataset
from .options import RemoteOptions
from .schedule import EpochUses, minimum_budget

__all__ = ["ShardCache", "default_cache_dir", "parse_bytes", "format_bytes", "stop_caches"]

logger = logging.getLogger("fastload")


class ShardCache:
    """The node-local cache of one remote dataset (see the module docstring).

    Args:
        remote: the dataset (manifest + transport).
        options: how it is cached (:class:`~fastload.remote.options.RemoteOptions`): its
            ``cache_dir`` (default :func:`default_cache_dir`), ``cache_limit`` (the byte budget
            for shards on disk; default: the whole dataset when it fits in 80% of the free
            disk, else 80% of the free disk), ``download_timeout`` (the per-shard deadline)
            and ``download_threads`` (downloads in flight at most, default 4; adapted down
            on throttling). Its ``filesystem`` / ``storage_options`` made ``remote`` already.
        cache_dir, limit, threads: the same as ``options``' ``cache_dir``, ``cache_limit``
            and ``download_threads`` (kept keywords; not together with ``options``).
        ahead: how many positions before reporting them consumed the reader asks for shards
            (its prefetch; the Loader passes ``(prefetch + 2) * batch_size * world_size``).
        local_rank, local_world_size: this process among the node's ranks (default: the
            ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` environment variables, else 0 / 1).
        retry: attempts, backoff and the per-shard deadline (:class:`RetryPolicy`; default:
            ``options``' ``download_timeout`` as the deadline); given, it is the whole policy.
        owner_grace_s: how long to wait for another live rank to download a shard this rank
            needs before fetching it itself.
    """

    def __init__(self, remote: RemoteDataset, options: RemoteOptions | None = None, *,
                 cache_dir: str | os.PathLike | None = None, limit: int | str | None = None,
                 threads: int | None = None, ahead: int = 0, local_rank: int | None = None,
                 local_world_size: int | None = None, retry: RetryPolicy | None = None, chunk_bytes: int = 8 << 20,
                 owner_grace_s: float = 30.0, poll_s: float = 0.01, fsync: bool = True):
        options = RemoteOptions.from_keywords(options, cache_dir=cache_dir, cache_limit=limit, download_threads=threads)
        lr, lws = _local_rank(local_rank, local_world_size)
        self.remote = remote
        self.policy = retry or options.retry_policy()
        self._closed = False
        self.files = CacheFiles(remote, options.cache_dir or default_cache_dir(), options.cache_limit)
        self.ranks = NodeRanks(self.files, lr, lws, owner_grace_s=owner_grace_s, poll_s=poll_s)
        self.timeline = Timeline(self.files.sizes, ahead)
        self.eviction = Eviction(self.files, self.timeline, self.ranks)
        self._cond = threading.Condition()  # guards what the download threads share (timeline, fetcher)
        self.fetcher = Fetcher(remote, self.files, self.ranks, self.timeline, self.eviction, self._cond,
                               policy=self.policy, threads=options.download_threads or 4, chunk_bytes=chunk_bytes,
                               fsync=fsync, poll_s=poll_s)
        # (no collaborator refers back to the cache: a dropped Dataset frees it at once, and
        # its finalizer joins the download threads)
        lifecycle.track(self)

    # -- what it is ------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return self.remote.url

    @property
    def root(self) -> Path:
        return self.files.root

    @property
    def dir(self) -> Path:
        return self.files.dir

    @property
    def sizes(self):
        return self.files.sizes

    @property
    def names(self) -> list[str]:
        return self.files.names

    @property
    def num_shards(self) -> int:
        return self.files.num_shards

    @property
    def limit(self) -> int:
        return self.files.limit

    @property
    def mirror(self) -> bool:
        return self.files.mirror

    @property
    def local_rank(self) -> int:
        return self.ranks.local_rank

    @property
    def local_world_size(self) -> int:
        return self.ranks.local_world_size

    @property
    def owner_grace_s(self) -> float:
        return self.ranks.owner_grace_s

    @property
    def ahead(self) -> int:
        return self.timeline.ahead

    @ahead.setter
    def ahead(self, value: int) -> None:
        self.timeline.ahead = max(0, int(value))

    @property
    def downloader(self):
        return self.fetcher.downloader

    @property
    def counters(self):
        return self.fetcher.counters

    @property
    def closed(self) -> bool:
        return self._closed

    # counters
    @property
    def evictions(self) -> int:
        return self.eviction.evictions

    @property
    def cache_hits(self) -> int:
        return self.fetcher.cache_hits

    @property
    def downloads(self) -> int:
        return self.fetcher.downloads

    @property
    def wait_s(self) -> float:
        return self.fetcher.wait_s

    @property
    def self_fetches(self) -> int:
        return self.fetcher.self_fetches

    # -- public ----------------------------------------------------------------------------
    def path(self, shard: int) -> Path:
        return self.files.path(shard)

    def owner(self, shard: int) -> int:
        return self.ranks.owner(shard)

    def disk_usage(self) -> int:
        """Bytes of shards and partial downloads in this dataset's cache directory."""
        return self.files.disk_usage()

    def ensure(self, shard: int, timeout: float | None = None) -> Path:
        """The local path of ``shard``, downloading it (or waiting for the rank that does)
        first. Raises :class:`DownloadError` / :class:`DownloadTimeout` naming the shard."""
        return self.fetcher.ensure(shard, timeout)

    def on_release(self, fn: Callable[[int], None]) -> None:
        """Call ``fn(shard)`` when this process no longer needs a shard (its last use is
        behind the reader) and before this process deletes one: drop mappings there."""
        self.eviction.on_release(fn)

    def on_fetched(self, fn: Callable[[int, Path], None]) -> None:
        """Call ``fn(shard, path)`` (in a download thread) after this process downloaded a
        shard and found it equal to the manifest's checksum, before anything reads it."""
        self.fetcher.on_fetched(fn)

    def remove_release_hook(self, fn: Callable[[int], None]) -> None:
        self.eviction.remove_release_hook(fn)

    def probe(self) -> dict[str, float]:
        """Cumulative counters (for a Loader's per-epoch stats)."""
        c, f = self.counters, self.fetcher
        return {"bytes_downloaded": c.bytes, "download_wait_s": f.wait_s, "download_busy_s": c.busy_s,
                "cache_hits": f.cache_hits, "evictions": self.eviction.evictions, "retries": c.retries,
                "downloads": f.downloads}

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
            self.timeline.clear()
        return self.fetcher.begin_stop()

    def _end_stop(self, begun: tuple) -> None:
        """Join what :meth:`_begin_stop` stopped, until its deadline; start a new generation."""
        self.fetcher.end_stop(begun)
        self.ranks.write_done()  # peers stop counting this rank
        if not self._closed:  # a new generation for the next pass
            self.fetcher.new_generation()

    def set_limit(self, limit: int) -> None:
        """A new byte budget (bytes; before a pass is planned: a mixture shares one budget out)."""
        self.files.set_limit(limit)

    def minimum_limit(self, uses: EpochUses) -> int:
        """The smallest ``limit`` that lets ``uses`` be read (see schedule.minimum_budget)."""
        return minimum_budget(uses.shards, uses.first, uses.last, self.sizes, self.ahead)[0]

    def plan(self, uses: EpochUses, next_uses: EpochUses | None = None, *, check: EpochUses | None = None) -> None:
        """Start a pass: ``uses`` (positions from ``uses.start``), and optionally the next
        pass's uses, fetched with what the budget leaves before this pass ends. Raises
        :class:`CacheTooSmall` when the budget cannot hold what the order needs at once
        (computed from ``check`` when given: the uses of a pass whose scan is not over, each
        last use the last one seen, which need no more than the pass does)."""
        self._check_open()
        need = self.minimum_limit(uses if check is None else check)
        if need > self.limit:
            raise CacheTooSmall(self._too_small_message(uses, need), minimum=need)
        with self._cond:
            self.fetcher.failed = None
            self.timeline.plan(uses, next_uses, self.limit)
            self.ranks.write_progress(self.timeline.my_t, self.timeline.pass_no)
            self._cond.notify_all()
        self.fetcher.start()

    def update(self, pass_no: int, uses: EpochUses, next_uses: EpochUses | None = None) -> bool:
        """More is known of pass ``pass_no`` (the :attr:`pass_no` its :meth:`plan` made): its
        uses extended as its scan went on (see :meth:`Timeline.update`), and optionally the
        next pass's. False (nothing done) when the cache is on another pass by now."""
        self._check_open()
        with self._cond:
            if self.timeline.pass_no != pass_no or not self.timeline.active:
                return False
            self.timeline.update(uses, next_uses, self.limit)
            self._cond.notify_all()
        return True

    @property
    def pass_no(self) -> int:
        """The passes planned so far (the current one's number)."""
        return self.timeline.pass_no

    def fail(self, error: BaseException) -> None:
        """The plan of the current pass failed (e.g. its scan found the budget too small):
        ``ensure`` raises ``error`` from now on, waits included."""
        with self._cond:
            self.fetcher.failed = error
            self._cond.notify_all()

    def advance(self, consumed: int) -> None:
        """The global position consumed in the current pass (every position below it is
        done on this rank; the Loader passes what it has delivered)."""
        if self.timeline.advance(consumed):
            self._on_event()

    def reopen_state(self) -> dict[str, Any]:
        """What another process needs to open this dataset's cache the same way (a pickled
        Dataset): the transport's secret-free description, the fingerprint and the settings."""
        return {"remote": self.remote.transport.describe(), "fingerprint": self.remote.fingerprint,
                "cache_dir": str(self.root), "cache_limit": self.limit, "download_timeout": self.policy.timeout_s,
                "download_threads": self.fetcher.threads}

    def stats(self) -> dict[str, Any]:
        c, f = self.counters, self.fetcher
        return {"bytes_downloaded": c.bytes, "download_wait_s": f.wait_s, "download_MBps": c.mbps(),
                "cache_hits": f.cache_hits, "evictions": self.eviction.evictions, "retries": c.retries,
                "downloads": f.downloads, "throttled": c.throttled, "credential_reloads": c.rebuilds,
                "checksum_failures": c.checksum_failures, "downloads_in_flight_limit": f.downloader.concurrency.limit,
                "self_fetches": f.self_fetches, "cache_limit": self.limit}

    # -- events and eviction -----------------------------------------------------------------
    def _on_event(self) -> None:
        """This rank passed an event of the timeline: release what it no longer needs, then
        evict what no local rank needs any more (under the admission lock)."""
        timeline = self.timeline
        self.ranks.write_progress(timeline.my_t, timeline.pass_no)
        self.eviction.release_passed()
        timeline.event_handled()
        node_t = self.ranks.refresh(timeline.my_t, timeline.hold, force=True)
        t0 = time.monotonic()
        if not self.files.lock_admission(t0 + self.policy.timeout_s):  # never without a deadline
            raise RemoteError(f"eviction in {self.dir} stopped: "
                              + self.files.admission_stuck(time.monotonic() - t0))
        try:
            self.eviction.evict(node_t, need=0, busy=self.fetcher.busy)
        finally:
            self.files.unlock_admission()
        with self._cond:
            self._cond.notify_all()

    # -- process lifecycle -----------------------------------------------------------------
    def _after_fork_in_child(self) -> None:
        """In a process forked from this cache's (a DataLoader worker): none of the download
        or range threads exist here, and their locks may be held. Start afresh as an
        on-demand cache of the same directory (no plan: the parent's pass is the parent's):
        new locks, new downloader, and the cross-process flocks opened again (a flock is
        shared with the parent through an inherited descriptor, so it would not exclude it)."""
        self._cond = threading.Condition()
        self.timeline.clear()
        self.fetcher.after_fork(self._cond)
        self.ranks.after_fork(self._closed)
        self.files.after_fork(self._closed)

    def close(self) -> None:
        """Stop and join the download threads, leave the node (peers stop counting this
        rank), and release the locks. Complete shards stay for the next run."""
        if self._closed:
            return
        self._closed = True
        self.fetcher.closed = True
        lifecycle.untrack(self)
        self.stop()
        self.ranks.close()
        self.files.close()

    def __enter__(self) -> ShardCache:
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


def _local_rank(local_rank: int | None, local_world_size: int | None) -> tuple[int, int]:
    """(local rank, local world size): the arguments, else what the launcher said
    (:func:`fastload.runtime.world.local_env`, the one reader of ``LOCAL_RANK`` /
    ``LOCAL_WORLD_SIZE``, as ``World.detect`` reads them; not ``World.detect`` itself, which
    asks ``torch.distributed`` for the global rank: this package does not import torch), else
    0 / 1; checked."""
    from ..runtime.world import local_env

    env_rank, env_size = local_env()
    lws = (env_size or 1) if local_world_size is None else int(local_world_size)
    if lws < 1:
        raise ValueError(f"local_world_size={local_world_size!r} must be >= 1")
    if local_rank is None:
        local_rank = env_rank or 0
    if not 0 <= int(local_rank) < lws:
        raise ValueError(f"local_rank={local_rank!r} must be in [0, local_world_size={lws})")
    return int(local_rank), lws


def stop_caches(caches) -> None:
    """:meth:`ShardCache.stop` of several caches (a mixture's) at once: all are told to stop
    first, then joined, so the whole takes one ``close_s`` (the longest), not their sum."""
    begun = [c._begin_stop() for c in caches]
    for c, b in zip(caches, begun):
        c._end_stop(b)

"""Getting shards into the cache: the download threads, admission, and :meth:`ensure`.

Part of :mod:`fastload.remote.cache`. :class:`_Fetching` is the part of
:class:`~fastload.remote.cache.ShardCache` that

* runs the background threads downloading, in first-use order, the shards this rank owns
  once the node's slowest rank is far enough (their admission time on the timeline);
* admits a download: under the node-wide admission flock, counts the bytes really on disk,
  evicts if needed, and reserves the shard's room by creating its partial file;
* downloads one shard under its own flock (another process downloading it: wait for it);
* :meth:`ShardCache.ensure`: the local path of a shard, fetched now, or waited for while its
  owner rank fetches it (fetched here after ``owner_grace_s``, or at once if that rank died).

Every wait here ends by the shard's deadline (``download_timeout``): for another process's
download (its flock), for the admission flock (a stopped process may hold it), for room in
the budget, for the server. Room held by partial downloads nobody writes any more (their
process was killed) is taken back when a download needs it: their shard's flock is free.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING
from pathlib import Path

from ..errors import DownloadError, DownloadTimeout, FastloadError, RemoteError, format_bytes
from .cache_files import _Flock
from .download import Cancelled

if TYPE_CHECKING:
    from .download import Downloader

__all__: list[str] = []

logger = logging.getLogger("fastload")


class _Fetching:
    """Mixin of :class:`~fastload.remote.cache.ShardCache` (uses the downloader, locks and
    shared state set by its ``__init__``)."""

    def ensure(self, shard: int, timeout: float | None = None) -> Path:
        """The local path of ``shard``, downloading it (or waiting for the rank that does)
        first. Raises :class:`DownloadError` / :class:`DownloadTimeout` naming the shard."""
        shard = int(shard)
        path = self.path(shard)
        if path.exists():
            return path
        self._check_open()
        t0 = time.monotonic()
        deadline = t0 + (self.policy.timeout_s if timeout is None else float(timeout))
        try:
            while True:
                if path.exists():
                    return path
                if self._closed:
                    raise Cancelled()
                take = False
                with self._cond:
                    err = self._errors.get(shard)
                    if err is not None:
                        raise err
                    if shard not in self._inflight:
                        owner = self.owner(shard)
                        waited = time.monotonic() - t0
                        planned = shard in self._by_shard
                        if (owner == self.local_rank or not planned or not self._is_alive(owner)
                                or waited > self.owner_grace_s):
                            if owner != self.local_rank and planned:
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
            raise RemoteError(f"the cache of {self.url} was closed while shard {self.names[shard]} "
                              "was being fetched") from None
        finally:
            self.wait_s += time.monotonic() - t0

    def _start_workers(self) -> None:
        if self._workers:
            return
        # this generation's stop event and downloader: a thread left behind by stop() (blocked
        # in a read) keeps the ones that told it to stop, never the next generation's
        stop, downloader = self._stop, self.downloader
        for i in range(self._threads_n):
            t = threading.Thread(target=self._worker, args=(stop, downloader), name=f"fastload-download-{i}",
                                 daemon=True)
            t.start()
            self._workers.append(t)

    def _worker(self, stop: threading.Event, downloader: "Downloader") -> None:
        while not stop.is_set():
            with self._cond:
                j = self._next
                if j >= len(self._u_shard):
                    self._cond.wait(0.1)
                    continue
                node_t = self._refresh_node_t()
                if self._u_admit[j] > node_t:
                    self._cond.wait(self._poll if self.local_world_size > 1 else 0.1)
                    continue
                self._next = j + 1
                s = int(self._u_shard[j])
                if self._u_last[j] < node_t or s in self._inflight:
                    continue
                owner = self.owner(s)
                if self.path(s).exists():
                    if owner == self.local_rank and s not in self._fetched:
                        self.cache_hits += 1  # there before this run needed it (an earlier run, epoch, rank)
                    self._fetched.discard(s)
                    continue
                if owner != self.local_rank and self._is_alive(owner):
                    continue  # the owner fetches it
                self._inflight.add(s)
            try:
                self._obtain(s, time.monotonic() + self.policy.timeout_s, priority=j, stop=stop, downloader=downloader)
            except Cancelled:
                return
            except BaseException as e:  # kept for the reader: ensure() raises it, naming the shard
                if not isinstance(e, FastloadError):
                    e = DownloadError(f"shard {self.names[s]} from {self.remote.shard_url(s)} failed: "
                                      f"{type(e).__name__}: {e}", shard=self.names[s], url=self.remote.shard_url(s))
                with self._cond:
                    self._errors[s] = e
            finally:
                with self._cond:
                    self._inflight.discard(s)
                    self._cond.notify_all()

    def _obtain(self, s: int, deadline: float, priority: float = -1, *, stop: threading.Event,
                downloader: "Downloader") -> None:
        """Download shard ``s`` unless it is (or gets) there: under its flock, after the
        budget admitted it. The caller has put ``s`` in ``_inflight``."""
        path = self.path(s)
        lock = _Flock(self.dir / ".locks" / f"{self.names[s]}.lock")
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
            part = self.dir / f".{self.names[s]}.part"
            self._reserve(s, part, deadline, stop)
            downloader.fetch(self.names[s], path, size=int(self.sizes[s]), checksum=self.remote.checksums[s],
                                  part=part, label=self.names[s], deadline=deadline, priority=priority)
            for fn in self._fetch_hooks:  # e.g. the reader remembers the shard as verified
                try:
                    fn(s, path)
                except Exception:  # a hook must not fail the download
                    logger.exception("fastload: fetch hook failed for shard %s", self.names[s])
            with self._cond:
                self.downloads += 1
                self._fetched.add(s)
                self._errors.pop(s, None)
        finally:
            lock.close()

    def _lock_admission(self, deadline: float) -> bool:
        """Take the in-process and the node-wide admission locks, waiting until ``deadline``
        at most (a process stopped while holding the flock must not hang this one)."""
        if not self._admit_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return False
        if self._admission.lock(deadline - time.monotonic()):
            return True
        self._admit_lock.release()
        return False

    def _unlock_admission(self) -> None:
        self._admission.unlock()
        self._admit_lock.release()

    def _admission_stuck(self, waited: float) -> str:
        return (f"the cache's admission lock {self._admission.path} was not free for {waited:.0f}s: another "
                f"process using the cache {self.dir} holds it and is stopped or hung (suspended with Ctrl-Z, "
                "a debugger); resume or end it, or use another cache_dir")

    def _reserve(self, s: int, part: Path, deadline: float, stop: threading.Event) -> None:
        """Wait until shard ``s`` fits in the budget next to what is on disk, then create its
        partial file (which counts at full size for every other process from then on).
        Partial files of downloads that nobody writes any more are taken back first."""
        size = int(self.sizes[s])
        t0 = time.monotonic()
        while True:
            if not self._lock_admission(deadline):
                raise DownloadTimeout(f"shard {self.names[s]} could not be admitted: "
                                      + self._admission_stuck(time.monotonic() - t0),
                                      shard=self.names[s], url=self.remote.shard_url(s))
            try:
                node_t = self._refresh_node_t(force=True)
                complete, partial = self._present()
                own_part = size if part.exists() else 0
                used = sum(complete.values()) + partial - own_part
                if used + size > self.limit and self._reclaim_stale_parts(keep=s):
                    complete, partial = self._present()
                    used = sum(complete.values()) + partial - own_part
                if used + size > self.limit:
                    self._evict(node_t, used + size - self.limit)
                    complete, partial = self._present()
                    used = sum(complete.values()) + partial - own_part
                if used + size <= self.limit:
                    part.touch()
                    return
            finally:
                self._unlock_admission()
            if stop.is_set():
                raise Cancelled()
            if time.monotonic() >= deadline:
                raise DownloadTimeout(
                    f"shard {self.names[s]} ({format_bytes(size)}) waited until its deadline for room in the cache: "
                    f"cache_limit={format_bytes(self.limit)} holds {format_bytes(used)} of shards still in use "
                    f"in {self.dir}; raise cache_limit (or download_timeout=), or check that every local rank "
                    "is making progress", shard=self.names[s], url=self.remote.shard_url(s))
            with self._cond:
                self._cond.wait(self._poll * 5)

    def _timeout(self, s: int, t0: float) -> DownloadTimeout:
        owner = self.owner(s)
        who = "" if owner == self.local_rank else f" (waiting for local rank {owner}, which downloads it)"
        return DownloadTimeout(
            f"shard {self.names[s]} was not in the cache {self.dir} after {time.monotonic() - t0:.0f}s{who}; "
            f"it comes from {self.remote.shard_url(s)}: check the network and the server, or raise "
            "download_timeout= (fastload.Dataset / Loader)",
            shard=self.names[s], url=self.remote.shard_url(s))

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
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..errors import CacheTooSmall, DownloadError, DownloadTimeout, FastloadError, RemoteError, format_bytes
from .download import Cancelled, Downloader, DownloadCounters, RetryPolicy
from .manifest import RemoteDataset
from .schedule import EpochUses, admission_times, minimum_budget

__all__ = ["ShardCache", "default_cache_dir", "parse_bytes", "format_bytes"]

logger = logging.getLogger("fastload")

CACHE_ENV = "FASTLOAD_CACHE"
REMOTE_JSON = "remote.json"
_NEVER = np.iinfo(np.int64).min // 4  # "admitted since forever" (uses of a previous pass)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def default_cache_dir() -> Path:
    """``$FASTLOAD_CACHE``, else ``~/.cache/fastload``."""
    v = os.environ.get(CACHE_ENV, "").strip()
    return Path(v).expanduser() if v else Path.home() / ".cache" / "fastload"


def parse_bytes(value: int | str, what: str = "cache_limit") -> int:
    """'200GB', '1.5GiB', '4096' or an int -> bytes (> 0)."""
    import re

    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        n = int(value)
    else:
        m = re.match(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)\s*$", str(value), re.I)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{what}={value!r} is not a size; use e.g. 200GB, 1.5GiB or a byte count")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"{what}={value!r} must be a positive size")
    return n


class _Flock:
    """A kernel advisory lock on a file (released by the kernel when the process dies).
    Lock files are never deleted: deleting them races with the next locker."""

    def __init__(self, path: Path):
        self.path = path
        self.fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def try_lock(self) -> bool:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def lock(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def unlock(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases the lock
            self.fd = None


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


class ShardCache:
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
        from ..system import local_world_size as _lws

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
        self.limit = self._resolve_limit(limit)
        # the whole dataset fits: a mirror, nothing is deleted (a rerun reads it all locally)
        self.mirror = self.limit >= int(self.sizes.sum())
        biggest = int(self.sizes.max()) if self.num_shards else 0
        if self.limit < biggest:
            raise CacheTooSmall(
                f"cache_limit={format_bytes(self.limit)} is smaller than the largest shard of {remote.url} "
                f"({format_bytes(biggest)}); raise cache_limit", minimum=biggest)

        self._stop = threading.Event()
        self.counters = DownloadCounters()
        self.downloader = Downloader(remote.transport, threads=threads, policy=self.policy, chunk_bytes=chunk_bytes,
                                     stop=self._stop, counters=self.counters, fsync=fsync)
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

        # The timeline (see schedule.py): uses of the kept passes, in first-use order.
        self._u_shard = np.zeros(0, np.int64)
        self._u_first = np.zeros(0, np.int64)
        self._u_last = np.zeros(0, np.int64)
        self._u_admit = np.zeros(0, np.int64)
        self._by_shard: dict[int, np.ndarray] = {}
        self._events = np.zeros(0, np.int64)
        self._next_event = np.iinfo(np.int64).max
        self._next = 0           # next use for the prefetch threads
        self._passes: list[dict] = []  # {"k", "base", "uses"} of the kept passes
        self._pass = 0
        self._base_next = 0
        self._my_t = 0
        self._cur_base = self._cur_start = self._cur_len = 0
        self._rank_t: list[int] = [0]  # timeline positions of the live local ranks (this one first)
        self._node_t = 0
        self._node_t_at = 0.0
        self._release_ptr = 0
        self._by_last = np.zeros(0, np.int64)
        self._inflight: set[int] = set()
        self._fetched: set[int] = set()  # downloaded by this process, not yet counted by the prefetcher
        self._errors: dict[int, BaseException] = {}
        self._released: set[int] = set()
        self._release_hooks: list[Callable[[int], None]] = []
        self._workers: list[threading.Thread] = []
        self._closed = False
        # counters
        self.cache_hits = 0
        self.evictions = 0
        self.downloads = 0
        self.wait_s = 0.0
        self.self_fetches = 0

    # -- construction helpers --------------------------------------------------------------
    def _write_remote_json(self) -> None:
        p = self.dir / REMOTE_JSON
        doc = {"url": self.remote.url, "fingerprint": self.remote.fingerprint, "manifest": self.remote.manifest,
               "note": "a fastload shard cache, not a dataset; open the URL, or run `fastload prefetch URL DIR` "
                       "for a complete local copy"}
        text = json.dumps(doc, indent=1)
        try:
            if p.exists() and p.read_text(encoding="utf-8") == text:
                return
        except OSError:
            pass
        _write_atomic(p, text)

    def _check_present(self) -> None:
        """Complete shards left by an earlier run are trusted by size; a wrong size is a
        damaged file (deleted, downloaded again)."""
        for e in os.scandir(self.dir):
            i = self._index.get(e.name)
            if i is not None and e.stat().st_size != self.sizes[i]:
                logger.warning("fastload: cached %s has %d bytes, the manifest says %d; downloading it again",
                               e.path, e.stat().st_size, self.sizes[i])
                os.unlink(e.path)

    def _resolve_limit(self, limit) -> int:
        total = int(self.sizes.sum())
        if limit is not None:
            return parse_bytes(limit)
        free = shutil.disk_usage(self.dir).free + self.disk_usage()
        return max(1, min(total, int(0.8 * free)))

    def _claim_alive(self) -> None:
        """Hold this rank's ``alive`` lock. Another open cache of the same rank (a second
        Dataset in this process, a DataLoader worker) already holds it: then this one runs
        without it (peers see the rank through the first)."""
        deadline = time.monotonic() + 0.2
        while not self._alive.try_lock():
            if time.monotonic() > deadline:
                self._alive.close()
                return
            time.sleep(0.01)

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

    def stop(self) -> None:
        """Stop and join the download threads (a Loader closing); ``ensure()`` still works,
        and the next :meth:`plan` starts them again."""
        with self._cond:
            self._passes = []
            self._u_shard = self._u_first = self._u_last = self._u_admit = np.zeros(0, np.int64)
            self._by_shard, self._next = {}, 0
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        for t in self._workers:
            t.join()
        self._workers = []
        self.downloader.close()
        if self.local_world_size > 1 and self._alive.fd is not None:
            _write_atomic(self._progress_path, "done\n")  # peers stop counting this rank
        if not self._closed:
            self._stop.clear()

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
                    self._obtain(shard, deadline)
                finally:
                    with self._cond:
                        self._inflight.discard(shard)
                        self._cond.notify_all()
        except Cancelled:
            raise RemoteError(f"the cache of {self.url} was closed while shard {self.names[shard]} "
                              "was being fetched") from None
        finally:
            self.wait_s += time.monotonic() - t0

    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {"bytes_downloaded": c.bytes, "download_wait_s": self.wait_s, "download_MBps": c.mbps(),
                "cache_hits": self.cache_hits, "evictions": self.evictions, "retries": c.retries,
                "downloads": self.downloads, "throttled": c.throttled, "credential_reloads": c.rebuilds,
                "checksum_failures": c.checksum_failures, "downloads_in_flight_limit": self.downloader.concurrency.limit,
                "self_fetches": self.self_fetches, "cache_limit": self.limit}

    def disk_usage(self) -> int:
        """Bytes of shards and partial downloads in this dataset's cache directory."""
        total = 0
        for e in os.scandir(self.dir):
            if e.name.endswith(".arrow") or e.name.endswith(".part"):
                try:
                    total += e.stat().st_size
                except FileNotFoundError:
                    pass
        return total

    def close(self) -> None:
        """Stop and join the download threads, leave the node (peers stop counting this
        rank), and release the locks. Complete shards stay for the next run."""
        if self._closed:
            return
        self._closed = True
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

    # -- timeline ----------------------------------------------------------------------------
    def _rebuild_timeline(self, n_prev: int, t0: int) -> None:
        shards, first, last = [], [], []
        for j, p in enumerate(self._passes):
            u: EpochUses = p["uses"]
            off = p["base"] - u.start
            shards.append(u.shards)
            first.append(u.first + off)
            last.append(u.last + off)
        sh = np.concatenate(shards) if shards else np.zeros(0, np.int64)
        fi = np.concatenate(first) if first else np.zeros(0, np.int64)
        la = np.concatenate(last) if last else np.zeros(0, np.int64)
        n_prev_uses = sum(len(p["uses"]) for p in self._passes[:n_prev])
        adm = np.full(len(sh), _NEVER, dtype=np.int64)
        adm[n_prev_uses:] = admission_times(sh[n_prev_uses:], fi[n_prev_uses:], la[n_prev_uses:], self.sizes,
                                            self.limit, t0)
        self._u_shard, self._u_first, self._u_last, self._u_admit = sh, fi, la, adm
        order = np.argsort(sh, kind="stable")
        bounds = np.searchsorted(sh[order], np.arange(self.num_shards + 1))
        self._by_shard = {int(s): order[bounds[s]:bounds[s + 1]] for s in np.unique(sh)}
        self._by_last = np.argsort(la, kind="stable")
        self._next = n_prev_uses
        ev = np.concatenate([adm[n_prev_uses:], la + 1, fi - self.ahead])
        self._events = np.unique(ev[ev > _NEVER])
        self._next_event = self._event_after(t0 - 1)

    def _event_after(self, t: int) -> int:
        i = int(np.searchsorted(self._events, t, side="right"))
        return int(self._events[i]) if i < len(self._events) else np.iinfo(np.int64).max

    def _on_event(self) -> None:
        self._write_progress()
        self._release_passed()
        self._next_event = self._event_after(self._my_t)
        node_t = self._refresh_node_t(force=True)
        with self._admit_lock:
            self._admission.lock()
            try:
                self._evict(node_t, need=0)
            finally:
                self._admission.unlock()
        with self._cond:
            self._cond.notify_all()

    def _release_passed(self) -> None:
        """Mappings of shards whose uses are all behind this rank go (callbacks)."""
        t = self._my_t
        order = self._by_last
        while self._release_ptr < len(order) and self._u_last[order[self._release_ptr]] < t:
            s = int(self._u_shard[order[self._release_ptr]])
            self._release_ptr += 1
            if s in self._released or self._required_by_me(s, t):
                continue
            self._released.add(s)
            self._call_release(s)

    def _required_by_me(self, s: int, t: int) -> bool:
        us = self._by_shard.get(s)
        if us is None:
            return False
        return bool(np.any((self._u_first[us] - self.ahead <= t) & (self._u_last[us] >= t)))

    def _call_release(self, s: int) -> None:
        for fn in self._release_hooks:
            try:
                fn(s)
            except Exception:  # a hook must not break the cache
                logger.exception("fastload: release hook failed for shard %s", self.names[s])

    # -- the node's position ---------------------------------------------------------------------
    def _write_progress(self) -> None:
        if self.local_world_size > 1:
            _write_atomic(self._progress_path, f"{self._my_t} {self._pass} {socket.gethostname()}\n")

    def _is_alive(self, rank: int) -> bool:
        if rank == self.local_rank:
            return True
        f = self._peer_alive.get(rank)
        if f is None or f.fd is None:
            return False
        if f.try_lock():
            f.unlock()
            return False
        return True

    def _refresh_node_t(self, force: bool = False) -> int:
        """min over the live local ranks of their timeline position."""
        if self.local_world_size == 1:
            self._node_t = self._my_t
            self._rank_t = [self._my_t]
            return self._node_t
        now = time.monotonic()
        if not force and now - self._node_t_at < self._poll:
            return self._node_t
        t = self._my_t
        ranks = [t]
        hold = self._passes[0]["base"] if self._passes else 0  # nothing of this run evicted yet
        for r in self._peer_alive:
            peer = self._peer_position(r, hold, now)
            if peer is None:
                continue
            t = min(t, peer)
            ranks.append(peer)
        self._node_t, self._node_t_at, self._rank_t = t, now, ranks
        return t

    def _peer_position(self, r: int, hold: int, now: float) -> int | None:
        """Local rank ``r``'s timeline position; None when it does not count (it finished or
        died in this run); ``hold`` while it has not started this run yet (a rank slower to
        start must not find its first shards evicted), for at most ``owner_grace_s``."""
        alive = self._is_alive(r)
        fresh = None
        try:
            p = self.dir / ".progress" / f"rank-{r}"
            if p.stat().st_mtime >= self._t_open - 1.0:  # written in this run
                fresh = p.read_text(encoding="utf-8").split()
        except (OSError, ValueError):
            fresh = None
        if fresh:
            if fresh[0] == "done":
                return None
            if alive:
                try:
                    return int(fresh[0])
                except ValueError:
                    return hold
            return None  # it ran in this run and its process is gone: it died
        if alive or now - self._t_open_mono < self.owner_grace_s:
            return hold  # not started yet (or between opening its cache and its first pass)
        return None

    # -- eviction ------------------------------------------------------------------------------
    def _present(self) -> tuple[dict[int, int], int]:
        """(complete shard -> bytes, bytes of partial downloads at their full size)."""
        complete: dict[int, int] = {}
        partial = 0
        for e in os.scandir(self.dir):
            n = e.name
            i = self._index.get(n)
            if i is not None:
                complete[i] = int(self.sizes[i])
            elif n.startswith(".") and n.endswith(".part"):
                j = self._index.get(n[1:-5])
                if j is not None:
                    partial += int(self.sizes[j])
        return complete, partial

    def _classify(self, s: int, node_t: int) -> tuple[bool, float]:
        """(live, next use): live = an admitted use of ``s`` is not behind the node, or a
        local rank (possibly ahead of the node) reads it; next use = the first position of
        its earliest not-yet-admitted use (inf: none, -inf: never planned)."""
        us = self._by_shard.get(s)
        if us is None:
            return False, float("-inf")
        adm, la, fi = self._u_admit[us], self._u_last[us], self._u_first[us]
        live = bool(np.any((adm <= node_t) & (la >= node_t)))
        if not live:
            for t in self._rank_t:
                if np.any((fi - self.ahead <= t) & (la >= t)):
                    live = True
                    break
        fut = fi[adm > node_t]
        return live, float(fut.min()) if len(fut) else float("inf")

    def _evict(self, node_t: int, need: int) -> int:
        """Delete shards nobody needs any more (exact eviction); then, while ``need`` bytes
        more are wanted, shards not needed now, farthest next use first. Returns bytes freed.
        Called with the admission lock held."""
        complete, _ = self._present()
        freed = 0
        candidates = []
        for s, size in complete.items():
            if s in self._inflight:
                continue
            live, nxt = self._classify(s, node_t)
            if live:
                continue
            if nxt == float("inf") and not self.mirror:  # every planned use is behind the node
                if self._delete(s):
                    freed += size
            else:
                candidates.append((nxt, s, size))
        if need > freed:
            # farthest next use first; never-planned files (on-demand reads) by age
            def key(c):
                nxt, s, _ = c
                if nxt == float("-inf"):
                    try:
                        return (1, -self.path(s).stat().st_mtime)
                    except FileNotFoundError:
                        return (2, 0)
                return (0, -nxt)
            for nxt, s, size in sorted(candidates, key=key):
                if freed >= need:
                    break
                if self._delete(s):
                    freed += size
        return freed

    def _delete(self, s: int) -> bool:
        self._call_release(s)
        try:
            os.unlink(self.path(s))
        except FileNotFoundError:
            return False
        self.evictions += 1
        return True

    # -- downloading ---------------------------------------------------------------------------
    def _start_workers(self) -> None:
        if self._workers:
            return
        for i in range(self._threads_n):
            t = threading.Thread(target=self._worker, name=f"fastload-download-{i}", daemon=True)
            t.start()
            self._workers.append(t)

    def _worker(self) -> None:
        while not self._stop.is_set():
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
                self._obtain(s, time.monotonic() + self.policy.timeout_s, priority=j)
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

    def _obtain(self, s: int, deadline: float, priority: float = -1) -> None:
        """Download shard ``s`` unless it is (or gets) there: under its flock, after the
        budget admitted it. The caller has put ``s`` in ``_inflight``."""
        path = self.path(s)
        lock = _Flock(self.dir / ".locks" / f"{self.names[s]}.lock")
        try:
            while not lock.try_lock():  # another process downloads it
                if path.exists():
                    return
                if self._stop.is_set():
                    raise Cancelled()
                if time.monotonic() >= deadline:
                    raise self._timeout(s, deadline - self.policy.timeout_s)
                time.sleep(self._poll)
            if path.exists():
                return
            part = self.dir / f".{self.names[s]}.part"
            self._reserve(s, part, deadline)
            self.downloader.fetch(self.names[s], path, size=int(self.sizes[s]), checksum=self.remote.checksums[s],
                                  part=part, label=self.names[s], deadline=deadline, priority=priority)
            with self._cond:
                self.downloads += 1
                self._fetched.add(s)
                self._errors.pop(s, None)
        finally:
            lock.close()

    def _reserve(self, s: int, part: Path, deadline: float) -> None:
        """Wait until shard ``s`` fits in the budget next to what is on disk, then create its
        partial file (which counts at full size for every other process from then on)."""
        size = int(self.sizes[s])
        while True:
            with self._admit_lock:
                self._admission.lock()
                try:
                    node_t = self._refresh_node_t(force=True)
                    complete, partial = self._present()
                    own_part = size if part.exists() else 0
                    used = sum(complete.values()) + partial - own_part
                    if used + size > self.limit:
                        self._evict(node_t, used + size - self.limit)
                        complete, partial = self._present()
                        used = sum(complete.values()) + partial - own_part
                    if used + size <= self.limit:
                        part.touch()
                        return
                finally:
                    self._admission.unlock()
            if self._stop.is_set():
                raise Cancelled()
            if time.monotonic() >= deadline:
                raise DownloadTimeout(
                    f"shard {self.names[s]} ({format_bytes(size)}) waited until its deadline for room in the cache: "
                    f"cache_limit={format_bytes(self.limit)} holds {format_bytes(used)} of shards still in use "
                    f"in {self.dir}; raise cache_limit (or download_timeout), or check that every local rank "
                    "is making progress", shard=self.names[s], url=self.remote.shard_url(s))
            with self._cond:
                self._cond.wait(self._poll * 5)

    # -- messages --------------------------------------------------------------------------
    def _timeout(self, s: int, t0: float) -> DownloadTimeout:
        owner = self.owner(s)
        who = "" if owner == self.local_rank else f" (waiting for local rank {owner}, which downloads it)"
        return DownloadTimeout(
            f"shard {self.names[s]} was not in the cache {self.dir} after {time.monotonic() - t0:.0f}s{who}; "
            f"it comes from {self.remote.shard_url(s)}: check the network and the server, or raise download_timeout",
            shard=self.names[s], url=self.remote.shard_url(s))

    def _too_small_message(self, uses: EpochUses, need: int, hint: str | None = None) -> str:
        return (f"cache_limit={format_bytes(self.limit)} is too small for this order of {self.url}: reading it needs "
                f"{format_bytes(need)} of shards on disk at the same time (of {format_bytes(int(self.sizes.sum()))} "
                f"in all). Raise cache_limit to at least {format_bytes(need)} ({need} bytes), or "
                + (hint or "read in shard windows with shuffle_mode=\"window\" (a window of w shards needs about "
                            "2*w+1 shards of cache), which keeps only a few shards in use at a time"))

    def _check_open(self) -> None:
        if self._closed:
            raise RemoteError(f"the cache of {self.url} is closed")

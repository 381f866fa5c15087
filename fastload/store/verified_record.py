"""Shard integrity: the verification policy and the node's record of verified shards.

A reader never delivers a row of a shard whose bytes it has not checked against the
manifest's checksum, unless told to (``verify="off"``):

``"first-use"`` (the default)
    Each shard is hashed (xxh3-128 of the mapped file, in C++ with the GIL released, several
    shards in parallel) the first time a read touches it, before any of its rows is
    delivered. A shard that matches is remembered in a per-node record
    (``$FASTLOAD_CACHE/verified``, default ``~/.cache/fastload/verified``; without a home
    directory ``$XDG_CACHE_HOME/fastload``, else ``<tmp>/fastload-<uid>``) keyed by the
    file's identity (device, inode, size, modification and change times) and the expected
    checksum, so a restarted job, another rank on the same node, or the next epoch does not
    hash it again. Ranks on a node share the work: a shard another process is hashing is
    waited for (``flock``), not hashed twice — for at most :func:`lock_deadline` seconds
    (30 s plus 1 s per 200 MB of the shard; ``$FASTLOAD_VERIFY_LOCK_TIMEOUT`` sets the 30),
    after which the shard is hashed without the lock (a stopped or hung process never
    blocks the others). Any change to the file (a write, a rename over it, a restore from
    backup) changes its identity, so it is hashed again. A shard modified less than
    :data:`RACY_WINDOW_S` seconds before it was hashed is not remembered (git's
    "racy clean" rule: on a file system with coarse timestamps, a second write in the same
    tick would keep the identity). Entries for files that no longer exist or changed are
    pruned about once a day.
``"always"``
    As ``"first-use"``, without the record: every reader (every process) hashes each shard
    it touches once.
``"off"``
    No hashing. The structural checks still run when a shard is mapped (a regular file of
    the manifest's size, one record batch of the manifest's row count, the manifest's
    schema including field shapes), so a truncated, replaced-by-another-size or
    wrong-schema shard is still refused; a same-size byte flip or two swapped equal-size
    shards are not detected.

The record only says "this exact file was hashed and matched"; it is not a defence against
someone who can write the cache directory or reset a file's ctime.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, Sequence

from ..files import atomic_write
from ..runtime.system import CACHE_ENV, cache_root, usable_cores

__all__ = ["DEFAULT_VERIFY", "LOCK_TIMEOUT_ENV", "RACY_WINDOW_S", "VERIFY_POLICIES", "VerifiedRecord", "cache_root",
           "hash_mapped", "lock_deadline"]

logger = logging.getLogger("fastload")

VERIFY_POLICIES = ("first-use", "always", "off")
DEFAULT_VERIFY = "first-use"
LOCK_TIMEOUT_ENV = "FASTLOAD_VERIFY_LOCK_TIMEOUT"
LOCK_TIMEOUT_S = 30.0  # waiting for another process's hash of one shard: this, plus ...
LOCK_BYTES_PER_S = 200e6  # ... the time to hash the shard at this (slow disk) speed
RACY_WINDOW_S = 2.0  # a shard changed less than this before it was hashed is not remembered
PRUNE_EVERY_S = 24 * 3600.0  # the record drops entries of gone or changed files this often
_STALE_TMP_S = 3600.0  # a temporary or lock file this old is left over from a killed process

def lock_deadline(nbytes: int) -> float:
    """Seconds to wait for another process hashing a shard of ``nbytes`` before hashing it
    without the lock: ``$FASTLOAD_VERIFY_LOCK_TIMEOUT`` (default 30) plus 1 s per 200 MB."""
    try:
        base = float(os.environ.get(LOCK_TIMEOUT_ENV, "") or LOCK_TIMEOUT_S)
    except ValueError:
        base = LOCK_TIMEOUT_S
    return max(0.0, base) + max(0, int(nbytes)) / LOCK_BYTES_PER_S


def hash_mapped(mapped: Sequence[Any]) -> list[str]:
    """``"xxh3_128:<hex>"`` of each mapped file, hashed in parallel threads (the hashing
    releases the GIL); the threads are joined before this returns."""
    if len(mapped) <= 1:
        return [m.hash_xxh3_128() for m in mapped]
    workers = min(len(mapped), usable_cores())
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fastload-verify") as pool:
        return list(pool.map(lambda m: m.hash_xxh3_128(), mapped))


def _identity_key(realpath: str, dev: int, ino: int, size: int, mtime_ns: int, ctime_ns: int, checksum: str) -> str:
    ident = "\0".join(map(str, (realpath, dev, ino, size, mtime_ns, ctime_ns, checksum)))
    return hashlib.sha256(ident.encode("utf-8", "surrogateescape")).hexdigest()


class VerifiedRecord:
    """The shards this node has hashed and found to match their manifest checksum.

    ``root``: the cache directory (default :func:`cache_root`; the record is its
    ``verified/`` subdirectory). ``lock_timeout_s``: the base of :func:`lock_deadline`
    (default ``$FASTLOAD_VERIFY_LOCK_TIMEOUT`` or 30 s). Without a usable directory the
    record remembers nothing (each process then hashes), said once in the log."""

    def __init__(self, root: Path | None = None, *, lock_timeout_s: float | None = None) -> None:
        root = root if root is not None else cache_root()
        self.dir = root / "verified" if root is not None else None
        self.lock_timeout_s = lock_timeout_s
        self._warned = False
        self._lock_warned = False
        if self.dir is None:
            self._warned = True  # cache_root() said it

    @staticmethod
    def key(mapped: Any, checksum: str) -> str:
        return _identity_key(os.path.realpath(mapped.path), mapped.st_dev, mapped.st_ino, mapped.size,
                             mapped.st_mtime_ns, mapped.st_ctime_ns, checksum)

    def _path(self, key: str) -> Path:
        return self.dir / key[:2] / key

    def contains(self, key: str) -> bool:
        return self.dir is not None and self._path(key).is_file()

    def add(self, key: str, mapped: Any, checksum: str, *, hashed_at: float | None = None,
            written_here: bool = False) -> bool:
        """Remember a verified shard (best effort: an unwritable cache only costs a rehash).
        ``hashed_at``: when its hashing began (``time.time()``); a file modified less than
        :data:`RACY_WINDOW_S` before that is not remembered (see the module docstring), unless
        ``written_here``: fastload itself wrote the bytes it hashed and renamed the file into
        place (the remote shard cache), so no write of the same tick can hide behind its
        identity. True if remembered."""
        if self.dir is None:
            return False
        newest = max(mapped.st_mtime_ns, mapped.st_ctime_ns) / 1e9
        if not written_here and (time.time() if hashed_at is None else hashed_at) - newest < RACY_WINDOW_S:
            return False  # racy: a write in the same timestamp tick would keep this identity
        p = self._path(key)
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            entry = {"path": os.fsdecode(os.path.realpath(mapped.path)), "checksum": checksum,
                     "size": mapped.size, "verified_at": time.time()}
            atomic_write(p, json.dumps(entry, ensure_ascii=True), fsync=False)  # a cache: a lost entry is a rehash
        except OSError as e:
            self._warn(e)
            return False
        self.maybe_prune()
        return True

    # -- one lock per shard identity, across processes ------------------------------------
    @contextlib.contextmanager
    def locked(self, key: str, nbytes: int = 0, what: Any = None) -> Iterator[bool]:
        """Hold an exclusive lock on ``key`` across processes (``flock``), so ranks on one
        node do not hash the same shard at the same time. Waits at most
        :func:`lock_deadline` (``nbytes``: the shard's size), then logs one line naming
        ``what`` and goes on without the lock (hashing twice is harmless; waiting forever
        for a stopped process is not). Yields whether the lock is held; the lock file is
        removed on release."""
        fd = None
        if self.dir is not None:
            try:
                fd = self._acquire(key, nbytes, what)
            except (OSError, ImportError) as e:
                self._warn(e)
        try:
            yield fd is not None
        finally:
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.unlink(self._lock_path(key))  # while held: a waiter re-checks the path
                os.close(fd)  # releases the flock

    def _lock_path(self, key: str) -> Path:
        return self._path(key).with_suffix(".lock")

    def _acquire(self, key: str, nbytes: int, what: Any) -> int | None:
        import fcntl

        self._path(key).parent.mkdir(parents=True, exist_ok=True)
        path = self._lock_path(key)
        base = self.lock_timeout_s
        wait = lock_deadline(nbytes) if base is None else max(0.0, base) + nbytes / LOCK_BYTES_PER_S
        deadline = time.monotonic() + wait
        pause = 0.005
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() >= deadline:
                            self._lock_timed_out(path, wait, what)
                            os.close(fd)
                            return None
                        time.sleep(pause)
                        pause = min(pause * 2, 0.1)
                # The holder before us may have removed the file (it does on release): then
                # this lock is on a file nobody else will find; lock the path's file instead.
                try:
                    cur = os.stat(path)
                except FileNotFoundError:
                    cur = None
                mine = os.fstat(fd)
                if cur is not None and (cur.st_dev, cur.st_ino) == (mine.st_dev, mine.st_ino):
                    return fd
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)

    def _lock_timed_out(self, path: Path, wait: float, what: Any) -> None:
        level = logging.DEBUG if self._lock_warned else logging.WARNING
        self._lock_warned = True
        logger.log(level, "fastload: another process has held the verification lock of shard %s for %.0f s "
                   "(%s; a stopped or hung process?); hashing it here without the lock", what or "?", wait, path)

    # -- upkeep --------------------------------------------------------------------------
    def maybe_prune(self, every_s: float = PRUNE_EVERY_S) -> int:
        """:meth:`prune` if no process on this node did for ``every_s`` seconds (a marker
        file's time says when); the number of entries removed."""
        if self.dir is None:
            return 0
        marker = self.dir / ".pruned"
        try:
            if time.time() - marker.stat().st_mtime < every_s:
                return 0
        except FileNotFoundError:
            pass
        except OSError:
            return 0
        try:
            marker.touch()  # first: concurrent processes do not all prune
        except OSError:
            return 0
        return self.prune()

    def prune(self, *, max_seconds: float | None = 2.0) -> int:
        """Remove entries whose file no longer exists or changed since it was verified (their
        identity can never match again), and temporary and lock files left by killed
        processes. Reads each entry (a few hundred bytes) and stats its file, the buckets in
        random order, for at most ``max_seconds`` (None: all), so a huge record is pruned a
        part a day; returns the number of files removed."""
        if self.dir is None:
            return 0
        import random

        removed = 0
        now = time.time()
        stop = None if max_seconds is None else time.monotonic() + max_seconds
        try:
            buckets = [b.path for b in os.scandir(self.dir) if len(b.name) == 2 and b.is_dir(follow_symlinks=False)]
        except OSError:
            return 0
        random.shuffle(buckets)
        for bucket in buckets:
            try:
                names = list(os.scandir(bucket))
            except OSError:
                continue
            for e in names:
                if stop is not None and time.monotonic() > stop:
                    return removed
                removed += self._prune_one(e, now)
        return removed

    def _prune_one(self, e: os.DirEntry, now: float) -> int:
        name = e.name
        try:
            if name.endswith(".tmp") or name.endswith(".lock"):
                if now - e.stat(follow_symlinks=False).st_mtime < _STALE_TMP_S:
                    return 0
                if name.endswith(".lock"):
                    return self._remove_if_unlocked(e.path)
                os.unlink(e.path)
                return 1
            with open(e.path, encoding="utf-8") as f:
                entry = json.load(f)
            path, checksum = entry["path"], entry["checksum"]
            try:
                st = os.stat(path)
                live = _identity_key(os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
                                     st.st_ctime_ns, checksum) == name
            except OSError:
                live = False
        except (OSError, ValueError, KeyError, TypeError):
            live = False  # unreadable or not an entry: it vouches for nothing
        if live:
            return 0
        with contextlib.suppress(OSError):
            os.unlink(e.path)
            return 1
        return 0

    @staticmethod
    def _remove_if_unlocked(path: str) -> int:
        """Remove a lock file no process holds (removed while we hold it: a process that
        opened it meanwhile re-checks the path once it gets the lock, see ``_acquire``)."""
        import fcntl

        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return 0
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(path)
            return 1
        except OSError:
            return 0
        finally:
            os.close(fd)

    def _warn(self, e: BaseException) -> None:
        if not self._warned:
            self._warned = True
            logger.info("fastload: cannot use the verified-shard record in %s (%s); shards will be hashed "
                        "again by each process (set %s to a writable directory)", self.dir, e, CACHE_ENV)

"""Shard integrity: the verification policy and the node's record of verified shards.

A reader never delivers a row of a shard whose bytes it has not checked against the
manifest's checksum, unless told to (``verify="off"``):

``"first-use"`` (the default)
    Each shard is hashed (xxh3-128 of the mapped file, in C++ with the GIL released, several
    shards in parallel) the first time a read touches it, before any of its rows is
    delivered. A shard that matches is remembered in a per-node record
    (``$FASTLOAD_CACHE/verified``, default ``~/.cache/fastload/verified``) keyed by the
    file's identity (device, inode, size, modification and change times) and the expected
    checksum, so a restarted job, another rank on the same node, or the next epoch does not
    hash it again. Ranks on a node share the work: a shard another process is hashing is
    waited for (``flock``), not hashed twice. Any change to the file (a write, a rename over
    it, a restore from backup) changes its identity, so it is hashed again.
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
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

from ..system import usable_cores

__all__ = ["DEFAULT_VERIFY", "VERIFY_POLICIES", "VerifiedRecord", "cache_root", "hash_mapped"]

logger = logging.getLogger("fastload")

VERIFY_POLICIES = ("first-use", "always", "off")
DEFAULT_VERIFY = "first-use"
CACHE_ENV = "FASTLOAD_CACHE"


def cache_root() -> Path:
    """fastload's node-local cache directory (shared with the remote shard cache):
    ``$FASTLOAD_CACHE``, else ``~/.cache/fastload``."""
    env = os.environ.get(CACHE_ENV, "").strip()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fastload"


def hash_mapped(mapped: Sequence[Any]) -> list[str]:
    """``"xxh3_128:<hex>"`` of each mapped file, hashed in parallel threads (the hashing
    releases the GIL); the threads are joined before this returns."""
    if len(mapped) <= 1:
        return [m.hash_xxh3_128() for m in mapped]
    workers = min(len(mapped), usable_cores())
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fastload-verify") as pool:
        return list(pool.map(lambda m: m.hash_xxh3_128(), mapped))


class VerifiedRecord:
    """The shards this node has hashed and found to match their manifest checksum."""

    def __init__(self, root: Path | None = None) -> None:
        self.dir = (root if root is not None else cache_root()) / "verified"
        self._warned = False

    @staticmethod
    def key(mapped: Any, checksum: str) -> str:
        ident = "\0".join(map(str, (os.path.realpath(mapped.path), mapped.st_dev, mapped.st_ino, mapped.size,
                                    mapped.st_mtime_ns, mapped.st_ctime_ns, checksum)))
        return hashlib.sha256(ident.encode("utf-8", "surrogateescape")).hexdigest()

    def _path(self, key: str) -> Path:
        return self.dir / key[:2] / key

    def contains(self, key: str) -> bool:
        return self._path(key).is_file()

    def add(self, key: str, mapped: Any, checksum: str) -> None:
        """Remember a verified shard (best effort: an unwritable cache only costs a rehash)."""
        p = self._path(key)
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.with_name(f".{key}.{os.getpid()}.{threading.get_ident()}.tmp")
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump({"path": os.fsdecode(mapped.path), "checksum": checksum, "size": mapped.size,
                           "verified_at": time.time()}, f, ensure_ascii=True)
            os.replace(tmp, p)
        except OSError as e:
            self._warn(e)

    @contextlib.contextmanager
    def locked(self, key: str):
        """Hold an exclusive lock on ``key`` across processes (``flock``), so ranks on one
        node do not hash the same shard at the same time; a no-op where locking fails."""
        fd = None
        try:
            self.dir.joinpath(key[:2]).mkdir(parents=True, exist_ok=True)
            fd = os.open(self._path(key).with_suffix(".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX)
        except (OSError, ImportError) as e:
            if fd is not None:
                os.close(fd)
                fd = None
            self._warn(e)
        try:
            yield
        finally:
            if fd is not None:
                os.close(fd)  # releases the flock

    def _warn(self, e: BaseException) -> None:
        if not self._warned:
            self._warned = True
            logger.info("fastload: cannot use the verified-shard record in %s (%s); shards will be hashed "
                        "again by each process (set %s to a writable directory)", self.dir, e, CACHE_ENV)

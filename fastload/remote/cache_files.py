"""The cache directory on disk: where it is, sizes, atomic writes, kernel locks.

Part of :mod:`fastload.remote.cache` (which re-exports the public names):

* :func:`default_cache_dir` (``$FASTLOAD_CACHE``, else ``~/.cache/fastload``) and
  :func:`~fastload.errors.parse_bytes` ('200GB' -> bytes, re-exported);
* :class:`_Flock`, the kernel advisory lock every cross-process lock of the cache is made of
  (per shard download, admission, a rank being alive), and :func:`_write_atomic`;
* :class:`_CacheFiles`, the part of :class:`~fastload.remote.cache.ShardCache` that reads
  the directory: ``remote.json``, shards left by an earlier run, the default budget, the
  bytes on disk (complete shards, partial downloads at full size).
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path

from ..errors import parse_bytes
from ..runtime.system import CACHE_ENV, cache_root

__all__ = ["CACHE_ENV", "REMOTE_JSON", "default_cache_dir", "parse_bytes"]

logger = logging.getLogger("fastload")

REMOTE_JSON = "remote.json"


def default_cache_dir() -> Path:
    """``$FASTLOAD_CACHE``, else ``~/.cache/fastload``; without a home directory (an arbitrary
    uid in a container) the fallbacks of :func:`fastload.runtime.system.cache_root`: then
    ``$XDG_CACHE_HOME/fastload`` or a private ``<tmp>/fastload-<uid>``."""
    root = cache_root()
    if root is None:
        from ..errors import UsageError

        raise UsageError(f"no directory for the shard cache: there is no home directory and the private temporary "
                         f"directory is not safely this user's; set {CACHE_ENV} (or pass cache_dir=)")
    return root


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

    def lock(self, timeout: float) -> bool:
        """Take the lock, waiting at most ``timeout`` seconds (never without a deadline: the
        holder may be a stopped process); False when it was not free by then."""
        deadline = time.monotonic() + max(0.0, float(timeout))
        pause = 0.001
        while not self.try_lock():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause, left))
            pause = min(0.02, pause * 2)
        return True

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


class _CacheFiles:
    """Mixin of :class:`~fastload.remote.cache.ShardCache`: the dataset's cache directory
    (uses ``dir``, ``remote``, ``sizes``, ``_index`` set by its ``__init__``)."""

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
            return parse_bytes(limit, "cache_limit")
        free = shutil.disk_usage(self.dir).free + self.disk_usage()
        return max(1, min(total, int(0.8 * free)))

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

    def _reclaim_stale_parts(self, keep: int = -1) -> int:
        """Delete the partial downloads nobody is writing: their shard's flock is free, so
        the process that made them died (``kill -9``) or gave up. They hold no budget any
        more. Shard ``keep`` and this process's downloads in flight keep theirs (resumed).
        Called with the admission lock held; returns the bytes released (at full size)."""
        freed = 0
        for e in os.scandir(self.dir):
            n = e.name
            if not (n.startswith(".") and n.endswith(".part")):
                continue
            j = self._index.get(n[1:-5])
            if j is None or j == keep or j in self._inflight:
                continue
            lock = _Flock(self.dir / ".locks" / f"{self.names[j]}.lock")
            try:
                if not lock.try_lock():
                    continue  # a live process downloads it
                try:
                    os.unlink(e.path)
                except FileNotFoundError:
                    continue
                freed += int(self.sizes[j])
                logger.info("fastload: removed %s, a partial download no process is writing (its process died "
                            "or gave up): its room in the cache budget is free again", e.path)
            finally:
                lock.close()
        return freed

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

"""The cache directory on disk: where it is, what it holds, its byte budget, kernel locks.

Part of :mod:`fastload.remote.cache` (which re-exports the public names):

* :func:`default_cache_dir` (``$FASTLOAD_CACHE``, else ``~/.cache/fastload``) and
  :func:`~fastload.errors.parse_bytes` ('200GB' -> bytes, re-exported);
* :class:`_Flock`, the kernel advisory lock every cross-process lock of the cache is made of
  (per shard download, admission, a rank being alive): :class:`fastload.runtime.kept.Flock`;
* :class:`CacheFiles`, one dataset's cache directory and its budget: ``remote.json``, shards
  left by an earlier run, the byte budget (``limit``; its default from the free disk), the
  bytes on disk (complete shards, partial downloads at full size), deleting a shard and
  taking back partial downloads nobody writes. It knows nothing of ranks, passes or threads.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Collection

import numpy as np

from ..errors import CacheTooSmall, RemoteError, format_bytes, parse_bytes
from ..files import atomic_write
from ..runtime.kept import Flock
from ..runtime.system import CACHE_ENV, cache_root

__all__ = ["CACHE_ENV", "REMOTE_JSON", "CacheFiles", "default_cache_dir", "parse_bytes"]

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


_Flock = Flock  # (fastload.runtime.kept: the kernel lock of every table kept per node)


class CacheFiles:
    """The directory ``<root>/<fingerprint>/`` of one remote dataset's shards, and the byte
    budget they are held to.

    Creating it makes the directory (and ``.locks``, ``.progress``), writes ``remote.json``,
    deletes shards an earlier run left with a wrong size, and sets the budget: ``limit``
    bytes (parsed already; None: the whole dataset when it fits in 80% of the free disk,
    else 80% of the free disk). ``mirror``: the whole dataset fits (nothing is evicted)."""

    def __init__(self, remote, root: Path, limit: int | None):
        self.url: str = remote.url
        self.root = Path(root)
        self.dir = self.root / remote.fingerprint
        self.sizes = np.asarray(remote.shard_bytes, dtype=np.int64)
        self.names: list[str] = list(remote.shard_files)
        self.num_shards = len(self.names)
        self._index = {n: i for i, n in enumerate(self.names)}
        try:
            for d in (self.dir, self.dir / ".locks", self.dir / ".progress"):
                d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RemoteError(f"cannot create the cache directory {self.dir} ({e}); pass cache_dir= "
                              f"(or set ${CACHE_ENV}) to a writable local directory") from None
        self._write_remote_json(remote)
        self._check_present()
        self.set_limit(self._default_limit() if limit is None else limit)
        self._admit_lock = threading.Lock()  # the threads of this process, then
        self._admission = self.lock("admission.lock")  # the processes of the node

    # -- names -----------------------------------------------------------------------------
    def index(self, name: str) -> int | None:
        """The shard stored under file name ``name`` (None: not a shard of this dataset)."""
        return self._index.get(name)

    def path(self, shard: int) -> Path:
        """Where a complete shard lives."""
        return self.dir / self.names[shard]

    def part(self, shard: int) -> Path:
        """Where a shard's download in progress lives (counted at full size by every process)."""
        return self.dir / f".{self.names[shard]}.part"

    def lock(self, name: str) -> _Flock:
        """A new kernel lock ``.locks/<name>`` (the caller closes it)."""
        return _Flock(self.dir / ".locks" / name)

    def shard_lock(self, shard: int) -> _Flock:
        """The lock held while a process downloads ``shard``."""
        return self.lock(f"{self.names[shard]}.lock")

    def progress(self, name: str) -> Path:
        return self.dir / ".progress" / name

    # -- the budget --------------------------------------------------------------------------
    def set_limit(self, limit: int) -> None:
        """A new byte budget (bytes; at least the largest shard)."""
        biggest = int(self.sizes.max()) if self.num_shards else 0
        if int(limit) < biggest:
            raise CacheTooSmall(f"cache_limit={format_bytes(limit)} is smaller than the largest shard of {self.url} "
                                f"({format_bytes(biggest)}); raise cache_limit", minimum=biggest)
        self.limit = int(limit)
        # the whole dataset fits: a mirror, nothing is deleted (a rerun reads it all locally)
        self.mirror = self.limit >= int(self.sizes.sum())

    def _default_limit(self) -> int:
        free = shutil.disk_usage(self.dir).free + self.disk_usage()
        return max(1, min(int(self.sizes.sum()), int(0.8 * free)))

    # -- admission: one process (and thread) at a time checks the budget and evicts -----------
    def lock_admission(self, deadline: float) -> bool:
        """Take the in-process and the node-wide admission locks, waiting until ``deadline``
        at most (a process stopped while holding the flock must not hang this one)."""
        if not self._admit_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return False
        if self._admission.lock(deadline - time.monotonic()):
            return True
        self._admit_lock.release()
        return False

    def unlock_admission(self) -> None:
        self._admission.unlock()
        self._admit_lock.release()

    def admission_stuck(self, waited: float) -> str:
        """Why the admission lock was not taken (for an error message)."""
        return (f"the cache's admission lock {self._admission.path} was not free for {waited:.0f}s: another "
                f"process using the cache {self.dir} holds it and is stopped or hung (suspended with Ctrl-Z, "
                "a debugger); resume or end it, or use another cache_dir")

    def after_fork(self, closed: bool) -> None:
        """In a forked child: a thread of the parent may have held the in-process lock, and
        the inherited flock is the parent's (it would not exclude it): new ones."""
        self._admit_lock = threading.Lock()
        self._admission.close()
        if not closed:
            self._admission = self.lock("admission.lock")

    def close(self) -> None:
        self._admission.close()

    # -- what is on disk -------------------------------------------------------------------
    def _write_remote_json(self, remote) -> None:
        p = self.dir / REMOTE_JSON
        doc = {"url": remote.url, "fingerprint": remote.fingerprint, "manifest": remote.manifest,
               "note": "a fastload shard cache, not a dataset; open the URL, or run `fastload prefetch URL DIR` "
                       "for a complete local copy"}
        text = json.dumps(doc, indent=1)
        try:
            if p.exists() and p.read_text(encoding="utf-8") == text:
                return
        except OSError:
            pass
        atomic_write(p, text, fsync=False)  # a cache: a file lost in a crash is written again

    def _check_present(self) -> None:
        """Complete shards left by an earlier run are trusted by size; a wrong size is a
        damaged file (deleted, downloaded again)."""
        for e in os.scandir(self.dir):
            i = self._index.get(e.name)
            if i is not None and e.stat().st_size != self.sizes[i]:
                logger.warning("fastload: cached %s has %d bytes, the manifest says %d; downloading it again",
                               e.path, e.stat().st_size, self.sizes[i])
                os.unlink(e.path)

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

    def present(self) -> tuple[dict[int, int], int]:
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

    def age(self, shard: int) -> float | None:
        """The complete shard's modification time (None: not there)."""
        try:
            return self.path(shard).stat().st_mtime
        except FileNotFoundError:
            return None

    def delete(self, shard: int) -> bool:
        """Delete a complete shard; False when it was not there."""
        try:
            os.unlink(self.path(shard))
        except FileNotFoundError:
            return False
        return True

    def reclaim_stale_parts(self, keep: int = -1, busy: Collection[int] = ()) -> int:
        """Delete the partial downloads nobody is writing: their shard's flock is free, so
        the process that made them died (``kill -9``) or gave up. They hold no budget any
        more. Shard ``keep`` and the shards in ``busy`` (this process's downloads in flight)
        keep theirs (resumed). Called with the admission lock held; returns the bytes
        released (at full size)."""
        freed = 0
        for e in os.scandir(self.dir):
            n = e.name
            if not (n.startswith(".") and n.endswith(".part")):
                continue
            j = self._index.get(n[1:-5])
            if j is None or j == keep or j in busy:
                continue
            lock = self.shard_lock(j)
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

"""Arrays derived from content, kept once per node: built by one process, memory-mapped by all.

A table computed from per-sample data (a dataset's document lengths, the cumulative weights of
weighted draws, the samples grouped by class of class-balanced draws) costs bytes per sample:
at 10^10 samples, tens of GB. Held by each rank it costs that once per rank; kept here it
costs it once per node, on disk, and every rank reads it through the page cache, which the
node's processes share.

:func:`kept_arrays` keeps the named arrays of one table as ``.npy`` files in a folder of the
node-local cache directory (:func:`~fastload.runtime.system.cache_root`: ``$FASTLOAD_CACHE``
or ``~/.cache/fastload``), named by the caller from a hash of everything the table is
computed from (:func:`content_key`: array contents hashed in chunks with xxh3-128, never
object identity) and the table's format version:

* a table already there is memory-mapped read-only, after a check of each file's header
  (dtype, shape) and size (exactly the header plus the data: a truncated or padded file is
  refused) and the caller's ``check`` (cheap invariants); a file that fails is built again,
  with a warning naming it;
* otherwise one process builds it: under a kernel lock (:class:`Flock`, ``.lock`` in the
  folder; released by the kernel if the process dies), the caller's ``build`` writes the
  arrays through memory maps under temporary names (never whole in memory: it may fill them
  in chunks), which are renamed into place, then mapped like the others. A process that
  finds the lock taken waits for it and maps the winner's files; past ``wait_s`` (a stopped
  process holding it; by default :func:`build_wait_s`: a minute plus far more than a build of
  that many rows takes) it builds them itself, the renames replacing equal files;
* a builder killed mid-build (SIGKILL, the OOM killer) leaves its temporary files, allocated at
  full size. They are named ``.NAME.npy.HOST.PID.THREAD.tmp``, and each is flocked by its
  builder while it is written; the next process that takes the folder's lock deletes those of
  its own host whose flock is free (their builder is gone: the kernel released its lock).
  Liveness is told by the flock, not the PID, so a builder in another PID namespace (a
  container) sharing the directory is never taken for dead; files of another host (a cache
  directory on NFS, where a flock may be local to each client) are left to that host;
* without a usable cache directory (none, not writable, full) the table is built in memory,
  with a warning saying what it costs and to set ``FASTLOAD_CACHE``. Only the cache's own
  operations fall back so: an error of the caller's ``build`` (an unreadable shard) is raised
  as it is, after the temporary files are deleted.

Arrays built in memory are returned read-only too, like the mapped ones.

Tables smaller than :data:`MAP_MIN` samples are built in memory by the callers (a few MB: the
files would cost more than they save).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .system import cache_root

__all__ = ["HASH_CHUNK", "MAP_MIN", "Flock", "build_wait_s", "content_key", "kept_arrays", "kept_folder"]

logger = logging.getLogger("fastload")

MAP_MIN = 1 << 20  # samples: smaller tables (a few MB) are built in memory, not kept
HASH_CHUNK = 1 << 24  # bytes hashed per step of content_key (bounded memory for any array)


def build_wait_s(n: int) -> float:
    """How long a process waits for another building a table of ``n`` rows before it builds
    the table itself: a minute, plus far more than a build takes at 2 M rows/s."""
    return 60.0 + n / 2e6


class Flock:
    """A kernel advisory lock on a file (released by the kernel when the process dies).
    Lock files are never deleted: deleting them races with the next locker."""

    def __init__(self, path: Path):
        self.path = path
        self.fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def _fd(self) -> int:
        if self.fd is None:
            raise ValueError(f"lock {self.path} is closed")
        return self.fd

    def try_lock(self) -> bool:
        try:
            fcntl.flock(self._fd(), fcntl.LOCK_EX | fcntl.LOCK_NB)
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
        fcntl.flock(self._fd(), fcntl.LOCK_UN)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases the lock
            self.fd = None


def content_key(*parts: Any) -> str:
    """A hex key (xxh3-128) of ``parts``: numpy arrays by dtype, shape and bytes (read in
    chunks of :data:`HASH_CHUNK` bytes: a memory-mapped array of 80 GB is hashed in bounded
    memory), anything else by its ``repr``. Raises TypeError for an array of Python objects
    (its bytes are pointers, not content)."""
    import xxhash

    h = xxhash.xxh3_128()
    for p in parts:
        if isinstance(p, np.ndarray):
            if p.dtype.hasobject:
                raise TypeError("an array of Python objects has no content hash")
            h.update(f"ndarray|{p.dtype.str}|{p.shape}|".encode())
            flat = p if p.ndim == 1 else p.reshape(-1)  # (a 1-D view, strided or mapped, is read in chunks)
            step = max(1, HASH_CHUNK // max(1, p.dtype.itemsize))
            for a in range(0, flat.size, step):
                h.update(np.ascontiguousarray(flat[a:a + step]).data)
        else:
            h.update(f"{type(p).__name__}|{p!r}|".encode())
    return h.hexdigest()


def kept_folder(*names: str) -> Path | None:
    """``<cache root>/<names...>``: where a table is kept (None: no cache directory)."""
    root = cache_root()
    return None if root is None else root.joinpath(*names)


Spec = tuple  # (dtype, shape): shape None accepts any one-dimensional length


def _load_one(path: Path, dtype: Any, shape: tuple | None) -> np.ndarray | None:
    try:
        v = np.load(path, mmap_mode="r", allow_pickle=False)
        size = os.stat(path).st_size
    except (OSError, ValueError, EOFError):
        return None
    if not isinstance(v, np.memmap) or v.dtype != np.dtype(dtype) or (
            v.shape != tuple(shape) if shape is not None else v.ndim != 1):
        return None
    if v.offset + v.nbytes != size:  # a file longer than its header says: not one fastload wrote
        return None
    return v


def _load(folder: Path, specs: Mapping[str, Spec], check: Callable[[dict], bool] | None
          ) -> tuple[dict | None, str | None]:
    """The kept arrays (None: missing or wrong) and, when a file exists but is wrong, its name."""
    out = {}
    for name, (dtype, shape) in specs.items():
        path = folder / f"{name}.npy"
        v = _load_one(path, dtype, shape)
        if v is None:
            return None, (str(path) if path.exists() else None)
        out[name] = v
    if check is not None and not check(out):
        return None, str(folder)
    return out, None


def _in_memory(specs: Mapping[str, Spec], build: Callable[[Callable], object]) -> dict:
    out: dict[str, np.ndarray] = {}

    def alloc(name: str, shape: tuple | None = None) -> np.ndarray:
        dtype, fixed = specs[name]
        out[name] = np.empty(fixed if shape is None else shape, dtype)
        return out[name]

    build(alloc)
    for v in out.values():
        v.flags.writeable = False  # (read-only like a kept table: nobody changes it after the build)
    return out


def _host() -> str:
    """This host's name as it appears in temporary names (a hash when it has odd characters)."""
    h = socket.gethostname()
    return h if re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", h) else "h" + content_key(h)[:16]


def _temp(folder: Path, name: str) -> Path:
    """The temporary name a build writes ``NAME.npy`` under (see the module docstring)."""
    return folder / f".{name}.npy.{_host()}.{os.getpid()}.{threading.get_ident()}.tmp"


def _remove_abandoned(folder: Path, what: str) -> None:
    """Delete the temporary files of this host's builders that died (their flock is free).
    Called with the folder's lock held."""
    own = re.compile(rf"\..+\.npy\.{re.escape(_host())}\.[0-9]+\.[0-9]+\.tmp")
    for e in os.scandir(folder):
        if not own.fullmatch(e.name):
            continue
        try:
            fd = os.open(e.path, os.O_RDWR | os.O_CLOEXEC)  # (NFS emulates flock with write locks)
        except OSError:
            continue  # removed meanwhile
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a live builder holds it (one that stopped waiting for the folder's lock)
        else:
            size = os.fstat(fd).st_size
            with contextlib.suppress(FileNotFoundError):
                os.unlink(e.path)
                logger.warning("fastload: deleted %s (%d bytes), left by a process that died while building %s",
                               e.path, size, what)
        finally:
            os.close(fd)


class _CacheFailure(Exception):
    """An OSError of the cache's own operations inside the caller's build (``alloc``): told
    apart from the build's own errors."""

    def __init__(self, error: OSError):
        super().__init__(str(error))
        self.error = error


def _reserve(path: Path, nbytes: int) -> None:
    """Allocate the file's blocks now: a full disk is then an OSError here, not a SIGBUS when
    a page of the map is written."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
    finally:
        os.close(fd)


def kept_arrays(folder: Path | None, specs: Mapping[str, Spec], build: Callable[[Callable], object], *,
                what: str, holds: str, check: Callable[[dict], bool] | None = None,
                wait_s: float | None = None) -> dict[str, np.ndarray]:
    """The arrays named by ``specs`` (``name -> (dtype, shape)``), memory-mapped read-only from
    ``folder`` (see the module docstring), built there first by ``build(alloc)`` when missing
    or wrong: ``alloc(name, shape=None)`` returns the writable array to fill (a memory map of
    a temporary file; ``shape`` for a spec whose shape is None). ``folder`` None: built in
    memory. ``what`` names the table in messages ("the lengths of 'tokens'"), ``holds`` what
    a right file holds ("500 lengths"); ``check(arrays)`` cheap invariants of a kept table;
    ``wait_s`` how long to wait for another process building it (default
    :func:`build_wait_s` of the longest fixed shape). An exception of ``build`` is raised
    as it is (the temporary files deleted); only the cache's own OSErrors fall back to memory."""
    if folder is None:
        return _in_memory(specs, build)
    if wait_s is None:
        wait_s = build_wait_s(max((int(np.prod(shape)) for _, shape in specs.values() if shape is not None),
                                  default=0))
    got, bad = _load(folder, specs, check)
    if got is not None:
        return got
    lock = None
    build_failed = False
    temps: list[tuple[Path, int]] = []  # (temporary file, the fd of its flock)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = Flock(folder / ".lock")
        locked = lock.try_lock()
        if not locked:
            logger.info("fastload: waiting for another process of this node, which builds %s in %s", what, folder)
            locked = lock.lock(wait_s)
            if not locked:
                logger.warning("fastload: another process of this node has been building %s in %s for %.0f s; "
                               "this one builds it too", what, folder, wait_s)
        got, bad2 = _load(folder, specs, check)  # built meanwhile by the process that held the lock
        if got is not None:
            return got
        if locked:  # (no builder of this host but a stopped one or one that gave up waiting is at work)
            _remove_abandoned(folder, what)
        bad = bad or bad2
        if bad is not None:
            logger.warning("fastload: %s does not hold %s; building it again", bad, holds)
        t0 = time.monotonic()
        maps: dict[str, np.memmap] = {}

        def alloc(name: str, shape: tuple | None = None) -> np.ndarray:
            dtype, fixed = specs[name]
            tmp = _temp(folder, name)
            try:
                fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
                temps.append((tmp, fd))
                fcntl.flock(fd, fcntl.LOCK_EX)  # held while it is written: a live builder's file
                m = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype,
                                              shape=tuple(fixed if shape is None else shape))
                _reserve(tmp, m.offset + m.nbytes)
            except OSError as e:
                raise _CacheFailure(e) from e
            maps[name] = m
            return m

        try:
            build(alloc)
        except _CacheFailure as e:
            raise e.error from None
        except OSError:
            build_failed = True  # the build's own error (a shard unreadable): not the cache's
            raise
        for m in maps.values():
            m.flush()
        names = list(maps)
        maps.clear()  # unmapped before the renames
        for name in names:
            os.replace(_temp(folder, name), folder / f"{name}.npy")
        for _, fd in temps:
            os.close(fd)
        temps.clear()
        logger.info("fastload: built %s in %s (%.1f s)", what, folder, time.monotonic() - t0)
        got, _ = _load(folder, specs, check)
        if got is not None:
            return got
        raise OSError(f"the files written in {folder} do not read back")
    except OSError as e:
        if build_failed:
            raise
        nbytes = sum(np.dtype(d).itemsize for d, _ in specs.values())
        logger.warning("fastload: could not keep %s in %s (%s); it is held in memory (%d bytes per sample, in "
                       "each process); set FASTLOAD_CACHE to a writable directory", what, folder, e, nbytes)
        return _in_memory(specs, build)
    finally:
        for tmp, fd in temps:
            with contextlib.suppress(OSError):
                tmp.unlink()
            os.close(fd)
        if lock is not None:
            lock.close()


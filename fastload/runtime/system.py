"""What this process may use of the machine: the one home of "how many cores".

Every default that depends on the cores (ring gather threads, DALI threads, convert
workers, benchmarks) asks here, so a policy change (affinity, ranks per node, torch's own
threads) is a change in one place.
"""
from __future__ import annotations

import logging
import os
import stat
import tempfile
import threading
from pathlib import Path

from ..errors import format_bytes

__all__ = ["CACHE_ENV", "IMAGE_FEEDERS", "LOADER_NICE", "available_memory", "cache_root", "check_fits_in_memory",
           "loader_nice", "local_world_size", "lower_priority", "rank_cores", "usable_cores"]

# The priority of a loader's own threads (ring producers, feeders, the DALI threads they
# start), as a Linux nice value: below the training loop's threads, so that when both want a
# core the loop's (torch's OpenMP team, which spins at its barriers) wins, and loading fills
# the gaps. Nothing starves: the consumer gathers late batches itself (the ring's "help"
# path), and DALI's threads still get the cores whenever the loop waits. The measurement:
# ``FASTLOAD_NICE=N bench/bench_loop.py`` (its figures are in docs/how-to/tune-threads.md).
LOADER_NICE = 19

# Image feeder threads per Loader (host and CUDA), each with its own DALI pipelines: while one
# runs its Python glue the other's DALI threads keep the cores busy (see bench/bench_jpeg.py).
IMAGE_FEEDERS = 2


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask, e.g. under ``taskset`` or a
    container's cpuset), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - macOS, Windows
        return max(1, os.cpu_count() or 1)


def local_world_size() -> int:
    """Processes of this job on this node (torchrun's ``LOCAL_WORLD_SIZE``, read by
    :func:`~fastload.runtime.world.local_env`), at least 1. A malformed value counts as 1."""
    from .world import local_env  # lazily: world.py imports numpy, `fastload --help` does not

    return local_env()[1] or 1


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def available_memory() -> int | None:
    """Bytes this process can still allocate without swapping or being killed: the kernel's
    ``MemAvailable``, lowered to what the cgroup (container) memory limit leaves; None where
    it cannot be told."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            avail = None
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and usage is not None and limit < (1 << 60):
            left = max(0, limit - usage)
            avail = left if avail is None else min(avail, left)
            break
    return avail


def check_fits_in_memory(nbytes: int, what: str, hint: str) -> None:
    """ValueError before allocating ``nbytes`` that this machine cannot hold: ``what`` needs
    N bytes, M are available; ``hint`` says what to lower."""
    avail = available_memory()
    if avail is not None and nbytes > avail:
        raise ValueError(f"{what} needs {format_bytes(nbytes)} of memory, but only {format_bytes(avail)} is "
                         f"available; {hint}")


def rank_cores() -> int:
    """This rank's share of the cores: the usable cores divided among the ``LOCAL_WORLD_SIZE``
    processes of the node (torchrun sets no affinity, so every rank sees every core), at
    least 1. A launcher that already binds each rank to its own cores makes this an
    underestimate; pass ``threads=`` to the Loader then."""
    return max(1, usable_cores() // local_world_size())


def loader_nice() -> int:
    """The nice value for a loader's threads: :data:`LOADER_NICE`, or ``$FASTLOAD_NICE``
    (0..19; 0 keeps the loop's priority) where set."""
    v = os.environ.get("FASTLOAD_NICE", "").strip()
    if not v:
        return LOADER_NICE
    if not v.isdigit() or int(v) > 19:
        from ..errors import UsageError

        raise UsageError(f"FASTLOAD_NICE={v!r}: expected a nice value 0..19 (0: the loader's threads run at "
                         f"the training loop's priority; unset: {LOADER_NICE})")
    return int(v)


def lower_priority(nice: int | None = None) -> None:
    """Run the calling thread (and the threads it starts later, which inherit it) at nice
    ``nice`` (default :func:`loader_nice`), if that is lower than its priority now. Linux
    nice values are per thread; raising one needs no privilege. Elsewhere: nothing."""
    n = loader_nice() if nice is None else int(nice)
    if n <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) < n:
            os.setpriority(os.PRIO_PROCESS, tid, n)
    except OSError:  # pragma: no cover - a sandbox that forbids it: run at the inherited priority
        pass


# -- the node-local cache directory ---------------------------------------------------------
logger = logging.getLogger("fastload")
CACHE_ENV = "FASTLOAD_CACHE"
_no_home_logged = False


def cache_root() -> Path | None:
    """fastload's node-local cache directory (shared with the remote shard cache):
    ``$FASTLOAD_CACHE``, else ``~/.cache/fastload``. Without a home directory (``HOME``
    unset and no passwd entry for the user, as for arbitrary UIDs in containers):
    ``$XDG_CACHE_HOME/fastload``, else ``<tmp>/fastload-<uid>`` (created private to the
    user; ``None`` when that is not safely ours: then nothing is remembered)."""
    env = os.environ.get(CACHE_ENV, "").strip()
    if env:
        return Path(env).expanduser()
    try:
        return Path.home() / ".cache" / "fastload"
    except (RuntimeError, KeyError, OSError):
        pass
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    root = Path(xdg) / "fastload" if xdg and os.path.isabs(xdg) else _private_tmp_dir()
    global _no_home_logged
    if not _no_home_logged:
        _no_home_logged = True
        where = f"uses {root}" if root is not None else "is not kept (no private directory for it)"
        logger.info("fastload: no home directory for this user; the node-local cache (verified and downloaded shards) %s; "
                    "set %s to choose a directory", where, CACHE_ENV)
    return root


def _private_tmp_dir() -> Path | None:
    """``<tmp>/fastload-<uid>``, created mode 0700; None if it exists but is not a directory
    of this user's (another user could have planted it in a shared /tmp)."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    p = Path(tempfile.gettempdir()) / f"fastload-{uid}"
    try:
        p.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(p)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o022:
        return None
    return p

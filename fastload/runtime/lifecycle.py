"""Process lifecycle of everything that runs threads: interpreter exit and ``os.fork()``.

*Fork.* A process forked while a Loader runs inherits the Loader's objects but none of its
threads (ring producers, feeder threads, DALI's workers), and any lock one of those threads
held is copied locked. Joining, shutting down or even locking such an inherited object in the
child waits forever. So every object that owns threads registers here
(:func:`track`), and in the child (``os.register_at_fork(after_in_child=...)``) each one's
``_after_fork_in_child()`` makes its copy *inert*: closing it joins and locks nothing, using it
raises an error that says to create a new one in the child.

*Exit.* DALI shuts its pipelines down in its own ``atexit`` hook; a Loader whose iterator is
still alive then had feeder threads blocked in a pipeline that no longer runs, and its close
waited for them. :func:`close_at_exit` registers (once DALI is imported, so that it runs
*before* DALI's hook: ``atexit`` runs hooks in reverse order) a hook that closes every live
tracked object with a deadline.
"""
from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from typing import Any

__all__ = ["close_at_exit", "forked", "generation", "track", "untrack"]

logger = logging.getLogger("fastload")

_live: weakref.WeakSet[Any] = weakref.WeakSet()
_lock = threading.Lock()
_exit_hook_after: set[str] = set()  # modules our exit hook was registered after
EXIT_DEADLINE_S = 10.0
generation = 0  # forks this process descends from: a cheap "am I a forked child?" test per batch


def track(obj: Any) -> None:
    """Register ``obj``: ``obj._after_fork_in_child()`` runs in a forked child, and
    ``obj._close_at_exit(deadline_s)`` (if it has one) at interpreter exit."""
    with _lock:
        _live.add(obj)


def untrack(obj: Any) -> None:
    with _lock:
        _live.discard(obj)


def forked(owner_pid: int) -> bool:
    """True in a process other than ``owner_pid`` (a child forked after the object was made)."""
    return os.getpid() != owner_pid


def _after_fork_in_child() -> None:
    global _lock, generation
    _lock = threading.Lock()  # may have been held by another thread at fork time
    generation += 1
    for obj in list(_live):
        try:
            obj._after_fork_in_child()
        except Exception:  # pragma: no cover - never let a fork fail on our account
            pass


def _close_all_at_exit() -> None:
    for obj in list(_live):
        close = getattr(obj, "_close_at_exit", None)
        if close is None:
            continue
        try:
            close(EXIT_DEADLINE_S)
        except Exception as e:  # pragma: no cover - best effort at exit
            logger.debug("fastload: closing %r at exit failed: %s", obj, e)


def close_at_exit(after_module: str) -> None:
    """Make sure live objects are closed at exit before ``after_module``'s own exit hooks
    run (call right after importing it; e.g. ``"nvidia.dali"``). Idempotent per module."""
    with _lock:
        if after_module in _exit_hook_after:
            return
        _exit_hook_after.add(after_module)
    atexit.register(_close_all_at_exit)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

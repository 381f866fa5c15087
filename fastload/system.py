"""What this process may use of the machine: the one home of "how many cores".

Every default that depends on the cores (ring gather threads, DALI threads, convert
workers, benchmarks) asks here, so a policy change (affinity, ranks per node, torch's own
threads) is a change in one place.
"""
from __future__ import annotations

import os

__all__ = ["local_world_size", "rank_cores", "usable_cores"]


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask, e.g. under ``taskset`` or a
    container's cpuset), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - macOS, Windows
        return max(1, os.cpu_count() or 1)


def local_world_size() -> int:
    """Processes of this job on this node (torchrun's ``LOCAL_WORLD_SIZE``), at least 1.
    A malformed value counts as 1."""
    v = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    return int(v) if v.isdigit() and int(v) > 0 else 1


def rank_cores() -> int:
    """This rank's share of the cores: the usable cores divided among the ``LOCAL_WORLD_SIZE``
    processes of the node (torchrun sets no affinity, so every rank sees every core), at
    least 1. A launcher that already binds each rank to its own cores makes this an
    underestimate; pass ``threads=`` to the Loader then."""
    return max(1, usable_cores() // local_world_size())

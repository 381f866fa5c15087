"""The machine a benchmark ran on: ``machine_info()`` (a dict: CPU, usable cores, memory,
GPU, versions) and ``system_info()`` (the same as one line, for tables and docs/benchmarks.md).

Only the standard library at import time; torch is imported by ``machine_info`` (for the
GPU's name) when it is called.
"""
from __future__ import annotations

import os
import platform
from typing import Any

__all__ = ["equal_priority", "machine_info", "system_info"]


def equal_priority() -> int:
    """Run fastload's threads at the priority of the rows they are compared with, and return
    the nice value in effect.

    A Loader's threads run at nice 19 by default (:data:`fastload.runtime.system.LOADER_NICE`:
    in training, the step's own threads win a contended core and loading fills the gaps). A
    benchmark that compares loaders *without* a training step runs the DataLoader's workers
    and DALI at nice 0; on a machine shared with other busy processes a nice-19 Loader would
    then be measured against their load instead of against the other rows. Benchmarks of that
    kind call this first: ``FASTLOAD_NICE=0`` unless the environment already sets it
    (``FASTLOAD_NICE=19 python bench/bench_x.py`` measures the default), and the machine line
    (:func:`system_info`) says which value was used. ``bench/bench_loop.py``, which has a
    training step, measures the priorities themselves and does not call it."""
    from fastload.runtime.system import loader_nice

    os.environ.setdefault("FASTLOAD_NICE", "0")
    return loader_nice()


def _cpu_name() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:  # pragma: no cover - not Linux
        return cpu


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            return round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):  # pragma: no cover - not Linux
        return None


def _dist_version(*names: str) -> str | None:
    """The installed version of the first of ``names`` found, without importing it (DALI
    and torch take seconds to import)."""
    from importlib import metadata

    for n in names:
        try:
            return metadata.version(n)
        except metadata.PackageNotFoundError:
            continue
    return None


def _gpu_name() -> str | None:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return None
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def machine_info() -> dict[str, Any]:
    """CPU, usable cores (:func:`fastload.runtime.system.usable_cores`), memory, GPU (if any, as torch
    sees it) and library versions."""
    from fastload import __version__
    from fastload.runtime.system import usable_cores

    versions = {"numpy": _dist_version("numpy"), "torch": _dist_version("torch"),
                "pyarrow": _dist_version("pyarrow"),
                "dali": _dist_version("nvidia-dali-cuda120", "nvidia-dali-cuda130", "nvidia-dali-cuda110",
                                      "nvidia-dali"),
                "fastload": __version__}
    from fastload.runtime.system import loader_nice

    return {"python": platform.python_version(), "platform": platform.platform(), "cpu": _cpu_name(),
            "cores": usable_cores(), "memory_gib": _memory_gib(), "gpu": _gpu_name(),
            "versions": versions, "loader_nice": loader_nice()}


def system_info(info: dict | None = None) -> str:
    """One line describing the machine and library versions (for benchmark output and the
    the results table of docs/benchmarks.md)."""
    m = info or machine_info()
    mem = f", {m['memory_gib']:.0f} GiB RAM" if m["memory_gib"] is not None else ""
    parts = [f"{m['cpu']}, {m['cores']} cores{mem}", f"Python {m['python']}"]
    if m.get("gpu"):
        parts.insert(1, f"GPU {m['gpu']}")
    parts += [f"{k} {m['versions'][k]}" for k in ("numpy", "torch") if m["versions"].get(k)]
    if m.get("loader_nice") is not None:  # (older reports have none)
        parts.append(f"fastload threads at nice {m['loader_nice']}")
    return "; ".join(parts)

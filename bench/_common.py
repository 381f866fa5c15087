"""Timing and reporting helpers shared by the benchmarks in bench/.

    from _common import Measurement, interleaved_medians, median_seconds, print_table, system_info

``median_seconds(fn)`` runs ``fn`` a few times after a warm-up and returns the median wall
time; ``interleaved_medians({name: fn})`` does the same for several systems run round-robin
(use it for ratios on a machine whose speed drifts); ``Measurement`` turns (samples, bytes, seconds) into samples/s and GB/s;
``print_table`` prints one block of rows with ratios to the best DataLoader row and to the
limit row, so every benchmark reports its result beside the hardware's limit in one run.
"""
from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


def median_seconds(fn: Callable[[], object], *, repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs after ``warmup`` untimed runs."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved_medians(fns: dict[str, Callable[[], object]], *, repeats: int = 5,
                        warmup: int = 1) -> dict[str, float]:
    """Median wall time of each ``fn`` when the functions are run round-robin (a, b, c, a,
    b, c, ...). On a shared machine whose speed drifts, this keeps ratios between the
    systems honest: every system sees the same conditions."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


@dataclass
class Measurement:
    """One benchmark row. ``kind`` is "ours", "dataloader", "limit" or "other"."""

    system: str
    samples: int
    nbytes: int
    seconds: float
    kind: str = "other"
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else float("inf")

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def system_info() -> str:
    """One line describing the machine and library versions."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 0
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
        mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    parts = [f"{cpu}, {cores} cores{mem}", f"Python {platform.python_version()}"]
    for mod in ("numpy", "torch"):
        try:
            parts.append(f"{mod} {__import__(mod).__version__}")
        except ImportError:
            pass
    return "; ".join(parts)


def _fmt_rate(x: float) -> str:
    if x >= 1e6:
        return f"{x / 1e6:.2f} M"
    if x >= 1e3:
        return f"{x / 1e3:.1f} k"
    return f"{x:.1f} "


def print_table(title: str, rows: Sequence[Measurement]) -> None:
    """Print rows with samples/s, GB/s, ratio to the best DataLoader row and to the best
    limit row (rows of kind "dataloader" / "limit")."""
    dl = [r.samples_per_s for r in rows if r.kind == "dataloader"]
    lim = [r.samples_per_s for r in rows if r.kind == "limit"]
    best_dl = max(dl) if dl else None
    # Ratios are reported against the fastest limit row.
    best_lim = max(lim) if lim else None
    headers = ["system", "samples/s", "GB/s", "vs best DataLoader", "vs limit", "note"]
    table = []
    for r in rows:
        table.append([
            r.system,
            _fmt_rate(r.samples_per_s),
            f"{r.gb_per_s:.2f}",
            f"{r.samples_per_s / best_dl:.1f}x" if best_dl else "-",
            f"{100 * r.samples_per_s / best_lim:.0f}%" if best_lim else "-",
            r.note,
        ])
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(headers)]
    line = "  ".join("-" * w for w in widths)
    print(f"\n## {title}")
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
    print(line)
    for row in table:
        print("  ".join(c.ljust(w) if i in (0, 5) else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))

"""Timing and reporting helpers shared by the benchmarks in bench/.

    from _common import Measurement, interleaved_medians, median_seconds, print_table, system_info

``median_seconds(fn)`` runs ``fn`` a few times after a warm-up and returns the median wall
time; ``interleaved_medians({name: fn})`` does the same for several systems run round-robin
(use it for ratios on a machine whose speed drifts); ``Measurement`` turns (samples, bytes, seconds) into samples/s and GB/s;
``print_table`` prints one block of rows with ratios to the best DataLoader row and to the
limit row, so every benchmark reports its result beside the hardware's limit in one run.
``headline`` records a script's main figure (fastload, the baseline, the limit) for the
README's results table, which ``run_all.py --readme`` generates from these records.
"""
from __future__ import annotations

import json
import math
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


# ---------------------------------------------------------------------------- headlines
RESULTS_ENV = "FASTLOAD_BENCH_RESULTS"


def headline(workload: str, *, script: str, ours: tuple[str, float], unit: str,
             baseline: tuple[str, float] | None = None, limit: tuple[str, float] | None = None,
             lower_is_better: bool = False, note: str = "", smoke: bool = False) -> dict:
    """Record one workload's main figure: (label, value) for fastload, the baseline people use
    today and the limit, all in ``unit`` and measured in the same run. Appended as a JSON line
    to the file named by $FASTLOAD_BENCH_RESULTS (set by run_all.py), and returned."""
    for what, pair in (("ours", ours), ("baseline", baseline), ("limit", limit)):
        if pair is None:
            continue
        ok = isinstance(pair[1], (int, float)) and math.isfinite(pair[1])
        # a cost of ours (time, memory growth) may be zero or below; everything else is a rate or a cost > 0
        if not ok or (pair[1] <= 0 and not (what == "ours" and lower_is_better)):
            raise ValueError(f"{workload}: {what} value {pair[1]!r} must be a positive number")
    rec = {"workload": workload, "script": script, "unit": unit, "lower_is_better": lower_is_better,
           "ours": list(ours), "baseline": list(baseline) if baseline else None,
           "limit": list(limit) if limit else None, "note": note, "smoke": smoke,
           "machine": system_info()}
    path = os.environ.get(RESULTS_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")
    return rec


def _fmt_value(x: float, unit: str) -> str:
    if x <= 0:
        v = f"{x:+.1f}"
    elif x >= 1e6:
        v = f"{x / 1e6:.2f} M"
    elif x >= 1e4:
        v = f"{x / 1e3:.0f} k"
    elif x >= 100:
        v = f"{x:,.0f}"
    elif x >= 1:
        v = f"{x:.2f}"
    else:
        v = f"{x:.3g}"
    return f"{v} {unit}"


def ratio_vs(rec: dict, which: str) -> float | None:
    """How many times better fastload is than ``which`` ("baseline" or "limit")."""
    other = rec.get(which)
    if not other:
        return None
    ours, theirs = rec["ours"][1], other[1]
    if ours <= 0:  # a cost of zero (no memory growth): no finite ratio
        return None
    return theirs / ours if rec["lower_is_better"] else ours / theirs


def markdown_table(records: list[dict]) -> str:
    """The README's results table: one row per recorded headline."""
    lines = ["| workload (command) | fastload | baseline | limit | vs baseline | vs limit |",
             "|---|---|---|---|---|---|"]
    for r in records:
        unit = r["unit"]

        def cell(pair):
            return f"{pair[0]}: {_fmt_value(pair[1], unit)}" if pair else "–"

        rb, rl = ratio_vs(r, "baseline"), ratio_vs(r, "limit")
        vs_b = ("none of its cost" if r["ours"][1] <= 0 and r["baseline"] else "–") if rb is None else (f"{rb:,.0f}x" if rb >= 100 else f"{rb:.1f}x")
        vs_l = "–" if rl is None else f"{100 * rl:.0f}%"
        work = f"{r['workload']} (`python bench/{r['script']}`)"
        ours = cell(r["ours"]) + (f" ({r['note']})" if r["note"] else "")
        lines.append(f"| {work} | {ours} | {cell(r['baseline'])} | {cell(r['limit'])} | {vs_b} | {vs_l} |")
    return "\n".join(lines)

"""Measuring and reporting, for ``fastload bench`` and every script in ``bench/``.

    from fastload.bench.report import (Measurement, headline, interleaved_medians, median_seconds,
                                       print_table, system_info)

* timing: ``median_seconds(fn)`` (median wall time after a warm-up) and
  ``interleaved_medians({name: fn})`` (several systems run round-robin, so that ratios hold
  on a machine whose speed drifts);
* ``Measurement``: one row (samples, bytes, seconds -> samples/s, MB/s, GB/s), of kind
  "ours", "dataloader", "limit" or "other";
* the machine: ``machine_info()`` (a dict: CPU, usable cores, memory, GPU, versions) and
  ``system_info()`` (the same as one line);
* tables: ``format_table(rows)`` with each row's ratio to the best DataLoader row and to the
  limit row, so every result is printed beside the hardware's limit;
* headlines: ``headline(...)`` records a script's main figure for README's results table,
  which ``markdown_table(records)`` renders (``bench/run_all.py --readme``).

Only the standard library at import time; torch is imported by ``machine_info`` (for the
GPU's name) when it is called.
"""
from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["KINDS", "RESULTS_ENV", "Measurement", "format_table", "headline", "interleaved_medians",
           "machine_info", "markdown_table", "median_seconds", "plot", "print_table", "ratio_vs", "system_info"]

KINDS = ("ours", "dataloader", "limit", "other")


# ---------------------------------------------------------------------------- timing
def _check_repeats(repeats: int, warmup: int) -> None:
    for name, v, low in (("repeats", repeats, 1), ("warmup", warmup, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{name}={v!r} must be an int >= {low}")


def median_seconds(fn: Callable[[], object], *, repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs after ``warmup`` untimed runs."""
    return interleaved_medians({"fn": fn}, repeats=repeats, warmup=warmup)["fn"]


def interleaved_medians(fns: dict[str, Callable[[], object]], *, repeats: int = 5,
                        warmup: int = 1) -> dict[str, float]:
    """Median wall time of each ``fn`` when the functions are run round-robin (a, b, c, a,
    b, c, ...). On a shared machine whose speed drifts, this keeps ratios between the
    systems honest: every system sees the same conditions."""
    _check_repeats(repeats, warmup)
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


# ---------------------------------------------------------------------------- one row
@dataclass
class Measurement:
    """One benchmark row: ``samples`` samples of ``nbytes`` bytes in ``seconds``.

    ``first_batch_s`` (cold start) and ``wait_fraction`` (share of the time the training
    loop waited for data) are filled by loader runs; ``stages`` holds a loader's per-stage
    seconds; ``extra`` anything else a script wants in its JSON."""

    system: str
    samples: int
    nbytes: int
    seconds: float
    kind: str = "other"
    note: str = ""
    first_batch_s: float | None = None
    wait_fraction: float | None = None
    stages: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind={self.kind!r} must be one of {KINDS}")

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e6 if self.seconds > 0 else 0.0

    @property
    def gb_per_s(self) -> float:
        return self.mb_per_s / 1e3

    def as_dict(self) -> dict:
        return {**asdict(self), "samples_per_s": self.samples_per_s, "mb_per_s": self.mb_per_s}

    @classmethod
    def from_dict(cls, d: dict) -> Measurement:
        return cls(**{k: v for k, v in d.items() if k not in ("samples_per_s", "mb_per_s")})


# ---------------------------------------------------------------------------- the machine
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
    """CPU, usable cores (:func:`fastload.system.usable_cores`), memory, GPU (if any, as torch
    sees it) and library versions."""
    from fastload import __version__
    from fastload.system import usable_cores

    versions = {"numpy": _dist_version("numpy"), "torch": _dist_version("torch"),
                "pyarrow": _dist_version("pyarrow"),
                "dali": _dist_version("nvidia-dali-cuda120", "nvidia-dali-cuda130", "nvidia-dali-cuda110",
                                      "nvidia-dali"),
                "fastload": __version__}
    return {"python": platform.python_version(), "platform": platform.platform(), "cpu": _cpu_name(),
            "cores": usable_cores(), "memory_gib": _memory_gib(), "gpu": _gpu_name(),
            "versions": versions}


def system_info(info: dict | None = None) -> str:
    """One line describing the machine and library versions (for benchmark output and the
    README's results table)."""
    m = info or machine_info()
    mem = f", {m['memory_gib']:.0f} GiB RAM" if m["memory_gib"] is not None else ""
    parts = [f"{m['cpu']}, {m['cores']} cores{mem}", f"Python {m['python']}"]
    if m.get("gpu"):
        parts.insert(1, f"GPU {m['gpu']}")
    parts += [f"{k} {m['versions'][k]}" for k in ("numpy", "torch") if m["versions"].get(k)]
    return "; ".join(parts)


# ---------------------------------------------------------------------------- tables
def _ratio(x: float) -> str:
    return f"{x:,.0f}x" if x >= 100 else f"{x:.2f}x"


def format_table(rows: Sequence[Measurement], *, rate: str = "MB/s") -> str:
    """Rows with samples/s, ``rate`` ("MB/s" or "GB/s"), cold first batch and stall where a
    row has them, the ratio to the best DataLoader row and to the best limit row (rows of
    kind "dataloader" / "limit"), and the note."""
    if rate not in ("MB/s", "GB/s"):
        raise ValueError(f"rate={rate!r} must be 'MB/s' or 'GB/s'")
    dl = [r.samples_per_s for r in rows if r.kind == "dataloader"]
    lim = [r.samples_per_s for r in rows if r.kind == "limit"]
    best_dl, best_lim = (max(dl) if dl else None), (max(lim) if lim else None)
    cols: list[tuple[str, Callable[[Measurement], str]]] = [
        ("system", lambda r: r.system),
        ("samples/s", lambda r: f"{r.samples_per_s:,.0f}"),
        (rate, lambda r: f"{r.mb_per_s:,.1f}" if rate == "MB/s" else f"{r.gb_per_s:.2f}"),
    ]
    if any(r.first_batch_s is not None for r in rows):
        cols.append(("first batch (cold)", lambda r: "-" if r.first_batch_s is None else f"{r.first_batch_s:.3f} s"))
    if any(r.wait_fraction is not None for r in rows):
        cols.append(("stall", lambda r: "-" if r.wait_fraction is None else f"{100 * r.wait_fraction:.0f}%"))
    cols.append(("vs DataLoader", lambda r: _ratio(r.samples_per_s / best_dl) if best_dl else "-"))
    cols.append(("vs limit", lambda r: f"{100 * r.samples_per_s / best_lim:.0f}%" if best_lim else "-"))
    if any(r.note for r in rows):
        cols.append(("note", lambda r: r.note))
    table = [[h for h, _ in cols]] + [[f(r) for _, f in cols] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    left = {0, len(cols) - 1} if cols[-1][0] == "note" else {0}
    lines = ["  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
             for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def print_table(title: str, rows: Sequence[Measurement], *, rate: str = "GB/s", file=None) -> None:
    """``format_table`` under a ``## title`` line (the bench/ scripts' format)."""
    print(f"\n## {title}\n{format_table(rows, rate=rate)}", file=file or sys.stdout)


def plot(rows: Sequence[Measurement], path: str | os.PathLike, title: str) -> None:
    """Draw samples/s and the stall fraction of each row to a PNG (matplotlib)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.system for r in rows]
    colors = {"ours": "#1f77b4", "dataloader": "#7f7f7f", "limit": "#2ca02c"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 0.6 * len(rows) + 2.2),
                                   gridspec_kw={"width_ratios": [3, 1.2]})
    y = list(range(len(rows)))[::-1]
    rates = [r.samples_per_s for r in rows]
    ax1.barh(y, rates, color=[colors.get(r.kind, "#999") for r in rows])
    ax1.set_yticks(y, names)
    ax1.set_xlabel("samples / s (higher is better)")
    for yi, v in zip(y, rates):
        ax1.text(v, yi, f" {v:,.0f}", va="center", fontsize=9)
    ax1.set_xlim(0, max(rates) * 1.25 if rates and max(rates) > 0 else 1)
    ax2.barh(y, [100 * (r.wait_fraction or 0.0) for r in rows], color="#d62728")
    ax2.set_yticks(y, [""] * len(y))
    ax2.set_xlim(0, 100)
    ax2.set_xlabel("% of time the loop waited for data")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
        if rb is None:
            vs_b = "none of its cost" if r["ours"][1] <= 0 and r["baseline"] else "–"
        else:
            vs_b = f"{rb:,.0f}x" if rb >= 100 else f"{rb:.1f}x"
        vs_l = "–" if rl is None else f"{100 * rl:.0f}%"
        work = f"{r['workload']} (`python bench/{r['script']}`)"
        ours = cell(r["ours"]) + (f" ({r['note']})" if r["note"] else "")
        lines.append(f"| {work} | {ours} | {cell(r['baseline'])} | {cell(r['limit'])} | {vs_b} | {vs_l} |")
    return "\n".join(lines)

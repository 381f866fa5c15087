"""Measuring and reporting, for ``fastload bench`` and every script in ``bench/``.

    from fastload.bench.report import (Measurement, Spread, headline, interleaved_times, paired_ratios,
                                       print_table, system_info)

* timing (:mod:`fastload.bench.timing`, re-exported here): ``interleaved_times({name: fn})``
  (several systems run round-robin, so that ratios hold on a machine whose speed drifts; the
  rounds pair up), ``Spread`` (median with min–max), ``paired_ratios``, and the medians alone
  (``interleaved_medians``, ``median_seconds``);
* ``Measurement``: one row (samples, bytes, seconds -> samples/s, MB/s, GB/s), of kind
  "ours", "dataloader", "limit" or "other"; ``Measurement.from_times`` keeps each round's
  rate, so the row carries its spread and its paired ratios to the rows of the same run;
* the machine (:mod:`fastload.bench.machine`): ``machine_info()`` (a dict: CPU, usable
  cores, memory, GPU, versions) and ``system_info()`` (the same as one line);
* tables: ``format_table(rows)`` with each row's ratio to the best DataLoader row and to the
  limit row, so every result is printed beside the hardware's limit; figures with a spread
  read ``median (min–max)``;
* headlines (:mod:`fastload.bench.headlines`): ``headline(...)`` records a script's main
  figure for the results table of docs/benchmarks.md, which ``markdown_table(records)`` renders
  (``bench/run_all.py --readme``).

Only the standard library at import time; torch is imported by ``machine_info`` (for the
GPU's name) when it is called.
"""
from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from .headlines import RESULTS_ENV, headline, markdown_table, ratio_vs
from .machine import machine_info, system_info
from .timing import (Spread, interleaved_cold_starts, interleaved_medians, interleaved_spreads, interleaved_times,
                     median_seconds, paired_ratios, seconds_spread, wait_until_idle)

__all__ = ["KINDS", "RESULTS_ENV", "Measurement", "Spread", "format_table", "headline", "interleaved_cold_starts",
           "interleaved_medians", "interleaved_spreads", "interleaved_times", "machine_info", "markdown_table", "median_seconds",
           "paired_ratios", "plot", "print_table", "ratio_vs", "seconds_spread", "system_info",
           "wait_until_idle"]

KINDS = ("ours", "dataloader", "limit", "other")


# ---------------------------------------------------------------------------- one row
@dataclass
class Measurement:
    """One benchmark row: ``samples`` samples of ``nbytes`` bytes in ``seconds``.

    ``first_batch_s`` (cold start; ``first_batch_range``: its fastest and slowest repeat)
    and ``wait_fraction`` (share of the time the training loop waited for data) are filled
    by loader runs; ``stages`` holds a loader's per-stage seconds; ``extra`` anything else a
    script wants in its JSON. ``round_rates``: samples/s of each timed repeat in round order
    (:meth:`from_times`); rows of one table with the same non-empty ``group`` were run
    round-robin in the same rounds, so their per-round ratios pair up (:meth:`paired`)."""

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
    round_rates: list = field(default_factory=list)
    group: str = ""
    first_batch_range: list | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind={self.kind!r} must be one of {KINDS}")
        self.round_rates = [float(r) for r in self.round_rates]

    @classmethod
    def from_times(cls, system: str, samples: int, nbytes: int, times: Sequence[float], kind: str = "other",
                   note: str = "", *, group: str = "", **kw) -> Measurement:
        """A row from the wall seconds of its repeats (each moving ``samples`` samples of
        ``nbytes`` bytes): ``seconds`` is their median, ``round_rates`` every repeat's rate."""
        if not times or min(times) <= 0:
            raise ValueError(f"{system}: times {list(times)!r} must be a non-empty list of seconds > 0")
        return cls(system, samples, nbytes, statistics.median(times), kind, note,
                   round_rates=[samples / t for t in times], group=group, **kw)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e6 if self.seconds > 0 else 0.0

    @property
    def gb_per_s(self) -> float:
        return self.mb_per_s / 1e3

    @property
    def rate_spread(self) -> Spread:
        """samples/s as a median (the rate of the median time) with the slowest and fastest
        repeat; one value when the repeats were not kept."""
        r = self.samples_per_s
        if len(self.round_rates) < 2:
            return Spread(r, r, r, 1)
        return Spread(r, min(min(self.round_rates), r), max(max(self.round_rates), r), len(self.round_rates))

    def paired(self, other: Measurement) -> Spread | None:
        """The spread of this row's rate over ``other``'s, round by round, when both were run
        round-robin in the same rounds (same ``group``, as many rounds); else None."""
        if not self.group or self.group != other.group or len(self.round_rates) != len(other.round_rates) \
                or len(self.round_rates) < 2:
            return None
        return paired_ratios(self.round_rates, other.round_rates)

    def as_dict(self) -> dict:
        return {**asdict(self), "samples_per_s": self.samples_per_s, "mb_per_s": self.mb_per_s}

    @classmethod
    def from_dict(cls, d: dict) -> Measurement:
        """A row from :meth:`as_dict` (also one written before spreads were recorded)."""
        return cls(**{k: v for k, v in d.items() if k not in ("samples_per_s", "mb_per_s")})


# ---------------------------------------------------------------------------- tables
def _ratio(x: float) -> str:
    return f"{x:,.0f}x" if x >= 100 else f"{x:.2f}x"


def _with_range(main: str, sp: Spread | None, fmt: Callable[[float], str], unit: str = "") -> str:
    return main if sp is None or sp.n < 2 else f"{main} ({fmt(sp.lo)}–{fmt(sp.hi)}{unit})"


def _rate_cell(r: Measurement) -> str:
    sp = r.rate_spread
    return _with_range(f"{r.samples_per_s:,.0f}", sp, lambda x: f"{x:,.0f}")


def _first_batch_cell(r: Measurement) -> str:
    if r.first_batch_s is None:
        return "-"
    s = f"{r.first_batch_s:.3f}"
    if r.first_batch_range:
        s += f" ({r.first_batch_range[0]:.3f}–{r.first_batch_range[1]:.3f})"
    return s + " s"


def format_table(rows: Sequence[Measurement], *, rate: str = "MB/s") -> str:
    """Rows with samples/s (``median (min–max)`` when the row kept its repeats), ``rate``
    ("MB/s" or "GB/s"), cold first batch and stall where a row has them, the ratio to the best
    DataLoader row and to the best limit row (rows of kind "dataloader" / "limit"; with the
    spread of the per-round ratios when both were run in the same rounds), and the note."""
    if rate not in ("MB/s", "GB/s"):
        raise ValueError(f"rate={rate!r} must be 'MB/s' or 'GB/s'")
    dl = [r for r in rows if r.kind == "dataloader"]
    lim = [r for r in rows if r.kind == "limit"]
    best_dl = max(dl, key=lambda r: r.samples_per_s) if dl else None
    best_lim = max(lim, key=lambda r: r.samples_per_s) if lim else None

    def vs_dl(r: Measurement) -> str:
        if best_dl is None or not best_dl.samples_per_s:
            return "-"
        return _with_range(_ratio(r.samples_per_s / best_dl.samples_per_s),
                           None if r is best_dl else r.paired(best_dl), lambda x: _ratio(x)[:-1], "x")

    def vs_lim(r: Measurement) -> str:
        if best_lim is None or not best_lim.samples_per_s:
            return "-"
        pct = f"{100 * r.samples_per_s / best_lim.samples_per_s:.0f}%"
        sp = None if r is best_lim else r.paired(best_lim)
        return pct if sp is None else f"{pct} ({100 * sp.lo:.0f}–{100 * sp.hi:.0f}%)"

    cols: list[tuple[str, Callable[[Measurement], str]]] = [
        ("system", lambda r: r.system),
        ("samples/s", _rate_cell),
        (rate, lambda r: f"{r.mb_per_s:,.1f}" if rate == "MB/s" else f"{r.gb_per_s:.2f}"),
    ]
    if any(r.first_batch_s is not None for r in rows):
        cols.append(("first batch (cold)", _first_batch_cell))
    if any(r.wait_fraction is not None for r in rows):
        cols.append(("stall", lambda r: "-" if r.wait_fraction is None else f"{100 * r.wait_fraction:.0f}%"))
    cols.append(("vs DataLoader", vs_dl))
    cols.append(("vs limit", vs_lim))
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
    """Draw samples/s (with the min–max of the repeats as error bars) and the stall fraction
    of each row to a PNG (matplotlib)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.system for r in rows]
    colors = {"ours": "#1f77b4", "dataloader": "#7f7f7f", "limit": "#2ca02c"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 0.6 * len(rows) + 2.2),
                                   gridspec_kw={"width_ratios": [3, 1.2]})
    y = list(range(len(rows)))[::-1]
    rates = [r.samples_per_s for r in rows]
    spreads = [r.rate_spread for r in rows]
    err = [[v - sp.lo for v, sp in zip(rates, spreads)], [sp.hi - v for v, sp in zip(rates, spreads)]]
    ax1.barh(y, rates, color=[colors.get(r.kind, "#999") for r in rows], xerr=err, capsize=3)
    ax1.set_yticks(y, names)
    ax1.set_xlabel("samples / s (higher is better)")
    top = max(sp.hi for sp in spreads) if spreads else 0
    xmax = top * 1.3 if top > 0 else 1
    for yi, v, sp in zip(y, rates, spreads):
        # the label starts past the error bar's right cap (not at the bar's end, where the cap
        # would run into its first digit: "2,873" read as "12,873"), on a white box
        ax1.text(max(v, sp.hi) + 0.015 * xmax, yi, f"{v:,.0f}", va="center", ha="left", fontsize=9,
                 bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.0})
    ax1.set_xlim(0, xmax)
    ax2.barh(y, [100 * (r.wait_fraction or 0.0) for r in rows], color="#d62728")
    ax2.set_yticks(y, [""] * len(y))
    ax2.set_xlim(0, 100)
    ax2.set_xlabel("% of time the loop waited for data")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

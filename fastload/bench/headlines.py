"""Headlines: each bench/ script's main figure, for the results table of docs/benchmarks.md.

``headline(...)`` records fastload's figure, the baseline people use today and the limit,
all measured in one run, each a number or a :class:`~fastload.bench.timing.Spread` (median
with min–max), optionally with the spread of the paired per-round ratios and the cold time
to the first batch of each system; ``markdown_table(records)`` renders the records as the
table (``bench/run_all.py --readme``). Records written before spreads existed render as
before.
"""
from __future__ import annotations

import json
import math
import os

from .machine import system_info
from .timing import Spread

__all__ = ["RESULTS_ENV", "headline", "markdown_table", "ratio_vs"]

RESULTS_ENV = "FASTLOAD_BENCH_RESULTS"


def _split(value) -> tuple[float, list[float] | None]:
    if isinstance(value, Spread):
        return value.median, ([value.lo, value.hi] if value.n > 1 else None)
    return value, None


def headline(workload: str, *, script: str, ours: tuple, unit: str, baseline: tuple | None = None,
             limit: tuple | None = None, lower_is_better: bool = False, note: str = "", smoke: bool = False,
             vs_baseline: Spread | None = None, vs_limit: Spread | None = None,
             first_batch: dict | None = None) -> dict:
    """Record one workload's main figure: (label, value) for fastload, the baseline people use
    today and the limit, all in ``unit`` and measured in the same run; a value is a number or
    a :class:`Spread` (its median is the figure, min–max its spread). ``vs_baseline`` /
    ``vs_limit``: the spread of the per-round ratios (how many times better fastload is,
    paired rounds of an interleaved run: :func:`fastload.bench.timing.paired_ratios`).
    ``first_batch``: ``{system: seconds or Spread}``, the cold time to the first batch.
    Appended as a JSON line to the file named by $FASTLOAD_BENCH_RESULTS (set by
    run_all.py), and returned."""
    rec = {"workload": workload, "script": script, "unit": unit, "lower_is_better": lower_is_better}
    for what, pair in (("ours", ours), ("baseline", baseline), ("limit", limit)):
        if pair is None:
            rec[what] = None
            continue
        v, rng = _split(pair[1])
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        # a cost of ours (time, memory growth) may be zero or below; everything else is a rate or a cost > 0
        if not ok or (v <= 0 and not (what == "ours" and lower_is_better)):
            raise ValueError(f"{workload}: {what} value {pair[1]!r} must be a positive number")
        rec[what] = [pair[0], v]
        if rng is not None:
            rec[f"{what}_range"] = rng
    for what, sp in (("vs_baseline", vs_baseline), ("vs_limit", vs_limit)):
        if sp is not None:
            if not isinstance(sp, Spread) or sp.lo <= 0:
                raise ValueError(f"{workload}: {what}={sp!r} must be a Spread of positive ratios")
            rec[f"{what}_range"] = [sp.lo, sp.hi]
    if first_batch:
        fb = {}
        for k, v in first_batch.items():
            m, rng = _split(v)
            if not isinstance(m, (int, float)) or not math.isfinite(m) or m <= 0:
                raise ValueError(f"{workload}: first_batch[{k!r}]={v!r} must be a positive number of seconds")
            fb[k] = [m, *(rng or [])]
        rec["first_batch_s"] = fb
    rec.update({"note": note, "smoke": smoke, "machine": system_info()})
    path = os.environ.get(RESULTS_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")
    return rec


def _scale(x: float) -> tuple[float, str, str]:
    """(divisor, format spec, prefix) for a value of the size of ``x``."""
    if x >= 1e6:
        return 1e6, ".2f", " M"
    if x >= 1e4:
        return 1e3, ".0f", " k"
    if x >= 100:
        return 1.0, ",.0f", ""
    if x >= 1:
        return 1.0, ".2f", ""
    return 1.0, f".{2 - math.floor(math.log10(x))}f", ""  # 3 significant digits, the range as many decimals


def _fmt_value(x: float, unit: str, rng: list[float] | None = None) -> str:
    """``2.47 M samples/s``, or with a spread ``2.47 (2.40–2.55) M samples/s``."""
    if x <= 0:
        return f"{x:+.1f} {unit}"
    div, spec, prefix = _scale(x)
    v = format(x / div, spec)
    if rng:
        v += f" ({format(rng[0] / div, spec)}–{format(rng[1] / div, spec)})"
    return f"{v}{prefix} {unit}"


def ratio_vs(rec: dict, which: str) -> float | None:
    """How many times better fastload is than ``which`` ("baseline" or "limit"): the ratio of
    the medians."""
    other = rec.get(which)
    if not other:
        return None
    ours, theirs = rec["ours"][1], other[1]
    if ours <= 0:  # a cost of zero (no memory growth): no finite ratio
        return None
    return theirs / ours if rec["lower_is_better"] else ours / theirs


def _times(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def _first_batch(fb: dict) -> str:
    parts = []
    for k, v in fb.items():
        s = f"{v[0]:.2f}" if v[0] >= 0.1 else f"{v[0]:.3f}"
        if len(v) == 3:
            spec = ".2f" if v[0] >= 0.1 else ".3f"
            s += f" ({format(v[1], spec)}–{format(v[2], spec)})"
        parts.append(f"{k} {s} s")
    return "first batch (cold): " + ", ".join(parts)


def markdown_table(records: list[dict]) -> str:
    """The the results table of docs/benchmarks.md: one row per recorded headline. A figure with a spread
    reads ``median (min–max)``; ratios are the medians' ratio with the spread of the
    per-round ratios where the script recorded it."""
    lines = ["| workload (command) | fastload | baseline | limit | vs baseline | vs limit |",
             "|---|---|---|---|---|---|"]
    for r in records:
        unit = r["unit"]

        def cell(what, r=r, unit=unit):
            pair = r.get(what)
            return f"{pair[0]}: {_fmt_value(pair[1], unit, r.get(f'{what}_range'))}" if pair else "–"

        rb, rl = ratio_vs(r, "baseline"), ratio_vs(r, "limit")
        if rb is None:
            vs_b = "none of its cost" if r["ours"][1] <= 0 and r["baseline"] else "–"
        else:
            vs_b = f"{_times(rb)}x"
            if r.get("vs_baseline_range"):
                lo, hi = r["vs_baseline_range"]
                vs_b += f" ({_times(lo)}–{_times(hi)}x)"
        vs_l = "–" if rl is None else f"{100 * rl:.0f}%"
        if rl is not None and r.get("vs_limit_range"):
            lo, hi = r["vs_limit_range"]
            vs_l += f" ({100 * lo:.0f}–{100 * hi:.0f}%)"
        work = f"{r['workload']} (`python bench/{r['script']}`)"
        notes = [n for n in (r.get("note"), _first_batch(r["first_batch_s"]) if r.get("first_batch_s") else "") if n]
        ours = cell("ours") + (f" ({'; '.join(notes)})" if notes else "")
        lines.append(f"| {work} | {ours} | {cell('baseline')} | {cell('limit')} | {vs_b} | {vs_l} |")
    return "\n".join(lines)

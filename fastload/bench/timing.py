"""Timing for ``fastload bench`` and the ``bench/`` scripts: every figure is a median with its
spread, from repeats run round-robin.

* ``interleaved_times({name: fn})``: the systems run round-robin (a, b, c, a, b, c, ...)
  after untimed warm-up rounds; each system's wall times, in round order, so that the
  rounds pair up (round ``i`` of every system ran under the same conditions);
* ``Spread``: a median with the lowest and highest repeat (``Spread.of(values)``), turned
  into a rate (``rate(work)``: seconds -> work/s) or printed as ``median (min–max)``;
* ``paired_ratios(a, b)``: the spread of ``a[i] / b[i]`` over the rounds, which is what a
  ratio between two interleaved systems is worth on a machine whose speed drifts (the ratio
  of the medians always lies inside it);
* ``interleaved_medians`` / ``median_seconds``: the medians alone (older callers);
* ``interleaved_cold_starts({name: start})``: the time each system takes from nothing to
  its first batch (``start()`` builds it and returns its first batch's closer), round-robin;
* ``wait_until_idle()``: block until this process's threads stop using the CPU (a pipeline
  that runs ahead, like DALI's asynchronous executor, finishes its work inside the timing of
  the system that started it rather than in the next system's).

Standard library only.
"""
from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["Spread", "interleaved_cold_starts", "interleaved_medians", "interleaved_spreads", "interleaved_times",
           "median_seconds", "paired_ratios", "seconds_spread", "wait_until_idle"]


def _check_repeats(repeats: int, warmup: int) -> None:
    for name, v, low in (("repeats", repeats, 1), ("warmup", warmup, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{name}={v!r} must be an int >= {low}")


@dataclass(frozen=True)
class Spread:
    """A median with the lowest (``lo``) and highest (``hi``) of ``n`` repeats."""

    median: float
    lo: float
    hi: float
    n: int = 1

    def __post_init__(self) -> None:
        if not all(math.isfinite(v) for v in (self.median, self.lo, self.hi)) or not \
                self.lo <= self.median <= self.hi:
            raise ValueError(f"Spread needs finite lo <= median <= hi, got {self.lo!r}, {self.median!r}, {self.hi!r}")

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        vs = [float(v) for v in values]
        if not vs:
            raise ValueError("Spread.of: no values")
        return cls(statistics.median(vs), min(vs), max(vs), len(vs))

    def rate(self, work: float = 1.0) -> Spread:
        """Times (seconds) as a rate: ``work / t`` (the slowest repeat is the lowest rate)."""
        if self.lo <= 0:
            raise ValueError(f"Spread.rate: a time of {self.lo!r} s has no rate")
        return Spread(work / self.median, work / self.hi, work / self.lo, self.n)

    def scale(self, k: float) -> Spread:
        """Every value times ``k`` (a negative ``k`` swaps the ends)."""
        a, b = sorted((self.lo * k, self.hi * k))
        return Spread(self.median * k, a, b, self.n)

    def fmt(self, spec: str = ".2f", suffix: str = "") -> str:
        """``median (lo–hi)`` with ``format(x, spec)``; just the median for one repeat."""
        m = format(self.median, spec) + suffix
        if self.n < 2:
            return m
        return f"{m} ({format(self.lo, spec)}–{format(self.hi, spec)}{suffix})"


def interleaved_times(fns: dict[str, Callable[[], object]], *, repeats: int = 5,
                      warmup: int = 1) -> dict[str, list[float]]:
    """Wall seconds of each ``fn`` over ``repeats`` rounds, the functions run round-robin (a,
    b, c, a, b, c, ...) after ``warmup`` untimed rounds. On a shared machine whose speed
    drifts this keeps ratios between the systems honest: every round sees the same
    conditions, and round ``i`` of one system pairs with round ``i`` of another."""
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
    return times


def interleaved_spreads(fns: dict[str, Callable[[], object]], *, repeats: int = 5,
                        warmup: int = 1) -> dict[str, Spread]:
    """:func:`interleaved_times` as a :class:`Spread` of seconds per system."""
    return {k: Spread.of(v) for k, v in interleaved_times(fns, repeats=repeats, warmup=warmup).items()}


def interleaved_medians(fns: dict[str, Callable[[], object]], *, repeats: int = 5,
                        warmup: int = 1) -> dict[str, float]:
    """The median seconds of :func:`interleaved_times` (use :func:`interleaved_spreads` or the
    times themselves to report the spread too)."""
    return {k: s.median for k, s in interleaved_spreads(fns, repeats=repeats, warmup=warmup).items()}


def interleaved_cold_starts(starts: dict[str, Callable[[], Callable[[], object]]], *, repeats: int = 3,
                            warmup: int = 1) -> dict[str, list[float]]:
    """Seconds from nothing to the first batch of each system, round-robin like
    :func:`interleaved_times`: ``start()`` builds the system (pipeline build, worker start-up)
    and takes its first batch, then returns a function that shuts it down, which runs
    untimed. The warm-up rounds pay for what a process does once (imports, JIT), not for
    each loader."""
    _check_repeats(repeats, warmup)
    times: dict[str, list[float]] = {k: [] for k in starts}
    for r in range(warmup + repeats):
        for k, start in starts.items():
            t0 = time.perf_counter()
            close = start()
            dt = time.perf_counter() - t0
            close()
            # Drop the system here, untimed: else its last reference (the closure) goes when the
            # next start()'s result is assigned, inside the next timing, and whatever its
            # destructors do (join threads, free a pipeline) is charged to the next system.
            del close
            gc.collect()
            if r >= warmup:
                times[k].append(dt)
    return times


def seconds_spread(fn: Callable[[], object], *, repeats: int = 5, warmup: int = 1) -> Spread:
    """Wall time of ``fn()`` over ``repeats`` runs after ``warmup`` untimed runs."""
    return interleaved_spreads({"fn": fn}, repeats=repeats, warmup=warmup)["fn"]


def median_seconds(fn: Callable[[], object], *, repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs after ``warmup`` untimed runs."""
    return seconds_spread(fn, repeats=repeats, warmup=warmup).median


def paired_ratios(a: Sequence[float], b: Sequence[float]) -> Spread:
    """The spread of ``a[i] / b[i]`` over paired rounds (the same length: round ``i`` of
    both ran under the same conditions). The ratio of the medians lies inside it."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired_ratios needs two equally long, non-empty series; got {len(a)} and {len(b)}")
    if any(y <= 0 for y in b):
        raise ValueError("paired_ratios: a denominator <= 0")
    return Spread.of([x / y for x, y in zip(a, b)])


def wait_until_idle(*, busy: float = 0.1, window: float = 0.005, timeout: float = 5.0) -> float:
    """Block until this process's threads use less than ``busy`` of one core over a
    ``window`` of seconds (or ``timeout`` passes); returns the seconds waited. The calling
    thread only sleeps meanwhile, so what is measured is the others' work (e.g. DALI's
    executor still computing the batches it runs ahead)."""
    t0 = time.perf_counter()
    while True:
        c0 = time.process_time()
        time.sleep(window)
        if time.process_time() - c0 < busy * window or time.perf_counter() - t0 > timeout:
            return time.perf_counter() - t0

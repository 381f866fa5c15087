"""Stats: the one object every part of a Loader reports into; ``Loader.stats()`` is its
:meth:`Stats.report`.

Parts report in three ways:

* ``stats.add(name, value)`` adds to a counter of the current epoch (the feeders' decode and
  copy seconds, replaced samples, ...). A new counter needs nothing else: it appears in the
  snapshot (names in ``STAGES`` under ``"stages"``, the others at the top level).
* ``stats.attach(name, probe)`` registers a long-lived part's *cumulative* counters (the
  ring's gather time, measured in C++; a device delivery's copy time): ``probe()`` returns
  ``{counter: total so far}``, and the snapshot shows what accrued since the epoch began.
  ``detach_all()`` (the Loader's ``close()``) keeps the last values, so ``stats()`` stays
  complete after the parts are gone. ``derive(out)``, given with the probe, turns its totals
  into what the report shows (the remote cache's busy time into ``download_MBps``).
* ``stats.gauge(name, read)`` registers a whole-Loader fact that is read as it is when the
  report is made, not counted per epoch (the ring's slot states, the dataset's verification
  counters, the samples found undecodable): ``read()`` returns the value of ``name``, or
  None to leave it out. Gauges appear after the counters, in the order registered.

Probes and gauges are registered where their part is built (loader/machinery.py: the ring, the
device delivery, verification, undecodable samples; loader/remote.py: the shard cache; the
Loader: the epoch), so a new stat touches the reporting part and at most that registration.
``snapshot()`` is the per-epoch counters alone (the ``log_every`` line); ``report()`` adds
the derived values and the gauges.

The consumer reports each delivered batch with ``delivered()``; ``begin_epoch()`` and
``end_epoch()`` bound the wall time (a finished or broken-off epoch's rates stay put).
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Any, Callable

__all__ = ["STAGES", "Stats", "bottleneck"]

# Steady-state wait fractions (after the first batch) that name the pace setter
LOOP_BOUND_BELOW = 0.05  # the loop hardly ever waits: its own step sets the speed
LOADER_BOUND_ABOVE = 0.20  # the loop waits a fifth of its time or more: loading does

STAGES = ("gather_s", "decode_s", "copy_s")  # where the time went, summed over threads
# counters that always appear, zero or not; batches_ahead: this pass's batches requested
# while the previous pass ended (epoch.py's look-ahead)
_COUNTERS = ("replaced_samples", "batches_ahead")

Probe = Callable[[], dict]
Derive = Callable[[dict], Any]
Gauge = Callable[[], Any]


class Stats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._probes: dict[str, Probe] = {}
        self._derives: dict[str, Derive] = {}  # by probe; kept after detach_all (frozen values)
        self._gauges: dict[str, Gauge] = {}
        self._frozen: dict[str, dict] = {}  # a detached probe's last values
        self._base: dict[str, dict] = {}  # each probe's values when the epoch began
        self._reset()

    def _reset(self) -> None:
        self.t_start: float | None = None
        self.t_end: float | None = None
        self.batches = 0
        self.samples = 0
        self.bytes = 0
        self.wait_s = 0.0
        self.first_wait_s = 0.0  # the first batch's wait (pipeline start-up), apart
        self.first_batch_s: float | None = None
        self.counters: dict[str, float] = defaultdict(float)

    # -- reporting -------------------------------------------------------------------------
    def add(self, name: str, value: float) -> None:
        with self._lock:
            self.counters[name] += value

    def attach(self, name: str, probe: Probe, derive: Derive | None = None) -> None:
        values = probe()
        with self._lock:
            self._probes[name] = probe
            self._frozen.pop(name, None)
            self._base[name] = values  # counts from now on
            if derive is not None:
                self._derives[name] = derive
            else:
                self._derives.pop(name, None)

    def gauge(self, name: str, read: Gauge) -> None:
        with self._lock:
            self._gauges[name] = read

    def detach_all(self) -> None:
        with self._lock:
            for name, probe in self._probes.items():
                self._frozen[name] = probe()
            self._probes.clear()

    def begin_epoch(self) -> None:
        values = self._read_probes()
        with self._lock:
            self._reset()
            self._base = values
            self.t_start = time.perf_counter()

    def end_epoch(self) -> None:
        with self._lock:
            if self.t_end is None and self.t_start is not None:
                self.t_end = time.perf_counter()

    def delivered(self, samples: int, nbytes: int, wait_s: float, t: float) -> int:
        """One batch handed to the training loop at time ``t`` after waiting ``wait_s``;
        returns the epoch's batch count."""
        with self._lock:
            self.wait_s += wait_s
            if self.batches == 0:
                self.first_wait_s = wait_s
            self.batches += 1
            self.samples += samples
            self.bytes += nbytes
            if self.first_batch_s is None and self.t_start is not None:
                self.first_batch_s = t - self.t_start
            return self.batches

    # -- reading ---------------------------------------------------------------------------
    def _read_probes(self) -> dict[str, dict]:
        with self._lock:
            probes = dict(self._probes)
            values = {n: dict(v) for n, v in self._frozen.items()}
        values.update({n: p() for n, p in probes.items()})
        return values

    def snapshot(self) -> dict:
        """Throughput and where the time went, since the current epoch began."""
        now_values = self._read_probes()
        with self._lock:
            totals: dict[str, float] = defaultdict(float)
            for name in _COUNTERS:
                totals[name] = 0
            for name, v in self.counters.items():
                totals[name] += v
            for probe, values in now_values.items():
                base = self._base.get(probe, {})
                for name, v in values.items():
                    totals[name] += v - base.get(name, 0)
            now = self.t_end if self.t_end is not None else time.perf_counter()
            wall = (now - self.t_start) if self.t_start is not None else 0.0
            out = {
                "batches": self.batches, "samples": self.samples, "bytes": self.bytes,
                "wall_s": wall, "wait_s": self.wait_s,
                "wait_fraction": (self.wait_s / wall) if wall > 0 else 0.0,
                "batches_per_s": self.batches / wall if wall > 0 else 0.0,
                "samples_per_s": self.samples / wall if wall > 0 else 0.0,
                "mb_per_s": self.bytes / wall / 1e6 if wall > 0 else 0.0,
                "first_batch_s": self.first_batch_s,
                # the training loop's own time (outside next()), and which side sets the pace
                "loop_s": max(0.0, wall - self.wait_s),
                "bottleneck": bottleneck(self.batches, wall - self.first_wait_s, self.wait_s - self.first_wait_s),
                "stages": {name: float(totals.pop(name, 0.0)) for name in STAGES},
            }
        for name, v in totals.items():
            out[name] = int(v) if float(v).is_integer() else v
        return out

    def report(self) -> dict:
        """The snapshot, each probe's ``derive`` applied, then every gauge: what
        ``Loader.stats()`` returns."""
        out = self.snapshot()
        with self._lock:
            derives = list(self._derives.values())
            gauges = list(self._gauges.items())
        for derive in derives:
            derive(out)
        for name, read in gauges:
            value = read()
            if value is not None:
                out[name] = value
        return out


def bottleneck(batches: int, steady_wall_s: float, steady_wait_s: float) -> str | None:
    """What sets the pace of an epoch, from the time the loop waited in ``next()`` after
    its first batch (start-up is apart): ``"loop"`` when it waited under 5% of the time (the
    training step is the bottleneck: a faster loader gains nothing), ``"loader"`` above 20%
    (the loop is starved: more threads, a GPU decode or smaller images help), ``"both"`` in
    between, None before the second batch."""
    if batches < 2 or steady_wall_s <= 0:
        return None
    f = steady_wait_s / steady_wall_s
    return "loop" if f < LOOP_BOUND_BELOW else "loader" if f > LOADER_BOUND_ABOVE else "both"

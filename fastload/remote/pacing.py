"""How many downloads run, and when: the pacing shared by every download of a process.

* :class:`RetryPolicy`: attempts per file, exponential backoff with full jitter, the per-file
  deadline.
* :class:`Concurrency`: the downloads in flight, adapted AIMD-style (halved on throttling,
  one more after as many successes as there are slots).
* :class:`RangePool`: threads fetching byte ranges of shards, most urgent first.
* :class:`DownloadCounters`: thread-safe byte / retry / throttle counters and busy time.
* :class:`Cancelled`: raised when the cache closes mid-download (not a user-visible error).

The fault handling around one file (resume, credentials, checksums) is in
:mod:`fastload.remote.download`, which re-exports these names.
"""
from __future__ import annotations

import heapq
import itertools
import random
import threading
import time
from dataclasses import dataclass
from typing import Callable

__all__ = ["Cancelled", "Concurrency", "DownloadCounters", "RangePool", "RetryPolicy"]


class Cancelled(Exception):
    """The cache is closing: the download stopped (not an error the user sees)."""


@dataclass(frozen=True)
class RetryPolicy:
    """Attempts and deadlines. ``timeout_s`` (``download_timeout``) bounds every wait for the
    server: one file's download (all its attempts, its wait for room in the budget and for
    another process downloading it), a manifest read (all its attempts), a shard's lengths.
    ``close_s`` bounds how long ``stop()``/``close()`` wait for transfers to notice they were
    cancelled; a thread still blocked in a read of the server then is left behind (a daemon
    thread that writes nothing more), with a warning."""

    attempts: int = 6           # per file, on top of the transport's request retries
    backoff_s: float = 0.5      # first pause; doubled each attempt
    backoff_max_s: float = 30.0
    timeout_s: float = 600.0    # per file: the deadline that names the file
    close_s: float = 2.0        # stop()/close(): the wait for transfers to end

    def pause(self, attempt: int) -> float:
        """Full jitter: uniform in [0.5, 1.5] x base * 2**attempt, capped."""
        return min(self.backoff_max_s, self.backoff_s * (2 ** attempt)) * random.uniform(0.5, 1.5)


class Concurrency:
    """Downloads in flight, adapted AIMD-style: halved on throttling (at most once per
    ``cooldown_s``), one more after ``limit`` successes, between 1 and ``maximum``."""

    def __init__(self, maximum: int, cooldown_s: float = 1.0):
        self.maximum = max(1, int(maximum))
        self._limit = float(self.maximum)
        self._active = 0
        self._cond = threading.Condition()
        self._last_cut = -1e9
        self._cooldown = cooldown_s
        self.cuts = 0

    @property
    def limit(self) -> int:
        return max(1, int(self._limit))

    def acquire(self, stop: threading.Event | None = None, deadline: float | None = None) -> bool:
        """Take a slot; False when ``deadline`` (``time.monotonic()``) passed first,
        :class:`Cancelled` once ``stop`` is set."""
        with self._cond:
            while self._active >= self.limit:
                if stop is not None and stop.is_set():
                    raise Cancelled()
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                self._cond.wait(0.05)
            self._active += 1
            return True

    def release(self) -> None:
        with self._cond:
            self._active -= 1
            self._cond.notify_all()

    def throttled(self) -> None:
        with self._cond:
            now = time.monotonic()
            if now - self._last_cut >= self._cooldown:
                self._limit = max(1.0, self._limit / 2)
                self._last_cut = now
                self.cuts += 1

    def succeeded(self) -> None:
        with self._cond:
            if self._limit < self.maximum:
                self._limit = min(float(self.maximum), self._limit + 1.0 / self._limit)
                self._cond.notify_all()


class _Job:
    __slots__ = ("fn", "done", "error", "after")

    def __init__(self, fn: Callable[[], None], after: Callable[[], None] | None = None):
        self.fn = fn
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.after = after  # called once the job is over (run, failed or dropped)

    def finish(self) -> None:
        self.done.set()
        if self.after is not None:
            self.after()


class RangePool:
    """Threads that fetch byte ranges of shards, most urgent first (lowest priority value:
    the shard the reader waits for, then the order of first use), so the next shard needed
    gets the bandwidth instead of sharing it with shards needed later.

    :meth:`close` waits for the threads until a deadline; a thread still blocked in a read of
    the server then is left behind (it ends when the read returns: its generation is over)."""

    def __init__(self, threads: int, concurrency: Concurrency, stop: threading.Event):
        self._n = max(1, int(threads))
        self._concurrency = concurrency
        self._stop = stop
        self._heap: list = []
        self._cond = threading.Condition()
        self._seq = itertools.count()
        self._threads: list[threading.Thread] = []
        self._gen = 0  # close() ends a generation of threads; submit() starts the next

    def submit(self, priority, fn: Callable[[], None], after: Callable[[], None] | None = None) -> _Job:
        job = _Job(fn, after)
        with self._cond:
            if not self._threads:
                self._threads = [threading.Thread(target=self._run, args=(self._gen,), name=f"fastload-range-{i}",
                                                  daemon=True) for i in range(self._n)]
                for t in self._threads:
                    t.start()
            heapq.heappush(self._heap, (priority, next(self._seq), job))
            self._cond.notify()
        return job

    def _run(self, gen: int) -> None:
        while True:
            with self._cond:
                while not self._heap and self._gen == gen:
                    self._cond.wait()
                if self._gen != gen:
                    return
                _, _, job = heapq.heappop(self._heap)
            try:
                if self._stop.is_set():
                    raise Cancelled()
                self._concurrency.acquire(self._stop)
                try:
                    job.fn()
                finally:
                    self._concurrency.release()
            except BaseException as e:  # handed to the waiting download
                job.error = e
            job.finish()

    def close(self, deadline: float | None = None) -> list[threading.Thread]:
        """End this generation of threads: queued jobs are dropped (:class:`Cancelled`), the
        threads joined until ``deadline`` (``time.monotonic()``; None: no limit). Returns the
        threads still running then (blocked in a read; left behind)."""
        with self._cond:
            self._gen += 1
            threads, self._threads = self._threads, []
            dropped = [job for _, _, job in self._heap]
            self._heap.clear()
            self._cond.notify_all()
        for job in dropped:  # never run: their downloads are being cancelled
            job.error = Cancelled()
            job.finish()
        left = []
        for t in threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                left.append(t)
        return left


class DownloadCounters:
    """Thread-safe counters; ``busy_s`` is wall time with at least one download running."""

    def __init__(self):
        self._lock = threading.Lock()
        self.bytes = 0
        self.files = 0
        self.retries = 0
        self.throttled = 0
        self.rebuilds = 0
        self.checksum_failures = 0
        self._active = 0
        self._busy_since = 0.0
        self._busy_s = 0.0

    def add_bytes(self, n: int) -> None:
        with self._lock:
            self.bytes += n

    def incr(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + n)

    def start(self) -> None:
        with self._lock:
            if self._active == 0:
                self._busy_since = time.monotonic()
            self._active += 1

    def stop(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0:
                self._busy_s += time.monotonic() - self._busy_since

    @property
    def busy_s(self) -> float:
        with self._lock:
            return self._busy_s + (time.monotonic() - self._busy_since if self._active else 0.0)

    def mbps(self) -> float:
        b = self.busy_s
        return self.bytes / b / 1e6 if b > 0 else 0.0


"""Download one file into place: hashed while it arrives, checked, renamed atomically.

Layers of fault handling, innermost first:

1. the transport's own request retries (pyarrow's ``AwsStandardS3RetryStrategy``);
2. here, per file: up to ``attempts`` attempts with exponential backoff and full jitter
   (``base * 2**k``, capped), resuming a partial file where the server allows it (S3 ranges,
   HTTP ``Range``; an HTTP 200 means start over);
3. throttling (503 SlowDown, 429) halves the downloads in flight (:class:`Concurrency`,
   AIMD) and adds one back after as many successes as there are slots;
4. refused / expired credentials: the transport's filesystem is rebuilt once (reloading
   credentials) and the attempt repeated; refused again is an error naming the URL;
5. a checksum mismatch is downloaded once more from scratch, then reported naming the file,
   its URL and both checksums; a deadline per file names the file.
"""
from __future__ import annotations

import http.client
import os
import random
import socket
import threading
import time
import urllib.error
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import xxhash

from ..errors import ChecksumMismatch, DownloadError, DownloadTimeout
from .url import FaultKind, Transport, classify

__all__ = ["Concurrency", "DownloadCounters", "Downloader", "RetryPolicy", "Cancelled"]

CHECKSUM_PREFIX = "xxh3_128:"


class Cancelled(Exception):
    """The cache is closing: the download stopped (not an error the user sees)."""


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 6           # per file, on top of the transport's request retries
    backoff_s: float = 0.5      # first pause; doubled each attempt
    backoff_max_s: float = 30.0
    timeout_s: float = 600.0    # per file: the deadline that names the file

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

    def acquire(self, stop: threading.Event | None = None) -> None:
        with self._cond:
            while self._active >= self.limit:
                if stop is not None and stop.is_set():
                    raise Cancelled()
                self._cond.wait(0.05)
            self._active += 1

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


_TRANSIENT_ERRORS = (OSError, http.client.HTTPException, urllib.error.URLError, socket.timeout, ValueError)


class _Truncated(OSError):
    pass


class _Mismatch(Exception):
    def __init__(self, actual: str):
        self.actual = actual


class Downloader:
    """Fetches files of one :class:`Transport` into local paths (see the module docstring)."""

    def __init__(self, transport: Transport, *, threads: int = 4, policy: RetryPolicy | None = None,
                 chunk_bytes: int = 16 << 20, stop: threading.Event | None = None,
                 counters: DownloadCounters | None = None, fsync: bool = True):
        self.transport = transport
        self.policy = policy or RetryPolicy()
        self.concurrency = Concurrency(threads)
        self.chunk = int(chunk_bytes)
        self.stop = stop or threading.Event()
        self.counters = counters or DownloadCounters()
        self.fsync = fsync

    def fetch(self, name: str, dest: Path, *, size: int, checksum: str | None, part: Path | None = None,
              label: str | None = None, deadline: float | None = None,
              on_progress: Callable[[int], None] | None = None) -> None:
        """Download ``name`` to ``dest`` (atomically: via ``part``, then ``os.replace``).

        ``size``/``checksum`` come from the manifest; ``label`` names the file in errors
        (default: ``name``). Raises :class:`DownloadError` (or a subclass) naming the file
        and URL, or :class:`Cancelled` when ``stop`` is set."""
        label = label or name
        url = self.transport.file_url(name)
        part = part or dest.with_name(f".{dest.name}.part")
        deadline = deadline if deadline is not None else time.monotonic() + self.policy.timeout_s
        attempt = 0
        mismatches = 0
        last: BaseException | None = None
        rebuilt_for: int | None = None
        while True:
            if self.stop.is_set():
                raise Cancelled()
            if time.monotonic() >= deadline:
                raise DownloadTimeout(
                    f"shard {label} was not downloaded within its deadline of {self.policy.timeout_s:g}s "
                    f"({attempt} attempt(s); last error: {_short(last)}) from {url}; check the network and "
                    "the server, or raise download_timeout", shard=label, url=url)
            generation = self.transport.generation
            self.concurrency.acquire(self.stop)
            self.counters.start()
            try:
                self._attempt(name, dest, part, size, checksum, deadline, on_progress)
            except _Mismatch as m:
                mismatches += 1
                self.counters.incr("checksum_failures")
                _unlink(part)
                if mismatches >= 2:
                    raise ChecksumMismatch(
                        f"shard {label} downloaded from {url} twice has checksum {m.actual}, but the manifest "
                        f"says {checksum}: the remote dataset changed (or is damaged) since its manifest was "
                        "written; convert or upload it again, then run `fastload verify` on the URL",
                        shard=label, url=url, expected=checksum, actual=m.actual) from None
                last = RuntimeError(f"checksum {m.actual} != {checksum}")
            except (Cancelled, DownloadError):
                raise
            except _TRANSIENT_ERRORS as e:
                last = e
                kind = classify(e)
                if kind == FaultKind.MISSING:
                    _unlink(part)
                    raise DownloadError(
                        f"shard {label} does not exist at {url} ({_short(e)}); the remote dataset is incomplete "
                        "or was moved: check the URL, or upload the dataset again (manifest last)",
                        shard=label, url=url) from None
                if kind == FaultKind.THROTTLE:
                    self.counters.incr("throttled")
                    self.concurrency.throttled()
                elif kind == FaultKind.AUTH:
                    if rebuilt_for is not None:
                        raise DownloadError(
                            f"credentials for {url} were refused ({_short(e)}), again after reloading them; "
                            "check the credentials (environment, credential files, role) for shard "
                            f"{label}", shard=label, url=url) from None
                    if self.transport.rebuild(generation):
                        self.counters.incr("rebuilds")
                        rebuilt_for = generation
                        continue  # at once: not a failed attempt
                    raise DownloadError(
                        f"credentials for {url} were refused ({_short(e)}) for shard {label}; the "
                        "filesystem= instance cannot reload them: pass a callable that builds the "
                        "filesystem, or fix the credentials", shard=label, url=url) from None
            else:
                self.concurrency.succeeded()
                return
            finally:
                self.counters.stop()
                self.concurrency.release()
            attempt += 1
            if attempt >= self.policy.attempts:
                raise DownloadError(
                    f"shard {label} could not be downloaded from {url} after {attempt} attempts "
                    f"(last error: {_short(last)}); check the network and the server, then run again "
                    "(what was downloaded is kept)", shard=label, url=url)
            self.counters.incr("retries")
            pause = min(self.policy.pause(attempt - 1), max(0.0, deadline - time.monotonic()))
            if self.stop.wait(pause):
                raise Cancelled()

    def _attempt(self, name: str, dest: Path, part: Path, size: int, checksum: str | None, deadline: float,
                 on_progress: Callable[[int], None] | None) -> None:
        h = xxhash.xxh3_128()
        have = part.stat().st_size if part.exists() else 0
        if have > size:
            _unlink(part)
            have = 0
        stream, start = self.transport.open_read(name, have)
        try:
            if start == 0 and have:
                have = 0  # the server cannot resume: start over
            mode = "r+b" if have else "wb"
            with open(part, mode) as out:
                if have:
                    # hash what is already there (page-cached: memory speed)
                    out.seek(0)
                    left = have
                    while left:
                        b = out.read(min(self.chunk, left))
                        if not b:
                            break
                        h.update(b)
                        left -= len(b)
                    out.seek(have)
                    out.truncate(have)
                pos = have
                while pos < size:
                    if self.stop.is_set():
                        raise Cancelled()
                    if time.monotonic() >= deadline:
                        raise socket.timeout("deadline reached mid-download")
                    b = stream.read(min(self.chunk, size - pos))
                    if not b:
                        break
                    out.write(b)
                    h.update(b)
                    n = len(b)
                    pos += n
                    self.counters.add_bytes(n)
                    if on_progress is not None:
                        on_progress(n)
                if pos == size:
                    extra = stream.read(1)
                    if extra:
                        raise _Mismatch(f"(more than the manifest's {size} bytes)")
                if self.fsync and pos == size:
                    out.flush()
                    os.fsync(out.fileno())
        finally:
            try:
                stream.close()
            except Exception:
                pass
        got = part.stat().st_size
        if got < size:
            raise _Truncated(f"body ended after {got} of {size} bytes")
        actual = CHECKSUM_PREFIX + h.hexdigest()
        if checksum is not None and actual != checksum:
            raise _Mismatch(actual)
        os.replace(part, dest)


def _unlink(p: Path) -> None:
    try:
        os.unlink(p)
    except FileNotFoundError:
        pass


def _short(e: BaseException | None) -> str:
    if e is None:
        return "none"
    s = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {s[:300]}" if s else type(e).__name__

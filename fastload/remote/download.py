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

Every call to the server runs where the deadline can leave it behind
(:mod:`fastload.remote.bounded`): the open (a HEAD) in a daemon thread, an http(s) body read
by a daemon pump, byte ranges in the range threads; so a server that stalls mid-transfer ends
the download at its deadline, and :meth:`Downloader.close` returns within its own deadline
(an http(s) stream's socket is shut down; a thread blocked in pyarrow's read is left behind).

The pacing shared by a process's downloads (:class:`RetryPolicy`, :class:`Concurrency`, the
range thread pool, :class:`DownloadCounters`, :class:`Cancelled`) lives in
:mod:`fastload.remote.pacing` and is re-exported here.
"""
from __future__ import annotations

import http.client
import os
import socket
import threading
import time
import urllib.error
from pathlib import Path
from typing import Callable

import xxhash

from ..errors import ChecksumMismatch, DownloadError, DownloadTimeout, HostUnreachable
from .bounded import StreamPump, call_within
from .pacing import Cancelled, Concurrency, DownloadCounters, RangePool, RetryPolicy
from .url import FaultKind, Transport, classify, unreachable_message

__all__ = ["Concurrency", "DownloadCounters", "Downloader", "RetryPolicy", "Cancelled"]

CHECKSUM_PREFIX = "xxh3_128:"


# the errors a retry may cure (what classify() sorts); anything else is a bug, raised at once
TRANSIENT_ERRORS = (OSError, http.client.HTTPException, urllib.error.URLError, socket.timeout, ValueError)


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
        # object stores: a shard bigger than one chunk comes as byte ranges fetched in
        # parallel, the most urgent shard's first (RangePool); http(s): one streamed GET
        self.ranges = RangePool(threads, self.concurrency, self.stop) if getattr(transport, "ranged", False) else None
        self._pumps: set[StreamPump] = set()  # http(s) bodies being read (aborted by close)
        self._pumps_lock = threading.Lock()
        self._finish_by: float | None = None  # once stopped: requests in flight may finish until then

    def finish_by(self, t: float) -> None:
        """Once ``stop`` is set, requests already in flight may still finish until ``t``
        (``time.monotonic()``): a healthy transfer completes (its bytes are not wasted); a
        stalled one ends then. Nothing new starts after ``stop``."""
        self._finish_by = float(t)

    def _cancelled(self) -> bool:
        return self.stop.is_set() and (self._finish_by is None or time.monotonic() >= self._finish_by)

    def close(self, deadline: float | None = None) -> list[threading.Thread]:
        """Cut the streams still in flight (``stop`` should be set first), join the range
        threads until ``deadline`` (default: ``policy.close_s`` from now; they start again
        with the next download). Returns the threads still blocked in a read of the server
        then (left behind: daemon threads whose download is over; they write nothing more)."""
        if deadline is None:
            deadline = time.monotonic() + self.policy.close_s
        with self._pumps_lock:
            pumps = list(self._pumps)
        for p in pumps:
            p.abort()
        return self.ranges.close(deadline) if self.ranges is not None else []

    def fetch(self, name: str, dest: Path, *, size: int, checksum: str | None, part: Path | None = None,
              label: str | None = None, deadline: float | None = None, priority: float = 0,
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
        ranged = self.ranges is not None  # object stores: byte ranges (the deadline holds while they run)
        done: set[int] = set()  # offsets of ranges already in the partial file (ranged path)
        while True:
            if self.stop.is_set():
                raise Cancelled()
            if time.monotonic() >= deadline:
                raise DownloadTimeout(
                    f"shard {label} was not downloaded within its deadline of {self.policy.timeout_s:g}s "
                    f"({attempt} attempt(s); last error: {_short(last)}) from {url}; check the network and "
                    "the server, or raise download_timeout= (fastload.Dataset / Loader)", shard=label, url=url)
            generation = self.transport.generation
            if not ranged and not self.concurrency.acquire(self.stop, deadline):  # (range threads: per request)
                continue  # the deadline passed while waiting for a slot: raised above
            self.counters.start()
            try:
                if ranged:
                    self._attempt_ranges(name, dest, part, size, checksum, priority, done, on_progress, deadline)
                else:
                    self._attempt(name, dest, part, size, checksum, deadline, on_progress)
            except _Mismatch as m:
                mismatches += 1
                self.counters.incr("checksum_failures")
                done.clear()
                if mismatches >= 2:
                    _unlink(part)  # the download is over: its room in a cache's budget is free again
                    raise ChecksumMismatch(
                        f"shard {label} downloaded from {url} twice has checksum {m.actual}, but the manifest "
                        f"says {checksum}: the remote dataset changed (or is damaged) since its manifest was "
                        "written; convert or upload it again, then run `fastload verify` on the URL",
                        shard=label, url=url, expected=checksum, actual=m.actual) from None
                # from scratch, in the same file: a cache counts the partial file as this
                # download's room in its budget (admitted once), so it must exist from the
                # admission to the rename; deleted, the room would go to another shard
                # during the pause, and the next attempt's bytes would come on top
                _truncate(part)
                last = RuntimeError(f"checksum {m.actual} != {checksum}")
            except (Cancelled, DownloadError):
                raise
            except TRANSIENT_ERRORS as e:
                last = e
                kind = classify(e)
                if kind == FaultKind.UNREACHABLE and not self.transport.reached:  # a wrong endpoint
                    msg = str(e) if isinstance(e, HostUnreachable) else unreachable_message(url, e)
                    raise DownloadError(f"shard {label} ({url}): {msg}", shard=label, url=url) from None
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
                    try:  # a new client: pyarrow's waits for the S3 requests in flight (bounded here)
                        again = call_within(lambda g=generation: self.transport.rebuild(g), deadline,
                                            what="reloading credentials", stop=self.stop)
                    except TimeoutError:
                        continue  # the deadline: raised at the loop's top
                    if again:
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
                if not ranged:
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

    def _attempt_ranges(self, name: str, dest: Path, part: Path, size: int, checksum: str | None, priority: float,
                        done: set[int], on_progress: Callable[[int], None] | None, deadline: float) -> None:
        """One attempt in byte ranges (object stores): open once (the size is checked against
        the manifest), fetch the ranges not yet in ``part`` in parallel into a preallocated
        file, then hash it whole (page-cached: memory speed) and rename it into place. The
        deadline holds while ranges run: past it the attempt ends at once (ranges still in a
        request write nothing more; the file and the remote stream close after the last)."""
        def open_file():
            f, _ = self.transport.open_read(name, 0)
            return f, f.size()

        f, remote_size = call_within(open_file, deadline, what=f"opening {name}",
                                     stop=self.stop, on_late=lambda r: r[0].close())
        shared = _Shared(f)
        try:
            if remote_size != size:
                raise _Mismatch(f"(an object of {remote_size} bytes, the manifest says {size})")
            if not done or not part.exists():
                done.clear()
                with open(part, "wb") as out:
                    out.truncate(size)
            shared.fd = os.open(part, os.O_WRONLY)

            def get(o: int, n: int) -> None:
                if shared.cancelled:
                    raise Cancelled()
                b = f.read_at(n, o)
                if len(b) != n:
                    raise _Truncated(f"range at {o}: {len(b)} of {n} bytes")
                with shared.lock:
                    if shared.cancelled:
                        raise Cancelled()
                    os.pwrite(shared.fd, memoryview(b), o)
                done.add(o)
                self.counters.add_bytes(n)
                if on_progress is not None:
                    on_progress(n)

            offsets = [o for o in range(0, size, self.chunk) if o not in done]
            shared.users += len(offsets)
            jobs = [self.ranges.submit((priority, o), lambda o=o: get(o, min(self.chunk, size - o)), shared.release)
                    for o in offsets]
            error = None
            for job in jobs:
                while not job.done.wait(0.05):
                    if self._cancelled():
                        raise Cancelled()
                    if time.monotonic() >= deadline:
                        raise TimeoutError("deadline reached while byte ranges were being fetched")
                if job.error is not None and (error is None or isinstance(error, Cancelled)):
                    error = job.error
            if error is not None:
                raise error
            if self.fsync:
                os.fsync(shared.fd)
        finally:
            with shared.lock:
                shared.cancelled = True
            shared.release()
        actual = file_checksum_of(part)
        if checksum is not None and actual != checksum:
            raise _Mismatch(actual)
        os.replace(part, dest)

    def _attempt(self, name: str, dest: Path, part: Path, size: int, checksum: str | None, deadline: float,
                 on_progress: Callable[[int], None] | None) -> None:
        h = xxhash.xxh3_128()
        have = part.stat().st_size if part.exists() else 0
        if have > size:
            have = 0  # start over ("wb" below empties it; kept: it is the download's room, see fetch)
        # the stream is opened and read by a pump thread: every wait for the server ends at
        # the deadline (or when the cache stops), whatever the client's own timeouts are
        pump = StreamPump(lambda: self.transport.open_read(name, have), size=size, block=self.chunk, depth=2,
                          deadline=deadline, cancelled=self._cancelled, what=f"reading {name}")
        with self._pumps_lock:
            self._pumps.add(pump)
        try:
            start = pump.opened()
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
                while True:
                    if self._cancelled():
                        raise Cancelled()
                    b = pump.read()
                    if not b:
                        break
                    if pos + len(b) > size:
                        raise _Mismatch(f"(more than the manifest's {size} bytes)")
                    out.write(b)
                    h.update(b)
                    n = len(b)
                    pos += n
                    self.counters.add_bytes(n)
                    if on_progress is not None:
                        on_progress(n)
                if self.fsync and pos == size:
                    out.flush()
                    os.fsync(out.fileno())
        finally:
            pump.abort()  # the pump closes the stream (at once, unless a read of it is blocked)
            with self._pumps_lock:
                self._pumps.discard(pump)
        got = part.stat().st_size
        if got < size:
            raise _Truncated(f"body ended after {got} of {size} bytes")
        actual = CHECKSUM_PREFIX + h.hexdigest()
        if checksum is not None and actual != checksum:
            raise _Mismatch(actual)
        os.replace(part, dest)


class _Shared:
    """What one ranged attempt's jobs share: the remote file and the partial file's
    descriptor, closed by the last of the attempt and its jobs to finish (a job stalled in a
    request may outlive an attempt that gave up)."""

    def __init__(self, remote_file):
        self.remote = remote_file
        self.fd: int | None = None
        self.users = 1  # the attempt itself, plus one per submitted job
        self.cancelled = False
        self.lock = threading.Lock()

    def release(self) -> None:
        with self.lock:
            self.users -= 1
            last = self.users == 0
        if last:
            if self.fd is not None:
                os.close(self.fd)
            try:
                self.remote.close()
            except Exception:
                pass


def file_checksum_of(path: Path, chunk: int = 8 << 20) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return CHECKSUM_PREFIX + h.hexdigest()


def _truncate(p: Path) -> None:
    try:
        os.truncate(p, 0)
    except FileNotFoundError:
        pass


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

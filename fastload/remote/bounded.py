"""Blocking calls to a server, bounded by the caller's deadline.

A client's own timeouts (pyarrow's request timeout times its request retries, a socket
timeout per ``recv``) bound one request, not the deadline of whoever waits for it, and a
thread blocked in a socket read cannot be interrupted from Python. So every call to a server
made while someone waits (open a file, read a byte range, read the manifest, read the next
block of a stream) goes through here:

* :func:`call_within`: ``fn()`` runs in a daemon thread; the caller waits at most until its
  deadline (or until ``stop`` is set), then goes on without it (``socket.timeout`` /
  :class:`~fastload.remote.pacing.Cancelled`). A call left behind that returns later hands
  its result to ``on_late`` (e.g. to close a file it opened) and touches nothing else.
* :class:`StreamPump`: a stream opened and read by a daemon thread into a short queue; the
  download reading it waits for each block at most until its deadline. On give-up the stream
  is aborted (``abort()``: an HTTP stream shuts its socket down, so the blocked read returns
  at once) and the pump closes it when its read returns.

Threads left behind are daemon threads named ``fastload-io-*``: they end when their call
returns (at the latest when the client's own timeouts end it) and write nothing anywhere.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable

from .pacing import Cancelled

__all__ = ["StreamPump", "call_within"]

_POLL_S = 0.05  # how often a waiting caller looks at its stop event


def _wait(done: threading.Event, deadline: float, stop: threading.Event | None) -> str | None:
    """Wait for ``done``; 'stop' or 'deadline' when the wait ended otherwise."""
    while True:
        left = deadline - time.monotonic()
        if done.wait(max(0.0, min(_POLL_S, left))):
            return None
        if stop is not None and stop.is_set():
            return "stop"
        if time.monotonic() >= deadline:
            return "deadline"


def call_within(fn: Callable[[], Any], deadline: float, *, what: str, stop: threading.Event | None = None,
                on_late: Callable[[Any], None] | None = None) -> Any:
    """``fn()``'s result (or its exception), waited for until ``deadline`` (``time.monotonic()``
    time) at most: past it ``socket.timeout`` naming ``what``; :class:`Cancelled` once ``stop``
    is set. A call still running then is left behind (see the module docstring)."""
    done = threading.Event()
    lock = threading.Lock()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            r = fn()
        except BaseException as e:  # handed to the caller (or dropped if it left)
            with lock:
                box["error"] = e
        else:
            with lock:
                late = box.get("gone", False)
                if not late:
                    box["result"] = r
            if late and on_late is not None:
                try:
                    on_late(r)
                except Exception:
                    pass
        finally:
            done.set()

    t = threading.Thread(target=run, name="fastload-io-call", daemon=True)
    t.start()
    why = _wait(done, deadline, stop)
    with lock:
        if "result" in box:
            return box["result"]
        if "error" in box:
            raise box["error"]
        box["gone"] = True  # too late now: a result arriving after this goes to on_late
    if why == "stop":
        raise Cancelled()
    raise TimeoutError(f"{what}: no answer by the deadline (the request was left behind)")


class StreamPump:
    """Open a stream and read it in a daemon thread (see the module docstring).

    ``open_fn() -> (stream, start)`` (a transport's ``open_read``); the pump then reads up to
    ``size - start + 1`` bytes (one more than the file should have, to see a longer file) in
    blocks of ``block`` bytes. :meth:`opened` returns ``start``; :meth:`read` the next block
    (``b""`` at the end of the stream); both raise what the stream raised,
    ``socket.timeout`` at the deadline, or :class:`Cancelled` once ``cancelled()`` is true."""

    def __init__(self, open_fn: Callable[[], tuple[Any, int]], *, size: int, block: int, deadline: float,
                 cancelled: Callable[[], bool] | None, what: str, depth: int = 4):
        self._q: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._deadline, self._cancelled, self._what = deadline, cancelled, what
        self._aborted = threading.Event()
        self._lock = threading.Lock()
        self._stream: Any = None
        self._t = threading.Thread(target=self._run, args=(open_fn, int(size), max(1, int(block))),
                                   name="fastload-io-stream", daemon=True)
        self._t.start()

    # -- the pump's thread -----------------------------------------------------------------
    def _put(self, item) -> bool:
        while not self._aborted.is_set():
            try:
                self._q.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, open_fn, size: int, block: int) -> None:
        stream = None
        try:
            stream, start = open_fn()
            with self._lock:
                self._stream = stream
            if self._aborted.is_set() or not self._put(("open", start)):
                return
            want, got = size - start + 1, 0
            read = getattr(stream, "read1", None) or stream.read  # read1: what has arrived, now
            while got < want and not self._aborted.is_set():
                b = read(min(block, want - got))
                if not self._put(("data", b)) or not b:
                    return
                got += len(b)
            self._put(("data", b""))
        except BaseException as e:  # handed to the reader
            self._put(("error", e))
        finally:
            with self._lock:
                self._stream = None
            if stream is not None:
                try:
                    stream.close()
                except Exception:
                    pass

    # -- the reader's side -----------------------------------------------------------------
    def _get(self):
        while True:
            if self._cancelled is not None and self._cancelled():
                raise Cancelled()
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self._what}: no data by the deadline (the transfer was left behind)")
            try:
                kind, v = self._q.get(timeout=min(_POLL_S, left))
            except queue.Empty:
                continue
            if kind == "error":
                raise v
            return kind, v

    def opened(self) -> int:
        kind, v = self._get()
        assert kind == "open", kind
        return v

    def read(self) -> bytes:
        kind, v = self._get()
        assert kind == "data", kind
        return v

    def abort(self) -> None:
        """Stop pumping: a read blocked in the stream is cut short where the stream can
        (``abort()``); the pump's thread closes the stream when its read returns."""
        self._aborted.set()
        with self._lock:
            stream = self._stream
        cut = getattr(stream, "abort", None)
        if cut is not None:
            try:
                cut()
            except Exception:
                pass

    @property
    def alive(self) -> bool:
        return self._t.is_alive()

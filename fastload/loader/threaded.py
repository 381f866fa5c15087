"""ThreadedSource: another source's ``get()`` run in a fastload thread, off the training loop.

A Loader with a ``batch_transform`` (or ``device_transform``) wraps its epoch's source in
this: one thread named ``fastload-transform`` takes each ready batch from the inner source
(which finishes it on the host — ragged forms, lists, the user's transform — and, on CUDA,
copies it to the device), in order, while the training loop runs its step; ``get()`` only
dequeues. Errors (a transform's ``TransformError``, a ``DecodeError``) are handed over in
order, for the very batch that caused them.

The transform is Python: it holds the GIL while it runs, so it competes with the training
loop's own Python for one core (numpy and torch operations release the GIL and overlap).
Per-sample image work belongs in a DALI graph (``fastload.vision.custom``), which runs in
C++ threads on the GPU or CPU.

A transform that never returns never blocks ``close()``: it waits at most
``CLOSE_TIMEOUT_S`` (10 s) for the batch the thread is on, then logs a warning naming the
transform, the batch and the line it is stuck at, and goes on without the thread. The thread
is a daemon: an abandoned one never keeps the interpreter from exiting, and the batch it holds
keeps its ring slot (ring slots outlive the ring while viewed). ``get()`` warns once per batch
when it has waited ``WAIT_WARN_S`` for one, naming the same.

On CUDA, ``handoff`` orders the consumer's stream after the worker's: an event recorded in
the worker (``handoff.record()``), waited on by the consumer (``handoff.wait(batch, ev)``);
and the thread selects the loader's device and a stream of fastload's own (``handoff.start()``)
before it runs anything, so a transform that touches CUDA works on the loader's GPU, opens no
context on cuda:0 and queues nothing on the training stream.
"""
from __future__ import annotations

import collections
import logging
import os
import queue
import sys
import threading
import time
from typing import Sequence

from ..sampling.packing import Request
from .source import Ready

__all__ = ["CLOSE_TIMEOUT_S", "WAIT_WARN_S", "ThreadedSource", "stuck_at"]

logger = logging.getLogger("fastload")

CLOSE_TIMEOUT_S = 10.0  # close() waits at most this long for the batch the transform thread is on
WAIT_WARN_S = 60.0  # get() warns when a batch has taken this long (a transform that never returns?)

_FASTLOAD_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_THREADING = os.path.abspath(threading.__file__)


def stuck_at(thread: threading.Thread) -> str:
    """Where ``thread`` is now, for a message: the user's function that fastload called (the
    outermost frame outside fastload whose caller is fastload) at its current line, and the
    innermost frame when that is elsewhere; "" when unknown (not CPython)."""
    frames = getattr(sys, "_current_frames", None)
    frame = frames().get(thread.ident) if frames is not None and thread.ident is not None else None
    if frame is None:
        return ""

    def ours(f) -> bool:
        path = os.path.abspath(f.f_code.co_filename)
        return path.startswith(_FASTLOAD_DIR + os.sep) or path == _THREADING

    def where(f) -> str:
        return f"{f.f_code.co_name} ({f.f_code.co_filename}:{f.f_lineno})"

    inner, entry, f = frame, None, frame
    while f is not None:
        if not ours(f) and (f.f_back is None or ours(f.f_back)):
            entry = f
            break
        f = f.f_back
    if entry is None:
        return where(inner)
    return where(entry) if entry is inner else f"{where(entry)}, in {where(inner)}"


class ThreadedSource:
    def __init__(self, inner, *, handoff=None) -> None:
        self._inner = inner
        self.amortize = inner.amortize
        self._handoff = handoff
        self._todo = threading.Semaphore(0)  # one release per batch put
        self._out: queue.Queue = queue.Queue()  # (Ready, event) or the batch's exception, in order
        self._stop = threading.Event()
        self._closed = False
        self._requests: collections.deque = collections.deque()  # put, not yet started by the thread
        self._busy: tuple[Request | None, float] | None = None  # the batch the thread is on, since when
        self._thread = threading.Thread(target=self._run, name="fastload-transform", daemon=True)
        self._thread.start()

    def put(self, batches: Sequence[Request]) -> None:
        self._inner.put(batches)
        self._requests.extend(batches)
        for _ in batches:
            self._todo.release()

    def _run(self) -> None:
        if self._handoff is not None:
            try:
                self._handoff.start()  # first: the loader's GPU, on a stream of fastload's own
            except BaseException as e:  # pragma: no cover - a device that vanished
                self._out.put(e)
                return
        while True:
            self._todo.acquire()
            if self._stop.is_set():
                return
            try:
                self._busy = (self._requests.popleft() if self._requests else None, time.monotonic())
                ready = self._inner.get()
                item = (ready, self._handoff.record() if self._handoff is not None else None)
            except BaseException as e:  # raised by get() for this very batch
                item = e
            finally:
                self._busy = None
            if self._stop.is_set():
                return
            self._out.put(item)

    def _describe_stuck(self) -> str:
        """What the thread is on: the transforms, the batch, for how long, the line it is at."""
        busy = self._busy
        names = " / ".join(getattr(self._inner, "transforms", None) or ["the batch transform"])
        what = f"{names} (thread {self._thread.name!r}"
        at = stuck_at(self._thread)
        what += f", at {at})" if at else ")"
        if busy is not None:
            req, since = busy
            what += f" has been running for {time.monotonic() - since:.1f} s"
            if req is not None:
                what += (f" on the batch at stream position {req.position} (samples "
                         f"{', '.join(map(str, req.index[:8].tolist()))}{', ...' if len(req.index) > 8 else ''})")
        else:
            what += " has not finished its batch"
        return what

    def get(self) -> Ready:
        t0 = time.monotonic()
        warned = False
        while True:
            try:
                item = self._out.get(timeout=0.1)
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError("fastload transform thread stopped unexpectedly") from None
                if not warned and time.monotonic() - t0 > WAIT_WARN_S:
                    warned = True
                    logger.warning("fastload: the training loop has waited %.0f s for a batch: %s; still waiting "
                                   "(Ctrl-C stops it)", time.monotonic() - t0, self._describe_stuck())
                continue
            if isinstance(item, BaseException):
                raise item
            ready, ev = item
            if self._handoff is not None:
                self._handoff.wait(ready.batch, ev)
            return ready

    def _drop_finished(self) -> None:
        while True:
            try:
                self._out.get_nowait()
            except queue.Empty:
                return

    def close(self) -> None:
        """Stop the thread (it finishes the batch it is on; finished batches are dropped so
        their ring slots come free), then close the inner source. Idempotent. Waits at most
        ``CLOSE_TIMEOUT_S`` for the thread: a transform that does not return by then is left
        running (a daemon thread, see the module docstring) with a warning naming it."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._todo.release()
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        while self._thread.is_alive():
            self._drop_finished()
            self._thread.join(timeout=0.05)
            if self._thread.is_alive() and time.monotonic() > deadline:
                logger.warning("fastload: closing the Loader's pass without its transform thread: %s, and did not "
                               "return within %.0f s; it is left running as a daemon thread (it does not keep the "
                               "process from exiting). A transform must return for every batch",
                               self._describe_stuck(), CLOSE_TIMEOUT_S)
                break
        self._drop_finished()
        self._inner.close()

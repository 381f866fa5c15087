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

On CUDA, ``handoff`` orders the consumer's stream after the worker's: an event recorded in
the worker (``handoff.record()``), waited on by the consumer (``handoff.wait(batch, ev)``);
and the thread selects the loader's device (``handoff.device``) before it runs anything, so
a transform that touches CUDA works on the loader's GPU and opens no context on cuda:0.
"""
from __future__ import annotations

import queue
import threading
from typing import Sequence

from ..packing import Request
from .source import Ready

__all__ = ["ThreadedSource"]


class ThreadedSource:
    def __init__(self, inner, *, handoff=None) -> None:
        self._inner = inner
        self.amortize = inner.amortize
        self._handoff = handoff
        self._todo = threading.Semaphore(0)  # one release per batch put
        self._out: queue.Queue = queue.Queue()  # (Ready, event) or the batch's exception, in order
        self._stop = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="fastload-transform", daemon=True)
        self._thread.start()

    def put(self, batches: Sequence[Request]) -> None:
        self._inner.put(batches)
        for _ in batches:
            self._todo.release()

    def _run(self) -> None:
        if self._handoff is not None:
            from ..device import select

            try:
                select(self._handoff.device)  # first: the user's transforms run on the loader's GPU
            except BaseException as e:  # pragma: no cover - a device that vanished
                self._out.put(e)
                return
        while True:
            self._todo.acquire()
            if self._stop.is_set():
                return
            try:
                ready = self._inner.get()
                item = (ready, self._handoff.record() if self._handoff is not None else None)
            except BaseException as e:  # raised by get() for this very batch
                item = e
            if self._stop.is_set():
                return
            self._out.put(item)

    def get(self) -> Ready:
        while True:
            try:
                item = self._out.get(timeout=0.1)
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError("fastload transform thread stopped unexpectedly") from None
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
        their ring slots come free), then close the inner source. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._todo.release()
        while self._thread.is_alive():
            self._drop_finished()
            self._thread.join(timeout=0.05)
        self._drop_finished()
        self._inner.close()

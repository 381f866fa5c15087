"""HostSource: ready batches in host memory, zero-copy views of the ring's slots.

Raw fields (tensors, scalars) and ``"index"`` are gathered by the ring's C++ threads
straight into a slot. With image fields, ``HostImageFeeder`` threads fill the slots instead:
under a lock a worker takes the next batch and acquires the next ring slot (so slots are
acquired in request order), then gathers the raw fields into it, lets DALI write each image
field into it and commits it. Two workers, each with its own DALI pipelines, take batches in
turn: while one worker's Python glue runs (views, crop parameters), the other's DALI threads
keep the cores busy (bench/bench_jpeg.py: +~10%).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Sequence

import numpy as np

from .decode import Decoders, decode_fields, runner_decoder
from .source import INDEX, Ready, RingFedSource

__all__ = ["HostImageFeeder", "HostSource"]

logger = logging.getLogger("fastload")

class HostSource(RingFedSource):
    """See the module docstring. ``ring`` has every raw field (with sources), every image
    field's output (filled by the feeder) and the ``"index"`` field."""

    def __init__(self, *, ring, dataset, image_fields: Sequence[str], decoders: Decoders | None, epoch: int,
                 on_error: str, stats, finish=None, workers: int = 2, prepare=None) -> None:
        super().__init__(ring, dataset, HostImageFeeder(
            ring=ring, dataset=dataset, image_fields=image_fields, decoders=decoders, epoch=epoch,
            on_error=on_error, stats=stats, workers=workers) if image_fields else None, prepare)
        self._finish = None if finish is None or finish.trivial else finish

    def get(self) -> Ready:
        req = self.next_request()
        if self._feeder is not None:
            self._feeder.wait_acquired()  # so that the ring has this batch pending
        batch = self._ring.get()
        index = batch[INDEX].numpy()
        if self._finish is not None:
            batch = self._finish(batch, req)  # ragged forms, lists, mixture source, transforms
        return Ready(batch, index)


class HostImageFeeder:
    """Threads that decode the image fields of each batch into its ring slot, in order."""

    def __init__(self, *, ring, dataset, image_fields: Sequence[str], decoders: Decoders, epoch: int,
                 on_error: str, stats, workers: int) -> None:
        self._ring = ring
        self._dataset = dataset
        self._image_fields = list(image_fields)
        self._epoch = epoch
        self._on_error = on_error
        self._stats = stats
        self._inbox: queue.Queue = queue.Queue()
        self._acquired: queue.Queue = queue.Queue()  # None per slot acquired, or the error
        self._stop = threading.Event()
        self._take_lock = threading.Lock()
        self._runners = [decoders.for_worker(self._image_fields, k) for k in range(workers)]
        self._threads = [threading.Thread(target=self._run, args=(k,), name=f"fastload-feeder-{k}", daemon=True)
                         for k in range(workers)]
        for t in self._threads:
            t.start()

    def put(self, idx: np.ndarray) -> None:
        self._inbox.put(idx)

    def wait_acquired(self) -> None:
        """Wait until a worker holds the next batch's slot (or raise why it could not)."""
        while True:
            try:
                item = self._acquired.get(timeout=0.1)
            except queue.Empty:
                if not any(t.is_alive() for t in self._threads):
                    raise RuntimeError("fastload feeder thread stopped unexpectedly") from None
                continue
            if isinstance(item, BaseException):
                raise item
            return

    # -- the workers -------------------------------------------------------------------------
    def _take(self):
        """(indices, slot) of the next batch, slots acquired in order; None when stopping."""
        with self._take_lock:
            while True:
                if self._stop.is_set():
                    return None
                try:
                    idx = self._inbox.get(timeout=0.1)
                except queue.Empty:
                    continue
                if idx is None:
                    self._inbox.put(None)  # let the other workers see it too
                    return None
                try:
                    slot = self._ring.acquire()
                except BaseException as e:  # the ring is closing: no slot for this batch
                    self._acquired.put(e)
                    return None
                self._acquired.put(None)
                return idx, slot

    def _run(self, worker: int) -> None:
        runners = self._runners[worker]
        while True:
            job = self._take()
            if job is None:
                return
            idx, slot = job
            try:
                self._fill(slot, idx, runners)
            except BaseException as e:  # the consumer raises it for this very batch
                slot.fail(e)

    def _fill(self, slot, idx: np.ndarray, runners: dict) -> None:
        ds = self._dataset
        n = len(idx)
        slot.gather(*ds.locate(idx), index=idx)  # raw fields + index (timed by the ring)
        tensors = slot.tensors
        decoders = {name: runner_decoder(runners[name], ds, name, self._epoch, tensors[name][:n], self._stats)
                    for name in self._image_fields}
        _, final, replaced = decode_fields(decoders, idx, num_samples=len(ds), on_error=self._on_error,
                                           describe=ds.describe)
        if replaced:
            self._stats.add("replaced_samples", replaced)
            slot.gather(*ds.locate(final), index=final)  # replaced samples: their raw fields too
        slot.commit(n)

    def close(self) -> None:
        self._stop.set()
        self._inbox.put(None)
        # A worker may be blocked in ring.acquire() waiting for a free slot: keep draining
        # the ring until every worker has seen the stop flag and returned.
        deadline = time.monotonic() + 30
        while any(t.is_alive() for t in self._threads):
            self._ring.drain()
            for t in self._threads:
                t.join(timeout=0.01)
            if time.monotonic() > deadline:  # pragma: no cover - only if DALI hangs
                logger.warning("fastload: feeder threads did not stop within 30 s")
                break

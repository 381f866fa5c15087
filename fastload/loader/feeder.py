"""ImageFeeder: worker threads that decode each batch's image fields, in request order.

The one protocol of both deliveries. A feeder belongs to the Loader's machinery and serves pass
after pass: each batch is put with its epoch (the crops are a function of seed, epoch and
sample), so the next pass's first batches can follow this pass's last ones in the same queue
(the Loader's look-ahead, epoch.py); a pass ended early closes it, and the next gets a new
one. Under a lock a worker takes the next batch's indices and acquires the next ring slot,
so slots are acquired in request order; then, outside the lock, it decodes every image field
through its own DALI runners (replacing undecodable samples per the policy in
``decode.py``), gathers the raw fields and the final indices into the slot, hands the
decoded images over by the slot's sequence number and commits the slot. The consumer waits
for the next slot to be acquired (``wait_acquired``: the ring then has that batch pending),
takes it from the ring, and picks up its images (``take``).

On the host, the presets' images are written into the slot itself (the ring has a field for
each: DALI decodes, torch finishes each image there, host_tail.py), so they travel with the
raw fields under the ring's lifetime rule. Other images are DALI's own output buffers:
zero-copy torch tensors on the host (DLPack, DALI's dynamic executor never reuses a buffer
while it is referenced), CUDA tensors made on each runner's copy stream on a GPU, with the
events a consumer's stream must wait on. Two workers, each with its own pipelines, take
batches in turn: while one worker's Python glue runs (views, crop parameters), the other's
DALI threads keep the cores busy.

Feeder threads run at the loader's thread priority (``system.lower_priority``), and so do
the DALI threads they start: a training step's own threads win a contended core. Their torch
operators run on the feeder's own thread only (``host_tail.one_torch_thread``).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Sequence

import numpy as np

from ..runtime.system import IMAGE_FEEDERS, lower_priority
from ..pipeline.host_tail import one_torch_thread
from .decode import Decoders, decode_fields, runner_decoder

__all__ = ["ImageFeeder"]

logger = logging.getLogger("fastload")


class ImageFeeder:
    """See the module docstring. ``device``: a CUDA ``torch.device`` (each worker selects it
    first, so every CUDA call of the thread goes to the loader's GPU), or None on the host."""

    def __init__(self, *, ring, dataset, image_fields: Sequence[str], decoders: Decoders,
                 on_error: str, stats, workers: int = IMAGE_FEEDERS, device=None, ensure=None) -> None:
        self._ring = ring
        self._ensure = ensure  # installs a replacement's shard in the ring (LocalShards.ensure), or None
        self._dataset = dataset
        self._device = device
        self._image_fields = list(image_fields)
        self._on_error = on_error
        self._stats = stats
        self._inbox: queue.Queue = queue.Queue()
        self._acquired: queue.Queue = queue.Queue()  # the seq of each slot acquired, or the error
        self._done: dict[int, tuple[dict, tuple, int]] = {}  # slot seq -> (images, ready events, replaced)
        self._done_lock = threading.Lock()
        self._stop = threading.Event()
        self.closed = False
        self._take_lock = threading.Lock()
        self._known_bad = decoders.known_bad
        self._runners = [decoders.for_worker(self._image_fields, k) for k in range(workers)]
        name = "fastload-feeder" + ("-cuda" if device is not None else "")
        self._threads = [threading.Thread(target=self._run, args=(k,), name=f"{name}-{k}", daemon=True)
                         for k in range(workers)]
        for t in self._threads:
            t.start()

    def put(self, idx: np.ndarray, epoch: int) -> None:
        """Decode this batch of ``epoch`` after every batch put before (of any epoch)."""
        self._inbox.put((idx, epoch))

    def wait_acquired(self) -> int:
        """Wait until a worker holds the next batch's slot (or raise why it could not); the
        slot's sequence number (the ring hands batches out in this order)."""
        while True:
            try:
                item = self._acquired.get(timeout=0.1)
            except queue.Empty:
                if not any(t.is_alive() for t in self._threads):
                    raise RuntimeError("fastload feeder threads stopped unexpectedly") from None
                continue
            if isinstance(item, BaseException):
                raise item
            return item

    def take(self, seq: int) -> tuple[dict[str, Any], tuple]:
        """The images and ready events of batch ``seq``, just taken from the ring (a worker
        hands them over before it commits the slot)."""
        with self._done_lock:
            images, events, replaced = self._done.pop(seq)
        if replaced:  # counted in the pass that delivers the batch (it may be decoded in the one before)
            self._stats.add("replaced_samples", replaced)
        return images, events

    # -- the workers -------------------------------------------------------------------------
    def _take(self):
        """(indices, epoch, slot) of the next batch, slots acquired in order; None when stopping."""
        with self._take_lock:
            while True:
                if self._stop.is_set():
                    return None
                try:
                    job = self._inbox.get(timeout=0.1)
                except queue.Empty:
                    continue
                if job is None:
                    self._inbox.put(None)  # let the other workers see it too
                    return None
                try:
                    slot = self._ring.acquire()
                except BaseException as e:  # the ring is closing: no slot for this batch
                    self._acquired.put(e)
                    return None
                self._acquired.put(slot.seq)
                return job + (slot,)

    def _run(self, worker: int) -> None:
        try:
            lower_priority()  # before DALI starts its threads: they inherit it
            one_torch_thread()  # host_tail.py's torch work here runs on this thread alone
            if self._device is not None:
                from ..runtime.device import select

                select(self._device)  # first: every CUDA call of this thread goes to the loader's GPU
        except BaseException as e:  # pragma: no cover - a device that vanished
            self._acquired.put(e)
            return
        runners = self._runners[worker]
        while True:
            job = self._take()
            if job is None:
                return
            idx, epoch, slot = job
            try:
                self._fill(slot, idx, epoch, runners)
            except BaseException as e:  # the consumer raises it for this very batch
                slot.fail(e)

    def _fill(self, slot, idx: np.ndarray, epoch: int, runners: dict) -> None:
        import torch

        ds = self._dataset
        # image fields the ring has room for (finished in torch on the host) are decoded into the slot
        arrays = slot.arrays
        into: dict[str, Any] = {}
        for name in self._image_fields:
            outputs = getattr(runners[name].transform, "outputs", None)  # a sample transform's, by output
            if outputs is not None:
                into[name] = {k: torch.from_numpy(arrays[k][:len(idx)]) for k in outputs if k in arrays}
            elif name in arrays:
                into[name] = torch.from_numpy(arrays[name][:len(idx)])
        decoders = {name: runner_decoder(runners[name], ds, name, epoch, into.get(name), self._stats)
                    for name in self._image_fields}
        images, final, replaced = decode_fields(decoders, idx, num_samples=len(ds), on_error=self._on_error,
                                                describe=ds.describe, known_bad=self._known_bad)
        for name in into:  # in the slot: delivered with the raw fields
            got = images.pop(name)
            if isinstance(got, dict):  # the other outputs of a sample transform go with the images
                images.update({k: v for k, v in got.items() if k not in into[name]})
        for name in [n for n, v in images.items() if isinstance(v, dict)]:
            images.update(images.pop(name))
        del into, arrays
        # on a GPU each field's last run produced its tensor: its runner's ready event covers it
        events = tuple(ev for ev in (getattr(runners[n], "ready_event", None) for n in self._image_fields)
                       if ev is not None)
        if self._ensure is not None and replaced:  # a replacement may lie in a shard the batch did not need
            self._ensure(final)
        slot.gather(*ds.locate(final), index=final)  # raw fields + the indices delivered
        with self._done_lock:
            self._done[slot.seq] = (images, events, replaced)
        slot.commit(len(idx))

    def close(self) -> bool:
        """Stop the workers and drop every batch they were asked for (the ring is drained
        while they stop). Idempotent: True when this call closed it."""
        if self.closed:
            return False
        self.closed = True
        self._stop.set()
        self._inbox.put(None)
        # A worker may be blocked in ring.acquire() waiting for a free slot: keep draining
        # the ring until every worker has seen the stop flag and returned.
        deadline = time.monotonic() + 30
        while any(t.is_alive() for t in self._threads):
            self._ring.drain(timeout=0.1, warn=False)  # bounded: the deadline below is checked
            for t in self._threads:
                t.join(timeout=0.01)
            if time.monotonic() > deadline:  # pragma: no cover - only if DALI hangs
                from .threaded import stuck_at

                stuck = "; ".join(f"{t.name} at {stuck_at(t) or 'an unknown place'}"
                                  for t in self._threads if t.is_alive())
                logger.warning("fastload: feeder threads did not stop within 30 s (%s); they are left running as "
                               "daemon threads (they do not keep the process from exiting)", stuck)
                break
        with self._done_lock:
            self._done.clear()
        return True

"""CudaSource: ready batches on a CUDA device.

Raw fields and ``"index"`` are gathered into a ring slot exactly as on the host, then copied
to the device by ``CudaDelivery``: every slot page-locked when the delivery is made
(``cudaHostRegister`` through ``torch.cuda.cudart()``), a ``non_blocking`` copy on a side
stream, the consumer's stream waiting for that stream, ``record_stream`` on the outputs, and
the slot's host tensors (its lease) held until the copy's event has completed — so a slot is
never refilled while the GPU still reads it. Image fields are decoded by DALI on the GPU
(``mixed`` decoder) by the ``ImageFeeder`` (``feeder.py``, shared with the host): two workers, each with its own DALI pipelines,
so one batch is decoded while the other's is copied out; a worker fills the batch's ring
slot (raw fields and final indices) and hands its image tensors over with the runners'
ready events, which the consumer's stream waits on. Nothing is waited for on the host per
batch.

One CUDA context per rank: the workers select the loader's device before anything else, and
the consumer side wraps its CUDA calls in a device guard (``fastload.runtime.device``), so no call
lands on cuda:0 from a thread whose current device is still 0.

Everything else (the sampler's plan, the ring, the bad-image policy, stats) is shared with
the host path; this file holds only what differs on a GPU.
"""
from __future__ import annotations

import collections
import logging
import time
from typing import Any

import numpy as np

from ..runtime.device import clear_cuda_error, guard, private_stream, release_stream, select
from .feeder import ImageFeeder
from .source import INDEX, Ready, RingFedSource

__all__ = ["CudaDelivery", "CudaSource", "StreamHandoff"]

logger = logging.getLogger("fastload")

_CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context


class CudaDelivery:
    """Host ring batches -> device tensors (see the module docstring). Every slot the ring
    has is page-locked here, at creation; a slot the ring grows later (only while the
    training loop holds batches) is page-locked when first delivered. If page-locking fails
    (``ulimit -l``, little free memory), the delivery warns and copies from pageable memory."""

    def __init__(self, ring, device) -> None:
        import torch

        self._torch = torch
        self._ring = ring
        self._device = device
        self._pin = True  # False after a failed registration: pageable copies from then on
        self._pinned: dict[int, tuple[int, np.ndarray]] = {}
        self._inflight: collections.deque = collections.deque()
        self.copy_s = 0.0  # host time issuing device copies (asynchronous, so a lower bound)
        with guard(device):
            self._stream = private_stream(device)  # not one of torch's pooled streams (the user's, maybe)
            try:
                for slot in range(ring.num_slots):
                    if not self._pin:  # one failed: the rest would fail alike
                        break
                    self._pin_slot(slot)
            except BaseException:
                self.close()  # nobody else will: unpin what was pinned before the failure
                raise

    def probe(self) -> dict:
        return {"copy_s": self.copy_s}

    def deliver(self, rb, host: dict | None = None, device_fn=None) -> dict[str, Any]:
        """One ``RingBatch`` -> ``{name: device tensor}`` ordered before the current stream.
        ``host``: the batch to copy when it is not ``rb.tensors`` as is (finished on the host
        from them: ragged forms, a batch transform; values that are no tensor pass through);
        ``device_fn(batch)`` runs on the copy stream after the copies (``device_transform``)."""
        torch = self._torch
        with guard(self._device):
            self._reap(block=False)
            if self._pin and not rb.copied and rb.slot not in self._pinned:
                self._pin_slot(rb.slot)  # a slot the ring grew since
            t0 = time.perf_counter()
            lease = rb.tensors
            host = lease if host is None else host
            # Keep the number of slots waiting on copies below the ring size so the ring
            # does not grow just because the GPU is behind.
            while len(self._inflight) >= max(1, self._ring.num_slots - 2):
                ev, _ = self._inflight.popleft()
                ev.synchronize()
            with torch.cuda.stream(self._stream):
                out = {k: t.to(self._device, non_blocking=True) if isinstance(t, torch.Tensor) else t
                       for k, t in host.items()}
                try:
                    if device_fn is not None:
                        out = device_fn(out)
                finally:  # even when the transform raised: the copies are queued all the same
                    ev = torch.cuda.Event(blocking=True)  # the host may wait for it (above, close)
                    ev.record(self._stream)
                    # The host tensors hold the slot lease: the slot is refilled only after `ev`.
                    self._inflight.append((ev, (lease, host)))
            current = torch.cuda.current_stream(self._device)
            current.wait_stream(self._stream)  # the training stream never sees a half copy
            for t in out.values():
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(current)  # output memory is not reused before `current` is done
            self.copy_s += time.perf_counter() - t0
        return out

    def run_on_stream(self, fn, batch: dict, events=()) -> dict:
        """``fn(batch)`` on the copy stream once ``events`` (the GPU-decoded images' copies)
        have completed — not after the current stream's work, so the transform overlaps the
        training step — ordered before the current stream again (``device_transform`` of a
        batch with GPU-decoded images; the raw fields were copied on this stream already)."""
        torch = self._torch
        with guard(self._device):
            for ev in events:
                self._stream.wait_event(ev)
            for t in batch.values():  # the images were allocated on the runners' copy streams
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(self._stream)
            with torch.cuda.stream(self._stream):
                out = fn(batch)
            current = torch.cuda.current_stream(self._device)
            current.wait_stream(self._stream)
            for t in out.values():
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(current)
        return out

    def _reap(self, block: bool) -> None:
        while self._inflight:
            ev, _ = self._inflight[0]
            if block:
                ev.synchronize()
            elif not ev.query():
                break
            self._inflight.popleft()

    def _pin_slot(self, slot: int) -> None:
        """Page-lock one slot (under the device guard of the caller)."""
        cudart = self._torch.cuda.cudart()
        mem = self._ring.slot_memory(slot)
        ptr, size = mem.ctypes.data, mem.nbytes
        err = cudart.cudaHostRegister(ptr, size, _CUDA_HOST_REGISTER_PORTABLE)
        code = int(err)
        if code == 0:
            self._pinned[slot] = (ptr, mem)  # `mem` keeps the slot memory alive while pinned
            return
        # The runtime keeps the error as this thread's last error; torch's next kernel-launch
        # check would raise it from an unrelated operation (the training step): read it away.
        cleared = clear_cuda_error()
        msg = (f"fastload: cudaHostRegister of ring slot {slot} ({size} bytes) failed with cudaError "
               f"{code} ({cudart.cudaGetErrorString(err)})")
        remedy = ("raise the page-locked memory limit (ulimit -l unlimited; docker run --ulimit memlock=-1), "
                  "or lower batch_size / prefetch so the ring's slots fit it; `fastload doctor DATASET` "
                  "compares the limit with what the ring page-locks")
        if cleared is None:
            raise RuntimeError(f"{msg}. The CUDA runtime's last error could not be cleared (a statically linked "
                               "runtime?), so fastload stops here rather than let it fail a later, unrelated CUDA "
                               f"call in your training step: {remedy}")
        logger.warning("%s; continuing with pageable memory (host-to-device copies will not overlap the "
                       "training step): %s", msg, remedy)
        self._pin = False

    def close(self) -> None:
        """Wait for the copies in flight, then unpin every slot and give the stream back.
        Idempotent."""
        if not self._inflight and not self._pinned and self._stream is None:
            return
        with guard(self._device):
            if self._inflight:
                self._reap(block=True)
            cudart = self._torch.cuda.cudart()
            for slot, (ptr, _mem) in sorted(self._pinned.items()):
                code = int(cudart.cudaHostUnregister(ptr))
                if code != 0:
                    clear_cuda_error()
                    logger.warning("fastload: cudaHostUnregister of ring slot %d failed with cudaError %d",
                                   slot, code)
            self._pinned.clear()
            stream, self._stream = self._stream, None
            release_stream(stream)

    @property
    def pinned(self) -> int:
        return len(self._pinned)


class CudaSource(RingFedSource):
    """See the module docstring. ``ring`` holds the raw fields and ``"index"``."""

    def __init__(self, *, ring, delivery: CudaDelivery, dataset, device, feeder: ImageFeeder | None, epoch: int,
                 finish=None, device_transform=None, prepare=None) -> None:
        import torch

        self._torch = torch
        self._delivery = delivery
        self._device = device
        # Host-side finishing of the ring's fields (ragged forms, lists, batch_transform;
        # GPU-decoded images are not in it) and the device transform (all fields).
        self._finish = None if finish is None or finish.trivial else finish
        self._device_fn = device_transform
        self._checks = finish  # runs device_transform with its info, errors and result checks
        self.transforms = list(finish.names) if finish is not None else []
        super().__init__(ring, dataset, feeder, epoch, prepare)

    def _device_transform(self, req, index: np.ndarray):
        """The device transform of this batch (None without one): the user's ``fn(batch)`` as
        ``Finish.device_transform`` runs it (info, TransformError, result checked on the device)."""
        fn, checks = self._device_fn, self._checks
        if fn is None or checks is None:
            return fn
        return lambda batch: checks.device_transform(fn, batch, req, index, self._device)

    def get(self) -> Ready:
        req = self.next_request()
        images, events = {}, ()
        seq = self._feeder.wait_acquired() if self._feeder is not None else None  # the ring has it pending
        rb = self._ring.get_batch()  # raw fields and index (a failed batch raises its error here)
        if seq is not None:
            images, events = self._feeder.take(seq)
        self.taken()
        index = rb.arrays[INDEX].copy()  # the slot is recycled after its copy
        host = None if self._finish is None else self._finish(dict(rb.tensors), req)
        device_fn = self._device_transform(req, index)
        out = self._delivery.deliver(rb, host, None if images else device_fn)
        if images and device_fn is not None:  # on the copy stream after the images' events (G1)
            out.update(images)
            return Ready(self._delivery.run_on_stream(device_fn, out, events), index)
        if images:
            torch = self._torch
            with guard(self._device):
                cur = torch.cuda.current_stream(self._device)
                for ev in events:
                    cur.wait_event(ev)  # the consumer's stream waits for DALI's work and copy
                for v in images.values():
                    v.record_stream(cur)  # allocated on a copy stream, used on `cur`
            out.update(images)
        return Ready(out, index)


class StreamHandoff:
    """Orders the consumer's stream after a batch made on another thread's stream (for
    ``ThreadedSource``: a ``batch_transform`` runs the source in a fastload thread):
    ``start()`` first in the producing thread (it selects the loader's device and makes a
    private stream of fastload's that thread's current stream, so nothing it does waits on or
    records into the training stream from the background), ``record()`` there after each
    batch, ``wait(batch, ev)`` in the consumer (which also keeps the batch's memory from reuse
    until its stream is done). ``device``: the loader's."""

    def __init__(self, device) -> None:
        import torch

        self._torch = torch
        self._device = device
        self._stream = None

    def start(self) -> None:
        """In the producing thread, before anything else."""
        import weakref

        select(self._device)
        with guard(self._device):
            self._stream = private_stream(self._device)
        self._torch.cuda.set_stream(self._stream)
        weakref.finalize(self, release_stream, self._stream)  # back to the free list with the handoff

    @property
    def device(self):
        return self._device

    def record(self):
        with guard(self._device):
            ev = self._torch.cuda.Event()
            ev.record(self._torch.cuda.current_stream(self._device))
        return ev

    def wait(self, batch: dict, ev) -> None:
        with guard(self._device):
            cur = self._torch.cuda.current_stream(self._device)
            cur.wait_event(ev)
            for v in batch.values():
                if isinstance(v, self._torch.Tensor) and v.is_cuda:
                    v.record_stream(cur)

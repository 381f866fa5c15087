"""CudaSource: ready batches on a CUDA device.

Raw fields and ``"index"`` are gathered into a ring slot exactly as on the host, then
copied to the device by ``CudaDelivery``: page-locked slots (``cudaHostRegister`` through
``torch.cuda.cudart()``), a ``non_blocking`` copy on a side stream, the consumer's stream
waiting for that stream, ``record_stream`` on the outputs, and the slot's host tensors (its
lease) held until the copy's event has completed — so a slot is never refilled while the GPU
still reads it. Image fields are decoded by DALI on the GPU (``mixed`` decoder) in a feeder
thread and handed over with an event the consumer's stream waits on.

Everything else (the sampler's plan, the ring, the bad-image policy, stats) is shared with
the host path; this file holds only what differs on a GPU.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import Any, Sequence

import numpy as np

from .decode import Decoders, decode_fields, runner_decoder
from .source import INDEX, Ready, RingFedSource

__all__ = ["CudaDelivery", "CudaImageFeeder", "CudaSource"]

logger = logging.getLogger("fastload")

_CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context


class CudaDelivery:
    """Host ring batches -> device tensors (see the module docstring). ``pin``: ``None``
    pins and falls back to pageable memory with a warning if pinning fails, ``True``
    requires pinning, ``False`` never pins."""

    def __init__(self, ring, device, *, pin: bool | None = None) -> None:
        import torch

        self._torch = torch
        self._ring = ring
        self._device = device
        self._pin = pin is not False
        self._pin_required = pin is True
        self._pinned: dict[int, tuple[int, np.ndarray]] = {}
        self._inflight: collections.deque = collections.deque()
        self._stream = torch.cuda.Stream(device=device)
        self.copy_s = 0.0  # host time issuing device copies (asynchronous, so a lower bound)

    def probe(self) -> dict:
        return {"copy_s": self.copy_s}

    def deliver(self, rb) -> dict[str, Any]:
        """One ``RingBatch`` -> ``{name: device tensor}`` ordered before the current stream."""
        torch = self._torch
        self._reap(block=False)
        if self._pin and not rb.copied and rb.slot not in self._pinned:
            self._pin_slot(rb.slot)
        t0 = time.perf_counter()
        host = rb.tensors
        # Keep the number of slots waiting on copies below the ring size so the ring does
        # not grow just because the GPU is behind.
        while len(self._inflight) >= max(1, self._ring.num_slots - 2):
            ev, _ = self._inflight.popleft()
            ev.synchronize()
        with torch.cuda.stream(self._stream):
            out = {k: t.to(self._device, non_blocking=True) for k, t in host.items()}
            ev = torch.cuda.Event()
            ev.record(self._stream)
        current = torch.cuda.current_stream(self._device)
        current.wait_stream(self._stream)  # the training stream never sees a half copy
        for t in out.values():
            t.record_stream(current)  # output memory is not reused before `current` is done
        # The host tensors hold the slot lease: the slot is refilled only after `ev`.
        self._inflight.append((ev, host))
        self.copy_s += time.perf_counter() - t0
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
        torch = self._torch
        mem = self._ring.slot_memory(slot)
        ptr, size = mem.ctypes.data, mem.nbytes
        err = torch.cuda.cudart().cudaHostRegister(ptr, size, _CUDA_HOST_REGISTER_PORTABLE)
        code = int(err)
        if code == 0:
            self._pinned[slot] = (ptr, mem)  # `mem` keeps the slot memory alive while pinned
            return
        msg = (f"fastload: cudaHostRegister of ring slot {slot} ({size} bytes) failed with cudaError "
               f"{code} ({torch.cuda.cudart().cudaGetErrorString(err)})")
        if self._pin_required:
            raise RuntimeError(msg + "; pass pin=None to fall back to pageable memory")
        logger.warning("%s; continuing with pageable memory (host-to-device copies will not overlap)", msg)
        self._pin = False

    def close(self) -> None:
        """Wait for the copies in flight, then unpin every slot. Idempotent."""
        if self._inflight:
            self._reap(block=True)
        if not self._pinned:
            return
        cudart = self._torch.cuda.cudart()
        for slot, (ptr, _mem) in sorted(self._pinned.items()):
            code = int(cudart.cudaHostUnregister(ptr))
            if code != 0:
                logger.warning("fastload: cudaHostUnregister of ring slot %d failed with cudaError %d", slot, code)
        self._pinned.clear()

    @property
    def pinned(self) -> int:
        return len(self._pinned)


class CudaSource(RingFedSource):
    """See the module docstring. ``ring`` holds the raw fields and ``"index"``."""

    def __init__(self, *, ring, delivery: CudaDelivery, dataset, device, image_fields: Sequence[str],
                 decoders: Decoders | None, epoch: int, on_error: str, stats) -> None:
        import torch

        self._torch = torch
        self._delivery = delivery
        self._device = device
        super().__init__(ring, dataset, CudaImageFeeder(
            ring=ring, delivery=delivery, dataset=dataset, device=device, image_fields=image_fields,
            decoders=decoders, epoch=epoch, on_error=on_error, stats=stats) if image_fields else None)

    def get(self) -> Ready:
        if self._feeder is None:
            rb = self._ring.get_batch()
            index = rb.tensors[INDEX].numpy().copy()  # the slot is recycled after its copy
            return Ready(self._delivery.deliver(rb), index)
        batch, index, ev = self._feeder.get()
        cur = self._torch.cuda.current_stream(self._device)
        cur.wait_event(ev)  # the training stream waits for DALI's work and the copies
        for v in batch.values():
            if isinstance(v, self._torch.Tensor) and v.is_cuda:
                v.record_stream(cur)
        return Ready(batch, index)


class CudaImageFeeder:
    """One thread: decode each batch's image fields on the GPU, its raw fields and index
    through the ring and the device delivery, and hand the batch over with an event."""

    def __init__(self, *, ring, delivery: CudaDelivery, dataset, device, image_fields: Sequence[str],
                 decoders: Decoders, epoch: int, on_error: str, stats) -> None:
        import torch

        self._torch = torch
        self._ring = ring
        self._delivery = delivery
        self._dataset = dataset
        self._device = device
        self._image_fields = list(image_fields)
        self._epoch = epoch
        self._on_error = on_error
        self._stats = stats
        self._inbox: queue.Queue = queue.Queue()
        self._outbox: queue.Queue = queue.Queue()  # finished batches (or errors), in order
        self._stop = threading.Event()
        self._runners = decoders.for_worker(self._image_fields, 0)
        self._thread = threading.Thread(target=self._run, name="fastload-feeder-cuda", daemon=True)
        self._thread.start()

    def put(self, idx: np.ndarray) -> None:
        self._inbox.put(idx)

    def get(self):
        while True:
            try:
                item = self._outbox.get(timeout=0.1)
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError("fastload feeder thread stopped unexpectedly") from None
                continue
            if isinstance(item, BaseException):
                raise item
            return item

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                idx = self._inbox.get(timeout=0.1)
            except queue.Empty:
                continue
            if idx is None:
                return
            try:
                self._outbox.put(self._one(idx))
            except BaseException as e:  # handed to the consumer in order
                if self._stop.is_set():
                    return
                self._outbox.put(e)

    def _one(self, idx: np.ndarray):
        torch, ds = self._torch, self._dataset
        decoders = {name: runner_decoder(self._runners[name], ds, name, self._epoch, None, self._stats)
                    for name in self._image_fields}
        images, final, replaced = decode_fields(decoders, idx, num_samples=len(ds), on_error=self._on_error,
                                                describe=ds.describe)
        if replaced:
            self._stats.add("replaced_samples", replaced)
        self._ring.submit(*ds.locate(final), index=final)
        out = self._delivery.deliver(self._ring.get_batch())  # raw fields and index
        out.update(images)
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self._device))
        return out, final, ev

    def close(self) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout=30)
        if self._thread.is_alive():  # pragma: no cover - only if DALI hangs
            logger.warning("fastload: the CUDA feeder thread did not stop within 30 s")
        while not self._outbox.empty():
            self._outbox.get_nowait()

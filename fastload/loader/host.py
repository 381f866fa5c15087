"""HostSource: ready batches in host memory, with no copy after the gather or the decode.

Raw fields (tensors, scalars) and ``"index"`` are gathered by the ring's C++ threads
straight into a slot and delivered as zero-copy views of it. With image fields, the
``ImageFeeder`` (``feeder.py``, the Loader's machinery owns it) fills the slots instead and
decodes the images with DALI on the CPU: the presets' images are finished in the slot itself,
other image fields are delivered as DALI's own output buffers (DLPack, no copy).
"""
from __future__ import annotations

from .feeder import ImageFeeder
from .source import INDEX, Ready, RingFedSource

__all__ = ["HostSource"]

class HostSource(RingFedSource):
    """See the module docstring. ``ring`` has every raw field (with sources) and the
    ``"index"`` field."""

    def __init__(self, *, ring, dataset, feeder: ImageFeeder | None, epoch: int, finish=None,
                 prepare=None) -> None:
        super().__init__(ring, dataset, feeder, epoch, prepare)
        self._finish = None if finish is None or finish.trivial else finish
        self.transforms = list(finish.names) if finish is not None else []  # named when one is stuck

    def get(self) -> Ready:
        req = self.next_request()
        seq = self._feeder.wait_acquired() if self._feeder is not None else None  # the ring has it pending
        rb = self._ring.get_batch()  # raw fields and index (a failed batch raises its error here)
        batch = rb.tensors
        if seq is not None:
            batch.update(self._feeder.take(seq)[0])  # DALI's outputs (host: no events)
        self.taken()
        index = rb.arrays[INDEX]
        if self._finish is not None:
            batch = self._finish(batch, req)  # ragged forms, lists, mixture source, transforms
        return Ready(batch, index)

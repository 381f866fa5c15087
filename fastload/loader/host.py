"""HostSource: ready batches in host memory, with no copy after the gather or the decode.

Raw fields (tensors, scalars) and ``"index"`` are gathered by the ring's C++ threads
straight into a slot and delivered as zero-copy views of it. With image fields, the
``ImageFeeder`` (``feeder.py``) fills the slots instead and decodes the images with DALI on
the CPU; each image field is delivered as DALI's own output buffer (DLPack, no copy).
"""
from __future__ import annotations

from typing import Sequence

from ..system import IMAGE_FEEDERS
from .decode import Decoders
from .feeder import ImageFeeder
from .source import INDEX, Ready, RingFedSource

__all__ = ["HostSource"]

class HostSource(RingFedSource):
    """See the module docstring. ``ring`` has every raw field (with sources) and the
    ``"index"`` field."""

    def __init__(self, *, ring, dataset, image_fields: Sequence[str], decoders: Decoders | None, epoch: int,
                 on_error: str, stats, finish=None, workers: int = IMAGE_FEEDERS, prepare=None) -> None:
        super().__init__(ring, dataset, ImageFeeder(
            ring=ring, dataset=dataset, image_fields=image_fields, decoders=decoders, epoch=epoch,
            on_error=on_error, stats=stats, workers=workers) if image_fields else None, prepare)
        self._finish = None if finish is None or finish.trivial else finish

    def get(self) -> Ready:
        req = self.next_request()
        seq = self._feeder.wait_acquired() if self._feeder is not None else None  # the ring has it pending
        rb = self._ring.get_batch()  # raw fields and index (a failed batch raises its error here)
        batch = rb.tensors
        if seq is not None:
            batch.update(self._feeder.take(seq)[0])  # DALI's outputs (host: no events)
        index = rb.arrays[INDEX]
        if self._finish is not None:
            batch = self._finish(batch, req)  # ragged forms, lists, mixture source, transforms
        return Ready(batch, index)

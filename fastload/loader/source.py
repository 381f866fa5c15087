"""The contract between an epoch's iteration and whatever produces its batches.

A *source of ready batches* takes the epoch's batches of global sample indices in order
(``put``) and hands back, in the same order, batches ready for the training loop (``get``):
every delivered field as a tensor on the loader's device, ``"index"`` included (the global
indices actually delivered, after any replacement of undecodable images). ``close()`` ends
the epoch's work: threads started for it are joined, batches still in flight are drained.

Two implementations, chosen once by the Loader from its device: ``HostSource``
(``host.py``: batches in host memory, zero-copy views of ring slots) and ``CudaSource``
(``cuda.py``: batches on a CUDA device). Neither branches on the other's case.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Protocol, Sequence

import numpy as np

__all__ = ["INDEX", "BatchSource", "Ready", "RingFedSource", "submit_batches"]

INDEX = "index"  # the ring field (and batch key) holding each batch's global sample indices


class Ready(NamedTuple):
    batch: dict[str, Any]  # field -> tensor on the loader's device, "index" included
    index: np.ndarray  # the same global indices as a host int64 array (for host-side lookups)


class BatchSource(Protocol):
    # True when batches are best put in runs (one locate + one submit for many batches):
    # the epoch then refills only when half of the batches in flight have been taken.
    amortize: bool

    def put(self, batches: Sequence[np.ndarray]) -> None:
        """Request these batches (global indices, int64), after every earlier one."""

    def get(self) -> Ready:
        """The next batch in request order; raises the batch's error (e.g. DecodeError)."""

    def close(self) -> None:
        """Stop this epoch's work: join its threads, drain what is in flight. Idempotent."""


def submit_batches(ring, dataset, batches: Sequence[np.ndarray]) -> None:
    """Locate and submit consecutive batches with one call when they have equal sizes (the
    sampler only shortens the last one), else one by one; their indices fill ``INDEX``."""
    idx_all = np.concatenate(batches) if len(batches) > 1 else batches[0]
    shard, row = dataset.locate(idx_all, check=False)
    sizes = {len(b) for b in batches[:-1]}
    if len(sizes) <= 1 and (not sizes or len(batches[-1]) <= next(iter(sizes))):
        ring.submit_many(shard, row, len(batches[0]), index=idx_all)
        return
    start = 0  # pragma: no cover - the sampler only shortens the last batch
    for b in batches:
        stop = start + len(b)
        ring.submit(shard[start:stop], row[start:stop], index=idx_all[start:stop])
        start = stop


class RingFedSource:
    """What both sources share: batches go to the image feeder when there is one (it fills
    the ring or hands over device batches), else straight to the ring in runs; ``close()``
    joins the feeder and drains the ring so its slots are free for the next epoch."""

    def __init__(self, ring, dataset, feeder) -> None:
        self._ring = ring
        self._dataset = dataset
        self._feeder = feeder
        self.amortize = feeder is None
        self._closed = False

    def put(self, batches: Sequence[np.ndarray]) -> None:
        if self._feeder is not None:
            for idx in batches:
                self._feeder.put(idx)
        elif batches:
            submit_batches(self._ring, self._dataset, batches)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._feeder is not None:
            self._feeder.close()
        self._ring.drain()

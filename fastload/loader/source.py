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

__all__ = ["BatchSource", "Ready"]


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

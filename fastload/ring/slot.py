"""What a :class:`~fastload.ring.ring.Ring` hands out besides plain batches: a :class:`FillSlot`
reserved by ``Ring.acquire()`` for an external fill (e.g. DALI output), and the
:class:`RingBatch` of ``Ring.get_batch()`` (a batch's tensors and the slot they view).

Both follow the ring's lifetime rule (see :mod:`fastload.ring.ring`): a slot is not reused while
any view of it is alive.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .spec import row_args
from ..validate import is_int as _is_int

__all__ = ["FillSlot", "RingBatch"]


class FillSlot:
    """A ring slot reserved by :meth:`Ring.acquire` for an external fill.

    ``arrays`` (numpy) and ``tensors`` (torch, same memory) are writable views of the whole
    slot, shape ``(batch_size, *shape)`` per field. Write the batch, then ``commit(rows)`` to
    publish it as the next batch in order, or ``fail(error)`` to make ``get()`` raise for it
    (an exception object is raised as is; a message as ``RuntimeError``). Used as a context
    manager, an exception inside the block fails the batch with that exception. A slot dropped without
    commit/fail is published as an error, so the consumer never waits forever. The slot is
    not reused while any of these views (or the delivered batch) is alive.
    """

    __slots__ = ("_handle", "_arrays", "_index_field", "_done", "seq")

    def __init__(self, handle: Any, arrays: dict[str, np.ndarray], index_field: str | None = None) -> None:
        self._handle = handle
        self._index_field = index_field
        self._arrays = arrays
        self._done = False
        self.seq = handle.seq

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        self._check_open()
        return self._arrays

    @property
    def tensors(self) -> dict[str, Any]:
        import torch

        self._check_open()
        return {k: torch.from_numpy(v) for k, v in self._arrays.items()}

    def gather(self, shard: Any, row: Any, index: Any = None) -> None:
        """Gather the fields that have sources for rows ``(shard, row)`` into this slot (and
        ``index`` into the index field), in the calling thread with the GIL released."""
        self._check_open()
        self._handle.gather(*row_args(shard, row, index, self._index_field))

    def commit(self, rows: int) -> None:
        """Publish the first ``rows`` rows of every field as the next batch."""
        self._check_open()
        if not _is_int(rows):
            raise ValueError(f"rows must be an int, got {rows!r}")
        self._handle.commit(int(rows))
        self._release()

    def fail(self, error: BaseException | str) -> None:
        """Publish an error instead of a batch: ``get()`` raises ``error`` for this batch
        (a string becomes ``RuntimeError(error)``). The ring keeps the exception until that
        batch is delivered (or dropped by ``drain()``/``close()``)."""
        self._check_open()
        self._handle.fail(error if isinstance(error, BaseException) else str(error))
        self._release()

    def _check_open(self) -> None:
        if self._done:
            raise RuntimeError(f"batch {self.seq}: this slot was already committed or failed")

    def _release(self) -> None:
        # Our references go; the slot stays held only by views the caller kept.
        self._done = True
        self._handle = None
        self._arrays = {}

    def __enter__(self) -> FillSlot:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and not self._done:
            try:
                self.fail(exc)
            except RuntimeError:  # ring already closed: nothing left to notify
                self._release()


class RingBatch(NamedTuple):
    """One batch from :meth:`Ring.get_batch`: ``tensors`` (host, zero-copy unless
    ``copied``), the ``slot`` they view (-1 for a copy), and ``arrays``: the same memory as
    numpy arrays (for host-side lookups without a tensor round trip)."""

    tensors: dict[str, Any]
    slot: int
    copied: bool
    arrays: dict[str, Any]

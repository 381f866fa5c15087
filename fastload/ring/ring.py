"""Python face of the C++ ring buffer (``fastload._C.Ring``): host slots as tensors.

A :class:`Ring` owns a fixed set of aligned host slots, each large enough for one batch of
every field, and a pool of C++ producer threads. ``submit(shard, row)`` enqueues one batch
(the producers gather those rows of every field from the source arrays into a free slot,
GIL released); ``get()`` returns the next batch **in submission order** as a dict of torch
tensors. ``acquire()`` reserves the next batch for an *external fill* (e.g. DALI output) with
the same ordering and lifetime rules. An optional *index field* (int64) receives the
global sample indices passed to ``submit`` / ``FillSlot.gather``, so a batch's
``"index"`` travels in the slot like every other field.

Lifetime rule. A batch returned by ``get()`` is a zero-copy view of its slot. The slot is
not reused while any array or tensor of that batch is alive: every view holds a reference
to a small ``SlotLease`` object, and the slot goes back to the free list only when the last
view dies. If the user keeps so many batches that no slot is left for the producers, the
ring grows by one slot at a time up to ``max_slots``; past the cap, batches are delivered as
copies (a warning is logged once). Nothing is ever overwritten and nothing deadlocks.

This module knows nothing of CUDA: a device delivery (``fastload/loader/cuda.py``) pins the
slots (``slot_memory()``) and copies batches to the device, holding each batch's host
tensors — and so its slot — until its copy has completed.

Validation happens once, in Python: every argument is checked with a message naming the
field and shard (:mod:`fastload.ring.spec`); the C++ side only asserts its invariants. The
sizing defaults (threads, slots, growth cap, split size) are :mod:`fastload.ring.size`; the
slot of an external fill and the batch of ``get_batch()`` are :mod:`fastload.ring.slot`.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from .. import _C
from .size import MIN_PART_BYTES, default_slots, default_threads, ring_sizes
from .slot import FillSlot, RingBatch
from .spec import RaggedField, as_index, batch_dict, parse_ragged, ragged_descs, row_args, shard_sources, window_args
from .spec import parse_fields as _parse_fields
from .spec import parse_sources as _parse_sources
from ..validate import check_int
from ..validate import is_int as _is_int

__all__ = ["FillSlot", "RaggedField", "Ring", "RingBatch", "default_slots", "default_threads"]

_from_numpy = None  # torch.from_numpy, once torch is loaded (fastload.ring.ring imports no torch)


def _torch_from_numpy():
    global _from_numpy
    import torch

    _from_numpy = torch.from_numpy
    return _from_numpy


logger = logging.getLogger(__name__)

_INT64 = np.dtype(np.int64)


class Ring:
    """A ring of host slots filled by C++ producer threads; batches come out in order.

    Args:
        fields: ``{name: (dtype, shape)}``; ``shape`` is the per-row shape (``()`` for scalars);
            or ``{name: RaggedField(...)}`` for a variable number of items per row (a batch
            then holds ``name`` and ``name + "_offsets"``, see :class:`RaggedField`).
        batch_size: rows per slot (the largest batch ``submit`` accepts).
        sources: ``{name: [array per shard]}``; each array is C-contiguous with shape
            ``(rows, *shape)`` and the field's exact dtype (read-only / memory-mapped is fine).
            Every field gathered by ``submit`` needs sources; a field without sources can only
            be filled through ``acquire()``. The ring keeps the arrays alive (buffer protocol).
        index_field: the name of an ``int64`` scalar field (without sources) that receives
            the global indices given to ``submit(..., index=)`` and ``FillSlot.gather``.
        threads: producer threads (default :func:`default_threads`).
        slots: initial slots (default :func:`default_slots`).
        max_slots: growth cap when the user holds batches (default: ``slots`` plus about
            512 MiB worth of slots, at least 2 and at most 64 extra).
        min_part_bytes: batches with more bytes than this are split across producer threads.
        shard_rows: rows per shard; with it, a shard's source (a ragged field's pair too) may
            be ``None`` (not loaded yet) and :meth:`set_source` installs or drops a shard's
            sources while the ring runs
            (a remote dataset's cache maps shards as they arrive and releases them after
            their last use). A batch that needs a shard that is not loaded fails with a
            ValueError naming the shard.
        nice: the producer threads' priority (a Linux nice value, 0..19; 0: unchanged).
            A Loader runs its producers below the training loop's threads
            (:func:`fastload.runtime.system.loader_nice`).
    """

    def __init__(
        self,
        fields: Mapping[str, Any],
        batch_size: int,
        sources: Mapping[str, Sequence[np.ndarray] | np.ndarray] | None = None,
        *,
        index_field: str | None = None,
        threads: int | None = None,
        slots: int | None = None,
        max_slots: int | None = None,
        min_part_bytes: int = MIN_PART_BYTES,
        shard_rows: Sequence[int] | None = None,
        nice: int = 0,
    ) -> None:
        self._core = None
        self._closed = True
        if not _is_int(batch_size) or batch_size <= 0:
            raise ValueError(f"batch_size={batch_size!r} must be an int > 0")
        names, dtypes, shapes = _parse_fields(fields)
        ragged = parse_ragged(fields, names, dtypes, shapes)
        srcs = _parse_sources(sources, names, dtypes, shapes, ragged, shard_rows)
        index = -1
        if index_field is not None:
            if index_field not in names:
                raise ValueError(f"index_field={index_field!r} is not one of the fields {names}")
            index = names.index(index_field)
            if dtypes[index] != _INT64 or shapes[index] != () or srcs[index] is not None:
                raise ValueError(f"index_field={index_field!r} must be an int64 scalar field without sources")
        row_bytes = sum(dt.itemsize * int(np.prod(s, dtype=np.int64))
                        for dt, s, r in zip(dtypes, shapes, ragged) if r is None)
        descs, ragged_bytes = ragged_descs(ragged, srcs, int(batch_size), dtypes, shapes)
        threads = default_threads() if threads is None else threads
        nice = check_int("nice", nice, min=0, max=19)
        threads, slots, max_slots, min_part_bytes = ring_sizes(
            batch_size, row_bytes, ragged_bytes, threads=threads,
            slots=default_slots(threads) if slots is None and _is_int(threads) else slots,
            max_slots=max_slots, min_part_bytes=min_part_bytes)

        self._names = names
        self._plain = all(r is None for r in ragged)  # no ragged field: one array per name
        self._dtypes = dtypes
        self._shapes = shapes
        self._batch_size = int(batch_size)
        self._index_field = index_field
        self._needs_sources = [n for n, s, i in zip(names, srcs, range(len(names))) if s is None and i != index]
        self._sourced = [s is not None and r is None for s, r in zip(srcs, ragged)]  # set_source: fixed-size
        self._ragged_sourced = [s is not None and r is not None for s, r in zip(srcs, ragged)]  # ...and ragged
        first = next((s for s in srcs if s is not None), [])
        self._shard_rows = [a if isinstance(a, int) else (len(a[1]) - 1 if isinstance(a, tuple) else a.shape[0])
                            for a in first]
        self._warned_copy = False
        self._core = _C.Ring(
            names, dtypes, [list(s) for s in shapes], int(batch_size), srcs, index,
            int(threads), int(slots), int(max_slots), int(min_part_bytes), descs, nice,
        )
        self._closed = False

    # ------------------------------------------------------------------ properties
    @property
    def fields(self) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        return {n: (d, s) for n, d, s in zip(self._names, self._dtypes, self._shapes)}

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def index_field(self) -> str | None:
        return self._index_field

    @property
    def threads(self) -> int:
        return self._live().threads

    @property
    def num_slots(self) -> int:
        return self._live().num_slots

    @property
    def max_slots(self) -> int:
        return self._live().max_slots

    @property
    def pending(self) -> int:
        """Batches submitted or acquired and not yet returned by ``get()``."""
        return 0 if self._core is None else self._core.pending

    @property
    def closed(self) -> bool:
        return self._closed

    def stats(self) -> dict[str, int]:
        """Slot states and counters: slots, free, filling, ready, in_use, submitted,
        delivered, grown, copies, pending, max_slots, slot_bytes, threads, and gather_ns
        (time spent gathering rows since the ring was made, summed over threads)."""
        return self._live().stats()

    def slot_memory(self, slot: int) -> np.ndarray:
        """The whole memory of slot ``slot`` as a uint8 array (e.g. to page-lock it); the
        array keeps the ring's memory alive."""
        return self._live().slot_memory(int(slot))

    # ------------------------------------------------------------------ producer side
    def submit(self, shard: Any, row: Any, index: Any = None, *, start: Any = None, count: Any = None) -> None:
        """Enqueue one batch: row ``row[i]`` of shard ``shard[i]`` for every field (and
        ``index[i]`` for the index field). ``start``/``count`` give each row's window of items
        in the ragged fields (items ``start[i]..start[i]+count[i]-1``; ``count[i] < 0``: to
        the end).

        Never blocks (the request queue is unbounded; index arrays are copied). Bad ids are
        reported by ``get()`` for this batch (IndexError); bad arguments raise ValueError now.
        """
        s, r, ix = row_args(shard, row, index, self._index_field)
        n = len(s)
        if not 1 <= n <= self._batch_size:
            raise ValueError(f"a batch must have between 1 and batch_size={self._batch_size} rows, got {n}")
        self._submit(s, r, ix, n, *window_args(start, count, n))

    def submit_many(self, shard: Any, row: Any, batch_size: int | None = None, index: Any = None, *,
                    start: Any = None, count: Any = None) -> int:
        """Enqueue many rows at once as consecutive batches of ``batch_size`` rows (default:
        the ring's), the last one possibly shorter — e.g. a whole epoch from
        ``Dataset.locate(order)``. Same rules as :meth:`submit`; returns the number of batches.
        """
        s, r, ix = row_args(shard, row, index, self._index_field)
        per = self._batch_size if batch_size is None else batch_size
        if not _is_int(per) or not 1 <= per <= self._batch_size:
            raise ValueError(f"batch_size={per!r} must be an int between 1 and the ring's batch_size={self._batch_size}")
        if len(s) == 0:
            raise ValueError("submit_many() needs at least one row")
        return self._submit(s, r, ix, int(per), *window_args(start, count, len(s)))

    def submit_indices(self, index: Any, batch_size: int | None = None) -> int:
        """Enqueue the rows of global sample indices, numbered across the shards in order
        (``Dataset.locate``'s numbering, from ``shard_rows``), as consecutive batches of
        ``batch_size`` rows (default: the ring's), the last one possibly shorter. The ring
        locates them in C++ (no shard and row arrays are made); its index field, if any,
        receives the indices. An index out of range raises IndexError and submits nothing.
        Returns the number of batches."""
        ix = as_index(index, "index")
        per = self._batch_size if batch_size is None else batch_size
        if not _is_int(per) or not 1 <= per <= self._batch_size:
            raise ValueError(f"batch_size={per!r} must be an int between 1 and the ring's batch_size={self._batch_size}")
        if len(ix) == 0:
            raise ValueError("submit_indices() needs at least one index")
        self._check_submit()
        return self._core.submit_indices(ix, int(per))

    def submit_sizes(self, shard: Any, row: Any, sizes: Any, index: Any = None, *, start: Any = None,
                     count: Any = None) -> int:
        """Enqueue consecutive batches of ``sizes[k]`` rows each (they add up to the rows):
        :meth:`submit_many` for batches of varying sizes, e.g. the pieces of packed sequences.
        The arguments are checked once for the whole run; returns the number of batches."""
        s, r, ix = row_args(shard, row, index, self._index_field)
        st, ct = window_args(start, count, len(s))
        sz = as_index(sizes, "sizes")
        if len(sz) == 0 or int(sz.sum()) != len(s) or int(sz.min()) < 1 or int(sz.max()) > self._batch_size:
            raise ValueError(f"sizes must be between 1 and batch_size={self._batch_size} and add up to the "
                             f"{len(s)} rows (got {len(sz)} sizes adding up to {int(sz.sum())}, "
                             f"the largest {int(sz.max(initial=0))})")
        self._check_submit()
        return self._core.submit_sizes(s, r, ix, sz, st, ct)

    def _check_submit(self) -> None:
        if self._closed:
            raise RuntimeError("this Ring is closed; create a new one")
        if self._needs_sources:
            raise ValueError(f"field {self._needs_sources[0]!r} has no sources, so submit() cannot gather it; "
                             "fill it with acquire() instead")

    def _submit(self, s, r, ix, per: int, start=None, count=None) -> int:
        self._check_submit()
        return self._core.submit_many(s, r, ix, per, start, count)

    def set_source(self, shard: int, arrays: Mapping[str, Any] | None) -> None:
        """Install one shard's sources (``{field: array}`` for every sourced field, ``{field:
        (values, offsets)}`` for a ragged one) or drop them (``None``) while the ring runs.
        Waits until no gather (and no ragged planning in ``submit``) is running, so the ring
        never reads a dropped array again (the caller may unmap it afterwards); batches
        submitted later that need a dropped shard fail naming it, and so does a ragged batch
        submitted before and gathered after its shard was dropped or replaced (never a batch
        mixing two sources)."""
        core = self._live()
        per_field = shard_sources(shard, arrays, self._names, self._dtypes, self._shapes, self._sourced,
                                  self._shard_rows, self._ragged_sourced)
        core.set_source(int(shard), per_field)

    def acquire(self) -> FillSlot:
        """Reserve the next batch for an external fill; waits (GIL released, Ctrl-C aware)
        until a slot is free. See :class:`FillSlot`."""
        handle, arrays = self._live().acquire()
        return FillSlot(handle, batch_dict(self._names, arrays), self._index_field)

    # ------------------------------------------------------------------ consumer side
    def get_arrays(self) -> dict[str, np.ndarray]:
        """The next batch as zero-copy numpy views of its host slot, shape ``(rows, *shape)``.

        Waits with the GIL released; Ctrl-C raises KeyboardInterrupt. A producer error for
        this batch raises here (IndexError for bad shard/row ids; ShardReadError, naming the
        shard's file, when reading a memory-mapped source raised SIGBUS — the file was
        truncated while in use or its storage failed; a failed external fill raises its own
        exception; RuntimeError otherwise).
        """
        return batch_dict(self._names, self._next()[0])

    def get(self) -> dict[str, Any]:
        """The next batch in submission order as ``{name: torch.Tensor}`` (host memory,
        zero-copy views of the slot; see the lifetime rule in the module docstring)."""
        return self.get_batch().tensors

    def get_batch(self) -> RingBatch:
        """As :meth:`get`, with the slot the batch views (for a device delivery)."""
        from_numpy = _from_numpy or _torch_from_numpy()
        core = self._core  # (the per-batch path: _next() inlined)
        if self._closed or core is None:
            raise RuntimeError("this Ring is closed; create a new one")
        _, arrays, slot, copied = core.get()  # a failed fill raises its own exception here
        if copied and not self._warned_copy:
            self._warn_copies(core)
        named = dict(zip(self._names, arrays)) if self._plain else batch_dict(self._names, arrays)
        return RingBatch({k: from_numpy(a) for k, a in named.items()}, slot, copied, named)

    def _next(self) -> tuple:
        core = self._live()
        rows, arrays, slot, copied = core.get()  # a failed fill raises its own exception here
        if copied and not self._warned_copy:
            self._warn_copies(core)
        return arrays, slot, copied

    def _warn_copies(self, core) -> None:
        self._warned_copy = True
        logger.warning(
            "fastload ring: the caller holds %d batches (max_slots=%d), so batches are now "
            "delivered as copies; drop references to old batches (or raise max_slots) to "
            "get zero-copy batches back",
            core.stats()["in_use"], core.max_slots,
        )

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Yield ``get()`` until no submitted/acquired batch is pending."""
        while self.pending > 0:
            yield self.get()

    def drain(self, timeout: float | None = None, warn: bool = True) -> bool:
        """Take (and drop) every pending batch, errors included, so all slots are free.
        With ``timeout`` (seconds), give up when no batch became ready for that long (a fill
        that never completes); returns True when nothing is pending any more."""
        import time

        while not self._closed and self.pending > 0:
            t0 = time.monotonic()
            try:  # a batch that failed (a gather error, a failed fill) is dropped with its error
                got = self._live().get(-1 if timeout is None else int(timeout * 1000), True)
            except Exception:  # the ring closed or emptied meanwhile: the loop's test decides
                continue
            if got is None:
                if not warn:
                    return False
                logger.warning("fastload ring: %d batch(es) still pending after %.1f s; giving up draining",
                               self.pending, time.monotonic() - t0)
                return False
        return True

    # ------------------------------------------------------------------ lifetime
    def _live(self) -> Any:
        if self._closed or self._core is None:
            raise RuntimeError("this Ring is closed; create a new one")
        return self._core

    def close(self) -> None:
        """Stop and join every producer thread. Idempotent. Batches already returned stay
        valid."""
        if self._closed:
            return
        self._closed = True
        core = self._core
        if core is not None:
            core.close()  # and drops the errors of fills never delivered

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_core", None) is not None and not getattr(self, "_closed", True):
            self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"slots={self._core.num_slots}, pending={self._core.pending}"
        fields = ", ".join(f"{n}: {d}{list(s)}" for n, d, s in zip(self._names, self._dtypes, self._shapes))
        return f"Ring({fields}; batch_size={self._batch_size}, {state})"

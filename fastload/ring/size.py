"""How big a ring is: the one sizing policy of fastload (a Ring alone, a Loader, doctor).

    threads   default_threads()         producer threads of a Ring: this rank's share of the
                                        usable cores, at most 8 (the gather is memory-bound:
                                        more threads than cores only add switching)
              default_gather_threads()  a Loader's: one core fewer, left to the training loop
    prefetch  default_prefetch()        a Loader's batches in flight: one per gather thread
                                        plus one, more for small batches, within PREFETCH_BUDGET
              default_cuda_image_prefetch()  with images decoded on a GPU: 2 or 3, within
                                        DEVICE_PREFETCH_BUDGET of device memory
    slots     ring_slots(in_flight)     in_flight + 2: one held by the training loop while the
                                        next ``get()`` runs, one in the hand-off (at least 3).
                                        A Loader's in flight is its prefetch; a Ring alone
                                        keeps threads + 1 in flight (default_slots)
    bytes     batch_bytes(), slot_bytes()  a Loader's batch and slot: its fields' rows plus
                                        each row's int64 index (INDEX_BYTES), field regions
                                        and the slot aligned as csrc/ring.cpp lays them out
    growth    ring_sizes()              max_slots: slots plus about 512 MiB worth of slots (at
                                        least 2, at most 64 more), used while the caller
                                        holds batches; batches over MIN_PART_BYTES are split
                                        across threads

:func:`ring_sizes` checks threads, slots, max_slots and the split size (and that the slots
fit in memory) before the C++ ring allocates anything. How the defaults were chosen: see
``bench/bench_tensor.py`` (gather threads, prefetch) and ``bench/bench_jpeg.py`` (images).
"""
from __future__ import annotations

from typing import Any

from ..runtime.system import check_fits_in_memory, rank_cores
from ..validate import is_int as _is_int

__all__ = ["DEVICE_PREFETCH_BUDGET", "INDEX_BYTES", "MIN_PART_BYTES", "PREFETCH_BUDGET", "batch_bytes",
           "default_cuda_image_prefetch", "default_gather_threads", "default_prefetch", "default_slots",
           "default_threads", "ring_sizes", "ring_slots", "slot_bytes"]

MIN_PART_BYTES = 256 << 10  # split a batch across producers above this many bytes per part
PREFETCH_BUDGET = 256 << 20  # host memory a Loader's default prefetch may use for batches in flight
DEVICE_PREFETCH_BUDGET = 512 << 20  # GPU memory decoded images in flight may use (per rank)
INDEX_BYTES = 8  # each row's global sample index (int64): the "index" field of a Loader's slot
SLOT_ALIGN = 4096  # csrc/ring.cpp kSlotAlign: a slot is whole pages
FIELD_ALIGN = 256  # csrc/ring.cpp kFieldAlign: each field's region in a slot starts aligned
_GROWTH_BUDGET = 512 << 20  # default max_slots lets the ring grow by about this many bytes
_MAX_SLOT_BYTES = 1 << 40  # a slot this large is a mistake (batch_size or shapes), not a plan


def default_threads() -> int:
    """Producer threads of a Ring made with ``threads=None``: this rank's share of the usable
    cores (:func:`fastload.runtime.system.rank_cores`), at most 8."""
    return max(1, min(8, rank_cores()))


def default_gather_threads() -> int:
    """A Loader's gather threads: :func:`default_threads` minus one core left to the training
    loop's own Python thread, at least 1."""
    return max(1, default_threads() - 1)


def default_prefetch(threads: int, batch_bytes: int) -> int:
    """A Loader's batches in flight: enough to keep every gather thread busy with one to
    spare, up to 8 when batches are small, capped so the slots stay within PREFETCH_BUDGET;
    at least 2."""
    fit = PREFETCH_BUDGET // max(1, batch_bytes)
    return int(max(2, min(8, max(threads + 1, fit))))


def default_cuda_image_prefetch(image_batch_bytes: int) -> int:
    """A Loader's batches in flight when DALI decodes on the GPU: each holds its decoded images
    in device memory, so 2 (one decoding while one is consumed), or 3 when a batch's images fit
    DEVICE_PREFETCH_BUDGET three times."""
    return int(max(2, min(3, DEVICE_PREFETCH_BUDGET // max(1, image_batch_bytes))))


def ring_slots(in_flight: int) -> int:
    """Ring slots for ``in_flight`` batches requested ahead: one more held by the training
    loop, one in the hand-off; at least 3."""
    return max(int(in_flight) + 2, 3)


def default_slots(threads: int) -> int:
    """Slots of a Ring made with ``slots=None`` for ``threads`` producers: one batch in flight
    per producer and one spare (:func:`ring_slots` of ``threads + 1``)."""
    return ring_slots(threads + 1)


def batch_bytes(rows: int, row_bytes: int) -> int:
    """The bytes of a Loader's batch of ``rows`` rows of ``row_bytes`` (its fields) in a slot,
    each row's int64 index included."""
    return int(rows) * (int(row_bytes) + INDEX_BYTES)


def slot_bytes(rows: int, row_bytes: int, fields: int) -> int:
    """A Loader's ring slot: :func:`batch_bytes` with each of ``fields`` regions and the
    index's aligned to FIELD_ALIGN, rounded up to whole pages (csrc/ring.cpp's layout; ragged
    fields' items are not counted here: the ring checks its exact size)."""
    need = batch_bytes(rows, row_bytes) + FIELD_ALIGN * (int(fields) + 1)
    return -(-need // SLOT_ALIGN) * SLOT_ALIGN


def ring_sizes(batch_size: int, row_bytes: int, ragged_bytes: int, *, threads: Any, slots: Any, max_slots: Any,
               min_part_bytes: Any) -> tuple[int, int, int, int]:
    """Checked ``(threads, slots, max_slots, min_part_bytes)``; ``max_slots`` defaults to
    ``slots`` plus about 512 MiB of slots (at least 2, at most 64 more)."""
    if not _is_int(threads) or not 1 <= threads <= 256:
        raise ValueError(f"threads={threads!r} must be an int in [1, 256]")
    if not _is_int(slots) or slots < 1:
        raise ValueError(f"slots={slots!r} must be an int >= 1")
    per_slot = int(batch_size) * row_bytes + ragged_bytes  # Python ints: no overflow
    if per_slot > _MAX_SLOT_BYTES:
        raise ValueError(f"batch_size={batch_size} rows of {row_bytes} bytes need a {per_slot:,}-byte slot; "
                         "lower batch_size")
    check_fits_in_memory(int(slots) * per_slot,
                         f"a ring of {slots} slots of batch_size={batch_size} rows ({row_bytes:,} bytes each)",
                         "lower batch_size or the number of slots (a Loader's prefetch)")
    if max_slots is None:
        max_slots = int(slots) + max(2, min(64, _GROWTH_BUDGET // max(per_slot, 1)))
    if not _is_int(max_slots) or max_slots < slots:
        raise ValueError(f"max_slots={max_slots!r} must be an int >= slots={slots}")
    if not _is_int(min_part_bytes) or min_part_bytes < 1:
        raise ValueError(f"min_part_bytes={min_part_bytes!r} must be an int > 0")
    return int(threads), int(slots), int(max_slots), int(min_part_bytes)

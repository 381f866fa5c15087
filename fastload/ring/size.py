"""How big a ring is: producer threads, slots, the growth cap and the split size.

Defaults (measured on a 2-core VM, ``bench/bench_tensor.py``): ``threads`` = usable cores
(capped at 8) — the gather is memory-bound and more threads than cores only add switching;
``slots`` = ``threads + 3`` — one slot held by the training loop while the next ``get()``
runs, one in the hand-off, one per producer thread, and one spare; batches larger than
``min_part_bytes`` (256 KiB) are split across threads. When the caller holds batches, the
ring grows up to ``max_slots``: by default ``slots`` plus about 512 MiB worth of slots (at
least 2, at most 64 more). :func:`ring_sizes` checks all four (and that the slots fit in
memory) before the C++ ring allocates anything.
"""
from __future__ import annotations

from typing import Any

from ..runtime.system import check_fits_in_memory, rank_cores
from ..validate import is_int as _is_int

__all__ = ["MIN_PART_BYTES", "default_slots", "default_threads", "ring_sizes"]

MIN_PART_BYTES = 256 << 10  # split a batch across producers above this many bytes per part
_GROWTH_BUDGET = 512 << 20  # default max_slots lets the ring grow by about this many bytes
_MAX_SLOT_BYTES = 1 << 40  # a slot this large is a mistake (batch_size or shapes), not a plan


def default_threads() -> int:
    """Producer threads used when ``threads=None``: this rank's share of the usable cores
    (:func:`fastload.runtime.system.rank_cores`), at most 8."""
    return max(1, min(8, rank_cores()))


def default_slots(threads: int) -> int:
    """Initial slots used when ``slots=None`` for ``threads`` producers."""
    return threads + 3


def ring_sizes(batch_size: int, row_bytes: int, ragged_bytes: int, *, threads: Any, slots: Any, max_slots: Any,
               min_part_bytes: Any) -> tuple[int, int, int, int]:
    """Checked ``(threads, slots, max_slots, min_part_bytes)``; ``max_slots`` defaults to
    ``slots`` plus about 512 MiB of slots (at least 2, at most 64 more)."""
    if not _is_int(threads) or not 1 <= threads <= 256:
        raise ValueError(f"threads={threads!r} must be an int in [1, 256]")
    if not _is_int(slots) or slots < 1:
        raise ValueError(f"slots={slots!r} must be an int >= 1")
    slot_bytes = int(batch_size) * row_bytes + ragged_bytes  # Python ints: no overflow
    if slot_bytes > _MAX_SLOT_BYTES:
        raise ValueError(f"batch_size={batch_size} rows of {row_bytes} bytes need a {slot_bytes:,}-byte slot; "
                         "lower batch_size")
    check_fits_in_memory(int(slots) * slot_bytes,
                         f"a ring of {slots} slots of batch_size={batch_size} rows ({row_bytes:,} bytes each)",
                         "lower batch_size or the number of slots (a Loader's prefetch)")
    if max_slots is None:
        max_slots = int(slots) + max(2, min(64, _GROWTH_BUDGET // max(slot_bytes, 1)))
    if not _is_int(max_slots) or max_slots < slots:
        raise ValueError(f"max_slots={max_slots!r} must be an int >= slots={slots}")
    if not _is_int(min_part_bytes) or min_part_bytes < 1:
        raise ValueError(f"min_part_bytes={min_part_bytes!r} must be an int > 0")
    return int(threads), int(slots), int(max_slots), int(min_part_bytes)

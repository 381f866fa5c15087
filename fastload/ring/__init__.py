"""The ring: fixed host slots that C++ threads gather batches into (GIL released), handed
to Python as zero-copy tensors in submission order (``fastload._C`` underneath).

    ring.py   the Python face: ``Ring`` (submit / acquire / get, the slot lifetime rule)
    spec.py   fields, sources and ragged fields checked once, with messages naming them
    size.py   the one sizing policy: threads, prefetch, slots, slot bytes, growth cap, split size
    slot.py   an external fill's slot (``FillSlot``) and a delivered batch (``RingBatch``)

No CUDA inside: a device delivery (``fastload/loader/cuda.py``) pins the slots and copies.
"""
from .ring import FillSlot, RaggedField, Ring, RingBatch, default_slots, default_threads

__all__ = ["FillSlot", "RaggedField", "Ring", "RingBatch", "default_slots", "default_threads"]

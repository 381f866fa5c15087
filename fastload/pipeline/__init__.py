"""Per-field image decode and augmentation with NVIDIA DALI, on the GPU or the CPU.

A *transform* (see :mod:`fastload.pipeline.presets`: ``train``, ``eval``, ``custom``)
describes a DALI graph from encoded bytes to a fixed-shape image. ``transform.runner(...)``
builds that graph for one device and batch size and returns a :class:`Runner`, which the
loader calls once per batch with zero-copy views of the encoded bytes in the memory-mapped
shards (``fn.external_source``). ``device="cuda"`` decodes with the ``mixed`` decoder
(nvJPEG) and runs the other operators on the GPU. ``device="cpu"`` runs the CPU variants of
the same operators (``device_id=None``), except that the ``train`` and ``eval`` presets end
DALI's graph at the decoder there and resize, crop, flip and normalize each image in torch,
straight into the batch (:mod:`fastload.pipeline.host_tail`: torch's antialiased bilinear
resize, the same filter, costs about a quarter of DALI's on the CPU). ``dali_only=True``
keeps the whole graph in DALI on the CPU too (the benches' "DALI alone").

Bad images: DALI fails a whole batch. The runner then finds the failing sample(s) by
bisection (rebuilding the graph after each failure, ~10 ms) and raises :class:`BadSamples`
with their positions and DALI's reason; images whose recorded size exceeds ``max_pixels``
are refused before any decoding.
"""
from __future__ import annotations

from ..errors import BadSamples
from .runner import Runner, default_threads

__all__ = ["BadSamples", "Runner", "default_threads"]

"""What a Loader builds and owns: the ring, the DALI decoders and the device delivery.

Each is built on first use and handed down to the epoch's source as a value; ``source()``
is the one place that chooses between host and CUDA delivery. ``Parts`` holds no reference
to the Loader, so the Loader's finalizer can close it when the Loader is garbage collected:
``close()`` ends a live epoch, stops the DALI pipelines, waits for device copies, and joins
the ring's threads.
"""
from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from ..ring import Ring
from .decode import Decoders
from .host import HostSource
from .options import Options
from .source import INDEX, BatchSource
from .stats import Stats

__all__ = ["Parts"]


class Parts:
    def __init__(self, dataset, options: Options, stats: Stats) -> None:
        self._dataset = dataset
        self._opts = options
        self._stats = stats
        self._ring: Ring | None = None
        self._decoders: Decoders | None = None
        self._delivery = None  # CudaDelivery on a CUDA device
        self._iter_ref: weakref.ref | None = None

    @property
    def cuda(self) -> bool:
        return self._opts.device.type == "cuda"

    def ring(self) -> Ring:
        """Raw fields (gathered from the memory-mapped shards), on the host path the image
        fields' outputs (filled by the feeders), and the int64 ``"index"`` field."""
        if self._ring is None:
            ds, o = self._dataset, self._opts
            specs: dict[str, Any] = {}
            sources: dict[str, list] = {}
            for n in o.raw_fields:
                f = ds.fields[n]
                specs[n] = (f.np_dtype, f.shape)
                sources[n] = [ds.column(s, n) for s in range(ds.num_shards)]
            if not self.cuda:
                for n in o.image_fields:
                    t = o.transforms[n]
                    specs[n] = (np.dtype(t.out_dtype), tuple(t.out_shape))
            specs[INDEX] = (np.int64, ())
            ring = Ring(specs, o.batch_size, sources, index_field=INDEX, threads=o.threads,
                        slots=max(o.prefetch + 2, 3))
            self._ring = ring
            self._stats.attach("ring", lambda: {"gather_s": ring.stats()["gather_ns"] / 1e9})
        return self._ring

    def ring_stats(self) -> dict | None:
        ring = self._ring
        if ring is None or ring.closed:
            return None
        s = ring.stats()
        if self._delivery is not None:
            s["pinned"] = self._delivery.pinned
        return s

    def decoders(self) -> Decoders:
        if self._decoders is None:
            o = self._opts
            self._decoders = Decoders(o.transforms, device=o.device.type,
                                      device_id=o.device.index if self.cuda else None,
                                      batch_size=o.batch_size, seed=o.seed)
        return self._decoders

    def delivery(self):
        if self._delivery is None:
            from .cuda import CudaDelivery

            self._delivery = CudaDelivery(self.ring(), self._opts.device)
            self._stats.attach("cuda", self._delivery.probe)
        return self._delivery

    def source(self, epoch: int) -> BatchSource:
        """This epoch's source of ready batches: host or CUDA delivery."""
        o = self._opts
        decoders = self.decoders() if o.image_fields else None
        common = dict(ring=self.ring(), dataset=self._dataset, image_fields=o.image_fields, decoders=decoders,
                      epoch=epoch, on_error=o.on_error, stats=self._stats)
        if self.cuda:
            from .cuda import CudaSource

            return CudaSource(delivery=self.delivery(), device=o.device, **common)
        return HostSource(**common)

    # -- the live epoch --------------------------------------------------------------------
    def track(self, it) -> None:
        # weak: an iterator keeps its loader alive, never the other way round
        self._iter_ref = weakref.ref(it)

    def stop_iter(self) -> None:
        it = self._iter_ref() if self._iter_ref is not None else None
        self._iter_ref = None
        if it is not None:
            it.close()

    def close(self) -> None:
        self.stop_iter()
        decoders, self._decoders = self._decoders, None
        if decoders is not None:
            decoders.close()
        delivery, self._delivery = self._delivery, None
        if delivery is not None:
            delivery.close()
        ring, self._ring = self._ring, None
        if ring is not None:
            ring.close()

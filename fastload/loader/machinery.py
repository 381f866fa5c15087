"""A Loader's machinery: everything of it that holds threads, memory or files.

The ring (and its gather threads), the DALI decoders (and the thread building them ahead),
the image feeder, the CUDA delivery, a remote dataset's downloads and a dataset the Loader
opened itself. Each is built on first use and handed down to the epoch's source as a value;
``source()`` is the one place that chooses between host and CUDA delivery (and the threaded
wrapper for the user's transforms). The Loader keeps its values elsewhere (options, sampler,
stats); this is the part it must close. ``Machinery`` holds no reference to the Loader, so
the Loader's finalizer can close it when the Loader is garbage collected: ``close()`` ends a
live epoch, stops the DALI pipelines, waits for device copies, and joins the ring's threads.
"""
from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Any

import numpy as np

from ..runtime import lifecycle
from ..sampling.packing import max_pieces
from ..pipeline.multi import SampleTransform
from ..ring.ring import Ring
from ..store.mapped import mapped_shard_limit
from ..runtime.system import IMAGE_FEEDERS, loader_nice, lower_priority
from .decode import Decoders
from .finish import Finish
from .feeder import ImageFeeder
from .host import HostSource
from .ragged import ring_field
from .threaded import ThreadedSource
from .options import Options
from .shards import LocalShards
from .source import INDEX, BatchSource
from .stats import Stats

__all__ = ["Machinery", "images_checked", "slot_images"]

WARM_JOIN_S = 30.0  # close() waits this long for the DALI pipelines being built ahead

logger = logging.getLogger("fastload")


class Machinery:
    def __init__(self, dataset, options: Options, stats: Stats, *, remote=None, owned=None) -> None:
        self._dataset = dataset
        self._remote = remote  # RemoteShards for a remote dataset (remote.py), else None
        self._local: LocalShards | None = None  # a local dataset of many shards: installed lazily (shards.py)
        self._owned = owned  # a dataset the Loader opened (a path, a URL, a mixture): closed with it
        self._opts = options
        self._stats = stats
        self._ring: Ring | None = None
        self._decoders: Decoders | None = None
        self._delivery = None  # CudaDelivery on a CUDA device
        self._feeder: ImageFeeder | None = None  # the image fields' workers, across epochs (feeder.py)
        self._iter_ref: weakref.ref | None = None
        self._warm: threading.Thread | None = None  # builds the DALI pipelines ahead (warm())
        self._pid = os.getpid()
        self.forked = False  # True in a child forked from the process that built this machinery
        lifecycle.track(self)
        # what the machinery reports as it is (stats.py: gauges), after the per-epoch counters
        stats.gauge("verify", dataset.verify_stats)
        if options.image_fields:
            stats.gauge("undecodable_samples", self.undecodable)
        stats.gauge("ring", self.ring_stats)

    # -- process lifecycle (see fastload/runtime/lifecycle.py) ---------------------------------------
    def _after_fork_in_child(self) -> None:
        # None of the threads exist here and their locks may be held: never touch them. The
        # ring is inert by itself (C++), the DALI runners leak their pipelines (runner.py).
        self.forked = True

    def _close_at_exit(self, deadline_s: float) -> None:
        if not self.forked:
            self.close()

    def check_process(self) -> None:
        """RuntimeError in a child forked after this machinery was built (it is inert there)."""
        if self.forked or lifecycle.forked(self._pid):
            raise RuntimeError(
                f"this Loader was created in process {self._pid}, before os.fork(); its threads do not exist in "
                f"this process ({os.getpid()}). Create a new fastload.Loader in the child process.")

    @property
    def cuda(self) -> bool:
        return self._opts.device.type == "cuda"

    def ring(self) -> Ring:
        """Raw fields (gathered from the memory-mapped shards), the int64 ``"index"``
        field, and on the host the image fields whose transform finishes in torch (the
        feeders write them into the slot: :func:`slot_images`); other decoded images never
        pass through it (they are DALI's own buffers)."""
        if self._ring is None:
            ds, o = self._dataset, self._opts
            specs: dict[str, Any] = {}
            sources: dict[str, list] = {}
            remote = self._remote is not None
            # past the limit on mapped shards, a local dataset's shards are installed as batches
            # need them (LocalShards), like a remote dataset's as they arrive (RemoteShards)
            limit = mapped_shard_limit()
            lazy = remote or ds.num_shards > limit
            for n in o.raw_fields:
                f = ds.fields[n]
                specs[n] = (f.np_dtype, f.shape)
                # a remote dataset's shards become sources as they arrive (RemoteShards.prepare);
                # views of every shard, each verified before a batch reads it (locate)
                sources[n] = [None if lazy else ds.column(s, n, verify=False) for s in range(ds.num_shards)]
            rows = o.slot_rows
            pack = o.pack
            if pack is not None:  # one row per piece: at most this many pieces per batch
                rows = max_pieces(ds.lengths(pack[0]), o.batch_size, pack[1].pack_to, pack[1].max_length)
            for n, d in o.ragged.items():
                specs[n] = ring_field(ds, n, d, o.slot_rows)
                sources[n] = [None if lazy else _values_offsets(ds.ragged_column(s, n, verify=False))
                              for s in range(ds.num_shards)]
            specs.update(slot_images(o))  # written by the feeders, no source
            specs[INDEX] = (np.int64, ())
            ring = Ring(specs, rows, sources, index_field=INDEX, threads=o.threads,
                        slots=o.slots, shard_rows=ds.shard_sizes.tolist(),
                        nice=loader_nice())
            self._ring = ring
            if self._remote is not None:
                self._remote.attach_ring(ring, o.raw_fields, tuple(o.ragged))
            elif lazy and (o.raw_fields or o.ragged):
                self._local = LocalShards(ring, ds, o.raw_fields, tuple(o.ragged), limit)
            self._stats.attach("ring", lambda: {"gather_s": ring.stats()["gather_ns"] / 1e9})
        return self._ring

    def check_pieces(self, plan) -> None:
        """A packed pass's batches fit the ring's rows (one per document piece; sized once
        from the documents' lengths by ``max_pieces``, an upper bound for any order)."""
        rows = self.ring().batch_size
        most = plan.most_pieces
        if most > rows:
            name, d = self._opts.pack
            raise RuntimeError(
                f"pack_to={d.pack_to} with batch_size={self._opts.batch_size}: a batch of epoch {plan.epoch} holds "
                f"{most} pieces of documents of {name!r}, more than the {rows} this Loader made room for from "
                f"the documents' lengths (max_length={d.max_length}); this is a bug in fastload, please report it "
                "with these numbers")

    def ring_stats(self) -> dict | None:
        ring = self._ring
        if ring is None or ring.closed or self.forked:
            return None
        s = ring.stats()
        if self._delivery is not None:
            s["pinned"] = self._delivery.pinned
        if self._local is not None:
            s["shards_installed"] = self._local.installed
        return s

    def decoders(self) -> Decoders:
        if self._decoders is None:
            o = self._opts
            self._decoders = Decoders(o.transforms, device=o.device.type,
                                      device_id=o.device.index if self.cuda else None,
                                      batch_size=o.slot_rows, seed=o.seed,
                                      checked=images_checked(self._dataset), output_ragged=o.output_ragged)
        return self._decoders

    def warm(self) -> None:
        """Build the image fields' DALI pipelines now, in a thread at the loader's priority
        (and, on CUDA, on the loader's device), while the training script builds its model:
        the first batch then does not wait for them (tens of ms on the CPU, more for nvJPEG).
        A pipeline that fails to build here is built again by its feeder, which reports why."""
        o = self._opts
        if not o.image_fields or self._warm is not None:
            return
        decoders = self.decoders()
        runners = [decoders.get(f, w) for w in range(IMAGE_FEEDERS) for f in o.image_fields]
        device = o.device if self.cuda else None

        def build() -> None:
            try:
                lower_priority()  # DALI's threads inherit it
                if device is not None:
                    from ..runtime.device import select

                    select(device)  # first: no CUDA call of this thread lands on cuda:0
                for r in runners:
                    r.prepare()
            except BaseException as e:  # the feeder builds it again and raises the error there
                logger.debug("fastload: building the DALI pipelines ahead failed: %s", e)

        self._warm = threading.Thread(target=build, name="fastload-warmup", daemon=True)
        self._warm.start()

    def undecodable(self) -> int:
        """Distinct samples the decoders refused so far (``on_error="skip"`` replaced them)."""
        return 0 if self._decoders is None else self._decoders.undecodable()

    def delivery(self):
        if self._delivery is None:
            from .cuda import CudaDelivery

            self._delivery = CudaDelivery(self.ring(), self._opts.device)
            self._stats.attach("cuda", self._delivery.probe)
        return self._delivery

    def feeder(self) -> ImageFeeder | None:
        """The image fields' feeder (None without image fields): one for as long as passes end
        normally, so its threads and DALI runners carry on from one epoch to the next; a pass
        closed early closes it (with every batch it held) and the next pass makes a new one."""
        o = self._opts
        if not o.image_fields:
            return None
        if self._feeder is None or self._feeder.closed:
            self._feeder = ImageFeeder(ring=self.ring(), dataset=self._dataset, image_fields=o.image_fields,
                                       decoders=self.decoders(), on_error=o.on_error, stats=self._stats,
                                       device=o.device if self.cuda else None,
                                       ensure=self._local.ensure if self._local is not None else None)
        return self._feeder

    def source(self, epoch: int) -> BatchSource:
        """This epoch's source of ready batches: host or CUDA delivery, run in a fastload
        thread when the user's transforms must run off the training loop's thread."""
        o = self._opts
        finish = Finish(dataset=self._dataset, options=o, epoch=epoch, on_host_device=not self.cuda)
        ring = self.ring()
        prepare = (self._remote if self._remote is not None  # (RemoteShards: prepare and idle)
                   else self._local if self._local is not None else None)  # (LocalShards: prepare and idle)
        common = dict(ring=ring, dataset=self._dataset, feeder=self.feeder(), epoch=epoch, finish=finish,
                      prepare=prepare)
        threaded = o.batch_transform is not None or o.device_transform is not None
        if self.cuda:
            from .cuda import CudaSource, StreamHandoff

            src = CudaSource(delivery=self.delivery(), device=o.device, device_transform=o.device_transform,
                             **common)
            return ThreadedSource(src, handoff=StreamHandoff(o.device)) if threaded else src
        src = HostSource(**common)
        return ThreadedSource(src) if threaded else src

    # -- the live epoch --------------------------------------------------------------------
    def track(self, it) -> None:
        # weak: an iterator keeps its loader alive, never the other way round
        self._iter_ref = weakref.ref(it)

    def stop_iter(self, reason: str | None = None) -> None:
        """End the live pass, if any; ``reason``: what its later ``next()`` calls raise (epoch.py)."""
        it = self._iter_ref() if self._iter_ref is not None else None
        self._iter_ref = None
        if it is not None and not self.forked:
            it.close(reason)

    def close(self) -> None:
        if self.forked:  # a child's inert copy: drop references, join and lock nothing
            self._iter_ref = None
            return
        lifecycle.untrack(self)
        self.stop_iter("the Loader was closed during this pass (close(), or the interpreter exiting)")
        self._take("_feeder", "close")  # and with it what a pass looking ahead had put (epoch.py: LookAhead)
        warm = self._take("_warm", "join", WARM_JOIN_S)  # a pipeline being built: closed below once it exists
        if warm is not None and warm.is_alive():  # a build that hangs (a stuck GPU): left to it
            self._decoders = None
            logger.warning("fastload: building the DALI pipelines did not finish within %.0f s; closing without "
                           "them (the daemon thread is left behind and does not keep the process alive)", WARM_JOIN_S)
        self._local = None
        for name in ("_decoders", "_delivery", "_remote", "_ring", "_owned"):  # in this order: users first
            self._take(name, "close")

    def _take(self, name: str, method: str, *args):
        """Detach the part ``name`` (None from now on) and call its ``method``; returns the part."""
        part = getattr(self, name)
        setattr(self, name, None)
        if part is not None:
            getattr(part, method)(*args)
        return part


def _values_offsets(column: tuple) -> tuple:
    offsets, values = column
    return values, offsets


def slot_images(o) -> dict[str, tuple]:
    """``{ring field: (dtype, shape)}`` of the images decoded into ring slots: on the host,
    those whose transform ends its DALI graph at the decoder and finishes each image in torch,
    straight into the batch (``Transform.finishes_on_cpu``; a slot outlives nothing the user
    holds, see ring.py); for a sample transform, its dense outputs made by that finish."""
    if o.device.type == "cuda":
        return {}
    out: dict[str, tuple] = {}
    for n in o.image_fields:
        t = o.transforms[n]
        if not t.finishes_on_cpu:
            continue
        if isinstance(t, SampleTransform):
            out.update({k: (t.outputs[k].np_dtype, tuple(t.outputs[k].shape)) for k in t.graph_outputs()
                        if not t.outputs[k].ragged})
        else:
            out[n] = (np.dtype(t.out_dtype), tuple(t.out_shape))
    return out


def images_checked(dataset) -> bool:
    """Whether ``fastload convert`` decoded every image of ``dataset`` with DALI (its manifest
    says so): then no batch can fail to decode unless a shard changed, which verification
    catches."""
    manifest = getattr(dataset, "manifest", None)
    return isinstance(manifest, dict) and (manifest.get("metadata") or {}).get("images_checked") == "dali"

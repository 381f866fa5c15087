"""The contract between an epoch's iteration and whatever produces its batches.

A *source of ready batches* takes the epoch's batch requests in order (``put``: a
:class:`~fastload.sampling.packing.Request` holds the global sample indices, the batch's stream
position and, when packing, each row's window of tokens) and hands back, in the same order,
batches ready for the training loop (``get``):
every delivered field as a tensor on the loader's device, ``"index"`` included (the global
indices actually delivered, after any replacement of undecodable images). ``close()`` ends
the epoch's work: threads started for it are joined, batches still in flight are drained.

Two implementations, one per device: ``HostSource`` (``host.py``: batches in host memory,
zero-copy views of ring slots) and ``CudaSource`` (``cuda.py``: batches on a CUDA device).
Neither branches on the other's case. ``ThreadedSource`` (``threaded.py``) wraps either one to
run the user's transforms in a fastload thread. ``Machinery.source`` (``machinery.py``) is the
one place that chooses, once per pass.
"""
from __future__ import annotations

import collections
from typing import Any, NamedTuple, Protocol, Sequence

import numpy as np

from ..sampling.packing import Request

__all__ = ["DRAIN_TIMEOUT_S", "INDEX", "BatchSource", "Ready", "Request", "RingFedSource", "submit_batches"]

DRAIN_TIMEOUT_S = 30.0  # close() waits at most this long for a batch in flight

INDEX = "index"  # the ring field (and batch key) holding each batch's global sample indices


class Ready(NamedTuple):
    batch: dict[str, Any]  # field -> tensor on the loader's device, "index" included
    index: np.ndarray  # the same global indices as a host int64 array (for host-side lookups)


class BatchSource(Protocol):
    # True when batches are best put in runs (one locate + one submit for many batches):
    # the epoch then refills only when half of the batches in flight have been taken.
    amortize: bool

    def put(self, batches: Sequence[Request]) -> None:
        """Request these batches, after every earlier one."""

    def get(self) -> Ready:
        """The next batch in request order; raises the batch's error (e.g. DecodeError)."""

    def close(self) -> None:
        """Stop this epoch's work: join its threads, drain what is in flight. Idempotent."""


def submit_batches(ring, dataset, batches: Sequence[Request]) -> None:
    """Submit consecutive batches with one call: located by the ring in C++ when they have
    equal sizes (the sampler only shortens the last one), else located here and submitted
    with their sizes; their indices fill ``INDEX`` and their windows (packing) the ragged
    fields'. Shards are verified when a batch is taken (``next_request``)."""
    idx_all = np.concatenate([b.index for b in batches]) if len(batches) > 1 else batches[0].index
    sizes = {len(b.index) for b in batches[:-1]}
    windows = batches[0].start is not None
    if not windows and len(sizes) <= 1 and (not sizes or len(batches[-1].index) <= next(iter(sizes))):
        # the ring locates them in C++ (its shard rows are the dataset's: the same numbering)
        ring.submit_indices(idx_all, len(batches[0].index))
        return
    shard, row = dataset.locate(idx_all, check=False, verify=False)  # verified when taken (next_request)
    sizes = [len(b.index) for b in batches]
    if windows:  # packed sequences: one row per piece, pieces per batch vary
        start = np.concatenate([b.start for b in batches]) if len(batches) > 1 else batches[0].start
        count = np.concatenate([b.count for b in batches]) if len(batches) > 1 else batches[0].count
        ring.submit_sizes(shard, row, sizes, index=idx_all, start=start, count=count)
        return
    ring.submit_sizes(shard, row, sizes, index=idx_all)


class RingFedSource:
    """What both sources share: batches go to the image feeder when there is one (it fills
    the ring or hands over device batches), else straight to the ring in runs.

    The feeder outlives an epoch (the Loader's machinery owns it): its requests carry their epoch,
    so the next pass's first batches can be put while this pass's last ones are consumed
    (``Loader``'s look-ahead). ``close()`` after every request was delivered, none half way
    (``get`` calls ``taken()`` once its batch is off the ring and the feeder: a Ctrl-C or an
    error in between leaves the feeder's queues out of step with the ring), leaves the feeder
    running (what it holds belongs to the next pass); otherwise it closes the feeder and drains
    the ring, so every slot is free again (a feeder is made anew for the next pass), and the
    same without a feeder."""

    def __init__(self, ring, dataset, feeder, epoch: int, prepare=None) -> None:
        self._ring = ring
        self._dataset = dataset
        self._feeder = feeder
        self._epoch = epoch
        self._prepare = prepare  # a remote dataset or many local shards: install the batches' shards first
        self.amortize = feeder is None
        self._closed = False
        self._requests: collections.deque = collections.deque()  # put, not yet taken: in order
        self._clean = True  # no get() left half done (a request taken, its batch not)

    @property
    def feeder_alive(self) -> bool:
        """Whether the feeder this source put its batches into still runs (a pass that
        ended early closed it, and with it what was put for the next pass)."""
        return self._feeder is not None and not self._feeder.closed

    def put(self, batches: Sequence[Request]) -> None:
        if batches and not self._dataset.fully_verified:  # their shards hashed ahead, in order of use
            idx = np.concatenate([b.index for b in batches]) if len(batches) > 1 else batches[0].index
            self._dataset.verify_ahead(self._dataset.locate(idx, check=False, verify=False)[0])  # (not remote)
        if self._prepare is not None and batches:  # their shards local and installed in the ring first
            plan_through = getattr(self._prepare, "plan_through", None)  # a remote pass: planned that far first
            if plan_through is not None:
                plan_through(batches)
            self._prepare([b.index for b in batches])
        self._requests.extend(batches)  # before the ring can deliver them
        if self._feeder is not None:
            for req in batches:
                self._feeder.put(req.index, self._epoch)
        elif batches:
            submit_batches(self._ring, self._dataset, batches)

    def next_request(self) -> Request:
        """The request of the batch ``get`` delivers now (requests come back in order), its
        shards verified first (as the dataset's policy says): a batch waits for its own
        shards only, the others are hashed ahead in the background (``put``)."""
        self._clean = False  # until taken(): an interrupted get() leaves the feeder out of step
        req = self._requests.popleft()
        if not self._dataset.fully_verified:
            self._dataset.locate(req.index, check=False)
        return req

    def taken(self) -> None:
        """``get`` has taken its batch from the ring and the feeder: nothing is half done."""
        self._clean = True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._feeder is not None and not self._requests and self._clean:
            return  # all delivered: the feeder carries on (the next pass's batches may be in it)
        self._dataset.stop_verify_ahead()
        if self._feeder is None or self._feeder.close():  # else closed already, with what it held
            drained = self._ring.drain(timeout=DRAIN_TIMEOUT_S)  # never waits longer for a batch that does not come
            idle = getattr(self._prepare, "idle", None)  # LocalShards: the dropped batches free their shards
            if drained and idle is not None:
                idle()

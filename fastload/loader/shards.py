"""LocalShards: a local dataset's shards installed as ring sources as batches need them.

A Loader's ring gathers raw fields from the memory-mapped shards. A dataset of up to
:func:`~fastload.store.mapped.mapped_shard_limit` shards (a few thousand) gives the ring
every shard up front. A larger one would need a mapping per shard, and a process may hold
only ``vm.max_map_count`` of them (65,530 by default): at 100,000 shards the first batch
failed with ``Cannot allocate memory``. So the ring starts with no shard loaded (its per-shard
tables are then row counts and null pointers), and before batches go to the ring
(``prepare``, called by the epoch's source with every batch request, in order) their shards
are mapped and installed (``Ring.set_source``).

Past the limit, the installed shards that no batch in flight needs are dropped, those
needed longest ago first. A batch is in flight from its ``prepare`` until the ring hands it
out: the ring delivers in submission order, and every ring batch is one prepared batch
(submitted or acquired after its ``prepare``; one that never reached the ring only delays
drops), so shard ``s`` is free once the ring has delivered more batches than the position of
the last prepared batch that needs it. A delivered batch is a copy in a ring slot and views
no shard; dropping a source waits for the gathers that read it (``Ring.set_source``) and
the reader's views keep a mapping alive while anything holds them. Verification is
unchanged: the epoch's source still verifies each batch's shards before delivering it.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

__all__ = ["LocalShards"]

KEEP = 0.75  # past the limit, drop down to this share of it (drops come in runs, not one per batch)


class LocalShards:
    """See the module docstring. ``fields``: the ring's raw (fixed-size) fields, ``ragged``
    its ragged ones; ``limit``: installed shards kept at most (while batches in flight
    allow); ``managed``: the shards it installs and drops (a bool per shard; None: all; a
    mixture with remote datasets leaves their shards to RemoteShards)."""

    def __init__(self, ring, dataset, fields: Sequence[str], ragged: Sequence[str], limit: int,
                 managed: np.ndarray | None = None) -> None:
        self._ring = ring
        self._ds = dataset
        self._fields, self._ragged = tuple(fields), tuple(ragged)
        self.limit = max(1, int(limit))
        n = dataset.num_shards
        self._installed = np.zeros(n, dtype=bool)
        self._last = np.full(n, -1, dtype=np.int64)  # position of the last prepared batch needing the shard
        self._managed = None if managed is None else np.asarray(managed, dtype=bool)
        self._count = 0  # shards installed now
        self._prepared = 0  # batches prepared so far (the next one's position)
        self._lock = threading.Lock()
        self.installs = 0
        self.drops = 0

    @property
    def installed(self) -> int:
        """Shards installed in the ring now."""
        return self._count

    def prepare(self, batches: Sequence[np.ndarray]) -> None:
        """Install the shards of these batches (global sample indices, one array per batch,
        in the order they go to the ring); drop shards no batch in flight needs, past the
        limit. A shard that cannot be mapped raises its FormatError here."""
        if not batches:
            return
        sizes = [len(b) for b in batches]
        idx = np.concatenate(batches) if len(batches) > 1 else np.asarray(batches[0])
        shard = self._ds.locate(idx, check=False, verify=False)[0]
        with self._lock:
            pos = np.repeat(np.arange(self._prepared, self._prepared + len(sizes), dtype=np.int64), sizes)
            np.maximum.at(self._last, shard, pos)
            self._prepared += len(sizes)
            try:
                need = self._mine(np.unique(shard))
                new = need[~self._installed[need]]
                if self._count + len(new) > self.limit:
                    self._drop_unneeded(self._count + len(new) - int(self.limit * KEEP))
                for s in new.tolist():
                    self._install(s)
            except BaseException:
                # these batches never reach the ring: their positions go to the next ones (the
                # shards they marked are held until those are delivered: harmless)
                self._prepared -= len(sizes)
                raise

    __call__ = prepare  # the epoch's source calls its prepare hook

    def idle(self) -> None:
        """The ring was drained with its feeder closed (a pass that ended early): every batch
        prepared so far was delivered or dropped before it reached the ring. Positions restart
        at the ring's delivered count; else the dropped batches' positions, never delivered,
        would hold their shards for good, and past enough early ends no shard would be
        dropped any more (the process would map shards up to ``vm.max_map_count``)."""
        with self._lock:
            if self._ring.closed or self._ring.pending:
                return
            delivered = int(self._ring.stats()["delivered"])
            self._prepared = delivered
            np.minimum(self._last, delivered - 1, out=self._last)

    def ensure(self, index: np.ndarray) -> None:
        """Install the shards of these samples for a batch already prepared (an image whose
        decoding failed is replaced by the next sample, which may lie in the next shard);
        they stay installed until every batch prepared so far is delivered."""
        shard = self._mine(np.unique(self._ds.locate(np.asarray(index, dtype=np.int64), check=False,
                                                    verify=False)[0]))
        with self._lock:
            self._last[shard] = np.maximum(self._last[shard], self._prepared - 1)
            for s in shard[~self._installed[shard]].tolist():
                self._install(s)

    def _mine(self, shards: np.ndarray) -> np.ndarray:
        return shards if self._managed is None else shards[self._managed[shards]]

    def _install(self, s: int) -> None:
        arrays: dict = {n: self._ds.column(s, n, verify=False) for n in self._fields}  # verified per batch
        for n in self._ragged:
            offsets, values = self._ds.ragged_column(s, n, verify=False)
            arrays[n] = (values, offsets)
        self._ring.set_source(s, arrays)
        self._installed[s] = True
        self._count += 1
        self.installs += 1

    def _drop_unneeded(self, want: int) -> None:
        """Drop up to ``want`` installed shards that no undelivered batch needs, the ones
        needed longest ago first (with the lock held)."""
        if want <= 0 or self._ring.closed:
            return
        delivered = self._ring.stats()["delivered"]
        ids = np.flatnonzero(self._installed)
        free = ids[self._last[ids] < delivered]
        if len(free) > want:
            free = free[np.argpartition(self._last[free], want - 1)[:want]]
        for s in free.tolist():
            self._ring.set_source(s, None)
            self._installed[s] = False
            self._count -= 1
            self.drops += 1

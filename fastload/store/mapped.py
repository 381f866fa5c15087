"""How many shards a process keeps memory-mapped, and the bounded set a local reader holds.

Each mapped shard is one memory mapping, and Linux allows a process ``vm.max_map_count`` of
them (65,530 by default; ``fastload doctor`` compares a dataset's shards with it). A dataset
of more shards than that cannot be mapped all at once, so a local reader keeps at most
:func:`mapped_shard_limit` shards mapped, dropping the least recently used one first
(:class:`ShardMaps`); the Loader's ring holds its sources the same way
(``fastload/loader/shards.py``). Dropping a shard drops the reader's reference only: views
handed out keep the mapping alive until they go (``_C.map_file`` unmaps when the last one
does), so nothing reads unmapped memory.

A shard mapped again after it was dropped must be the very file that was mapped (and
verified) before: same device, inode, size, modification and change times. A file replaced
or rewritten in between raises FormatError naming it, instead of delivering bytes that were
never checked against the manifest.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import FormatError

__all__ = ["ENV_LIMIT", "ShardMaps", "mapped_shard_limit"]

ENV_LIMIT = "FASTLOAD_MAPPED_SHARDS"  # overrides the limit (an int >= 1)
MOST = 4096  # a few thousand at most: far below the default vm.max_map_count
MAP_SHARE = 4  # at most this share of vm.max_map_count (the ring's sources, the process, its libraries)


def mapped_shard_limit(max_map_count: int | None = None) -> int:
    """Shards a reader (and, separately, a Loader's ring) keeps mapped at most:
    ``$FASTLOAD_MAPPED_SHARDS`` if set, else the smaller of 4096 and a quarter of
    ``vm.max_map_count`` (this process's, unless given; at least 16)."""
    v = os.environ.get(ENV_LIMIT, "").strip()
    if v:
        try:
            n = int(v)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"{ENV_LIMIT}={v!r} must be an int >= 1 (the most shards kept memory-mapped at once)")
        return n
    if max_map_count is None:
        try:
            with open("/proc/sys/vm/max_map_count") as fh:
                max_map_count = int(fh.read().strip())
        except (OSError, ValueError):
            return MOST
    return max(16, min(MOST, max_map_count // MAP_SHARE))


def identity(mm: Any) -> int:
    """What tells a mapped file from another one at the same path (``_C.map_file``'s stat:
    device, inode, size, modification and change times), as one nonzero int64 (a hash)."""
    h = hash((mm.st_dev, mm.st_ino, mm.size, mm.st_mtime_ns, mm.st_ctime_ns)) & 0x7FFF_FFFF_FFFF_FFFF
    return h or 1


class ShardMaps:
    """The mapped shards of a local reader: at most ``limit``, the least recently used
    dropped first. ``table`` is the reader's per-shard list (``None``: not mapped), kept in
    step; the caller holds its lock around :meth:`add`."""

    def __init__(self, table: list, limit: int) -> None:
        self.table = table
        self.limit = int(limit)
        self._order: OrderedDict[int, None] = OrderedDict()
        self._dropped: np.ndarray | None = None  # identity of each dropped shard's mapping (0: none)
        self.dropped = 0  # shards dropped so far (stats, tests)

    def __len__(self) -> int:
        return len(self._order)

    def touch(self, i: int) -> None:
        """Shard ``i`` (mapped) was used now."""
        try:
            self._order.move_to_end(i)
        except KeyError:  # dropped meanwhile by another thread: its next use maps it again
            pass

    def add(self, i: int, shard: Any, describe: Callable[[int], str]) -> None:
        """Shard ``i`` was just mapped: check it is the file dropped earlier (if it was),
        hold it, and drop the least recently used ones past the limit."""
        was = 0 if self._dropped is None else int(self._dropped[i])
        if was and identity(shard.mm) != was:  # (still remembered: the next try checks again)
            raise FormatError(
                f"shard {describe(i)} changed while the dataset was open (it was unmapped to stay under the "
                f"process's memory-map limit and mapped again, and it is no longer the file read before: "
                "replaced, rewritten or touched); reopen the dataset, and run `fastload verify` if nothing "
                "should have changed it")
        self.table[i] = shard
        self._order[i] = None
        while len(self._order) > self.limit:
            j, _ = self._order.popitem(last=False)
            old = self.table[j]
            self.table[j] = None
            if old is not None:
                if self._dropped is None:  # 8 bytes a shard, once shards are dropped at all
                    self._dropped = np.zeros(len(self.table), dtype=np.int64)
                self._dropped[j] = identity(old.mm)
                self.dropped += 1

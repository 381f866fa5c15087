"""Verification on use: a reader's shards are checked against the manifest's checksums
before any of their rows is delivered.

:class:`ShardVerifier` is the reader's bookkeeping for the policy of
:mod:`fastload.store.verified_record` (``"first-use"``, ``"always"``, ``"off"``): which shards are
verified, which are being hashed (by which thread does not matter: a reader that needs a
shard another thread is hashing waits for it), which failed (and why: a failed shard fails
the same way on every later read), and what the checks cost. With ``"first-use"``, shards
the node's :class:`~fastload.store.verified_record.VerifiedRecord` vouches for are not hashed
again, and the shards still to hash are hashed one per lock, several at once, so ranks on a
node share the work.

Two ways in. :meth:`ShardVerifier.ensure` (a read needs these shards now) hashes what is
left of them in the calling thread and a pool, and returns when they are verified.
:meth:`ShardVerifier.ahead` (a Loader knows what its next batches read) queues shards in
the order the batches will need them, and background threads hash them ahead of use, then
the dataset's other shards in index order, so a Loader's first batch waits only for its own
shards and later batches seldom wait at all. Whole-dataset verification (``fastload
verify``) is :mod:`fastload.store.full_check`.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import FormatError
from ..runtime.system import lower_priority, usable_cores
from .format import MANIFEST
from .verified_record import VerifiedRecord, hash_mapped

__all__ = ["ANNOUNCE_BYTES", "ShardVerifier"]

logger = logging.getLogger("fastload")

ANNOUNCE_BYTES = 1 << 30  # hashing this much or more is said in the log (a warning from 10x this)
STOP_TIMEOUT_S = 30.0  # stop_ahead() waits this long for a background hash in progress


class ShardVerifier:
    """Which shards of one reader are verified, as its ``policy`` says. ``entries`` are the
    manifest's shard entries (their ``checksum`` and ``bytes``), ``files`` the shards' paths
    and ``where`` the dataset (path or URL), for messages. ``all_verified`` is True once
    nothing is left to check (at once with ``"off"``)."""

    def __init__(self, policy: str, entries: list[dict], files: Sequence[Path], where: Any) -> None:
        n = len(entries)
        off = policy == "off"
        self.policy = policy
        self._entries = entries
        self._files = files
        self._where = where
        self.verified = np.full(n, off, dtype=bool)
        self.all_verified = off or n == 0
        self._bad: dict[int, str] = {}  # shard -> why it failed verification
        self._busy: set[int] = set()  # shards some thread of this process is checking now
        self._cond = threading.Condition()
        self._record = VerifiedRecord() if policy == "first-use" else None
        self.counts = {"shards_hashed": 0, "shards_remembered": 0, "bytes_hashed": 0, "hash_s": 0.0,
                       "shards_hashed_ahead": 0}
        self._announced = False
        # background hashing ahead of use (see ahead())
        self._queue: collections.deque[int] = collections.deque()
        self._queued = np.zeros(n, dtype=bool)
        self._rest = 0  # the next shard (index order) to consider once the queue is empty
        self._threads: list[threading.Thread] = []
        self._active = 0  # background threads that have not decided to exit
        self._stopping = False
        self._map: Callable[[int], Any] | None = None
        self.ahead_workers = max(1, min(4, usable_cores() // 2))

    def after_fork(self) -> None:
        # The parent's threads do not exist here: nothing is being hashed, nothing runs ahead.
        self._cond = threading.Condition()
        self._busy = set()
        self._queue = collections.deque()
        self._queued[:] = False
        self._threads, self._active, self._stopping = [], 0, False

    # -- checking shards now -----------------------------------------------------------------
    def ensure(self, shards: Any, map_shard: Callable[[int], Any]) -> None:
        """Check the bytes of these shards (``map_shard(i)`` maps shard ``i``, structural
        checks included) against the manifest's checksums, unless already done; FormatError
        names a shard that does not match. Shards another thread is hashing are waited for.
        Cheap once every shard is verified."""
        if self.all_verified:
            return
        ids = np.unique(np.asarray(shards, dtype=np.int64))
        need = ids[~self.verified[ids]]
        if len(need) == 0:
            return
        with self._cond:
            mine, theirs = [], []
            for i in map(int, need):
                if i in self._bad:
                    raise FormatError(self._bad[i])
                if not self.verified[i]:
                    (theirs if i in self._busy else mine).append(i)
            self._busy.update(mine)
        try:
            self._check(mine, map_shard)
        finally:
            with self._cond:
                self._busy.difference_update(mine)
                self._cond.notify_all()
        with self._cond:
            while any(i in self._busy for i in theirs):
                self._cond.wait(0.5)
            for i in sorted(mine + theirs):
                if i in self._bad:
                    raise FormatError(self._bad[i])
            left = [i for i in theirs if not self.verified[i]]  # a background check that could not map it
        if left:
            self.ensure(left, map_shard)

    def _check(self, ids: list[int], map_shard: Callable[[int], Any], *, pool: bool = True) -> None:
        """Map (structural checks: their errors propagate), hash and judge shards ``ids``,
        which the caller marked busy."""
        if not ids:
            return
        mapped = [map_shard(i) for i in ids]  # structural checks first
        expected = [self._entries[i]["checksum"] for i in ids]
        if self._record is None:
            self._announce()
            got = self._hash(mapped, ids, pool)
        else:
            got = self._hash_with_record(mapped, ids, expected, pool)
        with self._cond:
            for i, g, e in zip(ids, got, expected):
                if g != e:
                    self._bad[i] = (
                        f"shard {self._files[i]} does not match the manifest: its checksum is {g}, "
                        f"{MANIFEST} records {e}. The file was damaged or changed after the dataset was written "
                        "(a flipped byte, a swapped, replaced or re-linked shard); restore it or convert the "
                        f"source again (`fastload verify {self._where}` lists every damaged shard)")
                else:
                    self.verified[i] = True
            if self.verified.all():
                self.all_verified = True

    def _announce(self) -> None:
        """One log line when this reader starts hashing a lot: how many shards and bytes are
        not verified yet, and how to avoid the wait."""
        with self._cond:
            if self._announced:
                return
            self._announced = True
        left = np.flatnonzero(~self.verified)
        nbytes = sum(int(self._entries[i]["bytes"]) for i in left)
        if nbytes < ANNOUNCE_BYTES:
            return
        logger.log(logging.WARNING if nbytes >= 10 * ANNOUNCE_BYTES else logging.INFO,
                   "fastload: checking %s against its manifest's checksums before first use: up to %d shards "
                   "(%.1f GB) not yet verified on this node, each read once (about %.0f s at 1 GB/s; batches wait "
                   "for their own shards). Run `fastload verify %s` ahead of time to do it once for the node, or "
                   "pass verify=\"off\" to skip it", self._where, len(left), nbytes / 1e9, nbytes / 1e9,
                   self._where)

    def _pool_map(self, fn: Callable[[int], Any], items: list[int], pool: bool) -> list:
        if len(items) <= 1 or not pool:
            return [fn(j) for j in items]
        with ThreadPoolExecutor(max_workers=min(len(items), usable_cores()),
                                thread_name_prefix="fastload-verify") as ex:
            return list(ex.map(fn, items))

    def _hash(self, mapped: list[Any], ids: list[int], pool: bool) -> list[str]:
        t0 = time.perf_counter()
        got = hash_mapped([s.mm for s in mapped]) if pool else [s.mm.hash_xxh3_128() for s in mapped]
        with self._cond:
            c = self.counts
            c["hash_s"] += time.perf_counter() - t0
            c["shards_hashed"] += len(ids)
            c["bytes_hashed"] += sum(int(s.mm.size) for s in mapped)
        return got

    def _hash_with_record(self, mapped: list[Any], ids: list[int], expected: list[str], pool: bool) -> list[str]:
        """Hash what the node's record does not vouch for, one shard per lock (so ranks on
        a node share the work instead of each hashing everything); remember matches."""
        record = self._record
        keys = [record.key(s.mm, e) for s, e in zip(mapped, expected)]
        got: list[str | None] = [e if record.contains(k) else None for k, e in zip(keys, expected)]
        with self._cond:
            self.counts["shards_remembered"] += sum(g is not None for g in got)
        todo = [j for j, g in enumerate(got) if g is None]

        def one(j: int) -> tuple[str, bool]:
            self._announce()
            with record.locked(keys[j], int(mapped[j].mm.size), self._files[ids[j]]):
                if record.contains(keys[j]):  # another process hashed it meanwhile
                    return expected[j], False
                hashed_at = time.time()
                h = mapped[j].mm.hash_xxh3_128()
                if h == expected[j]:
                    record.add(keys[j], mapped[j].mm, h, hashed_at=hashed_at)
                return h, True

        if todo:
            t0 = time.perf_counter()
            results = self._pool_map(one, todo, pool)
            with self._cond:
                c = self.counts
                c["hash_s"] += time.perf_counter() - t0
                for j, (h, hashed) in zip(todo, results):
                    got[j] = h
                    if hashed:
                        c["shards_hashed"] += 1
                        c["bytes_hashed"] += int(mapped[j].mm.size)
                    else:
                        c["shards_remembered"] += 1
        return got  # type: ignore[return-value]

    # -- hashing ahead of use, in the background ----------------------------------------------
    def ahead(self, shards: Any, map_shard: Callable[[int], Any]) -> None:
        """Hash these shards in background threads, in this order (first appearance), then
        the other unverified shards in index order; returns at once. A read of a shard still
        queued hashes it itself (:meth:`ensure`); one being hashed is waited for. A shard
        that fails is reported by the read that needs it. :meth:`stop_ahead` ends it."""
        if self.all_verified:
            return
        s = np.asarray(shards, dtype=np.int64).reshape(-1)
        uniq, first = np.unique(s, return_index=True)
        order = uniq[np.argsort(first, kind="stable")]
        order = order[~self.verified[order] & ~self._queued[order]]
        with self._cond:
            self._map = map_shard
            self._stopping = False
            for i in map(int, order):
                if not self._queued[i]:
                    self._queued[i] = True
                    self._queue.append(i)
            self._threads = [t for t in self._threads if t.is_alive()]
            while self._active < self.ahead_workers:
                t = threading.Thread(target=self._run_ahead, name="fastload-verify-ahead", daemon=True)
                self._active += 1
                self._threads.append(t)
                t.start()

    def _next_ahead(self) -> int | None:
        """The next shard for a background thread (called with the lock held)."""
        n = len(self.verified)
        while self._queue:
            i = self._queue.popleft()
            if not self.verified[i] and i not in self._busy and i not in self._bad:
                return i
        while self._rest < n:
            i = self._rest
            self._rest += 1
            if not self.verified[i] and i not in self._busy and i not in self._bad:
                return i
        return None

    def _run_ahead(self) -> None:
        counted = True  # in self._active, until this thread decides to exit (under the lock)
        try:
            lower_priority()  # behind the training step and the loader's own threads
            while True:
                with self._cond:
                    i = None if self._stopping else self._next_ahead()
                    if i is None:
                        self._active -= 1
                        counted = False
                        return
                    self._busy.add(i)
                    map_shard = self._map
                try:
                    self._check([i], map_shard, pool=False)
                    with self._cond:
                        self.counts["shards_hashed_ahead"] += 1
                except Exception:  # a structural error: the read that needs this shard meets it itself
                    pass
                finally:
                    with self._cond:
                        self._busy.discard(i)
                        self._cond.notify_all()
        finally:
            if counted:  # pragma: no cover - only if something above raised past its handlers
                with self._cond:
                    self._active -= 1

    def stop_ahead(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop hashing ahead and join the background threads (a hash in progress finishes
        first; at most ``timeout`` seconds). Idempotent; :meth:`ahead` starts again."""
        with self._cond:
            self._stopping = True
            self._queue.clear()
            self._queued[:] = False
            threads = list(self._threads)
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = [t for t in threads if t.is_alive()]
        if alive:  # pragma: no cover - a hash slower than the deadline (a hung file system)
            logger.warning("fastload: %d verification thread(s) of %s still hashing after %.0f s; left running",
                           len(alive), self._where, timeout)
        with self._cond:
            self._threads = alive

    def stats(self) -> dict:
        """The policy and what it cost so far: shards verified, shards hashed (by background
        threads ahead of use: ``shards_hashed_ahead``), shards the node's record vouched for,
        bytes hashed, seconds spent hashing (summed over threads' wall)."""
        with self._cond:
            counts = dict(self.counts)
        return {"policy": self.policy, "shards_verified": int(self.verified.sum()) if
                self.policy != "off" else 0, "num_shards": len(self._entries), **counts}

"""Verification on use: a reader's shards are checked against the manifest's checksums
before any of their rows is delivered.

:class:`ShardVerifier` is the reader's bookkeeping for the policy of
:mod:`fastload.store.integrity` (``"first-use"``, ``"always"``, ``"off"``): which shards are
verified, which failed (and why: a failed shard fails the same way on every later read),
and what the checks cost. With ``"first-use"``, shards the node's
:class:`~fastload.store.integrity.VerifiedRecord` vouches for are not hashed again, and
the shards still to hash are hashed one per lock, several at once, so ranks on a node share
the work. Whole-dataset verification (``fastload verify``) is :mod:`fastload.store.verify`.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..errors import FormatError
from ..system import usable_cores
from .format import MANIFEST
from .integrity import VerifiedRecord, hash_mapped

__all__ = ["ShardVerifier"]


class ShardVerifier:
    """Which shards of one reader are verified, as its ``policy`` says. ``entries`` are the
    manifest's shard entries (their ``checksum``), ``files`` the shards' paths and ``where``
    the dataset (path or URL), for messages. ``all_verified`` is True once nothing is left
    to check (at once with ``"off"``)."""

    def __init__(self, policy: str, entries: list[dict], files: list[Path], where: Any) -> None:
        n = len(entries)
        off = policy == "off"
        self.policy = policy
        self._entries = entries
        self._files = files
        self._where = where
        self.verified = np.full(n, off, dtype=bool)
        self.all_verified = off or n == 0
        self._bad: dict[int, str] = {}  # shard -> why it failed verification
        self._lock = threading.Lock()
        self._record = VerifiedRecord() if policy == "first-use" else None
        self.counts = {"shards_hashed": 0, "shards_remembered": 0, "bytes_hashed": 0, "hash_s": 0.0}

    def after_fork(self) -> None:
        # A thread of the parent may have held the lock at fork time.
        self._lock = threading.Lock()

    def ensure(self, shards: Any, map_shard: Callable[[int], Any]) -> None:
        """Check the bytes of these shards (``map_shard(i)`` maps shard ``i``, structural
        checks included) against the manifest's checksums, unless already done; FormatError
        names a shard that does not match. Cheap once every shard is verified."""
        if self.all_verified:
            return
        ids = np.unique(np.asarray(shards, dtype=np.int64))
        need = ids[~self.verified[ids]]
        if len(need) == 0:
            return
        with self._lock:
            need = [int(i) for i in need if not self.verified[i]]
            for i in need:
                if i in self._bad:
                    raise FormatError(self._bad[i])
            mapped = [map_shard(i) for i in need]  # structural checks first
            expected = [self._entries[i]["checksum"] for i in need]
            if self._record is None:
                got = self._hash(mapped, need)
            else:
                got = self._hash_with_record(mapped, need, expected)
            for i, g, e in zip(need, got, expected):
                if g != e:
                    self._bad[i] = (
                        f"shard {self._files[i]} does not match the manifest: its checksum is {g}, "
                        f"{MANIFEST} records {e}. The file was damaged or changed after the dataset was written "
                        "(a flipped byte, a swapped, replaced or re-linked shard); restore it or convert the "
                        f"source again (`fastload verify {self._where}` lists every damaged shard)")
                    raise FormatError(self._bad[i])
                self.verified[i] = True
            if self.verified.all():
                self.all_verified = True

    def _hash(self, mapped: list[Any], ids: list[int]) -> list[str]:
        t0 = time.perf_counter()
        got = hash_mapped([s.mm for s in mapped])
        c = self.counts
        c["hash_s"] += time.perf_counter() - t0
        c["shards_hashed"] += len(ids)
        c["bytes_hashed"] += sum(int(s.mm.size) for s in mapped)
        return got

    def _hash_with_record(self, mapped: list[Any], ids: list[int], expected: list[str]) -> list[str]:
        """Hash what the node's record does not vouch for, one shard per lock (so ranks on
        a node share the work instead of each hashing everything); remember matches."""
        record = self._record
        keys = [record.key(s.mm, e) for s, e in zip(mapped, expected)]
        got: list[str | None] = [e if record.contains(k) else None for k, e in zip(keys, expected)]
        self.counts["shards_remembered"] += sum(g is not None for g in got)
        todo = [j for j, g in enumerate(got) if g is None]

        def one(j: int) -> tuple[str, bool]:
            with record.locked(keys[j]):
                if record.contains(keys[j]):  # another process hashed it meanwhile
                    return expected[j], False
                h = mapped[j].mm.hash_xxh3_128()
                if h == expected[j]:
                    record.add(keys[j], mapped[j].mm, h)
                return h, True

        if todo:
            t0 = time.perf_counter()
            if len(todo) == 1:
                results = [one(todo[0])]
            else:
                from concurrent.futures import ThreadPoolExecutor

                with ThreadPoolExecutor(max_workers=min(len(todo), usable_cores()),
                                        thread_name_prefix="fastload-verify") as pool:
                    results = list(pool.map(one, todo))
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

    def stats(self) -> dict:
        """The policy and what it cost so far: shards verified, shards hashed, shards the
        node's record vouched for, bytes hashed, seconds spent hashing (summed over threads'
        wall)."""
        return {"policy": self.policy, "shards_verified": int(self.verified.sum()) if
                self.policy != "off" else 0, "num_shards": len(self._entries), **self.counts}

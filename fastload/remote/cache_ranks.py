"""The node's ranks sharing one cache: who is alive, and how far the slowest one has read.

Part of :mod:`fastload.remote.cache`. :class:`_NodeRanks` is the part of
:class:`~fastload.remote.cache.ShardCache` that

* holds this rank's ``.locks/alive-<local rank>`` flock while its cache is open (the kernel
  drops it when the process dies: peers then stop waiting for it);
* writes ``.progress/rank-<local rank>`` (its position on the timeline, or ``done``);
* reads the peers' files to get the node's position: the minimum over the live local ranks,
  which gates admission and eviction (a rank not started yet holds the start of the run for
  at most ``owner_grace_s``).
"""
from __future__ import annotations

import socket
import time

from .cache_files import _write_atomic

__all__: list[str] = []


class _NodeRanks:
    """Mixin of :class:`~fastload.remote.cache.ShardCache` (uses the lock and position
    attributes set by its ``__init__``)."""

    def _claim_alive(self) -> None:
        """Hold this rank's ``alive`` lock. Another open cache of the same rank (a second
        Dataset in this process, a DataLoader worker) already holds it: then this one runs
        without it (peers see the rank through the first)."""
        deadline = time.monotonic() + 0.2
        while not self._alive.try_lock():
            if time.monotonic() > deadline:
                self._alive.close()
                return
            time.sleep(0.01)

    def _write_progress(self) -> None:
        if self.local_world_size > 1:
            _write_atomic(self._progress_path, f"{self._my_t} {self._pass} {socket.gethostname()}\n")

    def _is_alive(self, rank: int) -> bool:
        if rank == self.local_rank:
            return True
        f = self._peer_alive.get(rank)
        if f is None or f.fd is None:
            return False
        if f.try_lock():
            f.unlock()
            return False
        return True

    def _refresh_node_t(self, force: bool = False) -> int:
        """min over the live local ranks of their timeline position."""
        if self.local_world_size == 1:
            self._node_t = self._my_t
            self._rank_t = [self._my_t]
            return self._node_t
        now = time.monotonic()
        if not force and now - self._node_t_at < self._poll:
            return self._node_t
        t = self._my_t
        ranks = [t]
        hold = self._passes[0]["base"] if self._passes else 0  # nothing of this run evicted yet
        for r in self._peer_alive:
            peer = self._peer_position(r, hold, now)
            if peer is None:
                continue
            t = min(t, peer)
            ranks.append(peer)
        self._node_t, self._node_t_at, self._rank_t = t, now, ranks
        return t

    def _peer_position(self, r: int, hold: int, now: float) -> int | None:
        """Local rank ``r``'s timeline position; None when it does not count (it finished or
        died in this run); ``hold`` while it has not started this run yet (a rank slower to
        start must not find its first shards evicted), for at most ``owner_grace_s``."""
        alive = self._is_alive(r)
        fresh = None
        try:
            p = self.dir / ".progress" / f"rank-{r}"
            if p.stat().st_mtime >= self._t_open - 1.0:  # written in this run
                fresh = p.read_text(encoding="utf-8").split()
        except (OSError, ValueError):
            fresh = None
        if fresh:
            if fresh[0] == "done":
                return None
            if alive:
                try:
                    return int(fresh[0])
                except ValueError:
                    return hold
            return None  # it ran in this run and its process is gone: it died
        if alive or now - self._t_open_mono < self.owner_grace_s:
            return hold  # not started yet (or between opening its cache and its first pass)
        return None

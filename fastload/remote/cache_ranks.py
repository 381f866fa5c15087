"""The node's ranks sharing one cache: who is alive, and how far the slowest one has read.

Part of :mod:`fastload.remote.cache`. :class:`NodeRanks` is this process among the node's
local ranks that share a cache directory:

* it holds this rank's ``.locks/alive-<local rank>`` flock while its cache is open (the
  kernel drops it when the process dies: peers then stop waiting for it);
* it writes ``.progress/rank-<local rank>`` (its position on the timeline, or ``done``);
* it reads the peers' files to get the node's position: the minimum over the live local
  ranks, which gates admission and eviction (a rank not started yet holds the start of the
  run for at most ``owner_grace_s``);
* it says which rank owns (downloads) a shard, and when this rank fetches another's itself.

It knows nothing of shards' sizes, passes or threads: positions are numbers on the timeline
that the caller passes in.
"""
from __future__ import annotations

import socket
import time

from ..files import atomic_write
from .cache_files import CacheFiles, _Flock

__all__ = ["NodeRanks"]


class NodeRanks:
    """``local_rank`` of ``local_world_size`` ranks sharing the cache directory ``files``
    (checked already). ``owner_grace_s``: how long a live owner rank is waited for;
    ``poll_s``: how often the peers' positions are read at most."""

    def __init__(self, files: CacheFiles, local_rank: int, local_world_size: int, *, owner_grace_s: float,
                 poll_s: float):
        self.local_rank, self.local_world_size = int(local_rank), int(local_world_size)
        self.owner_grace_s = float(owner_grace_s)
        self._files = files
        self._poll = float(poll_s)
        self._alive = files.lock(f"alive-{self.local_rank}")
        self._claim_alive()
        self._peer_alive = {r: files.lock(f"alive-{r}") for r in range(self.local_world_size) if r != self.local_rank}
        self._progress_path = files.progress(f"rank-{self.local_rank}")
        self._t_open, self._t_open_mono = time.time(), time.monotonic()
        self.node_t = 0  # the node's position: min over the live local ranks (this one included)
        self.positions: list[int] = [0]  # timeline positions of the live local ranks (this one first)
        self._node_t_at = 0.0

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

    # -- ownership ---------------------------------------------------------------------------
    def owner(self, shard: int) -> int:
        """The local rank that downloads ``shard``."""
        return int(shard) % self.local_world_size

    def mine(self, shard: int) -> bool:
        return self.owner(shard) == self.local_rank

    def fetch_for_owner(self, shard: int, waited: float) -> bool:
        """This rank fetches ``shard`` itself (having waited ``waited`` seconds for it): it is
        its own, or its owner's process is gone, or the owner was waited for long enough."""
        owner = self.owner(shard)
        return owner == self.local_rank or not self.is_alive(owner) or waited > self.owner_grace_s

    def is_alive(self, rank: int) -> bool:
        if rank == self.local_rank:
            return True
        f = self._peer_alive.get(rank)
        if f is None or f.fd is None:
            return False
        if f.try_lock():
            f.unlock()
            return False
        return True

    # -- positions ---------------------------------------------------------------------------
    def write_progress(self, t: int, pass_no: int) -> None:
        """This rank is at timeline position ``t`` of its pass ``pass_no`` (for the peers)."""
        if self.local_world_size > 1:
            atomic_write(self._progress_path, f"{t} {pass_no} {socket.gethostname()}\n", fsync=False)

    def write_done(self) -> None:
        """This rank reads no more (its cache stopped): peers stop counting it."""
        if self.local_world_size > 1 and self._alive.fd is not None:
            atomic_write(self._progress_path, "done\n", fsync=False)

    def refresh(self, my_t: int, hold: int, force: bool = False) -> int:
        """The node's position: min over the live local ranks of their timeline positions,
        this one at ``my_t``; a peer that has not started this run counts at ``hold`` (the
        first planned position: nothing of this run is evicted under it). Read again at most
        every ``poll_s`` unless ``force``."""
        if self.local_world_size == 1:
            self.node_t = my_t
            self.positions = [my_t]
            return self.node_t
        now = time.monotonic()
        if not force and now - self._node_t_at < self._poll:
            return self.node_t
        t = my_t
        ranks = [t]
        for r in self._peer_alive:
            peer = self._peer_position(r, hold, now)
            if peer is None:
                continue
            t = min(t, peer)
            ranks.append(peer)
        self.node_t, self._node_t_at, self.positions = t, now, ranks
        return t

    def _peer_position(self, r: int, hold: int, now: float) -> int | None:
        """Local rank ``r``'s timeline position; None when it does not count (it finished or
        died in this run); ``hold`` while it has not started this run yet (a rank slower to
        start must not find its first shards evicted), for at most ``owner_grace_s``."""
        alive = self.is_alive(r)
        fresh = None
        try:
            p = self._files.progress(f"rank-{r}")
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

    # -- process lifecycle -------------------------------------------------------------------
    def after_fork(self, closed: bool) -> None:
        """In a forked child: the parent's ``alive`` flock is neither held nor released here,
        and the peers' flocks are opened again (an inherited descriptor shares the parent's
        lock, so it would not see the parent)."""
        self._alive.close()
        for f in self._peer_alive.values():
            f.close()
        if not closed:
            self._peer_alive = {r: _Flock(f.path) for r, f in self._peer_alive.items()}

    def close(self) -> None:
        """Leave the node: release this rank's ``alive`` flock and close the peers'."""
        for f in (self._alive, *self._peer_alive.values()):
            f.close()

"""One check across the ranks of a job: every rank reads the same dataset.

Each rank reads ``manifest.json`` itself, so ranks that open a dataset on either side of an
overwrite (``convert --overwrite`` while the job starts) would train on different data, and
their partitions of the epoch would not line up. A Loader whose rank and world size come from
an initialised ``torch.distributed`` process group publishes its dataset's fingerprint in the
process group's key-value store (TCP, on the CPU, whatever the backend) and compares it with
what the other ranks published for the same dataset location, once every rank has published:
at construction, else when its first epoch starts. Nothing ever waits for another rank (a
Loader built on some ranks only costs nothing and blocks nobody), and each rank makes O(1)
store requests at any world size. The last rank to publish always sees every fingerprint, so a
mismatch is raised on at least that rank (on every rank that starts an epoch after it built
its Loader), naming the ranks that disagree; torchrun then stops the job.

Keys are ``fastload/fingerprint/<hash of the location as given>/<n>/<rank>``, where ``n`` counts
the Loaders this process built over that location: a job that regenerates a dataset at the
same path between phases (and builds a new Loader on every rank) compares each phase with
itself.
"""
from __future__ import annotations

import hashlib
import logging
from typing import Any, Callable

from ..errors import FormatError
from ..runtime.world import World

__all__ = ["DatasetCheck"]

logger = logging.getLogger("fastload")

_PREFIX = "fastload/fingerprint"
_built: dict[str, int] = {}  # location key -> Loaders built over it in this process


def _store() -> Any:
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()  # noqa: SLF001 (the group's own store)
    except Exception:  # no default group, or a torch without it: nothing to check against
        return None


class DatasetCheck:
    """The cross-rank check of one Loader (see the module docstring). ``check()`` raises
    FormatError when another rank published a different fingerprint for this location."""

    def __init__(self, world: World, fingerprint: Callable[[], str], location: Any) -> None:
        self._world = world
        self._location = str(location)
        self._keys: list[str] = []
        self._store = None
        self._error: FormatError | None = None  # raised again by every later check()
        if world.source != "torch.distributed" or world.world_size < 2:
            return
        store = _store()
        if store is None:
            return
        loc = hashlib.sha256(self._location.encode("utf-8", "surrogateescape")).hexdigest()[:16]
        n = _built.get(loc, 0)
        _built[loc] = n + 1
        base = f"{_PREFIX}/{loc}/{n}"
        self._keys = [f"{base}/{r}" for r in range(world.world_size)]
        try:
            store.set(self._keys[world.rank], fingerprint())  # computed only under torch.distributed
        except Exception as e:  # a store that refuses: the check is a safety net, not a gate
            logger.debug("fastload: cannot publish the dataset fingerprint (%s)", e)
            return
        self._store = store

    def check(self) -> None:
        """Compare with the other ranks when every rank has published (one request to learn
        that, one to read them all: O(1) per rank at any world size); else nothing yet."""
        if self._error is not None:
            raise self._error
        if self._store is None:
            return
        try:
            if not self._store.check(self._keys):  # some rank has not built it yet: never wait
                return
            values = self._store.multi_get(self._keys)
        except Exception as e:
            logger.debug("fastload: cannot read the other ranks' dataset fingerprints (%s)", e)
            return
        self._store = None  # compared once: done
        prints = {rank: bytes(v).decode("ascii", "replace") for rank, v in enumerate(values)}
        if len(set(prints.values())) <= 1:
            return
        groups: dict[str, list[int]] = {}
        for rank, fp in sorted(prints.items()):
            groups.setdefault(fp, []).append(rank)
        said = "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {fp}"
                         for fp, r in groups.items())
        self._error = FormatError(f"the ranks opened different versions of {self._location} (dataset fingerprints {said}; "
                                  f"this is rank {self._world.rank}): it was probably replaced (e.g. by convert "
                                  "--overwrite) while the job started. Every rank must read the same dataset: start "
                                  "the job again")
        raise self._error

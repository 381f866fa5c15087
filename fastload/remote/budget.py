"""One byte budget shared by the caches of several remote datasets (a mixture).

Each dataset's cache holds to its own ``limit`` (see :mod:`fastload.remote.cache`). A
mixture of several URLs gets one ``cache_limit`` for all of them, as a user thinks of it
("20 GB of local disk for this job"), and the default is computed once for the disk they
share (80% of its free space), not once per dataset, which would promise the same free
space several times over. :func:`share_budget` hands each cache its part: first what its
order needs at one moment (its minimum: see :func:`~fastload.remote.schedule.minimum_budget`;
at least its largest shard), then the rest in proportion to what each still lacks to hold
its whole dataset.
"""
from __future__ import annotations

import numbers
import os
import shutil
from typing import Sequence

from ..errors import CacheTooSmall, format_bytes

__all__ = ["share_budget", "split_budget"]


def split_budget(total: int, needs: Sequence[int], sizes: Sequence[int]) -> list[int]:
    """Limits adding up to at most ``total``: each ``needs[i]``, plus the remainder shared in
    proportion to ``sizes[i] - needs[i]`` (never more than ``sizes[i]``). The caller checks
    ``sum(needs) <= total``."""
    needs = [min(int(n), int(z)) for n, z in zip(needs, sizes)]
    extra = int(total) - sum(needs)
    room = [max(0, int(z) - n) for n, z in zip(needs, sizes)]
    if sum(room) <= extra:
        return [int(z) for z in sizes]
    return [n + extra * r // sum(room) for n, r in zip(needs, room)]


def _default_total(caches: Sequence) -> int:
    """80% of the free space (plus what the caches hold already) of each disk the caches
    are on, at most the datasets' bytes, added up over the disks."""
    by_dev: dict[int, list] = {}
    for c in caches:
        by_dev.setdefault(os.stat(c.dir).st_dev, []).append(c)
    total = 0
    for group in by_dev.values():
        free = shutil.disk_usage(group[0].dir).free + sum(c.disk_usage() for c in group)
        total += max(1, min(sum(int(c.sizes.sum()) for c in group), int(0.8 * free)))
    return total


def share_budget(caches: Sequence, total: int | None = None, needs: Sequence[int] | None = None, *,
                 hint: str | None = None) -> int:
    """Set the limits of ``caches`` so that together they hold at most ``total`` bytes (the
    ``cache_limit`` of a :class:`~fastload.remote.options.RemoteOptions`, parsed there; None:
    the default above), each at least ``needs[i]`` (default: its largest shard). Returns the
    total. :class:`CacheTooSmall` names each dataset's need when the total cannot hold them."""
    if total is not None and (isinstance(total, bool) or not isinstance(total, numbers.Integral)):
        raise TypeError(f"share_budget takes the budget in bytes (cache_limit as RemoteOptions parsed it), got "
                        f"{total!r}")
    total = _default_total(caches) if total is None else int(total)
    biggest = [int(c.sizes.max()) if c.num_shards else 0 for c in caches]
    needs = biggest if needs is None else [max(int(n), b) for n, b in zip(needs, biggest)]
    if sum(needs) > total:
        each = ", ".join(f"{c.url}: {format_bytes(n)}" for c, n in zip(caches, needs))
        raise CacheTooSmall(
            f"cache_limit={format_bytes(total)} for the mixture's remote datasets is too small: reading them needs "
            f"{format_bytes(sum(needs))} of shards on disk at the same time ({each}). Raise cache_limit to at least "
            f"{format_bytes(sum(needs))} ({sum(needs)} bytes)" + (f", or {hint}" if hint else ""),
            minimum=sum(needs))
    for c, limit in zip(caches, split_budget(total, needs, [int(c.sizes.sum()) for c in caches])):
        c.set_limit(limit)
    return total

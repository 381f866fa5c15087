"""Who am I in the job: rank and world size, and this process among the node's processes,
as a small value (imitating streaming's World).

Rank and world size: explicit arguments win; else an initialised ``torch.distributed``
process group; else the ``RANK``/``WORLD_SIZE`` environment variables (as set by torchrun);
else a single process. A unit test can be rank 1 of 4 inside one process by passing both
numbers.

Local rank and local world size (the job's processes on this node, which share its cores,
GPUs and shard cache): explicit arguments win; else torchrun's ``LOCAL_RANK`` /
``LOCAL_WORLD_SIZE``; else None, "the launcher did not say" (count it as 0 / 1). A
malformed value (not a non-negative / positive integer) counts as not said. This module is
the one place that reads those two variables (:func:`local_env`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from ..validate import check_int


def local_env() -> tuple[int | None, int | None]:
    """``(LOCAL_RANK, LOCAL_WORLD_SIZE)`` as torchrun sets them; None for one that is unset
    or malformed (LOCAL_RANK not an integer >= 0, LOCAL_WORLD_SIZE not an integer >= 1). Reads
    only the environment (no torch), so the thread and device policies may ask it cheaply."""
    lr = os.environ.get("LOCAL_RANK", "").strip()
    lws = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    return (int(lr) if lr.isdigit() else None,
            int(lws) if lws.isdigit() and int(lws) > 0 else None)


@dataclass(frozen=True)
class World:
    rank: int = 0
    world_size: int = 1
    source: str = "default"
    local_rank: int | None = None  # among the node's processes; None: not said (count it as 0)
    local_world_size: int | None = None  # the job's processes on this node; None: not said (count it as 1)

    def __post_init__(self):
        check_int("world_size", self.world_size, min=1)
        check_int("rank", self.rank, min=0)
        if not self.rank < self.world_size:
            raise ValueError(f"rank={self.rank!r} must be an int in [0, world_size={self.world_size})")
        if self.local_rank is not None:
            check_int("local_rank", self.local_rank, min=0)
        if self.local_world_size is not None:
            check_int("local_world_size", self.local_world_size, min=1)

    @classmethod
    def detect(cls, rank: int | None = None, world_size: int | None = None, *,
               local_rank: int | None = None, local_world_size: int | None = None) -> World:
        if rank is not None:
            rank = check_int("rank", rank, min=0)
        if world_size is not None:
            world_size = check_int("world_size", world_size, min=1)
        env_lr, env_lws = local_env()
        lr = env_lr if local_rank is None else check_int("local_rank", local_rank, min=0)
        lws = env_lws if local_world_size is None else check_int("local_world_size", local_world_size, min=1)
        if rank is not None and world_size is not None:
            return cls(rank, world_size, "arguments", lr, lws)
        src = "default"
        r, w = 0, 1
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                r, w, src = dist.get_rank(), dist.get_world_size(), "torch.distributed"
        except ImportError:  # pragma: no cover - torch without distributed
            pass
        if src == "default" and ("RANK" in os.environ or "WORLD_SIZE" in os.environ):
            try:
                r = int(os.environ.get("RANK", "0").strip())
                w = int(os.environ.get("WORLD_SIZE", "1").strip())
            except ValueError:
                raise ValueError(f"RANK={os.environ.get('RANK')!r} / WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} "
                                 "must be integers") from None
            src = "environment"
        if rank is not None:
            r, src = rank, "arguments"
        if world_size is not None:
            w, src = world_size, "arguments"
        return cls(r, w, src, lr, lws)

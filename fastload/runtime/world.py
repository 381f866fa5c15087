"""Who am I in the job: rank and world size as a small value (imitating streaming's World).

Explicit arguments win; else an initialised ``torch.distributed`` process group; else the
``RANK``/``WORLD_SIZE`` environment variables (as set by torchrun); else a single process.
A unit test can be rank 1 of 4 inside one process by passing both numbers.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from ..validate import check_int


@dataclass(frozen=True)
class World:
    rank: int = 0
    world_size: int = 1
    source: str = "default"

    def __post_init__(self):
        check_int("world_size", self.world_size, min=1)
        check_int("rank", self.rank, min=0)
        if not self.rank < self.world_size:
            raise ValueError(f"rank={self.rank!r} must be an int in [0, world_size={self.world_size})")

    @classmethod
    def detect(cls, rank: int | None = None, world_size: int | None = None) -> "World":
        if rank is not None:
            rank = check_int("rank", rank, min=0)
        if world_size is not None:
            world_size = check_int("world_size", world_size, min=1)
        if rank is not None and world_size is not None:
            return cls(rank, world_size, "arguments")
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
        return cls(r, w, src)

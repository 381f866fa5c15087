"""Who am I in the job: rank and world size as a small value (imitating streaming's World).

Explicit arguments win; else an initialised ``torch.distributed`` process group; else the
``RANK``/``WORLD_SIZE`` environment variables (as set by torchrun); else a single process.
A unit test can be rank 1 of 4 inside one process by passing both numbers.
"""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class World:
    rank: int = 0
    world_size: int = 1
    source: str = "default"

    def __post_init__(self):
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size={self.world_size!r} must be an int >= 1")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank!r} must be an int in [0, world_size={self.world_size})")

    @classmethod
    def detect(cls, rank: int | None = None, world_size: int | None = None) -> "World":
        if rank is not None and world_size is not None:
            return cls(int(rank), int(world_size), "arguments")
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
                r = int(os.environ.get("RANK", "0"))
                w = int(os.environ.get("WORLD_SIZE", "1"))
            except ValueError:
                raise ValueError(f"RANK={os.environ.get('RANK')!r} / WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} "
                                 "must be integers") from None
            src = "environment"
        if rank is not None:
            r, src = int(rank), "arguments"
        if world_size is not None:
            w, src = int(world_size), "arguments"
        return cls(r, w, src)

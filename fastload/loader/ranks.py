"""One check across the ranks of a job: every rank reads the same dataset.

Each rank reads ``manifest.json`` itself, so ranks that open a dataset on either side of an
overwrite (``convert --overwrite`` while the job starts) would train on different data, and
their partitions of the epoch would not line up. A Loader whose rank and world size come from
an initialised ``torch.distributed`` process group compares its dataset's fingerprint with
every other rank's once, at construction (a fixed-size ``all_gather`` of the fingerprint's
bytes: no pickle), and raises naming the ranks that disagree.
"""
from __future__ import annotations

from typing import Any

from ..errors import FormatError
from ..world import World

__all__ = ["check_same_dataset"]


def check_same_dataset(world: World, fingerprint: str, where: Any) -> None:
    """Raise FormatError on every rank if the ranks' ``fingerprint``\\ s (16 hex digits of the
    dataset they opened) differ. Nothing unless the world comes from torch.distributed."""
    if world.source != "torch.distributed" or world.world_size < 2:
        return
    import torch
    import torch.distributed as dist

    mine = torch.tensor(list(fingerprint.encode("ascii")[:16].ljust(16, b"?")), dtype=torch.uint8)
    if str(dist.get_backend()) == "nccl":  # NCCL gathers device tensors only
        mine = mine.to(torch.device("cuda", torch.cuda.current_device()))
    parts = [torch.empty_like(mine) for _ in range(world.world_size)]
    dist.all_gather(parts, mine)
    prints = [bytes(p.cpu().tolist()).decode("ascii", "replace") for p in parts]
    if len(set(prints)) == 1:
        return
    groups: dict[str, list[int]] = {}
    for rank, fp in enumerate(prints):
        groups.setdefault(fp, []).append(rank)
    said = "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {fp}" for fp, r in groups.items())
    raise FormatError(f"the ranks opened different versions of {where} (dataset fingerprints {said}; this is "
                      f"rank {world.rank}): it was probably replaced (e.g. by convert --overwrite) while the "
                      "job started. Every rank must read the same dataset: start the job again")

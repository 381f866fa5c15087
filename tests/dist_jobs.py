"""Functions run on every rank by tests/_dist.py (a real gloo process group is initialised)."""
from __future__ import annotations

import itertools
import os

import numpy as np
import torch
import torch.distributed as dist


def _gather(x: np.ndarray) -> np.ndarray:
    """all_gather of equal-length int64 arrays from every rank, concatenated in rank order."""
    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64))
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return torch.cat(parts).numpy()


def _agree(value: int) -> tuple[int, int]:
    t = torch.tensor([value, -value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t[0]), int(-t[1])


def sampler_epoch(n: int, batch_size: int, seed: int, epoch: int, stop_after: int | None = None,
                  state: dict | None = None, drop_last: bool = False) -> dict:
    """Each rank builds its Sampler from the process group; returns what the ranks read
    together (gathered collectively) and rank 0's state after `stop_after` steps."""
    from fastload import Sampler
    from fastload.runtime.world import World

    world = World.detect()
    assert world.source == "torch.distributed", world
    s = Sampler(n, batch_size=batch_size, world_size=world.world_size, rank=world.rank, seed=seed,
                drop_last=drop_last)
    if state is not None:
        s.load_state_dict(state)
    s.set_epoch(epoch)
    batches = list(itertools.islice(s, stop_after))  # islice stops before pulling one more
    mine = np.concatenate(batches) if batches else np.empty(0, np.int64)
    most, least = _agree(len(batches))
    assert most == least, f"ranks read different numbers of batches: {least}..{most}"
    every = _gather(mine)
    return {"rank": world.rank, "world_size": world.world_size, "batches": len(batches),
            "read": every.tolist(), "state": s.state_dict()}


def loader_epoch(path: str, batch_size: int, seed: int, epoch: int, stop_after: int | None = None,
                 state: dict | None = None) -> dict:
    """Each rank builds a Loader (rank and world size from the process group), reads its part
    of the epoch (optionally stopping early), checks every row against the store, and all
    ranks gather what was read."""
    import fastload

    ds = fastload.Dataset(path)
    with fastload.Loader(ds, batch_size=batch_size, seed=seed, fields=["x", "label"], device="cpu") as loader:
        assert loader.sampler.world_size == dist.get_world_size() and loader.sampler.rank == dist.get_rank()
        if state is not None:
            loader.load_state_dict(state)
        loader.set_epoch(epoch)
        read, ok = [], True
        for b in itertools.islice(loader, stop_after):
            idx = b["index"].numpy()
            ok &= bool(np.array_equal(b["x"].numpy(), ds.get_batch(idx, fields=["x"])["x"]))
            read.append(idx.copy())
        out_state = loader.state_dict()
    mine = np.concatenate(read) if read else np.empty(0, np.int64)
    most, least = _agree(len(read))
    assert most == least, f"ranks read different numbers of batches: {least}..{most}"
    return {"read": _gather(mine).tolist(), "state": out_state, "rows_ok": ok}


def mixture_epoch(paths: dict, stop_after: int | None = None, state: dict | None = None) -> dict:
    """Each rank reads its part of a mixture's epoch 0 (stopping early or resuming from
    `state`); returns the mixed samples' x (gathered over ranks, step by step) and the state."""
    import fastload

    from fastload.store.mixture import Mixture

    mix = Mixture({n: fastload.Dataset(p) for n, p in paths.items()}, [0.5, 0.3, 0.2], epoch_size=333)
    with fastload.Loader(mix, batch_size=8, seed=11) as loader:
        if state is not None:
            loader.load_state_dict(state)
        loader.set_epoch(0)
        steps = [b["x"].numpy().copy() for b in itertools.islice(loader, stop_after)]
        out_state = loader.state_dict()
    most, least = _agree(len(steps))
    assert most == least
    # step by step, rank 0's rows then rank 1's ...: the order the stream was split in
    read = [_gather(s) for s in steps]
    return {"read": np.concatenate(read).tolist() if read else [], "state": out_state}


def packed_epoch(path: str, stop_after: int | None = None, state: dict | None = None) -> dict:
    """Each rank reads its rows of a packed epoch (pack_to=48, 2 rows per batch); returns the
    tokens all ranks read, step by step in rank order, and the state."""
    import fastload

    with fastload.Loader(path, batch_size=2, seed=9, pack_to=48, drop_last=True, fields=["tokens"]) as loader:
        if state is not None:
            loader.load_state_dict(state)
        loader.set_epoch(0)
        steps = [b["tokens"].numpy().reshape(-1).astype(np.int64) for b in itertools.islice(loader, stop_after)]
        out_state = loader.state_dict()
    most, least = _agree(len(steps))
    assert most == least
    read = [_gather(s) for s in steps]
    return {"read": np.concatenate(read).tolist() if read else [], "state": out_state}


def loader_on_own_dataset(dirs: list) -> dict:
    """Rank r works in dirs[r], where ``ds`` is the dataset: the same location, but rank 1's
    holds other bytes (a dataset replaced while the job started). A Loader must refuse it,
    naming the ranks, on the rank that builds its Loader last (at construction) and on every
    rank that starts an epoch after all were built; nothing waits for another rank."""
    import fastload
    from fastload.errors import FormatError

    rank = dist.get_rank()
    with fastload.Loader(os.path.join(dirs[0], "ds"), batch_size=4, device="cpu") as loader:  # the same: fine
        agreed = len(next(iter(loader))["index"])
    os.chdir(dirs[rank])
    errors, loader = [], None
    # the ranks build their Loaders one after the other (rank order): two ranks publishing
    # at once before either compares would both see every fingerprint at construction
    # (the product promises "at least the last rank"); so the last one is known
    for turn in range(dist.get_world_size()):
        if turn == rank:
            try:
                loader = fastload.Loader("ds", batch_size=4, device="cpu")
            except FormatError as e:
                errors.append(("construction", str(e)))
        dist.barrier()  # every rank has built (or failed to build) its Loader after the last turn
    if loader is not None:
        try:
            next(iter(loader))
        except FormatError as e:
            errors.append(("first epoch", str(e)))
        finally:
            loader.close()
    return {"agreed": agreed, "errors": errors}


def loader_on_rank_0_only(path: str) -> dict:
    """A Loader built and read on rank 0 only (rank 1 goes straight to the barrier): nothing
    may wait for a rank that never builds one."""
    import fastload

    batches = 0
    if dist.get_rank() == 0:
        with fastload.Loader(path, batch_size=4, device="cpu") as loader:
            batches = sum(1 for _ in loader)
    dist.barrier()
    return {"batches": batches}

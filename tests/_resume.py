"""One resume check for every loader configuration (in the spirit of torchdata's
``run_test_save_load_state``): stop after each number of batches, save the state, resume it
in a new loader — the same world size or another — and compare with the uninterrupted run.

    check_resume(lambda **kw: fastload.Loader(path, batch_size=4, **kw), epochs=2)

``make(rank=, world_size=)`` builds a fresh loader. Batches are compared as dicts of numpy
arrays (every key, bytes exact). At another world size the batches differ, so the check is
on what all ranks read together: each key's rows, concatenated in step order.
"""
from __future__ import annotations

import itertools
from typing import Callable

import numpy as np


def as_numpy(batch: dict) -> dict:
    return {k: (v.numpy().copy() if hasattr(v, "numpy") else list(v)) for k, v in batch.items()}


def run(loader, epochs: int, start_epoch: int = 0, stop_after: int | None = None) -> tuple[list, dict | None]:
    """Batches of ``epochs`` epochs from ``start_epoch`` (the first possibly resumed); with
    ``stop_after``, stop after that many batches and return the state then."""
    out = []
    for e in range(start_epoch, start_epoch + epochs):
        loader.set_epoch(e)
        it = iter(loader)
        for b in it:
            out.append(as_numpy(b))
            if stop_after is not None and len(out) == stop_after:
                state = loader.state_dict()
                it.close()
                return out, state
    return out, None


def assert_same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b), f"{len(a)} batches vs {len(b)}"
    for k, (x, y) in enumerate(zip(a, b)):
        assert x.keys() == y.keys(), (k, x.keys(), y.keys())
        for key in x:
            if isinstance(x[key], list):
                assert x[key] == y[key], (k, key)
            else:
                assert x[key].dtype == y[key].dtype and x[key].shape == y[key].shape, (k, key)
                assert x[key].tobytes() == y[key].tobytes(), (k, key)


def check_resume(make: Callable, *, epochs: int = 2, stops: list[int] | None = None) -> list[dict]:
    """Resume at every stop (default: every batch boundary of the run) on one rank; returns
    the uninterrupted run."""
    with make() as loader:
        full, _ = run(loader, epochs)
        per_epoch = len(full) // epochs
    for stop in (stops if stops is not None else range(len(full) + 1)):
        with make() as first:
            head, state = run(first, epochs, stop_after=stop) if stop else ([], None)
        with make() as second:
            start_epoch = 0
            if state is not None:
                second.load_state_dict(state)
                start_epoch = state["sampler"]["epoch"]
            tail, _ = run(second, epochs - start_epoch, start_epoch=start_epoch)
        assert_same(head + tail, full) if per_epoch else None
    return full


def rows_read(make: Callable, world_size: int, *, epoch: int = 0, state: dict | None = None,
              stop_after: int | None = None, key: str = "index") -> tuple[np.ndarray, dict | None]:
    """What ``world_size`` ranks read together, step by step (rank 0's rows of a step, then
    rank 1's, ...), and rank 0's state when every rank stopped after ``stop_after`` steps."""
    per_rank, states = [], []
    for r in range(world_size):
        with make(rank=r, world_size=world_size) as loader:
            if state is not None:
                loader.load_state_dict(state)
            loader.set_epoch(epoch)
            it = iter(loader)
            batches = [as_numpy(b)[key] for b in itertools.islice(it, stop_after)]
            states.append(loader.state_dict())
            it.close()
        per_rank.append(batches)
    steps = len(per_rank[0])
    assert all(len(p) == steps for p in per_rank), [len(p) for p in per_rank]
    rows = [per_rank[r][k] for k in range(steps) for r in range(world_size)]
    return (np.concatenate(rows) if rows else np.empty(0)), states[0]

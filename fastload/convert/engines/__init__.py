"""Engines that run the tasks of a plan: ``ray`` (Ray core tasks) and ``torch`` (the ranks of
``torchrun``). The ``local`` engine is the single-process writer with its validation pool
(``run_convert``) and does not come through here.

Every engine does the same three steps: the driver plans (plan.py), tasks convert groups
(task.py), the driver commits (commit.py). What differs is only who runs the tasks (an
``Executor``, driven by driver.py's loop).
"""
from __future__ import annotations

import os

ENGINES = ("local", "ray", "torch")


def run_engine(engine: str, kind: str, src: str | os.PathLike, dst: str | os.PathLike, *, workers: int | None,
               shard_size: int, on_error: str, overwrite: bool, resume: bool, progress: bool,
               ray_address: str | None, label: str | None, image_columns, max_pixels: int | None,
               max_size: int | None = None, quality: int | None = None, source_options: dict | None = None) -> dict:
    opts = dict(shard_size=shard_size, overwrite=overwrite, resume=resume, label=label,
                image_columns=image_columns, max_pixels=max_pixels, max_size=max_size, quality=quality,
                source_options=source_options)
    if engine == "ray":
        from .ray_engine import run
        return run(kind, src, dst, workers=workers, on_error=on_error, progress=progress, address=ray_address, **opts)
    if engine == "torch":
        from .torch_engine import run
        return run(kind, src, dst, workers=workers, on_error=on_error, progress=progress, **opts)
    raise ValueError(f"engine={engine!r} must be one of {', '.join(ENGINES)}")


__all__ = ["ENGINES", "run_engine"]


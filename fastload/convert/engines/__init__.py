"""Engines that run the tasks of a plan: ``ray`` (Ray core tasks) and ``torch`` (the ranks of
``torchrun``). The ``local`` engine is the single-process writer with its validation pool
(``run_convert``) and does not come through here.

Every engine does the same three steps: the driver plans (plan.py), tasks convert groups
(task.py), the driver commits (commit.py). What differs is only who runs the tasks, which
is the ``Executor``: ``submit(group)`` returns a handle, ``wait(handles, timeout)`` returns
the finished ones as ``(handle, result dict or exception)``, ``cancel(handles)``.
``drive()`` is the loop they share: at most ``slots`` tasks at once, a progress bar in
samples/s with an ETA, and under ``on_error="raise"`` the first error cancels the rest
and is raised naming the group and the sample key.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Iterable, Protocol

from ..common import ConvertError
from ..plan import Plan
from ..task import finished_part

ENGINES = ("local", "ray", "torch")


class Executor(Protocol):
    slots: int

    def submit(self, group: int) -> Any: ...

    def wait(self, handles: list, timeout: float) -> list[tuple[Any, Any]]: ...

    def cancel(self, handles: Iterable) -> None: ...


def _bar(plan: Plan, total: int, initial: int, progress: bool, desc: str):
    from tqdm import tqdm as _tqdm

    class tqdm(_tqdm):  # noqa: N801
        monitor_interval = 0  # no monitor thread left running after convert() returns

    return tqdm(total=total, initial=initial, unit="samples", desc=desc, disable=not progress,
                file=sys.stderr, dynamic_ncols=True, smoothing=0.1)


def drive(plan: Plan, executor: Executor, groups: Iterable[int], *, progress: bool = True,
          desc: str = "convert", stop: Callable[[], str | None] | None = None) -> dict[int, dict]:
    """Run the tasks of ``groups`` (finished parts are reused, not redone); return
    {group: result}. Raises ConvertError on the first failed task, after cancelling the
    others; ``stop()`` returning a message stops early too (another rank failed)."""
    groups = list(groups)
    results: dict[int, dict] = {}
    todo = []
    reused = 0
    for g in groups:
        rec = finished_part(plan.part_dir(g))
        if rec is None:
            todo.append(g)
        else:
            reused += rec["stop"] - rec["start"]
            results[g] = {**rec, "reused": True, "error": None}
    total = sum(plan.bounds(g)[1] - plan.bounds(g)[0] for g in groups)
    bar = _bar(plan, total, reused, progress, desc)
    pending: dict[Any, int] = {}
    todo.reverse()
    failure = None
    try:
        while (todo or pending) and failure is None:
            while todo and len(pending) < executor.slots:
                g = todo.pop()
                pending[executor.submit(g)] = g
            for handle, res in executor.wait(list(pending), timeout=0.5):
                g = pending.pop(handle)
                a, b = plan.bounds(g)
                if isinstance(res, BaseException):
                    failure = failure or f"group {g} (samples {a}..{b - 1}) failed: {_describe(res)}"
                elif res.get("error"):
                    failure = failure or res["error"]
                else:
                    results[g] = res
                    bar.update(b - a)
                    bar.set_postfix(tasks=f"{len(results)}/{len(groups)}", refresh=False)
            if failure is None and stop is not None:
                failure = stop()
    except BaseException:  # KeyboardInterrupt, a lost cluster: stop what runs
        if pending:
            executor.cancel(list(pending))
        raise
    finally:
        bar.close()
    if failure is not None:
        if pending:
            executor.cancel(list(pending))
        raise ConvertError(f"{failure}\n(the finished parts are kept in {plan.parts}: run the same command "
                           "with --resume to reuse them)")
    return results


def _describe(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)  # Ray's RayTaskError keeps the task's own exception
    e = cause if isinstance(cause, BaseException) else exc
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"


def summary(res: dict, t0: float, results: dict[int, dict], engine: str, slots: int) -> dict:
    ran = [r for r in results.values() if not r.get("reused")]
    peak = [r.get("peak_rss_bytes", 0) for r in ran]
    res.update(seconds=time.perf_counter() - t0, engine=engine, workers=slots,
               tasks_run=len(ran), tasks_reused=len(results) - len(ran),
               worker_pids=len({(r.get("host"), r.get("pid")) for r in ran}),
               worker_peak_rss_bytes=max(peak) if peak else 0,
               worker_heavy_modules=sorted({m for r in ran for m in r.get("heavy_modules", [])}))
    return res


def run_engine(engine: str, kind: str, src: str | os.PathLike, dst: str | os.PathLike, *, workers: int | None,
               shard_size: int, on_error: str, overwrite: bool, resume: bool, progress: bool,
               ray_address: str | None, label: str | None, image_columns, max_pixels: int | None) -> dict:
    opts = dict(shard_size=shard_size, overwrite=overwrite, resume=resume, label=label,
                image_columns=image_columns, max_pixels=max_pixels)
    if engine == "ray":
        from .ray_engine import run
        return run(kind, src, dst, workers=workers, on_error=on_error, progress=progress, address=ray_address, **opts)
    if engine == "torch":
        from .torch_engine import run
        return run(kind, src, dst, workers=workers, on_error=on_error, progress=progress, **opts)
    raise ValueError(f"engine={engine!r} must be one of {', '.join(ENGINES)}")


__all__ = ["ENGINES", "Executor", "drive", "run_engine", "summary"]


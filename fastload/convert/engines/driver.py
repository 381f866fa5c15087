"""The loop every distributed engine shares: tasks of a plan in flight, progress, first error.

An engine provides an ``Executor``: ``submit(group)`` returns a handle, ``wait(handles,
timeout)`` returns the finished ones as ``(handle, result dict or exception)``,
``cancel(handles)``. ``drive()`` keeps at most ``slots`` tasks in flight, shows a progress
bar in samples/s with an ETA, reuses finished parts, and under ``on_error="raise"`` stops
at the first error: it cancels the other tasks and raises naming the group and sample key.
"""
from __future__ import annotations

import sys
import time
from typing import Any, Callable, Iterable, Protocol

from ..common import ConvertError
from ..plan import Plan
from ..sourcestate import SourceChanged
from ..task import finished_groups

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
    done = finished_groups(plan, groups)
    for g in groups:
        rec = done.get(g)
        if rec is None:
            todo.append(g)
        else:
            reused += rec["stop"] - rec["start"]
            results[g] = {k: v for k, v in rec.items() if k not in ("manifest", "report", "inputs")}
            results[g].update(reused=True, error=None)
    total = sum(plan.bounds(g)[1] - plan.bounds(g)[0] for g in groups)
    bar = _bar(plan, total, reused, progress, desc)
    pending: dict[Any, int] = {}
    todo.reverse()
    failure, restart = None, False
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
                    if failure is None:
                        failure, restart = res["error"], bool(res.get("source_changed"))
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
        if restart:  # the source no longer fits the plan: its message says to start over
            raise SourceChanged(failure)
        raise ConvertError(f"{failure}\n(the finished parts are kept in {plan.parts_where}: run the same command "
                           "with --resume to reuse them)")
    return results


def _describe(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)  # Ray's RayTaskError keeps the task's own exception
    e = cause if isinstance(cause, BaseException) else exc
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"


def summary(res: dict, t0: float, results: dict[int, dict], engine: str, slots: int, plan: Plan | None = None) -> dict:
    """The summary of a distributed run: the commit's, plus the whole call's seconds (with
    the engine's start), the task phase's (``tasks_seconds``, set by the engine), task
    counts, the peak memory and heavy imports of the processes that ran tasks, and under
    ``resumed_changed`` the groups a --resume converted again because files they had read
    changed since (``{group: [paths]}``, see plan.py)."""
    if plan is not None:
        res["resumed_changed"] = {int(g): list(p) for g, p in sorted(plan.redo.items())}
    ran = [r for r in results.values() if not r.get("reused")]
    peak = [r.get("peak_rss_bytes", 0) for r in ran]
    res.update(seconds=time.perf_counter() - t0, engine=engine, workers=slots,
               tasks_run=len(ran), tasks_reused=len(results) - len(ran),
               worker_pids=len({(r.get("host"), r.get("pid")) for r in ran}),
               worker_peak_rss_bytes=max(peak) if peak else 0,
               worker_heavy_modules=sorted({m for r in ran for m in r.get("heavy_modules", [])}))
    return res


def commit_plan(plan: Plan, on_error: str) -> dict:
    """The commit (commit.py: a local directory or an object store)."""
    from ..commit import commit

    return commit(plan, on_error)

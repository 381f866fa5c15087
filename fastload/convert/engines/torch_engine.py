"""``--engine torch``: the ranks of ``torchrun`` share the groups; rank 0 plans and commits.

    torchrun --nnodes N --nproc-per-node K -m fastload convert KIND SRC DST --engine torch

Every rank runs the same command. Rank 0 writes the plan; rank r converts groups r, r+W,
r+2W, ... (W ranks); rank 0 commits once every rank is done. DST must be a path all nodes
see (a shared filesystem). The ranks meet three times over ``torch.distributed`` (gloo;
the process group is created here unless the script made one): after the plan, after
their groups, after the commit. A failing rank writes ``stop.json`` into the parts
directory, so that the others stop early instead of converting groups in vain. A process
group made here waits up to 7 days at a meeting point (ranks' shares may finish hours
apart); one the script made keeps its own timeout (30 minutes by default in torch).

Each rank runs its tasks in ``python -m fastload.convert.worker`` processes, started once:
``workers`` is the number of tasks converting at once across all ranks, split between them
(at least one per rank; default one per rank). The converting processes never import torch
(image sources load DALI's CPU decoder there, to check every image with the Loader's
decoder), and a task whose process dies is retried (up to 3 times) in a new one. Without
``torchrun`` (no WORLD_SIZE) this is a single rank and torch is not imported at all.
"""
from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from .._store import MANIFEST, PARTS, write_json
from ..common import ConvertError
from ..objstore import Store
from ..plan import load_plan, make_plan
from ..task import finished_groups
from .driver import commit_plan, drive, summary

MAX_RETRIES = 3
STOP = "stop.json"
# Our own process group waits long at its meeting points: the ranks' shares of a large
# conversion may finish hours apart.
PG_TIMEOUT = timedelta(days=7)


class _Worker:
    """One ``python -m fastload.convert.worker`` process and the group it is converting."""

    def __init__(self, dst: str, on_error: str):
        self.err = tempfile.TemporaryFile(mode="w+b")
        self.proc = subprocess.Popen([sys.executable, "-m", "fastload.convert.worker", dst, on_error],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err)
        self.handle: int | None = None
        self._buf = b""

    def give(self, handle: int, group: int) -> None:
        self.handle = handle
        self.proc.stdin.write(f"{group}\n".encode())
        self.proc.stdin.flush()

    def read_line(self) -> bytes | None:
        """A complete result line if one is there (call when the pipe is readable); b"" at EOF."""
        chunk = os.read(self.proc.stdout.fileno(), 65536)
        if not chunk:
            return b""
        self._buf += chunk
        if b"\n" not in self._buf:
            return None
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def stderr_tail(self) -> str:
        self.err.seek(0)
        lines = self.err.read().decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else ""

    def stop(self, kill: bool = False) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        if kill:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=10 if kill else 60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self.err.close()


class SubprocessExecutor:
    """Tasks in ``slots`` long-lived worker processes (fastload.convert.worker); a task whose
    process dies without a result is retried in a new process, up to MAX_RETRIES times."""

    def __init__(self, dst: str, on_error: str, slots: int):
        self.dst, self.on_error, self.slots = dst, on_error, slots
        self._idle: list[_Worker] = []
        self._busy: dict[int, _Worker] = {}  # handle -> worker
        self._group: dict[int, int] = {}
        self._tries: dict[int, int] = {}
        self._next = 0
        self._sel = selectors.DefaultSelector()

    def _run(self, handle: int) -> None:
        w = self._idle.pop() if self._idle else _Worker(self.dst, self.on_error)
        w.give(handle, self._group[handle])
        self._busy[handle] = w
        self._sel.register(w.proc.stdout, selectors.EVENT_READ, w)

    def submit(self, group: int) -> int:
        h = self._next
        self._next += 1
        self._group[h], self._tries[h] = group, 0
        self._run(h)
        return h

    def wait(self, handles: list, timeout: float) -> list:
        out = []
        for key, _ in self._sel.select(timeout):
            w: _Worker = key.data
            line = w.read_line()
            if line is None:
                continue
            h = w.handle
            self._sel.unregister(w.proc.stdout)
            del self._busy[h]
            if line:
                w.handle = None
                self._idle.append(w)
                out.append((h, json.loads(line)))
                continue
            tail = w.stderr_tail()  # EOF: the process died without a result
            w.stop(kill=True)
            if self._tries[h] < MAX_RETRIES:
                self._tries[h] += 1
                self._run(h)
            else:
                out.append((h, RuntimeError(f"the task's process died {self._tries[h] + 1} times "
                                            f"(exit {w.proc.returncode}): {tail}")))
        return out

    def cancel(self, handles) -> None:
        for h in handles:
            w = self._busy.pop(h, None)
            if w is not None:
                self._sel.unregister(w.proc.stdout)
                w.stop(kill=True)

    def close(self) -> None:
        self.cancel(list(self._busy))
        for w in self._idle:
            w.stop()
        self._idle.clear()
        self._sel.close()


class _Ranks:
    """The meeting points of the ranks (torch.distributed), or a single rank without it."""

    def __init__(self):
        self.world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        self.rank = int(os.environ.get("RANK", "0") or 0)
        self.dist = None
        self._own = False
        if "torch" in sys.modules or self.world > 1:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                self.dist, self.world, self.rank = dist, dist.get_world_size(), dist.get_rank()
            elif self.world > 1:
                dist.init_process_group("gloo", timeout=PG_TIMEOUT)
                self.dist, self._own = dist, True
                self.world, self.rank = dist.get_world_size(), dist.get_rank()

    def _reduce(self, flag: bool, op: str) -> bool:
        if self.dist is None or self.world == 1:
            return flag
        import torch

        t = torch.tensor([int(flag)], dtype=torch.int64)
        if op == "broadcast":
            self.dist.broadcast(t, src=0)
        else:
            self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return bool(t.item())

    def from_rank0(self, flag: bool) -> bool:
        return self._reduce(flag, "broadcast")

    def any(self, flag: bool) -> bool:
        return self._reduce(flag, "max")

    def close(self) -> None:
        if self._own:
            self.dist.destroy_process_group()


class _Stop:
    """``stop.json`` in the parts directory (or under an object store's parts prefix): the
    first rank that fails writes it, so that the others stop early instead of converting
    groups in vain. An object store is asked at most every 2 s."""

    def __init__(self, plan):
        self.store = Store(plan.dst) if plan.remote else None
        self.path = None if plan.remote else plan.parts / STOP
        self._next = 0.0

    def _read(self) -> dict | None:
        if self.store is not None:
            return self.store.get_json(f"{PARTS}/{STOP}")
        try:
            with open(self.path, encoding="utf-8") as f:
                return json.load(f)
        except (FileNotFoundError, ValueError):
            return None

    def clear(self) -> None:
        if self.store is not None:
            self.store.delete(f"{PARTS}/{STOP}")
        else:
            self.path.unlink(missing_ok=True)

    def set(self, rank: int, error: str) -> None:
        if self._read() is not None:  # the first failure is the one to report
            return
        d = {"rank": rank, "error": error}
        if self.store is not None:
            self.store.put_json(f"{PARTS}/{STOP}", d)
        else:
            write_json(self.path, d)

    def message(self, rank: int, wait: bool = False) -> str | None:
        if self.store is not None and not wait:
            now = time.monotonic()
            if now < self._next:
                return None
            self._next = now + 2.0
        d = self._read()
        return None if d is None or d.get("rank") == rank else \
            f"stopped because rank {d.get('rank')} failed: {d.get('error')}"


def rank_slots(workers: int | None, rank: int, world: int) -> int:
    """This rank's share of ``workers``, the tasks converting at once across all ranks (as on
    every engine): split as evenly as possible, at least one per rank; None: one per rank."""
    if workers is None:
        return 1
    return max(1, workers // world + (1 if rank < workers % world else 0))


def run(kind, src, dst, *, workers, on_error, progress, shard_size, overwrite, resume, label, image_columns,
        max_pixels, max_size=None, quality=None, source_options=None) -> dict:
    if workers is not None and workers < 1:
        raise ValueError(f"workers={workers} must be >= 1 with --engine torch")
    t0 = time.perf_counter()
    ranks = _Ranks()
    try:
        slots = rank_slots(workers, ranks.rank, ranks.world)
        # 1. rank 0 plans; the others wait for it, then read the plan from DST.
        plan, err, reused = None, None, 0
        if ranks.rank == 0:
            try:
                plan = make_plan(kind, src, dst, shard_size=shard_size, overwrite=overwrite, resume=resume,
                                 label=label, image_columns=image_columns, max_pixels=max_pixels,
                                 max_size=max_size, quality=quality, source_options=source_options)
                _Stop(plan).clear()
                reused = len(finished_groups(plan, range(plan.num_groups)))  # (as drive() counts them)
            except BaseException as e:
                err = e
        if not ranks.from_rank0(err is None):
            if err is not None:
                raise err
            raise ConvertError("rank 0 could not plan the conversion (its error says why)")
        plan = plan or load_plan(dst)
        t_tasks = time.perf_counter()
        # 2. every rank converts its share of the groups.
        stop = _Stop(plan)
        mine = range(ranks.rank, plan.num_groups, ranks.world)
        desc = f"convert {kind} (torch rank 0 of {ranks.world})" if ranks.world > 1 else f"convert {kind} (torch)"
        failed, results = None, {}
        ex = SubprocessExecutor(plan.dst, on_error, slots)
        try:
            results = drive(plan, ex, mine, progress=progress and ranks.rank == 0, desc=desc,
                            stop=lambda: stop.message(ranks.rank))
        except ConvertError as e:
            failed = e
            stop.set(ranks.rank, str(e).splitlines()[0])
        finally:
            ex.close()
        failed_somewhere = ranks.any(failed is not None)  # every rank is done here
        t_tasks = time.perf_counter() - t_tasks
        if failed_somewhere:
            if failed is not None:
                raise failed
            raise ConvertError(stop.message(ranks.rank, wait=True) or "another rank failed (its error says why)")
        # 3. rank 0 commits.
        res, err = None, None
        if ranks.rank == 0:
            try:
                res = commit_plan(plan, on_error)
            except BaseException as e:
                err = e
        if not ranks.from_rank0(err is None):
            if err is not None:
                raise err
            raise ConvertError("rank 0 could not commit the conversion (its error says why)")
        if res is None:  # the other ranks report what rank 0 wrote
            if plan.remote:
                m = Store(plan.dst).get_json(MANIFEST)
            else:
                with open(Path(plan.dst) / MANIFEST, encoding="utf-8") as f:
                    m = json.load(f)
            res = {"dst": Store(plan.dst).display if plan.remote else plan.dst, "num_samples": m["num_samples"],
                   "num_shards": len(m["shards"]),
                   "bytes": m["total_bytes"], "skipped": None, "report": None, "num_groups": plan.num_groups}
        res.update(rank=ranks.rank, world_size=ranks.world, tasks_seconds=t_tasks)
        res = summary(res, t0, results, "torch", slots, plan if ranks.rank == 0 else None)  # worker figures: this rank's tasks
        res["workers"] = sum(rank_slots(workers, r, ranks.world) for r in range(ranks.world))  # all ranks'
        if ranks.rank == 0:  # task counts: every rank's
            res.update(tasks_run=plan.num_groups - reused, tasks_reused=reused)
        return res
    finally:
        ranks.close()

"""Run a function on several real ``torch.distributed`` ranks (gloo, localhost, a free port).

    results = run_ranks(4, "dist_jobs:sampler_epoch", {"n": 1000})

starts ``world_size`` Python processes; each initialises a gloo process group over TCP on
127.0.0.1, calls ``module:function(**kwargs)`` and writes what it returns (JSON) to a file.
The results come back as a list indexed by rank. A rank that fails or hangs fails the test
with its stderr. Used by the tests only; nothing here is in fastload's data path.

On Linux the rank processes are forked from one launcher process per test session (a
"zygote", started on first use) that has imported torch and fastload once, instead of each
importing them anew: a rank is still a fresh process of its own (its environment, its
process group, its exit), without the seconds of start-up (and of teardown) that a dozen
multi-rank tests paid for every rank. Elsewhere each rank is started with ``subprocess``.
"""
from __future__ import annotations

import atexit
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world_size: int, target: str, kwargs: dict | None = None, *, timeout: float = 240,
              env: dict | None = None) -> list:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="fastload-dist-") as out:
        envs = [{**os.environ, **(env or {}), "RANK": str(rank), "WORLD_SIZE": str(world_size),
                 "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                 "OMP_NUM_THREADS": "1", "PYTHONPATH": _pythonpath()} for rank in range(world_size)]
        zygote = _Zygote.get()
        if zygote is not None:
            errors = zygote.run(target, kwargs or {}, out, envs, timeout)
        else:
            errors = _run_processes(target, kwargs or {}, out, envs, timeout)
        if errors:
            raise AssertionError("\n".join(errors))
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world_size)]


def _pythonpath() -> str:
    return os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")])


def _run_processes(target: str, kwargs: dict, out: str, envs: list[dict], timeout: float) -> list[str]:
    """Each rank a new Python process (where fork is not used)."""
    procs = [subprocess.Popen([sys.executable, str(HERE / "_dist.py"), target, json.dumps(kwargs), out], env=e,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for e in envs]
    errors = []
    try:
        for rank, p in enumerate(procs):
            try:
                _, err = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                errors.append(f"rank {rank} did not finish in {timeout}s")
                continue
            if p.returncode != 0:
                errors.append(f"rank {rank} exited with {p.returncode}:\n{err[-4000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return errors


class _Zygote:
    """The launcher process (``python _dist.py --zygote``) and its line protocol: one JSON
    line per job in (target, kwargs, out, cwd, one environment per rank); out come the
    ranks' process ids, then one line per rank as it exits, with its exit status (negative:
    the signal that ended it). A rank's stderr goes to ``out/rank<r>.err``."""

    _current: _Zygote | None = None

    @classmethod
    def get(cls) -> _Zygote | None:
        if not sys.platform.startswith("linux"):
            return None
        z = cls._current
        if z is None or z.proc.poll() is not None:
            z = cls._current = cls()
            atexit.register(z.stop)
        return z

    def __init__(self) -> None:
        self.log = tempfile.TemporaryFile()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": _pythonpath()}
        self.proc = subprocess.Popen([sys.executable, str(HERE / "_dist.py"), "--zygote"], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)
        self._buf = b""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        self.log.close()

    def _line(self, deadline: float) -> dict | None:
        """The next line from the launcher, or None at the deadline."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                self.log.seek(0)
                raise AssertionError("the rank launcher (tests/_dist.py --zygote) died:\n"
                                     + self.log.read()[-4000:].decode(errors="replace"))
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def run(self, target: str, kwargs: dict, out: str, envs: list[dict], timeout: float) -> list[str]:
        job = {"target": target, "kwargs": kwargs, "out": out, "cwd": os.getcwd(), "envs": envs}
        self.proc.stdin.write(json.dumps(job).encode() + b"\n")
        self.proc.stdin.flush()
        pids = self._line(time.monotonic() + 60)
        if pids is None:
            raise AssertionError("the rank launcher (tests/_dist.py --zygote) did not start the ranks in 60 s")
        pids = pids["pids"]
        deadline = time.monotonic() + timeout
        codes: dict[int, int] = {}
        hung: list[int] = []
        while len(codes) < len(pids):
            msg = self._line(deadline if not hung else time.monotonic() + 60)
            if msg is None:
                if hung:
                    raise AssertionError(f"ranks {hung} did not end after SIGKILL")
                hung = [r for r in range(len(pids)) if r not in codes]
                for r in hung:
                    os.kill(pids[r], signal.SIGKILL)
                continue
            codes[msg["rank"]] = msg["code"]
        errors = []
        for rank in range(len(pids)):
            if rank in hung:
                errors.append(f"rank {rank} did not finish in {timeout}s")
            elif codes[rank] != 0:
                err = Path(out, f"rank{rank}.err").read_text(errors="replace")
                errors.append(f"rank {rank} exited with {codes[rank]}:\n{err[-4000:]}")
        return errors


def _zygote() -> None:
    """The launcher: torch, pyarrow and fastload's loader imported once (no thread started
    but jemalloc's, which is fork-safe, as DataLoader's fork workers rely on); each job's
    ranks forked from here."""
    import numpy  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    import fastload.loader  # noqa: F401
    import fastload.store  # noqa: F401

    for line in sys.stdin:
        job = json.loads(line)
        pids = []
        for rank, env in enumerate(job["envs"]):
            pid = os.fork()
            if pid == 0:
                _rank_child(job, rank, env)  # never returns
            pids.append(pid)
        print(json.dumps({"pids": pids}), flush=True)
        left = dict(zip(pids, range(len(pids))))
        while left:
            pid, status = os.wait()
            if pid in left:
                print(json.dumps({"rank": left.pop(pid), "code": os.waitstatus_to_exitcode(status)}), flush=True)


def _rank_child(job: dict, rank: int, env: dict) -> None:
    """In a forked rank: its environment, no stdin / stdout of the launcher's, stderr to a
    file; then the job, and its end (threads joined, atexit run)."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(job["cwd"])
    for p in reversed(env.get("PYTHONPATH", "").split(os.pathsep)):  # as a new process would have it
        if p and p not in sys.path:
            sys.path.insert(0, p)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    err = os.open(os.path.join(job["out"], f"rank{rank}.err"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(err, 2)
    os.close(null)
    os.close(err)
    sys.stdin = open(os.devnull)
    code = 1
    try:
        _run(job["target"], job["kwargs"], job["out"])
        code = 0
    except BaseException:  # noqa: BLE001 - reported through stderr and the exit status
        import traceback

        traceback.print_exc()
    # the end of a process as multiprocessing ends its forked children: non-daemon threads
    # joined, atexit handlers run, then os._exit (the interpreter's teardown of the modules
    # the launcher imported took seconds per rank, and nothing of the job's is in it)
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run(target: str, kwargs: dict, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    try:
        mod, fn = target.split(":")
        result = getattr(importlib.import_module(mod), fn)(**kwargs)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{int(os.environ['RANK'])}.json").write_text(json.dumps(result))


def _main() -> None:
    if sys.argv[1:] == ["--zygote"]:
        _zygote()
        return
    target, kwargs, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    _run(target, kwargs, out)


if __name__ == "__main__":
    _main()

"""Run a function on several real ``torch.distributed`` ranks (gloo, localhost, a free port).

    results = run_ranks(4, "dist_jobs:sampler_epoch", {"n": 1000})

starts ``world_size`` Python processes; each initialises a gloo process group over TCP on
127.0.0.1, calls ``module:function(**kwargs)`` and writes what it returns (JSON) to a file.
The results come back as a list indexed by rank. A rank that fails or hangs fails the test
with its stderr. Used by the tests only; nothing here is in fastload's data path.

On Linux the ranks are forked from the tests' process launcher (tests/_zygote.py), which
imported torch and fastload once: each rank is still a fresh process of its own, without
the seconds of start-up (and of teardown) that a dozen multi-rank tests paid for every rank.
"""
from __future__ import annotations

import importlib
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from _zygote import Zygote, pythonpath

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world_size: int, target: str, kwargs: dict | None = None, *, timeout: float = 240,
              env: dict | None = None) -> list:
    # The ranks' rendezvous store is held here, on a port the OS chose and kept bound (as
    # torchrun's agent holds it): a free port picked and released first could be taken by
    # another process before rank 0 bound it ("address already in use", seen under load).
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="fastload-dist-") as out:
        envs = [{**os.environ, **(env or {}), "RANK": str(rank), "WORLD_SIZE": str(world_size),
                 "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
                 "TORCHELASTIC_USE_AGENT_STORE": "True",
                 "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath()} for rank in range(world_size)]
        zygote = Zygote.get("1")
        if zygote is not None:
            children = [{"call": ["_dist:_run", {"target": target, "kwargs": kwargs or {}, "out": out}], "env": e,
                         "cwd": os.getcwd(), "stdout": None, "stderr": str(Path(out, f"rank{r}.err"))}
                        for r, e in enumerate(envs)]
            codes, hung = zygote.run(children, timeout)
            errors = [f"rank {r} did not finish in {timeout}s" if r in hung else
                      f"rank {r} exited with {c}:\n{Path(out, f'rank{r}.err').read_text(errors='replace')[-4000:]}"
                      for r, c in enumerate(codes) if r in hung or c != 0]
        else:
            errors = _run_processes(target, kwargs or {}, out, envs, timeout)
        if errors:
            raise AssertionError("\n".join(errors))
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world_size)]


def _run_processes(target: str, kwargs: dict, out: str, envs: list[dict], timeout: float) -> list[str]:
    """Each rank a new Python process (where the launcher is not used)."""
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
    target, kwargs, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    _run(target, kwargs, out)


if __name__ == "__main__":
    _main()

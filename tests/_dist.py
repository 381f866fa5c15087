"""Run a function on several real ``torch.distributed`` ranks (gloo, localhost, a free port).

    results = run_ranks(4, "dist_jobs:sampler_epoch", {"n": 1000})

starts ``world_size`` Python processes; each initialises a gloo process group over TCP on
127.0.0.1, calls ``module:function(**kwargs)`` and writes what it returns (JSON) to a file.
The results come back as a list indexed by rank. A rank that fails or hangs fails the test
with its stderr. Used by the tests only; nothing here is in fastload's data path.
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

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world_size: int, target: str, kwargs: dict | None = None, *, timeout: float = 240,
              env: dict | None = None) -> list:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="fastload-dist-") as out:
        procs = []
        for rank in range(world_size):
            e = {**os.environ, **(env or {}), "RANK": str(rank), "WORLD_SIZE": str(world_size),
                 "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                 "OMP_NUM_THREADS": "1",
                 "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
            procs.append(subprocess.Popen(
                [sys.executable, str(HERE / "_dist.py"), target, json.dumps(kwargs or {}), out],
                env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
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
        if errors:
            raise AssertionError("\n".join(errors))
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world_size)]


def _main() -> None:
    target, kwargs, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    try:
        mod, fn = target.split(":")
        result = getattr(importlib.import_module(mod), fn)(**kwargs)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{int(os.environ['RANK'])}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    _main()

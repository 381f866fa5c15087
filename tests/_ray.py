"""One Ray cluster on 127.0.0.1 for the whole session (``ray_cluster``), that the Ray tests join
with ``ray_address=`` instead of each starting a private Ray (seconds each on 2 cores). A pytest
plugin of tests/conftest.py.

The cluster is started lazily, by the first test that asks for it, by a helper driver process
(``ray.init(num_cpus=2)``, not a child of pytest's) that holds it until its stdin closes; at the
end of the session (or when the pytest process dies) the helper stops it, and any process of the
cluster still alive then is killed by its pid (never by name). Its processes (GCS, raylet, the
workers) get the environment of the session as it was when it started, less what a test sets for
itself (``AWS_*``, ``FASTLOAD_TEST_*``), without a GPU.

A driver that joins it gets ``ray_cluster.env(driver_env)``: what its own environment adds to or
changes in the cluster's (the fault injection of tests/fault_site on PYTHONPATH, the
``FASTLOAD_TEST_*`` switches, moto's ``AWS_*``, ...) goes to every worker of its job as Ray's
job-level ``runtime_env={"env_vars": ...}`` (``RAY_JOB_CONFIG_JSON_ENV_VAR``, read by every
``ray.init``: the way ``ray job submit`` hands a job its environment), so a worker's interpreter
starts with it and the fault site's ``sitecustomize`` runs there as in a private Ray. Workers
belong to one job: no state passes from one test's run to the next.

A test that needs a cluster of its own (one whose every socket it watches) starts a private Ray.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CPUS = 2
# loopback only, no usage statistics (as the engine sets for a private Ray)
LOCAL_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
_PRIVATE = ("AWS_", "FASTLOAD_TEST_")  # set by tests for their own runs, never the cluster's


# The helper: started by a launcher that exits at once, so that the helper is not a child of the
# pytest process (a test may check that a conversion left no child process behind); the pipes
# stay the launcher's, so the helper still ends when the pytest process does (its stdin closes).
_HELPER = (f"import os, ray, sys; ray.init(num_cpus={CPUS}, include_dashboard=False); "
           "print(os.getpid(), ray.get_runtime_context().gcs_address, flush=True); sys.stdin.read()")
_LAUNCHER = "import subprocess, sys; subprocess.Popen([sys.executable, '-c', sys.argv[1]])"


@dataclass
class RayCluster:
    address: str
    pid: int  # the helper driver's
    stdin: object = field(repr=False)  # closing it ends the helper
    cluster_env: dict = field(repr=False)

    def alive(self) -> bool:
        return _running(self.pid)

    def env(self, driver_env: dict) -> dict:
        """Environment to add to a driver that joins the cluster: its own variables that the
        cluster's processes lack or have otherwise reach its job's workers (``RAY_*`` ones
        are Ray's own and stay with the driver)."""
        mine = {k: v for k, v in driver_env.items() if self.cluster_env.get(k) != v and not k.startswith("RAY_")}
        return {**LOCAL_ENV, "RAY_AUTH_MODE": "token",  # a local Ray's token is the default
                "RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps({"runtime_env": {"env_vars": mine}})}


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def start_cluster() -> RayCluster:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_PRIVATE)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update(LOCAL_ENV, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")  # (the suite's tests see no GPU)
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, _HELPER], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    launcher.wait()
    t0 = time.monotonic()
    line = launcher.stdout.readline().split()
    launcher.stdout.close()
    if len(line) != 2 or not line[1].startswith("127.0.0.1:"):
        if line and line[0].isdigit():
            stop_cluster(int(line[0]), launcher.stdin)
        else:
            launcher.stdin.close()
        raise RuntimeError(f"the session's Ray cluster did not start on 127.0.0.1 (said {line!r}, "
                           f"after {time.monotonic() - t0:.0f} s)")
    return RayCluster(line[1], int(line[0]), launcher.stdin, env)


def stop_cluster(pid: int, stdin) -> None:
    """End the helper (it stops its cluster), then kill by pid whatever of its tree is left."""
    import psutil

    try:
        tree = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        tree = []
    stdin.close()
    deadline = time.monotonic() + 60
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    for p in ([psutil.Process(pid)] if _running(pid) else []) + tree:
        try:
            p.kill()
        except psutil.Error:
            pass


@pytest.fixture(scope="session")
def ray_cluster():
    """The session's Ray cluster (see the module docstring); skipped where Ray is not installed."""
    if subprocess.run([sys.executable, "-c", "import ray"], capture_output=True).returncode != 0:
        pytest.skip("ray is not installed (pip install 'fastload[ray]')")
    cluster = start_cluster()
    try:
        yield cluster
    finally:
        stop_cluster(cluster.pid, cluster.stdin)

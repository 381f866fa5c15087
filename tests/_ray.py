"""One Ray cluster on 127.0.0.1 for the whole session (``ray_cluster``), that the Ray tests join
with ``ray_address=`` instead of each starting a private Ray (seconds each on 2 cores). A pytest
plugin of tests/conftest.py.

The cluster is started lazily, by the first test that asks for it, by a helper driver process
(``ray.init(num_cpus=2)``) that holds it until its stdin closes; at the end of the session the
helper stops it, and any process of the cluster still alive then is killed by its pid (never by
name). Its processes (GCS, raylet, the workers) get the environment of the session as it was when
it started, less what a test sets for itself (``AWS_*``, ``FASTLOAD_TEST_*``).

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


@dataclass
class RayCluster:
    address: str
    helper: subprocess.Popen
    cluster_env: dict = field(repr=False)

    def alive(self) -> bool:
        return self.helper.poll() is None

    def env(self, driver_env: dict) -> dict:
        """Environment to add to a driver that joins the cluster: its own variables that the
        cluster's processes lack or have otherwise reach its job's workers (``RAY_*`` ones
        are Ray's own and stay with the driver)."""
        mine = {k: v for k, v in driver_env.items() if self.cluster_env.get(k) != v and not k.startswith("RAY_")}
        return {**LOCAL_ENV, "RAY_AUTH_MODE": "token",  # a local Ray's token is the default
                "RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps({"runtime_env": {"env_vars": mine}})}


def _tree(pid: int) -> list:
    import psutil

    try:
        return [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def start_cluster(timeout: float = 180) -> RayCluster:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_PRIVATE)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update(LOCAL_ENV, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")  # (the suite's tests see no GPU)
    helper = subprocess.Popen(
        [sys.executable, "-c", f"import ray, sys; ray.init(num_cpus={CPUS}, include_dashboard=False); "
                               "print(ray.get_runtime_context().gcs_address, flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    t0 = time.monotonic()
    address = helper.stdout.readline().strip()
    if not address.startswith("127.0.0.1:"):
        stop_cluster(helper)
        raise RuntimeError(f"the session's Ray cluster did not start on 127.0.0.1 (said {address!r}, "
                           f"after {time.monotonic() - t0:.0f} s)")
    return RayCluster(address, helper, env)


def stop_cluster(helper: subprocess.Popen) -> None:
    """End the helper (it stops its cluster), then kill by pid whatever of its tree is left."""
    import psutil

    tree = _tree(helper.pid)[1:]
    if helper.stdin and not helper.stdin.closed:
        helper.stdin.close()
    try:
        helper.wait(timeout=60)
    except subprocess.TimeoutExpired:
        helper.kill()
        helper.wait()
    for p in tree:
        try:
            p.kill()
        except psutil.Error:
            pass
    if helper.stdout:
        helper.stdout.close()


@pytest.fixture(scope="session")
def ray_cluster():
    """The session's Ray cluster (see the module docstring); skipped where Ray is not installed."""
    if subprocess.run([sys.executable, "-c", "import ray"], capture_output=True).returncode != 0:
        pytest.skip("ray is not installed (pip install 'fastload[ray]')")
    cluster = start_cluster()
    try:
        yield cluster
    finally:
        stop_cluster(cluster.helper)

"""``--engine ray``: one Ray core task per group of the plan.

Without ``address`` this starts a private single-node Ray on this machine with ``workers``
CPUs, bound to 127.0.0.1 only, without dashboard or usage reporting, and stops it at the
end. With ``address`` ("auto" or HOST:PORT) it joins that cluster as a driver and leaves it
running; DST must then be a path every node sees (a shared filesystem), and fastload must
be installed on every node. A Ray already initialised in this process is used as it is.

Tasks take one CPU, a memory hint of twice the shard size (a shard is built in memory),
and are retried up to 3 times when their worker or node dies (``max_retries``); a Python
exception in a task is not retried (it would fail again). They return small dicts.
"""
from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager

from ...runtime.system import usable_cores
from ..common import ConvertError
from ..plan import make_plan
from .driver import commit_plan, drive, summary

MAX_RETRIES = 3
# Environment for a private local Ray: loopback only (without the first, Ray advertises the
# machine's external address even for a one-node cluster), no usage statistics sent out.
_LOCAL_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


_INSTALL_HINT = "--engine ray needs Ray, which is not installed: pip install 'fastload[ray]'"


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ConvertError(_INSTALL_HINT) from None
    return ray


def convert_group(dst: str, group: int, on_error: str) -> dict:
    """The Ray task: runs in a Ray worker process (imports fastload's conversion only)."""
    from ..task import run_group

    return run_group(dst, group, on_error)


@contextmanager
def _env(values: dict):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class RayExecutor:
    def __init__(self, ray, dst: str, on_error: str, slots: int, memory: int):
        self.ray, self.dst, self.on_error, self.slots = ray, dst, on_error, slots
        self.fn = ray.remote(convert_group).options(num_cpus=1, max_retries=MAX_RETRIES, retry_exceptions=False,
                                                    memory=memory, name="fastload-convert-group")

    def submit(self, group: int):
        return self.fn.remote(self.dst, group, self.on_error)

    def wait(self, handles: list, timeout: float) -> list:
        ray = self.ray
        ready, rest = ray.wait(handles, num_returns=1, timeout=timeout)
        if ready and rest:
            more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
            ready += more
        out = []
        for h in ready:
            try:
                out.append((h, ray.get(h)))
            except Exception as e:  # RayTaskError (the task raised), WorkerCrashedError after the retries, ...
                out.append((h, e))
        return out

    def cancel(self, handles) -> None:
        for h in handles:
            try:
                self.ray.cancel(h)  # a running task gets KeyboardInterrupt: its attempt is removed
            except Exception:
                pass


def _loopback(address: str) -> bool:
    """A cluster on this machine's loopback (127.0.0.1:PORT, localhost:PORT): this driver must
    then also take 127.0.0.1 as its node's address, or it waits for a node that never comes."""
    host = address.rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def _probe(address: str, timeout: float = 10.0) -> None:
    """Refuse a HOST:PORT where nothing listens, at once (``ray.init`` would wait for a GCS
    there for minutes, retrying)."""
    import socket

    hostport = address.split("://", 1)[-1]
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto", or a form Ray resolves itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as e:
        raise ConvertError(f"--ray-address {address}: cannot connect to a Ray cluster there "
                           f"({e.strerror or e}); start it (ray start --head) or give its address") from None


@contextmanager
def ray_session(address: str | None, workers: int | None):
    """Connect to Ray (or start a private local one); yield (ray, number of task slots)."""
    with _env(_LOCAL_ENV if not address or _loopback(address) else {}):
        ray = _import_ray()  # Ray reads the loopback flag when it is first imported ...
        consts = sys.modules.get("ray._private.ray_constants")
        if (not address or _loopback(address)) and getattr(consts, "ENABLE_RAY_CLUSTER", False):
            # ... so when this process imported Ray earlier without it, say it here: a Ray
            # on this machine only must take 127.0.0.1 as its node address.
            consts.ENABLE_RAY_CLUSTER = False
        owned = False
        if not ray.is_initialized():
            kw = dict(include_dashboard=False, configure_logging=False, log_to_driver=True)
            if address:
                _probe(address)
                try:
                    ray.init(address=address, **kw)
                except ConnectionError as e:
                    raise ConvertError(f"--ray-address {address}: cannot connect to a Ray cluster ({e})") from None
            else:
                ray.init(num_cpus=workers or usable_cores(), **kw)
            owned = True
        try:
            slots = workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
            yield ray, slots
        finally:
            if owned:
                ray.shutdown()


def run(kind, src, dst, *, workers, on_error, progress, address, shard_size, overwrite, resume, label,
        image_columns, max_pixels, max_size=None, quality=None, source_options=None) -> dict:
    import importlib.util

    if importlib.util.find_spec("ray") is None:  # the install hint before any work (not importing
        raise ConvertError(_INSTALL_HINT)        # Ray yet: ray_session sets its environment first)
    if workers is not None and workers < 1:
        raise ValueError(f"workers={workers} must be >= 1 with --engine ray")
    t0 = time.perf_counter()
    # Ray first: a cluster that cannot be reached (or a Ray that cannot start) leaves DST as
    # it was, with no plan that a rerun would have to --resume or --overwrite.
    with ray_session(address, workers) as (ray, slots):
        plan = make_plan(kind, src, dst, shard_size=shard_size, overwrite=overwrite, resume=resume, label=label,
                         image_columns=image_columns, max_pixels=max_pixels, max_size=max_size, quality=quality,
                         source_options=source_options)
        ex = RayExecutor(ray, plan.dst, on_error, slots, memory=2 * int(shard_size))
        t_tasks = time.perf_counter()
        results = drive(plan, ex, range(plan.num_groups), progress=progress, desc=f"convert {kind} (ray)")
        t_tasks = time.perf_counter() - t_tasks
    res = commit_plan(plan, on_error)
    res["tasks_seconds"] = t_tasks
    return summary(res, t0, results, "ray", slots, plan)

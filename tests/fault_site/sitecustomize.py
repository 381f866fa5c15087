"""Test-only fault injection for the distributed convert (tests/test_convert_scale.py).

Put this directory on PYTHONPATH and set ``FASTLOAD_TEST_FAULT=GROUP:DIR``: in every Python
process started with that environment (the CLI driver, Ray workers, torch task processes),
the first attempt of the task for group GROUP kills its own process with ``os._exit(1)``,
as a crashed or OOM-killed worker would; ``DIR/died-GROUP`` records it (the pid). Every
later attempt runs normally. ``FASTLOAD_TEST_HEAVY=DIR``: each task writes the heavy modules
(torch, DALI) its process has imported to ``DIR/modules-<pid>`` (the test asserts there are none).
"""
import os
import sys

_fault = os.environ.get("FASTLOAD_TEST_FAULT")
_heavy = os.environ.get("FASTLOAD_TEST_HEAVY")
if _fault or _heavy:
    import importlib

    _task = importlib.import_module("fastload.convert.task")  # (fastload.convert is also a function)

    _orig = _task.run_group

    def run_group(dst, g, on_error="raise"):
        if _heavy:
            loaded = [m for m in ("torch", "nvidia.dali") if m in sys.modules]
            with open(os.path.join(_heavy, f"modules-{os.getpid()}"), "w") as f:
                f.write(" ".join(loaded))
        if _fault:
            group, marker_dir = _fault.split(":", 1)
            if int(g) == int(group):
                try:
                    fd = os.open(os.path.join(marker_dir, f"died-{g}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                except FileExistsError:
                    pass
                else:
                    os.write(fd, str(os.getpid()).encode())
                    os.close(fd)
                    os._exit(1)
        return _orig(dst, g, on_error)

    _task.run_group = run_group

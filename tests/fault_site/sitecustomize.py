"""Test-only fault injection for the distributed convert (tests/test_convert_scale.py,
tests/test_convert_s3.py).

Put this directory on PYTHONPATH and set ``FASTLOAD_TEST_FAULT=GROUP:DIR[:WHEN]`` (several,
comma-separated, for several groups): in every Python process started with that environment
(the CLI driver, Ray workers, torch task processes), the first attempt of the task for group
GROUP kills its own process with ``os._exit(1)``, as a crashed or OOM-killed worker would;
``DIR/died-GROUP`` records it (the pid). Every later attempt runs normally. WHEN is when it dies:

* ``start`` (the default): before the task does anything;
* ``write``: in the middle of writing its shard file (after 20 KB of it);
* ``put``: an object-store task, after it uploaded its shards, before its record.

``FASTLOAD_TEST_SLOW=GROUP:SECONDS``: the task for group GROUP sleeps that long before it
starts (a task still running when another one fails). ``FASTLOAD_TEST_AFTER=GROUP:OTHER``
(with ``FASTLOAD_TEST_HEAVY``): the task for group GROUP waits, up to 120 s, until the task
for group OTHER has started (a failure that must find another task in flight, whatever the
machine's load). ``FASTLOAD_TEST_HEAVY=DIR``: each task
writes the heavy modules (torch, DALI) its process has imported to ``DIR/modules-<pid>``,
``DIR/started-<group>`` when it starts, and every DALI image check the process builds
appends its thread count to ``DIR/dali-<pid>``.
"""
import os
import sys
import time

_fault = os.environ.get("FASTLOAD_TEST_FAULT")
_heavy = os.environ.get("FASTLOAD_TEST_HEAVY")
_slow = os.environ.get("FASTLOAD_TEST_SLOW")
_after = os.environ.get("FASTLOAD_TEST_AFTER")
if _fault or _heavy or _slow:
    import importlib

    _task = importlib.import_module("fastload.convert.task")  # (fastload.convert is also a function)

    _orig = _task.run_group
    _faults = {}  # {group: (marker directory, when)}
    for _spec in (_fault or "").split(","):
        if _spec:
            _g, _rest = _spec.split(":", 1)
            _dir, _, _w = _rest.partition(":")
            _faults[int(_g)] = (_dir, _w or "start")
    _whens = {w for _, w in _faults.values()}
    _current = [None]

    def _first_death(g, when) -> bool:
        """True (and the marker written) for the first attempt of a faulty group only, at its WHEN."""
        if g is None or _faults.get(int(g), (None, None))[1] != when:
            return False
        try:
            fd = os.open(os.path.join(_faults[int(g)][0], f"died-{g}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        return True

    def run_group(dst, g, on_error="raise"):
        if _heavy:
            loaded = [m for m in ("torch", "nvidia.dali") if m in sys.modules]
            with open(os.path.join(_heavy, f"modules-{os.getpid()}"), "w") as f:
                f.write(" ".join(loaded))
            open(os.path.join(_heavy, f"started-{g}"), "w").close()
        if _after and _heavy:
            group, other = _after.split(":")
            deadline = time.monotonic() + 120
            while (int(g) == int(group) and not os.path.exists(os.path.join(_heavy, f"started-{other}"))
                   and time.monotonic() < deadline):
                time.sleep(0.05)
        if _slow:
            group, seconds = _slow.split(":")
            if int(g) == int(group):
                time.sleep(float(seconds))
        if _first_death(g, "start"):
            os._exit(1)
        _current[0] = int(g)
        try:
            return _orig(dst, g, on_error)
        finally:
            _current[0] = None

    _task.run_group = run_group

    if "write" in _whens:
        _tx = importlib.import_module("fastload.store.transaction")
        _write = _tx.HashingFile.write

        def write(self, b):
            n = _write(self, b)
            if self.nbytes > 20_000 and _first_death(_current[0], "write"):
                os._exit(1)  # half a shard file on disk
            return n

        _tx.HashingFile.write = write

    if "put" in _whens:
        _obj = importlib.import_module("fastload.convert.objstore")
        _put_json = _obj.Store.put_json

        def put_json(self, name, obj):
            for g in _faults:
                if name == _obj.record_name(g) and _first_death(g, "put"):
                    os._exit(1)  # the shards are uploaded, the record is not
            return _put_json(self, name, obj)

        _obj.Store.put_json = put_json

    if _heavy:
        _check = importlib.import_module("fastload.convert.imagecheck")
        _build = _check.DaliImageCheck._build

        def _build_counted(self):
            pipe = _build(self)
            with open(os.path.join(_heavy, f"dali-{os.getpid()}"), "a") as f:
                f.write(f"{self.threads}\n")
            return pipe

        _check.DaliImageCheck._build = _build_counted

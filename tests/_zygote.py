"""Python processes for the tests without a Python start-up each: forked from a launcher.

    p = run_python("-m", "fastload", "bench", ds, cwd=tmp_path)   # like subprocess.run
    codes = Zygote.get().run([child, ...], timeout)               # several at once (ranks)

A launcher process (``python _zygote.py``, a "zygote", one per test session and value of
``OMP_NUM_THREADS``, which torch reads at import) imports torch, pyarrow and fastload's
loader once, and forks every child from there: a child is still a fresh process of its own
(its environment, working directory, ``sys.path`` from ``PYTHONPATH``, ``sys.argv``, file
descriptors 0-2, its exit status), without the seconds every test's ``python`` paid to
import torch and to tear it down again. A child runs a script (``python script.py ...``), a
module (``python -m mod ...``), code (``python -c ...``) or a function (``mod:fn``), and
ends as multiprocessing ends its forked children: non-daemon threads joined, atexit handlers
run, then ``os._exit``. Linux only (fork after importing torch); elsewhere ``run_python``
starts ``subprocess``es and ``Zygote.get()`` is None. Nothing here is in fastload's data path.
"""
from __future__ import annotations

import atexit
import gc
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def pythonpath() -> str:
    """PYTHONPATH for a child: tests/ and the repository first."""
    return os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")])


def run_python(*args, cwd=None, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *args], capture_output=True, text=True, ...)``, the
    process forked from a launcher (see the module docstring). ``env`` is the whole
    environment (default: this process's)."""
    args = [str(a) for a in args]
    env = dict(os.environ if env is None else env)
    z = Zygote.get(env.get("OMP_NUM_THREADS"))
    if z is None:
        return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=cwd)
    with tempfile.TemporaryDirectory(prefix="fastload-zygote-") as d:
        out, err = Path(d, "stdout"), Path(d, "stderr")
        child = {"argv": args, "env": env, "cwd": str(cwd or os.getcwd()), "stdout": str(out), "stderr": str(err)}
        (code,), hung = z.run([child], timeout)
        if hung:
            raise subprocess.TimeoutExpired([sys.executable, *args], timeout, out.read_text(errors="replace"),
                                            err.read_text(errors="replace"))
        return subprocess.CompletedProcess([sys.executable, *args], code, out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))


class Zygote:
    """A launcher and its line protocol: a job is one JSON line of children (each: ``argv``
    as after ``python``, or ``call`` ``[module:function, kwargs]``; ``env``, ``cwd``, and the
    files for its ``stdout`` / ``stderr``, None: /dev/null); back come the children's
    process ids, then one line per child as it exits with its exit status (negative: the
    signal that ended it)."""

    _running: dict[str | None, Zygote] = {}

    @classmethod
    def get(cls, omp_threads: str | None = "1") -> Zygote | None:
        if not sys.platform.startswith("linux"):
            return None
        z = cls._running.get(omp_threads)
        if z is None or z.proc.poll() is not None:
            z = cls._running[omp_threads] = cls(omp_threads)
            atexit.register(z.stop)
        return z

    def __init__(self, omp_threads: str | None) -> None:
        self.log = tempfile.TemporaryFile()
        env = {**os.environ, "PYTHONPATH": pythonpath()}
        env.pop("OMP_NUM_THREADS", None)
        if omp_threads is not None:
            env["OMP_NUM_THREADS"] = omp_threads
        self.proc = subprocess.Popen([sys.executable, str(HERE / "_zygote.py")], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log)
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
                raise AssertionError("the process launcher (tests/_zygote.py) died:\n"
                                     + self.log.read()[-4000:].decode(errors="replace"))
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def run(self, children: list[dict], timeout: float) -> tuple[list[int], list[int]]:
        """Fork ``children`` at once and wait for them all, at most ``timeout`` seconds in
        all: (exit statuses, the children killed (SIGKILL) at the timeout)."""
        self.proc.stdin.write(json.dumps(children).encode() + b"\n")
        self.proc.stdin.flush()
        pids = self._line(time.monotonic() + 60)
        if pids is None:
            raise AssertionError("the process launcher (tests/_zygote.py) did not fork in 60 s")
        pids = pids["pids"]
        deadline = time.monotonic() + timeout
        codes: dict[int, int] = {}
        hung: list[int] = []
        while len(codes) < len(pids):
            msg = self._line(deadline if not hung else time.monotonic() + 60)
            if msg is None:
                if hung:
                    raise AssertionError(f"children {hung} of the process launcher did not end after SIGKILL")
                hung = [i for i in range(len(pids)) if i not in codes]
                for i in hung:
                    os.kill(pids[i], signal.SIGKILL)
                continue
            codes[msg["child"]] = msg["code"]
        return [codes[i] for i in range(len(pids))], hung


def _launcher() -> None:
    """The launcher: torch, pyarrow and fastload's loader imported once (no thread started
    but jemalloc's, which is fork-safe, as DataLoader's fork workers rely on)."""
    import numpy  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    try:
        import fastload.loader  # noqa: F401
        import fastload.store  # noqa: F401
    except ImportError:  # pragma: no cover - a child imports what it needs (and says what is missing)
        pass
    # what the launcher imported lives as long as every child: frozen (gc.freeze), no child's
    # collection walks it (each full one did, ~0.1 s, touching and so copying its pages)
    gc.collect()
    gc.freeze()

    for line in sys.stdin:
        pids = []
        for child in json.loads(line):
            pid = os.fork()
            if pid == 0:
                _child(child)  # never returns
            pids.append(pid)
        print(json.dumps({"pids": pids}), flush=True)
        left = {pid: i for i, pid in enumerate(pids)}
        while left:
            pid, status = os.wait()
            if pid in left:
                print(json.dumps({"child": left.pop(pid), "code": os.waitstatus_to_exitcode(status)}), flush=True)


def _child(spec: dict) -> None:
    """In a forked child: its environment, directory, sys.path, stdin / stdout / stderr;
    then its work, and its end."""
    import runpy

    env = spec["env"]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(spec["cwd"])
    for p in reversed(env.get("PYTHONPATH", "").split(os.pathsep)):  # as a new process would have it
        if p and p not in sys.path:
            sys.path.insert(0, p)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    for fd, path in ((1, spec.get("stdout")), (2, spec.get("stderr"))):
        if path is None:
            os.dup2(null, fd)
        else:
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(f, fd)
            os.close(f)
    os.close(null)
    sys.stdin = open(os.devnull)
    if env.get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(line_buffering=True)
    code = 0
    try:
        if "call" in spec:
            import importlib

            target, kwargs = spec["call"]
            mod, fn = target.split(":")
            getattr(importlib.import_module(mod), fn)(**kwargs)
        else:
            argv = spec["argv"]
            if argv[0] == "-m":
                sys.path.insert(0, os.getcwd())
                sys.argv = [argv[1], *argv[2:]]
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            elif argv[0] == "-c":
                sys.path.insert(0, "")
                sys.argv = ["-c", *argv[2:]]
                exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
            else:
                sys.argv = list(argv)
                sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
                runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - reported through stderr and the exit status
        import traceback

        traceback.print_exc()
        code = 1
    # the end of a process as multiprocessing ends its forked children: non-daemon threads
    # joined, atexit handlers run, then os._exit (the interpreter's teardown of the modules
    # the launcher imported took seconds, and nothing of the child's work is in it)
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _launcher()

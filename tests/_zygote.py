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

A child asked for with ``fork_python=True`` gets, as its ``sys.executable``, a stand-in for
``python`` (``python_shim()``: a Python without ``site``, ~15 ms to start) that hands its
argv, environment, working directory and file descriptors 0-2 to the same launcher over a
Unix socket: the processes the child starts as ``python ...`` (torchrun's ranks, Lightning's
DDP ranks) are forked from the launcher too. The shim waits for its process, forwards the
signals it gets to it (torchrun and Lightning stop their ranks with SIGTERM) and exits as it
exited; when the shim itself is killed, the launcher kills the process. Such a process is not
in the shim's process group (``killpg`` reaches it only through the shim) and is not the
shim's child: tests about process groups, parents or interpreter start-up do not use it.

Launchers are pooled: a thread that finds every launcher of its kind busy starts another, so
``run_python`` may be called from several threads at once.
"""
from __future__ import annotations

import atexit
import gc
import json
import os
import select
import shutil
import signal
import socket
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


SHIM_ENV = "FASTLOAD_TEST_LAUNCHER"

# The shim: no site, no PYTHON* variables (-SE); exits 1 with one line when there is no launcher.
_SHIM = r"""
import json, os, signal, socket, sys
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(os.environ["FASTLOAD_TEST_LAUNCHER"])
except (KeyError, OSError) as e:
    sys.exit(f"tests' python shim (tests/_zygote.py): no process launcher to fork from: {e!r}")
msg = json.dumps({"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd()}).encode()
socket.send_fds(s, [len(msg).to_bytes(8, "little")], [0, 1, 2])
s.sendall(msg)
f = s.makefile("rb")
pid = int(f.readline() or 0)
if pid <= 0:
    sys.exit("tests' python shim (tests/_zygote.py): the process launcher did not fork")


def forward(sig, frame):
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(sig, forward)
line = f.readline()
code = int(line) if line.strip() else -signal.SIGKILL
if code < 0:
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
"""

_shim_path: Path | None = None


def python_shim() -> Path:
    """The executable that stands in for ``python`` (see the module docstring); made once per
    process, removed at its exit."""
    global _shim_path
    if _shim_path is None:
        d = Path(tempfile.mkdtemp(prefix="fastload-shim-"))
        atexit.register(shutil.rmtree, d, True)
        p = d / "python"
        p.write_text(f"#!{sys.executable} -SE\n{_SHIM}")
        p.chmod(0o755)
        _shim_path = p
    return _shim_path


def run_python(*args, cwd=None, env: dict | None = None, timeout: float = 600, preload: tuple[str, ...] = (),
               fork_python: bool = False) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *args], capture_output=True, text=True, ...)``, the
    process forked from a launcher (see the module docstring). ``env`` is the whole
    environment (default: this process's). ``preload``: modules the launcher imports too
    (e.g. ``("lightning",)``, seconds of every Lightning run); ``fork_python``: the child's
    ``python`` is the shim, so the Python processes it starts are forked as well."""
    args = [str(a) for a in args]
    env = dict(os.environ if env is None else env)
    z = Zygote.get(env.get("OMP_NUM_THREADS"), preload)
    if z is None:
        return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=cwd)
    with tempfile.TemporaryDirectory(prefix="fastload-zygote-") as d:
        out, err = Path(d, "stdout"), Path(d, "stderr")
        child = {"argv": args, "env": env, "cwd": str(cwd or os.getcwd()), "stdout": str(out), "stderr": str(err)}
        if fork_python:
            child["executable"] = str(python_shim())
            child["env"] = {**env, SHIM_ENV: z.socket}
        (code,), hung = z.run([child], timeout)
        if hung:
            raise subprocess.TimeoutExpired([sys.executable, *args], timeout, out.read_text(errors="replace"),
                                            err.read_text(errors="replace"))
        return subprocess.CompletedProcess([sys.executable, *args], code, out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))


class Zygote:
    """A launcher and its line protocol: a job is one JSON line of children (each: ``argv``
    as after ``python``, or ``call`` ``[module:function, kwargs]``; ``env``, ``cwd``, and the
    files for its ``stdout`` / ``stderr``, None: /dev/null; optionally ``executable``, its
    ``sys.executable``); back come the children's process ids, then one line per child as it
    exits with its exit status (negative: the signal that ended it). Its first line is
    ``{"socket": path}``, where the shims connect."""

    _pool: dict[tuple, list[Zygote]] = {}
    _pool_lock = threading.Lock()

    @classmethod
    def get(cls, omp_threads: str | None = "1", preload: tuple[str, ...] = ()) -> Zygote | None:
        """A launcher of this kind that no thread is using (a new one if all are busy)."""
        if not sys.platform.startswith("linux"):
            return None
        with cls._pool_lock:
            pool = cls._pool.setdefault((omp_threads, tuple(preload)), [])
            pool[:] = [z for z in pool if z.proc.poll() is None]
            z = next((z for z in pool if not z._taken), None)
            if z is None:
                z = cls(omp_threads, tuple(preload))
                pool.append(z)
                atexit.register(z.stop)
            z._taken = True
            return z

    def __init__(self, omp_threads: str | None, preload: tuple[str, ...] = ()) -> None:
        self.log = tempfile.TemporaryFile()
        env = {**os.environ, "PYTHONPATH": pythonpath()}
        env.pop("OMP_NUM_THREADS", None)
        if omp_threads is not None:
            env["OMP_NUM_THREADS"] = omp_threads
        self.proc = subprocess.Popen([sys.executable, str(HERE / "_zygote.py"), *preload], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)
        self._buf = b""
        self._taken = False  # given to a thread by get() until its run ends
        self._socket: str | None = None

    @property
    def socket(self) -> str:
        """The launcher's Unix socket (waits until it has imported what it preloads)."""
        if self._socket is None:
            hello = self._line(time.monotonic() + 120)
            if hello is None:
                raise AssertionError("the process launcher (tests/_zygote.py) did not start in 120 s")
            self._socket = hello["socket"]
        return self._socket

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
        try:
            return self._run(children, timeout)
        finally:
            self._taken = False

    def _run(self, children: list[dict], timeout: float) -> tuple[list[int], list[int]]:
        self.socket  # noqa: B018 - the launcher's first line read
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


# the launcher's own descriptors (socket, wake-up pipe, shims' connections): closed in a child
_LAUNCHER_FDS: set[int] = set()


def _launcher(preload: list[str]) -> None:
    """The launcher: torch, pyarrow and fastload's loader imported once (no thread started
    but jemalloc's, which is fork-safe, as DataLoader's fork workers rely on), then a loop
    that forks the jobs read from stdin and the shims' processes, and reaps them."""
    import importlib

    import numpy  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    try:
        import fastload.loader  # noqa: F401
        import fastload.store  # noqa: F401
    except ImportError:  # pragma: no cover - a child imports what it needs (and says what is missing)
        pass
    for mod in preload:
        importlib.import_module(mod)
    # what the launcher imported lives as long as every child: frozen (gc.freeze), no child's
    # collection walks it (each full one did, ~0.1 s, touching and so copying its pages)
    gc.collect()
    gc.freeze()

    home = tempfile.mkdtemp(prefix="fastload-launcher-")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(os.path.join(home, "sock"))
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    _LAUNCHER_FDS.update((listener.fileno(), wake_r, wake_w))
    print(json.dumps({"socket": listener.getsockname()}), flush=True)

    job: dict[int, int] = {}  # pid -> index in the current stdin job
    shims: dict[int, socket.socket | None] = {}  # pid -> its shim's connection (None: the shim is gone)
    conns: dict[socket.socket, int] = {}
    buf = b""
    try:
        while True:
            ready = select.select([0, wake_r, listener, *conns], [], [])[0]
            if wake_r in ready:
                while True:
                    try:
                        if not os.read(wake_r, 4096):
                            break
                    except BlockingIOError:
                        break
            _reap(job, shims, conns)
            if listener in ready:
                _fork_for_shim(listener, shims, conns)
            for conn in [c for c in ready if c in conns]:
                try:
                    gone = not conn.recv(1)
                except OSError:
                    gone = True
                if gone:  # the shim was killed: so is its process
                    pid = conns[conn]
                    _close(conn, conns)
                    shims[pid] = None
                    _kill(pid)
            if 0 in ready:
                data = os.read(0, 65536)
                if not data:
                    return
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    pids = []
                    for child in json.loads(line):
                        pid = os.fork()
                        if pid == 0:
                            _child(child)  # never returns
                        pids.append(pid)
                    print(json.dumps({"pids": pids}), flush=True)
                    job = {pid: i for i, pid in enumerate(pids)}
    finally:
        for pid in shims:
            _kill(pid)
        shutil.rmtree(home, ignore_errors=True)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _close(conn: socket.socket, conns: dict) -> None:
    """A shim's connection closed, here and in the children forked from now on."""
    conns.pop(conn, None)
    _LAUNCHER_FDS.discard(conn.fileno())
    conn.close()


def _reap(job: dict[int, int], shims: dict, conns: dict) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = os.waitstatus_to_exitcode(status)
        if pid in job:
            print(json.dumps({"child": job.pop(pid), "code": code}), flush=True)
        elif pid in shims:
            conn = shims.pop(pid)
            if conn is not None:
                try:
                    conn.sendall(f"{code}\n".encode())
                except OSError:
                    pass
                _close(conn, conns)


def _fork_for_shim(listener: socket.socket, shims: dict, conns: dict) -> None:
    """Read a shim's request (its descriptors 0-2 come with it) and fork its process."""
    conn, _ = listener.accept()
    fds: list[int] = []
    try:
        conn.settimeout(30)
        head, fds, _, _ = socket.recv_fds(conn, 8, 3)
        while len(head) < 8:
            more = conn.recv(8 - len(head))
            if not more:
                raise ConnectionError("the shim closed before its request")
            head += more
        size = int.from_bytes(head, "little")
        body = bytearray()
        while len(body) < size:
            more = conn.recv(min(size - len(body), 1 << 20))
            if not more:
                raise ConnectionError("the shim closed mid-request")
            body += more
        spec = json.loads(body)
        if len(fds) != 3:
            raise ConnectionError(f"the shim sent {len(fds)} descriptors, not 3")
    except (OSError, ValueError) as e:
        print(f"tests/_zygote.py: a shim's request failed: {e!r}", file=sys.stderr, flush=True)
        for fd in fds:
            os.close(fd)
        conn.close()
        return
    _LAUNCHER_FDS.add(conn.fileno())  # (the child closes it too)
    pid = os.fork()
    if pid == 0:
        _child({**spec, "fds": fds})  # never returns
    for fd in fds:
        os.close(fd)
    conn.settimeout(None)
    try:
        conn.sendall(f"{pid}\n".encode())
    except OSError:  # the shim is gone already: so is its process (reaped with the others)
        _close(conn, conns)
        shims[pid] = None
        _kill(pid)
        return
    shims[pid] = conn
    conns[conn] = pid


def _options(argv: list[str]) -> tuple[list[str], bool]:
    """The interpreter options before the script / -m / -c that a child honours: (the rest,
    unbuffered). ``-u`` (torchrun's), ``-B``, ``-W arg`` and ``-X faulthandler``."""
    import warnings

    i, unbuffered = 0, False
    while i < len(argv) and argv[i].startswith("-") and argv[i] not in ("-m", "-c", "-"):
        o = argv[i]
        if o == "-u":
            unbuffered = True
        elif o == "-B":
            pass
        elif o == "-W" and i + 1 < len(argv):
            i += 1
            warnings._setoption(argv[i])  # as the interpreter parses -W
        elif o == "-X" and i + 1 < len(argv) and argv[i + 1] == "faulthandler":
            import faulthandler

            i += 1
            faulthandler.enable()
        else:
            raise SystemExit(f"tests/_zygote.py: the option {o!r} is not one a forked child honours "
                             f"(-u, -B, -W, -X faulthandler): run this one with subprocess")
        i += 1
    return argv[i:], unbuffered


def _child(spec: dict) -> None:
    """In a forked child: its environment, directory, sys.path, stdin / stdout / stderr;
    then its work, and its end."""
    import io
    import runpy

    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in _LAUNCHER_FDS:
        try:
            os.close(fd)
        except OSError:
            pass
    env = spec["env"]
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # the launcher's (its TMPDIR): a fresh process finds its own
    os.chdir(spec["cwd"])
    for p in reversed(env.get("PYTHONPATH", "").split(os.pathsep)):  # as a new process would have it
        if p and p not in sys.path:
            sys.path.insert(0, p)
    if "fds" in spec:  # a shim's: its own stdin, stdout and stderr
        for target, fd in enumerate(spec["fds"]):
            os.dup2(fd, target)
            os.close(fd)
        sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    else:
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
    if spec.get("executable"):  # its python is the shim; multiprocessing's spawn keeps the real one
        import multiprocessing.spawn

        multiprocessing.spawn.set_executable(sys.executable)
        sys.executable = spec["executable"]
    code = 0
    try:
        if "call" in spec:
            import importlib

            target, kwargs = spec["call"]
            mod, fn = target.split(":")
            getattr(importlib.import_module(mod), fn)(**kwargs)
        else:
            argv, unbuffered = _options(spec["argv"])
            if unbuffered or env.get("PYTHONUNBUFFERED"):
                sys.stdout.reconfigure(line_buffering=True, write_through=True)
                sys.stderr.reconfigure(line_buffering=True, write_through=True)
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
    _launcher(sys.argv[1:])

"""The tests' process launcher (tests/_zygote.py) gives what ``subprocess.run([python, ...])``
gives: the exit status, stdout, stderr, the environment, working directory and argv asked
for, a traceback for an uncaught exception, a timeout; threads joined and atexit run at the
end. (On other systems than Linux it is subprocess itself.)"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from _zygote import Zygote, run_python


def test_a_child_is_a_process_of_its_own_with_its_env_cwd_argv_and_exit(tmp_path):
    code = ("import os, sys, atexit, threading, time\n"
            "atexit.register(lambda: print('atexit ran'))\n"
            "threading.Thread(target=lambda: (time.sleep(0.3), print('thread joined'))).start()\n"
            "print(os.getpid(), os.getcwd(), os.environ['ZYG_X'], sys.argv[1:])\n"
            "print('to stderr', file=sys.stderr)\n"
            "sys.exit(3)\n")
    p = run_python("-c", code, "a", "b", cwd=tmp_path, env={**os.environ, "ZYG_X": "yes"})
    assert p.returncode == 3, p.stderr
    pid, cwd, x, argv = p.stdout.splitlines()[0].split(" ", 3)
    assert int(pid) != os.getpid() and cwd == str(tmp_path) and x == "yes" and argv == "['a', 'b']"
    assert p.stdout.splitlines()[1:] == ["thread joined", "atexit ran"] and p.stderr == "to stderr\n"
    assert "ZYG_X" not in os.environ  # the child's environment only


def test_a_script_and_a_module_run_as_main_and_failures_are_reported(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import sys\nif __name__ == '__main__':\n    raise ValueError('broken ' + sys.argv[1])\n")
    p = run_python(script, "here", cwd=tmp_path)
    assert p.returncode == 1 and "ValueError: broken here" in p.stderr and "Traceback" in p.stderr
    p = run_python("-m", "fastload", "--version")
    assert p.returncode == 0 and p.stdout.strip()
    with pytest.raises(subprocess.TimeoutExpired):
        run_python("-c", "import time; time.sleep(60)", timeout=1)


_PARENT = r'''
import json, os, signal, subprocess, sys, time
out = {"exe": sys.executable}
p = subprocess.run([sys.executable, "-u", "-c",
                    "import os, sys; print(os.getpid(), os.getppid(), os.getcwd(), os.environ['ZYG_Y'], sys.argv[1:]);"
                    "print(sys.stdin.read().upper(), file=sys.stderr); sys.exit(7)", "a"],
                   input="hello", capture_output=True, text=True, env={**os.environ, "ZYG_Y": "z"}, cwd=sys.argv[1])
out["ran"] = [p.returncode, p.stdout, p.stderr]
for sig in (signal.SIGTERM, signal.SIGKILL):  # to the shim: forwarded / the launcher kills its process
    q = subprocess.Popen([sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(60)"],
                         stdout=subprocess.PIPE, text=True)
    pid = int(q.stdout.readline())
    q.send_signal(sig)
    out[str(int(sig))] = [q.wait(), pid]
print(json.dumps(out))
'''


def test_a_childs_python_processes_are_forked_through_the_shim(tmp_path):
    """fork_python: the child's ``sys.executable`` is the shim; a process started through it
    gets its argv, environment, directory, stdin/stdout/stderr and exit status, as a process
    of its own; a signal to the shim reaches it, and a killed shim's process is killed."""
    p = run_python("-c", _PARENT, tmp_path, fork_python=True, timeout=120)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.splitlines()[-1])
    assert out["exe"].endswith("python") and "fastload-shim-" in out["exe"]
    code, stdout, stderr = out["ran"]
    pid, ppid, cwd, y, argv = stdout.split(" ", 4)
    assert code == 7 and (cwd, y, argv.strip()) == (str(tmp_path), "z", "['a']") and stderr == "HELLO\n"
    assert int(pid) not in (p.returncode, int(ppid))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        code, pid = out[str(int(sig))]
        assert code == -sig
        with pytest.raises(ProcessLookupError):  # reaped by the launcher, nothing left running
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                os.kill(pid, 0)
                time.sleep(0.05)


def test_run_python_from_several_threads_at_once():
    """Each thread finds a launcher of its own (the pool starts another when all are busy)."""
    def one(i):
        return run_python("-c", f"import time, os; time.sleep(1); print({i}, os.getpid())")

    with ThreadPoolExecutor(2) as ex:
        done = list(ex.map(one, range(2)))
    assert [int(p.stdout.split()[0]) for p in done] == [0, 1] and all(p.returncode == 0 for p in done)
    assert len({p.stdout.split()[1] for p in done}) == 2
    assert sum(z.proc.poll() is None for z in Zygote._pool[(os.environ.get("OMP_NUM_THREADS"), ())]) >= 2

"""The tests' process launcher (tests/_zygote.py) gives what ``subprocess.run([python, ...])``
gives: the exit status, stdout, stderr, the environment, working directory and argv asked
for, a traceback for an uncaught exception, a timeout; threads joined and atexit run at the
end. (On other systems than Linux it is subprocess itself.)"""
from __future__ import annotations

import os
import subprocess

import pytest

from _zygote import run_python


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

#!/usr/bin/env python3
"""Mutation check of the fake-CUDA tests: do they catch the GPU bugs they exist for?

Each mutation below is a real GPU bug (a slot released before its copy ran, a missing
``record_stream``, DALI's output allocated on the wrong stream, a missing wait, a thread on
the wrong device, and the review's G1, G6, G7 and G8 undone), written into a temporary copy
of the package. The fake-CUDA tests
(tests/fake_cuda.py) are run against each copy; a mutation is *killed* when they fail.
Prints one line per mutation and ``killed K of N mutations``; exits 1 unless every mutation
is killed (2 if the tests fail on the unmutated copy, or a mutation no longer applies: the
code it names has changed; update the mutation).

    python tools/cuda_mutations.py [--jobs 2] [--only NAME ...] [-v]

It runs ``pytest`` with the interpreter running it, which must have fastload's test
dependencies (torch, DALI, pytest) and a built extension (``fastload/_C*.so`` in place).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = ["tests/test_cuda_lifetime.py", "tests/test_cuda_fake.py"]
TIMEOUT_S = 300


@dataclass(frozen=True)
class Mutation:
    name: str
    bug: str  # what it does on a real GPU
    path: str  # relative to the repository root
    pattern: str  # a regular expression, matched in the file
    replacement: str
    count: int = 1  # how many matches there must be (0: at least one)


MUTATIONS = [
    Mutation("slot-released-early", "the ring slot goes back before the GPU ran its host-to-device copy",
             "fastload/loader/cuda.py", r"self\._inflight\.append\(\(ev, \(lease, host\)\)\)",
             "self._inflight.append((ev, None))"),
    Mutation("no-record-stream", "delivered tensors' memory reused while the training stream still reads them",
             "fastload/loader/cuda.py", r"\b\w+\.record_stream\([\w.]+\)", "None", count=0),
    Mutation("dali-output-off-stream", "DALI's output allocated on the feeder's stream, written on the copy stream",
             "fastload/pipeline/cuda_copy.py", r"with torch\.cuda\.stream\(stream\):", "if True:"),
    Mutation("no-image-event-wait", "the training stream reads images before DALI's copy finished",
             "fastload/loader/cuda.py", r"cur\.wait_event\(ev\)(?=  # the consumer)", "None"),
    Mutation("no-wait-stream", "the training stream reads raw fields before their copy finished",
             "fastload/loader/cuda.py", r"current\.wait_stream\(self\._stream\)(?=  # the training stream)", "None"),
    Mutation("transform-skips-image-events", "the device transform reads images before DALI's copy finished",
             "fastload/loader/cuda.py", r"self\._stream\.wait_event\(ev\)", "None"),
    Mutation("transform-waits-training-stream", "G1: the device transform waits for the training step (no overlap)",
             "fastload/loader/cuda.py", r"for ev in events:\n(\s+)self\._stream\.wait_event\(ev\)",
             r"for ev in events:\n\1self._stream.wait_stream(torch.cuda.current_stream(self._device))"),
    Mutation("transform-thread-on-training-stream", "G1: background threads queue waits into the training stream",
             "fastload/loader/cuda.py", r"self\._torch\.cuda\.set_stream\(self\._stream\)", "None"),
    Mutation("wrong-device", "fastload's threads select cuda:0, not the loader's device (a context per rank on GPU 0)",
             "fastload/runtime/device.py", r"torch\.cuda\.set_device\(device\)", "torch.cuda.set_device(0)"),
    Mutation("gpu-run-captures-stderr", "G6: every GPU run redirects the process's standard error",
             "fastload/pipeline/runner.py", r' and self\.device != "cuda"\)', ")"),
    Mutation("ranks-on-cuda-0", "G7: with fewer ranks than GPUs, every rank's batches land on cuda:0",
             "fastload/runtime/device.py", r"if on_local and not on_0:\n(\s+)return local", r"if False:\n\1pass"),
    Mutation("pooled-side-stream", "G8: the side stream comes from torch's shared pool (maybe the user's stream)",
             "fastload/loader/cuda.py", r"self\._stream = private_stream\(device\)",
             "self._stream = torch.cuda.Stream(device=device)"),
    Mutation("unpin-under-copy", "slots unregistered while copies out of them are still queued",
             "fastload/loader/cuda.py", r"if self\._inflight:\n(\s+)self\._reap\(block=True\)",
             r"if self._inflight:\n\1pass"),
]


def _copy_tree(dst: str) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for name in ("fastload", "tests"):
        shutil.copytree(os.path.join(ROOT, name), os.path.join(dst, name), ignore=ignore)
    shutil.copy2(os.path.join(ROOT, "pyproject.toml"), dst)


def _apply(tree: str, m: Mutation) -> None:
    path = os.path.join(tree, m.path)
    with open(path) as f:
        text = f.read()
    new, n = re.subn(m.pattern, m.replacement, text)
    if n == 0 or (m.count and n != m.count):
        raise LookupError(f"{m.name}: {m.pattern!r} matches {n} time(s) in {m.path}, expected "
                          f"{m.count or 'at least 1'} (the code changed: update the mutation)")
    compile(new, path, "exec")  # a mutant that is not Python would "kill" every test: refused here
    with open(path, "w") as f:
        f.write(new)


def _pytest(tree: str, tests: list[str]) -> tuple[int, str, float]:
    env = dict(os.environ, PYTHONPATH=tree + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", *tests]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, check=False, cwd=tree, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        return 124, (e.stdout or "") if isinstance(e.stdout, str) else "", time.monotonic() - t0
    return p.returncode, p.stdout + p.stderr, time.monotonic() - t0


# failures that say the mutant is not a working program (a kill must come from a wrong result,
# an assertion or the fake's CudaHazard, not from a module that cannot be imported)
_BROKEN = ("SyntaxError", "IndentationError", "NameError", "ImportError", "ModuleNotFoundError",
           "UnboundLocalError")


def _first_failure(out: str) -> str:
    for line in out.splitlines():
        if line.startswith(("FAILED", "ERROR")):
            return line[:160]
    return out.strip().splitlines()[-1][:160] if out.strip() else ""


def _run(m: Mutation | None, tests: list[str], verbose: bool) -> tuple[str, int, str, float]:
    with tempfile.TemporaryDirectory(prefix="fastload-mutant-") as tree:
        _copy_tree(tree)
        if m is not None:
            _apply(tree, m)
        rc, out, s = _pytest(tree, tests)
    if verbose:
        print(out, file=sys.stderr)
    return (m.name if m else "(none)"), rc, _first_failure(out), s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=2, help="mutants tested at once (default 2)")
    ap.add_argument("--only", nargs="*", default=None, help="only these mutations (names)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print pytest's output")
    a = ap.parse_args(argv)
    chosen = [m for m in MUTATIONS if a.only is None or m.name in a.only]
    if a.only and len(chosen) != len(set(a.only)):
        print(f"unknown mutation(s); known: {', '.join(m.name for m in MUTATIONS)}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    # Every mutation must still apply to today's code (checked before anything runs).
    for m in chosen:
        with open(os.path.join(ROOT, m.path)) as f:
            n = len(re.findall(m.pattern, f.read()))
        if n == 0 or (m.count and n != m.count):
            print(f"mutation {m.name} no longer applies: {m.pattern!r} matches {n} time(s) in {m.path} "
                  f"(expected {m.count or 'at least 1'}); update tools/cuda_mutations.py", file=sys.stderr)
            return 2
    with ThreadPoolExecutor(max(1, a.jobs)) as pool:
        base = pool.submit(_run, None, TESTS, a.verbose)
        runs = [pool.submit(_run, m, TESTS, a.verbose) for m in chosen]
        _, rc, why, s = base.result()
        if rc != 0:
            print(f"the fake-CUDA tests fail without any mutation (pytest exit {rc}): {why}", file=sys.stderr)
            return 2
        print(f"unmutated: pass ({s:.0f} s)")
        killed = 0
        for m, fut in zip(chosen, runs):
            name, rc, why, s = fut.result()
            # tests failed (other codes: interrupted, internal error, nothing collected), and for a
            # reason a wrong program gives, not because the mutant cannot import or run at all
            broken = any(e in why for e in _BROKEN)
            ok = rc == 1 and not broken
            killed += ok
            print(f"{'killed  ' if ok else 'SURVIVED'} {name:36s} {s:4.0f} s  {m.bug}"
                  + (f"\n         {why}" if ok and a.verbose else "")
                  + ("" if ok else f"\n         pytest exit {rc}{' (a broken mutant, not a kill)' if broken else ''}: {why}"))
    print(f"killed {killed} of {len(chosen)} mutations ({time.monotonic() - t0:.0f} s)")
    return 0 if killed == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main())

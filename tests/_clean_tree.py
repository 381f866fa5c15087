"""A clean copy of the project (its git-tracked files: what a fresh clone has) and the sdist
or wheel that setuptools builds from it, for the packaging and plain-install tests."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def tracked_files(root: Path) -> list[str]:
    p = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=root, check=False)
    if p.returncode != 0:
        pytest.skip("not a git checkout (an unpacked sdist, say): no list of the project's files")
    return [f for f in p.stdout.splitlines() if (root / f).is_file()]


def clean_copy(root: Path, dest: Path) -> list[str]:
    """Copy the tracked files of ``root`` to ``dest``; returns their relative paths."""
    files = tracked_files(root)
    for f in files:
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / f, dest / f)
    return files


def build(tree: Path, kind: str, out: Path) -> Path:
    """``kind`` "sdist" or "wheel", built by setuptools' PEP 517 hooks in this interpreter
    (no isolated environment: setuptools and pybind11 as installed here)."""
    code = f"from setuptools import build_meta as b; print(b.build_{kind}({str(out)!r}))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, cwd=tree,
                       check=False)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return out / p.stdout.split()[-1]

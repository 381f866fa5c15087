"""Lint and types, as .ci/run and the pre-commit hooks run them: ``ruff check .`` and
``mypy`` (its files and settings are pyproject.toml's [tool.mypy]: the public API), from the
repository root. Here too so that ``make test`` alone catches what CI would; each is skipped,
saying what to install, where the tool is missing. mypy's cache (.mypy_cache) makes a second
run within the same checkout take a second or two."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKS = {"ruff": ["ruff", "check", "."], "mypy": ["mypy"]}  # python -m <these>, in ROOT


def _run(tool: str) -> subprocess.CompletedProcess:
    if importlib.util.find_spec(tool) is None:
        pytest.skip(f"{tool} is not installed (pip install -e '.[lint]')")
    return subprocess.run([sys.executable, "-m", *CHECKS[tool]], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def test_ruff_finds_nothing():
    p = _run("ruff")
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-2000:]


def test_mypy_finds_nothing_in_the_public_api():
    p = _run("mypy")
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-2000:]
    assert "Success" in p.stdout, p.stdout


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_mypy_checks_the_public_api_strictly_enough_to_mean_something():
    cfg = _pyproject()["tool"]["mypy"]
    files = set(cfg["files"])
    for f in ("fastload/__init__.py", "fastload/loader/loader.py", "fastload/store/dataset.py",
              "fastload/store/writer.py", "fastload/convert/__init__.py", "fastload/vision.py"):
        assert f in files, f
    assert all((ROOT / f).is_file() for f in files), [f for f in files if not (ROOT / f).is_file()]
    assert cfg["check_untyped_defs"] and cfg["disallow_incomplete_defs"]
    # the package says it is typed (PEP 561) and ships the marker in its wheel
    assert (ROOT / "fastload" / "py.typed").is_file()
    assert "py.typed" in _pyproject()["tool"]["setuptools"]["package-data"]["fastload"]


def test_pre_commit_hooks_run_the_installed_tools_as_ci_does():
    """Only local and meta hooks: nothing to download when a contributor commits, and the
    same commands as CI (the settings are pyproject.toml's in both)."""
    yaml = pytest.importorskip("yaml")
    cfg = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    assert {r["repo"] for r in cfg["repos"]} <= {"local", "meta"}
    hooks = {h["id"]: h for r in cfg["repos"] for h in r["hooks"]}
    assert hooks["ruff"]["entry"].split()[:2] == CHECKS["ruff"][:2] and hooks["ruff"]["language"] == "system"
    assert hooks["mypy"]["entry"].split() == CHECKS["mypy"] and hooks["mypy"]["pass_filenames"] is False

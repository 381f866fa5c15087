"""Packaging: the license (a LICENSE file, an SPDX string in pyproject.toml, PEP 639), the
Python versions tested, and the editable install of the Makefile, which must not let a clone
named ``fastload`` shadow the package when a script runs from the clone's parent directory;
``fastload doctor`` says when that happens."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from fastload.doctor import WARN, Facts
from fastload.doctor.imports import check_import_path, probe_shadow
from fastload.doctor.report import assess

ROOT = Path(__file__).resolve().parent.parent


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_license_is_an_spdx_string_with_the_apache_text_beside_it():
    project = pyproject()["project"]
    assert project["license"] == "Apache-2.0"  # PEP 639: a string, not the deprecated table
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text
    # PEP 639 forbids the License :: classifiers beside a license expression
    assert not [c for c in project.get("classifiers", []) if c.startswith("License ::")]


def test_build_requires_a_setuptools_that_accepts_license_strings():
    reqs = pyproject()["build-system"]["requires"]
    st = [r for r in reqs if re.match(r"setuptools\b", r)]
    assert len(st) == 1 and (m := re.fullmatch(r"setuptools>=(\d+)(\.\d+)*", st[0].replace(" ", "")))
    assert int(m.group(1)) >= 77  # setuptools 77.0.0 implements PEP 639 license expressions


def test_classifiers_name_the_tested_python():
    classifiers = pyproject()["project"]["classifiers"]
    assert "Programming Language :: Python :: 3.11" in classifiers
    assert f"Programming Language :: Python :: {sys.version_info[0]}.{sys.version_info[1]}" in classifiers


def test_makefile_installs_editable_in_compat_mode():
    lines = [ln for ln in (ROOT / "Makefile").read_text().splitlines() if "pip install" in ln and " -e " in ln]
    assert lines and all("--config-settings editable_mode=compat" in ln for ln in lines), lines


def _shadowing_clone(tmp: Path) -> Path:
    """``tmp/fastload``: a clone's layout (no __init__.py at its top), seen from its parent."""
    clone = tmp / "fastload"
    clone.mkdir()
    for name in ("fastload", "pyproject.toml", "setup.py", "csrc", "tests"):
        (clone / name).symlink_to(ROOT / name)
    return clone


def test_compat_install_path_imports_the_package_from_the_clones_parent(tmp_path):
    # what editable_mode=compat installs: a .pth naming the clone, read at start-up by site;
    # then the ordinary path search finds the clone's fastload/__init__.py, and a regular
    # package wins over the namespace portion that the clone's directory is
    _shadowing_clone(tmp_path)
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    (site_dir / "__editable__.fastload-0.1.0.pth").write_text(f"{ROOT}\n")
    code = (f"import site; site.addsitedir({str(site_dir)!r})\n"
            "import fastload; fastload.Loader; print(fastload.__file__)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env=env)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == str(ROOT / "fastload" / "__init__.py")


def test_doctor_probe_sees_the_shadowing_clone_exactly_when_scripts_fail(tmp_path):
    clone = _shadowing_clone(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    script = subprocess.run([sys.executable, "-c", "import fastload; fastload.Loader"], capture_output=True,
                            text=True, timeout=120, cwd=tmp_path, env=env)
    shadow = probe_shadow(str(tmp_path))
    if script.returncode != 0:  # a strict editable install: the namespace package wins
        assert "has no attribute 'Loader'" in script.stderr
        assert shadow == [str(clone)]
    else:  # a compat or regular install: the real package wins
        assert shadow is None


def test_doctor_reports_the_shadowing_clone_and_what_to_do(tmp_path):
    f = Facts(device="cpu", cwd=str(tmp_path), import_shadow=[str(tmp_path / "fastload")], torch_version="2.13.0",
              dali_version="2.4.0")
    line = {c.name: c for c in assess(f)}["import path"]
    assert line.status == WARN
    assert str(tmp_path / "fastload") in line.message and "has no attribute 'Loader'" in line.message
    assert "editable_mode=compat" in line.message and "another directory" in line.message
    assert check_import_path(Facts(device="cpu")) is None  # nothing to say when fastload is found


def test_sdist_ships_the_tests_with_everything_they_read_and_no_build_outputs(tmp_path):
    import tarfile

    from _clean_tree import build, clean_copy

    tree = tmp_path / "tree"
    tracked = clean_copy(ROOT, tree)  # what a fresh clone has
    # what a working tree also holds, never to be shipped: the built extension, bench outputs, caches
    for junk in ("fastload/_C.cpython-311-x86_64-linux-gnu.so", "bench/out/results.json", "bench/.results-1.jsonl",
                 "tests/__pycache__/conftest.cpython-311.pyc"):
        (tree / junk).parent.mkdir(parents=True, exist_ok=True)
        (tree / junk).write_text("junk")
    with tarfile.open(build(tree, "sdist", tmp_path / "dist")) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    wanted = [f for f in tracked if f.split("/")[0] in ("tests", "examples", "bench", "docs", "csrc", "fastload")
              or f in ("Makefile", "LICENSE", "README.md", "pyproject.toml", "setup.py")]
    assert [f for f in wanted if f not in names] == []
    assert "tests/conftest.py" in names and "tests/data/v1/manifest.json" in names  # what the shipped tests import
    assert not [n for n in names if n.endswith((".so", ".pyc")) or "/out/" in n or ".results-" in n]

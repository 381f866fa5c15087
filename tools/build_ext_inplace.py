#!/usr/bin/env python3
"""Build ``fastload._C`` in place without pip and without the pybind11 package.

setup.py imports ``pybind11.setup_helpers``, so ``pip install --no-build-isolation -e .``
needs pybind11 installed, and without a package registry pip cannot fetch it. The extension
needs only pybind11's *headers*, and every torch wheel ships them (``torch/include/pybind11``):
this compiles ``csrc/*.cpp`` with the C++ compiler against those headers and this
interpreter's, in parallel, into ``fastload/_C<EXT_SUFFIX>``, and imports it to check. Use
the tree through ``PYTHONPATH`` afterwards. Exit status 1 (with the compiler's message) when
no compiler, headers or build works.

    python tools/build_ext_inplace.py [--cxx g++]
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pybind11_include() -> str | None:
    """pybind11's headers: the package's if installed, else the copy inside torch."""
    try:
        import pybind11

        return pybind11.get_include()
    except ImportError:
        pass
    try:
        import torch
    except ImportError:
        return None
    inc = os.path.join(os.path.dirname(torch.__file__), "include")
    return inc if os.path.isfile(os.path.join(inc, "pybind11", "pybind11.h")) else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cxx", default=os.environ.get("CXX", "g++"), help="the C++ compiler (default $CXX or g++)")
    a = ap.parse_args(argv)
    cxx = shutil.which(a.cxx)
    if cxx is None:
        print(f"build_ext_inplace: no C++ compiler {a.cxx!r} on PATH", file=sys.stderr)
        return 1
    py_inc = sysconfig.get_paths()["include"]
    if not os.path.isfile(os.path.join(py_inc, "Python.h")):
        print(f"build_ext_inplace: Python.h not found in {py_inc} (install the python3-dev package)", file=sys.stderr)
        return 1
    pb_inc = pybind11_include()
    if pb_inc is None:
        print("build_ext_inplace: no pybind11 headers (neither the pybind11 package nor torch/include/pybind11)",
              file=sys.stderr)
        return 1
    sources = sorted(glob.glob(os.path.join(ROOT, "csrc", "*.cpp")))
    out = os.path.join(ROOT, "fastload", "_C" + sysconfig.get_config_var("EXT_SUFFIX"))
    flags = ["-O3", "-std=c++17", "-fPIC", "-fvisibility=hidden", "-pthread", f"-I{py_inc}", f"-I{pb_inc}",
             f"-I{os.path.join(ROOT, 'csrc')}"]
    with tempfile.TemporaryDirectory(prefix="fastload-build-") as tmp:
        def compile_one(src: str) -> tuple[str, subprocess.CompletedProcess]:
            obj = os.path.join(tmp, os.path.basename(src) + ".o")
            return obj, subprocess.run([cxx, *flags, "-c", src, "-o", obj], capture_output=True, text=True,
                                       check=False)

        with ThreadPoolExecutor(min(len(sources), os.cpu_count() or 1)) as pool:
            results = list(pool.map(compile_one, sources))
        for (_obj, p), src in zip(results, sources):
            if p.returncode != 0:
                print(f"build_ext_inplace: {os.path.basename(src)} failed:\n{p.stderr[-3000:]}", file=sys.stderr)
                return 1
        tmp_out = os.path.join(tmp, os.path.basename(out))
        p = subprocess.run([cxx, "-shared", "-pthread", *[o for o, _ in results], "-o", tmp_out],
                           capture_output=True, text=True, check=False)
        if p.returncode != 0:
            print(f"build_ext_inplace: linking failed:\n{p.stderr[-3000:]}", file=sys.stderr)
            return 1
        shutil.move(tmp_out, out)  # whole, or not at all
    check = subprocess.run([sys.executable, "-c", "import fastload._C as c; print(c.__file__)"], cwd=ROOT,
                           capture_output=True, text=True, check=False,
                           env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")))
    if check.returncode != 0:
        print(f"build_ext_inplace: built {out} but it does not import:\n{check.stderr[-2000:]}", file=sys.stderr)
        return 1
    print(f"built {os.path.relpath(out, ROOT)} with {os.path.basename(cxx)} and the pybind11 headers in {pb_inc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

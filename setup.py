"""Builds the C++ extension ``fastload._C`` from ``csrc/``.

The extension never includes or links torch: it sees raw buffers through the Python
buffer protocol, so it builds in pip's isolated environment with only pybind11.
"""
import glob
import sys

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

extra_compile_args = ["-O3", "-fvisibility=hidden"] if sys.platform != "win32" else ["/O2"]

ext_modules = [
    Pybind11Extension(
        "fastload._C",
        sorted(glob.glob("csrc/*.cpp")),
        include_dirs=["csrc"],
        depends=sorted(glob.glob("csrc/*.h")),  # rebuild when a header changes
        cxx_std=17,
        extra_compile_args=extra_compile_args,
    ),
]

setup(ext_modules=ext_modules, cmdclass={"build_ext": build_ext})

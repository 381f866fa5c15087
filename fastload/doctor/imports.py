"""Which ``fastload`` a ``python`` started in the current directory imports. A directory
named ``fastload`` there without an ``__init__.py`` (the clone, seen from its parent) is a
namespace package; with a default (strict) editable install, whose import hook runs after
the ordinary path search, it wins over the installed package: scripts run there fail with
``module 'fastload' has no attribute 'Loader'`` and ``python -m fastload`` / ``torchrun -m``
with "No module named fastload.__main__". The ``fastload`` command itself is not affected
(a console script's ``sys.path`` starts at its own directory), so ``fastload doctor`` can say so."""
from __future__ import annotations

import os
import subprocess
import sys

from .facts import WARN, Check, Facts

_PROBE = ("import fastload, sys\n"
          "f = getattr(fastload, '__file__', None)\n"
          "print(f if f else 'namespace:' + chr(0).join(getattr(fastload, '__path__', [])))\n")


def probe_shadow(cwd: str | None = None, timeout: float = 60) -> list[str] | None:
    """The directories of the namespace package ``fastload`` that a ``python`` started in
    ``cwd`` (default: the current directory) imports, or None when it imports the real one
    (or the probe cannot tell)."""
    try:
        p = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=timeout,
                           cwd=cwd or os.getcwd())
    except (OSError, subprocess.TimeoutExpired):
        return None
    line = p.stdout.strip().splitlines()[-1] if p.returncode == 0 and p.stdout.strip() else ""
    if not line.startswith("namespace:"):
        return None
    return [d for d in line[len("namespace:"):].split("\0") if d]


def check_import_path(f: Facts) -> Check | None:
    """A warning when ``python`` in the current directory would import a namespace package
    ``fastload`` (a clone's directory) instead of fastload; nothing when all is well."""
    if not f.import_shadow:
        return None
    where = ", ".join(f.import_shadow)
    return Check(WARN, "import path", f"python started in {f.cwd or os.getcwd()} imports {where} as a namespace "
                 "package 'fastload' (a directory named fastload without __init__.py, e.g. the clone seen from its "
                 "parent), not fastload: scripts run here fail with \"module 'fastload' has no attribute 'Loader'\" "
                 "and python -m fastload / torchrun -m fail. Run from another directory, or reinstall with "
                 "pip install -e CLONE --config-settings editable_mode=compat (make install does), which puts the "
                 "clone on sys.path so that its package wins")

"""Review test I: a static check of the code that moves batches to a GPU (fastload/loader,
fastload/pipeline, the ring), so that a blocking copy or a spinning host wait cannot come
back unnoticed on a machine without a GPU (the fake-CUDA tests check the same at run time,
but only on the paths they run).

The rules, each the fix of a finding of the GPU review:

* ``non_blocking=`` is the constant ``True`` wherever it is written (F2: ``non_blocking=False``
  is ``memcpy_and_sync``, a host wait per batch);
* ``.to(...)`` that may move a tensor to a device, and ``.cuda(...)``, pass
  ``non_blocking=True`` (F2: the default is a blocking copy); a ``.to(torch.<dtype>)`` that
  only converts is fine;
* no ``.cpu()`` and no ``torch.cuda.synchronize()`` (F2: a device-to-host copy or a device
  sync stalls the host behind the training stream);
* in a class (or a module-level function) that waits on the host for an event
  (``x.synchronize()``), every CUDA event it creates is ``Event(blocking=True)`` (F12: the
  default spins a core that DALI or the gather needs while it waits).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
CHECKED = sorted([*(ROOT / "fastload" / "loader").glob("*.py"), *(ROOT / "fastload" / "pipeline").glob("*.py"),
                  *(ROOT / "fastload" / "ring").glob("*.py"), ROOT / "fastload" / "runtime" / "device.py"])
DTYPES = {n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)}


def _dotted(node: ast.AST) -> str:
    """``torch.cuda.Event`` for that attribute chain ('' for anything else)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _kw(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _cuda_attr(call: ast.Call, attr: str) -> bool:
    """A call of ``<...>.cuda.<attr>`` (torch.cuda.X, self._torch.cuda.X)."""
    f = call.func
    return isinstance(f, ast.Attribute) and f.attr == attr and _dotted(f.value).split(".")[-1:] == ["cuda"]


def _dtype_only(call: ast.Call) -> bool:
    """``t.to(torch.int32)`` / ``t.to(dtype=...)``: a conversion on the tensor's own device."""
    if any(k.arg not in ("dtype", "copy") for k in call.keywords):
        return False
    return all(isinstance(a, ast.Attribute) and a.attr in DTYPES for a in call.args) and (
        bool(call.args) or _kw(call, "dtype") is not None)


def _scopes(tree: ast.Module):
    """The classes and module-level functions of a module: the unit of the event rule."""
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def cuda_lint(source: str, filename: str = "<string>") -> list[str]:
    """Violations of the module docstring's rules in one Python source, as ``file:line: why``."""
    tree = ast.parse(source, filename)
    out = []

    def bad(node: ast.AST, why: str) -> None:
        out.append(f"{filename}:{node.lineno}: {why}")

    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        nb = _kw(node, "non_blocking")
        if nb is not None and not _is_true(nb):
            bad(node, f"non_blocking={ast.unparse(nb)}: a blocking copy (pass non_blocking=True)")
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr == "to" and not _dtype_only(node) and not _is_true(nb):
            bad(node, f"{ast.unparse(node)}: a copy to a device without non_blocking=True blocks the host")
        elif isinstance(f, ast.Attribute) and f.attr == "cuda" and not _is_true(nb):
            bad(node, f"{ast.unparse(node)}: .cuda() without non_blocking=True blocks the host")
        elif isinstance(f, ast.Attribute) and f.attr == "cpu" and not node.args:
            bad(node, f"{ast.unparse(node)}: a device-to-host copy waits for the stream")
        elif _cuda_attr(node, "synchronize"):
            bad(node, f"{ast.unparse(node)}: a device-wide host sync")
    for scope in _scopes(tree):
        calls = [n for n in ast.walk(scope) if isinstance(n, ast.Call)]
        waits = [c for c in calls if isinstance(c.func, ast.Attribute) and c.func.attr == "synchronize"
                 and not _cuda_attr(c, "synchronize")]
        if not waits:
            continue
        for c in calls:
            if _cuda_attr(c, "Event") and not _is_true(_kw(c, "blocking")):
                bad(c, f"{ast.unparse(c)} in {scope.name}, which waits on the host for an event (line "
                       f"{waits[0].lineno}): use Event(blocking=True), or the wait spins a core")
    return out


@pytest.mark.parametrize("path", CHECKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_blocking_copy_or_spinning_wait(path):
    assert cuda_lint(path.read_text(), str(path.relative_to(ROOT))) == []


def test_the_checked_files_are_the_cuda_path():
    names = {str(p.relative_to(ROOT)) for p in CHECKED}
    assert {"fastload/loader/cuda.py", "fastload/pipeline/runner.py", "fastload/loader/feeder.py",
            "fastload/loader/threaded.py", "fastload/ring/ring.py"} <= names


@pytest.mark.parametrize("code, found", [
    # F2 as it was (8d7542b loader.py): the index copied with a host wait, and read back
    ("idx_t = idx_t.to(loader.device, non_blocking=False)", "non_blocking=False"),
    ("t = torch.from_numpy(final).to(loader.device)", "without non_blocking=True"),
    ("t = x.to('cuda:0', torch.float16)", "without non_blocking=True"),
    ("t = x.cuda()", ".cuda() without"),
    ("t = x.to(dev, non_blocking=blocking)", "non_blocking=blocking"),
    ("i = idx_t.cpu().numpy()", "device-to-host"),
    ("torch.cuda.synchronize(dev)", "device-wide"),
    # F12 as it was (8d7542b pipeline/__init__.py): a spinning event the host waits on
    ("class Runner:\n    def run(self):\n        self._copied.synchronize()\n"
     "    def copy(self):\n        self._copied = torch.cuda.Event()\n", "use Event(blocking=True)"),
    ("def f(ev):\n    e = self._torch.cuda.Event(blocking=False)\n    e.synchronize()\n", "in f, which waits"),
])
def test_the_rules_catch_what_the_review_found(code, found):
    msgs = cuda_lint(code)
    assert len(msgs) == 1 and found in msgs[0], msgs


@pytest.mark.parametrize("code", [
    "out = t.to(self._device, non_blocking=True)",
    "o = offsets.to(torch.int32)",
    "o = offsets.to(dtype=torch.float16)",
    "x = arr.astype(np.int64)",
    "class A:\n    def f(self):\n        ev = torch.cuda.Event(blocking=True)\n        ev.synchronize()\n",
    "class Handoff:\n    def record(self):\n        return torch.cuda.Event()\n",  # never waited on the host
    "stop = threading.Event()\nstop.wait()",
])
def test_the_rules_accept_the_right_forms(code):
    assert cuda_lint(code) == []

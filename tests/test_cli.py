"""The package face and the ``fastload`` command: lazy imports (``import fastload`` and the
light commands never load torch or DALI), no import circles, the public names, the output
conventions shared by every command (``--json [FILE]``, ``-`` = stdout, a closed stdout),
``--version``."""
from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import fastload
import fastload.errors

from _damage import damaged_copy
from _zygote import run_python

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "fastload"


def env() -> dict[str, str]:
    """The subprocess environment, built when a test runs (not at import): it carries what
    the fixtures set, e.g. the empty CUDA_VISIBLE_DEVICES that hides a GPU from tests not
    marked ``cuda`` (conftest.hide_cuda)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


HEAVY = ("torch", "nvidia", "numpy", "pyarrow", "PIL")


def py(code: str, *, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env(),
                          cwd=ROOT)


def fl(*args, cwd=None, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    """``python -m fastload ARGS``, forked from the tests' launcher (tests/_zygote.py, which has
    imported torch: what a command imports is checked with ``py``, in new interpreters)."""
    if not kw:
        return run_python("-m", "fastload", *args, timeout=timeout, env=env(), cwd=cwd or ROOT)
    return subprocess.run([sys.executable, "-m", "fastload", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env(), cwd=cwd or ROOT, **kw)


def loaded_after(code: str, prefixes=("torch", "nvidia")) -> list[str]:
    """Top-level packages among ``prefixes`` in sys.modules after running ``code`` in a
    fresh interpreter."""
    p = py(code + "\nimport sys, json\n"
           f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({list(prefixes)!r}))))")
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def raw_ds(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("cli")
    with fastload.ShardWriter(d / "ds", {"x": "float32[16]", "label": "int64"}, label="label") as w:
        w.write_batch({"x": np.arange(400 * 16, dtype=np.float32).reshape(400, 16), "label": np.arange(400) % 5})
    np.savez(d / "src.npz", x=np.zeros((50, 4), np.float32), label=np.arange(50) % 3)
    return d / "ds"


# -- the package face ----------------------------------------------------------------------
def test_commands_run_as_the_test_does(monkeypatch):
    """A GPU host's `fastload bench` run by a test not marked `cuda` sees no GPU either."""
    monkeypatch.setenv("FASTLOAD_TEST_PROBE", "set by the test")
    p = py("import os; print(repr((os.environ.get('CUDA_VISIBLE_DEVICES'), os.environ.get('FASTLOAD_TEST_PROBE'))))")
    assert p.stdout.strip() == repr(("", "set by the test")), p.stderr[-2000:]


def test_import_fastload_loads_nothing_heavy():
    assert loaded_after("import fastload", HEAVY) == []
    assert loaded_after("import fastload; fastload.__version__; fastload.FastloadError; fastload.UsageError",
                        HEAVY) == []


def test_vision_presets_do_not_load_torch_or_dali():
    assert loaded_after("import fastload.vision as v\nv.train(224); v.eval(224, resize=256)\n"
                        "import fastload\nfastload.vision.train(224, dtype='uint8', layout='HWC')") == []


def test_public_names_resolve_and_all_is_sorted():
    assert fastload.__all__ == sorted(fastload.__all__)
    for name in fastload.__all__:
        assert getattr(fastload, name) is not None, name
        assert name in dir(fastload)
    for name in ("BadSamples", "ConvertError", "DecodeError", "FastloadError", "FormatError", "SampleError",
                 "UsageError"):
        assert getattr(fastload, name) is getattr(fastload.errors, name)
        assert issubclass(getattr(fastload, name), fastload.FastloadError)
    assert callable(fastload.convert) and callable(fastload.verify) and fastload.vision.train(224) is not None
    assert fastload.Loader.__name__ == "Loader" and fastload.Dataset.__name__ == "Dataset"
    assert fastload.FORMAT_VERSION >= 1
    with pytest.raises(AttributeError, match="'NoSuchThing'.*the public names are BadSamples"):
        fastload.NoSuchThing  # noqa: B018
    p = py("from fastload import *\nprint(sorted(k for k in dir() if not k.startswith('_')))")
    assert p.returncode == 0, p.stderr
    assert eval(p.stdout) == sorted(n for n in fastload.__all__ if not n.startswith("_"))  # noqa: S307


def test_fastload_convert_is_the_callable_package_whatever_was_imported_first():
    """Importing the subpackage fastload.convert binds it to the parent's attribute of the same
    name, so the face resolves ``convert`` to that package (callable as its convert()) in every
    import order, never sometimes the function and sometimes the module."""
    for code in ("import fastload.convert.common\nimport fastload\nf = fastload.convert",
                 "import fastload\nf = fastload.convert\nimport fastload.convert.table\nf = fastload.convert",
                 "from fastload.convert import ConvertError\nfrom fastload import convert as f",
                 "from fastload import convert as f"):
        p = py(code + "\nimport sys\nprint(f is sys.modules['fastload.convert'], callable(f), "
                      "f.convert.__name__)")
        assert p.returncode == 0 and p.stdout.split() == ["True", "True", "convert"], (code, p.stdout, p.stderr)


def test_verify_stays_the_function_when_the_store_exposes_its_submodule():
    """The whole-dataset check is the submodule fastload.store.full_check: no submodule of the
    store is named verify, so importing it shadows nothing; fastload.verify and
    fastload.store.verify are the function in any case."""
    p = py("import sys, fastload.store as s, fastload.store.full_check\nm = sys.modules['fastload.store.full_check']\n"
           "import fastload\nprint(fastload.verify is m.verify is s.verify, callable(fastload.verify))")
    assert p.returncode == 0 and p.stdout.strip() == "True True", p.stderr


@pytest.mark.parametrize("module, name", [
    ("fastload.store", "FormatError"), ("fastload.store.reader", "FormatError"), ("fastload.store", "SampleError"),
    ("fastload.store.writer", "SampleError"), ("fastload.convert", "ConvertError"),
    ("fastload.loader.decode", "DecodeError"), ("fastload.pipeline.runner", "BadSamples")])
def test_the_exported_errors_are_the_raised_ones(module, name):
    """``except fastload.X`` catches what fastload raises: one class, in fastload.errors."""
    raised = getattr(importlib.import_module(module), name)
    assert raised is getattr(fastload, name) is getattr(fastload.errors, name)
    assert issubclass(raised, fastload.FastloadError)


def test_version():
    p = fl("--version")
    assert p.returncode == 0 and p.stdout.startswith(f"fastload {fastload.__version__} ")
    assert fastload.__version__ == importlib.metadata.version("fastload")  # one version: pyproject's


# -- lazy commands ---------------------------------------------------------------------------
def test_help_builds_from_the_standard_library_only():
    assert loaded_after("from fastload.cli import build_parser\nbuild_parser()", HEAVY) == []
    for args in (["--help"], ["bench", "--help"], ["inspect", "--help"], ["convert", "--help"]):
        p = fl(*args)
        assert p.returncode == 0 and "usage: fastload" in p.stdout, p.stderr
    assert "--json [FILE]" in fl("bench", "--help").stdout and "--json [FILE]" in fl("inspect", "--help").stdout
    assert "'-'" in fl("--help").stdout  # the convention is stated in the top-level help


@pytest.mark.parametrize("command", ["convert", "inspect", "inspect --json", "verify"])
def test_light_commands_do_not_load_torch_or_dali(raw_ds, tmp_path, command):
    args = {"convert": ["convert", "arrays", raw_ds.parent / "src.npz", tmp_path / "out", "-q"],
            "inspect": ["inspect", raw_ds], "inspect --json": ["inspect", "--json", raw_ds],
            "verify": ["verify", raw_ds]}[command]
    code = (f"import sys\nfrom fastload.cli import main\nrc = main({[str(a) for a in args]!r})\n"
            "assert rc == 0, rc")
    assert loaded_after(code) == []


# -- no import circles -------------------------------------------------------------------------
def _modules() -> dict[str, Path]:
    """Every module of the package: Python files, and compiled extensions (``fastload._C``:
    a leaf that imports nothing of the package)."""
    out = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    for p in [*PKG.rglob("*.so"), *PKG.rglob("*.pyd")]:
        parts = p.relative_to(ROOT).parts
        out[".".join([*parts[:-1], p.name.split(".")[0]])] = p
    return out


def _type_checking_only(node: ast.AST) -> bool:
    t = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING")
        or (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"))


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """fastload modules that module ``name`` makes Python run, from imports anywhere in it
    (module level or inside functions; ``if TYPE_CHECKING:`` blocks never run and are left
    out). ``from P import n`` runs ``P.n`` if that is a module, and P's ``__init__`` -- except
    when P is a package that ``name`` lives in, which Python initialised before ``name``:
    then only names read from its namespace (``from fastload import __version__``) count.
    A string equal to a submodule's name (``importlib.import_module("fastload.loader")``, a
    table of lazy names) counts as an import too."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    parts = name.split(".")
    ancestors = {".".join(parts[:i]) for i in range(1, len(parts))} | ({name} if path.name == "__init__.py" else set())
    found: set[str] = set()

    def run(dotted: str) -> None:  # importing a.b.c runs a, a.b and a.b.c
        p = dotted.split(".")
        found.update(".".join(p[:i]) for i in range(1, len(p) + 1) if ".".join(p[:i]) not in ancestors)

    def visit(node: ast.AST) -> None:
        if _type_checking_only(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for a in node.names:
                run(a.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                p = package.split(".")
                base = ".".join(p[:len(p) - (node.level - 1)] + ([node.module] if node.module else []))
            run(base)
            for a in node.names:
                if f"{base}.{a.name}" in modules:
                    run(f"{base}.{a.name}")
                else:
                    found.add(base)  # a name read from base's namespace
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value \
                and node.value in modules:  # "fastload" alone is a name (logger, format), not an import
            found.add(node.value)
        for child in ast.iter_child_nodes(node):
            visit(child)

    if path.suffix != ".py":  # a compiled extension
        return set()
    visit(ast.parse(path.read_text(), str(path)))
    return {m for m in found if m in modules and m != name}


def test_no_import_cycles_in_the_package():
    modules = _modules()
    graph = {m: sorted(_imports(m, p, modules)) for m, p in modules.items()}
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def dfs(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in graph[m]:
            if state.get(n) == 1:
                cycles.append(" -> ".join(stack[stack.index(n):] + [n]))
            elif n not in state:
                dfs(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            dfs(m)
    assert graph["fastload.cli"] and graph["fastload"]  # the scan sees imports at all
    assert "fastload.loader" in graph["fastload"]  # ... and the lazy table of the package face
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_cycle_scan_sees_function_level_relative_and_lazy_imports(tmp_path):
    pkg = tmp_path / "fastload"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "import importlib\ndef __getattr__(n):\n    return importlib.import_module('fastload.a')\n",
        "a.py": "def f():\n    from .sub import b\n",
        "c.py": "import logging\nlog = logging.getLogger('fastload')\n",
        "sub/__init__.py": "",
        "sub/x.py": "from fastload import VERSION\n",
        "sub/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .. import c\n"
                    "from . import x\ndef g():\n    from ..a import f\n",
    }
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    mods = {"fastload": "__init__.py", "fastload.a": "a.py", "fastload.c": "c.py", "fastload.sub": "sub/__init__.py",
            "fastload.sub.x": "sub/x.py", "fastload.sub.b": "sub/b.py"}
    graph = {m: _imports(m, pkg / rel, {k: pkg / v for k, v in mods.items()}) for m, rel in mods.items()}
    assert graph == {"fastload": {"fastload.a"}, "fastload.a": {"fastload.sub", "fastload.sub.b"},
                     "fastload.c": set(), "fastload.sub": set(), "fastload.sub.x": {"fastload"},
                     "fastload.sub.b": {"fastload.sub.x", "fastload.a"}}


# -- one home for shared policies (in the CLI and benchmark code) -----------------------------------
def test_bench_and_cli_code_have_no_own_core_count_or_crop():
    files = [*sorted((PKG / "bench").glob("*.py")), PKG / "cli.py", *sorted((PKG / "demo").glob("*.py")),
             *sorted((ROOT / "bench").glob("*.py"))]
    for f in files:
        text = f.read_text()
        assert "sched_getaffinity" not in text and "cpu_count" not in text, f"{f}: use fastload.runtime.system.usable_cores()"
        tree = ast.parse(text)
        # the one exception: the DataLoader baseline's per-image IoU crop, written from
        # torchvision's RandomIoUCrop (the competitor's way; fastload's own is vectorised in
        # fastload.pipeline.detection.iou_crop), not a RandomResizedCrop
        crops = [n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))
                 and "crop" in n.name.lower() and (f.name, n.name) != ("bench_detection.py", "iou_crop_one")]
        assert not crops, f"{f} defines {crops}: import fastload.pipeline.crops (the only RandomResizedCrop)"
    assert not (ROOT / "bench" / "_common.py").exists()  # one benchmark framework: fastload.bench.report


# -- output conventions ---------------------------------------------------------------------------
def test_inspect_json_goes_to_stdout_or_to_a_file(raw_ds, tmp_path):
    manifest = json.loads((raw_ds / "manifest.json").read_text())
    for args in (["inspect", "--json", raw_ds], ["inspect", raw_ds, "--json"], ["inspect", raw_ds, "--json", "-"],
                 ["inspect", "--json", "-", raw_ds]):
        p = fl(*args, cwd=tmp_path)
        assert p.returncode == 0 and json.loads(p.stdout) == manifest and p.stderr == "", (args, p.stderr)
    assert not (tmp_path / "-").exists()
    p = fl("inspect", "--json", tmp_path / "m.json", raw_ds)
    assert p.returncode == 0 and p.stdout == f"wrote {tmp_path / 'm.json'}\n"
    assert json.loads((tmp_path / "m.json").read_text()) == manifest
    p = fl("inspect", raw_ds, "--json", tmp_path / "m2.json")
    assert p.returncode == 0 and json.loads((tmp_path / "m2.json").read_text()) == manifest
    assert [f.name for f in tmp_path.iterdir() if ".tmp" in f.name] == []
    p = fl("inspect", "--json")
    assert p.returncode == 2 and "required: PATH" in p.stderr
    p = fl("inspect", raw_ds, "--json", tmp_path / "nodir" / "m.json")
    assert p.returncode == 1 and "nodir" in p.stderr and "does not exist" in p.stderr
    p = fl("inspect", tmp_path / "missing")
    assert p.returncode == 1 and p.stderr.startswith("fastload inspect: error: ") and "missing" in p.stderr
    text = fl("inspect", raw_ds).stdout
    assert "samples   400" in text and "label" in text and "classes   5" in text


def test_verify_json_says_ok_or_names_the_damaged_shards(raw_ds, tmp_path):
    p = fl("verify", raw_ds, "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == {"path": str(raw_ds), "ok": True, "problems": []}
    assert "OK" in p.stderr  # the human line goes to stderr when stdout holds the JSON
    bad = tmp_path / "bad"
    shard = damaged_copy(raw_ds, bad)
    p = fl("verify", bad, "--json", tmp_path / "v.json")
    assert p.returncode == 1
    doc = json.loads((tmp_path / "v.json").read_text())
    assert doc["ok"] is False and len(doc["problems"]) == 1 and shard.name in doc["problems"][0]


def test_bench_json_dash_is_stdout(raw_ds, tmp_path):
    p = fl("bench", raw_ds, "--batch-size", "100", "--max-batches", "2", "--warmup", "1", "--no-progress",
           "--json", "-", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)  # stdout holds the JSON document only
    assert r["results"][0]["system"] == "fastload Loader" and r["results"][0]["samples"] == 200
    assert r["settings"]["max_batches"] == 2 and r["dataset"]["samples"] == 400
    assert "fastload Loader" in p.stderr and "vs DataLoader" in p.stderr  # the text report went to stderr
    assert not (tmp_path / "-").exists()
    p = fl("bench", "--json", raw_ds, "--batch-size", "100", "--max-batches", "1", "--warmup", "0",
           "--no-progress", cwd=tmp_path)
    assert p.returncode == 0 and json.loads(p.stdout)["results"][0]["samples"] == 100, p.stderr


@pytest.mark.parametrize("args, rc", [
    (["inspect", "{ds}"], 141), (["inspect", "--json", "{ds}"], 141), (["verify", "{ds}"], 141),
    (["convert", "arrays", "{src}", "{tmp}/out", "-q"], 141),
    (["bench", "{ds}", "--batch-size", "100", "--max-batches", "1", "--no-progress"], 141),
    (["bench", "{ds}", "--batch-size", "100", "--max-batches", "1", "--no-progress", "--json"], 141),
    (["--help"], None), (["--version"], None), (["bench", "--help"], None),
])
def test_a_closed_stdout_ends_quietly(raw_ds, tmp_path, args, rc):
    """``fastload ... | head`` when head has gone: no traceback, exit 141 (128 + SIGPIPE)."""
    args = [a.format(ds=raw_ds, src=raw_ds.parent / "src.npz", tmp=tmp_path) for a in args]
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the command writes anything
    try:
        p = subprocess.run([sys.executable, "-m", "fastload", *args], stdout=w, stderr=subprocess.PIPE, text=True,
                           env=env(), timeout=600)
    finally:
        os.close(w)
    assert "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr and "Exception ignored" not in p.stderr, p.stderr
    if rc is not None:
        assert p.returncode == rc, p.stderr
    else:  # argparse's own --help/--version output: quiet, whatever the status
        assert p.returncode in (0, 141)


def test_inspect_json_into_head(raw_ds):
    p = subprocess.run(f"'{sys.executable}' -m fastload inspect --json '{raw_ds}' | head -n 2", shell=True,
                       capture_output=True, text=True, env=env(), timeout=300)
    assert p.stdout == '{\n "format": "fastload",\n' and p.stderr == "", p.stderr

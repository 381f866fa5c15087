"""The structure drawn from the code (issue 31): folders by concept, layers one way.

Every import of ``fastload/`` — at module level, inside functions, under ``TYPE_CHECKING`` —
is an arrow. Units are the top-level modules and packages. An arrow between two units must
point down the layers below; within a unit, modules may import each other but never in a
circle. The only arrows exempt are those to the compiled extension ``fastload._C`` and to
the package's ``__version__``.
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "fastload"

# top to bottom: a unit imports only units of the layers below its own
LAYERS = [
    {"__main__"},
    {"cli"},
    {"demo"},  # runs convert, the Loader and the bench
    {"bench", "doctor"},
    {"__init__"},  # the public face: lazy re-exports of what is below
    {"loader", "convert"},
    {"vision", "video", "audio"},  # the public presets: DALI graphs of pipeline/
    {"pipeline"},  # DALI graphs, run on batches the store hands over
    {"store"},  # datasets: format, writer, readers, concatenated and mixed datasets
    {"remote"},  # object stores and the node-local shard cache, below the store
    {"sampling", "ring"},  # orders over integers; the C++ ring over raw arrays: used by every layer above
    {"runtime", "manifest_checksum"},  # where the process runs; the manifest's own checksum
    {"files", "validate"},  # regular files and the atomic write; argument values
    {"errors"},
]
RANK = {u: i for i, layer in enumerate(LAYERS) for u in layer}
EXEMPT = {"fastload._C", "fastload.__version__"}


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for m, p in mods.items():
        pkg = m.split(".") if p.name == "__init__.py" else m.split(".")[:-1]
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg[:len(pkg) - node.level + 1]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                if src.split(".")[0] != "fastload":
                    continue
                for a in node.names:
                    full = f"{src}.{a.name}"
                    edges[m].add(full if full in mods or full in EXEMPT else src)
            elif isinstance(node, ast.Import):
                edges[m].update(a.name for a in node.names if a.name.split(".")[0] == "fastload")
    return edges


def _unit(m: str) -> str:
    parts = m.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_unit_has_a_layer():
    units = {_unit(m) for m in _modules()}
    assert units - {"_C"} <= set(RANK), f"place these in LAYERS: {sorted(units - set(RANK))}"


def test_arrows_between_units_point_down():
    mods = _modules()
    up = []
    for a, bs in _imports(mods).items():
        for b in bs - EXEMPT:
            ua, ub = _unit(a), _unit(b)
            if ua != ub and RANK[ub] <= RANK[ua]:
                up.append(f"{a} -> {b}")
    assert not up, "imports that climb or cross a layer:\n" + "\n".join(sorted(up))


def test_no_import_circle():
    mods = _modules()
    # a package's __init__ re-exporting its own modules is not an arrow back (they import it only as a face)
    edges = {a: {b for b in bs if b in mods and not (mods[a].name == "__init__.py" and b.startswith(a + "."))}
             for a, bs in _imports(mods).items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(mods):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_the_top_floor_keeps_at_most_eight_loose_modules():
    loose = sorted(p.name for p in PKG.glob("*.py"))
    assert len(loose) <= 8, loose


def test_no_test_server_ships_in_the_package():
    for p in PKG.rglob("*.py"):
        text = p.read_text()
        assert not p.stem.startswith("testing"), p
        for server in ("ThreadedMotoServer", "RangeHTTPServer", "gcp_storage_emulator", "seaweedfs"):
            assert server not in text, f"{p} names {server}: test servers live in tests/_servers/"

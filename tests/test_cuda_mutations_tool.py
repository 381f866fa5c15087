"""tools/cuda_mutations.py stays in step with the code: every mutation still applies to today's
tree (a refactor that moves the code it names fails here, in the ordinary suite, not only in
the slower mutation run), applying one changes exactly what it names, and a stale one stops the
tool with exit status 2 before anything runs."""
from __future__ import annotations

import importlib.util
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tool():
    spec = importlib.util.spec_from_file_location("cuda_mutations", os.path.join(ROOT, "tools", "cuda_mutations.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


TOOL = _tool()


@pytest.mark.parametrize("m", TOOL.MUTATIONS, ids=lambda m: m.name)
def test_every_mutation_applies_to_today_s_code(m, tmp_path):
    src = os.path.join(ROOT, m.path)
    with open(src) as f:
        text = f.read()
    n = len(re.findall(m.pattern, text))
    assert n >= 1 and (not m.count or n == m.count), f"{m.name}: {n} match(es) in {m.path}"
    dst = tmp_path / m.path
    dst.parent.mkdir(parents=True)
    dst.write_text(text)
    TOOL._apply(str(tmp_path), m)
    mutated = dst.read_text()
    assert mutated != text
    compile(mutated, str(dst), "exec")  # still Python: a failure means the bug, not a syntax error


def test_the_mutations_include_the_review_s_three():
    names = {m.name for m in TOOL.MUTATIONS}
    assert {"slot-released-early", "no-record-stream", "dali-output-off-stream"} <= names
    assert len(names) == len(TOOL.MUTATIONS)


def test_a_stale_mutation_stops_the_tool(monkeypatch, capsys):
    stale = TOOL.Mutation("stale", "a bug", "fastload/loader/cuda.py", r"no such code anywhere", "x")
    monkeypatch.setattr(TOOL, "MUTATIONS", [stale])
    assert TOOL.main([]) == 2
    assert "mutation stale no longer applies" in capsys.readouterr().err

"""The documentation site (docs/, mkdocs.yml) and the README as its front page.

The site build needs the ``docs`` extra (mkdocs-material, mkdocstrings[python]); without it
that test is skipped (``make docs`` installs the extra into .venv, after which ``make test``
runs it too). The README checks and the CLI page's renderer need nothing extra.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 250


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _links(markdown: str) -> list[str]:
    """Relative link targets of a Markdown text (no URLs, no in-page anchors)."""
    targets = re.findall(r"\]\(([^)\s]+)\)", markdown)
    return [t.split("#", 1)[0] for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def test_readme_is_a_front_page_that_links_the_docs():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"
    links = _links(text)
    assert "docs/index.md" in links
    docs_links = [t for t in links if t.startswith("docs/")]
    assert len(docs_links) >= 10, docs_links  # a map into the site, not one link
    missing = [t for t in links if not (ROOT / t).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"
    # the two commands, exactly as the Makefile runs them
    assert "make demo    #" in text and "make test    #" in text
    makefile = (ROOT / "Makefile").read_text()
    for target in ("demo", "test", "docs"):
        assert re.search(rf"^{target}:", makefile, re.MULTILINE), f"Makefile has no {target!r} target"
    # a CPU-only torch and the tested Python version, as the issue asks
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in text
    assert "Tested on Python 3.11" in text


def test_readme_headline_numbers_come_from_the_results_table():
    """The README's headline numbers are copied from the generated Results table of
    docs/benchmarks.md (``bench/run_all.py --docs``): every figure in a row of the README's
    table must be in that table, so a new run that changes them fails here until the README
    is updated."""
    bench = (DOCS / "benchmarks.md").read_text()
    generated = bench.split("<!-- bench-results:begin -->", 1)[1].split("<!-- bench-results:end -->", 1)[0]
    section = README.read_text().split("## Headline numbers", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in section.splitlines() if ln.startswith("| ") and not ln.startswith("| workload")]
    assert len(rows) >= 5, rows
    number = re.compile(r"(?<![\w.])\d(?:[\d,]*\d)?(?:\.\d+)?(?:x|%)?")
    # figures only: the workload's own sizes ("batch 300", "224") are in the table's workload cells too
    stale = [(row.split("|")[1].strip(), n) for row in rows for n in number.findall(row) if n not in generated]
    assert not stale, f"README headline figures not in docs/benchmarks.md's generated table: {stale}"


def test_every_docs_link_resolves():
    """Relative links between pages (mkdocs --strict checks them too; this runs without it)."""
    bad = []
    for page in DOCS.rglob("*.md"):
        for target in _links(page.read_text()):
            if target and not (page.parent / target).resolve().exists():
                bad.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not bad, bad


def test_cli_reference_renders_every_subcommand():
    """The hook that writes the CLI page renders ``fastload.cli``'s parser itself: every
    subcommand, with the usage and options its own --help prints."""
    hook = _load(DOCS / "_build" / "cli_reference.py", "cli_reference_hook")
    from fastload.cli import build_parser

    parser = build_parser()
    subs = hook.subcommands(parser)
    assert {"convert", "inspect", "verify", "recover", "prefetch", "demo", "bench", "doctor"} <= set(subs)
    page = hook.on_page_markdown(f"# CLI\n\n{hook.MARKER}\n", None, {"config_file_path": str(ROOT / "mkdocs.yml")},
                                 None)
    assert hook.MARKER not in page
    for name, sub in subs.items():
        section = page.split(f"## `fastload {name}`", 1)[1].split("\n## ", 1)[0]
        assert f"usage: fastload {name}" in section
        for action in sub._actions:
            for flag in action.option_strings:
                assert flag in section, (name, flag)
    # a page without the marker is left alone
    assert hook.on_page_markdown("# other\n", None, {"config_file_path": str(ROOT / "mkdocs.yml")}, None) == \
        "# other\n"


def test_rst_roles_become_code_spans():
    ext = _load(DOCS / "_build" / "rst_roles.py", "rst_roles_ext")
    assert ext.plain("see :class:`fastload.Dataset` and :func:`~fastload.store.verify`") == \
        "see `fastload.Dataset` and `verify`"
    assert ext.plain(":mod:`fastload.sampling.packing`, ``x``") == "`fastload.sampling.packing`, ``x``"


@pytest.mark.slow
def test_site_builds_strict(tmp_path):
    """``mkdocs build --strict``: no broken link or anchor, no missing nav page, no docstring
    the API reference cannot parse; the generated pages hold what they promise."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    pytest.importorskip("material")
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                        "-d", str(site)], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300,
                       check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "WARNING" not in p.stderr, p.stderr[-3000:]
    api = (site / "reference" / "api" / "index.html").read_text()
    for name in ("Loader", "Dataset", "ShardWriter", "Sampler", "Mixture", "convert", "verify", "train", "eval",
                 "FastloadError", "HostUnreachable"):
        assert 'id="fastload.' in api and re.search(rf'id="[\w.]*\b{name}"', api), name
    assert ":class:`" not in api and ":func:`" not in api  # the roles extension ran
    cli = (site / "reference" / "cli" / "index.html").read_text()
    assert "usage: fastload convert" in cli and "--on-error" in cli and "usage: fastload doctor" in cli
    bench = (site / "benchmarks" / "index.html").read_text()
    assert "vs baseline" in bench  # the generated Results table

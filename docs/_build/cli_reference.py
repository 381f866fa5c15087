"""mkdocs hook: the CLI reference is rendered from ``fastload.cli.build_parser()`` at every
build, so it never goes stale. A page holding the line ``<!-- cli-reference -->`` gets, in its
place, ``fastload --help`` and then each subcommand's ``--help``, in the parser's order."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

MARKER = "<!-- cli-reference -->"
WIDTH = 100  # help wrapped the same on every machine, whatever the terminal


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """name -> subparser, in the order they were added."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def render(parser: argparse.ArgumentParser) -> str:
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(WIDTH)  # argparse's HelpFormatter reads it for its width
    try:
        parts = ["## `fastload`", "", "```text", parser.format_help().rstrip(), "```", ""]
        for name, sub in subcommands(parser).items():
            parts += [f"## `fastload {name}`", "", "```text", sub.format_help().rstrip(), "```", ""]
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old
    return "\n".join(parts)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    root = str(Path(config["config_file_path"]).resolve().parent)  # the clone being documented
    if root not in sys.path:
        sys.path.insert(0, root)
    from fastload.cli import build_parser

    return markdown.replace(MARKER, render(build_parser()))

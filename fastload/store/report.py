"""The skipped-samples report: ``skipped.jsonl`` in a dataset directory.

``fastload convert --on-error skip`` leaves out samples it cannot convert and lists them
here, one JSON object per line (``{"index", "key", "reason"}``). The report is written
atomically (a temporary name, then a rename), so a reader never sees half of it.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

__all__ = ["read_report", "write_report"]


def write_report(path: Path, records: Iterable[Mapping[str, Any]]) -> int:
    """Write the skipped-sample report (JSON lines) atomically; return the count."""
    records = list(records)
    tmp = path.with_name("." + path.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(dict(r)) + "\n")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return len(records)


def read_report(directory: Path, offset: int = 0) -> list[dict]:
    """The records of ``directory``'s skipped-sample report (none if it has no report), each
    ``index`` shifted by ``offset`` (a conversion group's first sample in the whole dataset)."""
    from .format import SKIPPED_REPORT

    out = []
    try:
        with open(Path(directory) / SKIPPED_REPORT, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    r["index"] = int(r["index"]) + offset
                    out.append(r)
    except FileNotFoundError:
        pass
    return out

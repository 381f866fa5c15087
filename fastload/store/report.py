"""The skipped-samples report: ``skipped.jsonl`` in a dataset directory.

``fastload convert --on-error skip`` leaves out samples it cannot convert and lists them
here, one JSON object per line (``{"index", "key", "reason"}``). The report is written
atomically (:func:`fastload.files.atomic_write`), so a reader never sees half of it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping

from ..files import atomic_write

__all__ = ["read_report", "write_report"]


def write_report(path: Path, records: Iterable[Mapping[str, Any]]) -> int:
    """Write the skipped-sample report (JSON lines) atomically and durably
    (:func:`fastload.files.atomic_write`); return the count."""
    records = list(records)
    atomic_write(path, "".join(json.dumps(dict(r)) + "\n" for r in records))
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

"""What ``fastload inspect`` shows: a dataset's fields, counts, shards, sizes and class
balance as text, or its manifest as JSON. Reads ``manifest.json`` only (no shard is opened).
"""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import format_bytes
from .format import SKIPPED_REPORT
from .reader import DatasetReader

__all__ = ["inspect_json", "inspect_text"]

_MAX_CLASSES = 20  # classes listed one per line; the rest are counted


def _open(path: str | os.PathLike) -> DatasetReader:
    """The torch-free reader: it checks the manifest once (the checks the Loader makes) and
    opens no shard."""
    return DatasetReader(path)


def inspect_json(path: str | os.PathLike) -> dict:
    """The dataset's manifest, after the reader accepted it."""
    with _open(path) as ds:  # a URL: the manifest is fetched, no shard is
        return ds.manifest


def inspect_text(path: str | os.PathLike) -> str:
    """The human-readable summary printed by ``fastload inspect``."""
    with _open(path) as ds:
        return _text(ds)


def _total_bytes(m: dict) -> int:
    """The manifest's ``total_bytes`` (optional; the schema checked it against the shards)."""
    return m["total_bytes"] if "total_bytes" in m else sum(s["bytes"] for s in m["shards"])


def _text(ds: DatasetReader) -> str:
    m = ds.manifest
    sizes = [int(s) for s in ds.shard_sizes]
    lines = [f"dataset   {ds.path}",
             f"format    fastload v{m['format_version']}",
             f"samples   {len(ds):,}",
             f"shards    {ds.num_shards} ({format_bytes(_total_bytes(m))}; "
             f"{min(sizes, default=0):,}..{max(sizes, default=0):,} samples each)",
             "fields"]
    for name, f in ds.fields.items():
        extra = " (label)" if name == ds.label_field else ""
        lines.append(f"  {name:<20} {f.kind:<7} {str(f) if f.fixed or f.ragged else ''}{extra}")
    if ds.class_counts is not None:
        counts = [int(c) for c in ds.class_counts]
        names = ds.class_names or [str(i) for i in range(len(counts))]
        total = max(sum(counts), 1)
        lines.append(f"classes   {len(counts)} (min {min(counts, default=0)}, "
                     f"max {max(counts, default=0)} samples per class)")
        for i, (n, c) in enumerate(zip(names, counts)):
            if i == _MAX_CLASSES:
                lines.append(f"  … {len(counts) - _MAX_CLASSES} more")
                break
            lines.append(f"  {i:>4} {n:<24} {c:>9,} {100 * c / total:5.1f}%")
    skipped = Path(ds.path) / SKIPPED_REPORT
    if ds.url is None and skipped.exists():
        with open(skipped, encoding="utf-8", errors="replace") as f:
            lines.append(f"skipped   {sum(1 for _ in f)} source sample(s) at convert time (see {skipped})")
    return "\n".join(lines)

"""The commit of a distributed conversion, on the driver: parts in, one dataset out.

1. Check every group: its part exists, covers the planned rows, has the planned fields,
   label field, class names and metadata, and its shard files have the recorded sizes.
2. In group order, rename the part shards to ``shard-NNNNN.arrow`` (inside DST, or inside a
   staging directory when DST holds a dataset to replace: ``--overwrite`` keeps its
   guarantee, the old dataset is untouched until the new one is complete).
3. Merge label counts and the counts of images resized for ``--max-size``; concatenate the
   parts' ``skipped.jsonl`` with indices made global.
4. Write ``manifest.json`` last (then swap the staging directory in), and remove the parts.

The checksums are the ones each task computed while writing (the shard files are renamed,
never rewritten), so the commit reads no sample data.

Other destinations: the commit talks to its destination only through ``Target``
(``place`` a finished part shard under its final name, ``put_report``, ``put_manifest``
last, ``discard_parts``). A local directory renames; an object store would have tasks
upload their shard under its final name and ``place`` only record it, keeping the same
order of events and the manifest last.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from ._store import MANIFEST, SKIPPED_REPORT, commit_transaction, fsync_dir, remove_tree, shard_name, write_report
from .common import RESIZED_IMAGES, ConvertError
from .plan import Plan
from .task import read_part


class LocalTarget:
    """DST as a local (or shared network) directory, through the store's transaction: the new
    dataset is assembled in a staging directory inside DST and swapped in complete, so an old
    dataset there stays untouched (and opens) until the new one is in."""

    def __init__(self, dst: Path):
        self.dst = dst
        replacing = (dst / MANIFEST).exists()
        self.tx = commit_transaction(dst)
        # replacing a dataset: new shard names, never one a reader of the old dataset maps
        self.generation = self.tx.generation if replacing else None
        self._placed: list[tuple[Path, Path]] = []

    def place(self, part_file: Path, name: str) -> None:
        os.replace(part_file, self.tx.dir / name)
        self._placed.append((part_file, self.tx.dir / name))

    def put_report(self, records: list[dict]) -> None:
        if records:
            write_report(self.tx.dir / SKIPPED_REPORT, records)

    def put_manifest(self, manifest: dict) -> None:
        fsync_dir(self.tx.dir)
        self.tx.commit(manifest)  # the manifest last; the dataset opens from here on
        self._placed.clear()

    def discard_parts(self, parts: Path) -> None:
        remove_tree(parts)
        fsync_dir(self.dst)

    def abort(self) -> None:
        """Put the shards moved so far back into their parts (a --resume then finds them)."""
        for src, placed in reversed(self._placed):
            try:
                os.replace(placed, src)
            except OSError:
                pass
        self._placed.clear()
        self.tx.abort()


def _read_manifest(part: Path) -> dict | None:
    try:
        with open(part / MANIFEST, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def _read_report(part: Path, offset: int) -> list[dict]:
    out = []
    try:
        with open(part / SKIPPED_REPORT, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    r["index"] = int(r["index"]) + offset
                    out.append(r)
    except FileNotFoundError:
        pass
    return out


def check_parts(plan: Plan, on_error: str) -> list[tuple[int, dict, dict | None]]:
    """(group, part record, part manifest or None when every sample was skipped) for every
    group, in order; raises ConvertError naming the first group that is not right."""
    out = []
    for g in range(plan.num_groups):
        part = plan.part_dir(g)
        rec = read_part(part)
        a, b = plan.bounds(g)
        where = f"group {g} (samples {a}..{b - 1}, {part})"
        if rec is None:
            raise ConvertError(f"{where}: not converted")
        if (rec["start"], rec["stop"]) != (a, b):
            raise ConvertError(f"{where}: the part holds samples {rec['start']}..{rec['stop'] - 1}; "
                               "it belongs to another plan; start over with --overwrite")
        if on_error == "raise" and rec["skipped"]:
            raise ConvertError(f"{where}: {rec['skipped']} sample(s) were skipped by an earlier --on-error skip "
                               f"run (see {part / SKIPPED_REPORT}); resume with --on-error skip, or start "
                               "over with --overwrite")
        m = _read_manifest(part)
        if m is None:
            if rec["num_samples"]:
                raise ConvertError(f"{where}: its manifest is missing")
        else:
            label = m.get("label") or {}
            if m["fields"] != plan.fields or label.get("field") != plan.label or \
                    label.get("class_names") != plan.class_names or _planned(m.get("metadata", {})) != plan.metadata:
                raise ConvertError(f"{where}: its fields, label or metadata differ from the plan's; "
                                   "start over with --overwrite")
            for s in m["shards"]:
                p = part / s["file"]
                size = p.stat().st_size if p.exists() else None
                if size != s["bytes"]:
                    raise ConvertError(f"{where}: shard {s['file']} is {'missing' if size is None else f'{size} bytes'}"
                                       f", its manifest says {s['bytes']}")
        out.append((g, rec, m))
    return out


def _planned(metadata: dict) -> dict:
    """A part's metadata less what each part counts for itself."""
    return {k: v for k, v in metadata.items() if k != RESIZED_IMAGES}


def commit(plan: Plan, on_error: str = "raise", target: Any = None) -> dict:
    """Turn the finished parts into the dataset at ``plan.dst``; return a summary."""
    dst = Path(plan.dst)
    parts = check_parts(plan, on_error)
    skipped: list[dict] = []
    for g, rec, _ in parts:
        skipped += _read_report(plan.part_dir(g), rec["start"])
    total = sum(rec["num_samples"] for _, rec, _ in parts)
    if total == 0:
        first = "; ".join(f"{r['key']}: {r['reason']}" for r in skipped[:3])
        if skipped and not (dst / MANIFEST).exists():
            write_report(dst / SKIPPED_REPORT, skipped)
        raise ConvertError(f"no sample of {plan.num_samples} could be converted"
                           + (f" ({first}{'; …' if len(skipped) > 3 else ''})" if skipped else ""))
    template = next(m for _, _, m in parts if m is not None)
    target = target if target is not None else LocalTarget(dst)
    shards: list[dict] = []
    counts = np.zeros(len(plan.class_names or ()), dtype=np.int64)
    try:
        for g, rec, m in parts:
            if m is None:
                continue
            for s in m["shards"]:
                name = shard_name(len(shards), getattr(target, "generation", None))
                target.place(plan.part_dir(g) / s["file"], name)
                shards.append({**s, "file": name})
            c = np.asarray((m.get("label") or {}).get("counts") or [], dtype=np.int64)
            if c.size > counts.size:
                c, counts = counts, c.copy()
            counts[: c.size] += c
        manifest = {k: v for k, v in template.items()}
        manifest.update(num_samples=int(sum(s["num_samples"] for s in shards)),
                        total_bytes=int(sum(s["bytes"] for s in shards)), shards=shards)
        if "label" in manifest:
            manifest["label"] = {**manifest["label"], "counts": counts.tolist()}
        if RESIZED_IMAGES in manifest.get("metadata", {}):
            resized = sum(int((m or {}).get("metadata", {}).get(RESIZED_IMAGES, 0)) for _, _, m in parts)
            manifest["metadata"] = {**manifest["metadata"], RESIZED_IMAGES: resized}
        target.put_report(skipped)
        target.put_manifest(manifest)
    except BaseException:
        target.abort()
        raise
    target.discard_parts(plan.parts)
    return {"dst": str(dst), "num_samples": manifest["num_samples"], "num_shards": len(shards),
            "bytes": manifest["total_bytes"], "skipped": len(skipped),
            "report": str(dst / SKIPPED_REPORT) if skipped else None, "num_groups": plan.num_groups,
            **{k: manifest.get("metadata", {}).get(k) for k in ("max_pixels", "max_size", RESIZED_IMAGES)}}

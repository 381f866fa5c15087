"""The commit of a distributed conversion, on the driver: parts in, one dataset out.

1. Check every group: its part exists, covers the planned rows, has the planned fields,
   label field, class names and metadata, and its shard files have the recorded sizes.
   Check the source: the files that number its samples are as planned and every file a
   group read is still as that group read it (plan.py, sourcestate.py); otherwise nothing
   is committed and the error names the files.
2. In group order, rename the part shards to ``shard-NNNNN.arrow`` (inside DST, or inside a
   staging directory when DST holds a dataset to replace: ``--overwrite`` keeps its
   guarantee, the old dataset is untouched until the new one is complete).
3. Merge label counts and the counts of images resized for ``--max-size``; concatenate the
   parts' ``skipped.jsonl`` with indices made global.
4. Write ``manifest.json`` last (then swap the staging directory in), and remove the parts.

The checksums are the ones each task computed while writing (the shard files are renamed,
never rewritten), so the commit reads no sample data.

A local directory is reached through ``LocalTarget`` (``place`` a finished part shard under
its final name, ``put_report``, ``put_manifest`` last, ``discard_parts``). An object store
(objstore.py) cannot rename: its tasks uploaded their shards under their final names
already, so its commit checks the groups' records and writes the report and the manifest
last, in the same order of events.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from ._store import (MANIFEST, SKIPPED_REPORT, commit_transaction, fsync_dir, read_report, remove_tree, shard_name,
                     write_report)
from .common import RESIZED_IMAGES, ConvertError
from ..store.format import stale_files
from .objstore import Store, record_name
from .plan import Plan, check_source_at_commit
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


def check_parts(plan: Plan, on_error: str) -> list[tuple[int, dict, dict | None]]:
    """(group, part record, part manifest or None when every sample was skipped) for every
    group, in order; raises ConvertError naming the first group that is not right."""
    out = []
    for g in range(plan.num_groups):
        part = plan.part_dir(g)
        rec = read_part(part)
        m = _read_manifest(part) if rec is not None else None

        def size_of(name: str, part=part) -> int | None:
            p = part / name
            return p.stat().st_size if p.exists() else None

        _check_part(plan, g, rec, m, on_error, str(part), part / SKIPPED_REPORT, size_of)
        out.append((g, rec, m))
    return out


def _check_part(plan: Plan, g: int, rec: dict | None, m: dict | None, on_error: str, place: str, report: Any,
                size_of) -> None:
    """Raise ConvertError naming group ``g`` when its part is missing or not the plan's."""
    a, b = plan.bounds(g)
    where = f"group {g} (samples {a}..{b - 1}, {place})"
    if rec is None:
        raise ConvertError(f"{where}: not converted")
    if (rec["start"], rec["stop"]) != (a, b):
        raise ConvertError(f"{where}: the part holds samples {rec['start']}..{rec['stop'] - 1}; "
                           "it belongs to another plan; start over with --overwrite")
    if on_error == "raise" and rec["skipped"]:
        raise ConvertError(f"{where}: {rec['skipped']} sample(s) were skipped by an earlier --on-error skip "
                           f"run (see {report}); resume with --on-error skip, or start over with --overwrite")
    if m is None:
        if rec["num_samples"]:
            raise ConvertError(f"{where}: its manifest is missing")
        return
    label = m.get("label") or {}
    if m["fields"] != plan.fields or label.get("field") != plan.label or \
            label.get("class_names") != plan.class_names or _planned(m.get("metadata", {})) != plan.metadata:
        raise ConvertError(f"{where}: its fields, label or metadata differ from the plan's; "
                           "start over with --overwrite")
    for s in m["shards"]:
        size = size_of(s["file"])
        if size != s["bytes"]:
            raise ConvertError(f"{where}: shard {s['file']} is {'missing' if size is None else f'{size} bytes'}"
                               f", its manifest says {s['bytes']}")


def _planned(metadata: dict) -> dict:
    """A part's metadata less what each part counts for itself."""
    return {k: v for k, v in metadata.items() if k != RESIZED_IMAGES}


def _merge(plan: Plan, parts: list[tuple[int, dict, dict | None]], shards: list[dict]) -> dict:
    """The dataset's manifest: the first part's, with ``shards`` (in group order), the label
    counts and the count of images resized for --max-size summed over the parts."""
    template = next(m for _, _, m in parts if m is not None)
    counts = np.zeros(len(plan.class_names or ()), dtype=np.int64)
    for _, _, m in parts:
        c = np.asarray(((m or {}).get("label") or {}).get("counts") or [], dtype=np.int64)
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
    return manifest


def _nothing_converted(plan: Plan, skipped: list[dict]) -> ConvertError:
    first = "; ".join(f"{r['key']}: {r['reason']}" for r in skipped[:3])
    return ConvertError(f"no sample of {plan.num_samples} could be converted"
                        + (f" ({first}{'; …' if len(skipped) > 3 else ''})" if skipped else ""))


def _summary(plan: Plan, where: str, manifest: dict, skipped: list[dict]) -> dict:
    return {"dst": where, "num_samples": manifest["num_samples"], "num_shards": len(manifest["shards"]),
            "bytes": manifest["total_bytes"], "skipped": len(skipped),
            "report": f"{where}/{SKIPPED_REPORT}" if skipped else None, "num_groups": plan.num_groups,
            **{k: manifest.get("metadata", {}).get(k) for k in ("max_pixels", "max_size", RESIZED_IMAGES)}}


def commit(plan: Plan, on_error: str = "raise", target: Any = None) -> dict:
    """Turn the finished parts into the dataset at ``plan.dst``; return a summary."""
    if plan.remote:
        return _commit_remote(plan, on_error)
    dst = Path(plan.dst)
    parts = check_parts(plan, on_error)
    check_source_at_commit(plan, {g: rec for g, rec, _ in parts})  # the source is still what the parts read
    skipped: list[dict] = []
    for g, rec, _ in parts:
        skipped += read_report(plan.part_dir(g), rec["start"])
    if sum(rec["num_samples"] for _, rec, _ in parts) == 0:
        if skipped and not (dst / MANIFEST).exists():
            write_report(dst / SKIPPED_REPORT, skipped)
        raise _nothing_converted(plan, skipped)
    target = target if target is not None else LocalTarget(dst)
    shards: list[dict] = []
    try:
        for g, _rec, m in parts:
            if m is None:
                continue
            for s in m["shards"]:
                name = shard_name(len(shards), getattr(target, "generation", None))
                target.place(plan.part_dir(g) / s["file"], name)
                shards.append({**s, "file": name})
        manifest = _merge(plan, parts, shards)
        target.put_report(skipped)
        target.put_manifest(manifest)
    except BaseException:
        target.abort()
        raise
    target.discard_parts(plan.parts)
    return _summary(plan, str(dst), manifest, skipped)


def _commit_remote(plan: Plan, on_error: str) -> dict:
    """The commit into an object store (objstore.py): the shards are in place already, under
    their final names; check every group's record, PUT the report, the manifest last, then
    delete the files the new dataset replaces and the parts."""
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    store = Store(plan.dst)
    have = sorted(store.records())
    with ThreadPoolExecutor(max_workers=16, thread_name_prefix="fastload-commit") as pool:
        recs = dict(zip(have, pool.map(lambda g: store.get_json(record_name(g)), have)))
    names = store.sizes()
    parts, skipped = [], []
    for g in range(plan.num_groups):
        rec = recs.get(g)
        rec = rec if isinstance(rec, dict) and rec.get("token") == plan.token else None  # another run's: redo
        m = rec.get("manifest") if rec else None
        _check_part(plan, g, rec, m, on_error, store.where(record_name(g)), store.where(record_name(g)), names.get)
        parts.append((g, rec, m))
        skipped += [{**r, "index": int(r["index"]) + rec["start"]} for r in rec.get("report", [])]
    check_source_at_commit(plan, {g: rec for g, rec, _ in parts})  # the source is still what the parts read
    if sum(rec["num_samples"] for _, rec, _ in parts) == 0:
        raise _nothing_converted(plan, skipped)
    shards = [s for _, _, m in parts if m is not None for s in m["shards"]]
    manifest = _merge(plan, parts, shards)
    if skipped:
        with tempfile.TemporaryDirectory(prefix="fastload-commit-") as tmp:
            write_report(Path(tmp) / SKIPPED_REPORT, skipped)
            store.put_file(Path(tmp) / SKIPPED_REPORT, SKIPPED_REPORT)
    store.put_manifest(manifest)  # last: from here on DST opens as the new dataset
    keep = {s["file"] for s in shards} | {MANIFEST} | ({SKIPPED_REPORT} if skipped else set())
    for name in stale_files(names, keep):  # the replaced dataset's files, a failed run's shards
        store.delete(name)
    store.remove_parts()
    return _summary(plan, store.display, manifest, skipped)

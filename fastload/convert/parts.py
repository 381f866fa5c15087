"""The finished parts of a distributed conversion: which groups are done, and forgetting one.

A local group is done when ``DST/.fastload-parts/g-NNNNNNNN/part.json`` exists and the
part's shard files have the sizes its manifest records (task.py makes them); an object-store
group when its record ``.fastload-parts/g-NNNNNNNN.json`` carries the plan's token and its
shards are at DST with the recorded sizes (objstore.py). The plan (plan.py: ``--resume``),
the tasks, the engines and the commit read them through here. This module takes a plan as
it comes (``remote``, ``dst``, ``token``, ``parts``, ``part_dir``) and never imports plan.py.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

from ._store import MANIFEST, fsync_dir
from .objstore import Store, record_name

PART = "part.json"


def read_part(part: Path) -> dict | None:
    """The record of a finished part, or None when the group is not done."""
    try:
        with open(part / PART, encoding="utf-8") as f:
            return json.load(f)
    except (FileNotFoundError, NotADirectoryError):
        return None


def finished_part(part: Path) -> dict | None:
    """The record of a finished, intact part; None when the group must be (re)done. A part
    whose shard files are gone (an interrupted commit had moved them) is set aside."""
    rec = read_part(part)
    if rec is None:
        return None
    try:
        with open(part / MANIFEST, encoding="utf-8") as f:
            shards = json.load(f)["shards"]
    except FileNotFoundError:
        shards = []
    if all((part / s["file"]).is_file() and (part / s["file"]).stat().st_size == s["bytes"] for s in shards) \
            and (shards or rec["num_samples"] == 0):
        return rec
    broken = part.with_name(f"{part.name}.attempt-{uuid.uuid4().hex[:12]}")
    try:  # renamed first, so that a concurrent reader never sees it half deleted
        os.rename(part, broken)
        shutil.rmtree(broken, ignore_errors=True)
    except OSError:
        pass
    return None


def finished_groups(plan, groups) -> dict[int, dict]:
    """{group: record} of the groups among ``groups`` whose part is finished and intact (a
    broken local part is set aside); one listing for an object store."""
    if not plan.remote:
        return {g: rec for g in groups if (rec := finished_part(plan.part_dir(g))) is not None}
    store = Store(plan.dst)
    have = store.records()
    names = store.sizes() if have else {}
    out = {}
    for g in groups:
        if g in have:
            rec = _intact_record(store.get_json(record_name(g)), names.get, plan.token)
            if rec is not None:
                out[g] = rec
    return out


def _intact_record(rec: dict | None, size_of, token: str | None) -> dict | None:
    """An object-store group record of this plan (``token``) whose shards are all at DST with
    the recorded sizes (``size_of(name)``: a shard's size, None when it is missing)."""
    if not isinstance(rec, dict) or rec.get("token") != token:
        return None
    shards = (rec.get("manifest") or {}).get("shards", [])
    return rec if all(size_of(s["file"]) == s["bytes"] for s in shards) else None


def discard_group(plan, g: int) -> None:
    """Forget the finished part of group ``g`` (its source files changed): the next task of
    the group converts it again. A local part is renamed first, then removed (a concurrent
    reader never sees it half deleted); an object store's group loses its record (its shards
    are PUT again under the same names)."""
    if plan.remote:
        Store(plan.dst).delete(record_name(g))
        return
    part = plan.part_dir(g)
    gone = part.with_name(f"{part.name}.attempt-{uuid.uuid4().hex[:12]}")
    try:
        os.rename(part, gone)
    except FileNotFoundError:
        return
    shutil.rmtree(gone, ignore_errors=True)
    fsync_dir(plan.parts)

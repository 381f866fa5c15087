"""The one place where the distributed convert touches the store's file transaction.

Everything the plan/task/commit core needs from ``fastload.store`` beyond its public face is
here: which files of a directory are fastload's own, the staging directory that makes
``--overwrite`` safe, the swap-in that replaces an old dataset (manifest last), atomic JSON,
directory fsync and the skipped report. When the store's file-transaction module changes,
only this file follows.
"""
from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Mapping

from ..store.format import MANIFEST, SKIPPED_REPORT, shard_name  # noqa: F401  (re-exported)
from ..store.writer import (  # noqa: F401  (re-exported)
    MAX_SHARD_SIZE, _OWN_FILE, _STAGING, _fsync_dir, _remove_own, parse_size, write_json_atomic, write_report,
)

# The hidden directory inside DST that holds the plan and the parts of a conversion.
PARTS = ".fastload-parts"

fsync_dir = _fsync_dir


def is_own(name: str) -> bool:
    """True for the names a fastload dataset directory may hold (what --overwrite may delete)."""
    return name == PARTS or bool(_OWN_FILE.match(name))


def check_destination(dst: Path, *, overwrite: bool, allow_leftovers: bool = False) -> bool:
    """Refuse a destination the conversion may not write into; never deletes anything.

    Returns True when DST holds an old dataset (or a crashed commit's files) that the commit
    must replace through a staging directory. The parts directory does not count here.
    ``allow_leftovers``: a resumed conversion may find its own files without a manifest
    (a commit interrupted midway); those are replaced, not refused."""
    if dst.exists() and not dst.is_dir():
        raise FileExistsError(f"{dst} exists and is not a directory; choose another destination")
    if not dst.is_dir():
        return False
    entries = sorted(e for e in os.listdir(dst) if e != PARTS)
    if not entries:
        return False
    foreign = [e for e in entries if not is_own(e)]
    leftovers = allow_leftovers and not foreign and MANIFEST not in entries
    if not overwrite and not leftovers:
        raise FileExistsError(f"{dst} is not empty; choose an empty or new directory, "
                              "or pass --overwrite (overwrite=True) to replace the dataset in it")
    if foreign:
        raise FileExistsError(
            f"refusing to overwrite {dst}: it holds files fastload did not write "
            f"({', '.join(foreign[:5])}{'…' if len(foreign) > 5 else ''}); choose another directory")
    return True


def new_staging(dst: Path) -> Path:
    """A fresh hidden staging directory inside DST (same filesystem, so renames are atomic);
    the next --overwrite of DST removes it if this process dies before the swap."""
    d = dst / f"{_STAGING}{uuid.uuid4().hex[:12]}"
    d.mkdir()
    return d


def swap_in(dst: Path, staging: Path) -> None:
    """Replace the old dataset in DST by the complete new one in ``staging`` (manifest last):
    the old manifest goes first, so the old dataset stops opening before any shard changes."""
    _remove_own(dst, keep=[staging.name, PARTS])
    for e in sorted(os.listdir(staging)):
        if e != MANIFEST:
            os.rename(staging / e, dst / e)
    _fsync_dir(dst)
    os.rename(staging / MANIFEST, dst / MANIFEST)  # the new dataset opens from here on
    _fsync_dir(dst)
    os.rmdir(staging)


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def write_json(path: Path, obj: Mapping[str, Any]) -> None:
    write_json_atomic(path, obj)

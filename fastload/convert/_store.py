"""The one place where the distributed convert touches the store's file transaction.

Everything the plan/task/commit core needs from ``fastload.store`` beyond its public face
comes through here: which files of a directory are fastload's own, the transaction whose
staging directory and swap-in make ``--overwrite`` safe (manifest last), atomic JSON,
directory fsync and the skipped report.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..store.format import MANIFEST, MAX_SHARD_SIZE, SKIPPED_REPORT, shard_name
from ..store.report import read_report, write_report
from ..store.transaction import PARTS_DIR as PARTS
from ..store.transaction import Transaction, fsync_dir, is_own_file, write_json_atomic

__all__ = ["MANIFEST", "MAX_SHARD_SIZE", "PARTS", "SKIPPED_REPORT", "check_destination", "commit_transaction",
           "fsync_dir", "read_report", "remove_tree", "shard_name", "write_json", "write_report"]

write_json = write_json_atomic


def check_destination(dst: Path, *, overwrite: bool, allow_leftovers: bool = False) -> bool:
    """Refuse a destination the conversion may not write into; never deletes anything.

    Returns True when DST holds something besides the parts directory (an old dataset to
    replace). ``allow_leftovers``: a resumed conversion may find fastload's own files without
    a manifest there (a commit interrupted midway); those are replaced, not refused."""
    if dst.exists() and not dst.is_dir():
        raise FileExistsError(f"{dst} exists and is not a directory; choose another destination")
    if not dst.is_dir():
        return False
    entries = sorted(e for e in os.listdir(dst) if e != PARTS)
    if not entries:
        return False
    foreign = [e for e in entries if not is_own_file(e)]
    leftovers = allow_leftovers and not foreign and MANIFEST not in entries
    if not overwrite and not leftovers:
        raise FileExistsError(f"{dst} is not empty; choose an empty or new directory, "
                              "or pass --overwrite (overwrite=True) to replace the dataset in it")
    if foreign:
        raise FileExistsError(
            f"refusing to overwrite {dst}: it holds files fastload did not write "
            f"({', '.join(foreign[:5])}{'…' if len(foreign) > 5 else ''}); choose another directory")
    return True


def commit_transaction(dst: Path) -> Transaction:
    """The store's transaction for the commit: the new dataset is assembled in a staging
    directory inside DST (DST holds at least the parts) and swapped in complete, manifest
    last, leaving the parts in place until the dataset is in."""
    return Transaction(dst, overwrite=True, keep=[PARTS])


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)

"""The file transaction of a dataset being written: a complete dataset directory, or nothing
that opens — and never a user's file deleted.

Shards and the manifest are written under a temporary name, fsynced and renamed; the manifest
goes last, so a directory without it is not a dataset and an interrupted writer never leaves
something that opens half-written.

Replacing a dataset (``overwrite=True``) never destroys the old one before the new one is
complete: the new dataset is written into a hidden ``.fastload-staging-T`` directory inside
DST (same filesystem, so DST may be a mount point; DST's permissions are kept). A failed
conversion leaves the old dataset as it was. :meth:`Transaction.commit` then swaps, by renames
only (:func:`_swap`):

1. create ``.fastload-old-T`` (the same token T) and write its journal ``swap.json``: the names
   of the new dataset's files (so a file in DST is known to be old or new at every instant);
2. move the old dataset's files into ``.fastload-old-T``, its manifest first (DST stops
   opening as the old dataset before any of its shards goes);
3. move the new files up, then the new manifest (DST opens as the new dataset from here on);
4. remove ``.fastload-staging-T`` and ``.fastload-old-T`` (the old dataset's files).

A process killed at any point of the swap leaves DST opening as exactly the old dataset
(before step 2) or exactly the new one (after step 3), or not opening at all in between —
then opening DST says that an overwrite was interrupted and to run
``fastload recover DST``. That command, and the next overwrite of DST (a
``ShardWriter(overwrite=True)``, ``fastload convert --overwrite``), finish an interrupted swap
(:func:`recover`): DST holds exactly the new dataset afterwards, nothing of the old, and
``fastload verify`` passes. Before step 1 (no journal) recovery rolls back instead: the
staging directory goes, DST keeps exactly the old dataset.

``--overwrite`` only ever deletes fastload's own files (:func:`is_own_file`): a directory
holding anything else is refused, so a mistyped DST never costs a user their data.
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import shutil
import uuid
import weakref
from pathlib import Path
from typing import Any, Iterable, Iterator

import xxhash

from ..files import atomic_file, atomic_write, fsync_dir, temp_pattern
from ..manifest_checksum import sealed
from .format import MANIFEST, SHARD_FILE_RE, SKIPPED_REPORT

__all__ = ["ASIDE_PREFIX", "HashingFile", "PARTS_DIR", "STAGING_PREFIX", "Transaction", "fsync_dir",
           "interrupted_swap", "is_own_file", "prepare_output_dir", "recover", "remove_own", "write_atomic",
           "write_json_atomic"]

logger = logging.getLogger("fastload")

STAGING_PREFIX = ".fastload-staging-"
# Where a swap moves the replaced dataset's files (same token as its staging directory).
ASIDE_PREFIX = ".fastload-old-"
SWAP_JOURNAL = "swap.json"
# The plan and parts of a distributed conversion in progress (fastload.convert.plan).
PARTS_DIR = ".fastload-parts"
# Files a fastload dataset directory may hold: the manifest, the skipped report, shards (any
# number of digits that shard_name() gives), their temporary names, staging directories, the
# parts directory, the directories a swap moves an old dataset into.
_OWN_DIR = re.compile(rf"(?:{re.escape(STAGING_PREFIX)}|{re.escape(ASIDE_PREFIX)})[0-9a-f]{{12}}|{re.escape(PARTS_DIR)}")
_OWN_FILE = re.compile(rf"{re.escape(MANIFEST)}|{re.escape(SKIPPED_REPORT)}|{SHARD_FILE_RE}"
                       rf"|{temp_pattern(f'{SHARD_FILE_RE}|{re.escape(MANIFEST)}|{re.escape(SKIPPED_REPORT)}')}"
                       rf"|{_OWN_DIR.pattern}")


_GENERATION = re.compile(r"shard-[0-9]{5,}-([0-9a-f]{8})\.arrow")


def is_own_file(name: str) -> bool:
    """True for the names of the files fastload writes into a dataset directory (the whole
    name: ``"manifest.json.bak"`` or ``"manifest.json\\n"`` is someone else's)."""
    return _OWN_FILE.fullmatch(name) is not None


def prepare_output_dir(path: Path, overwrite: bool) -> bool:
    """Create ``path``, or check that the old fastload dataset there may be replaced.

    A non-empty directory is refused without ``overwrite``; with it, only a directory that
    holds nothing but fastload's own files may be replaced, so a mistyped DST never deletes
    a user's other data. Nothing is deleted here: returns True when ``path`` holds files to
    replace (the writer then writes into a staging directory inside it and swaps at commit).
    """
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path} exists and is not a directory; choose another destination")
    if path.is_dir():
        entries = sorted(os.listdir(path))
        if entries:
            if not overwrite:
                raise FileExistsError(f"{path} is not empty; choose an empty or new directory, "
                                      "or pass --overwrite (overwrite=True) to replace the dataset in it")
            foreign = [e for e in entries if not is_own_file(e)]
            if foreign:
                raise FileExistsError(
                    f"refusing to overwrite {path}: it holds files fastload did not write "
                    f"({', '.join(foreign[:5])}{'…' if len(foreign) > 5 else ''}); choose another directory")
            return True
    path.mkdir(parents=True, exist_ok=True)
    return False


def remove_own(path: Path, keep: Iterable[str] = (), staging: bool = True, files: bool = True) -> None:
    """Delete fastload's files in ``path`` except ``keep`` (and, with ``staging``, leftover
    staging, old-dataset and parts directories; with ``files=False`` only those directories),
    the manifest first so that the old dataset stops opening before any shard disappears."""
    keep = set(keep)
    entries = sorted(os.listdir(path), key=lambda e: e != MANIFEST)
    for e in entries:
        if e in keep or not is_own_file(e):
            continue
        if _OWN_DIR.fullmatch(e):  # directories of ours
            if staging:
                shutil.rmtree(path / e, ignore_errors=True)
            continue
        if not files:
            continue
        try:
            os.unlink(path / e)
        except FileNotFoundError:
            pass


class HashingFile(io.RawIOBase):
    """A write-only file that hashes (xxh3-128) and counts what passes through it."""

    def __init__(self, f):
        self._f = f
        self.hash = xxhash.xxh3_128()
        self.nbytes = 0

    def writable(self):
        return True

    def write(self, b):
        mv = memoryview(b)
        self.hash.update(mv)
        self._f.write(mv)
        self.nbytes += mv.nbytes
        return mv.nbytes


@contextlib.contextmanager
def write_atomic(path: Path) -> Iterator[HashingFile]:
    """Write ``path`` atomically and durably (:func:`fastload.files.atomic_file`), hashing on
    the fly: the yielded file's ``hash`` and ``nbytes`` describe what was written."""
    with atomic_file(path) as raw:
        yield HashingFile(raw)


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON (indented, a newline at the end) to ``path`` atomically and
    durably (:func:`fastload.files.atomic_write`)."""
    atomic_write(path, json.dumps(obj, indent=1, sort_keys=False) + "\n")


def new_generation(existing_names: Iterable[str]) -> str:
    """A shard-name generation token (8 hex digits) that none of ``existing_names`` uses, so
    the shards of a dataset written over another never take a name a reader of the old one
    may still map (see ``format.GENERATION_PATTERN``)."""
    used = {m.group(1) for m in map(_GENERATION.fullmatch, existing_names) if m}
    while True:
        token = uuid.uuid4().hex[:8]
        if token not in used:
            return token


class Transaction:
    """The files of one dataset being written to ``path``.

    ``dir`` is where they go meanwhile: ``path`` itself, or — when ``path`` holds a dataset
    to replace (``overwrite=True``) — a staging directory inside it. :meth:`commit` writes
    the manifest (last) and, when staging, swaps the new dataset in; :meth:`abort` takes
    back what was written. A transaction dropped without either still removes its staging
    directory.
    """

    def __init__(self, path: Path, overwrite: bool, keep: Iterable[str] = ()):
        self.path = path
        self.dir = path
        self.generation: str | None = None  # the shard-name token of a replacing dataset
        self.keep = list(keep)  # own entries of ``path`` the swap-in leaves alone
        self._cleanup: weakref.finalize | None = None
        self._swapping = False
        self._created = not os.path.lexists(path)  # abort() removes a directory it made, once empty
        if prepare_output_dir(path, overwrite):
            recover(path)  # an overwrite killed while swapping: finished first (DST is then a dataset)
            if (path / MANIFEST).exists():  # a dataset a reader may have open: never reuse its names
                self.generation = new_generation(os.listdir(path))
            self.dir = path / f"{STAGING_PREFIX}{uuid.uuid4().hex[:12]}"
            self.dir.mkdir()
            self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.dir), True)

    @property
    def staging(self) -> bool:
        return self.dir != self.path

    def commit(self, manifest: dict) -> dict:
        """Write ``manifest.json``, sealed with its checksum (from here on ``path`` opens as
        the new dataset); returns the manifest as written."""
        m = sealed(manifest)
        write_json_atomic(self.dir / MANIFEST, m)
        if self.staging:
            self._swap_in()
        return m

    def _swap_in(self) -> None:
        """Replace the old dataset in ``path`` by the complete new one in the staging dir
        (see the module docstring: crash-safe at every step)."""
        staging = self.dir
        # From here the staging directory may become the only copy: never delete it again.
        self._cleanup.detach()
        self._swapping = True
        _swap(self.path, staging, keep=self.keep)
        # what an earlier writer left: other staging / old-dataset directories, a parts
        # directory (unless kept: a distributed commit removes its own after the swap)
        remove_own(self.path, keep=[MANIFEST, SKIPPED_REPORT, *self.keep], staging=True, files=False)
        self._swapping = False
        self.dir = self.path

    def abort(self) -> None:
        """Delete everything this transaction wrote; ``path`` does not open as the new dataset
        (when replacing, the old one is left as it was). A skipped report is kept."""
        if self.staging:  # a staging directory of our own
            if self._swapping:  # the old dataset may be moved aside already: recovery finishes the swap
                logger.error("fastload: replacing %s failed midway; the complete new dataset is in %s: run "
                             "`fastload recover %s` to finish replacing", self.path, self.dir,
                             self.path)
                return
            shutil.rmtree(self.dir, ignore_errors=True)
            self._cleanup.detach()
            return
        if self.path.is_dir():  # another writer's staging directory is not ours to remove
            remove_own(self.path, keep=[SKIPPED_REPORT], staging=False)
            if self._created:
                try:  # nothing left of a directory this transaction created (else it stays)
                    os.rmdir(self.path)
                except OSError:
                    pass


# -- the swap and its recovery ------------------------------------------------------------
def _reached(step: str) -> None:
    """Called after every step of a swap that changes the directory (tests kill the process
    here, at each step in turn, to check that recovery leaves exactly one dataset)."""


def _token(staging: Path) -> str:
    return staging.name[len(STAGING_PREFIX):]


def _swap(path: Path, staging: Path, keep: Iterable[str] = ()) -> None:
    """Swap the complete new dataset in ``staging`` (its manifest inside) into ``path``:
    journal, old files aside (manifest first), new files up (manifest last), clean up."""
    aside = path / f"{ASIDE_PREFIX}{_token(staging)}"
    aside.mkdir()
    _reached("aside-created")
    new = sorted(e for e in os.listdir(staging) if e != MANIFEST)
    write_json_atomic(aside / SWAP_JOURNAL, {"new": new})
    fsync_dir(path)
    _reached("journal-written")
    _finish(path, staging, aside, new, keep)


def _finish(path: Path, staging: Path, aside: Path, new: list[str], keep: Iterable[str] = ()) -> None:
    """Steps 2-4 of a swap, from wherever an interrupted one stopped (idempotent): a file of
    ``new`` is in DST once it left ``staging`` (renames move each file whole), so every other
    file of fastload's in DST belongs to the old dataset."""
    keep = set(keep)
    if (staging / MANIFEST).exists():  # the new dataset is not published yet
        old = [e for e in os.listdir(path)
               if is_own_file(e) and not _OWN_DIR.fullmatch(e) and e not in keep
               and not (e in new and not os.path.lexists(staging / e))]
        for e in sorted(old, key=lambda e: e != MANIFEST):  # the manifest first: DST stops opening
            os.replace(path / e, aside / e)
            _reached(f"aside:{e}")
        fsync_dir(aside)
        fsync_dir(path)
        for e in new:
            if os.path.lexists(staging / e):
                os.replace(staging / e, path / e)
                _reached(f"up:{e}")
        fsync_dir(path)
        os.replace(staging / MANIFEST, path / MANIFEST)  # the new dataset opens from here on
        fsync_dir(path)
        _reached("published")
    shutil.rmtree(staging, ignore_errors=True)
    _reached("staging-removed")
    shutil.rmtree(aside, ignore_errors=True)  # the old dataset's files
    fsync_dir(path)
    _reached("done")


def _journal(aside: Path) -> list[str] | None:
    try:
        with open(aside / SWAP_JOURNAL, encoding="utf-8") as f:
            new = json.load(f)["new"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(new, list) or not all(isinstance(e, str) and is_own_file(e) and "/" not in e for e in new):
        return None
    return new


def interrupted_swap(path: Path) -> Path | None:
    """The staging directory of an overwrite of ``path`` that was killed while swapping (its
    journal written, its manifest not yet moved up), or None."""
    try:
        entries = sorted(os.listdir(path))
    except OSError:
        return None
    for e in entries:
        if e.startswith(ASIDE_PREFIX) and _OWN_DIR.fullmatch(e):
            staging = path / f"{STAGING_PREFIX}{e[len(ASIDE_PREFIX):]}"
            if (staging / MANIFEST).exists() and _journal(path / e) is not None:
                return staging
    return None


def recover(path: Path, keep: Iterable[str] = (PARTS_DIR,)) -> str | None:
    """Finish (or roll back) an overwrite of ``path`` that was killed while swapping; what
    it did, or None when there was nothing to do.

    * a swap with its journal written: finished (the old dataset's remaining files aside,
      the new ones up, the manifest last); ``path`` holds exactly the new dataset;
    * a swap that stopped before its journal: rolled back (its empty old-dataset directory
      and, when ``path`` still opens as the old dataset, the staging directory removed);
    * a swap that published its manifest: its leftover directories removed.

    Staging directories without a journal are left to the next overwrite (they may be a live
    writer's), except as above. Run by every overwrite before it writes, and by
    ``fastload recover DST``."""
    path = Path(path)
    if not path.is_dir():
        return None
    did = None
    for e in sorted(os.listdir(path)):
        if not (e.startswith(ASIDE_PREFIX) and _OWN_DIR.fullmatch(e)):
            continue
        aside = path / e
        staging = path / f"{STAGING_PREFIX}{e[len(ASIDE_PREFIX):]}"
        new = _journal(aside)
        if new is None:  # killed before the journal: nothing was moved yet
            if (path / MANIFEST).exists():
                shutil.rmtree(staging, ignore_errors=True)
            shutil.rmtree(aside, ignore_errors=True)
            fsync_dir(path)
            did = did or "rolled back an overwrite interrupted before it swapped"
            continue
        finished = not (staging / MANIFEST).exists()
        _finish(path, staging, aside, new, keep)
        did = "removed what a finished overwrite left" if finished and did is None else \
            "finished an overwrite interrupted while swapping the new dataset in"
    if did is None and not (path / MANIFEST).exists():
        # an overwrite by an older fastload killed while swapping (no journal): the new manifest
        # lists the new shards; everything else of fastload's in DST is the old dataset's
        staged = sorted((p for p in path.iterdir() if p.name.startswith(STAGING_PREFIX) and _OWN_DIR.fullmatch(p.name)
                         and (p / MANIFEST).exists()), key=lambda p: (p / MANIFEST).stat().st_mtime)
        if staged:
            staging = staged[-1]
            try:
                with open(staging / MANIFEST, encoding="utf-8") as f:
                    listed = [s_["file"] for s_ in json.load(f)["shards"]]
            except (OSError, ValueError, KeyError, TypeError):
                return None
            in_staging = [x for x in os.listdir(staging) if x != MANIFEST]
            new = set(listed) | set(in_staging)
            if any(os.path.lexists(path / x) and x not in in_staging for x in listed):
                new.add(SKIPPED_REPORT)  # files were moving up: the old report was deleted before
            new = sorted(new)
            aside = path / f"{ASIDE_PREFIX}{_token(staging)}"
            aside.mkdir(exist_ok=True)
            write_json_atomic(aside / SWAP_JOURNAL, {"new": new})
            _finish(path, staging, aside, new, keep)
            did = "finished an overwrite interrupted while swapping the new dataset in"
    return did

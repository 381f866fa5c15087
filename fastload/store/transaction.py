"""The file transaction of a dataset being written: a complete dataset directory, or nothing
that opens — and never a user's file deleted.

Shards and the manifest are written under a temporary name, fsynced and renamed; the manifest
goes last, so a directory without it is not a dataset and an interrupted writer never leaves
something that opens half-written.

Replacing a dataset (``overwrite=True``) never destroys the old one before the new one is
complete: the new dataset is written into a hidden ``.fastload-staging-*`` directory inside
DST (same filesystem, so DST may be a mount point; DST's permissions are kept), and only
:meth:`Transaction.commit` removes the old files and moves the new ones up, the manifest last.
A failed conversion leaves the old dataset as it was. A process killed during that final swap
(a few unlinks and renames) leaves DST without a manifest, the new shards moved so far in DST
and the rest with the new manifest in ``DST/.fastload-staging-*/`` (opening DST says so:
moving those files up completes the swap); a killed process at any other time leaves at most
that hidden directory, which the next overwrite of DST removes.

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

from ..manifest_checksum import sealed
from .format import MANIFEST, SHARD_FILE_RE, SKIPPED_REPORT

__all__ = ["HashingFile", "PARTS_DIR", "STAGING_PREFIX", "Transaction", "fsync_dir", "is_own_file", "prepare_output_dir",
           "remove_own", "write_atomic", "write_json_atomic"]

logger = logging.getLogger("fastload")

STAGING_PREFIX = ".fastload-staging-"
# The plan and parts of a distributed conversion in progress (fastload.convert.plan).
PARTS_DIR = ".fastload-parts"
# Files a fastload dataset directory may hold: the manifest, the skipped report, shards (any
# number of digits that shard_name() gives), their temporary names, staging directories, the
# parts directory.
_OWN_FILE = re.compile(rf"{re.escape(MANIFEST)}|{re.escape(SKIPPED_REPORT)}|{SHARD_FILE_RE}"
                       rf"|\.(?:{SHARD_FILE_RE}|{re.escape(MANIFEST)}|{re.escape(SKIPPED_REPORT)})\.tmp"
                       rf"|{re.escape(STAGING_PREFIX)}[0-9a-f]{{12}}|{re.escape(PARTS_DIR)}")


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


def remove_own(path: Path, keep: Iterable[str] = (), staging: bool = True) -> None:
    """Delete fastload's files in ``path`` except ``keep`` (and, with ``staging``, leftover
    staging and parts directories), the manifest first so that the old dataset stops opening before
    any shard disappears."""
    keep = set(keep)
    entries = sorted(os.listdir(path), key=lambda e: e != MANIFEST)
    for e in entries:
        if e in keep or not is_own_file(e):
            continue
        if e.startswith(STAGING_PREFIX) or e == PARTS_DIR:  # directories of ours
            if staging:
                shutil.rmtree(path / e, ignore_errors=True)
            continue
        try:
            os.unlink(path / e)
        except FileNotFoundError:
            pass


def fsync_dir(path: Path) -> None:
    """Make the renames in ``path`` durable (where the platform allows it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


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
    """Write ``path`` under a temporary name (``.NAME.tmp``), hashing on the fly; fsync and
    rename it into place only when the block ends without an exception (else the temporary
    file is removed). The yielded file's ``hash`` and ``nbytes`` describe what was written."""
    tmp = path.with_name("." + path.name + ".tmp")
    try:
        with open(tmp, "wb") as raw:
            hf = HashingFile(raw)
            yield hf
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` atomically and durably (temporary name, fsync, rename;
    the temporary file is removed if anything fails)."""
    tmp = path.with_name("." + path.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=1, sort_keys=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


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
        """Replace the old dataset in ``path`` by the complete new one in the staging dir."""
        staging = self.dir
        # From here the staging directory may become the only copy: never delete it again.
        self._cleanup.detach()
        self._swapping = True
        remove_own(self.path, keep=[staging.name, *self.keep])
        for e in sorted(os.listdir(staging)):
            if e != MANIFEST:
                os.rename(staging / e, self.path / e)
        fsync_dir(self.path)
        os.rename(staging / MANIFEST, self.path / MANIFEST)  # the new dataset opens from here on
        fsync_dir(self.path)
        os.rmdir(staging)
        self._swapping = False
        self.dir = self.path

    def abort(self) -> None:
        """Delete everything this transaction wrote; ``path`` does not open as the new dataset
        (when replacing, the old one is left as it was). A skipped report is kept."""
        if self.staging:  # a staging directory of our own
            if self._swapping:  # the old dataset is gone already: keep the new one for recovery
                logger.error("fastload: replacing %s failed midway; the complete new dataset is in %s",
                             self.path, self.dir)
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

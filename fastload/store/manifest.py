"""manifest.json of a dataset directory: read, checked against the schema, and its fields.

A reader opens a dataset by reading its manifest only (:func:`read_manifest`): a missing
or damaged manifest raises a FormatError (MissingFileError for a missing directory) that
says what happened and what to do (an interrupted write or overwrite is recognised). A
manifest read from elsewhere (a remote dataset's URL) is checked with
:func:`check_manifest`; :func:`manifest_fields` turns its field descriptions into
:class:`~fastload.store.format.Field` objects.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .. import manifest_checksum
from ..errors import FormatError, MissingFileError
from ..files import NotRegularFile, read_regular
from .format import MANIFEST, Field
from .schema import validate_manifest
from .transaction import STAGING_PREFIX, interrupted_swap

__all__ = ["MAX_MANIFEST_BYTES", "check_manifest", "manifest_bytes", "manifest_fields", "read_manifest"]

# The bytes every writer of a manifest writes (sealed with its checksum; see
# :mod:`fastload.manifest_checksum`).
manifest_bytes = manifest_checksum.manifest_bytes


# A manifest larger than this is not one fastload wrote (a million shards take ~150 MB).
MAX_MANIFEST_BYTES = 1 << 30


def read_manifest(path: Path, *, checksum: bool = True) -> dict:
    """The parsed ``manifest.json`` of the dataset at ``path``, checked against the schema
    and its own checksum (:func:`check_manifest`: a FormatError names the bad key, or says the
    content does not match the checksum). ``checksum=False``: the schema only (``verify``
    reports a checksum mismatch as one of its problems and goes on checking the shards)."""
    mpath = path / MANIFEST
    if not path.exists():
        raise MissingFileError(f"{path} does not exist; create a dataset with `fastload convert`")
    if not path.is_dir():
        raise FormatError(f"{path} is not a directory; a fastload dataset is a directory with {MANIFEST}")
    if not mpath.exists():
        shards = sorted(p.name for p in path.glob("*shard-*.arrow*"))
        staged = interrupted_swap(path) or next(
            (p for p in sorted(path.glob(STAGING_PREFIX + "*")) if (p / MANIFEST).exists()), None)
        if staged is not None:  # an overwrite was killed while swapping the new dataset in
            hint = (f" An overwrite was interrupted while swapping the new dataset in (it is complete in"
                    f" {staged.name}). Finish it with `fastload recover {path}`: this"
                    " directory then holds exactly the new dataset (converting again with --overwrite"
                    " also finishes it first).")
        elif shards:
            hint = (" It holds shard files but no manifest: the writer was interrupted, so the dataset is"
                    " incomplete; convert again with --overwrite.")
        else:
            hint = ""
        raise FormatError(f"{path} is not a fastload dataset: {MANIFEST} is missing.{hint}")
    try:
        raw = read_regular(mpath, what="manifest", max_bytes=MAX_MANIFEST_BYTES)
    except NotRegularFile as e:
        raise FormatError(f"{e}; the dataset is damaged") from None
    except OSError as e:
        raise FormatError(f"{mpath} cannot be read ({e.strerror or e})") from None
    try:
        m = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise FormatError(f"{mpath} is not readable JSON ({str(e)[:200]}); the dataset is damaged") from None
    return check_manifest(m, mpath, checksum=checksum)


def check_manifest(m: Any, where: Any, *, checksum: bool = True) -> dict:
    """Every key of a manifest, wherever it was read (``where`` names it), against the schema
    (:func:`fastload.store.schema.validate_manifest`), then its content against its
    ``manifest_checksum`` when it has one (:func:`fastload.manifest_checksum.check`); returns
    ``m``. The schema goes first: a damaged key is named as such."""
    validate_manifest(m, where)
    if checksum:
        manifest_checksum.check(m, where)
    return m


def manifest_fields(m: dict, path: Path) -> dict[str, Field]:
    """The fields of a manifest (checked by :func:`check_manifest`) read from the dataset at
    ``path``, in column order."""
    try:
        return {n: Field.from_json(d) for n, d in m["fields"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise FormatError(f"{path / MANIFEST}: bad field description ({e})") from None

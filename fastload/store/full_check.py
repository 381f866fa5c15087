"""verify: check a whole dataset now — manifest schema, every shard's checksum, size, schema
(field shapes included) and Arrow's full validation.

The manifest is checked on reading (:func:`~fastload.store.reader.read_manifest` raises a
FormatError naming the bad key); a manifest whose content does not match its own checksum
(``manifest_checksum``) is reported as the first problem, naming it and what to do. Each shard is mapped like a reader maps
it (regular files only, no descriptor kept), hashed in C++ with the GIL released, several shards at once.
Shards that pass are added to the node's verified record (see
:mod:`fastload.store.verified_record`), so a Loader with ``verify="first-use"`` on this node does not
hash them again.
"""
from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa

from .. import manifest_checksum
from ..errors import FormatError
from ..files import printable
from ..runtime.system import usable_cores
from .format import MANIFEST, SHARD_FILE_RE, Field, field_of_arrow, schema_mismatch
from .verified_record import VerifiedRecord
from .manifest import manifest_fields, read_manifest
from .transaction import ASIDE_PREFIX, is_own_file

__all__ = ["check_shard", "file_checksum", "verify"]

_SHARD_FILE = re.compile(SHARD_FILE_RE)


def file_checksum(path: Path) -> str:
    """``"xxh3_128:<hex>"`` of a regular file (ValueError naming it if it is not one)."""
    from .. import _C

    return _C.map_file(os.fspath(path)).hash_xxh3_128()


def check_shard(path: Path, entry: dict, fields: Mapping[str, Field] | pa.Schema, checksum: str | None = None,
                record: VerifiedRecord | None = None) -> list[str]:
    """The problems of one shard file ``path`` against its manifest entry ``entry``: missing,
    not a regular file, size, checksum (``checksum``: already computed, e.g. while
    downloading), schema (including each field's dtype and shape), Arrow validity, record
    batches, rows. ``fields``: the manifest's fields (or the Arrow schema they give). A shard
    that passes is added to ``record``."""
    from .. import _C

    if isinstance(fields, pa.Schema):
        fields = {f.name: field_of_arrow(f) for f in fields if b"fastload" in (f.metadata or {})}
    name = entry["file"]
    try:
        mm = _C.map_file(os.fspath(path))
    except FileNotFoundError:
        return [f"{name}: missing"]
    except ValueError as e:  # not a regular file
        return [f"{name}: {printable(str(e)).replace(os.fspath(path), 'the file')}"]
    except OSError as e:
        return [f"{name}: cannot be read ({e.strerror or e})"]
    problems = []
    hashed_at = time.time()
    if mm.size != entry["bytes"]:  # damaged already: no need to read a (perhaps huge) wrong file
        problems.append(f"{name}: size {mm.size} bytes, manifest says {entry['bytes']}")
        got = None
    else:
        got = checksum or mm.hash_xxh3_128()
        if got != entry["checksum"]:
            problems.append(f"{name}: checksum mismatch (file {got}, manifest {entry['checksum']})")
    try:
        reader = pa.ipc.open_file(pa.py_buffer(mm))
        why = schema_mismatch(reader.schema, fields)
        if why is not None:
            problems.append(f"{name}: schema differs from the manifest's fields ({why})")
        rows = 0
        for i in range(reader.num_record_batches):
            b = reader.get_batch(i)
            b.validate(full=True)
            rows += b.num_rows
        if reader.num_record_batches != 1:
            problems.append(f"{name}: {reader.num_record_batches} record batches, expected 1")
        if rows != entry["num_samples"]:
            problems.append(f"{name}: {rows} rows, manifest says {entry['num_samples']}")
    except (pa.ArrowInvalid, pa.ArrowException, OSError) as e:
        problems.append(f"{name}: not a valid Arrow IPC file ({str(e).splitlines()[0][:200]})")
    if not problems and record is not None:
        record.add(record.key(mm, got), mm, got, hashed_at=hashed_at if checksum is None else None)
    return problems


def verify(path: str | os.PathLike, *, remember: bool = True) -> list[str]:
    """Check a dataset; return one line per problem found (an empty list: all good).

    Raises FormatError / FileNotFoundError when the manifest itself cannot be read or does
    not follow the schema (the message names the key). ``remember``: add the shards that
    pass to this node's verified record (so Loaders here need not hash them again).
    """
    path = Path(path)
    m = read_manifest(path, checksum=False)
    problems = []
    try:  # a manifest damaged in a way the schema allows: reported, and the shards still checked
        manifest_checksum.check(m, path / MANIFEST)
    except FormatError as e:
        problems.append(str(e))
    fields = manifest_fields(m, path)
    record = VerifiedRecord() if remember else None
    shards = m["shards"]
    workers = max(1, min(len(shards), usable_cores()))
    if workers == 1:
        results = [check_shard(path / s["file"], s, fields, record=record) for s in shards]
    else:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fastload-verify") as pool:
            results = list(pool.map(lambda s: check_shard(path / s["file"], s, fields, record=record), shards))
    problems += [p for r in results for p in r]
    listed = {s["file"] for s in shards}
    for extra in sorted(os.listdir(path)):
        if _SHARD_FILE.fullmatch(extra) and extra not in listed:
            problems.append(f"{extra}: not listed in {MANIFEST} (left over from another write?)")
        elif extra.startswith(ASIDE_PREFIX) and is_own_file(extra):
            problems.append(f"{extra}: the files of the dataset this one replaced, left by an overwrite that was "
                            f"killed; remove them with `fastload recover {path}`")
    return problems

"""verify: recompute every shard's checksum and run Arrow's full validation."""
from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import xxhash

from .format import CHECKSUM_ALGO, MANIFEST, arrow_schema
from .reader import manifest_fields, read_manifest

_CHUNK = 8 * 1024 * 1024


def file_checksum(path: Path) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while True:
            b = f.read(_CHUNK)
            if not b:
                break
            h.update(b)
    return f"{CHECKSUM_ALGO}:{h.hexdigest()}"


def check_shard(p: Path, s: dict, schema: pa.Schema, checksum: str | None = None) -> list[str]:
    """The problems of one shard file ``p`` against its manifest entry ``s``: missing, size,
    checksum (``checksum``: already computed, e.g. while downloading), schema, Arrow validity,
    record batches, rows."""
    if not p.exists():
        return [f"{s['file']}: missing"]
    problems = []
    size = p.stat().st_size
    if size != s["bytes"]:
        problems.append(f"{s['file']}: size {size} bytes, manifest says {s['bytes']}")
    got = checksum or file_checksum(p)
    if got != s["checksum"]:
        problems.append(f"{s['file']}: checksum mismatch (file {got}, manifest {s['checksum']})")
    try:
        with pa.memory_map(str(p), "r") as mm:
            reader = pa.ipc.open_file(mm)
            if not reader.schema.equals(schema, check_metadata=False):
                problems.append(f"{s['file']}: schema differs from the manifest's fields")
            rows = 0
            for i in range(reader.num_record_batches):
                b = reader.get_batch(i)
                b.validate(full=True)
                rows += b.num_rows
            if reader.num_record_batches != 1:
                problems.append(f"{s['file']}: {reader.num_record_batches} record batches, expected 1")
            if rows != s["num_samples"]:
                problems.append(f"{s['file']}: {rows} rows, manifest says {s['num_samples']}")
    except (pa.ArrowInvalid, pa.ArrowException, OSError) as e:
        problems.append(f"{s['file']}: not a valid Arrow IPC file ({str(e).splitlines()[0]})")
    return problems


def verify(path: str | os.PathLike) -> list[str]:
    """Check a dataset; return one line per problem found (an empty list: all good).

    Raises FormatError / FileNotFoundError when the manifest itself cannot be read.
    """
    path = Path(path)
    m = read_manifest(path)
    schema = arrow_schema(manifest_fields(m, path))
    problems: list[str] = []
    total = 0
    for s in m["shards"]:
        total += s["num_samples"]
        problems += check_shard(path / s["file"], s, schema)
    if total != m["num_samples"]:
        problems.append(f"{MANIFEST}: shard counts add up to {total}, num_samples is {m['num_samples']}")
    listed = {s["file"] for s in m["shards"]}
    for extra in sorted(path.glob("shard-*.arrow")):
        if extra.name not in listed:
            problems.append(f"{extra.name}: not listed in {MANIFEST} (left over from another write?)")
    return problems

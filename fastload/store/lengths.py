"""A local dataset's per-sample lengths of a ragged field, memory-mapped from a cache file.

``Dataset.lengths(field)`` (sequence packing plans its rows from it, a Loader sizes its ring
from it) is 8 bytes per sample: 8 GB at 10^9 documents, once per rank if each rank held its
own copy. A local dataset of at least :data:`MAP_MIN` samples keeps them instead in the
node-local cache directory (:func:`fastload.runtime.system.cache_root`:
``$FASTLOAD_CACHE`` or ``~/.cache/fastload``), ``lengths/<key>/lengths-<field>.npy``, where
``key`` hashes the manifest (whose shard checksums fix every length): read from the shards'
offsets once per node, written through a memory map (never whole in memory) under a
temporary name and renamed into place, then memory-mapped read-only by every later call,
run and rank of the node (the page cache is shared). A file of the wrong type, shape or size is
read again; ranks that start together wait for the one that reads them (a lock in the
folder) and map its file; without a usable cache directory the lengths are read into memory (a warning
says so). The remote path keeps them the same way in its own cache
(:mod:`fastload.remote.lengths`); a mixture's (the datasets' lengths one after the other) are
kept here too, keyed by its datasets' manifests (:func:`concat_lengths`).
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np

from ..runtime.kept import MAP_MIN, kept_arrays
from ..runtime.system import cache_root

__all__ = ["MAP_MIN", "concat_lengths", "kept_lengths", "kept_path", "kept_values", "local_lengths",
           "local_lengths_path"]


def _key(manifests: list) -> str:
    return hashlib.sha256(json.dumps(manifests, sort_keys=True, default=str).encode()).hexdigest()[:32]


def kept_path(manifests: list, field: str, what: str = "lengths") -> Path | None:
    """Where ``field``'s lengths (``what="values"``: a scalar field's values, :func:`kept_values`)
    of the dataset(s) of ``manifests`` are kept (None: no cache directory)."""
    root = cache_root()
    if root is None:
        return None
    safe = field if re.fullmatch(r"[A-Za-z0-9_.-]{1,100}", field) else hashlib.sha1(field.encode()).hexdigest()
    return root / "lengths" / _key(manifests) / f"{what}-{safe}.npy"


def local_lengths_path(reader, field: str) -> Path | None:
    """Where ``field``'s lengths of a local dataset are kept (None: no cache directory)."""
    return kept_path([reader.manifest], field)


def _fill(reader, field: str, out: np.ndarray) -> np.ndarray:
    starts = reader.shard_starts
    for s in range(reader.num_shards):
        offsets, _ = reader.ragged_column(s, field)
        np.subtract(offsets[1:], offsets[:-1], out=out[starts[s]:starts[s + 1]])
    return out


def kept_lengths(path: Path | None, n: int, field: str, fill) -> np.ndarray:
    """``n`` lengths memory-mapped from ``path``, written there by ``fill(out)`` first when
    missing or wrong (see the module docstring; the one machinery of tables kept per node,
    :func:`fastload.runtime.kept.kept_arrays`); ``path`` None: ``fill`` into memory."""
    folder, name = (None, "lengths") if path is None else (path.parent, path.stem)
    got = kept_arrays(folder, {name: (np.int64, (n,))}, lambda alloc: fill(alloc(name)),
                      what=f"the lengths of {field!r}", holds=f"{n} lengths")
    return got[name]


def local_lengths(reader, field: str) -> np.ndarray:
    """Items per sample of ragged ``field`` of a local dataset (see the module docstring)."""
    n = len(reader)
    path = local_lengths_path(reader, field) if n >= MAP_MIN else None
    return kept_lengths(path, n, field, lambda out: _fill(reader, field, out))


def concat_lengths(readers, field: str) -> np.ndarray:
    """The lengths of several datasets one after the other (a mixture's), kept the same way
    past :data:`MAP_MIN` samples (copied from each dataset's, in chunks)."""
    n = sum(len(r) for r in readers)

    def fill(out: np.ndarray) -> np.ndarray:
        at = 0
        for r in readers:
            v = r.lengths(field)
            for a in range(0, len(v), 1 << 24):
                b = min(len(v), a + (1 << 24))
                out[at + a:at + b] = v[a:b]
            at += len(v)
        return out

    path = kept_path([r.manifest for r in readers], field) if n >= MAP_MIN else None
    return kept_lengths(path, n, field, fill)


def kept_values(reader, field: str) -> np.ndarray:
    """Every sample's value of scalar ``field`` of a dataset (a Loader's ``weights=`` or
    ``balance=`` field), read from the shards' columns once per node, shard by shard,
    written through a memory map, then memory-mapped read-only by every rank: a local
    dataset's past :data:`MAP_MIN` samples (``values-<field>.npy`` beside its lengths, else
    read into memory), a remote dataset's always, in its cache directory beside its lengths
    (``values-<field>.npy``: the shards are downloaded once per node, through the cache, and
    a later run reads the file, downloading nothing)."""
    n = len(reader)
    f = reader._field(field)
    starts = reader.shard_starts
    remote = reader.cache is not None

    def fill(out: np.ndarray) -> np.ndarray:
        for s in range(reader.num_shards):
            mapped = not remote or reader._shards[s] is not None
            out[starts[s]:starts[s + 1]] = reader.column(s, field)
            if not mapped:
                reader._release_shard(s)  # (read for its values only: the cache keeps or evicts it)
        return out

    dtype = np.dtype(f.dtype)
    if remote:
        from ..remote.lengths import kept_name

        folder, name = reader.cache.dir, kept_name(field, "values")
        what = f"the values of {field!r} of {reader.cache.url}"
    else:
        path = kept_path([reader.manifest], field, "values") if n >= MAP_MIN else None
        folder, name = (None, "values") if path is None else (path.parent, path.stem)
        what = f"the values of {field!r}"
    got = kept_arrays(folder, {name: (dtype, (n,))}, lambda alloc: fill(alloc(name)), what=what, holds=f"{n} values")
    return got[name]

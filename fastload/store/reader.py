"""DatasetReader: a fastload directory opened for reading, without torch.

Opening reads ``manifest.json`` only. Shards are memory-mapped on first use, one record
batch each, so every tensor or scalar column of a shard is a single zero-copy numpy view
of shape ``(rows, *shape)``. The global index -> (shard, row) map is one cumulative-count
numpy array: no per-sample Python object exists, so forked DataLoader workers do not grow
by copy-on-write.

This module imports neither torch nor DALI: verify, inspect and conversion use
:class:`DatasetReader` directly. The public :class:`fastload.Dataset` (``store/dataset.py``)
is this class made a ``torch.utils.data.Dataset`` as well.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa

from ..errors import FormatError
from .format import (FORMAT_NAME, KEY_COLUMN, MANIFEST, READABLE_VERSIONS, Field, arrow_schema,
                     format_version_for, image_size_columns)
from .transaction import STAGING_PREFIX

__all__ = ["DatasetReader", "check_manifest", "manifest_fields", "read_manifest"]


def read_manifest(path: Path) -> dict:
    mpath = path / MANIFEST
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; create a dataset with `fastload convert`")
    if not path.is_dir():
        raise FormatError(f"{path} is not a directory; a fastload dataset is a directory with {MANIFEST}")
    if not mpath.exists():
        shards = sorted(p.name for p in path.glob("*shard-*.arrow*"))
        staged = sorted(p for p in path.glob(STAGING_PREFIX + "*") if (p / MANIFEST).exists())
        if staged:  # an overwrite was killed while swapping the new dataset in
            hint = (f" An overwrite was interrupted while swapping the new dataset in: move every file"
                    f" of {staged[-1]} up into this directory to complete it (the new shards already"
                    " moved are here), then remove that directory.")
        elif shards:
            hint = (" It holds shard files but no manifest: the writer was interrupted, so the dataset is"
                    " incomplete; convert again with --overwrite.")
        else:
            hint = ""
        raise FormatError(f"{path} is not a fastload dataset: {MANIFEST} is missing.{hint}")
    try:
        with open(mpath, encoding="utf-8") as f:
            m = json.load(f)
    except (OSError, ValueError) as e:
        raise FormatError(f"{mpath} is not readable JSON ({e}); the dataset is damaged") from None
    return check_manifest(m, mpath)


def check_manifest(m: Any, where: Any) -> dict:
    """The checks every manifest passes, wherever it was read (``where`` names it)."""
    if not isinstance(m, dict) or m.get("format") != FORMAT_NAME:
        raise FormatError(f"{where} is not a fastload manifest (no \"format\": \"{FORMAT_NAME}\")")
    v = m.get("format_version")
    if v not in READABLE_VERSIONS or isinstance(v, bool):
        raise FormatError(f"{where} has format_version {v!r}; this fastload reads versions "
                          f"{', '.join(map(str, READABLE_VERSIONS))}. Convert the source again with this version"
                          " (or upgrade fastload, if a newer one wrote it).")
    for k in ("fields", "shards", "num_samples"):
        if k not in m:
            raise FormatError(f"{where} lacks the key {k!r}; the manifest is damaged")
    return m


def manifest_fields(m: dict, path: Path) -> dict[str, Field]:
    """The fields of a manifest read from the dataset at ``path``, in column order."""
    try:
        fields = {n: Field.from_json(d) for n, d in m["fields"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise FormatError(f"{path / MANIFEST}: bad field description ({e})") from None
    need = format_version_for(fields)
    if m.get("format_version", need) < need:
        raise FormatError(f"{path / MANIFEST}: format_version {m['format_version']} cannot hold ragged fields "
                          f"(version {need} or later); the manifest is damaged")
    return fields


class _Shard:
    """One memory-mapped shard: its record batch and cached zero-copy views."""

    __slots__ = ("batch", "views", "mm")

    def __init__(self, path: Path, schema: pa.Schema, num_rows: int):
        try:
            self.mm = pa.memory_map(str(path), "r")
            reader = pa.ipc.open_file(self.mm)
        except (OSError, pa.ArrowInvalid) as e:
            raise FormatError(f"shard {path} cannot be opened as an Arrow IPC file ({e}); "
                              "run `fastload verify` on the dataset") from None
        if reader.num_record_batches != 1:
            raise FormatError(f"shard {path} holds {reader.num_record_batches} record batches; "
                              "fastload shards hold exactly one")
        if not reader.schema.equals(schema, check_metadata=False):
            raise FormatError(f"shard {path} has schema {reader.schema} which does not match the "
                              f"manifest's fields; the dataset is damaged")
        self.batch = reader.get_batch(0)
        if self.batch.num_rows != num_rows:
            raise FormatError(f"shard {path} holds {self.batch.num_rows} rows, the manifest says {num_rows}")
        self.views: dict[str, Any] = {}


class DatasetReader:
    """A fastload dataset directory, opened read-only (no torch needed).

    ``len(ds)``, ``ds.fields``, ``ds[i]`` (one sample as a dict), ``ds.get_batch(indices)``
    (a whole batch, gathered with vectorised numpy), and ``ds.__getitems__`` so a plain
    ``torch.utils.data.DataLoader`` fetches whole batches (through :class:`fastload.Dataset`,
    this class as a ``torch.utils.data.Dataset``). Tensor fields come back as numpy arrays,
    ragged fields as arrays ``(k, *item)``, scalars as numpy scalars, images and bytes as
    ``bytes`` (``fastload.vision.decode`` makes a uint8 tensor), strings as ``str``.
    ``transform(sample) -> anything`` is applied by ``ds[i]`` and ``__getitems__`` (per-sample
    Python code in DataLoader workers; ``get_batch`` returns the stored values). Pickles as
    its path and transform (a worker process reopens it), never its data.
    """

    _repr_name = "fastload.store.DatasetReader"

    def __init__(self, path: str | os.PathLike, *, transform: Callable[[dict], Any] | None = None,
                 cache_dir: str | os.PathLike | None = None, cache_limit: int | str | None = None,
                 filesystem: Any = None, storage_options: dict | None = None):
        if transform is not None and not callable(transform):
            raise ValueError(f"transform={transform!r} must be a function sample -> sample")
        self.transform = transform
        # A remote dataset (s3://, gs://, az://, https://): the manifest comes from the URL, the
        # shards from a node-local cache (fastload.remote); self.path is then the display URL.
        self.url: str | None = None
        self.cache = None
        from ..remote.url import is_remote

        if is_remote(path) or filesystem is not None:
            from ..remote import open_cache

            self.cache = open_cache(path, cache_dir=cache_dir, cache_limit=cache_limit, filesystem=filesystem,
                                    storage_options=storage_options)
            self.url = self.path = self.cache.url
            try:
                self.manifest = check_manifest(self.cache.remote.manifest, f"{self.url}/{MANIFEST}")
            except BaseException:
                self.cache.close()
                raise
            base = self.cache.dir
            self.cache.on_release(self._release_shard)
        else:
            if cache_dir is not None or cache_limit is not None or storage_options is not None:
                raise ValueError(f"cache_dir / cache_limit / storage_options apply to remote datasets "
                                 f"(s3://, gs://, az://, https://); {str(path)!r} is a local path")
            self.path = Path(path)
            self.manifest = read_manifest(self.path)
            base = self.path
        m = self.manifest
        self.fields: dict[str, Field] = manifest_fields(m, Path(str(self.path)))
        self.schema = arrow_schema(self.fields)
        self.shard_files = [base / s["file"] for s in m["shards"]]
        self.shard_sizes = np.array([s["num_samples"] for s in m["shards"]], dtype=np.int64)
        self._starts = np.zeros(len(self.shard_sizes) + 1, dtype=np.int64)
        np.cumsum(self.shard_sizes, out=self._starts[1:])
        if int(self._starts[-1]) != m["num_samples"]:
            raise FormatError(f"{self.path / MANIFEST}: shard sample counts add up to "
                              f"{int(self._starts[-1])}, not num_samples={m['num_samples']}")
        self._shards: list[_Shard | None] = [None] * len(self.shard_files)
        self._lock = threading.Lock()
        lab = m.get("label")
        self.label_field: str | None = lab["field"] if lab else None
        self.class_names: list[str] | None = lab.get("class_names") if lab else None
        self.class_counts = np.asarray(lab["counts"], dtype=np.int64) if lab else None

    # -- pickling for spawn-started DataLoader workers: the path only, never the data ----
    # (a remote dataset: its URL and cache settings; never a filesystem or a secret)
    def __getstate__(self):
        if self.cache is not None:
            return {"path": self.url, "transform": self.transform, "cache_dir": str(self.cache.root),
                    "cache_limit": self.cache.limit}
        return {"path": str(self.path), "transform": self.transform}

    def __setstate__(self, state):
        self.__init__(state["path"], transform=state.get("transform"), cache_dir=state.get("cache_dir"),
                      cache_limit=state.get("cache_limit"))

    def close(self) -> None:
        """Stop a remote dataset's download threads and release its cache (the shards
        downloaded stay for the next run). Nothing to do for a local dataset."""
        if self.cache is not None:
            self.cache.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        fields = ", ".join(f"{n}: {f}" for n, f in self.fields.items())
        return f"{self._repr_name}({str(self.path)!r}, {len(self)} samples, {self.num_shards} shards, {{{fields}}})"

    def __len__(self) -> int:
        return int(self._starts[-1])

    @property
    def num_shards(self) -> int:
        return len(self.shard_files)

    @property
    def shard_starts(self) -> np.ndarray:
        """Global index of each shard's first sample (length num_shards + 1)."""
        return self._starts

    # -- shards --------------------------------------------------------------------------
    def shard(self, i: int) -> _Shard:
        s = self._shards[i]
        if s is None:
            if self.cache is not None:
                return self._remote_shard(i)
            with self._lock:
                s = self._shards[i]
                if s is None:
                    if not self.shard_files[i].exists():
                        raise FileNotFoundError(f"shard {self.shard_files[i]} listed in the manifest is "
                                                "missing; the dataset is damaged (run `fastload verify`)")
                    s = _Shard(self.shard_files[i], self.schema, int(self.shard_sizes[i]))
                    self._shards[i] = s
        return s

    def _remote_shard(self, i: int) -> _Shard:
        """Map shard ``i`` of a remote dataset, fetching it into the cache first (blocking)."""
        for attempt in range(3):
            self.cache.ensure(i)  # outside the lock: other shards map meanwhile
            with self._lock:
                s = self._shards[i]
                if s is not None:
                    return s
                try:
                    s = _Shard(self.shard_files[i], self.schema, int(self.shard_sizes[i]))
                except FormatError:
                    if self.shard_files[i].exists() or attempt == 2:
                        raise
                    continue  # evicted between ensure() and the mapping (another rank): again
                self._shards[i] = s
                return s
        raise AssertionError("unreachable")  # pragma: no cover

    def _release_shard(self, i: int) -> None:
        """The cache no longer needs shard ``i`` here: drop this reader's mapping (views
        handed out keep the memory alive until they go)."""
        with self._lock:
            self._shards[i] = None

    def _field(self, name: str) -> Field:
        f = self.fields.get(name)
        if f is None:
            raise KeyError(f"{name!r} is not a field of {self.path}; fields are {list(self.fields)}")
        return f

    def column(self, shard: int, field: str) -> np.ndarray:
        """Zero-copy read-only view ``(rows, *shape)`` of a tensor/scalar field in one shard."""
        f = self._field(field)
        if not f.fixed:
            use = "ragged_column()" if f.ragged else "binary_column()"
            raise TypeError(f"field {field!r} is a {f.kind} field; use {use}")
        s = self.shard(shard)
        v = s.views.get(field)
        if v is None:
            col = s.batch.column(field)
            values = col.values if isinstance(col.type, pa.FixedSizeListType) else col
            rows = s.batch.num_rows
            base, per_row = f.storage()
            arr = values.to_numpy(zero_copy_only=True)
            if isinstance(col.type, pa.FixedSizeListType):
                arr = arr[col.offset * per_row:(col.offset + rows) * per_row]
            v = arr.view(f.np_dtype).reshape((rows, *f.shape))
            s.views[field] = v
        return v

    def _raw_column(self, shard: int, name: str) -> tuple[np.ndarray, np.ndarray]:
        s = self.shard(shard)
        v = s.views.get(name)
        if v is None:
            col = s.batch.column(name)
            bufs = col.buffers()
            offsets = np.frombuffer(bufs[1], dtype=np.int32)[col.offset: col.offset + len(col) + 1]
            values = (np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None and bufs[2].size
                      else np.zeros(0, dtype=np.uint8))
            v = (offsets, values)
            s.views[name] = v
        return v

    def binary_column(self, shard: int, field: str) -> tuple[np.ndarray, np.ndarray]:
        """Zero-copy ``(offsets int32[rows+1], values uint8[...])`` of an image/bytes/string field."""
        f = self._field(field)
        if f.fixed or f.ragged:
            raise TypeError(f"field {field!r} is a {f.kind} field; use {'ragged_column' if f.ragged else 'column'}()")
        return self._raw_column(shard, field)

    def ragged_column(self, shard: int, field: str) -> tuple[np.ndarray, np.ndarray]:
        """Zero-copy read-only ``(offsets, values)`` of a ragged field in one shard: ``offsets``
        int64 ``(rows + 1,)`` (sample ``r`` is ``values[offsets[r]:offsets[r + 1]]``; they
        need not start at 0) and ``values`` of shape ``(items, *item_shape)``."""
        f = self._field(field)
        if not f.ragged:
            raise TypeError(f"field {field!r} is a {f.kind} field, not a ragged one")
        s = self.shard(shard)
        v = s.views.get(field)
        if v is None:
            v = _ragged_views(s.batch.column(field), f, self.shard_files[shard])
            s.views[field] = v
        return v

    def lengths(self, field: str) -> np.ndarray:
        """Items per sample of a ragged field, for every sample (int64, cached): read from
        the shards' offsets, never from the values."""
        f = self._field(field)
        if not f.ragged:
            raise TypeError(f"field {field!r} is a {f.kind} field, not a ragged one")
        cache = self.__dict__.setdefault("_lengths", {})
        v = cache.get(field)
        if v is None:
            v = np.empty(len(self), dtype=np.int64)
            for s in range(self.num_shards):
                offsets, _ = self.ragged_column(s, field)
                np.subtract(offsets[1:], offsets[:-1], out=v[self._starts[s]:self._starts[s + 1]])
            v.flags.writeable = False
            cache[field] = v
        return v

    def _int_column(self, shard: int, name: str) -> np.ndarray:
        s = self.shard(shard)
        v = s.views.get(name)
        if v is None:
            v = s.batch.column(name).to_numpy(zero_copy_only=True)
            s.views[name] = v
        return v

    # -- index -----------------------------------------------------------------------------
    def locate(self, indices: np.ndarray | Sequence[int], *, check: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Global indices -> (shard, row), both int64 arrays. Out of range -> IndexError
        (``check=False`` skips the range check for indices known to be valid)."""
        idx = np.asarray(indices, dtype=np.int64)
        n = len(self)
        if check and idx.size:
            lo, hi = idx.min(), idx.max()
            if lo < 0 or hi >= n:
                bad = int(lo if lo < 0 else hi)
                raise IndexError(f"sample index {bad} is out of range for {self.path} ({n} samples)")
        shard = np.searchsorted(self._starts, idx, side="right") - 1
        return shard, idx - self._starts[shard]

    def _groups(self, shard: np.ndarray):
        if self.num_shards == 1:
            yield 0, slice(None)
            return
        for s in np.unique(shard):
            yield int(s), shard == s

    # -- reading ---------------------------------------------------------------------------
    def _gather_fixed(self, name: str, shard: np.ndarray, row: np.ndarray) -> np.ndarray:
        f = self.fields[name]
        out = np.empty((len(row), *f.shape), dtype=f.np_dtype)
        for s, sel in self._groups(shard):
            col = self.column(s, name)
            if isinstance(sel, slice):
                np.take(col, row, axis=0, out=out)
            else:
                out[sel] = col[row[sel]]
        return out

    def _gather_ragged(self, name: str, shard: np.ndarray, row: np.ndarray) -> list[np.ndarray]:
        """One array ``(k, *item_shape)`` per row: copies, so they outlive the memory map."""
        out: list = [None] * len(row)
        for s, sel in self._groups(shard):
            offsets, values = self.ragged_column(s, name)
            pos = np.arange(len(row))[sel]
            r = row[sel]
            for p, a, b in zip(pos.tolist(), offsets[r].tolist(), offsets[r + 1].tolist()):
                out[p] = values[a:b].copy()
        return out

    def _gather_binary(self, name: str, shard: np.ndarray, row: np.ndarray) -> list:
        out: list = [None] * len(row)
        as_str = self.fields[name].kind == "string" if name in self.fields else True
        for s, sel in self._groups(shard):
            offsets, values = self._raw_column(s, name)
            pos = np.arange(len(row))[sel]
            for p, r in zip(pos.tolist(), row[sel].tolist()):
                b = values[offsets[r]:offsets[r + 1]].tobytes()
                out[p] = b.decode("utf-8") if as_str else b
        return out

    def views(self, field: str, indices: np.ndarray | Sequence[int]) -> list[np.ndarray]:
        """Zero-copy uint8 views of the encoded bytes of an image/bytes field, one per index."""
        f = self._field(field)
        if f.fixed or f.ragged:
            raise TypeError(f"field {field!r} is a {f.kind} field; views() is for binary fields")
        shard, row = self.locate(indices)
        out: list = [None] * len(row)
        for s, sel in self._groups(shard):
            offsets, values = self._raw_column(s, field)
            pos = np.arange(len(row))[sel]
            r = row[sel]
            starts, ends = offsets[r].tolist(), offsets[r + 1].tolist()
            for p, a, b in zip(pos.tolist(), starts, ends):
                out[p] = values[a:b]
        return out

    def image_sizes(self, field: str, indices: np.ndarray | Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(width, height) int32 arrays read from the store (recorded at convert time)."""
        f = self._field(field)
        if f.kind != "image":
            raise TypeError(f"field {field!r} is a {f.kind} field, not an image")
        shard, row = self.locate(indices)
        wcol, hcol = image_size_columns(field)
        w = np.empty(len(row), dtype=np.int32)
        h = np.empty(len(row), dtype=np.int32)
        for s, sel in self._groups(shard):
            w[sel] = self._int_column(s, wcol)[row[sel]]
            h[sel] = self._int_column(s, hcol)[row[sel]]
        return w, h

    def keys(self, indices: np.ndarray | Sequence[int]) -> list[str]:
        """The source key (e.g. the relative path of the original file) of each sample."""
        shard, row = self.locate(indices)
        return self._gather_binary(KEY_COLUMN, shard, row)

    def describe(self, index: int) -> str:
        """'shard shard-00003.arrow row 17 (key cat/001.jpg)' for error messages."""
        shard, row = self.locate([index])
        key = self.keys([index])[0]
        return f"sample {index} (shard {self.shard_files[int(shard[0])].name}, row {int(row[0])}, key {key!r})"

    def get_batch(self, indices: np.ndarray | Sequence[int], fields: Sequence[str] | None = None) -> dict:
        """Gather a whole batch: fixed fields as stacked numpy arrays (vectorised), ragged
        fields as lists of arrays ``(k, *item_shape)``, binary fields as lists of ``bytes``,
        strings as lists of ``str``."""
        shard, row = self.locate(indices)
        out: dict[str, Any] = {}
        for name in (fields if fields is not None else self.fields):
            f = self._field(name)
            out[name] = (self._gather_fixed(name, shard, row) if f.fixed
                         else self._gather_ragged(name, shard, row) if f.ragged
                         else self._gather_binary(name, shard, row))
        return out

    def __getitem__(self, i: int) -> dict:
        n = len(self)
        if isinstance(i, (np.integer,)):
            i = int(i)
        if not isinstance(i, int):
            raise TypeError(f"dataset index must be an int, not {type(i).__name__}; use get_batch() for many")
        if i < -n or i >= n:
            raise IndexError(f"sample index {i} is out of range for {self.path} ({n} samples)")
        b = self.get_batch([i % n])
        sample = {k: v[0] for k, v in b.items()}
        return sample if self.transform is None else self.transform(sample)

    def __getitems__(self, indices: Sequence[int]) -> list[dict]:
        """Batched fetch for ``torch.utils.data.DataLoader``: one vectorised gather, then
        split into the list of samples that ``collate_fn`` expects."""
        b = self.get_batch(indices)
        n = len(indices)
        samples = [{k: v[j] for k, v in b.items()} for j in range(n)]
        return samples if self.transform is None else [self.transform(s) for s in samples]


def _ragged_views(col: pa.Array, f: Field, path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Zero-copy (offsets int64, values (items, *item_shape)) of a large_list column."""
    if not isinstance(col.type, pa.LargeListType):
        raise FormatError(f"shard {path}: ragged field column has type {col.type}, not large_list")
    offsets = col.offsets.to_numpy(zero_copy_only=True)  # indices into col.values, slice-aware
    items = col.values
    base, per_item = f.storage()
    if isinstance(items.type, pa.FixedSizeListType):
        flat = items.values.to_numpy(zero_copy_only=True)[items.offset * per_item:(items.offset + len(items)) * per_item]
    else:
        flat = items.to_numpy(zero_copy_only=True)
    n_items = len(items)
    values = flat.view(f.np_dtype).reshape((n_items, *f.shape))
    if len(offsets) and (offsets[0] < 0 or offsets[-1] > n_items):
        raise FormatError(f"shard {path}: ragged field offsets run past its {n_items} items; the shard is damaged")
    return offsets, values

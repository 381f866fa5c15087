"""DatasetReader: a fastload directory opened for reading, without torch.

Opening reads ``manifest.json`` only (:mod:`fastload.store.manifest`). Shards are
memory-mapped on first use, one record batch each (:mod:`fastload.store.shard`), so every
tensor or scalar column of a shard is a single zero-copy numpy view of shape
``(rows, *shape)``; each shard is verified against the manifest's checksum before any of
its rows is delivered (:mod:`fastload.store.first_use`); at most a few thousand stay
mapped, the least recently used dropped first (:mod:`fastload.store.mapped`: a process may
hold only ``vm.max_map_count`` mappings). The global index -> (shard, row)
map is one cumulative-count numpy array: no per-sample Python object exists, so forked
DataLoader workers do not grow by copy-on-write. A remote dataset's shards come from a
node-local cache (:mod:`fastload.remote`), mapped when they arrive and dropped when the
cache releases them.

This module imports neither torch nor DALI: verify, inspect and conversion use
:class:`DatasetReader` directly. The public :class:`fastload.Dataset` (``store/dataset.py``)
is this class made a ``torch.utils.data.Dataset`` as well.
"""
from __future__ import annotations

import os
import weakref
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from ..runtime import lifecycle
from ..errors import FormatError, MissingFileError
from ..validate import check_choice, check_index_array
from .format import MANIFEST, Field, arrow_schema
from .gather import Gathering
from .verified_record import DEFAULT_VERIFY, VERIFY_POLICIES
from .lengths import local_lengths
from .manifest import check_manifest, manifest_fields, read_manifest
from .mapped import ShardMaps, mapped_shard_limit
from .shard import MappedShard, SchemaCheck
from .first_use import ShardVerifier

if TYPE_CHECKING:
    from ..remote.options import RemoteOptions

__all__ = ["DatasetReader", "check_manifest", "manifest_fields", "read_manifest"]


class DatasetReader(Gathering):
    """A fastload dataset directory, opened read-only (no torch needed).

    ``len(ds)``, ``ds.fields``, ``ds[i]`` (one sample as a dict), ``ds.get_batch(indices)``
    (a whole batch, gathered with vectorised numpy), and ``ds.__getitems__`` so a plain
    ``torch.utils.data.DataLoader`` fetches whole batches (through :class:`fastload.Dataset`,
    this class as a ``torch.utils.data.Dataset``). Tensor fields come back as numpy arrays,
    ragged fields as arrays ``(k, *item)``, scalars as numpy scalars, images and bytes as
    ``bytes`` (``fastload.vision.decode`` makes a uint8 tensor), strings as ``str``.
    ``transform(sample) -> anything`` is applied by ``ds[i]`` and ``__getitems__`` (per-sample
    Python code in DataLoader workers; ``get_batch`` returns the stored values). Pickles as
    its path, transform and verification policy (a worker process reopens it), never its data.

    ``verify`` ("first-use", the default; "always"; "off"): whether each shard's bytes are
    checked against the manifest's checksum before any of its rows is delivered, and whether
    that is remembered for the node (see :mod:`fastload.store.verified_record`).

    A URL (``s3://``, ``gs://``, ``az://``, ``https://``) is opened as ``remote`` says (a
    :class:`~fastload.remote.options.RemoteOptions`: cache directory and budget, filesystem
    and its options, download deadline and threads), or as the same settings given as
    keywords (``cache_dir=``, ``cache_limit=``, ``filesystem=``, ``storage_options=``,
    ``download_timeout=``, ``download_threads=``; not together with ``remote=``).
    """

    _repr_name = "fastload.store.DatasetReader"
    path: str | Path  # the directory; for a remote dataset, its display URL

    def __init__(self, path: str | os.PathLike, *, transform: Callable[[dict], Any] | None = None,
                 cache_dir: str | os.PathLike | None = None, cache_limit: int | str | None = None,
                 filesystem: Any = None, storage_options: dict | None = None, verify: str = DEFAULT_VERIFY,
                 download_timeout: float | None = None, download_threads: int | None = None,
                 remote: RemoteOptions | None = None):
        from ..remote.options import RemoteOptions  # (the remote package is imported when needed)

        # every remote setting, checked once (bad values: ValueError naming them, before any request)
        remote = RemoteOptions.from_keywords(remote, cache_dir=cache_dir, cache_limit=cache_limit,
                                             filesystem=filesystem, storage_options=storage_options,
                                             download_timeout=download_timeout, download_threads=download_threads)
        self.verify_policy: str = check_choice("verify", verify, VERIFY_POLICIES)
        if transform is not None and not callable(transform):
            raise ValueError(f"transform={transform!r} must be a function sample -> sample")
        self.transform = transform
        # A remote dataset (s3://, gs://, az://, https://): the manifest comes from the URL, the
        # shards from a node-local cache (fastload.remote); self.path is then the display URL.
        self.url: str | None = None
        self.cache = None
        from ..remote.url import is_remote

        if is_remote(path) or remote.filesystem is not None:
            from ..remote import open_cache

            self.cache = open_cache(str(path), remote)
            self.url = self.path = self.cache.url
            try:
                self.manifest = check_manifest(self.cache.remote.manifest, f"{self.url}/{MANIFEST}")
            except BaseException:
                self.cache.close()
                raise
            base = self.cache.dir
            # The cache's hooks hold this reader weakly: a dropped Dataset is freed at once (no
            # cycle through its cache), so the cache's finalizer joins the download threads.
            me = weakref.ref(self)
            def release(i: int) -> None:
                ds = me()
                if ds is not None:
                    ds._release_shard(i)

            self.cache.on_release(release)
            if self.verify_policy == "first-use":  # the download was hashed: no second hash at first use
                checksums = [s["checksum"] for s in self.manifest["shards"]]
                self.cache.on_fetched(lambda i, p: remember_verified(p, checksums[i]))
        else:
            if remote.given():
                raise ValueError(f"{' / '.join(remote.given())} apply to remote datasets (s3://, gs://, az://, "
                                 f"https://); {str(path)!r} is a local path")
            self.path = Path(path)
            self.manifest = read_manifest(self.path)
            base = self.path
        m = self.manifest
        self.fields: dict[str, Field] = manifest_fields(m, Path(str(self.path)))  # (checked with the manifest)
        self.schema = arrow_schema(self.fields)
        self.shard_files = ShardPaths(base, [s["file"] for s in m["shards"]])
        self.shard_sizes = np.array([s["num_samples"] for s in m["shards"]], dtype=np.int64)
        self._starts = np.zeros(len(self.shard_sizes) + 1, dtype=np.int64)
        np.cumsum(self.shard_sizes, out=self._starts[1:])
        self._shards: list[MappedShard | None] = [None] * len(self.shard_files)
        self._maps = ShardMaps(self._shards, mapped_shard_limit())  # a local dataset's, bounded
        self._schema_check = SchemaCheck(self.fields)
        self._lock = threading.Lock()
        self._verifier = ShardVerifier(self.verify_policy, m["shards"], self.shard_files, self.path)
        lifecycle.track(self)
        lab = m.get("label")
        self.label_field: str | None = lab["field"] if lab else None
        self.class_names: list[str] | None = lab.get("class_names") if lab else None
        self.class_counts = np.asarray(lab["counts"], dtype=np.int64) if lab else None

    # -- pickling for spawn-started DataLoader workers: the path only, never the data ----
    # (a remote dataset: what reopens the same place and its cache settings, never a secret:
    # see fastload.remote.privacy; pickling fails with a clear message rather than carry one)
    def __getstate__(self):
        if self.cache is not None:
            return {"path": self.url, "transform": self.transform, "verify": self.verify_policy,
                    **self.cache.reopen_state()}
        return {"path": str(self.path), "transform": self.transform, "verify": self.verify_policy}

    def __setstate__(self, state):
        from ..remote.options import RemoteOptions

        where = state.get("remote") or {}  # the transport's secret-free description
        options = RemoteOptions(cache_dir=state.get("cache_dir"), cache_limit=state.get("cache_limit"),
                                filesystem=where.get("filesystem"), storage_options=where.get("storage_options"),
                                download_timeout=state.get("download_timeout"),
                                download_threads=state.get("download_threads"))
        self.__init__(where.get("url", state["path"]),  # type: ignore[misc]  # (a subclass's own __init__)
                      transform=state.get("transform"), remote=options,
                      verify=state.get("verify", DEFAULT_VERIFY))
        if self.cache is not None and state.get("fingerprint") not in (None, self.cache.remote.fingerprint):
            self.close()
            raise FormatError(f"{self.url} changed since this Dataset was pickled (its manifest's fingerprint is "
                              f"{self.cache.remote.fingerprint}, the pickled one {state['fingerprint']}): a worker "
                              "would read other data than its parent; reopen the dataset")

    def _after_fork_in_child(self) -> None:
        # A thread of the parent may have held these at fork time; the mappings stay valid.
        self._lock = threading.Lock()
        self._verifier.after_fork()

    def close(self) -> None:
        """Stop hashing shards ahead of use (:meth:`verify_ahead`); stop a remote dataset's
        download threads and release its cache (the shards downloaded stay for the next run)."""
        self._verifier.stop_ahead()
        if self.cache is not None:
            self.cache.close()

    def _close_at_exit(self, deadline_s: float) -> None:
        self._verifier.stop_ahead(deadline_s)

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
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
    def shard(self, i: int) -> MappedShard:
        """Shard ``i``, memory-mapped (on first use; a local dataset keeps at most
        :func:`~fastload.store.mapped.mapped_shard_limit` shards mapped, see
        :mod:`fastload.store.mapped`)."""
        s = self._shards[i]
        if s is None:
            if self.cache is not None:
                return self._remote_shard(i)
            with self._lock:
                s = self._shards[i]
                if s is None:
                    s = MappedShard(self.shard_files[i], self.manifest["shards"][i], self.fields, self._schema_check)
                    self._maps.add(i, s, lambda j: str(self.shard_files[j]))
        elif self.cache is None:
            self._maps.touch(i)
        return s

    @property
    def mapped_shards(self) -> int:
        """Shards this reader holds mapped now (views handed out may keep others mapped)."""
        return len(self._maps) if self.cache is None else sum(s is not None for s in self._shards)

    def ensure_verified(self, shards: Any) -> None:
        """Check the bytes of these shards against the manifest's checksums (as the
        verification policy says) before any of their rows is read; FormatError names a
        shard that does not match. Cheap once every shard is verified."""
        self._verifier.ensure(shards, self.shard)

    @property
    def fully_verified(self) -> bool:
        """True once no shard is left to check (at once with ``verify="off"``)."""
        return self._verifier.all_verified

    def verify_ahead(self, shards: Any) -> None:
        """Hash these shards (then the others) in background threads, in this order, ahead
        of the reads that need them; returns at once (see
        :meth:`~fastload.store.first_use.ShardVerifier.ahead`). A Loader calls it with the
        shards of the batches it requests; reads still verify every shard they touch, so
        this only moves the work earlier. Nothing for a remote dataset (its shards are
        verified as they arrive) or once every shard is verified."""
        if self.cache is None and not self._verifier.all_verified:
            self._verifier.ahead(shards, self.shard)

    def stop_verify_ahead(self) -> None:
        """Stop the background hashing of :meth:`verify_ahead` and join its threads."""
        self._verifier.stop_ahead()

    def verify_stats(self) -> dict:
        """The verification policy and what it cost so far: shards hashed, shards the node's
        record vouched for, bytes hashed, seconds spent hashing (summed over threads' wall)."""
        return self._verifier.stats()

    def _remote_shard(self, i: int) -> MappedShard:
        """Map shard ``i`` of a remote dataset, fetching it into the cache first (blocking)."""
        assert self.cache is not None  # (remote datasets only)
        for attempt in range(3):
            self.cache.ensure(i)  # outside the lock: other shards map meanwhile
            with self._lock:
                s = self._shards[i]
                if s is not None:
                    return s
                try:
                    s = MappedShard(self.shard_files[i], self.manifest["shards"][i], self.fields)
                except (FormatError, MissingFileError):
                    if self.shard_files[i].exists() or attempt == 2:
                        raise
                    continue  # evicted between ensure() and the mapping (another rank): again
                if self.__dict__.get("_lengths"):  # lengths read before the download: still right?
                    from ..remote.lengths import check_shard

                    check_shard(self, i, s)
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

    def column(self, shard: int, field: str, *, verify: bool = True) -> np.ndarray:
        """Zero-copy read-only view ``(rows, *shape)`` of a tensor/scalar field in one shard,
        the shard verified first (``verify=False``: the caller calls :meth:`ensure_verified`
        before it delivers any row of the view, as the Loader does per batch)."""
        f = self._field(field)
        if not f.fixed:
            use = "ragged_column()" if f.ragged else "binary_column()"
            raise TypeError(f"field {field!r} is a {f.kind} field; use {use}")
        if verify:
            self.ensure_verified([shard])
        return self.shard(shard).fixed(field, f)

    def _raw_column(self, shard: int, name: str) -> tuple[np.ndarray, np.ndarray]:
        return self.shard(shard).binary(name)

    def binary_column(self, shard: int, field: str) -> tuple[np.ndarray, np.ndarray]:
        """Zero-copy ``(offsets int32[rows+1], values uint8[...])`` of an image/bytes/string field."""
        f = self._field(field)
        if f.fixed or f.ragged:
            raise TypeError(f"field {field!r} is a {f.kind} field; use {'ragged_column' if f.ragged else 'column'}()")
        self.ensure_verified([shard])
        return self._raw_column(shard, field)

    def ragged_column(self, shard: int, field: str, *, verify: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Zero-copy read-only ``(offsets, values)`` of a ragged field in one shard: ``offsets``
        int64 ``(rows + 1,)`` (sample ``r`` is ``values[offsets[r]:offsets[r + 1]]``; they
        need not start at 0) and ``values`` of shape ``(items, *item_shape)``."""
        f = self._field(field)
        if not f.ragged:
            raise TypeError(f"field {field!r} is a {f.kind} field, not a ragged one")
        if verify:
            self.ensure_verified([shard])
        return self.shard(shard).ragged(field, f, self.shard_files[shard])

    def lengths(self, field: str) -> np.ndarray:
        """Items per sample of a ragged field, for every sample (int64, cached): read from
        the shards' offsets, never from the values (a remote dataset's with byte-range reads
        of just the offsets, kept in its cache directory: :mod:`fastload.remote.lengths`; a
        local dataset's past a million samples kept in the node's cache directory:
        :mod:`fastload.store.lengths`), memory-mapped read-only when kept."""
        f = self._field(field)
        if not f.ragged:
            raise TypeError(f"field {field!r} is a {f.kind} field, not a ragged one")
        cache = self.__dict__.setdefault("_lengths", {})
        v = cache.get(field)
        if v is None:
            if self.cache is not None:
                from ..remote.lengths import remote_lengths

                v = remote_lengths(self, field, lambda s: MappedShard(self.shard_files[s], self.manifest["shards"][s],
                                                                      self.fields))
            else:  # memory-mapped from the node's cache directory past a million samples
                v = local_lengths(self, field)
            if v.flags.writeable:
                v.flags.writeable = False
            cache[field] = v
        return v

    def _int_column(self, shard: int, name: str) -> np.ndarray:
        return self.shard(shard).ints(name)

    # -- index -----------------------------------------------------------------------------
    def locate(self, indices: np.ndarray | Sequence[int], *, check: bool = True,
               verify: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Global indices -> (shard, row), both int64 arrays, the shards verified (as the
        policy says) before anything reads their rows. Out of range -> IndexError, a float
        or bool index -> ValueError (``check=False`` skips both checks for indices known to be
        valid int64; ``verify=False`` only locates)."""
        idx = check_index_array(indices, "indices") if check else np.asarray(indices, dtype=np.int64)
        n = len(self)
        if check and idx.size:
            lo, hi = idx.min(), idx.max()
            if lo < 0 or hi >= n:
                bad = int(lo if lo < 0 else hi)
                raise IndexError(f"sample index {bad} is out of range for {self.path} ({n} samples)")
        shard = np.searchsorted(self._starts, idx, side="right") - 1
        if verify and not self._verifier.all_verified and idx.size:
            self.ensure_verified(shard)
        return shard, idx - self._starts[shard]


class ShardPaths(Sequence):
    """The shards' paths, each made when asked for: a manifest of 100,000 shards opens
    without building 100,000 Path objects (about a second of its open time)."""

    def __init__(self, base: Path, names: list[str]) -> None:
        self.base, self.names = base, names

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.base / n for n in self.names[i]]
        return self.base / self.names[i]


def remember_verified(path: Path, checksum: str) -> None:
    """Record a shard the remote cache just downloaded and found equal to ``checksum`` in the
    node's verified-shard record (keyed by the file's identity), so that its first use does
    not hash it a second time."""
    from types import SimpleNamespace

    from .verified_record import VerifiedRecord

    st = os.stat(path)
    ident = SimpleNamespace(path=os.fspath(path), st_dev=st.st_dev, st_ino=st.st_ino, size=st.st_size,
                            st_mtime_ns=st.st_mtime_ns, st_ctime_ns=st.st_ctime_ns)
    record = VerifiedRecord()
    record.add(record.key(ident, checksum), ident, checksum, written_here=True)

"""ShardWriter: samples in, a complete dataset directory out — or nothing that opens.

Samples are checked (:mod:`.values`: shapes, dtypes, ranges, labels; image sizes from
:mod:`.geometry`) before anything of them is buffered, so a refused sample
(:class:`~fastload.errors.SampleError`) leaves the writer able to go on. Each shard is built
in memory as one Arrow record batch (so every column of a shard is one contiguous, zero-copy
view when read back) and rolled by bytes; the manifest records shards, checksums and label
counts. Where the files go and how they become the dataset — temporary names, fsync,
staging inside DST for an overwrite, the manifest last — is :mod:`.transaction`'s job.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence, cast

import numpy as np
import pyarrow as pa

from ..errors import NO_SPACE_ERRNOS, NoSpaceError, SampleError
from .keys import escape_key
from .format import (
    CHECKSUM_ALGO, DEFAULT_SHARD_SIZE, FORMAT_NAME, KEY_COLUMN, Field, arrow_schema,
    MEDIA_KINDS, check_field_names, format_version_for, media_columns, parse_field, parse_size, shard_name,
)
from .geometry import image_size
from .transaction import Transaction, write_atomic
from .values import check_label_field, check_labels, encoded, fixed_rows, ragged_rows

__all__ = ["DEFAULT_SHARD_SIZE", "SampleError", "ShardWriter"]


def _storable_key(key: str) -> str:
    """A key Arrow can store as UTF-8: one that is not (a file name's undecodable bytes carried
    as surrogates) is escaped as ``fastload convert`` escapes names (:func:`~fastload.store.keys.escape_key`:
    ``\\xNN``, backslashes doubled, so two such names never share a key) rather than failing
    the whole shard at flush. Keys that are valid UTF-8 are stored as given."""
    try:
        key.encode("utf-8")
        return key
    except UnicodeEncodeError:
        return escape_key(key)


class ShardWriter:
    """Write samples into a fastload dataset directory.

    >>> with ShardWriter("out", fields={"image": "image", "label": "int64"}, label="label") as w:
    ...     w.write({"image": jpeg_bytes, "label": 3}, key="cat/001.jpg")

    ``fields`` maps names to specs: ``"image"``, ``"bytes"``, ``"string"``, a scalar dtype
    (``"int64"``, ``"float32"``, ``"bool"``), a tensor (``"float32[784]"``,
    ``"uint8[3,224,224]"``), a ragged field (``"int32[]"``: a 1-d array of any length per
    sample; ``"float32[*,4]"``: any number of rows of 4) or a :class:`Field`. A ragged value
    is an array of shape ``(k, *item)`` (``k`` may be 0); ``write_batch`` takes a list of
    such arrays or a :class:`~fastload.store.values.Ragged` (values + offsets). ``label`` names an integer scalar field
    whose per-class counts (and ``class_names``) go into the manifest. The dataset exists
    only once :meth:`close` (or the end of the ``with`` block) has written the manifest; an
    exception inside the block deletes what was written.

    ``shard_size``: bytes per shard (an int, or ``"256MB"``; at most 2 GiB; not a float).
    Unlike ``fastload convert``, which refuses sizes below 1 MB unless forced, the writer
    takes any size: it is the library's building block (a distributed convert's tasks and
    tests write small shards on purpose).
    """

    def __init__(self, path: str | os.PathLike, fields: Mapping[str, Any], *,
                 shard_size: int | str = DEFAULT_SHARD_SIZE, label: str | None = None,
                 class_names: Sequence[str] | None = None, overwrite: bool = False,
                 metadata: Mapping[str, Any] | None = None):
        if not fields:
            raise ValueError("fields is empty; a dataset needs at least one field")
        self.path = Path(path)
        self.fields = {str(n): parse_field(s, n) for n, s in fields.items()}
        check_field_names(self.fields)
        self.shard_size = parse_size(shard_size)
        check_label_field(self.fields, label)
        self.label = label
        self.class_names = list(class_names) if class_names is not None else None
        self.metadata = dict(metadata or {})
        self.schema = arrow_schema(self.fields)
        # Where the files go until close(): the destination, or a staging directory inside it
        # when replacing a dataset (a writer dropped without close() or abort() removes it).
        self._txn = Transaction(self.path, overwrite)
        self._shards: list[dict] = []
        self._label_counts = np.zeros(0, dtype=np.int64)
        self._closed = False
        self._reset_buffer()

    # -- buffering -----------------------------------------------------------------------
    def _reset_buffer(self):
        self._cols: dict[str, list] = {n: [] for n in self.fields}
        self._sizes: dict[str, list] = {n: [] for n, f in self.fields.items() if f.kind == "image"}
        self._media: dict[str, list] = {n: [] for n, f in self.fields.items() if f.kind in MEDIA_KINDS}
        self._keys: list[str] = []
        self._rows = 0
        self._bytes = 0

    @property
    def dir(self) -> Path:
        """The directory this writer's files go to now (a staging directory inside ``path``
        while replacing a dataset; ``path`` once closed). Extra files written here, like the
        skipped report, become part of the dataset at :meth:`close`."""
        return self._txn.dir

    @property
    def num_samples(self) -> int:
        return sum(s["num_samples"] for s in self._shards) + self._rows

    @property
    def num_written(self) -> int:
        """Samples in the shards written to disk so far (not counting the buffered ones)."""
        return sum(s["num_samples"] for s in self._shards)

    @property
    def num_written_bytes(self) -> int:
        """Bytes of the shards written to disk so far."""
        return sum(s["bytes"] for s in self._shards)

    def _check_open(self):
        if self._closed:
            raise RuntimeError(f"ShardWriter for {self.path} is closed")

    def write(self, sample: Mapping[str, Any], key: str | None = None,
              image_sizes: Mapping[str, tuple[int, int]] | None = None,
              media_info: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        """Append one sample: a dict with a value for every field.

        ``image_sizes`` may give (width, height) of image fields already known to the caller
        (convert reads them while validating); otherwise they are read from the header.
        ``media_info`` likewise gives what was probed of video/audio fields
        (:func:`fastload.store.media.probe`); otherwise each file is probed (decoded) here."""
        self._check_open()
        key = str(self.num_samples) if key is None else _storable_key(str(key))
        missing = [n for n in self.fields if n not in sample]
        if missing:
            raise SampleError(f"sample {key!r} lacks field(s) {missing}; fields are {list(self.fields)}")
        extra = [n for n in sample if n not in self.fields]
        if extra:
            raise SampleError(f"sample {key!r} has unknown field(s) {extra}; fields are {list(self.fields)}")
        row: dict[str, Any] = {}
        sizes: dict[str, tuple[int, int]] = {}
        media: dict[str, dict] = {}
        nbytes = 0
        for name, f in self.fields.items():
            v = sample[name]
            if f.fixed:
                row[name] = fixed_rows(name, f, v, None, lambda _: key)
                if name == self.label:
                    check_labels(name, row[name], self.class_names, lambda _: key)
                nbytes += f.row_nbytes
            elif f.ragged:
                row[name] = ragged_rows(name, f, v, None, lambda _: key)
                nbytes += row[name][0].nbytes + 8
            else:
                b = encoded(name, f, v, key)
                if f.kind == "image" and image_sizes and name in image_sizes:
                    sizes[name] = cast("tuple[int, int]", tuple(int(x) for x in image_sizes[name]))
                elif f.kind == "image":
                    try:
                        sizes[name] = image_size(cast(bytes, b))  # an image field's value is bytes
                    except Exception as e:
                        raise SampleError(f"field {name!r} of sample {key!r} is not a readable image: {e}") from None
                if f.kind in MEDIA_KINDS:
                    media[name] = _media_info(name, f.kind, cast(bytes, b), (media_info or {}).get(name), key)
                row[name] = b
                nbytes += len(b) if isinstance(b, bytes) else len(b.encode())
        nbytes += len(key)
        # Roll before a sample that would take the shard past its budget (a sample larger
        # than the whole budget gets a shard of its own).
        if self._rows and self._bytes + nbytes > self.shard_size:
            self._flush()
        for name, v in row.items():
            self._cols[name].append(v)
        for name, wh in sizes.items():
            self._sizes[name].append(wh)
        for name, info in media.items():
            self._media[name].append(info)
        self._keys.append(key)
        self._rows += 1
        self._bytes += nbytes

    def write_batch(self, batch: Mapping[str, Any], keys: Sequence[str] | None = None) -> None:
        """Append many samples at once: a dict of arrays (fixed fields), lists of arrays or
        ``Ragged`` (ragged fields), or sequences (image, bytes, string fields)."""
        self._check_open()
        if set(batch) != set(self.fields):
            raise ValueError(f"batch fields {sorted(batch)} differ from the dataset's {sorted(self.fields)}")
        unsized = [n for n, v in batch.items() if not hasattr(v, "__len__")]
        if unsized:
            raise SampleError(f"field {unsized[0]!r} of the batch: expected one value per sample (an array, a list "
                              f"of arrays or a Ragged), got {type(batch[unsized[0]]).__name__}")
        lengths = {n: len(v) for n, v in batch.items()}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"batch fields have different lengths: {lengths}")
        n = next(iter(lengths.values()))
        if n == 0:
            return
        if keys is not None and len(keys) != n:
            raise ValueError(f"keys has {len(keys)} entries for a batch of {n}")
        base = self.num_samples

        def key_of(i: int) -> str:
            return str(base + i) if keys is None else str(keys[i])

        fixed = {name: fixed_rows(name, f, batch[name], n, key_of)
                 for name, f in self.fields.items() if f.fixed}
        if self.label is not None:
            check_labels(self.label, fixed[self.label], self.class_names, key_of)
        ragged = {name: ragged_rows(name, f, batch[name], n, key_of)
                  for name, f in self.fields.items() if f.ragged}
        if all(f.fixed or f.ragged for f in self.fields.values()):
            self._buffer_bulk(n, fixed, ragged, keys, base)
            return
        starts = {name: np.concatenate([[0], np.cumsum(lens)]) for name, (_, lens) in ragged.items()}
        for i in range(n):
            sample = {}
            for name in self.fields:
                if name in fixed:
                    sample[name] = fixed[name][i]
                elif name in ragged:
                    sample[name] = ragged[name][0][starts[name][i]:starts[name][i + 1]]
                else:
                    sample[name] = batch[name][i]
            self.write(sample, key=str(base + i) if keys is None else keys[i])

    def _buffer_bulk(self, n: int, fixed: dict, ragged: dict, keys: Sequence[str] | None, base: int) -> None:
        """Buffer checked rows of fixed and ragged fields, split at shard boundaries without
        per-sample Python work."""
        row_bytes = np.full(n, sum(f.row_nbytes for f in self.fields.values() if f.fixed), dtype=np.int64)
        item_starts = {}
        for name, (_values, lens) in ragged.items():
            row_bytes += lens * self.fields[name].item_nbytes + 8
            starts = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(lens, out=starts[1:])
            item_starts[name] = starts
        cum = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(row_bytes, out=cum[1:])
        start = 0
        while start < n:
            room = self.shard_size - self._bytes
            # rows start..stop-1 fit in the room left (at least one row: a row larger than
            # the whole budget gets a shard of its own)
            stop = int(np.searchsorted(cum, cum[start] + room, side="right")) - 1
            if stop <= start:
                if self._rows:
                    self._flush()
                    continue
                stop = start + 1
            stop = min(n, stop)
            for name, arr in fixed.items():
                self._cols[name].append(arr[start:stop])
            for name, (values, lens) in ragged.items():
                st = item_starts[name]
                self._cols[name].append((values[st[start]:st[stop]], lens[start:stop]))
            if keys is None:
                self._keys.extend(map(str, range(base + start, base + stop)))
            else:
                self._keys.extend(_storable_key(str(k)) for k in keys[start:stop])
            self._rows += stop - start
            self._bytes += int(cum[stop] - cum[start])
            start = stop

    # -- shards --------------------------------------------------------------------------
    def _arrays(self) -> list[pa.Array]:
        arrays = []
        for name, f in self.fields.items():
            chunks = self._cols[name]
            if f.fixed:
                arr = np.concatenate(chunks) if len(chunks) > 1 else chunks[0]
                base, per_row = f.storage()
                flat = np.ascontiguousarray(arr).view(base).reshape(-1)
                if per_row == 1 and not isinstance(f.arrow_type(), pa.FixedSizeListType):
                    arrays.append(pa.array(flat))
                else:
                    arrays.append(pa.FixedSizeListArray.from_arrays(pa.array(flat), per_row))
                if name == self.label:
                    self._count_labels(name, arr)
            elif f.ragged:
                arrays.append(_ragged_array(f, chunks))
            else:
                arrays.append(pa.array(chunks, type=f.arrow_type()))
                if f.kind == "image":
                    wh = np.asarray(self._sizes[name], dtype=np.int32).reshape(-1, 2)
                    arrays += [pa.array(wh[:, 0]), pa.array(wh[:, 1])]
                for k, (_, t) in media_columns(name, f.kind).items():
                    arrays.append(pa.array([info[k] for info in self._media[name]], type=t))
        arrays.append(pa.array(self._keys, type=pa.string()))
        return arrays

    def _count_labels(self, name: str, labels: np.ndarray) -> None:
        labels = labels.astype(np.int64, copy=False)
        if labels.size and labels.min() < 0:
            bad = int(np.flatnonzero(labels < 0)[0])
            raise ValueError(f"label field {name!r} holds a negative class id {int(labels[bad])} "
                             f"(sample {self._keys[bad]!r}); class ids must be 0..num_classes-1")
        counts = np.bincount(labels)
        if counts.size > self._label_counts.size:
            counts, self._label_counts = self._label_counts, counts
        self._label_counts[: counts.size] += counts

    def _flush(self) -> None:
        if self._rows == 0:
            return
        batch = pa.RecordBatch.from_arrays(self._arrays(), schema=self.schema)
        index = len(self._shards)
        name = shard_name(index, self._txn.generation)
        try:
            with write_atomic(self.dir / name) as hf:
                sink = pa.PythonFile(hf, mode="w")
                with pa.ipc.new_file(sink, self.schema) as w:
                    w.write_batch(batch)
                sink.close() if not sink.closed else None
        except OSError as e:
            if e.errno not in NO_SPACE_ERRNOS:
                raise
            written = sum(s["bytes"] for s in self._shards)
            self.abort()  # nothing of the new dataset stays behind (an old one being replaced does)
            raise NoSpaceError(self.path, needed=written + batch.nbytes, written=written, detail=name) from None
        self._shards.append({
            "file": name,
            "num_samples": int(batch.num_rows),
            "bytes": int(hf.nbytes),
            "checksum": f"{CHECKSUM_ALGO}:{hf.hash.hexdigest()}",
        })
        self._reset_buffer()

    # -- end -----------------------------------------------------------------------------
    def manifest(self) -> dict:
        total = sum(s["num_samples"] for s in self._shards)
        m: dict[str, Any] = {
            "format": FORMAT_NAME,
            "format_version": format_version_for(self.fields),
            "num_samples": total,
            "total_bytes": sum(s["bytes"] for s in self._shards),
            "fields": {n: f.to_json() for n, f in self.fields.items()},
            "key_column": KEY_COLUMN,
            "checksum_algorithm": CHECKSUM_ALGO,
            "shards": self._shards,
        }
        if self.label is not None:
            names = self.class_names
            ncls = max(len(names) if names else 0, self._label_counts.size)
            counts = np.zeros(ncls, dtype=np.int64)
            counts[: self._label_counts.size] = self._label_counts
            if names is not None and self._label_counts.size > len(names):
                raise ValueError(f"label field {self.label!r} holds class id {self._label_counts.size - 1} "
                                 f"but only {len(names)} class_names were given")
            m["label"] = {"field": self.label, "class_names": names, "counts": counts.tolist()}
        if self.metadata:
            m["metadata"] = self.metadata
        return m

    def close(self) -> dict:
        """Write the last shard and the manifest; return the manifest."""
        if self._closed:
            raise RuntimeError(f"ShardWriter for {self.path} is already closed")
        self._flush()
        m = self.manifest()
        try:
            m = self._txn.commit(m)  # sealed with the manifest's checksum
        except OSError as e:
            if e.errno not in NO_SPACE_ERRNOS:
                raise
            self.abort()
            raise NoSpaceError(self.path, needed=m["total_bytes"] + 4096, written=m["total_bytes"],
                               detail="manifest.json") from None
        self._closed = True
        return m

    def abort(self) -> None:
        """Delete everything this writer wrote; the directory does not open as a new dataset
        (an old dataset being replaced is left as it was)."""
        self._closed = True
        self._txn.abort()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._closed:
            try:
                self.close()
            except BaseException:
                self.abort()
                raise


def _ragged_array(f: Field, chunks: list) -> pa.Array:
    """One shard's ragged column from its buffered ``(values, lengths)`` chunks: a
    ``large_list`` of the stored values (``fixed_size_list`` items for shaped items)."""
    values = np.concatenate([c[0] for c in chunks]) if len(chunks) > 1 else chunks[0][0]
    lengths = np.concatenate([c[1] for c in chunks]) if len(chunks) > 1 else chunks[0][1]
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    base, per_item = f.storage()
    flat = pa.array(np.ascontiguousarray(values).view(base).reshape(-1))
    items = flat if per_item == 1 else pa.FixedSizeListArray.from_arrays(flat, per_item)
    return pa.LargeListArray.from_arrays(pa.array(offsets), items)


def _media_info(name: str, kind: str, data: bytes, given: Mapping[str, Any] | None, key: str) -> dict:
    """What the store records of a video/audio value: ``given`` (checked for every key and
    a sane value) or, without it, the file probed (decoded) now."""
    cols = media_columns(name, kind)
    if given is None:
        from .media import probe

        try:
            return probe(kind, data)
        except ImportError:
            raise
        except Exception as e:
            raise SampleError(f"field {name!r} of sample {key!r} is not a decodable {kind} file: {e}") from None
    missing = sorted(set(cols) - set(given))
    if missing:
        raise SampleError(f"media_info[{name!r}] of sample {key!r} lacks {missing}; it needs {sorted(cols)}")
    info = {k: given[k] for k in cols}
    for k, v in info.items():
        # fps is a float column, the counts are integer columns (a float there would fail the
        # whole shard at its write, not this sample)
        if k == "codec":
            ok, want = isinstance(v, str) and bool(v), "a codec name"
        elif k == "fps":
            ok = bool(isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
                      and math.isfinite(v) and v >= 0)
            want = "a finite number >= 0"
        else:
            ok, want = bool(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 0), "an integer >= 0"
        if not ok:
            raise SampleError(f"media_info[{name!r}][{k!r}] of sample {key!r} is {v!r}; expected {want}")
    return info

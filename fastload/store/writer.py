"""ShardWriter: samples in, a complete dataset directory out — or nothing that opens.

Each shard is built in memory (one Arrow record batch, so every column of a shard is one
contiguous, zero-copy view when read back), written to ``.shard-NNNNN.arrow.tmp`` while its
xxh3-128 checksum is computed on the fly, fsynced, and renamed. ``manifest.json`` is written
the same way, last: a directory without it is not a dataset, so an interrupted writer can
never leave something that opens half-written.

Replacing a dataset (``overwrite=True``) never destroys the old one before the new one is
complete: the new dataset is written into a hidden ``.fastload-staging-*`` directory inside
DST (same filesystem, so DST may be a mount point; DST's permissions are kept), and only
:meth:`close` removes the old files and moves the new ones up, the manifest last. A failed
conversion leaves the old dataset as it was. A process killed during that final swap (a few
unlinks and renames) leaves DST without a manifest, the new shards moved so far in DST and
the rest with the new manifest in ``DST/.fastload-staging-*/`` (opening DST says so: moving
those files up completes the swap); a killed process at any other time leaves at most that
hidden directory, which the next overwrite of DST removes.
"""
from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import time
import uuid
import weakref
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import xxhash

from .format import (
    CHECKSUM_ALGO, FORMAT_NAME, FORMAT_VERSION, KEY_COLUMN, MANIFEST, SKIPPED_REPORT, Field,
    arrow_schema, check_field_names, image_size_columns, parse_field, shard_name,
)

logger = logging.getLogger("fastload")

DEFAULT_SHARD_SIZE = 256 * 1024 * 1024
MAX_SHARD_SIZE = 2**31 - 1  # binary columns use 32-bit offsets
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.I)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20,
          "g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40}
# Files a fastload dataset directory may hold; --overwrite only ever deletes these.
_STAGING = ".fastload-staging-"
_OWN_FILE = re.compile(r"^(manifest\.json|skipped\.jsonl|shard-\d{5}\.arrow|\.(shard-\d{5}\.arrow|manifest\.json|skipped\.jsonl)\.tmp"
                       r"|\.fastload-staging-[0-9a-f]{12})$")


class SampleError(ValueError):
    """One sample cannot be written (wrong shape, dtype, range, missing field, bad image);
    nothing of it was buffered, so the writer can go on with the next sample."""


def parse_size(value: int | str, what: str = "shard_size") -> int:
    """'256MB', '1.5GiB', '4096' or an int -> bytes."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        n = int(value)
    else:
        m = _SIZE_RE.match(str(value))
        if not m or m.group(2) is not None and m.group(2).lower() not in _UNITS:
            raise ValueError(f"{what}={value!r} is not a size; use e.g. 256MB, 1GiB or a byte count")
        n = int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])
    if not 0 < n <= MAX_SHARD_SIZE:
        raise ValueError(f"{what}={value!r} must be between 1 byte and 2 GiB")
    return n


# EXIF orientations 5-8 rotate by 90 degrees: the decoders (DALI, like PIL's exif_transpose)
# deliver the image upright, so its width and height are swapped relative to the pixel data.
_TRANSPOSING_ORIENTATIONS = (5, 6, 7, 8)
# Formats whose EXIF block DALI reads. TIFF is left out: PIL already reports a TIFF's
# upright size (and transposes it on load).
_EXIF_FORMATS = ("JPEG", "MPO", "PNG", "WEBP")


def displayed_size(im) -> tuple[int, int]:
    """(width, height) of an open PIL image as DALI decodes it: after its EXIF orientation.

    Only the real EXIF block counts (JPEG APP1, PNG eXIf, WebP EXIF: ``im.info["exif"]``), not
    PIL's other sources (XMP ``tiff:Orientation``, PNG text "Raw profile type exif"), which DALI
    ignores. Reading it decodes no pixels."""
    w, h = int(im.size[0]), int(im.size[1])
    raw = im.info.get("exif") if im.format in _EXIF_FORMATS else None
    if not raw:
        return w, h
    try:
        from PIL import Image

        exif = Image.Exif()
        exif.load(raw)
        orientation = int(exif.get(0x0112, 1))
    except Exception:  # a damaged EXIF block: the decoders ignore it too
        orientation = 1
    return (h, w) if orientation in _TRANSPOSING_ORIENTATIONS else (w, h)


def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) from an encoded image's header, without decoding the pixels, as the
    decoders deliver it (EXIF orientation applied: crop windows are drawn in that frame)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        return displayed_size(im)


class _HashingFile(io.RawIOBase):
    """A write-only file that hashes what passes through it (for pa.PythonFile)."""

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


def prepare_output_dir(path: Path, overwrite: bool) -> bool:
    """Create ``path``, or check that the old fastload dataset there may be replaced.

    A non-empty directory is refused without ``overwrite``; with it, only a directory that
    holds nothing but fastload's own files may be replaced, so a mistyped DST never deletes
    a user's other data. Nothing is deleted here: returns True when ``path`` holds files to
    replace (the writer then writes into a staging directory inside it and swaps at close).
    """
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path} exists and is not a directory; choose another destination")
    if path.is_dir():
        entries = sorted(os.listdir(path))
        if entries:
            if not overwrite:
                raise FileExistsError(f"{path} is not empty; choose an empty or new directory, "
                                      "or pass --overwrite (overwrite=True) to replace the dataset in it")
            foreign = [e for e in entries if not _OWN_FILE.match(e)]
            if foreign:
                raise FileExistsError(
                    f"refusing to overwrite {path}: it holds files fastload did not write "
                    f"({', '.join(foreign[:5])}{'…' if len(foreign) > 5 else ''}); choose another directory")
            return True
    path.mkdir(parents=True, exist_ok=True)
    return False


def _remove_own(path: Path, keep: Iterable[str] = (), staging: bool = True) -> None:
    """Delete fastload's files in ``path`` except ``keep`` (and, with ``staging``, leftover
    staging directories), the manifest first so that the old dataset stops opening before
    any shard disappears."""
    keep = set(keep)
    entries = sorted(os.listdir(path), key=lambda e: e != MANIFEST)
    for e in entries:
        if e in keep or not _OWN_FILE.match(e):
            continue
        if e.startswith(_STAGING):
            if staging:
                shutil.rmtree(path / e, ignore_errors=True)
            continue
        try:
            os.unlink(path / e)
        except FileNotFoundError:
            pass


def _fsync_dir(path: Path) -> None:
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


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name("." + path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


class ShardWriter:
    """Write samples into a fastload dataset directory.

    >>> with ShardWriter("out", fields={"image": "image", "label": "int64"}, label="label") as w:
    ...     w.write({"image": jpeg_bytes, "label": 3}, key="cat/001.jpg")

    ``fields`` maps names to specs: ``"image"``, ``"bytes"``, ``"string"``, a scalar dtype
    (``"int64"``, ``"float32"``, ``"bool"``), a tensor (``"float32[784]"``,
    ``"uint8[3,224,224]"``) or a :class:`Field`. ``label`` names an integer scalar field
    whose per-class counts (and ``class_names``) go into the manifest. The dataset exists
    only once :meth:`close` (or the end of the ``with`` block) has written the manifest; an
    exception inside the block deletes what was written.
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
        if label is not None:
            f = self.fields.get(label)
            if f is None:
                raise ValueError(f"label={label!r} is not one of the fields {list(self.fields)}")
            if f.kind != "scalar" or not np.issubdtype(f.np_dtype, np.integer):
                raise ValueError(f"label field {label!r} must be an integer scalar, not {f}")
        self.label = label
        self.class_names = list(class_names) if class_names is not None else None
        self.metadata = dict(metadata or {})
        self.schema = arrow_schema(self.fields)
        self._replace = prepare_output_dir(self.path, overwrite)
        # Where the files go: the destination itself, or a staging directory inside it when replacing.
        self.dir = self.path
        self._cleanup = None
        self._swapping = False
        if self._replace:
            self.dir = self.path / f"{_STAGING}{uuid.uuid4().hex[:12]}"
            self.dir.mkdir()
            # A writer dropped without close() or abort() still removes its staging files.
            self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.dir), True)
        self._shards: list[dict] = []
        self._label_counts = np.zeros(0, dtype=np.int64)
        self._closed = False
        self._t0 = time.time()
        self._reset_buffer()

    # -- buffering -----------------------------------------------------------------------
    def _reset_buffer(self):
        self._cols: dict[str, list] = {n: [] for n in self.fields}
        self._sizes: dict[str, list] = {n: [] for n, f in self.fields.items() if f.kind == "image"}
        self._keys: list[str] = []
        self._rows = 0
        self._bytes = 0

    @property
    def num_samples(self) -> int:
        return sum(s["num_samples"] for s in self._shards) + self._rows

    def _check_open(self):
        if self._closed:
            raise RuntimeError(f"ShardWriter for {self.path} is closed")

    def _fixed_rows(self, name: str, f: Field, value: Any, n: int | None, keys) -> np.ndarray:
        """``value`` as rows of field ``f``; ``keys(row)`` names the sample of a row in errors.

        Casts are checked by value, never silently narrowed: an integer out of the field's
        range, or a finite number that becomes inf in a smaller float type, is an error."""
        where = f"sample {keys(0)!r}" if n is None else f"the batch of samples {keys(0)!r}..{keys(n - 1)!r}"
        try:
            arr = np.asarray(value)
        except ValueError as e:  # ragged nested lists
            raise SampleError(f"field {name!r} of {where}: not a {f} array ({e})") from None
        want = f.shape if n is None else (n, *f.shape)
        if arr.shape != want:
            raise SampleError(f"field {name!r} of {where}: got shape {arr.shape}, expected {want} ({f})")
        if arr.dtype == object:
            raise SampleError(f"field {name!r} of {where}: values numpy cannot store as numbers "
                              f"(integers beyond 64 bits, or mixed types?); expected {f}")
        if arr.dtype != f.np_dtype:
            ints = arr.dtype.kind in "iu" and f.np_dtype.kind in "iu"  # any sign: range-checked below
            if not (ints or np.can_cast(arr.dtype, f.np_dtype, casting="same_kind")):
                raise SampleError(f"field {name!r} of {where}: got dtype {arr.dtype}, expected {f.dtype}")
            with np.errstate(over="ignore", invalid="ignore"):  # overflow is checked just below
                cast = arr.astype(f.np_dtype)
            lost = _lost_in_cast(arr, cast, f.np_dtype)
            if lost is not None:
                flat = lost.reshape(1 if n is None else n, -1).any(axis=1)
                row = int(np.flatnonzero(flat)[0])
                value = arr.reshape(flat.size, -1)[row][lost.reshape(flat.size, -1)[row]][0].item()
                raise SampleError(f"field {name!r} of sample {keys(row)!r}: {value!r} does not fit in "
                                 f"{f.np_dtype} (it would be stored as something else); widen the field "
                                 "or fix the value")
            arr = cast
        return np.ascontiguousarray(arr).reshape(want if n is not None else (1, *f.shape))

    def _check_labels(self, labels: np.ndarray, keys) -> None:
        labels = labels.reshape(-1)
        top = len(self.class_names) if self.class_names is not None else None
        bad = labels < 0 if top is None else (labels < 0) | (labels >= top)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            limit = f"0..{top - 1} (one per class name)" if top is not None else "0 or more"
            raise SampleError(f"field {self.label!r} of sample {keys(i)!r}: class id {int(labels[i])} is not "
                              f"a valid label; class ids are {limit}")

    def _encoded(self, name: str, f: Field, value: Any, key: str) -> bytes:
        if f.kind == "string":
            if not isinstance(value, str):
                raise SampleError(f"field {name!r} of sample {key!r}: expected str, got {type(value).__name__}")
            return value
        if isinstance(value, np.ndarray) and value.dtype == np.uint8 and value.ndim == 1:
            value = value.tobytes()
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise SampleError(f"field {name!r} of sample {key!r}: expected bytes, got {type(value).__name__}")
        return bytes(value)

    def write(self, sample: Mapping[str, Any], key: str | None = None,
              image_sizes: Mapping[str, tuple[int, int]] | None = None) -> None:
        """Append one sample: a dict with a value for every field.

        ``image_sizes`` may give (width, height) of image fields already known to the caller
        (convert reads them while validating); otherwise they are read from the header."""
        self._check_open()
        key = str(self.num_samples) if key is None else str(key)
        missing = [n for n in self.fields if n not in sample]
        if missing:
            raise SampleError(f"sample {key!r} lacks field(s) {missing}; fields are {list(self.fields)}")
        extra = [n for n in sample if n not in self.fields]
        if extra:
            raise SampleError(f"sample {key!r} has unknown field(s) {extra}; fields are {list(self.fields)}")
        row: dict[str, Any] = {}
        sizes: dict[str, tuple[int, int]] = {}
        nbytes = 0
        for name, f in self.fields.items():
            v = sample[name]
            if f.fixed:
                row[name] = self._fixed_rows(name, f, v, None, lambda _: key)
                if name == self.label:
                    self._check_labels(row[name], lambda _: key)
                nbytes += f.row_nbytes
            else:
                b = self._encoded(name, f, v, key)
                if f.kind == "image" and image_sizes and name in image_sizes:
                    sizes[name] = tuple(int(x) for x in image_sizes[name])
                elif f.kind == "image":
                    try:
                        sizes[name] = image_size(b)
                    except Exception as e:
                        raise SampleError(f"field {name!r} of sample {key!r} is not a readable image: {e}") from None
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
        self._keys.append(key)
        self._rows += 1
        self._bytes += nbytes

    def write_batch(self, batch: Mapping[str, Any], keys: Sequence[str] | None = None) -> None:
        """Append many samples at once: a dict of arrays (fixed fields) or sequences."""
        self._check_open()
        if set(batch) != set(self.fields):
            raise ValueError(f"batch fields {sorted(batch)} differ from the dataset's {sorted(self.fields)}")
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

        fixed = {name: self._fixed_rows(name, f, batch[name], n, key_of)
                 for name, f in self.fields.items() if f.fixed}
        if self.label is not None:
            self._check_labels(fixed[self.label], key_of)
        row_bytes = sum(f.row_nbytes for f in self.fields.values() if f.fixed)
        if all(f.fixed for f in self.fields.values()):
            # Split the batch at shard boundaries without per-sample Python work.
            start = 0
            while start < n:
                room = (self.shard_size - self._bytes) // max(row_bytes, 1)
                if room <= 0 and self._rows:
                    self._flush()
                    continue
                stop = min(n, start + max(1, room))
                for name, arr in fixed.items():
                    self._cols[name].append(arr[start:stop])
                if keys is None:
                    self._keys.extend(map(str, range(base + start, base + stop)))
                else:
                    self._keys.extend(map(str, keys[start:stop]))
                self._rows += stop - start
                self._bytes += (stop - start) * row_bytes
                start = stop
            return
        for i in range(n):
            self.write({name: (fixed[name][i] if name in fixed else batch[name][i]) for name in self.fields},
                       key=str(base + i) if keys is None else keys[i])

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
            else:
                arrays.append(pa.array(chunks, type=f.arrow_type()))
                if f.kind == "image":
                    wh = np.asarray(self._sizes[name], dtype=np.int32).reshape(-1, 2)
                    arrays += [pa.array(wh[:, 0]), pa.array(wh[:, 1])]
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
        final = self.dir / shard_name(index)
        tmp = self.dir / ("." + final.name + ".tmp")
        with open(tmp, "wb") as raw:
            hf = _HashingFile(raw)
            sink = pa.PythonFile(hf, mode="w")
            with pa.ipc.new_file(sink, self.schema) as w:
                w.write_batch(batch)
            sink.close() if not sink.closed else None
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, final)
        self._shards.append({
            "file": final.name,
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
            "format_version": FORMAT_VERSION,
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
        write_json_atomic(self.dir / MANIFEST, m)
        if self.dir != self.path:
            self._swap_in()
        self._closed = True
        return m

    def _swap_in(self) -> None:
        """Replace the old dataset in ``path`` by the complete new one in the staging dir."""
        staging = self.dir
        # From here the staging directory may become the only copy: never delete it again.
        self._cleanup.detach()
        self._swapping = True
        _remove_own(self.path, keep=[staging.name])
        for e in sorted(os.listdir(staging)):
            if e != MANIFEST:
                os.rename(staging / e, self.path / e)
        _fsync_dir(self.path)
        os.rename(staging / MANIFEST, self.path / MANIFEST)  # the new dataset opens from here on
        _fsync_dir(self.path)
        os.rmdir(staging)
        self._swapping = False
        self.dir = self.path

    def abort(self) -> None:
        """Delete everything this writer wrote; the directory does not open as a dataset."""
        self._closed = True
        if self.dir != self.path:  # a staging directory of our own
            if self._swapping:  # the old dataset is gone already: keep the new one for recovery
                logger.error("fastload: replacing %s failed midway; the complete new dataset is in %s",
                             self.path, self.dir)
                return
            shutil.rmtree(self.dir, ignore_errors=True)
            self._cleanup.detach()
            return
        if self.path.is_dir():  # another writer's staging directory is not ours to remove
            _remove_own(self.path, keep=[SKIPPED_REPORT], staging=False)

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._closed:
            try:
                self.close()
            except BaseException:
                self.abort()
                raise


def _lost_in_cast(src: np.ndarray, cast: np.ndarray, dtype: np.dtype) -> np.ndarray | None:
    """Mask of the values of ``src`` that ``cast`` (``src`` cast to ``dtype``) does not hold."""
    if np.issubdtype(dtype, np.integer) and np.issubdtype(src.dtype, np.integer):
        info = np.iinfo(dtype)
        lost = (src < info.min) | (src > info.max)
    elif np.issubdtype(dtype, np.inexact) and src.dtype.kind in "iu":
        with np.errstate(invalid="ignore", over="ignore"):  # integers must survive exactly
            lost = ~np.isfinite(cast) | (cast.astype(src.dtype) != src)
    elif np.issubdtype(dtype, np.inexact) and src.dtype.kind in "fc":
        lost = np.isfinite(src) & ~np.isfinite(cast)  # overflow to inf (rounding is expected)
    else:
        return None
    return lost if lost.any() else None


def write_report(path: Path, records: Iterable[Mapping[str, Any]]) -> int:
    """Write the skipped-sample report (JSON lines) atomically; return the count."""
    records = list(records)
    tmp = path.with_name("." + path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(dict(r)) + "\n")
    os.replace(tmp, path)
    return len(records)

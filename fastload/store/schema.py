"""The manifest's schema: ``manifest.json`` checked once, on open, key by key.

``validate_manifest(m, where)`` either returns the parsed fields or raises
:class:`~fastload.errors.FormatError` naming the key at fault (``shards[3].num_samples``,
``fields['image'].kind``, ``label.counts``) and what it must be, so a damaged or hand-edited
manifest is refused with one clear line by ``Dataset``, ``Loader``, ``inspect`` and ``verify``
instead of a traceback, and nothing downstream needs to re-check types.

What a field description may be is :meth:`Field.from_json`'s business (``format.py``): a new
field kind is added there (and in ``Field.arrow_type``), and this schema follows. The other
keys are described by the small table-driven checks below.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Mapping

from ..errors import FormatError
from .format import CHECKSUM_ALGO, FORMAT_NAME, KEY_COLUMN, READABLE_VERSIONS, SHARD_FILE_RE, Field, format_version_for

__all__ = ["CHECKSUM_RE", "validate_manifest"]

CHECKSUM_RE = re.compile(rf"{re.escape(CHECKSUM_ALGO)}:[0-9a-f]{{32}}")
_SHARD_FILE = re.compile(SHARD_FILE_RE)
INT64_MAX = 2**63 - 1  # counts and sizes are int64 everywhere downstream (numpy, Arrow, C++)
MAX_SHARD_BYTES = 2**48  # 256 TiB: no shard fastload writes comes near; larger is damage


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class _Checker:
    def __init__(self, where: str):
        self.where = where

    def fail(self, key: str, msg: str) -> None:
        raise FormatError(f"{self.where}: {key} {msg}; the manifest is damaged (convert the source "
                          "again, or restore manifest.json)")

    def int_at_least(self, key: str, v: Any, lo: int, hi: int = INT64_MAX) -> int:
        if not _is_int(v) or v < lo or v > hi:
            self.fail(key, f"must be an integer >= {lo} and <= {hi:,}, not {_show(v)}")
        return v

    def typed(self, key: str, v: Any, typ: type, what: str) -> Any:
        if not isinstance(v, typ):
            self.fail(key, f"must be {what}, not {_show(v)}")
        return v


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def validate_manifest(m: Any, where: str | Path) -> dict[str, Field]:
    """Check every key of a parsed manifest; return its fields (in column order)."""
    c = _Checker(str(where))
    if not isinstance(m, dict) or m.get("format") != FORMAT_NAME:
        raise FormatError(f"{where} is not a fastload manifest (no \"format\": \"{FORMAT_NAME}\")")
    v = m.get("format_version")
    if not _is_int(v) or v not in READABLE_VERSIONS:  # 1.0 and True are not versions
        raise FormatError(f"{where} has format_version {v!r}; this fastload reads versions "
                          f"{', '.join(map(str, READABLE_VERSIONS))}. Convert the source again with this version"
                          " (or upgrade fastload, if a newer one wrote it).")
    for k in ("fields", "shards", "num_samples"):
        if k not in m:
            c.fail(k, "is missing")
    num_samples = c.int_at_least("num_samples", m["num_samples"], 0)

    fields_json = c.typed("fields", m["fields"], dict, "an object {name: field description}")
    if not fields_json:
        c.fail("fields", "must name at least one field")
    fields: dict[str, Field] = {}
    for name, d in fields_json.items():
        if not name:
            c.fail("fields", "holds a field with an empty name")
        try:
            fields[name] = Field.from_json(d)
        except (ValueError, TypeError) as e:
            c.fail(f"fields[{name!r}]", f"is not a valid field description ({e})")
    need = format_version_for(fields)
    if v < need:
        what = "video or audio" if need == 3 else "ragged"
        c.fail("format_version", f"is {v}, which cannot hold {what} fields (version {need} or later)")

    shards = c.typed("shards", m["shards"], list, "a list of shard entries")
    seen: set[str] = set()
    total = 0
    total_bytes = 0
    for i, s in enumerate(shards):
        key = f"shards[{i}]"
        c.typed(key, s, dict, 'an object {"file", "num_samples", "bytes", "checksum"}')
        for k in ("file", "num_samples", "bytes", "checksum"):
            if k not in s:
                c.fail(f"{key}.{k}", "is missing")
        f = s["file"]
        if not isinstance(f, str) or not _SHARD_FILE.fullmatch(f):
            c.fail(f"{key}.file", f"must be a plain shard file name like 'shard-00000.arrow' inside the "
                                  f"dataset directory, not {_show(f)}")
        if f in seen:
            c.fail(f"{key}.file", f"names {f!r} a second time")
        seen.add(f)
        rows = c.int_at_least(f"{key}.num_samples", s["num_samples"], 0)
        size = c.int_at_least(f"{key}.bytes", s["bytes"], 1, MAX_SHARD_BYTES)
        if rows > size:  # every row of every field kind takes at least one byte
            c.fail(f"{key}.num_samples", f"is {rows:,}, more rows than the shard's {size:,} bytes can hold")
        total += rows
        total_bytes += size
        if total > INT64_MAX or total_bytes > INT64_MAX:
            c.fail(f"{key}", f"brings the shards' total past {INT64_MAX:,} "
                             f"{'samples' if total > INT64_MAX else 'bytes'}")
        if not isinstance(s["checksum"], str) or not CHECKSUM_RE.fullmatch(s["checksum"]):
            c.fail(f"{key}.checksum", f"must be '{CHECKSUM_ALGO}:' and 32 hex digits, not {_show(s['checksum'])}")
    if total != num_samples:
        c.fail("num_samples", f"is {num_samples}, but the shards hold {total} samples")

    for key, check in _OPTIONAL.items():
        if key in m:
            check(c, m[key], total_bytes=total_bytes, num_samples=num_samples, fields=fields)
    return fields


def _total_bytes(c: _Checker, v: Any, *, total_bytes: int, **_) -> None:
    if c.int_at_least("total_bytes", v, 0) != total_bytes:
        c.fail("total_bytes", f"is {v}, but the shards' bytes add up to {total_bytes}")


def _key_column(c: _Checker, v: Any, **_) -> None:
    if v != KEY_COLUMN:
        c.fail("key_column", f"must be {KEY_COLUMN!r}, not {_show(v)}")


def _checksum_algorithm(c: _Checker, v: Any, **_) -> None:
    if v != CHECKSUM_ALGO:
        c.fail("checksum_algorithm", f"must be {CHECKSUM_ALGO!r}, not {_show(v)}")


def _metadata(c: _Checker, v: Any, **_) -> None:
    c.typed("metadata", v, dict, "an object")


def _label(c: _Checker, v: Any, *, num_samples: int, fields: Mapping[str, Field], **_) -> None:
    if v is None:
        return
    c.typed("label", v, dict, 'an object {"field", "class_names", "counts"} or null')
    name = v.get("field")
    f = fields.get(name) if isinstance(name, str) else None
    if f is None or f.kind != "scalar" or f.np_dtype.kind not in "iu":
        c.fail("label.field", f"must name an integer scalar field, not {_show(name)}")
    names = v.get("class_names")
    if names is not None and (not isinstance(names, list) or not all(isinstance(n, str) for n in names)):
        c.fail("label.class_names", f"must be a list of strings or null, not {_show(names)}")
    if names is not None and len(set(names)) != len(names):
        dup = next(n for i, n in enumerate(names) if n in names[:i])
        c.fail("label.class_names", f"names {dup!r} twice; each class has one name")
    counts = v.get("counts")
    if not isinstance(counts, list) or not all(_is_int(n) and 0 <= n <= num_samples for n in counts):
        c.fail("label.counts", f"must be a list of integers >= 0 and <= num_samples, not {_show(counts)}")
    if names is not None and len(counts) != len(names):
        c.fail("label.counts", f"has {len(counts)} entries for {len(names)} class names")
    if sum(counts) != num_samples:
        c.fail("label.counts", f"add up to {sum(counts)}, not num_samples={num_samples}")


_OPTIONAL: dict[str, Callable[..., None]] = {
    "total_bytes": _total_bytes, "key_column": _key_column, "checksum_algorithm": _checksum_algorithm,
    "metadata": _metadata, "label": _label,
}

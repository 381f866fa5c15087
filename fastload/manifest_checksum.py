"""The checksum a manifest carries of its own content (``"manifest_checksum"``).

A shard's checksum protects the shard; this key protects the manifest itself, so a flipped
byte in a class name, a field's shape or a shard's size is caught when the dataset opens
(``Dataset``, ``Loader``, a remote dataset's fetched manifest) and by ``fastload verify``,
instead of being read as the truth.

The checksum is ``"xxh3_128:<32 hex digits>"`` of the manifest's *content*: every key but
``manifest_checksum`` itself, in the order they appear, serialised as compact ASCII JSON
(``json.dumps(body, separators=(",", ":"), ensure_ascii=True)``). It hashes the parsed
values, not the file's bytes, so indentation and escapes may change (an object store's copy,
a pretty-printer) while any change of a value, a key or the order of keys (the order of
``fields`` is the column order) is caught.

Compatibility: the format version does not change. A manifest without the key (written
before it existed) still opens; readers that predate the key ignore it (unknown top-level
keys are ignored by every fastload reader). Every writer of ``manifest.json`` writes it
through :func:`manifest_bytes` (or :func:`sealed`), so the key is always present and
current.

This module imports nothing of fastload's but the errors: the store and the remote package
(which sits below the store) both use it.
"""
from __future__ import annotations

import json
import re
from typing import Any, Mapping

import xxhash

from .errors import FormatError

__all__ = ["KEY", "check", "checksum_of", "manifest_bytes", "sealed"]

KEY = "manifest_checksum"
_ALGO = "xxh3_128"
_FORMAT = re.compile(rf"{_ALGO}:[0-9a-f]{{32}}")


def checksum_of(m: Mapping[str, Any]) -> str:
    """``"xxh3_128:<hex>"`` of the manifest's content (every key but :data:`KEY`)."""
    body = {k: v for k, v in m.items() if k != KEY}
    text = json.dumps(body, separators=(",", ":"), ensure_ascii=True, allow_nan=True)
    return f"{_ALGO}:{xxhash.xxh3_128_hexdigest(text.encode('ascii'))}"


def sealed(m: Mapping[str, Any]) -> dict:
    """A copy of ``m`` with its current checksum under :data:`KEY` (the last key); an old
    value of the key is replaced, so a manifest built from another one (a merged or renamed
    copy) is sealed afresh."""
    out = {k: v for k, v in m.items() if k != KEY}
    out[KEY] = checksum_of(out)
    return out


def manifest_bytes(m: Mapping[str, Any]) -> bytes:
    """The bytes of ``manifest.json`` for ``m``: sealed, indented JSON and a newline. Every
    writer of a manifest writes these (local directories, object stores, mirrors)."""
    return (json.dumps(sealed(m), indent=1) + "\n").encode("utf-8")


def check(m: Mapping[str, Any], where: Any) -> None:
    """Raise FormatError naming ``where`` when the manifest's checksum is malformed or does
    not match its content. A manifest without the key passes (written before it existed),
    unless it holds a key one character away from :data:`KEY` (the key itself damaged)."""
    if KEY not in m:
        near = [k for k in m if isinstance(k, str) and len(k) == len(KEY)
                and sum(a != b for a, b in zip(k, KEY)) == 1]
        if near:
            raise FormatError(f"{where}: holds the key {near[0]!r} where {KEY!r} belongs: the manifest is "
                              "damaged. Restore manifest.json from a copy, or convert the source again")
        return
    recorded = m[KEY]
    if not isinstance(recorded, str) or not _FORMAT.fullmatch(recorded):
        raise FormatError(f"{where}: {KEY} must be '{_ALGO}:' and 32 hex digits, not {str(recorded)[:60]!r}: "
                          "the manifest is damaged. Restore manifest.json from a copy, or convert the source again")
    actual = checksum_of(m)
    if actual != recorded:
        raise FormatError(
            f"{where}: the manifest's content does not match its {KEY} (recorded {recorded}, content hashes to "
            f"{actual}): manifest.json was damaged or edited after it was written, so its shard list, fields or "
            "class names cannot be trusted. Restore manifest.json from a copy, or convert the source again "
            f"(after an edit made on purpose, delete the {KEY!r} key to accept it)")

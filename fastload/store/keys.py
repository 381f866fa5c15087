"""Sample keys from source names (file paths, tar member names): any name becomes one line of
valid UTF-8, and two different names never become the same key.

Names that are printable ASCII without a backslash stay as they are (the common case). In
the others, a backslash becomes ``\\\\``; a byte that is not UTF-8 (carried by ``os.fsdecode``
as a lone surrogate) ``\\xNN`` (NN >= 80); a newline, return or tab ``\\n``, ``\\r``, ``\\t``;
another ASCII control character ``\\xNN`` (NN < 80); a C1 control character, a line or
paragraph separator or a lone surrogate ``\\uNNNN``. Every escape starts with a backslash and
every backslash of the name is doubled, so the key reads back to exactly one name
(:func:`unescape_key`). Other characters (accents, CJK, emoji) are kept as they are.
"""
from __future__ import annotations

import os
import re

__all__ = ["escape_key", "unescape_key"]

_SPECIAL = re.compile(r"[\\\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")
_NAMED = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(m: re.Match) -> str:
    ch = m.group()
    if ch in _NAMED:
        return _NAMED[ch]
    c = ord(ch)
    if 0xDC80 <= c <= 0xDCFF:  # an undecodable byte, as os.fsdecode carries it
        return f"\\x{c - 0xDC00:02x}"
    if c < 0x80:
        return f"\\x{c:02x}"
    return f"\\u{c:04x}"


def escape_key(name: str | bytes | os.PathLike) -> str:
    """The key of a sample named ``name`` (a str from ``os.fsdecode``, or raw bytes)."""
    if isinstance(name, os.PathLike):
        name = os.fspath(name)
    if isinstance(name, bytes):
        name = name.decode("utf-8", "surrogateescape")
    if name.isascii() and name.isprintable() and "\\" not in name:
        return name
    return _SPECIAL.sub(_escape, name)


_UNESCAPE = re.compile(r"\\(\\|n|r|t|x[0-9a-f]{2}|u[0-9a-f]{4})")


def unescape_key(key: str) -> str:
    """The name a key was made from (undecodable bytes as lone surrogates: ``os.fsencode``
    gives the bytes back)."""
    def one(m: re.Match) -> str:
        e = m.group(1)
        if e in ("\\", "n", "r", "t"):
            return {"\\": "\\", "n": "\n", "r": "\r", "t": "\t"}[e]
        c = int(e[1:], 16)
        return chr(0xDC00 + c) if e[0] == "x" and c >= 0x80 else chr(c)
    return _UNESCAPE.sub(one, key)

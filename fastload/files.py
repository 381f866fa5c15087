"""Reading files safely: only regular files, never more than a cap, names printable.

Every file fastload reads on a user's behalf (source images, tables, arrays, tar shards,
manifests) goes through here, so a FIFO among the sources cannot block a conversion, a
symlink to ``/dev/zero`` cannot run it out of memory, and a directory in place of a file is
named as such. ``open()`` uses ``O_NONBLOCK`` (opening a FIFO for reading would otherwise wait
for a writer) and the type is checked with ``fstat`` on the opened descriptor (no race with a
rename between the check and the read). Shards are mapped by ``fastload._C.map_file`` under
the same rule.

``printable(name)`` turns any file name (undecodable bytes carried as surrogates by
``os.fsdecode``, newlines, control characters) into one line of valid UTF-8, so keys, reports
and error messages can always be written and read.
"""
from __future__ import annotations

import os
import re
import stat
from typing import Any

__all__ = ["MAX_SAMPLE_BYTES", "NotRegularFile", "check_regular", "open_regular", "printable", "read_regular"]

# A single sample file larger than this is refused: a shard's binary column holds at most
# 2 GiB (32-bit offsets), and a 1 GiB image is far beyond any decoder's max_pixels.
MAX_SAMPLE_BYTES = 1 << 30


class NotRegularFile(ValueError):
    """A path that is not a regular file (or is too large); the message names it, ``detail``
    says what is wrong without the name ("is a FIFO (named pipe), not a regular file; ...")."""

    def __init__(self, what: str, path, detail: str):
        super().__init__(f"{what} {printable(os.fspath(path))} {detail}")
        self.detail = detail


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _check(st: os.stat_result, path, what: str, max_bytes: int | None) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularFile(what, path, f"is {_kind(st.st_mode)}, not a regular file; fastload reads only "
                                         "regular files")
    if max_bytes is not None and st.st_size > max_bytes:
        raise NotRegularFile(what, path, f"holds {st.st_size:,} bytes, more than the limit of {max_bytes:,}")


def check_regular(path: str | os.PathLike, *, what: str = "file", max_bytes: int | None = None) -> os.stat_result:
    """``os.stat(path)`` (following symlinks) if it is a regular file of at most ``max_bytes``
    bytes; else :class:`NotRegularFile` naming it. For paths handed to libraries that open
    them themselves (pyarrow, numpy, tarfile)."""
    st = os.stat(path)
    _check(st, path, what, max_bytes)
    return st


def open_regular(path: str | os.PathLike, *, what: str = "file", max_bytes: int | None = None) -> int:
    """A read-only descriptor of ``path`` if it is a regular file of at most ``max_bytes``
    bytes (the caller closes it). Never blocks on a FIFO."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    try:
        _check(os.fstat(fd), path, what, max_bytes)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


_SAMPLE_CAP = object()


def read_regular(path: str | os.PathLike, *, what: str = "file", max_bytes: Any = _SAMPLE_CAP) -> bytes:
    """The whole content of a regular file of at most ``max_bytes`` bytes (default
    ``MAX_SAMPLE_BYTES``; None: no cap; see :func:`open_regular`); a file that grows past the
    cap while being read is refused too."""
    if max_bytes is _SAMPLE_CAP:
        max_bytes = MAX_SAMPLE_BYTES
    fd = open_regular(path, what=what, max_bytes=max_bytes)
    with os.fdopen(fd, "rb", closefd=True) as f:
        data = f.read() if max_bytes is None else f.read(max_bytes + 1)
    if max_bytes is not None and len(data) > max_bytes:
        raise NotRegularFile(what, path, f"grew past the limit of {max_bytes:,} bytes while being read")
    return data


_CONTROL = re.compile(r"[\x00-\x1f\x7f\x80-\x9f\u2028\u2029]")


def printable(name: str | bytes | os.PathLike) -> str:
    """``name`` as one line of valid UTF-8: bytes that are not UTF-8 (carried as surrogates
    by ``os.fsdecode``) become ``\\xNN``, control characters (newline, tab, ...) ``\\n``,
    ``\\t`` or ``\\xNN``. Names that are already printable come back unchanged."""
    if isinstance(name, os.PathLike):
        name = os.fspath(name)
    if isinstance(name, bytes):
        raw = name
    else:
        if name.isprintable() and name.isascii():
            return name  # the common case, fast
        try:
            raw = name.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # lone surrogates that are not escaped bytes
            raw = name.encode("utf-8", "backslashreplace")
    text = raw.decode("utf-8", "backslashreplace")
    return _CONTROL.sub(lambda m: {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(m.group(), repr(m.group())[1:-1]),
                        text)

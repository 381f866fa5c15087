"""Reading files safely (only regular files, never more than a cap, names printable) and writing
them atomically.

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

Writing files atomically: every file fastload writes whole (a shard, a manifest, a journal,
a report, a plan, a cache entry, a ``--json`` output) goes through :func:`atomic_write` /
:func:`atomic_file`, the one rule: written under a temporary name in the same directory
(:func:`temp_path`: ``.NAME.PID.THREAD.tmp``, unique per writer, so ranks and threads writing
the same file never share one), flushed, fsynced (``fsync=True``), renamed over ``path``, and
the directory fsynced (``fsync=True``) so that the rename survives a power cut. If anything
fails the temporary file is removed and ``path`` keeps its old content (or stays absent): a
reader never sees half a file. ``fsync=False`` is for caches, where a write lost in a crash
is only redone.
"""
from __future__ import annotations

import contextlib
import os
import re
import stat
import threading
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

__all__ = ["MAX_SAMPLE_BYTES", "NotRegularFile", "atomic_file", "atomic_write", "check_regular", "fsync_dir",
           "open_regular", "printable", "read_regular", "temp_path", "temp_pattern"]

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


# -- writing files atomically --------------------------------------------------------------
def temp_path(path: str | os.PathLike) -> Path:
    """The temporary name :func:`atomic_file` writes ``path`` under: ``.NAME.PID.THREAD.tmp``
    beside it (same directory, so the rename is atomic; unique per process and thread)."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")


def temp_pattern(name_pattern: str) -> str:
    """A regular expression matching the temporary names of files named ``name_pattern`` (a
    regular expression): this module's ``.NAME.PID.THREAD.tmp``, and the ``.NAME.tmp`` that
    fastload wrote before, so leftovers of either are recognised as fastload's own."""
    return rf"\.(?:{name_pattern})(?:\.[0-9]+\.[0-9]+)?\.tmp"


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the renames in directory ``path`` durable (where the platform allows it)."""
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


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, *, fsync: bool = True) -> Iterator[BinaryIO]:
    """A binary file to write ``path``'s new content into; when the block ends without an
    exception it is flushed, fsynced (``fsync``), renamed over ``path`` and the directory
    fsynced (``fsync``). On any exception (Ctrl-C included) the temporary file is removed and
    ``path`` is untouched. See the module docstring."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if fsync:
        fsync_dir(path.parent)


def atomic_write(path: str | os.PathLike, data: bytes | str | Callable[[BinaryIO], Any], *,
                 fsync: bool = True) -> None:
    """Write ``path`` atomically (see :func:`atomic_file`): ``data`` is its whole content
    (``str`` is written as UTF-8), or a callable that writes it into the binary file it is
    given (``lambda f: np.save(f, v)``)."""
    with atomic_file(path, fsync=fsync) as f:
        if callable(data):
            data(f)
        else:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)

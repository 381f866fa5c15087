"""Keep the decoders' own error lines off the terminal while fastload reports them itself.

DALI's image decoders (nvImageCodec, libjpeg-turbo, libpng) print to the process's standard
error from C++ — ``[ERROR] [jpeg_parser] Invalid marker`` in colour, ``libpng error: Not enough
image data`` — once per failing run, and fastload runs a failing batch several times to find
the bad sample (bisection). With ``on_error="skip"`` that was half a dozen coloured lines per
bad image per epoch, on top of fastload's own report (``stats()["replaced_samples"]`` and one
log line per sample). DALI has no switch for these (its log level stops at "error").

:func:`decoder_output_captured` redirects file descriptor 2 into an anonymous in-memory file
for the duration of a pipeline run (reference-counted, so concurrent runs in several feeder
threads share one redirection); at the end of every run it passes on everything that is not a
decoder message, in order, and the last run restores the descriptor. Decoder messages are kept
(``captured_messages()``, ``messages_since()``): the runner adds them to the reason it reports
for a refused image. Anything another thread writes to standard error meanwhile is delayed by
at most one run, never lost.
"""
from __future__ import annotations

import collections
import contextlib
import os
import re
import sys
import threading
from typing import Iterator

__all__ = ["captured_messages", "decoder_output_captured", "messages_since"]

# Lines the decoders print (ANSI colour codes allowed around the tag).
_DECODER_LINE = re.compile(
    rb"^(?:\x1b\[[0-9;]*m)?\[(?:ERROR|WARNING|WARN|INFO)\]|^libpng (?:error|warning)|^libjpeg|"
    rb"^(?:Corrupt|Premature end of) JPEG|^\[(?:jpeg|png|tiff|webp|jpeg2k|nvjpeg|opencv)[a-z_]*\]|^OpenJPEG|^TIFF"
)

_lock = threading.Lock()
_depth = 0
_saved_fd: int | None = None
_capture_fd: int | None = None
_messages: collections.deque = collections.deque(maxlen=200)
_count = 0  # decoder messages captured so far
_offset = 0  # bytes of the capture already sorted
_partial = b""  # an unfinished line


def captured_messages() -> list[str]:
    """The last decoder messages kept off the terminal (at most 200)."""
    return [m.decode("utf-8", "replace") for m in _messages]


def _enter() -> None:
    global _depth, _saved_fd, _capture_fd
    with _lock:
        _depth += 1
        if _depth > 1:
            return
        try:
            sys.stderr.flush()
        except Exception:  # pragma: no cover - a closed or replaced stderr
            pass
        fd = saved = None
        try:
            try:
                fd = os.memfd_create("fastload-decoder-stderr", getattr(os, "MFD_CLOEXEC", 0))
            except (AttributeError, OSError):
                import tempfile

                with tempfile.TemporaryFile() as t:
                    fd = os.dup(t.fileno())
            saved = os.dup(2)
            os.dup2(fd, 2)
        except BaseException:
            _depth -= 1
            for f in (fd, saved):
                if f is not None:
                    os.close(f)
            raise
        _saved_fd, _capture_fd = saved, fd


def _drain(final: bool) -> None:
    """Sort what was written to the capture since the last drain: decoder lines are kept,
    everything else goes on to the real standard error now. Called with ``_lock`` held."""
    global _offset, _partial, _count
    fd, out_fd = _capture_fd, _saved_fd
    if fd is None or out_fd is None:  # pragma: no cover
        return
    size = os.fstat(fd).st_size
    data = _partial + (os.pread(fd, size - _offset, _offset) if size > _offset else b"")
    _offset = max(size, _offset)
    lines = data.splitlines(keepends=True)
    _partial = b""
    if lines and not lines[-1].endswith(b"\n") and not final:
        _partial = lines.pop()  # the rest of this line is still to come
    keep = []
    for line in lines:
        if _DECODER_LINE.match(line):
            _messages.append(line.rstrip())
            _count += 1
        else:
            keep.append(line)
    out = b"".join(keep)
    while out:
        try:
            n = os.write(out_fd, out)
        except OSError:  # pragma: no cover - stderr gone
            return
        out = out[n:]


def _exit() -> None:
    global _depth, _saved_fd, _capture_fd, _offset, _partial
    with _lock:
        _depth -= 1
        try:
            sys.stderr.flush()
        except Exception:  # pragma: no cover
            pass
        _drain(final=_depth == 0)
        if _depth > 0:
            return
        saved, fd = _saved_fd, _capture_fd
        _saved_fd = _capture_fd = None
        _offset, _partial = 0, b""
        if saved is not None:
            os.dup2(saved, 2)
            os.close(saved)
        if fd is not None:
            os.close(fd)


def messages_since(count: int) -> tuple[int, list[str]]:
    """``(now, messages)``: the decoder messages captured after the moment ``count`` was read
    (``messages_since(0)[0]`` is the current count)."""
    with _lock:
        now = _count
        n = min(now - count, len(_messages))
        recent = list(_messages)[len(_messages) - n:] if n > 0 else []
    return now, [m.decode("utf-8", "replace") for m in recent]


def _after_fork_in_child() -> None:
    """A child forked while a parent thread had standard error captured: give the child its
    real standard error back and a fresh lock (the parent's may have been held)."""
    global _lock, _depth, _saved_fd, _capture_fd, _offset, _partial
    _lock = threading.Lock()
    if _depth > 0 and _saved_fd is not None:
        try:
            os.dup2(_saved_fd, 2)
            os.close(_saved_fd)
            if _capture_fd is not None:
                os.close(_capture_fd)
        except OSError:  # pragma: no cover
            pass
    _depth, _saved_fd, _capture_fd, _offset, _partial = 0, None, None, 0, b""


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def decoder_output_captured() -> Iterator[None]:
    """Standard error captured while the block runs (see the module docstring). A no-op in
    a process whose fd 2 cannot be redirected."""
    try:
        _enter()
    except OSError:  # pragma: no cover - no fd 2 to redirect
        yield
        return
    try:
        yield
    finally:
        _exit()

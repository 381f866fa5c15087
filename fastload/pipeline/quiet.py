"""Keep the decoders' own error lines off the terminal while fastload reports them itself.

DALI's image decoders (nvImageCodec, libjpeg-turbo, libpng) print to the process's standard
error from C++ — ``[ERROR] [jpeg_parser] Invalid marker`` in colour, ``libpng error: Not enough
image data``, libjpeg's unprefixed ``Bogus Huffman table definition`` — once per failing run,
and fastload runs a failing batch several times to find the bad sample (bisection). With
``on_error="skip"`` that was half a dozen lines per bad image per epoch, on top of fastload's
own report (``stats()["replaced_samples"]`` and one log line per sample). DALI has no switch
for these (its log level stops at "error").

:func:`decoder_output_captured` redirects file descriptor 2 into an anonymous in-memory file
for the duration of a pipeline run (reference-counted, so concurrent runs in several feeder
threads share one redirection). Everything that reaches descriptor 2 meanwhile is taken for
the decoders' output: no list of message patterns can be complete (libjpeg alone has over a
hundred messages without a common prefix). Python's own writes do not go there: the standard
error stream objects (``sys.stderr``, ``sys.__stderr__``, when they write to descriptor 2) have
their ``write`` pointed at the real standard error for the duration, so a ``print``, a
``logging`` handler or a progress bar that holds the stream object shows at once, as always.
Decoder messages are kept (``captured_messages()``, ``messages_since()``): the runner adds
them to the reason it reports for a refused image. Native code other than the decoders that
writes to descriptor 2 during a captured run is kept with them, not shown; so the runner
captures only runs that can fail, and only where that costs little: on the CPU every run of a
dataset written without DALI's check, and the search for a bad sample. On a GPU only that
search: a GPU feeder runs DALI most of the time, and capturing each run would hold back other
libraries' native messages (CUDA's, c10's) for most of the job; a bad image then prints the
decoder's own line once, on the first, failing run. A dataset ``fastload convert`` checked
with DALI (its manifest says ``images_checked``) decodes with descriptor 2 untouched.
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

_ANSI = re.compile(rb"\x1b\[[0-9;]*m")  # colour codes around DALI's tags

_lock = threading.Lock()
_depth = 0
_saved_fd: int | None = None
_capture_fd: int | None = None
_messages: collections.deque = collections.deque(maxlen=200)
_count = 0  # decoder messages captured so far
_offset = 0  # bytes of the capture already sorted
_partial = b""  # an unfinished line
_patched: list = []  # the stream objects whose write goes to the real standard error meanwhile


def captured_messages() -> list[str]:
    """The last decoder messages kept off the terminal (at most 200)."""
    return [m.decode("utf-8", "replace") for m in _messages]


def _enter(token: list) -> None:
    """Start (or join) the capture; ``token`` gets an entry once this caller counts in it, so
    that an interrupt (Ctrl-C runs Python code between any two steps) never leaves descriptor
    2 captured: the caller exits the capture exactly when it holds a token."""
    global _depth, _saved_fd, _capture_fd
    with _lock:
        _depth += 1
        token.append(True)
        if _depth > 1:
            return
        fd = saved = None
        redirected = False
        try:
            try:
                sys.stderr.flush()
            except Exception:  # pragma: no cover - a closed or replaced stderr
                pass
            try:
                fd = os.memfd_create("fastload-decoder-stderr", getattr(os, "MFD_CLOEXEC", 0))
            except (AttributeError, OSError):
                import tempfile

                with tempfile.TemporaryFile() as t:
                    fd = os.dup(t.fileno())
            saved = os.dup(2)
            os.dup2(fd, 2)
            redirected = True
            _saved_fd, _capture_fd = saved, fd
            _bypass_python(saved)
        except BaseException:
            if redirected:
                os.dup2(saved, 2)
            _restore_python()
            _saved_fd = _capture_fd = None
            _depth -= 1
            token.clear()
            for f in (fd, saved):
                if f is not None:
                    os.close(f)
            raise


def _bypass_python(fd: int) -> None:
    """Point the ``write`` of Python's standard error objects that write to descriptor 2 at
    ``fd`` (the real standard error), so Python's output never enters the capture."""
    seen = set()
    for stream in (sys.stderr, sys.__stderr__):
        if stream is None or id(stream) in seen:
            continue
        seen.add(id(stream))
        try:
            if stream.fileno() != 2:
                continue
            stream.flush()
            stream.write = _writer(stream, fd)
        except Exception:  # not a real file (a test's capture), or an object without attributes
            continue
        _patched.append(stream)


def _writer(stream, fd: int):
    encoding = getattr(stream, "encoding", None) or "utf-8"
    errors = getattr(stream, "errors", None) or "backslashreplace"

    def write(text: str) -> int:
        data = text.encode(encoding, errors)
        while data:
            data = data[os.write(fd, data):]
        return len(text)
    return write


def _restore_python() -> None:
    while _patched:
        stream = _patched.pop()
        try:
            del stream.write
        except AttributeError:  # pragma: no cover - someone restored it already
            pass


def _drain(final: bool) -> None:
    """Keep what the decoders wrote to the capture since the last drain, line by line (an
    unfinished line waits for the rest, unless ``final``). Called with ``_lock`` held."""
    global _offset, _partial, _count
    fd = _capture_fd
    if fd is None:  # pragma: no cover
        return
    size = os.fstat(fd).st_size
    data = _partial + (os.pread(fd, size - _offset, _offset) if size > _offset else b"")
    _offset = max(size, _offset)
    lines = data.splitlines(keepends=True)
    _partial = b""
    if lines and not lines[-1].endswith(b"\n") and not final:
        _partial = lines.pop()  # the rest of this line is still to come
    for line in lines:
        text = _ANSI.sub(b"", line).strip()
        if text:
            _messages.append(text)
            _count += 1


def _exit() -> None:
    global _depth, _saved_fd, _capture_fd, _offset, _partial
    with _lock:
        _depth -= 1
        if _depth > 0:
            _drain(final=False)
            return
        saved, fd = _saved_fd, _capture_fd
        try:
            if saved is not None:
                os.dup2(saved, 2)  # first: nothing more enters the capture
            _drain(final=True)
        finally:
            _restore_python()
            _saved_fd = _capture_fd = None
            _offset, _partial = 0, b""
            for f in (saved, fd):
                if f is not None:
                    os.close(f)


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
    _restore_python()
    _depth, _saved_fd, _capture_fd, _offset, _partial = 0, None, None, 0, b""


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def decoder_output_captured() -> Iterator[None]:
    """Standard error captured while the block runs (see the module docstring). A no-op in
    a process whose fd 2 cannot be redirected."""
    token: list = []
    try:
        try:
            _enter(token)
        except OSError:  # pragma: no cover - no fd 2 to redirect
            pass
        yield
    finally:
        if token:
            _exit()

"""What a conversion read from its source, and whether the source still is that.

The state of a source file is its size and modification time in nanoseconds (``None`` when it
is missing). A conversion records the state of every file it reads, taken before reading and
checked again afterwards; the plan of a distributed conversion (plan.py) records the files
that number the samples (the table, the ``.npy`` files, the ``.tar`` shards; an image
folder's listing), and each finished group's record (task.py) the state of the files that
group read. From those:

* a file that changes while it is being converted fails that conversion (or that group),
  naming the file: nothing is written from it;
* ``--resume`` **refuses** a source whose listing or numbering changed (files added or
  removed, a table / array / tar file rewritten), naming the files: the finished groups would
  not fit it; the user reruns with ``--overwrite``. A file changed in place (an image
  rewritten, e.g. a bad one fixed) **reconverts** the finished groups that read it: the
  others are reused, and the run says which files and groups;
* the commit checks the source once more: a file changed after its group read it (while
  the run went on) fails the commit, so a dataset that opens never mixes two states of
  its source.

Limits: a rewrite that keeps both the size and the modification time (to the filesystem's
resolution; ``touch -r`` or ``rsync -t`` can do it on purpose) is not seen.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Sequence

import numpy as np

from ..files import printable
from ..errors import ConvertError

SHOWN = 5  # files named per kind of change in a message
_PARALLEL_FROM = 4096  # stat this many files or more on threads (a network filesystem answers slowly)
_THREADS = 16


class SourceChanged(ConvertError):
    """The source of a conversion changed under it (see the module docstring)."""


def stat_file(path: str | os.PathLike) -> tuple[int, int] | None:
    """(size, modification time in ns) of ``path`` (links followed), None when it is missing
    or cannot be seen."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return None
    except OSError:  # (e.g. ENAMETOOLONG, ELOOP): a file we could not read either
        return None
    return int(st.st_size), int(st.st_mtime_ns)


def stat_files(paths: Sequence[str]) -> np.ndarray:
    """States of ``paths`` as an (n, 2) int64 array of (size, mtime_ns); (-1, -1) where missing."""
    n = len(paths)
    out = np.full((n, 2), -1, dtype=np.int64)

    def fill(lo: int, hi: int) -> None:
        for i in range(lo, hi):
            s = stat_file(paths[i])
            if s is not None:
                out[i] = s

    if n < _PARALLEL_FROM:
        fill(0, n)
    else:  # os.stat releases the GIL
        step = 1024
        with ThreadPoolExecutor(max_workers=_THREADS, thread_name_prefix="fastload-stat") as pool:
            list(pool.map(lambda lo: fill(lo, min(n, lo + step)), range(0, n, step)))
    return out


def as_records(paths: Sequence[str], states: np.ndarray) -> list[list]:
    """``[[path, size, mtime_ns], ...]`` (size and mtime None for a missing file): JSON."""
    return [[str(p), None, None] if s[0] < 0 else [str(p), int(s[0]), int(s[1])] for p, s in zip(paths, states)]


def from_records(records: Iterable[Sequence]) -> tuple[list[str], np.ndarray]:
    """The inverse of :func:`as_records`."""
    recs = list(records)
    states = np.array([[-1, -1] if r[1] is None else [r[1], r[2]] for r in recs], dtype=np.int64).reshape(-1, 2)
    return [str(r[0]) for r in recs], states


def changed_since(records: Iterable[Sequence]) -> list[str]:
    """The paths among recorded ``[path, size, mtime_ns]`` whose state is not that any more."""
    paths, then = from_records(records)
    if not paths:
        return []
    now = stat_files(paths)
    return [paths[i] for i in np.flatnonzero((now != then).any(axis=1))]


def differing(paths: Sequence[str], a: np.ndarray, b: np.ndarray) -> list[str]:
    """The paths whose states differ between ``a`` and ``b`` (same order as ``paths``)."""
    return [paths[i] for i in np.flatnonzero((a != b).any(axis=1))] if len(paths) else []


def shown(paths: Sequence[str], root: str | os.PathLike | None = None, limit: int = SHOWN) -> str:
    """Up to ``limit`` paths (relative to ``root`` when inside it), printable, then "…"."""
    base = os.fspath(root).rstrip(os.sep) + os.sep if root is not None else None
    names = []
    for p in list(paths)[:limit]:
        p = os.fspath(p)
        names.append(printable(p[len(base):] if base and p.startswith(base) else p))
    return ", ".join(names) + (", …" if len(paths) > limit else "")


def describe(root: str | os.PathLike | None, *, changed: Sequence[str] = (), added: Sequence[str] = (),
             removed: Sequence[str] = ()) -> str:
    """"2 changed (a.jpg, b.jpg); 1 added (c.jpg)": what differs, naming up to SHOWN files each."""
    parts = []
    for what, paths in (("changed", changed), ("added", added), ("removed", removed)):
        if paths:
            parts.append(f"{len(paths)} file(s) {what} ({shown(paths, root)})")
    return "; ".join(parts)

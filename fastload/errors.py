"""Every public exception of fastload, under one base: ``except fastload.FastloadError``.

Each class also derives from the built-in type callers caught before it existed
(``FormatError`` is a ``ValueError``, ``DecodeError`` a ``RuntimeError``, ...), so existing
``except ValueError`` code keeps working. Messages name the file, shard, sample or argument
at fault and what to do about it.
"""
from __future__ import annotations

import errno
import numbers
import os
import re
import shutil
from collections.abc import Sequence

__all__ = ["BadSamples", "CacheTooSmall", "ChecksumMismatch", "ConvertError", "DecodeError", "DownloadError",
           "DownloadTimeout", "FastloadError", "FormatError", "HostUnreachable", "MissingFileError", "NoSpaceError", "PassEnded",
           "RemoteError", "SampleError", "ShardReadError", "TransformError", "UsageError"]


class FastloadError(Exception):
    """Base of every exception fastload raises on purpose."""


class FormatError(FastloadError, ValueError):
    """A dataset directory, manifest or shard does not follow the fastload format."""


class ShardReadError(FormatError, OSError):
    """Reading a memory-mapped shard raised SIGBUS: its file was truncated while in use, or its
    storage failed (a bad sector, a network file system that went away). Raised by the read
    that needed it (the batch, the hash) instead of the process dying; the message names the
    shard, its file (``path``) and what to do. Both a :class:`FormatError` and an ``OSError``
    (``errno`` EIO)."""


class SampleError(FastloadError, ValueError):
    """One sample cannot be written (wrong shape, dtype, range, missing field, bad image);
    nothing of it was buffered, so the writer can go on with the next sample."""


class MissingFileError(FastloadError, FileNotFoundError):
    """A file a dataset's manifest lists is gone (deleted, or the dataset was replaced since it
    was opened); the message names it."""


class ConvertError(FastloadError):
    """A source cannot be converted; the message names the file or sample and the cause."""


class DecodeError(FastloadError, RuntimeError):
    """An image could not be decoded (or was refused); names shard, row and source key."""


class TransformError(FastloadError, RuntimeError):
    """A Loader's ``batch_transform`` / ``device_transform`` raised (or returned something
    that is not a dict of tensors); names the batch's stream position and sample indices,
    with the transform's own exception as ``__cause__``."""


class PassEnded(FastloadError, RuntimeError):
    """``next()`` on a Loader's pass that ended before its data ran out: the Loader was
    closed, ``set_epoch`` / ``load_state_dict`` / a new ``iter(loader)`` ended it, or an
    earlier ``next()`` raised. The message says which; an epoch never ends quietly early."""


class UsageError(FastloadError, ValueError):
    """A bad command-line argument or option value: printed as one line by the CLI
    (exit status ``code``: 1 for a failed check, 2 for bad usage)."""

    def __init__(self, msg: str, code: int = 1):
        super().__init__(msg)
        self.code = code


class BadSamples(FastloadError):
    """Samples of one batch that a decoder refused: ``positions`` within the batch and a
    ``reasons`` string for each. Raised by a pipeline runner; the loader turns it into a
    :class:`DecodeError` naming the samples, or replaces them (``on_error="skip"``)."""

    def __init__(self, positions: Sequence[int], reasons: Sequence[str]):
        self.positions = [int(p) for p in positions]
        self.reasons = list(reasons)
        super().__init__("; ".join(f"position {p}: {r}" for p, r in zip(self.positions, self.reasons)))


NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class NoSpaceError(FastloadError, OSError):
    """The destination's filesystem is full (ENOSPC) or a quota is exhausted (EDQUOT) while
    writing a dataset. One line: the destination, the bytes needed, the bytes free. What was
    written of the new dataset is deleted (nothing that opens is left behind)."""

    def __init__(self, dst: str | os.PathLike, *, needed: int, written: int, detail: str = ""):
        super().__init__(errno.ENOSPC, "no space left on device")
        self.dst = os.fspath(dst)
        self.needed = int(needed)
        self.written = int(written)
        self.detail = detail

    def __str__(self) -> str:
        try:
            free = shutil.disk_usage(self.dst if os.path.isdir(self.dst) else os.path.dirname(self.dst) or ".").free
            has = f"; its filesystem has {format_bytes(free)} free"
        except OSError:
            has = ""
        at = f" (while writing {self.detail}, after {format_bytes(self.written)})" if self.detail else ""
        return (f"no space left on the device of {self.dst}{at}: the dataset needs about {format_bytes(self.needed)}"
                f"{has}. Nothing of it was kept; free space or choose another destination")


# -- byte counts: the one formatter and the one parser ---------------------------------------
# Here, at the bottom of the layers, because every layer names sizes in its messages
# (NoSpaceError above, cache limits, memory checks, inspect, doctor).
def format_bytes(n: float, *, binary: bool = False) -> str:
    """A byte count for a message: decimal units, as ``--shard-size`` and ``cache_limit`` take
    them (``"812 B"``, ``"1.5 KB"``, ``"3.0 GB"``); with ``binary``, powers of 1024 as
    ``ulimit`` and ``df -h`` count (``"64 KiB"``, ``"1.5 GiB"``, a whole number without ``.0``)."""
    base, units = (1024, ("B", "KiB", "MiB", "GiB", "TiB")) if binary else (1000, ("B", "KB", "MB", "GB", "TB"))
    for unit in units:
        if abs(n) < base or unit == units[-1]:
            break
        n /= base
    if unit == "B":
        return f"{n:.0f} B"
    text = f"{n:.1f} {unit}"
    return text.replace(".0 ", " ") if binary else text


_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)\s*$", re.I)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_bytes(value: object, what: str = "size", *, maximum: int | None = None, maximum_text: str | None = None) -> int:
    """A byte count from ``'256MB'``, ``'1.5GiB'``, ``'4096'`` or an int (decimal kB/MB/GB/TB,
    binary KiB/MiB/GiB/TiB), > 0 and at most ``maximum``; ValueError naming ``what``
    otherwise. The one parser of sizes (``shard_size``, ``cache_limit``, ...)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        n = int(value)
    else:
        m = _SIZE_RE.match(value) if isinstance(value, str) else None  # 1.5 (a float) is no byte count
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{what}={value!r} is not a size; use e.g. 256MB, 1.5GiB or a byte count")
        x = float(m.group(1)) * _UNITS[m.group(2).lower()]
        if x != int(x):
            raise ValueError(f"{what}={value!r} is not a whole number of bytes")
        n = int(x)
    if maximum is not None and not 0 < n <= maximum:
        raise ValueError(f"{what}={value!r} must be between 1 byte and {maximum_text or format_bytes(maximum)}")
    if n <= 0:
        raise ValueError(f"{what}={value!r} must be a positive size")
    return n



class RemoteError(FastloadError, OSError):
    """A remote dataset (``s3://``, ``gs://``, ``az://``, ``https://``) cannot be read: a bad
    URL, a missing object, refused credentials. The message names the URL (never a secret)."""


class DownloadError(RemoteError):
    """A shard could not be brought into the node-local cache after every retry; names the
    shard, its URL, the attempts made and the last cause."""

    def __init__(self, msg: str, *, shard: str | None = None, url: str | None = None):
        super().__init__(msg)
        self.shard = shard
        self.url = url

    def __reduce__(self):  # keep the message through multiprocessing / pickling of errors
        return (_rebuild_download_error, (type(self), str(self), self.shard, self.url))


def _rebuild_download_error(cls, msg, shard, url):
    return cls(msg, shard=shard, url=url)


class ChecksumMismatch(DownloadError):
    """A downloaded shard's xxh3-128 differs from the manifest's, again after re-downloading:
    the remote object changed (or is damaged) since the manifest was written. ``expected``
    and ``actual`` hold both checksums."""

    def __init__(self, msg: str, *, shard: str | None = None, url: str | None = None,
                 expected: str | None = None, actual: str | None = None):
        super().__init__(msg, shard=shard, url=url)
        self.expected = expected
        self.actual = actual

    def __reduce__(self):
        return (_rebuild_checksum_mismatch, (str(self), self.shard, self.url, self.expected, self.actual))


def _rebuild_checksum_mismatch(msg, shard, url, expected, actual):
    return ChecksumMismatch(msg, shard=shard, url=url, expected=expected, actual=actual)


class DownloadTimeout(DownloadError, TimeoutError):
    """A shard was not in the cache by its deadline (``download_timeout``); names the shard."""


class CacheTooSmall(FastloadError, ValueError):
    """``cache_limit`` cannot hold the shards the chosen order needs at the same time; the
    message names the minimum and ``shuffle_mode="window"`` (which needs far fewer)."""

    def __init__(self, msg: str, *, minimum: int | None = None):
        super().__init__(msg)
        self.minimum = minimum


class HostUnreachable(RemoteError):
    """The server of a remote dataset cannot be reached at all: its host name does not resolve
    or it refuses connections. Not retried (retrying cannot fix a wrong endpoint); raised at
    once, naming the URL and what to check (the endpoint, the network)."""

    def __init__(self, msg: str, *, url: str | None = None):
        super().__init__(msg)
        self.url = url

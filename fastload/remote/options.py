"""How a remote dataset is opened: one frozen value, checked once.

    opts = RemoteOptions(cache_dir="/nvme/cache", cache_limit="200GB", download_timeout=120)
    ds = fastload.Dataset("s3://bucket/ds", remote=opts)
    mix = fastload.Mixture(["s3://b/web", "s3://b/books"], [0.7, 0.3], epoch_size=10**6, remote=opts)

Every remote setting a user gives (to :class:`fastload.Dataset`, :class:`fastload.Mixture`,
the Loader, :func:`fastload.remote.open_cache` or :class:`~fastload.remote.cache.ShardCache`)
becomes one :class:`RemoteOptions` at the top of that call (:meth:`RemoteOptions.from_keywords`
also takes the old separate keywords) and travels as that value; nothing below parses a
setting again (``cache_limit`` is bytes from here on).

Adding a setting: a field here (with its check in :meth:`RemoteOptions.__post_init__`), the
code that uses it, and the docstrings of the public signatures (Dataset, Mixture, Loader).
"""
from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import parse_bytes

__all__ = ["REMOTE_KEYWORDS", "RemoteOptions"]


@dataclasses.dataclass(frozen=True, repr=False)
class RemoteOptions:
    """How the datasets given as URLs (``s3://``, ``gs://``, ``az://``, ``https://``) are opened.

    Args:
        cache_dir: the node-local shard cache's root (default ``$FASTLOAD_CACHE``, else
            ``~/.cache/fastload``); a ``Path`` once checked.
        cache_limit: byte budget of the shards on disk (an int or ``'200GB'``; bytes once
            checked); default: the whole dataset when it fits in 80% of the free disk, else
            80% of the free disk. A mixture's is the budget of all its URLs together.
        filesystem: a ``pyarrow.fs.FileSystem`` (or a function returning one) for the URL.
        storage_options: the filesystem's options (endpoint, region, ...; ``headers`` and
            ``timeout`` for http(s)). Credentials go in the environment, never here if the
            dataset is to be pickled for spawned workers.
        download_timeout: seconds a shard may take (its deadline, default 600); also bounds
            the manifest's read.
        download_threads: downloads in flight at most (default 4).

    A setting left ``None`` takes its default where it is used. Bad values raise ValueError
    naming the argument, when the value is made (before any request).
    """

    cache_dir: Path | None = None
    cache_limit: int | None = None
    filesystem: Any = dataclasses.field(default=None, hash=False)
    storage_options: Mapping[str, Any] | None = dataclasses.field(default=None, hash=False)
    download_timeout: float | None = None
    download_threads: int | None = None

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        if self.cache_dir is not None:
            if not isinstance(self.cache_dir, (str, os.PathLike)):
                raise ValueError(f"cache_dir={self.cache_dir!r} must be a directory path (str or os.PathLike)")
            put("cache_dir", Path(self.cache_dir).expanduser())
        if self.cache_limit is not None:
            put("cache_limit", parse_bytes(self.cache_limit, "cache_limit"))
        if self.storage_options is not None:
            if not isinstance(self.storage_options, Mapping):
                raise ValueError(f"storage_options must be a dict of the filesystem's options, got "
                                 f"{type(self.storage_options).__name__}")
            put("storage_options", dict(self.storage_options))  # a copy: the caller's dict may change
        t = self.download_timeout
        if t is not None:
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < math.inf:
                raise ValueError(f"download_timeout={t!r} must be a number of seconds > 0")
            put("download_timeout", float(t))
        if self.download_threads is not None:
            from ..validate import check_int

            put("download_threads", check_int("download_threads", self.download_threads, min=1))

    @classmethod
    def from_keywords(cls, remote: RemoteOptions | None = None, **keywords: Any) -> RemoteOptions:
        """One RemoteOptions from ``remote=`` or from the separate keywords (``cache_dir=``,
        ``cache_limit=``, ...; ``None`` means not given), never both; checked here."""
        unknown = sorted(set(keywords) - set(REMOTE_KEYWORDS))
        if unknown:
            raise TypeError(f"unknown remote setting(s) {unknown}; the settings are {list(REMOTE_KEYWORDS)}")
        given = {k: v for k, v in keywords.items() if v is not None}
        if remote is None:
            return cls(**given)
        if not isinstance(remote, RemoteOptions):
            raise ValueError(f"remote= must be a fastload.remote.RemoteOptions, got {type(remote).__name__}")
        if given:
            raise ValueError(f"pass the remote settings either as remote=RemoteOptions(...) or as keywords, not "
                             f"both (got remote= and {', '.join(sorted(given))}=)")
        return remote

    def __repr__(self) -> str:
        """The settings that are set; the values of secret-looking storage options hidden."""
        from .privacy import is_secret_name

        parts = []
        for name in self.given():
            v = getattr(self, name)
            if name == "storage_options":
                v = {k: ("***" if is_secret_name(k) else x) for k, x in v.items()}
            parts.append(f"{name}={v!r}")
        return f"RemoteOptions({', '.join(parts)})"

    def given(self) -> list[str]:
        """The names of the settings that are set (not ``None``), in field order."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None]

    def replace(self, **changes: Any) -> RemoteOptions:
        """A copy with ``changes`` (checked like the original)."""
        return dataclasses.replace(self, **changes)

    def retry_policy(self):
        """The :class:`~fastload.remote.pacing.RetryPolicy` these settings give: the default
        one, with ``download_timeout`` as its per-file deadline when set."""
        from .pacing import RetryPolicy

        return RetryPolicy() if self.download_timeout is None else RetryPolicy(timeout_s=self.download_timeout)


REMOTE_KEYWORDS = tuple(f.name for f in dataclasses.fields(RemoteOptions))

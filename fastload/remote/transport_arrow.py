"""Object stores through ``pyarrow.fs``: ``s3://``, ``gs://``/``gcs://``, ``az://``,
``abfs[s]://`` (see :mod:`fastload.remote.url`), or any ``filesystem=`` the user gives.

The filesystem is built from the URL, ``storage_options`` and the usual credential chains
(``AWS_ENDPOINT_URL`` honoured), with pyarrow's request retries on. It is built again to
reload expired credentials (:meth:`ArrowTransport.rebuild`) and, lazily, in a process forked
from the one that built it (the AWS SDK's client state belongs to the parent).
"""
from __future__ import annotations

import os
import threading
import urllib.parse
from typing import Any, Callable, Mapping

from ..errors import HostUnreachable, RemoteError
from .privacy import picklable_filesystem, safe_options
from .url import (_S3_QUERY_OK, REMOTE_SCHEMES, FaultKind, Transport, _refuse_secrets, classify, display_url,
                  scheme_of, unreachable_message)

__all__ = ["ArrowTransport", "arrow_filesystem"]


def _endpoint_from_env() -> tuple[str, str] | None:
    for var in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        v = os.environ.get(var, "").strip()
        if v:
            p = urllib.parse.urlsplit(v if "://" in v else f"https://{v}")
            return p.netloc, p.scheme or "https"
    return None


def _truthy(v: Any) -> bool:
    return v if isinstance(v, bool) else str(v).strip().lower() in ("1", "true", "yes", "on")


def arrow_filesystem(url: str, options: Mapping[str, Any]):
    """(filesystem, base path inside it) for an object-store URL."""
    import pyarrow.fs as pafs

    scheme = scheme_of(url)
    p = urllib.parse.urlsplit(url)
    opts = dict(options)
    if scheme == "s3":
        _refuse_secrets(url, _S3_QUERY_OK)
        for k, v in urllib.parse.parse_qsl(p.query):
            opts.setdefault(k, _truthy(v) if k.startswith("allow_") else v)
        if "endpoint_override" not in opts:
            env = _endpoint_from_env()
            if env is not None:
                opts["endpoint_override"], scheme_env = env
                opts.setdefault("scheme", scheme_env)
        if "region" not in opts:
            region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
            if region:
                opts["region"] = region
            elif "endpoint_override" in opts:
                opts["region"] = "us-east-1"  # S3-compatible servers; avoids a region lookup
        retries = int(opts.pop("max_attempts", 5))
        if opts.pop("_first_contact", False):  # one request, no client retries: see ArrowTransport._contact
            opts["retry_strategy"] = pafs.AwsStandardS3RetryStrategy(max_attempts=1)
        opts.setdefault("retry_strategy", pafs.AwsStandardS3RetryStrategy(max_attempts=retries))
        opts.setdefault("connect_timeout", 10)
        fs = pafs.S3FileSystem(**opts)
        return fs, (p.netloc + p.path).rstrip("/")
    if scheme in ("gs", "gcs"):
        _refuse_secrets(url)
        if opts:
            fs = pafs.GcsFileSystem(**opts)
        else:
            fs, _ = pafs.FileSystem.from_uri(f"gs://{p.netloc}{p.path}")
        return fs, (p.netloc + p.path).rstrip("/")
    if scheme == "az":
        _refuse_secrets(url)
        account = opts.pop("account_name", None) or os.environ.get("AZURE_STORAGE_ACCOUNT_NAME") \
            or os.environ.get("AZURE_STORAGE_ACCOUNT")
        if not account:
            raise RemoteError(f"{display_url(url)}: az:// needs the storage account: pass "
                              "storage_options={'account_name': ...} or set AZURE_STORAGE_ACCOUNT_NAME "
                              "(or use abfs://container@account.dfs.core.windows.net/path)")
        fs = pafs.AzureFileSystem(account_name=account, **opts)
        return fs, (p.netloc + p.path).rstrip("/")
    if scheme in ("abfs", "abfss"):
        _refuse_secrets(url)
        if opts:
            account = opts.pop("account_name", None) or (p.hostname or "").split(".")[0]
            fs = pafs.AzureFileSystem(account_name=account, **opts)
            container = p.username if p.username else p.path.lstrip("/").split("/")[0]
            rest = p.path if p.username else "/" + "/".join(p.path.lstrip("/").split("/")[1:])
            return fs, (container + rest).rstrip("/")
        fs, path = pafs.FileSystem.from_uri(url)
        return fs, path.rstrip("/")
    raise RemoteError(f"{display_url(url)}: unsupported scheme {scheme!r}; use one of "
                      + ", ".join(f"{s}://" for s in REMOTE_SCHEMES))


class ArrowTransport(Transport):
    """Files under ``base`` in a ``pyarrow.fs.FileSystem``."""

    ranged = True  # open_read returns a random-access file: read_at(nbytes, offset) from many threads

    def __init__(self, url: str, *, filesystem: Any = None, storage_options: Mapping[str, Any] | None = None):
        self.url = display_url(url)
        self._given_url = url  # checked: no user info, only non-secret query parameters
        self._given_fs = filesystem
        self._options = dict(storage_options or {})
        self._lock = threading.Lock()
        self._generation = 0
        self._pid = os.getpid()
        # How to build the filesystem again (reloading credentials); None: a user's instance.
        self._rebuild_fn: Callable[[], tuple[Any, str]] | None = None
        # Until a first request succeeds, requests go through a client without its own retries
        # (s3:// built here): a host that does not resolve or refuses connections fails in
        # milliseconds (HostUnreachable), not after the client's backoff (seconds per request)
        self.reached = False
        self._quick_fn: Callable[[], Any] | None = None
        self._quick_fs = None
        if filesystem is None:
            self._rebuild_fn = lambda: arrow_filesystem(url, self._options)
            if scheme_of(url) == "s3":
                self._quick_fn = lambda: arrow_filesystem(url, {**self._options, "_first_contact": True})[0]
            self._fs, self._base = self._rebuild_fn()
            return
        import pyarrow.fs as pafs

        p = urllib.parse.urlsplit(url)
        base = (p.netloc + p.path).rstrip("/") if p.scheme else str(url).rstrip("/")
        if callable(filesystem) and not isinstance(filesystem, pafs.FileSystem):
            factory = filesystem
            self._rebuild_fn = lambda: (_check_fs(factory()), base)
            self._fs, self._base = self._rebuild_fn()
        else:
            self._fs, self._base = _check_fs(filesystem), base

    def __repr__(self) -> str:
        return f"ArrowTransport({self.url!r})"

    def _path(self, name: str) -> str:
        return f"{self._base}/{name}" if self._base else name

    def describe(self) -> dict:
        where = self.url
        desc: dict[str, Any] = {"url": self._given_url}
        if self._options:
            desc["storage_options"] = safe_options(self._options, where)
        if self._given_fs is not None:
            desc["filesystem"] = picklable_filesystem(self._given_fs, where)
        return desc

    @property
    def filesystem(self):
        """The filesystem (built again on first use in a process forked from the one that
        built it, when fastload built it or has a factory: a client is not shared across fork)."""
        if self._pid != os.getpid():
            self._after_fork()
        return self._fs

    def _contact(self, fn: Callable[[Any], Any]):
        """``fn(filesystem)``. Until one succeeds (:attr:`reached`), through the quick client
        (see ``__init__``): a server that cannot be reached raises :class:`HostUnreachable`
        naming the URL; another transient fault of the quick client is tried again with the
        real one (its own retries)."""
        if self.reached:
            return fn(self.filesystem)
        try:
            if self._quick_fn is None:
                out = fn(self.filesystem)
                self.reached = True
                return out
            with self._lock:
                if self._quick_fs is None:
                    self._quick_fs = self._quick_fn()
                quick = self._quick_fs
            try:
                out = fn(quick)
            except OSError as e:
                if classify(e) not in (FaultKind.TRANSIENT, FaultKind.THROTTLE):
                    raise
                out = fn(self.filesystem)  # the client's own retries for what retrying can fix
            self.reached = True
            return out
        except OSError as e:
            kind = classify(e)
            if kind in (FaultKind.MISSING, FaultKind.AUTH, FaultKind.THROTTLE):
                self.reached = True  # the server answered
            elif not isinstance(e, RemoteError) and kind == FaultKind.UNREACHABLE:
                raise HostUnreachable(unreachable_message(self.url, e), url=self.url) from None
            raise

    def _after_fork(self) -> None:
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._quick_fs = None
        if self._rebuild_fn is not None:
            self._fs, self._base = self._rebuild_fn()

    def open_read(self, name: str, offset: int = 0):
        f = self._contact(lambda fs: fs.open_input_file(self._path(name)))
        if offset:
            f.seek(offset)
        return f, offset

    def open_ranged(self, name: str):
        return self._contact(lambda fs: fs.open_input_file(self._path(name)))  # one HEAD; read_at: one ranged GET

    def read_bytes(self, name: str) -> bytes:
        def read(fs):
            with fs.open_input_stream(self._path(name), compression=None) as f:
                return f.read()
        return self._contact(read)

    def write_file(self, local_path, name: str) -> None:
        fs = self.filesystem
        with open(local_path, "rb") as src, fs.open_output_stream(self._path(name), compression=None) as dst:
            while True:
                b = src.read(16 << 20)
                if not b:
                    break
                dst.write(b)

    def write_bytes(self, data: bytes, name: str) -> None:
        with self.filesystem.open_output_stream(self._path(name), compression=None) as dst:
            dst.write(data)

    def exists(self, name: str) -> bool:
        import pyarrow.fs as pafs

        return self._contact(lambda fs: fs.get_file_info(self._path(name))).type != pafs.FileType.NotFound

    def size(self, name: str) -> int | None:
        """The size of the file ``name``; None when there is no such file."""
        import pyarrow.fs as pafs

        info = self._contact(lambda fs: fs.get_file_info(self._path(name)))
        return info.size if info.type == pafs.FileType.File else None

    def delete(self, name: str) -> None:
        self.filesystem.delete_file(self._path(name))

    def delete_dir(self, name: str) -> None:
        """Delete the prefix ``name`` and everything under it."""
        self.filesystem.delete_dir(self._path(name))

    def sizes(self, prefix: str = "") -> dict[str, int]:
        """{name: size} of the files directly under the base (or under ``base/prefix``), one listing."""
        import pyarrow.fs as pafs

        sel = pafs.FileSelector(self._path(prefix) if prefix else self._base, allow_not_found=True, recursive=False)
        return {i.base_name: i.size for i in self._contact(lambda fs: fs.get_file_info(sel)) if i.type == pafs.FileType.File}

    def list_names(self) -> list[str]:
        return sorted(self.sizes())

    @property
    def generation(self) -> int:
        return self._generation

    def rebuild(self, seen_generation: int) -> bool:
        with self._lock:
            if self._generation != seen_generation:
                return True  # another thread rebuilt it meanwhile
            if self._rebuild_fn is None:
                return False
            self._fs, self._base = self._rebuild_fn()
            self._generation += 1
            return True


def _check_fs(fs):
    import pyarrow.fs as pafs

    if not isinstance(fs, pafs.FileSystem):
        raise RemoteError(f"filesystem= must be a pyarrow.fs.FileSystem (or a callable returning one), "
                          f"got {type(fs).__name__}; fsspec users wrap theirs in "
                          "pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(fs))")
    return fs

"""URL -> a transport that reads (and writes) the files of one remote dataset directory.

* ``s3://bucket/prefix``: ``pyarrow.fs.S3FileSystem`` (request retries built in; credentials
  from the usual AWS chain; ``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3`` honoured);
* ``gs://`` / ``gcs://``: ``pyarrow.fs.GcsFileSystem``;
* ``az://container/prefix`` (account from ``storage_options["account_name"]`` or
  ``AZURE_STORAGE_ACCOUNT_NAME``) and ``abfs[s]://container@account.dfs.core.windows.net/prefix``:
  ``pyarrow.fs.AzureFileSystem``;
* ``http://`` / ``https://``: the standard library, with ``Range`` requests to resume;
* ``filesystem=``: any ``pyarrow.fs.FileSystem`` (fsspec users pass
  ``pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(fs))``), or a zero-argument callable
  returning one, which is called again to reload expired credentials.

Secrets never travel in a URL: a URL with a password, a token or a secret query parameter is
refused with a message that says where credentials go instead, and every URL that fastload
prints, stores or pickles is the *display* URL (no user info, no query).
"""
from __future__ import annotations

import os
import re
import threading
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Callable, Mapping

from ..errors import RemoteError

__all__ = ["REMOTE_SCHEMES", "Transport", "ArrowTransport", "HttpTransport", "is_remote", "display_url",
           "open_transport", "FaultKind", "classify"]

REMOTE_SCHEMES = ("s3", "gs", "gcs", "az", "abfs", "abfss", "http", "https")
_SCHEME_RE = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
# Query parameters that configure a client without being secret (the rest are refused).
_S3_QUERY_OK = {"region", "endpoint_override", "scheme", "allow_bucket_creation", "allow_bucket_deletion"}
_SECRET_WORDS = ("secret", "key", "token", "password", "signature", "sig", "credential", "sas")
# A remote manifest names its shard files; they become file names in the cache directory,
# so they must be plain names (no directories, no "..", not hidden).
SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")


def scheme_of(url: str) -> str | None:
    m = _SCHEME_RE.match(url) if isinstance(url, str) else None
    return m.group(1).lower() if m else None


def is_remote(path: Any) -> bool:
    """True for a URL that fastload reads through the remote cache (``s3://``, ``gs://``,
    ``az://``, ``abfs://``, ``http(s)://``); False for local paths (and ``file://``)."""
    return isinstance(path, str) and scheme_of(path) in REMOTE_SCHEMES


def display_url(url: str) -> str:
    """The URL without user info or query string: safe to print, store and pickle."""
    p = urllib.parse.urlsplit(url)
    host = p.hostname or ""
    if p.port:
        host = f"{host}:{p.port}"
    if p.scheme.lower() in ("abfs", "abfss") and p.username and p.password is None:
        host = f"{p.username}@{host}"  # container@account: not a secret
    return urllib.parse.urlunsplit((p.scheme, host, p.path.rstrip("/"), "", ""))


def _refuse_secrets(url: str, allowed_query: set[str] | None = None) -> None:
    p = urllib.parse.urlsplit(url)
    where = display_url(url)
    if p.password is not None or (p.username is not None and p.scheme.lower() not in ("abfs", "abfss")):
        raise RemoteError(f"{where}: the URL carries user credentials; fastload never keeps secrets in URLs. "
                          "Pass them through the environment / credential files, storage_options= "
                          "(e.g. {'headers': {'Authorization': ...}} for http) or filesystem=")
    for k, _ in urllib.parse.parse_qsl(p.query, keep_blank_values=True):
        if allowed_query is not None and k in allowed_query:
            continue
        secret = any(w in k.lower() for w in _SECRET_WORDS)
        raise RemoteError(
            f"{where}: query parameter {k!r} is not accepted in a dataset URL"
            + ("; it looks like a secret, and fastload never keeps secrets in URLs" if secret else "")
            + ". Pass credentials through the environment / credential files, and options through "
              "storage_options= or filesystem=")


class FaultKind:
    """What a failed request means for the retry logic."""

    THROTTLE = "throttle"    # 503 SlowDown / 429: fewer requests in flight, then retry
    AUTH = "auth"            # expired or refused credentials: rebuild the filesystem once
    MISSING = "missing"      # the object does not exist: no point retrying (much)
    TRANSIENT = "transient"  # connection reset, truncated body, timeout, 5xx: retry (resume)


_THROTTLE_RE = re.compile(r"SLOW_DOWN|SlowDown|SERVICE_UNAVAILABLE|ServiceUnavailable|\b503\b|Service Unavailable|\b429\b|Too Many Requests|"
                          r"TooManyRequests|RequestLimitExceeded|Throttl", re.I)
_AUTH_RE = re.compile(r"EXPIRED_TOKEN|ExpiredToken|TokenRefreshRequired|RequestExpired|ACCESS_DENIED|"
                      r"AccessDenied|InvalidAccessKeyId|INVALID_ACCESS_KEY_ID|SignatureDoesNotMatch|"
                      r"SIGNATURE_DOES_NOT_MATCH|InvalidToken|\b401\b|\b403\b|Unauthenticated|"
                      r"PERMISSION_DENIED|AuthenticationFailed|AuthorizationFailure", re.I)
_MISSING_RE = re.compile(r"NoSuchKey|NO_SUCH_KEY|NoSuchBucket|NO_SUCH_BUCKET|Path does not exist|"
                         r"\b404\b|Not Found|BlobNotFound|ContainerNotFound", re.I)


def classify(exc: BaseException) -> str:
    """Map an exception from a transport to a :class:`FaultKind`."""
    if isinstance(exc, urllib.error.HTTPError):
        if exc.code in (429, 503):
            return FaultKind.THROTTLE
        if exc.code in (401, 403):
            return FaultKind.AUTH
        if exc.code in (404, 410):
            return FaultKind.MISSING
        return FaultKind.TRANSIENT
    if isinstance(exc, FileNotFoundError):
        return FaultKind.MISSING
    msg = str(exc)
    if _THROTTLE_RE.search(msg):
        return FaultKind.THROTTLE
    if _AUTH_RE.search(msg):
        return FaultKind.AUTH
    if isinstance(exc, PermissionError):
        return FaultKind.AUTH
    if _MISSING_RE.search(msg) and "NETWORK" not in msg:
        return FaultKind.MISSING
    return FaultKind.TRANSIENT


class Transport:
    """Reads the files of one remote directory. Thread-safe; no secret in its state."""

    url: str  # display URL of the directory

    def file_url(self, name: str) -> str:
        return f"{self.url}/{name}"

    def open_read(self, name: str, offset: int = 0):
        """``(stream, start)``: a readable (``read(n)``, ``close()``) positioned at ``start``,
        which is ``offset`` when the server could resume there and 0 when it could not."""
        raise NotImplementedError

    def read_bytes(self, name: str) -> bytes:
        stream, _ = self.open_read(name, 0)
        try:
            chunks = []
            while True:
                b = stream.read(1 << 20)
                if not b:
                    break
                chunks.append(bytes(b))
            return b"".join(chunks)
        finally:
            stream.close()

    def write_file(self, local_path: str | os.PathLike, name: str) -> None:
        raise RemoteError(f"{self.url}: writing is not supported over {type(self).__name__}")

    def write_bytes(self, data: bytes, name: str) -> None:
        raise RemoteError(f"{self.url}: writing is not supported over {type(self).__name__}")

    def exists(self, name: str) -> bool:
        raise NotImplementedError

    def list_names(self) -> list[str]:
        """File names directly in the directory (for `verify` and overwrite checks)."""
        raise NotImplementedError

    @property
    def generation(self) -> int:
        """Bumped by every successful :meth:`rebuild`."""
        return 0

    def rebuild(self, seen_generation: int) -> bool:
        """Build the client again (reloading credentials) unless another thread already did
        since ``seen_generation``. False when this transport cannot be rebuilt."""
        return False


# -- pyarrow.fs ------------------------------------------------------------------------------
def _endpoint_from_env() -> tuple[str, str] | None:
    for var in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        v = os.environ.get(var, "").strip()
        if v:
            p = urllib.parse.urlsplit(v if "://" in v else f"https://{v}")
            return p.netloc, p.scheme or "https"
    return None


def _truthy(v: Any) -> bool:
    return v if isinstance(v, bool) else str(v).strip().lower() in ("1", "true", "yes", "on")


def _build_arrow_fs(url: str, options: Mapping[str, Any]):
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
        self._options = dict(storage_options or {})
        self._lock = threading.Lock()
        self._generation = 0
        # How to build the filesystem again (reloading credentials); None: a user's instance.
        self._rebuild_fn: Callable[[], tuple[Any, str]] | None = None
        if filesystem is None:
            self._rebuild_fn = lambda: _build_arrow_fs(url, self._options)
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

    @property
    def filesystem(self):
        return self._fs

    def open_read(self, name: str, offset: int = 0):
        f = self._fs.open_input_file(self._path(name))
        if offset:
            f.seek(offset)
        return f, offset

    def read_bytes(self, name: str) -> bytes:
        with self._fs.open_input_stream(self._path(name), compression=None) as f:
            return f.read()

    def write_file(self, local_path, name: str) -> None:
        with open(local_path, "rb") as src, self._fs.open_output_stream(self._path(name), compression=None) as dst:
            while True:
                b = src.read(16 << 20)
                if not b:
                    break
                dst.write(b)

    def write_bytes(self, data: bytes, name: str) -> None:
        with self._fs.open_output_stream(self._path(name), compression=None) as dst:
            dst.write(data)

    def exists(self, name: str) -> bool:
        import pyarrow.fs as pafs

        return self._fs.get_file_info(self._path(name)).type != pafs.FileType.NotFound

    def delete(self, name: str) -> None:
        self._fs.delete_file(self._path(name))

    def list_names(self) -> list[str]:
        import pyarrow.fs as pafs

        sel = pafs.FileSelector(self._base, allow_not_found=True, recursive=False)
        return sorted(i.base_name for i in self._fs.get_file_info(sel) if i.type == pafs.FileType.File)

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


# -- http(s) ---------------------------------------------------------------------------------
class _HttpStream:
    def __init__(self, resp):
        self._resp = resp

    def read(self, n: int = -1) -> bytes:
        return self._resp.read(n)

    def close(self) -> None:
        self._resp.close()


class HttpTransport(Transport):
    """Files under an ``http(s)://`` URL, read with the standard library. ``headers`` (e.g.
    ``Authorization``) are sent with every request and never shown or stored."""

    def __init__(self, url: str, *, headers: Mapping[str, str] | None = None, timeout: float = 30.0):
        _refuse_secrets(url)
        self.url = display_url(url)
        self._headers = {"User-Agent": "fastload", **dict(headers or {})}
        self._timeout = float(timeout)
        # Proxies from the environment would route loopback test servers (and anything
        # the user did not ask for) through them; an explicit opener without proxies.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def __repr__(self) -> str:
        return f"HttpTransport({self.url!r})"

    def _request(self, name: str, headers: Mapping[str, str] | None = None, method: str = "GET"):
        req = urllib.request.Request(self.file_url(urllib.parse.quote(name)), method=method,
                                     headers={**self._headers, **(headers or {})})
        return self._opener.open(req, timeout=self._timeout)

    def open_read(self, name: str, offset: int = 0):
        resp = self._request(name, {"Range": f"bytes={offset}-"} if offset else None)
        start = 0
        if resp.status == 206:
            cr = resp.headers.get("Content-Range", "")
            m = re.match(r"bytes (\d+)-", cr)
            start = int(m.group(1)) if m else -1
            if start != offset:
                resp.close()
                raise OSError(f"{self.file_url(name)}: asked for bytes from {offset}, server sent "
                              f"Content-Range {cr!r}")
        elif resp.status != 200:
            resp.close()
            raise OSError(f"{self.file_url(name)}: HTTP {resp.status}")
        return _HttpStream(resp), start

    def exists(self, name: str) -> bool:
        try:
            self._request(name, method="HEAD").close()
            return True
        except urllib.error.HTTPError as e:
            if e.code in (404, 410):
                return False
            raise

    def list_names(self) -> list[str]:
        raise RemoteError(f"{self.url}: an http(s) server cannot list a directory; "
                          "fastload reads the file names from the manifest")


def open_transport(url: str, *, filesystem: Any = None, storage_options: Mapping[str, Any] | None = None) -> Transport:
    """The transport for a dataset URL (see the module docstring)."""
    if not isinstance(url, str):
        raise RemoteError(f"a remote dataset is a URL string, got {type(url).__name__}")
    scheme = scheme_of(url)
    opts = dict(storage_options or {})
    if filesystem is not None:
        if scheme in ("http", "https"):
            raise RemoteError(f"{display_url(url)}: filesystem= applies to object stores, not http(s) URLs")
        _refuse_secrets(url, _S3_QUERY_OK if scheme == "s3" else None)
        return ArrowTransport(url, filesystem=filesystem)
    if scheme in ("http", "https"):
        unknown = set(opts) - {"headers", "timeout"}
        if unknown:
            raise RemoteError(f"{display_url(url)}: storage_options {sorted(unknown)} do not apply to http(s); "
                              "use 'headers' and 'timeout'")
        return HttpTransport(url, headers=opts.get("headers"), timeout=opts.get("timeout", 30.0))
    if scheme not in REMOTE_SCHEMES:
        raise RemoteError(f"{url!r} is not a remote URL; use one of "
                          + ", ".join(f"{s}://" for s in REMOTE_SCHEMES) + " (or a local directory)")
    try:
        return ArrowTransport(url, storage_options=opts)
    except RemoteError:
        raise
    except (TypeError, ValueError, OSError) as e:  # bad option names / values, ArrowInvalid
        raise RemoteError(f"{display_url(url)}: cannot set up the {scheme}:// filesystem ({e})") from None

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

The transports: :mod:`fastload.remote.transport_arrow` (object stores, ``pyarrow.fs``) and
:mod:`fastload.remote.transport_http` (``http(s)://``), chosen by
:func:`fastload.remote.transports.open_transport`; this module has what they share (URL
checks, fault classification, the :class:`Transport` interface).
"""
from __future__ import annotations

import os
import re
import socket
import urllib.error
import urllib.parse
from typing import Any

from ..errors import HostUnreachable, RemoteError

__all__ = ["REMOTE_SCHEMES", "RangesUnsupported", "Transport", "is_remote", "display_url", "FaultKind", "classify",
           "scheme_of"]

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
    UNREACHABLE = "unreachable"  # the host does not resolve / refuses connections: fail at once


# curl (pyarrow's S3 client) and the standard library: the host name does not resolve, or
# nothing listens there (codes 6 and 7; connect *timeouts* are code 28 and stay transient)
_UNREACHABLE_RE = re.compile(r"curlCode: (6|7)\b|Could not resolve host|Couldn't resolve host|"
                             r"Could not connect to server|Couldn't connect to server|Connection refused|"
                             r"Name or service not known|nodename nor servname|No address associated with hostname|"
                             r"Temporary failure in name resolution", re.I)


def unreachable_message(where: str, exc: BaseException) -> str:
    """The one message for a server that cannot be reached (what :class:`HostUnreachable` says)."""
    detail = str(getattr(exc, "reason", None) or exc).strip().splitlines()
    detail = detail[0][:300] if detail else type(exc).__name__
    return (f"cannot reach the server of {where}: its host name does not resolve or it refuses connections "
            f"({detail}). Not retried: check the endpoint (an s3:// URL goes to AWS unless endpoint_override= "
            "in the URL or storage_options, or AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3, names another server), "
            "its host name and port, that the server runs, and the network (DNS, proxy, firewall)")


_THROTTLE_RE = re.compile(r"SLOW_DOWN|SlowDown|SERVICE_UNAVAILABLE|ServiceUnavailable|\b503\b|Service Unavailable|"
                          r"\b429\b|Too Many Requests|TooManyRequests|RequestLimitExceeded|Throttl", re.I)
_AUTH_RE = re.compile(r"EXPIRED_TOKEN|ExpiredToken|TokenRefreshRequired|RequestExpired|ACCESS_DENIED|"
                      r"AccessDenied|InvalidAccessKeyId|INVALID_ACCESS_KEY_ID|SignatureDoesNotMatch|"
                      r"SIGNATURE_DOES_NOT_MATCH|InvalidToken|\b401\b|\b403\b|Unauthenticated|"
                      r"PERMISSION_DENIED|AuthenticationFailed|AuthorizationFailure", re.I)
# RESOURCE_NOT_FOUND: how the AWS SDK reports some 404s (its message empty, S3's code not read):
# a missing object too, not a transient fault to retry 6 times
_MISSING_RE = re.compile(r"NoSuchKey|NO_SUCH_KEY|NoSuchBucket|NO_SUCH_BUCKET|RESOURCE_NOT_FOUND|Path does not exist|"
                         r"\b404\b|Not Found|BlobNotFound|ContainerNotFound", re.I)


def classify(exc: BaseException) -> str:
    """Map an exception from a transport to a :class:`FaultKind`."""
    if isinstance(exc, HostUnreachable):
        return FaultKind.UNREACHABLE
    reason = getattr(exc, "reason", None) if isinstance(exc, urllib.error.URLError) else None
    if isinstance(exc, (socket.gaierror, ConnectionRefusedError)) \
            or isinstance(reason, (socket.gaierror, ConnectionRefusedError)):
        return FaultKind.UNREACHABLE
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
    if _UNREACHABLE_RE.search(msg):
        return FaultKind.UNREACHABLE
    return FaultKind.TRANSIENT


class RangesUnsupported(RemoteError):
    """The transport, or its server, cannot read a byte range of a file."""


class Transport:
    """Reads the files of one remote directory. Thread-safe; no secret in its state."""

    url: str  # display URL of the directory
    # A request has succeeded: the endpoint is right. Until then a host that does not resolve
    # or refuses connections is a wrong endpoint (HostUnreachable, at once); after, a server
    # down for a while (retried within the deadline, like any transient fault).
    reached: bool = False

    def file_url(self, name: str) -> str:
        return f"{self.url}/{name}"

    def open_read(self, name: str, offset: int = 0):
        """``(stream, start)``: a readable (``read(n)``, ``close()``) positioned at ``start``,
        which is ``offset`` when the server could resume there and 0 when it could not."""
        raise NotImplementedError

    def open_ranged(self, name: str):
        """A random-access reader of ``name``: ``read_at(nbytes, offset) -> bytes`` (one
        ranged request each) and ``close()``. :class:`RangesUnsupported` when this transport
        or its server cannot read byte ranges."""
        raise RangesUnsupported(f"{self.url}: {type(self).__name__} does not read byte ranges")

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

    def describe(self) -> dict:
        """``open_transport(**describe())`` opens the same place in another process: no
        secret inside (RemoteError when that is impossible; see :mod:`fastload.remote.privacy`)."""
        raise RemoteError(f"{self.url}: {type(self).__name__} cannot be described for another process")

    @property
    def generation(self) -> int:
        """Bumped by every successful :meth:`rebuild`."""
        return 0

    def rebuild(self, seen_generation: int) -> bool:
        """Build the client again (reloading credentials) unless another thread already did
        since ``seen_generation``. False when this transport cannot be rebuilt."""
        return False

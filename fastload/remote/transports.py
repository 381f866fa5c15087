"""The transport for a dataset URL: :class:`~fastload.remote.transport_arrow.ArrowTransport`
for object stores (or any ``filesystem=``), :class:`~fastload.remote.transport_http.HttpTransport`
for ``http(s)://`` (see :mod:`fastload.remote.url` for the schemes and the rules on secrets)."""
from __future__ import annotations

from typing import Any, Mapping

from ..errors import RemoteError
from .transport_arrow import ArrowTransport
from .transport_http import HttpTransport
from .url import _S3_QUERY_OK, REMOTE_SCHEMES, Transport, _refuse_secrets, display_url, scheme_of

__all__ = ["ArrowTransport", "HttpTransport", "open_transport"]


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

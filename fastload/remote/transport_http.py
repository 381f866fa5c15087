"""``http(s)://`` datasets through the standard library, with ``Range`` requests to resume
(an answer of 200 to a ranged request means: start over)."""
from __future__ import annotations

import re
import socket
import urllib.error
import urllib.parse
import urllib.request
from typing import Mapping

from ..errors import RemoteError
from .privacy import is_secret_name
from .url import RangesUnsupported, Transport, _refuse_secrets, display_url

__all__ = ["HttpTransport"]


class _HttpStream:
    def __init__(self, resp):
        self._resp = resp

    def read(self, n: int = -1) -> bytes:
        return self._resp.read(n)

    def read1(self, n: int = -1) -> bytes:
        """What has arrived, up to ``n`` bytes (one receive): bytes a stalled server sent
        before it stalled reach the partial file (and a resume) instead of waiting for ``n``."""
        return self._resp.read1(n)

    def close(self) -> None:
        self._resp.close()

    def abort(self) -> None:
        """Cut the connection under a read blocked in another thread (a stalled server): the
        read returns at once. Thread-safe: only the socket is shut down; ``close()`` follows."""
        raw = getattr(getattr(self._resp, "fp", None), "raw", None)
        sock = getattr(raw, "_sock", None)  # http.client reads through sock.makefile(): SocketIO
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _HttpRanged:
    """``read_at`` over ``Range`` requests (no request until the first read)."""

    def __init__(self, transport: HttpTransport, name: str):
        self._t, self._name = transport, name

    def read_at(self, nbytes: int, offset: int) -> bytes:
        if nbytes <= 0:
            return b""
        resp = self._t._request(self._name, {"Range": f"bytes={offset}-{offset + nbytes - 1}"})
        try:
            if resp.status != 206:
                raise RangesUnsupported(f"{self._t.file_url(self._name)}: the server answered a byte-range "
                                        f"request with HTTP {resp.status}, not 206")
            m = re.match(r"bytes (\d+)-", resp.headers.get("Content-Range", ""))
            if not m or int(m.group(1)) != offset:
                raise OSError(f"{self._t.file_url(self._name)}: asked for bytes from {offset}, server sent "
                              f"Content-Range {resp.headers.get('Content-Range')!r}")
            return resp.read(nbytes)
        finally:
            resp.close()

    def close(self) -> None:
        pass


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

    def describe(self) -> dict:
        secret = sorted(k for k in self._headers if is_secret_name(k))
        if secret:
            raise RemoteError(f"fastload.Dataset({self.url}) cannot be pickled: its headers {secret} hold "
                              "credentials, and fastload never writes credentials into a pickle; start the "
                              "DataLoader workers with fork (multiprocessing_context=\"fork\"), or read a "
                              "local copy (`fastload prefetch`)")
        headers = {k: v for k, v in self._headers.items() if k != "User-Agent"}
        opts = {"timeout": self._timeout, **({"headers": headers} if headers else {})}
        return {"url": self.url, "storage_options": opts}

    def _request(self, name: str, headers: Mapping[str, str] | None = None, method: str = "GET"):
        req = urllib.request.Request(self.file_url(urllib.parse.quote(name)), method=method,
                                     headers={**self._headers, **(headers or {})})
        try:
            resp = self._opener.open(req, timeout=self._timeout)
        except urllib.error.HTTPError:
            self.reached = True  # the server answered (see Transport.reached)
            raise
        self.reached = True
        return resp

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

    def open_ranged(self, name: str):
        return _HttpRanged(self, name)

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

"""Proxies for remote-dataset tests, on 127.0.0.1 in front of a local server.

Part of :mod:`_servers` (which re-exports everything here).

* :class:`FaultProxy`: an HTTP proxy in this process (threads), injecting :class:`Fault`\\s
  per request (503 SlowDown, cut bodies, wrong bytes, expired credentials, resets, a server
  that disappears for a while) and logging every request (:class:`RequestLog`).
* :class:`DelayProxy`: a TCP delay line in a subprocess (the standalone script
  :mod:`_servers.delay`), stopped by its pid.
"""
from __future__ import annotations

import contextlib
import http.client
import http.server
import os
import re
import socket
import socketserver
import subprocess
import sys
import threading
from dataclasses import dataclass

from _servers.objstores import HOST, ProcessService, Service, free_port

__all__ = ["Fault", "RequestLog", "FaultProxy", "DelayProxy"]

# run as a script: it imports nothing of fastload (no torch in the proxy)
_DELAY_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "delay.py")


# -- fault injection -------------------------------------------------------------------------
@dataclass
class Fault:
    """One fault rule: requests whose ``method`` and path (``match``, a regex) fit, after
    ``skip`` matching requests passed untouched, get ``kind`` ``times`` times (-1: always).

    kinds: ``"slowdown"`` (503 SlowDown, S3 XML), ``"cut"`` (the body stops half way and the
    connection closes), ``"corrupt"`` (one byte of the body changed: byte ``at``, default the
    middle one, XOR ``xor``), ``"expired"`` (403
    ExpiredToken, only for requests signed with access key ``key_id``), ``"reset"`` (the
    connection closes without an answer), ``"status"`` (an answer with ``status``: S3's NoSuchKey for 404, else InternalError),
    ``"stall"`` (no answer for ``seconds``, or until :meth:`FaultProxy.release_stalls`; then
    the connection closes), ``"stall_body"`` (the headers and the first half of the body, then
    silence on the open connection for ``seconds``, or until :meth:`FaultProxy.release_stalls`;
    then the connection closes: a server that hangs mid-transfer)."""

    kind: str
    match: str = ""
    method: str = "GET"
    times: int = 1
    skip: int = 0
    key_id: str | None = None
    status: int = 500
    seconds: float = 30.0
    at: int | None = None
    xor: int = 0xFF
    seen: int = 0
    applied: int = 0

    def wants(self, method: str, path: str, auth: str) -> bool:
        if self.method and method != self.method:
            return False
        if self.match and not re.search(self.match, path):
            return False
        if self.kind == "expired" and self.key_id is not None and f"Credential={self.key_id}/" not in auth:
            return False
        self.seen += 1
        if self.seen <= self.skip:
            return False
        if self.times >= 0 and self.applied >= self.times:
            return False
        self.applied += 1
        return True


@dataclass
class RequestLog:
    method: str
    path: str
    range: str | None
    status: int
    fault: str | None
    bytes: int = 0


class _ProxyServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = False
    block_on_close = True
    allow_reuse_address = True


class FaultProxy(Service):
    """An HTTP proxy on 127.0.0.1 in front of ``upstream`` (``host:port``) that injects
    :class:`Fault`\\s. Thread-based, in this process; ``stop()`` joins every thread.

    ``log`` records every request (method, path, Range, status, fault applied)."""

    def __init__(self, upstream: str):
        self.upstream = upstream
        self.faults: list[Fault] = []
        self.log: list[RequestLog] = []
        self._lock = threading.Lock()
        self.port = 0
        self._server: _ProxyServer | None = None
        self._thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._revive: threading.Timer | None = None
        self._unstall = threading.Event()

    @property
    def endpoint(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.endpoint}"

    def add(self, kind: str, match: str = "", **kw) -> Fault:
        f = Fault(kind, match, **kw)
        with self._lock:
            self.faults.append(f)
        return f

    def clear(self) -> None:
        with self._lock:
            self.faults.clear()

    def release_stalls(self) -> None:
        """End every stalled request now (their connections close) and inject no more stalls."""
        with self._lock:
            self.faults = [f for f in self.faults if f.kind not in ("stall", "stall_body")]
        self._unstall.set()

    def requests(self, method: str = "GET", match: str = "") -> list[RequestLog]:
        with self._lock:
            return [r for r in self.log if r.method == method and re.search(match, r.path)]

    def _pick(self, method: str, path: str, auth: str) -> Fault | None:
        with self._lock:
            for f in self.faults:
                if f.wants(method, path, auth):
                    return f
        return None

    def start(self) -> FaultProxy:
        self._unstall.clear()
        if not self.port:
            self.port = free_port()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = 30  # an idle keep-alive connection does not pin a thread forever

            def setup(self):
                super().setup()
                with proxy._lock:
                    proxy._conns.add(self.connection)

            def finish(self):
                with proxy._lock:
                    proxy._conns.discard(self.connection)
                with contextlib.suppress(OSError):
                    super().finish()

            def log_message(self, *a):  # quiet
                pass

            def _handle(self):
                method = self.command
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                chunked = "chunked" in (self.headers.get("Transfer-Encoding") or "").lower()
                if chunked:  # de-chunk: forwarded with a Content-Length
                    parts = []
                    while True:
                        n = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if n == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            break
                        parts.append(self.rfile.read(n))
                        self.rfile.readline()
                    body = b"".join(parts)
                auth = self.headers.get("Authorization", "")
                fault = proxy._pick(method, self.path, auth)
                rec = RequestLog(method, self.path, self.headers.get("Range"), 0, fault.kind if fault else None)
                with proxy._lock:
                    proxy.log.append(rec)
                if fault is not None and fault.kind == "stall":
                    proxy._unstall.wait(fault.seconds)
                    self.close_connection = True
                    with contextlib.suppress(OSError):
                        self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if fault is not None and fault.kind == "reset":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if fault is not None and fault.kind in ("slowdown", "expired", "status"):
                    code, s3code, msg = {
                        "slowdown": (503, "SlowDown", "Please reduce your request rate."),
                        "expired": (403, "ExpiredToken", "The provided token has expired."),
                        # a 404 says what S3 says (NoSuchKey, which no client retries); other
                        # statuses InternalError (retried by the AWS SDK itself)
                        "status": (fault.status, *(("NoSuchKey", "The specified key does not exist.")
                                                   if fault.status == 404 else ("InternalError", "Injected error"))),
                    }[fault.kind]
                    xml = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{s3code}</Code>'
                           f"<Message>{msg}</Message><RequestId>fastload-test</RequestId></Error>").encode()
                    rec.status = code
                    self.send_response(code)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(xml)))
                    self.end_headers()
                    if method != "HEAD":
                        self.wfile.write(xml)
                    return
                host, port = proxy.upstream.rsplit(":", 1)
                conn = http.client.HTTPConnection(host, int(port), timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items()
                               if k.lower() not in ("connection", "transfer-encoding")}
                    if chunked:
                        headers["Content-Length"] = str(len(body))
                    conn.request(method, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                rec.status = resp.status
                rec.bytes = len(data)
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("connection", "transfer-encoding", "content-length", "date", "server"):
                        self.send_header(k, v)
                self.send_header("Content-Length", resp.getheader("Content-Length", "0") if method == "HEAD"
                                 else str(len(data)))
                self.end_headers()
                if method == "HEAD":
                    return
                if fault is not None and fault.kind == "cut" and len(data) > 1:
                    self.wfile.write(data[:len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    with contextlib.suppress(OSError):
                        self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if fault is not None and fault.kind == "stall_body" and len(data) > 1:
                    self.wfile.write(data[:len(data) // 2])
                    self.wfile.flush()
                    proxy._unstall.wait(fault.seconds)
                    self.close_connection = True
                    with contextlib.suppress(OSError):
                        self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if fault is not None and fault.kind == "corrupt" and data:
                    i = min(len(data) // 2 if fault.at is None else fault.at, len(data) - 1)
                    data = data[:i] + bytes([data[i] ^ fault.xor]) + data[i + 1:]
                self.wfile.write(data)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _handle

        self._server = _ProxyServer((HOST, self.port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="fastload-test-faultproxy", daemon=True)
        self._thread.start()
        return self

    def disappear(self, seconds: float) -> None:
        """Close the listening socket now (connections are refused) and listen again on the
        same port after ``seconds``, in the background."""
        self._shutdown()
        self._revive = threading.Timer(seconds, self.start)
        self._revive.name = "fastload-test-faultproxy-revive"
        self._revive.start()

    def _shutdown(self) -> None:
        self._unstall.set()
        if self._server is not None:
            self._server.shutdown()
            with self._lock:  # connections kept alive by clients: their threads end now
                for c in list(self._conns):
                    with contextlib.suppress(OSError):
                        c.shutdown(socket.SHUT_RDWR)
            self._server.server_close()  # joins the request threads (block_on_close)
            self._server = None
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def stop(self) -> None:
        if self._revive is not None:
            self._revive.cancel()
            self._revive.join()
            self._revive = None
        self._shutdown()


# -- latency ---------------------------------------------------------------------------------
class DelayProxy(ProcessService):
    """A TCP delay line in a subprocess: ``127.0.0.1:port`` -> ``upstream``, every chunk
    delivered ``delay_ms`` after it arrived (both directions); optional bandwidth cap.
    The subprocess also ends by itself after ``seconds``."""

    def __init__(self, upstream: str, delay_ms: float, *, mbps: float | None = None, seconds: float = 3600):
        self.upstream = upstream
        self.delay_ms = float(delay_ms)
        self.mbps = mbps
        self.seconds = seconds
        self.port = 0
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"{HOST}:{self.port}"

    def start(self) -> DelayProxy:
        self.port = free_port()
        args = [sys.executable, _DELAY_SCRIPT, "delay", str(self.port), self.upstream,
                str(self.delay_ms), str(self.seconds)]
        if self.mbps:
            args.append(str(self.mbps))
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        line = self.proc.stdout.readline()
        if not line.startswith(b"ready"):
            self.stop()
            raise RuntimeError(f"delay proxy did not start ({line!r})")
        return self

    def stop(self) -> None:
        out = self.proc.stdout if self.proc is not None else None
        super().stop()
        if out:
            out.close()

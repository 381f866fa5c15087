"""URLs: which are remote, what is shown, what is refused (secrets), how faults are read."""
from __future__ import annotations

import urllib.error

import pytest

from fastload.errors import FastloadError, RemoteError
from fastload.remote.transports import open_transport
from fastload.remote.url import FaultKind, classify, display_url, is_remote


def test_is_remote():
    for u in ("s3://b/ds", "gs://b/ds", "gcs://b/ds", "az://c/ds", "abfs://c@a.dfs.core.windows.net/ds",
              "https://h/ds", "HTTP://h/ds"):
        assert is_remote(u), u
    for p in ("/data/ds", "ds", "file:///data/ds", "C:/ds", None, 3):
        assert not is_remote(p), p


def test_display_url_has_no_secret():
    assert display_url("https://user:pw@host:8443/a/ds/?token=abc") == "https://host:8443/a/ds"
    assert display_url("s3://bkt/ds?region=eu-west-1&endpoint_override=127.0.0.1:9") == "s3://bkt/ds"
    assert display_url("abfs://cont@acct.dfs.core.windows.net/ds") == "abfs://cont@acct.dfs.core.windows.net/ds"


@pytest.mark.parametrize("url,word", [
    ("s3://bkt/ds?secret_key=hunter2", "secret_key"),
    ("s3://bkt/ds?access_key=AKIA&region=x", "access_key"),
    ("https://me:hunter2@host/ds", "credentials"),
    ("https://host/ds?sig=hunter2", "'sig'"),
    ("gs://bkt/ds?token=hunter2", "'token'"),
])
def test_secrets_in_urls_are_refused(url, word):
    with pytest.raises(RemoteError, match=word) as e:
        open_transport(url)
    assert "hunter2" not in str(e.value)
    assert isinstance(e.value, FastloadError)


def test_unknown_scheme_and_options():
    with pytest.raises(RemoteError, match="not a remote URL"):
        open_transport("ftp://host/ds")
    with pytest.raises(RemoteError, match="do not apply to http"):
        open_transport("https://host/ds", storage_options={"region": "x"})
    with pytest.raises(RemoteError, match="storage account"):
        open_transport("az://cont/ds", storage_options={})
    with pytest.raises(RemoteError, match="pyarrow.fs.FileSystem"):
        open_transport("s3://bkt/ds", filesystem=object())


def test_classify_faults():
    assert classify(OSError("AWS Error SLOW_DOWN during GetObject operation: Please reduce")) == FaultKind.THROTTLE
    assert classify(OSError("AWS Error UNKNOWN (HTTP status 503) during GetObject")) == FaultKind.THROTTLE
    assert classify(OSError("AWS Error ACCESS_DENIED during HeadObject operation")) == FaultKind.AUTH
    assert classify(OSError("AWS Error UNKNOWN (HTTP status 400) ExpiredToken: The provided token has expired")) \
        == FaultKind.AUTH
    assert classify(FileNotFoundError("Path does not exist 'b/ds/shard-00001.arrow'")) == FaultKind.MISSING
    assert classify(OSError("AWS Error RESOURCE_NOT_FOUND during GetObject operation: ")) == FaultKind.MISSING
    assert classify(OSError("AWS Error NETWORK_CONNECTION curlCode: 18, Transferred a partial file")) \
        == FaultKind.TRANSIENT
    assert classify(urllib.error.HTTPError("u", 503, "x", {}, None)) == FaultKind.THROTTLE
    assert classify(urllib.error.HTTPError("u", 403, "x", {}, None)) == FaultKind.AUTH
    assert classify(urllib.error.HTTPError("u", 404, "x", {}, None)) == FaultKind.MISSING
    assert classify(ConnectionResetError("reset")) == FaultKind.TRANSIENT

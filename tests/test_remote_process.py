"""A remote Dataset in other processes: forked children (DataLoader workers) read without
hanging, and pickles (spawn / forkserver workers) reopen the same place, never carrying a
secret."""
from __future__ import annotations

import os
import pickle
import select
import signal

import numpy as np
import pytest

import fastload
from _remote import BUCKET
from fastload.errors import RemoteError
from _servers import s3_filesystem, upload_dir

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def _in_child(fn, timeout: float = 30.0) -> bytes:
    """Run ``fn() -> bytes`` in a forked child; its result, or a failure naming a hang."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 1
        try:
            os.close(r)
            signal.alarm(int(timeout) + 5)
            os.write(w, fn())
            code = 0
        except BaseException as e:  # noqa: BLE001
            os.write(w, f"error {type(e).__name__}: {e}".encode()[:4000])
        finally:
            os._exit(code)
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], timeout)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"the forked child did not answer within {timeout}s (a hang)")
        out = b""
        while True:
            b = os.read(r, 65536)
            if not b:
                break
            out += b
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(r)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, out.decode(errors="replace")
    return out


def test_a_forked_child_downloads_after_the_parent_used_range_threads(remote_url, proxy, tmp_path):
    with fastload.Dataset(remote_url, cache_dir=tmp_path / "c") as ds:
        ds.cache.downloader.chunk = 8192  # shards of ~32 KB come as 8 KB ranges (the > 8 MB path)
        assert ds[0]["y"] == 0
        assert ds.cache.downloader.ranges._threads, "the parent's range threads are running"
        last = ds.num_shards - 1
        assert not ds.cache.path(last).exists()
        proxy.log.clear()
        got = _in_child(lambda: str(int(ds[len(ds) - 1]["y"])).encode())
        assert got == str(len(ds) - 1).encode()
        ranged = [r for r in proxy.requests("GET", ds.cache.names[last]) if r.range]
        assert len(ranged) >= 2, "the child fetched the shard in byte ranges"
        # the parent still works, and its cache knows nothing of the child's threads
        assert ds[len(ds) - 2]["y"] == len(ds) - 2


def test_torch_dataloader_fork_workers_read_a_url(remote_url, local_ds, tmp_path):
    import torch.utils.data as tud

    with fastload.Dataset(remote_url, cache_dir=tmp_path / "c") as ds, fastload.Dataset(local_ds) as local:
        ds.cache.downloader.chunk = 8192
        assert ds[0]["y"] == 0  # range threads started in the parent before the workers fork
        order = np.random.default_rng(0).permutation(len(ds))[:600].tolist()
        kw = dict(batch_size=50, sampler=order, num_workers=2, multiprocessing_context="fork", timeout=60,
                  collate_fn=lambda b: b)
        got = [s for batch in tud.DataLoader(ds, **kw) for s in batch]
        assert [int(s["y"]) for s in got] == order
        want = local.get_batch(order)
        assert np.array_equal(np.stack([s["x"] for s in got]), want["x"])


SECRET = "hunter2-very-secret-key"


def env_filesystem():
    """A module-level filesystem factory: pickles by name, builds from the environment."""
    return s3_filesystem(os.environ["FASTLOAD_TEST_S3_ENDPOINT"], "testing", os.environ["AWS_SECRET_ACCESS_KEY"])


def test_a_pickle_reopens_the_same_endpoint_with_the_same_settings(remote_url, proxy, tmp_path):
    with fastload.Dataset(remote_url, cache_dir=tmp_path / "c", cache_limit="10MB", download_timeout=33,
                          download_threads=2, verify="always") as ds:
        blob = pickle.dumps(ds)
    proxy.log.clear()
    with pickle.loads(blob) as again:
        assert again.cache.policy.timeout_s == 33 and again.cache.fetcher.threads == 2
        assert again.cache.limit == 10_000_000 and again.cache.root == tmp_path / "c"
        assert again.verify_policy == "always" and again[17]["y"] == 17
    assert proxy.requests("GET", "manifest.json"), "reopened through the same endpoint"
    # options outside the URL travel too (no secret among them)
    url = f"s3://{BUCKET}/ds"
    opts = {"endpoint_override": proxy.endpoint, "scheme": "http"}
    with fastload.Dataset(url, cache_dir=tmp_path / "c", storage_options=opts) as ds:
        with pickle.loads(pickle.dumps(ds)) as again:
            assert again[3]["y"] == 3


def test_secrets_are_never_pickled(remote_url, proxy, tmp_path, monkeypatch):
    import pyarrow.fs as pafs

    url = f"s3://{BUCKET}/ds"
    opts = {"endpoint_override": proxy.endpoint, "scheme": "http", "access_key": "testing", "secret_key": SECRET}
    with fastload.Dataset(url, cache_dir=tmp_path / "c", storage_options=opts) as ds:
        assert ds[1]["y"] == 1
        with pytest.raises(RemoteError, match=r"cannot be pickled.*secret_key.*environment") as e:
            pickle.dumps(ds)
        assert SECRET not in str(e.value)
    # a filesystem made with keys: refused; one whose credentials come from the environment: travels
    keyed = s3_filesystem(proxy.endpoint, "testing", SECRET)
    with fastload.Dataset(url, cache_dir=tmp_path / "c", filesystem=keyed) as ds:
        with pytest.raises(RemoteError, match=r"filesystem= was made with credentials.*secret_key"):
            pickle.dumps(ds)
    plain = pafs.S3FileSystem(endpoint_override=proxy.endpoint, scheme="http", region="us-east-1")
    with fastload.Dataset(url, cache_dir=tmp_path / "c", filesystem=plain) as ds:
        blob = pickle.dumps(ds)
        assert SECRET.encode() not in blob and b"testing" not in blob
        with pickle.loads(blob) as again:
            assert again[2]["y"] == 2
    # a factory travels by name; a lambda cannot
    monkeypatch.setenv("FASTLOAD_TEST_S3_ENDPOINT", proxy.endpoint)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    with fastload.Dataset(url, cache_dir=tmp_path / "c", filesystem=env_filesystem) as ds:
        blob = pickle.dumps(ds)
        assert SECRET.encode() not in blob
        with pickle.loads(blob) as again:
            assert again[4]["y"] == 4
    with fastload.Dataset(url, cache_dir=tmp_path / "c", filesystem=lambda: keyed) as ds:
        with pytest.raises(RemoteError, match="module-level function"):
            pickle.dumps(ds)


def test_http_headers_with_credentials_are_not_pickled():
    from fastload.remote import open_transport

    t = open_transport("http://127.0.0.1:9/ds", storage_options={"headers": {"Authorization": f"Bearer {SECRET}"}})
    with pytest.raises(RemoteError, match=r"headers \['Authorization'\]") as e:
        t.describe()
    assert SECRET not in str(e.value)
    t = open_transport("http://127.0.0.1:9/ds", storage_options={"headers": {"X-Trace": "1"}, "timeout": 5})
    assert t.describe() == {"url": "http://127.0.0.1:9/ds", "storage_options": {"timeout": 5.0,
                                                                                  "headers": {"X-Trace": "1"}}}


def test_no_secret_in_state_dict_stats_or_logs(proxy, local_ds, tmp_path, caplog, monkeypatch):
    import json
    import logging

    upload_dir(s3_filesystem(proxy.upstream, "testing", "testing"), local_ds, f"{BUCKET}/ds")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    opts = {"endpoint_override": proxy.endpoint, "scheme": "http", "access_key": "testing", "secret_key": SECRET}
    proxy.add("slowdown", "shard-00002", times=2)
    proxy.add("cut", "shard-00003", times=1)
    with caplog.at_level(logging.DEBUG):
        with fastload.Dataset(f"s3://{BUCKET}/ds", cache_dir=tmp_path / "c", storage_options=opts) as ds:
            with fastload.Loader(ds, batch_size=100, device="cpu", log_every=1) as lo:
                n = sum(len(b["y"]) for b in lo)
                text = json.dumps(lo.state_dict()) + repr(lo.stats()) + repr(ds) + repr(ds.cache.remote)
        assert n == 3000
        proxy.add("status", "shard-", status=404, times=-1)
        with pytest.raises(fastload.errors.RemoteError) as e:
            with fastload.Dataset(f"s3://{BUCKET}/ds", cache_dir=tmp_path / "c2", storage_options=opts) as ds:
                ds[0]
    assert SECRET not in text and SECRET not in str(e.value)
    assert "does not exist" in str(e.value)  # a 404 is not retried (it was, for ~50 s)
    logged = "\n".join(r.getMessage() + (r.exc_text or "") for r in caplog.records)
    assert caplog.records and SECRET not in logged


def test_spawn_workers_reopen_a_url(remote_url, local_ds, tmp_path):
    import torch.utils.data as tud

    with fastload.Dataset(remote_url, cache_dir=tmp_path / "c", download_timeout=60) as ds:
        order = list(range(0, len(ds), 7))
        got = [s for batch in tud.DataLoader(ds, batch_size=100, sampler=order, num_workers=1, collate_fn=list,
                                             multiprocessing_context="spawn", timeout=120) for s in batch]
    assert [int(s["y"]) for s in got] == order

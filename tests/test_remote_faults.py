"""Faults between the cache and the server, injected by a proxy of our own on 127.0.0.1:
503 SlowDown bursts, bodies cut half way, wrong bytes, expired credentials, connection
resets, a server that disappears for a while, HTTP servers with and without Range."""
from __future__ import annotations

import contextlib
import re
import shutil
import time

import numpy as np
import pytest

from _remote import BUCKET, DiskSampler, make_cache, open_remote, read_pass, shard_starts, window_stream
from fastload.errors import ChecksumMismatch, DownloadError, DownloadTimeout, RemoteError
from fastload.remote import RemoteDataset, RetryPolicy, epoch_uses
from fastload.store.full_check import file_checksum
from _servers import FaultProxy, HttpFileServer, s3_filesystem, upload_dir


@pytest.fixture
def remote(proxy, local_ds, s3_env):
    upload_dir(s3_filesystem(proxy.upstream, "testing", "testing"), local_ds, f"{BUCKET}/ds")
    return open_remote(proxy.endpoint)


def _gets(proxy: FaultProxy, name: str) -> list:
    return [r for r in proxy.requests("GET", re.escape(name))]


def _all_ok(cache, remote) -> None:
    for i, n in enumerate(remote.shard_files):
        if cache.path(i).exists():
            assert file_checksum(cache.path(i)) == remote.checksums[i], n


def test_a_pass_completes_with_identical_data_under_mixed_faults(proxy, remote, tmp_path):
    proxy.add("slowdown", r"shard-0000[0-4]", times=6)
    proxy.add("cut", r"shard-0000[5-9]", times=3)
    proxy.add("corrupt", r"shard-00010", times=1)
    proxy.add("corrupt", r"shard-00011", times=1)
    proxy.add("reset", r"shard-0001[3-6]", times=3)
    stream = window_stream(remote, 1, seed=4)
    limit = 4 * max(remote.shard_bytes)
    with make_cache(remote, tmp_path / "c", limit=limit, ahead=32, threads=3, chunk_bytes=8192) as c:
        c.plan(epoch_uses(stream, shard_starts(remote)))
        with DiskSampler(c.dir) as ds:
            read_pass(c, remote, stream)  # checks every row it reads
        st = c.stats()
    assert ds.peak <= limit
    assert sum(1 for r in proxy.log if r.fault) == 6 + 3 + 1 + 1 + 3  # every fault was met...
    # ...and handled (faults on ranges of one shard in flight together cost one retry)
    assert st["retries"] >= 4 and st["throttled"] >= 1 and st["checksum_failures"] == 2
    assert st["downloads"] == len(remote.shard_files)


def test_the_default_backoff_schedule(monkeypatch):
    """The pauses between a file's attempts (the Loader's default policy; the fault tests
    here use faster ones, and quick_backoff scales this one): 0.5 s doubled each attempt,
    capped at 30 s, times a uniform jitter in [0.5, 1.5]."""
    import random

    p = RetryPolicy()
    assert (p.attempts, p.backoff_s, p.backoff_max_s) == (6, 0.5, 30.0)
    for jitter in (0.5, 1.0, 1.5):
        monkeypatch.setattr(random, "uniform", lambda a, b, j=jitter: (a, b) == (0.5, 1.5) and j)
        assert [p.pause(a) for a in range(8)] == [jitter * s for s in (0.5, 1, 2, 4, 8, 16, 30, 30)]
    monkeypatch.undo()
    pauses = [RetryPolicy(backoff_s=0.1, backoff_max_s=0.3).pause(2) for _ in range(200)]
    assert 0.15 <= min(pauses) < 0.2 and 0.4 < max(pauses) <= 0.45  # capped 0.3 s, jittered


def test_slowdown_halves_the_downloads_in_flight(proxy, remote, tmp_path):
    proxy.add("slowdown", r"shard-", times=8)
    with make_cache(remote, tmp_path / "c", threads=4) as c:
        c.plan(epoch_uses(window_stream(remote, 1), shard_starts(remote)))
        for i in range(len(remote.shard_files)):
            c.ensure(i)
        _all_ok(c, remote)
        assert c.downloader.concurrency.cuts >= 1
        assert c.stats()["throttled"] == 8


def test_cut_body_resumes_where_it_stopped(proxy, remote, tmp_path):
    name = remote.shard_files[3]
    proxy.add("cut", re.escape(name), skip=1, times=1)  # the second chunk's body stops half way
    with make_cache(remote, tmp_path / "c", chunk_bytes=8192) as c:
        p = c.ensure(3)
        assert file_checksum(p) == remote.checksums[3]
        assert c.stats()["retries"] == 1
    gets = _gets(proxy, name)
    ranges = [g.range for g in gets]
    # the shard comes in 8 KB ranges fetched in parallel; the cut one is fetched again, the
    # others are not (the partial file keeps them)
    cut = [g.range for g in gets if g.fault == "cut"]
    assert len(cut) == 1 and ranges.count(cut[0]) == 2
    assert len(ranges) == len(set(ranges)) + 1 == -(-remote.shard_bytes[3] // 8192) + 1


def test_wrong_bytes_are_downloaded_again_then_reported(proxy, remote, tmp_path):
    proxy.add("corrupt", re.escape(remote.shard_files[1]), times=1)
    proxy.add("corrupt", re.escape(remote.shard_files[2]), times=-1)
    with make_cache(remote, tmp_path / "c") as c:
        assert file_checksum(c.ensure(1)) == remote.checksums[1]  # once wrong, then right
        with pytest.raises(ChecksumMismatch) as e:
            c.ensure(2)
        assert not c.path(2).exists() and not list(c.dir.glob(".*.part"))
    msg = str(e.value)
    assert remote.shard_files[2] in msg and remote.shard_url(2) in msg
    assert e.value.expected == remote.checksums[2] and e.value.expected in msg
    assert e.value.actual.startswith("xxh3_128:") and e.value.actual != e.value.expected and e.value.actual in msg
    assert len(_gets(proxy, remote.shard_files[2])) == 2


@pytest.mark.parametrize("server", ["s3", "http"])
def test_a_download_again_after_wrong_bytes_keeps_its_room_in_the_budget(server, request, local_ds, tmp_path):
    """The partial file is a download's room in the budget (admitted once): a shard
    downloaded again after wrong bytes keeps it through the pause before its second try. Were
    it deleted there, another shard asking for room meanwhile would be admitted, and the
    second try's bytes would come on top of it: one shard over cache_limit."""
    with contextlib.ExitStack() as stack:
        if server == "s3":
            px, r = request.getfixturevalue("proxy"), request.getfixturevalue("remote")
        else:
            srv = stack.enter_context(HttpFileServer(request.getfixturevalue("http_root"), ranges=True))
            px = stack.enter_context(FaultProxy(srv.url.split("//")[1]))
            r = RemoteDataset(f"{px.url}/ds")
        a, b = 1, 2
        px.add("corrupt", re.escape(r.shard_files[a]), times=1)
        limit = max(r.shard_bytes)  # room for one shard
        c = stack.enter_context(make_cache(r, tmp_path / "c", limit=limit))
        opened, meanwhile = [], []
        open_read = r.transport.open_read

        def second_try_opens(name, offset=0):
            if name == r.shard_files[a]:
                opened.append(name)
                if len(opened) == 2:  # the second try, after the wrong bytes and the pause
                    meanwhile.append(c.files.part(a).exists())
                    try:
                        c.ensure(b, timeout=0.5)
                        meanwhile.append("admitted")
                    except DownloadTimeout as e:
                        meanwhile.append(str(e))
            return open_read(name, offset)

        request.getfixturevalue("monkeypatch").setattr(r.transport, "open_read", second_try_opens)
        assert file_checksum(c.ensure(a)) == r.checksums[a]
        assert c.stats()["checksum_failures"] == 1 and len(opened) == 2
        assert meanwhile[0] is True, "the partial file (the shard's room in the budget) was deleted before the retry"
        assert "waited until its deadline for room in the cache" in meanwhile[1], meanwhile[1]
        assert not c.path(b).exists() and c.disk_usage() <= limit


def test_expired_credentials_reload_the_filesystem_once(proxy, remote, tmp_path):
    """From the URL: the filesystem is built again (the credential chain read again)."""
    proxy.add("expired", r"shard-00001", times=1)
    with make_cache(remote, tmp_path / "c") as c:
        for i in range(3):
            assert file_checksum(c.ensure(i)) == remote.checksums[i]
        assert c.stats()["credential_reloads"] == 1 and c.stats()["retries"] == 0
    # refused again after reloading: an error naming the URL and what to check
    proxy.add("expired", r"shard-00005", times=-1)
    with make_cache(remote, tmp_path / "c") as c:
        with pytest.raises(DownloadError, match=r"credentials for s3://fastload-test/ds/shard-00005\.arrow were "
                                                r"refused .* again after reloading them"):
            c.ensure(5)


def test_expired_credentials_with_a_filesystem_factory(proxy, local_ds, s3_env, tmp_path):
    """filesystem= a callable: called again on expiry (e.g. fetching fresh STS credentials)."""
    upload_dir(s3_filesystem(proxy.upstream, "testing", "testing"), local_ds, f"{BUCKET}/ds")
    keys = ["OLDKEY"]
    proxy.add("expired", r"shard-", key_id="OLDKEY", times=-1)
    r = RemoteDataset(f"s3://{BUCKET}/ds", filesystem=lambda: s3_filesystem(proxy.endpoint, keys[0], "x"))
    keys[0] = "NEWKEY"
    with make_cache(r, tmp_path / "c") as c:
        for i in range(3):
            assert file_checksum(c.ensure(i)) == r.checksums[i]
        assert c.stats()["credential_reloads"] == 1
    # a filesystem instance cannot be rebuilt: the error says what to pass instead
    r2 = RemoteDataset(f"s3://{BUCKET}/ds", filesystem=s3_filesystem(proxy.endpoint, "OLDKEY", "x"))
    with make_cache(r2, tmp_path / "c2") as c:
        with pytest.raises(DownloadError, match="pass a callable that builds the filesystem"):
            c.ensure(0)


def test_a_server_that_disappears_for_a_while(proxy, remote, tmp_path):
    patient = RetryPolicy(attempts=12, backoff_s=0.05, backoff_max_s=0.5, timeout_s=30)
    stream = window_stream(remote, 1, seed=9)
    with make_cache(remote, tmp_path / "c", limit=4 * max(remote.shard_bytes), retry=patient, threads=2) as c:
        c.plan(epoch_uses(stream, shard_starts(remote)))
        third = len(stream) // 3
        read_pass(c, remote, stream, end=third)
        proxy.disappear(1.5)
        t0 = time.monotonic()
        read_pass(c, remote, stream, start=third)
        assert time.monotonic() - t0 >= 1.0  # it did stall...
        assert c.stats()["retries"] >= 1  # ...and recovered


def test_per_shard_deadline_names_the_shard(proxy, remote, tmp_path):
    proxy.add("slowdown", re.escape(remote.shard_files[2]), times=-1)
    policy = RetryPolicy(attempts=1000, backoff_s=0.05, backoff_max_s=0.1, timeout_s=1.0)
    with make_cache(remote, tmp_path / "c", retry=policy) as c:
        t0 = time.monotonic()
        with pytest.raises(DownloadTimeout, match=r"shard shard-00002\.arrow .*deadline of 1s") as e:
            c.ensure(2)
        assert time.monotonic() - t0 < 5
        assert e.value.shard == "shard-00002.arrow" and isinstance(e.value, TimeoutError)


def test_the_deadline_holds_while_a_byte_range_stalls(proxy, local_ds, s3_env, tmp_path):
    """A server that stops answering mid-shard (ranged downloads): the shard's deadline ends
    the wait on time, not the client's request timeout (30 s here)."""
    upload_dir(s3_filesystem(proxy.upstream, "testing", "testing"), local_ds, f"{BUCKET}/ds")
    remote = open_remote(proxy.endpoint, request_timeout=30)
    proxy.add("stall", re.escape(remote.shard_files[2]), method="GET", times=-1, seconds=60)
    policy = RetryPolicy(attempts=3, backoff_s=0.05, backoff_max_s=0.1, timeout_s=1.5)
    c = make_cache(remote, tmp_path / "c", retry=policy, chunk_bytes=8192)
    try:
        t0 = time.monotonic()
        with pytest.raises(DownloadTimeout, match=r"shard shard-00002\.arrow .*deadline of 1\.5s"):
            c.ensure(2)
        assert time.monotonic() - t0 < 10, "the wait outlived the deadline"
        proxy.release_stalls()
        c.ensure(2)  # the same cache downloads it once the server answers (resuming the partial file)
        _all_ok(c, remote)
    finally:
        proxy.release_stalls()
        c.close()


def test_attempts_run_out_with_a_named_error(proxy, remote, tmp_path):
    proxy.add("reset", re.escape(remote.shard_files[4]), times=-1)
    with make_cache(remote, tmp_path / "c") as c:
        with pytest.raises(DownloadError, match=r"shard shard-00004\.arrow could not be downloaded from "
                                                r"s3://fastload-test/ds/shard-00004\.arrow after 6 attempts"):
            c.ensure(4)


def test_prefetch_errors_reach_the_reader_for_that_shard_only(proxy, remote, tmp_path):
    proxy.add("status", re.escape(remote.shard_files[0]), times=-1, status=500)
    stream = np.arange(int(shard_starts(remote)[-1]))  # natural order: shard 0 first
    with make_cache(remote, tmp_path / "c", threads=2) as c:
        c.plan(epoch_uses(stream, shard_starts(remote)))
        assert file_checksum(c.ensure(1)) == remote.checksums[1]
        with pytest.raises(DownloadError, match=r"shard-00000\.arrow"):
            c.ensure(0)


# -- http(s) ---------------------------------------------------------------------------------
@pytest.fixture
def http_root(local_ds, tmp_path):
    root = tmp_path / "www"
    root.mkdir()
    shutil.copytree(local_ds, root / "ds")
    return root


@pytest.mark.parametrize("ranges", [True, False])
def test_http_resume_or_start_over(http_root, tmp_path, ranges):
    with HttpFileServer(http_root, ranges=ranges) as srv, FaultProxy(srv.url.split("//")[1]) as px:
        r = RemoteDataset(f"{px.url}/ds")
        assert r.url == f"{px.url}/ds"
        name = r.shard_files[2]
        with make_cache(r, tmp_path / "c") as c:
            half = r.shard_bytes[2] // 2
            data = (http_root / "ds" / name).read_bytes()
            # a partial download left by an earlier run (with a damaged byte when the
            # server cannot resume: it must not survive)
            part = c.dir / f".{name}.part"
            part.write_bytes(data[:half] if ranges else b"\0" * half)
            p = c.ensure(2)
            assert file_checksum(p) == r.checksums[2]
            st = c.stats()
        gets = px.requests("GET", re.escape(name))
        assert gets[0].range == f"bytes={half}-"
        if ranges:
            assert gets[0].status == 206 and st["bytes_downloaded"] == r.shard_bytes[2] - half
        else:
            assert gets[0].status == 200 and st["bytes_downloaded"] == r.shard_bytes[2]


def test_http_cut_body_resumes_with_range(http_root, tmp_path):
    with HttpFileServer(http_root, ranges=True) as srv, FaultProxy(srv.url.split("//")[1]) as px:
        r = RemoteDataset(f"{px.url}/ds")
        px.add("cut", re.escape(r.shard_files[1]), times=1)
        with make_cache(r, tmp_path / "c", chunk_bytes=4096) as c:
            assert file_checksum(c.ensure(1)) == r.checksums[1]
        gets = px.requests("GET", re.escape(r.shard_files[1]))
        assert gets[0].range is None and gets[0].fault == "cut"
        resumed = int(re.match(r"bytes=(\d+)-", gets[1].range).group(1))
        assert resumed == r.shard_bytes[1] // 2  # every byte the server sent before the cut was kept


def test_http_missing_dataset(http_root, tmp_path):
    with HttpFileServer(http_root, ranges=True) as srv:
        with pytest.raises(RemoteError, match=r"manifest\.json does not exist"):
            RemoteDataset(f"{srv.url}/nothing")

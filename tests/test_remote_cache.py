"""The node-local shard cache against a real S3 server (moto, in this process, on 127.0.0.1)."""
from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from _remote import BUCKET, DiskSampler, make_cache, open_remote, read_pass, s3_url, shard_starts, upload, window_stream
from fastload.errors import CacheTooSmall, DownloadError, FormatError, RemoteError
from fastload.remote import RemoteDataset, epoch_uses, manifest_fingerprint
from fastload.store.full_check import file_checksum
from _servers import FaultProxy


def _shard_gets(proxy: FaultProxy) -> list[str]:
    return [re.search(r"(shard-\d+\.arrow)", r.path).group(1) for r in proxy.requests("GET", r"shard-")]


def test_manifest_fingerprint_and_no_secret_kept(moto, local_ds, s3_env, tmp_path):
    upload(moto, local_ds)
    r = RemoteDataset(s3_url(moto.endpoint), storage_options={"access_key": "testing", "secret_key": "hunter2"})
    from fastload.loader import dataset_fingerprint
    from fastload.store import Dataset

    assert r.fingerprint == dataset_fingerprint(Dataset(local_ds)) == manifest_fingerprint(r.manifest)
    assert r.url == f"s3://{BUCKET}/ds" and "hunter2" not in repr(r)
    with make_cache(r, tmp_path / "c") as c:
        text = (c.dir / "remote.json").read_text()
        assert "hunter2" not in text and "endpoint_override" not in text
        assert json.loads(text)["manifest"] == r.manifest
        # a partial cache is not a dataset: it has no manifest.json
        c.ensure(0)
        with pytest.raises(FormatError, match="manifest.json is missing"):
            Dataset(c.dir)


def test_mirror_in_first_use_order_then_all_hits(proxy, local_ds, s3_env, tmp_path):
    upload_via(proxy, local_ds)
    r = open_remote(proxy.endpoint)
    stream = window_stream(r, window=2, seed=7)
    uses = epoch_uses(stream, shard_starts(r))
    with make_cache(r, tmp_path / "c", threads=1) as c:  # one thread: the order is exactly the order of GETs
        assert c.limit == r.total_bytes  # default: the whole dataset fits on this disk
        c.plan(uses)
        read_pass(c, r, stream)
        st = c.stats()
    assert _shard_gets(proxy) == [r.shard_files[s] for s in uses.shards]
    assert st["downloads"] == len(r.shard_files) and st["bytes_downloaded"] == r.total_bytes
    assert st["evictions"] == 0 and st["cache_hits"] == 0
    for i, name in enumerate(r.shard_files):
        assert file_checksum(c.dir / name) == r.checksums[i]
    # a second run (same fingerprint) downloads nothing
    proxy.log.clear()
    with make_cache(r, tmp_path / "c") as c:
        c.plan(uses)
        read_pass(c, r, stream)
        assert c.stats()["cache_hits"] == len(r.shard_files) and c.stats()["bytes_downloaded"] == 0
    assert _shard_gets(proxy) == []


def upload_via(proxy: FaultProxy, local) -> None:
    from _servers import s3_filesystem, upload_dir

    upload_dir(s3_filesystem(proxy.upstream, "testing", "testing"), local, f"{BUCKET}/ds")  # not via the proxy
    proxy.log.clear()


@pytest.mark.parametrize("window,limit_shards", [(1, 3), (1, 4), (2, 5)])
def test_budget_holds_and_each_shard_is_downloaded_once(proxy, local_ds, s3_env, tmp_path, window, limit_shards,
                                                        monkeypatch):
    from fastload.remote.cache_timeline import Timeline

    taken: list[int] = []  # the shards the download threads took off the queue, in order (under the cache's lock)
    take = Timeline.take

    def recording(self, use, node_t):
        s = take(self, use, node_t)
        if s is not None:
            taken.append(s)
        return s

    monkeypatch.setattr(Timeline, "take", recording)
    upload_via(proxy, local_ds)
    r = open_remote(proxy.endpoint)
    big = max(r.shard_bytes)
    limit = limit_shards * big
    stream = window_stream(r, window=window, seed=1)
    uses = epoch_uses(stream, shard_starts(r))
    with make_cache(r, tmp_path / "c", limit=limit, ahead=32, threads=3) as c:
        assert c.minimum_limit(uses) <= limit
        c.plan(uses)
        with DiskSampler(c.dir) as ds:
            asked = read_pass(c, r, stream)
        st = c.stats()
        left = sorted(p.name for p in c.dir.glob("shard-*.arrow"))
    assert asked == uses.shards.tolist()
    assert ds.peak <= limit, f"{ds.peak} bytes on disk > cache_limit {limit}"
    assert len(ds.samples) > 20
    gets = _shard_gets(proxy)
    assert sorted(gets) == sorted(r.shard_files), "every shard exactly once"
    # admission in first-use order: the download threads take the shards in exactly that
    # order (the order their GETs reach the server is the scheduler's: 3 are in flight, and a
    # thread that took shard j may be preempted before its GET while another's j+3 goes out)
    assert taken == uses.shards.tolist()
    assert st["evictions"] == len(r.shard_files) and left == []  # exact eviction after the last use


def test_next_pass_is_fetched_before_this_one_ends(proxy, local_ds, s3_env, tmp_path):
    upload_via(proxy, local_ds)
    r = open_remote(proxy.endpoint)
    s0, s1 = window_stream(r, 1, seed=3, epoch=0), window_stream(r, 1, seed=3, epoch=1)
    u0, u1 = epoch_uses(s0, shard_starts(r)), epoch_uses(s1, shard_starts(r), epoch=1)
    with make_cache(r, tmp_path / "c", limit=4 * max(r.shard_bytes), ahead=16, threads=2) as c:
        c.plan(u0, next_uses=u1)
        read_pass(c, r, s0, end=len(s0) - 200)
        # still in pass 0: the first shards of pass 1 arrive (those not needed by pass 0's tail)
        first1 = [s for s in u1.shards[:2].tolist() if s not in u0.shards[-2:].tolist()]
        deadline = __import__("time").monotonic() + 10
        while not all(c.path(s).exists() for s in first1) and __import__("time").monotonic() < deadline:
            __import__("time").sleep(0.01)
        assert all(c.path(s).exists() for s in first1)
        read_pass(c, r, s0, start=len(s0) - 200)
        c.plan(u1)
        read_pass(c, r, s1)
        st = c.stats()
    # a 4-shard budget keeps nothing from one pass to the next: every shard once per pass,
    # the first ones of pass 1 during pass 0
    assert st["downloads"] == 2 * len(r.shard_files) and st["cache_hits"] == 0
    gets = _shard_gets(proxy)
    assert all(gets.count(n) == 2 for n in r.shard_files)


def test_resume_starts_at_the_position(proxy, local_ds, s3_env, tmp_path):
    upload_via(proxy, local_ds)
    r = open_remote(proxy.endpoint)
    stream = window_stream(r, 1, seed=2)
    start = len(stream) // 2 + 17
    uses = epoch_uses(stream, shard_starts(r), start=start)
    with make_cache(r, tmp_path / "c", limit=3 * max(r.shard_bytes), threads=1) as c:
        c.plan(uses)
        read_pass(c, r, stream, start=start)
    gets = _shard_gets(proxy)
    starts = shard_starts(r)
    assert gets[0] == r.shard_files[int(np.searchsorted(starts, stream[start], side="right") - 1)]
    assert len(gets) == len(uses) < len(r.shard_files)


def test_too_small_budgets_are_refused_up_front(moto, local_ds, s3_env, tmp_path):
    upload(moto, local_ds)
    r = open_remote(moto.endpoint)
    big = max(r.shard_bytes)
    with pytest.raises(CacheTooSmall, match="largest shard") as e:
        make_cache(r, tmp_path / "c", limit=big - 1)
    assert e.value.minimum == big
    full = np.random.default_rng(0).permutation(int(shard_starts(r)[-1]))
    with make_cache(r, tmp_path / "c", limit=4 * big, ahead=64) as c:
        with pytest.raises(CacheTooSmall, match=r'shuffle_mode="window"') as e:
            c.plan(epoch_uses(full, shard_starts(r)))
        assert e.value.minimum > 0.9 * r.total_bytes  # a full shuffle keeps nearly every shard in use
        assert str(e.value.minimum) in str(e.value)
        c.plan(epoch_uses(window_stream(r, 1), shard_starts(r)))  # the same budget is fine in window mode


def test_cache_limit_strings_and_default(moto, local_ds, s3_env, tmp_path):
    upload(moto, local_ds)
    r = open_remote(moto.endpoint)
    with make_cache(r, tmp_path / "c", limit="1MB") as c:
        assert c.limit == 1_000_000
    with pytest.raises(ValueError, match="cache_limit='lots' is not a size"):
        make_cache(r, tmp_path / "c", limit="lots")


def test_damaged_cached_file_is_replaced(moto, local_ds, s3_env, tmp_path):
    upload(moto, local_ds)
    r = open_remote(moto.endpoint)
    with make_cache(r, tmp_path / "c") as c:
        p = c.ensure(3)
    with open(p, "r+b") as f:
        f.truncate(10)
    with make_cache(r, tmp_path / "c") as c:
        assert not p.exists()  # a wrong size: deleted at open
        assert file_checksum(c.ensure(3)) == r.checksums[3]


def test_missing_objects_name_the_shard_and_url(moto, local_ds, s3_env, tmp_path):
    upload(moto, local_ds)
    fs = moto.filesystem()
    fs.delete_file(f"{BUCKET}/ds/shard-00002.arrow")
    r = open_remote(moto.endpoint)
    with make_cache(r, tmp_path / "c") as c:
        with pytest.raises(DownloadError, match=r"shard-00002\.arrow does not exist at s3://fastload-test/ds/"
                                                r"shard-00002\.arrow") as e:
            c.ensure(2)
        assert not isinstance(e.value, FileNotFoundError)
        assert e.value.shard == "shard-00002.arrow"
    with pytest.raises(RemoteError, match="not a fastload dataset"):
        open_remote(moto.endpoint, prefix="nothing-here")


def test_hostile_manifest_file_names_are_refused(moto, local_ds, s3_env, tmp_path):
    m = json.loads((local_ds / "manifest.json").read_text())
    m["shards"][0]["file"] = "../../escape.arrow"
    (local_ds / "manifest.json").write_text(json.dumps(m))
    upload(moto, local_ds)
    with pytest.raises(FormatError, match="plain file names"):
        open_remote(moto.endpoint)


def test_random_access_without_a_plan(moto, local_ds, s3_env, tmp_path):
    """A Dataset read at random (no Loader): shards come on demand, the budget still holds."""
    upload(moto, local_ds)
    r = open_remote(moto.endpoint)
    big = max(r.shard_bytes)
    with make_cache(r, tmp_path / "c", limit=2 * big) as c:
        for s in [0, 5, 3, 0, 7, 1]:
            assert file_checksum(c.ensure(s)) == r.checksums[s]
            assert c.disk_usage() <= 2 * big
        assert c.stats()["evictions"] >= 3


def test_close_joins_threads_and_leaves_the_node(moto, local_ds, s3_env, tmp_path):
    upload(moto, local_ds)
    r = open_remote(moto.endpoint)
    c = make_cache(r, tmp_path / "c", local_world_size=2, local_rank=1)
    c.plan(epoch_uses(window_stream(r, 1), shard_starts(r)))
    assert (c.dir / ".progress" / "rank-1").exists()
    c.close()
    assert (c.dir / ".progress" / "rank-1").read_text() == "done\n"  # peers stop counting it
    with pytest.raises(RemoteError, match="closed"):
        c.ensure(0)


def test_the_shard_cache_without_a_home_directory_uses_the_same_fallbacks(tmp_path, monkeypatch):
    """An arbitrary container uid (HOME unset, no passwd entry): the remote shard cache lives
    where the verified-shard record does ($XDG_CACHE_HOME/fastload, else a private temporary
    directory), and says what to set when there is no safe place at all."""
    import pathlib

    from fastload.runtime import system
    from fastload.errors import UsageError
    from fastload.remote.cache_files import default_cache_dir

    def no_home(*a, **k):
        raise RuntimeError("Could not determine home directory")
    monkeypatch.setattr(pathlib.Path, "home", classmethod(no_home))
    monkeypatch.delenv("FASTLOAD_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "fastload"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setattr(system.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    assert default_cache_dir() == tmp_path / "tmp" / f"fastload-{os.getuid()}"
    (tmp_path / "tmp" / f"fastload-{os.getuid()}").chmod(0o777)  # not safely ours (others may write)
    with pytest.raises(UsageError, match="set FASTLOAD_CACHE"):
        default_cache_dir()

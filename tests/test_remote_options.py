"""One RemoteOptions value for how a remote dataset is opened; the cache's collaborators, each
with its own state; one object-store client for reading and converting."""
from __future__ import annotations

import dataclasses
import gc
import pickle
import threading
import types
import weakref

import numpy as np
import pytest

from _remote import BUCKET, make_cache, open_remote, s3_url, shard_starts, upload
import fastload
from fastload.remote import RemoteOptions, epoch_uses


# -- RemoteOptions --------------------------------------------------------------------------
def test_remote_options_are_checked_once_when_made():
    o = RemoteOptions(cache_dir="~/c", cache_limit="2GB", download_timeout=3, download_threads=2,
                      storage_options={"region": "x", "secret_key": "hunter2"})
    assert o.cache_limit == 2_000_000_000 and o.download_timeout == 3.0 and o.download_threads == 2
    assert str(o.cache_dir).endswith("/c") and "~" not in str(o.cache_dir)
    assert "hunter2" not in repr(o) and "region" in repr(o)  # a logged value carries no secret
    assert o.retry_policy().timeout_s == 3.0
    assert o.given() == ["cache_dir", "cache_limit", "storage_options", "download_timeout", "download_threads"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.cache_limit = 5  # frozen
    assert pickle.loads(pickle.dumps(o)) == o
    for bad, name in ((dict(cache_limit="lots"), "cache_limit"), (dict(download_timeout=0), "download_timeout"),
                      (dict(download_timeout=True), "download_timeout"), (dict(download_threads=0), "download_threads"),
                      (dict(cache_dir=3), "cache_dir"), (dict(storage_options=["a"]), "storage_options")):
        with pytest.raises(ValueError, match=name):
            RemoteOptions(**bad)
    with pytest.raises(ValueError, match="not both"):
        RemoteOptions.from_keywords(o, cache_limit="1GB")
    assert RemoteOptions.from_keywords(o) is o
    assert RemoteOptions.from_keywords(None, cache_limit=None, download_threads=3) == RemoteOptions(download_threads=3)


def test_share_budget_takes_bytes_parsed_by_remote_options():
    from fastload.remote.budget import share_budget

    with pytest.raises(TypeError, match="RemoteOptions"):
        share_budget([], "20GB")  # parsed once, upstream: a size string here is a caller's mistake


def test_dataset_and_mixture_take_remote_options(moto, local_ds, s3_env, tmp_path):
    upload(moto, local_ds)
    upload(moto, local_ds, "ds2")
    url, url2 = s3_url(moto.endpoint), s3_url(moto.endpoint, "ds2")
    big = 4 * max(s["bytes"] for s in fastload.Dataset(local_ds).manifest["shards"])
    opts = RemoteOptions(cache_dir=tmp_path / "c", cache_limit=big, download_timeout=33, download_threads=2)
    with fastload.Dataset(url, remote=opts) as ds:
        assert ds.cache.limit == big and ds.cache.root == tmp_path / "c"
        assert ds.cache.policy.timeout_s == 33 and ds.cache.fetcher.threads == 2
        assert ds[3]["y"] == 3
        again = pickle.loads(pickle.dumps(ds))  # a spawned worker reopens it the same way
        try:
            assert again.cache.limit == big and again.cache.root == tmp_path / "c"
            assert again.cache.policy.timeout_s == 33 and again.cache.fetcher.threads == 2
        finally:
            again.close()
    # the old keywords still work, and become the same value
    with fastload.Dataset(url, cache_dir=tmp_path / "c", cache_limit=big, download_timeout=33,
                          download_threads=2) as ds:
        assert (ds.cache.limit, ds.cache.policy.timeout_s, ds.cache.fetcher.threads) == (big, 33, 2)
    with pytest.raises(ValueError, match="not both"):
        fastload.Dataset(url, remote=opts, cache_limit=big)
    with pytest.raises(ValueError, match="cache_limit apply to remote datasets"):
        fastload.Dataset(local_ds, remote=RemoteOptions(cache_limit="1GB"))
    mix = fastload.Mixture([url, url2], [1, 1], epoch_size=100,
                           remote=opts.replace(cache_limit=2 * big))
    try:
        assert mix.cache_limit == 2 * big  # one budget for both, shared out
        assert sum(c.limit for c in mix.shared_caches) <= 2 * big
        assert all(c.root == tmp_path / "c" and c.fetcher.threads == 2 for c in mix.shared_caches)
    finally:
        mix.close()


# -- the cache's collaborators ---------------------------------------------------------------
def _fake_remote(sizes):
    names = [f"shard-{i:05d}.arrow" for i in range(len(sizes))]
    return types.SimpleNamespace(url="s3://b/fake", fingerprint="f" * 16, shard_bytes=list(sizes), shard_files=names,
                                 manifest={"shards": [{"file": n} for n in names]})


def test_the_timeline_and_the_files_work_on_their_own(tmp_path):
    """Each concern of the cache is an object with its own state: the timeline decides from
    positions alone, the files hold the directory and its budget."""
    from fastload.remote.cache_files import CacheFiles
    from fastload.remote.cache_timeline import Timeline

    sizes = np.array([100, 100, 100, 100], dtype=np.int64)
    files = CacheFiles(_fake_remote(sizes), tmp_path, 250)
    assert (files.limit, files.mirror) == (250, False) and files.dir == tmp_path / ("f" * 16)
    for s in (0, 1):
        files.path(s).write_bytes(b"x" * 100)
    assert files.present() == ({0: 100, 1: 100}, 0) and files.disk_usage() == 200
    starts = np.array([0, 10, 20, 30, 40], dtype=np.int64)
    uses = epoch_uses(np.arange(40), starts)  # shards in order, 10 positions each
    t = Timeline(sizes, ahead=0)
    t.plan(uses, None, files.limit)
    assert t.next_use() == 0 and t.admitted_at(0) <= 0 and t.take(0, 0) == 0
    assert t.advance(15)  # shard 0's last use passed: an event
    t.event_handled()
    assert t.to_release() == [0]  # shard 0's uses are behind this rank
    done, spare = t.evictable({0: 100, 1: 100}, busy=(), node_t=15, positions=[15], mirror=False, age=files.age)
    assert done == [(0, 100)] and spare == []  # shard 1 is in use; shard 0 has no use ahead
    assert files.delete(0) and not files.delete(0)
    files.close()


def test_node_ranks_see_a_peer_only_while_its_process_holds_its_lock(tmp_path):
    from fastload.remote.cache_files import CacheFiles
    from fastload.remote.cache_ranks import NodeRanks

    files = CacheFiles(_fake_remote([10, 10]), tmp_path, None)
    a = NodeRanks(files, 0, 2, owner_grace_s=30.0, poll_s=0.0)
    assert not a.is_alive(1) and a.owner(3) == 1 and a.fetch_for_owner(3, 0.0)  # nobody to wait for
    b = NodeRanks(files, 1, 2, owner_grace_s=0.0, poll_s=0.0)  # (flocks are per open file: as another process)
    assert a.is_alive(1) and not a.fetch_for_owner(3, 0.0) and a.fetch_for_owner(3, 31.0)  # waited long enough
    b.write_progress(7, 1)
    assert a.refresh(20, hold=0, force=True) == 7 and sorted(a.positions) == [7, 20]
    b.write_done()
    b.close()
    assert not a.is_alive(1) and a.refresh(20, hold=0, force=True) == 20
    a.close()
    files.close()


def test_a_dropped_cache_with_a_planned_pass_is_closed_at_once(proxy, moto, local_ds, s3_env, tmp_path):
    """No download thread and no collaborator refers back to the cache: dropping the last
    reference closes it (threads joined) without waiting for the garbage collector."""
    upload(moto, local_ds)
    r = open_remote(proxy.endpoint)
    c = make_cache(r, tmp_path / "c", threads=2)
    c.plan(epoch_uses(np.arange(int(shard_starts(r)[-1])), shard_starts(r)))
    workers = [t for t in threading.enumerate() if t.name.startswith("fastload-download")]
    assert len(workers) == 2 and all(t.is_alive() for t in workers)
    ref = weakref.ref(c)
    gc.disable()
    try:
        del c
        assert ref() is None
    finally:
        gc.enable()
    for t in workers:
        t.join(5)
    assert not any(t.is_alive() for t in workers)
    assert not [t for t in threading.enumerate() if t.name.startswith("fastload-download")]


# -- one object-store client -----------------------------------------------------------------
def test_the_conversion_store_writes_through_the_remote_transport(moto, s3_env, tmp_path, monkeypatch):
    from fastload.convert.objstore import Store
    from fastload.remote.transport_arrow import ArrowTransport

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{moto.endpoint}")
    writes = []
    orig_file, orig_bytes = ArrowTransport.write_file, ArrowTransport.write_bytes
    monkeypatch.setattr(ArrowTransport, "write_file", lambda self, p, n: (writes.append(n), orig_file(self, p, n))[1])
    monkeypatch.setattr(ArrowTransport, "write_bytes",
                        lambda self, d, n: (writes.append(n), orig_bytes(self, d, n))[1])
    st = Store(f"s3://{BUCKET}/options-store")
    (tmp_path / "a.bin").write_bytes(b"abc" * 1000)
    st.put_file(tmp_path / "a.bin", "shard-00000.arrow")
    st.put_json(".fastload-parts/g-00000003.json", {"n": 1})
    assert writes == ["shard-00000.arrow", ".fastload-parts/g-00000003.json"]  # one upload loop: the transport's
    assert st.sizes() == {"shard-00000.arrow": 3000} and st.size("nope") is None
    assert st.get_json(".fastload-parts/g-00000003.json") == {"n": 1} and st.get_json("missing.json") is None
    assert st.records() == {3}
    with st.open_input("shard-00000.arrow") as f:
        assert f.read_at(3, 3) == b"abc"
    st.remove_parts()
    st.delete("shard-00000.arrow")
    st.delete("shard-00000.arrow")  # already gone: nothing to do
    assert st.sizes() == {} and st.records() == set()

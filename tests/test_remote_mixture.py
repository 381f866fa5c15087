"""Mixtures of remote datasets read through the cache's plan: batches equal the mixture of
the local copies, one budget shared by the datasets holds on disk (no evicted file stays
mapped), and a budget the mixture's order cannot meet is refused up front."""
from __future__ import annotations

import json

import pytest

import fastload
from _remote import assert_same, batches, BUCKET, DiskSampler, make_dataset, s3_url
from fastload.errors import CacheTooSmall
from _servers import s3_filesystem, upload_dir


@pytest.fixture
def two(proxy, tmp_path, s3_env):
    a, b = make_dataset(tmp_path / "a"), make_dataset(tmp_path / "b", rows=2000)
    fs = s3_filesystem(proxy.upstream, "testing", "testing")
    upload_dir(fs, a, f"{BUCKET}/a")
    upload_dir(fs, b, f"{BUCKET}/b")
    return (a, b), (s3_url(proxy.endpoint, "a"), s3_url(proxy.endpoint, "b"))


def _mapped_deleted(directory) -> int:
    """Files under ``directory`` this process still maps although they were deleted."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if str(directory) in line and line.rstrip().endswith("(deleted)"))


def _shard_bytes(path) -> int:
    return max(s["bytes"] for s in json.loads((path / "manifest.json").read_text())["shards"])


@pytest.mark.parametrize("shuffle,shards", [(True, None), (False, 6)])
def test_mixture_of_urls_equals_the_local_mixture(two, tmp_path, shuffle, shards):
    (a, b), (ua, ub) = two
    kw = dict(mix=[0.6, 0.4], epoch_size=1500, batch_size=50, seed=7, shuffle=shuffle, device="cpu", prefetch=2,
              threads=1)
    with fastload.Loader([str(a), str(b)], **kw) as lo:
        want = batches(lo, epochs=(0, 1))
    limit = None if shards is None else shards * _shard_bytes(a)
    cache = tmp_path / "cache"
    deleted = []
    with fastload.Loader([ua, ub], cache_dir=cache, cache_limit=limit, **kw) as lo:
        assert lo._remote is not None, "the mixture reads through the cache's plan"
        caches = [r.cache for r in lo.dataset.readers]
        if limit is not None:
            assert sum(c.limit for c in caches) <= limit
        on_batch = lambda _i: deleted.append(_mapped_deleted(cache))  # noqa: E731
        with DiskSampler(caches[0].dir) as d0, DiskSampler(caches[1].dir) as d1:
            got = batches(lo, epochs=(0,), on_batch=on_batch)
            st = lo.stats()  # the first epoch's
            got += batches(lo, epochs=(1,), on_batch=on_batch)
    assert_same(got, want)
    assert max(deleted) == 0, "a deleted cache file is still mapped"
    assert st["bytes_downloaded"] > 0 and "download_MBps" in st
    if limit is not None:
        # each dataset's cache holds to its part, and the parts add up to the one budget
        assert d0.peak <= caches[0].limit and d1.peak <= caches[1].limit
        assert st["evictions"] > 0
    # the Loader opened the URLs: closing it closed their caches
    assert all(c._closed for c in caches)


def test_mixture_resume_with_an_empty_cache(two, tmp_path):
    (a, b), (ua, ub) = two
    kw = dict(mix=[0.5, 0.5], epoch_size=1200, batch_size=40, seed=2, device="cpu", prefetch=2)
    with fastload.Loader([str(a), str(b)], **kw) as lo:
        want = batches(lo)
    with fastload.Loader([ua, ub], cache_dir=tmp_path / "c1", **kw) as lo:
        it = iter(lo)
        first = [{k: v.numpy().copy() for k, v in next(it).items()} for _ in range(11)]
        state = lo.state_dict()
    with fastload.Loader([ua, ub], cache_dir=tmp_path / "c2", **kw) as lo:
        lo.load_state_dict(json.loads(json.dumps(state)))
        rest = [{k: v.numpy().copy() for k, v in b.items()} for b in lo]
    assert_same(first + rest, want)


def test_a_budget_the_mixture_cannot_meet_is_refused(two, tmp_path):
    (a, b), (ua, ub) = two
    shard = _shard_bytes(a)
    kw = dict(mix=[0.5, 0.5], epoch_size=2000, batch_size=50, device="cpu")
    with pytest.raises(CacheTooSmall, match=r"mixture.*fastload prefetch") as e:
        fastload.Loader([ua, ub], cache_dir=tmp_path / "c", cache_limit=4 * shard, **kw)
    assert e.value.minimum > 4 * shard
    # Datasets opened with their own budgets: the one that cannot hold its order is named
    with fastload.Dataset(ua, cache_dir=tmp_path / "c", cache_limit=2 * shard) as da, \
            fastload.Dataset(ub, cache_dir=tmp_path / "c") as db:
        with pytest.raises(CacheTooSmall, match=r"s3://fastload-test/a.*fastload prefetch"):
            fastload.Loader(fastload.Mixture([da, db], [0.5, 0.5], epoch_size=2000), batch_size=50, device="cpu")
    with pytest.raises(ValueError, match="go with datasets given as URLs"):
        fastload.Loader([str(a), str(b)], cache_limit="1GB", **kw)


def test_one_default_budget_for_the_mixture(two, tmp_path, monkeypatch):
    """Without cache_limit, the datasets share one budget on their disk, not one each."""
    import shutil
    from collections import namedtuple

    (a, b), (ua, ub) = two
    usage = namedtuple("usage", "total used free")
    sizes = [sum(s["bytes"] for s in json.loads((p / "manifest.json").read_text())["shards"]) for p in (a, b)]
    free = int(sum(sizes) / 0.8 * 0.75)  # 80% of the free disk holds 75% of both datasets
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**12, 0, free))
    mix = fastload.Mixture([ua, ub], [0.5, 0.5], epoch_size=1000, cache_dir=tmp_path / "c")
    try:
        limits = [r.cache.limit for r in mix.reader.readers]
        assert sum(limits) <= int(0.8 * free) and mix.cache_limit == int(0.8 * free)
        assert all(0 < x < z for x, z in zip(limits, sizes))
    finally:
        mix.close()


def test_a_local_dataset_mixed_with_a_url_keeps_few_of_its_shards_mapped(two, tmp_path, monkeypatch):
    """A mixture of a URL and a local dataset of many shards, past the limit on mapped shards
    (here 8): the local dataset's shards are installed in the ring as batches need them and
    dropped when no batch in flight needs them (LocalShards), as a local dataset alone; they
    used to stay installed, so the process mapped every one of them by the epoch's end."""
    from fastload.store.mapped import ENV_LIMIT

    (a, _), (ua, _) = two
    many = make_dataset(tmp_path / "many", rows=2000, shard_size=4000)  # ~15 rows a shard
    with fastload.Dataset(many) as ds:
        n_many = ds.num_shards
    assert n_many > 100
    monkeypatch.setenv(ENV_LIMIT, "8")
    kw = dict(mix=[0.5, 0.5], epoch_size=1500, batch_size=50, seed=7, device="cpu", prefetch=2, threads=1)
    with fastload.Loader([str(a), str(many)], **kw) as lo:
        want = batches(lo, epochs=(0, 1))
    prefix = str(many.resolve()) + "/"

    def maps() -> int:
        with open("/proc/self/maps") as fh:
            return sum(1 for line in fh if prefix in line)

    most = []
    with fastload.Loader([ua, str(many)], cache_dir=tmp_path / "cache", **kw) as lo:
        assert lo._remote is not None
        got = batches(lo, epochs=(0, 1), on_batch=lambda _i: most.append(maps()))
    assert_same(got, want)
    # 8 kept by the reader, 8 installed in the ring and the shards of the batches in flight
    # (4 batches of 25 local rows at most): far below the ~130 shards the epochs read
    assert max(most) <= 8 + 8 + 4 * 25, max(most)
    assert max(most) < n_many // 2, max(most)

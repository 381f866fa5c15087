"""fastload.Dataset(URL) and fastload.Loader(URL): batches equal the local dataset's, the
budget holds during the run, resume with an empty cache, shards downloaded once per node."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

import fastload
from _remote import assert_same, batches, BUCKET, DiskSampler
from fastload.errors import CacheTooSmall


def test_dataset_from_a_url(remote_url, local_ds, tmp_path):
    with fastload.Dataset(remote_url, cache_dir=tmp_path / "c") as ds, fastload.Dataset(local_ds) as local:
        assert len(ds) == len(local) and ds.fields == local.fields and ds.path == f"s3://{BUCKET}/ds"
        idx = [0, 2999, 1500, 7]
        got, want = ds.get_batch(idx), local.get_batch(idx)
        assert all(np.array_equal(got[k], want[k]) for k in want)
        assert ds[5]["y"] == 5
        assert "s3://fastload-test/ds" in repr(ds)
        # pickles as the URL and cache settings (DataLoader workers), never a secret or data
        state = ds.__getstate__()
        assert state["path"] == f"s3://{BUCKET}/ds" and json.dumps(state)


@pytest.mark.parametrize("mode,window,limit_shards", [("window", 1, 4), ("window", 2, 6), ("full", None, None)])
def test_loader_batches_equal_local_across_epochs(remote_url, local_ds, tmp_path, mode, window, limit_shards):
    kw = dict(batch_size=50, seed=3, shuffle_mode=mode, window=window, device="cpu", prefetch=2, threads=1)
    with fastload.Loader(local_ds, **kw) as lo:
        want = batches(lo, epochs=(0, 1))
        shard_bytes = max(s["bytes"] for s in lo.dataset.manifest["shards"])
    limit = None if limit_shards is None else limit_shards * shard_bytes
    with fastload.Loader(remote_url, cache_dir=tmp_path / "c", cache_limit=limit, **kw) as lo:
        with DiskSampler(lo.dataset.cache.dir) as disk:
            got = batches(lo, epochs=(0, 1))
        st = lo.stats()
    assert_same(got, want)
    if limit is not None:
        assert disk.peak <= limit, f"{disk.peak} bytes on disk > cache_limit {limit}"
        assert st["evictions"] > 0
    for k in ("bytes_downloaded", "download_wait_s", "download_MBps", "cache_hits", "evictions", "retries"):
        assert k in st, k
    assert "download_busy_s" not in st


def test_resume_with_an_empty_cache(remote_url, local_ds, tmp_path):
    kw = dict(batch_size=40, seed=5, shuffle_mode="window", window=1, device="cpu", prefetch=2)
    with fastload.Loader(local_ds, **kw) as lo:
        want = batches(lo)
    with fastload.Loader(remote_url, cache_dir=tmp_path / "c1", cache_limit="150kB", **kw) as lo:
        it = iter(lo)
        first = [{k: v.numpy().copy() for k, v in next(it).items()} for _ in range(30)]
        state = lo.state_dict()
    with fastload.Loader(remote_url, cache_dir=tmp_path / "c2", cache_limit="150kB", **kw) as lo:
        lo.load_state_dict(json.loads(json.dumps(state)))
        rest = [{k: v.numpy().copy() for k, v in b.items()} for b in lo]
    assert_same(first + rest, want)


def test_too_small_cache_is_refused_at_construction(remote_url, tmp_path):
    with pytest.raises(CacheTooSmall, match=r'shuffle_mode="window"') as e:
        fastload.Loader(remote_url, batch_size=50, cache_dir=tmp_path / "c", cache_limit="150kB", device="cpu")
    assert e.value.minimum > 150_000
    with pytest.raises(ValueError, match="go with a URL"):
        fastload.Loader(fastload.Dataset(remote_url, cache_dir=tmp_path / "c"), batch_size=50,
                        cache_limit="1GB", device="cpu")


def test_log_every_shows_downloads(remote_url, tmp_path, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="fastload"):
        with fastload.Loader(remote_url, batch_size=100, cache_dir=tmp_path / "c", device="cpu",
                             log_every=10) as lo:
            for _ in lo:
                pass
    lines = [r.getMessage() for r in caplog.records if "downloaded" in r.getMessage()]
    assert lines and re.search(r"downloaded [\d.]+ MB at \d+ MB/s, waited [\d.]+ s for downloads, \d+ cache hits",
                               lines[0])


def test_a_downloaded_shard_is_hashed_once(remote_url, tmp_path):
    """The download checked each shard against the manifest: its first use does not hash it
    again. A cached file changed afterwards is still caught (its identity changed)."""
    with fastload.Dataset(remote_url, cache_dir=tmp_path / "c") as ds:
        ds.get_batch(np.arange(len(ds)))
        st = ds.verify_stats()
        assert st["shards_hashed"] == 0 and st["shards_remembered"] == ds.num_shards == st["shards_verified"]
        p = ds.cache.path(3)
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))
    with fastload.Dataset(remote_url, cache_dir=tmp_path / "c") as ds:
        with pytest.raises(fastload.errors.FormatError, match="does not match the manifest"):
            ds.get_batch(np.arange(len(ds)))


def test_downloads_start_when_the_loader_is_built(remote_url, local_ds, tmp_path):
    """The first pass is planned at construction (downloads overlap the model's set-up), and
    the first epoch's stats still count those downloads."""
    import time

    kw = dict(batch_size=50, seed=1, shuffle_mode="window", window=1, device="cpu", prefetch=2)
    with fastload.Loader(local_ds, **kw) as lo:
        want = batches(lo)
    with fastload.Loader(remote_url, cache_dir=tmp_path / "c", **kw) as lo:
        cache = lo.dataset.cache
        first = int(np.searchsorted(lo.dataset.shard_starts, lo.sampler.stream(0)[0], side="right") - 1)
        deadline = time.monotonic() + 30
        while not cache.path(first).exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cache.path(first).exists(), "the first shard was downloaded before iterating"
        got = batches(lo)
        st = lo.stats()
    assert_same(got, want)
    assert st["bytes_downloaded"] == sum(s["bytes"] for s in lo.dataset.manifest["shards"])

"""A Loader reading a URL through faults (503 bursts, cut bodies, wrong bytes, resets, a
server that disappears, a stalled server): the epoch completes with the local dataset's
batches, or fails with the named error. Plus an image field (DALI's CPU graph) read from a
URL, and the download options."""
from __future__ import annotations

import time

import pytest

import fastload
from _remote import assert_same, batches, BUCKET, DiskSampler, s3_url
from fastload.errors import ChecksumMismatch, DownloadTimeout
from _servers import s3_filesystem, upload_dir
from _images import write_photo_crops

KW = dict(batch_size=50, seed=3, shuffle_mode="window", window=1, device="cpu", prefetch=2, threads=1)


def _open(url, cache_dir, **kw):
    """The Loader's Dataset with pyarrow's own request retries off (max_attempts=1): the
    cache's retries are what these faults meet."""
    return fastload.Dataset(url, cache_dir=cache_dir, storage_options={"max_attempts": 1}, **kw)


def _shard_bytes(local_ds) -> int:
    with fastload.Dataset(local_ds) as ds:
        return max(s["bytes"] for s in ds.manifest["shards"])


def test_the_epoch_completes_with_identical_batches_under_faults(remote_url, proxy, local_ds, tmp_path,
                                                                quick_backoff):
    with fastload.Loader(local_ds, **KW) as lo:
        want = batches(lo, epochs=None)
    # (5 SlowDowns: fewer than a file's 6 attempts, so whichever of these shards the order
    # reads first survives them all, even when no other one is downloading beside it)
    proxy.add("slowdown", r"shard-0000[0-4]", times=5)
    proxy.add("cut", r"shard-0000[5-9]", times=3)
    proxy.add("corrupt", r"shard-00010", times=1)
    proxy.add("reset", r"shard-0001[3-6]", times=3)
    limit = 4 * _shard_bytes(local_ds)

    def disappear(i):
        if i == len(want) // 2:
            proxy.disappear(1.0)  # connections refused for a second, mid-epoch

    with _open(remote_url, tmp_path / "c", cache_limit=limit) as ds, fastload.Loader(ds, **KW) as lo:
        with DiskSampler(ds.cache.dir) as disk:
            got = batches(lo, epochs=None, on_batch=disappear)
        st = lo.stats()
    assert_same(got, want)
    assert sum(1 for r in proxy.log if r.fault) >= 12, "the faults were met"
    assert st["retries"] >= 5 and st["evictions"] > 0
    # at every moment, the retried downloads (the corrupt shard's second try included) too
    assert disk.peak <= limit, f"the cache held {disk.peak} bytes on disk against cache_limit={limit}"


def test_a_shard_that_stays_wrong_is_named(remote_url, proxy, local_ds, tmp_path):
    proxy.add("corrupt", r"shard-00007\.arrow", times=-1)
    with _open(remote_url, tmp_path / "c") as ds, fastload.Loader(ds, **KW) as lo:
        url = ds.cache.remote.shard_url(7)
        want = ds.manifest["shards"][7]["checksum"]
        n = 0
        with pytest.raises(ChecksumMismatch) as e:
            for _ in lo:
                n += 1
    msg = str(e.value)
    assert "shard-00007.arrow" in msg and url in msg and want in msg and e.value.actual in msg
    assert e.value.expected == want != e.value.actual
    assert n < len(lo)


def test_download_timeout_names_the_stalled_shard(remote_url, proxy, tmp_path):
    proxy.add("stall", r"shard-00003\.arrow", method="GET", times=-1, seconds=60)
    try:
        with fastload.Loader(remote_url, cache_dir=tmp_path / "c", download_timeout=1.5, download_threads=2,
                             batch_size=50, shuffle=False, device="cpu", prefetch=1) as lo:
            assert lo.dataset.cache.policy.timeout_s == 1.5 and lo.dataset.cache.fetcher.threads == 2
            t0 = time.monotonic()
            with pytest.raises(DownloadTimeout, match=r"shard shard-00003\.arrow .*download_timeout") as e:
                for _ in lo:
                    pass
            took = time.monotonic() - t0
            proxy.release_stalls()  # the stalled requests end: closing joins their threads at once
        assert took < 15, f"the stalled shard failed after {took:.1f}s, its deadline is 1.5s"
        assert e.value.shard == "shard-00003.arrow"
    finally:
        proxy.release_stalls()


def test_download_options_are_checked(remote_url, local_ds, tmp_path):
    for kw, match in [(dict(download_timeout=0), "download_timeout=0 must be"),
                      (dict(download_timeout="soon"), "download_timeout='soon' must be"),
                      (dict(download_threads=0), "download_threads=0 must be an int")]:
        with pytest.raises(ValueError, match=match):
            fastload.Loader(remote_url, cache_dir=tmp_path / "c", batch_size=10, device="cpu", **kw)
    with pytest.raises(ValueError, match="apply to remote datasets"):
        fastload.Dataset(local_ds, download_timeout=10)
    with pytest.raises(ValueError, match="apply to remote datasets"):
        fastload.Loader(local_ds, batch_size=10, download_threads=2)


def test_an_image_field_from_a_url(proxy, s3_env, tmp_path):
    """Encoded images read from the cache's mapped shards, decoded by DALI's CPU graph."""
    pytest.importorskip("nvidia.dali")
    from fastload import vision

    path = write_photo_crops(tmp_path / "img", 48, "100KB")
    upload_dir(s3_filesystem(proxy.upstream, "testing", "testing"), path, f"{BUCKET}/img")
    kw = dict(batch_size=8, seed=1, shuffle_mode="window", window=1, transforms={"image": vision.eval(32)},
              device="cpu", prefetch=1)
    with fastload.Loader(path, **kw) as lo:
        assert lo.dataset.num_shards >= 3
        want = batches(lo, epochs=None)
        shard = max(s["bytes"] for s in lo.dataset.manifest["shards"])
    with fastload.Loader(s3_url(proxy.endpoint, "img"), cache_dir=tmp_path / "c", cache_limit=3 * shard, **kw) as lo:
        got = batches(lo, epochs=None)
        st = lo.stats()
    assert_same(got, want)
    assert got[0]["image"].shape == (8, 3, 32, 32) and st["bytes_downloaded"] > 0

"""Ragged fields and sequence packing from a URL (moto behind a fault proxy, 127.0.0.1):
lengths read with byte ranges (never whole shards), checked, kept in the cache; padded,
packed and pack_to batches equal the local dataset's within a small cache budget, across
epochs and after a resume with an empty cache; a damaged ranged read is read again or stops
the run, never used silently."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

import fastload
from _remote import assert_same, batches, BUCKET, DiskSampler, read_ahead_of_planner, read_while_planned, s3_url
from fastload.errors import FormatError
from _servers import s3_filesystem, upload_dir
from fastload.store import ShardWriter

DOCS = 2000


def make_tokens(path, *, first: bool = True, seed: int = 0, docs: int = DOCS):
    """Documents of 0..150 int32 tokens (token t of document d is d * 1000 + t) and a label;
    ~48 kB shards. ``first``: the ragged column comes first (its offsets follow the record
    batch's metadata), else after the label."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 150, docs)
    lengths[::97] = 0
    tokens = [(d * 1000 + np.arange(n)).astype(np.int32) for d, n in enumerate(lengths)]
    spec = {"tokens": "int32[]", "label": "int64"} if first else {"label": "int64", "tokens": "int32[]"}
    with ShardWriter(path, spec, shard_size="48kB") as w:
        w.write_batch({"tokens": tokens, "label": np.arange(docs, dtype=np.int64)})
    return lengths


def _manifest(path) -> dict:
    return json.loads((path / "manifest.json").read_text())


@pytest.fixture
def tok(proxy, tmp_path, s3_env):
    local = tmp_path / "tok"
    lengths = make_tokens(local)
    upload_dir(s3_filesystem(proxy.upstream, "testing", "testing"), local, f"{BUCKET}/tok")
    proxy.log.clear()
    return local, s3_url(proxy.endpoint, "tok"), lengths


def _shard_gets(log, name):
    return [r for r in log if r.method == "GET" and r.path.split("?")[0].endswith("/" + name)]


def test_lengths_are_read_with_byte_ranges_and_kept(tok, proxy, tmp_path):
    local, url, lengths = tok
    m = _manifest(local)
    with fastload.Dataset(url, cache_dir=tmp_path / "c") as ds:
        assert np.array_equal(ds.lengths("tokens"), lengths)
        assert isinstance(ds.lengths("tokens"), np.memmap)  # mapped from the cache: shared by the node's ranks
        cache = ds.cache
        assert not list(cache.dir.glob("*.arrow")), "no shard was downloaded"
        assert (cache.dir / "lengths-tokens.npy").exists()
        st = cache.lengths_stats
    assert st["shards"] == len(m["shards"]) > 8
    for s in m["shards"]:
        gets = _shard_gets(proxy.log, s["file"])
        heads = [r for r in proxy.log if r.method == "HEAD" and r.path.split("?")[0].endswith("/" + s["file"])]
        # the footer, then the metadata with the offsets right behind it (tokens is the first column)
        assert len(gets) == 2 and len(heads) <= 1, [(r.method, r.range) for r in gets]
        assert all(r.range for r in gets)
        got = sum(r.bytes for r in gets)
        assert got <= min(16_384, s["bytes"]) + 1_000 + 8 * (s["num_samples"] + 1) + 64, (got, s["bytes"])
    assert st["bytes"] == sum(r.bytes for r in proxy.log if r.method == "GET" and "shard-" in r.path)
    assert st["bytes"] < 0.5 * sum(s["bytes"] for s in m["shards"])
    # a second open (another run, another rank) reads them from the cache: no request at all
    proxy.log.clear()
    with fastload.Dataset(url, cache_dir=tmp_path / "c") as ds:
        assert np.array_equal(ds.lengths("tokens"), lengths) and isinstance(ds.lengths("tokens"), np.memmap)
        assert np.array_equal(ds[17]["tokens"], 17_000 + np.arange(lengths[17], dtype=np.int32))  # checked on map
    assert [r for r in proxy.log if "shard-" in r.path and r.method == "GET"] == _shard_gets(proxy.log, "shard-00000.arrow")


def test_lengths_of_a_later_column_and_of_cached_shards(proxy, tmp_path, s3_env):
    """The ragged column after another: its offsets take a third request. Shards already in
    the cache are read from disk."""
    local = tmp_path / "tok2"
    lengths = make_tokens(local, first=False, seed=1)
    upload_dir(s3_filesystem(proxy.upstream, "testing", "testing"), local, f"{BUCKET}/tok2")
    url = s3_url(proxy.endpoint, "tok2")
    with fastload.Dataset(url, cache_dir=tmp_path / "c") as ds:
        ds.get_batch([0, 1000])  # shards 0 and the one of sample 1000 come into the cache
        have = {p.name for p in ds.cache.dir.glob("shard-*.arrow")}
        proxy.log.clear()
        assert np.array_equal(ds.lengths("tokens"), lengths)
    for s in _manifest(local)["shards"]:
        gets = _shard_gets(proxy.log, s["file"])
        want = 0 if s["file"] in have else 1 if s["bytes"] <= 16_384 else 3  # a small shard: one read holds all
        assert len(gets) == want, (s["file"], [r.range for r in gets])


@pytest.mark.parametrize("how", ["padded", "packed", "pack_to"])
def test_ragged_batches_from_a_url_equal_local_across_epochs(tok, tmp_path, how):
    local, url, _ = tok
    kw = dict(batch_size=16, seed=3, shuffle_mode="window", window=1, device="cpu", prefetch=2, threads=2)
    if how == "pack_to":
        kw.update(batch_size=4, pack_to=64, fields=["tokens"])
    else:
        kw.update(ragged=how)
    with fastload.Loader(local, **kw) as lo:
        want = batches(lo, epochs=(0, 1))
    limit = 4 * max(s["bytes"] for s in _manifest(local)["shards"])
    with fastload.Loader(url, cache_dir=tmp_path / "c", cache_limit=limit, **kw) as lo:
        assert lo.dataset.cache.lengths_stats["shards"] == lo.dataset.num_shards  # ranged reads, no download
        with DiskSampler(lo.dataset.cache.dir) as disk:
            got = batches(lo, epochs=(0, 1))
        st = lo.stats()
    assert_same(got, want)
    assert disk.peak <= limit, f"{disk.peak} bytes on disk > cache_limit {limit}"
    assert st["evictions"] > 0


@pytest.mark.parametrize("how", ["padded", "packed", "pack_to"])
def test_ragged_resumes_with_an_empty_cache(tok, tmp_path, how):
    local, url, _ = tok
    kw = dict(batch_size=4, seed=5, shuffle_mode="window", window=1, device="cpu", prefetch=2)
    kw.update(dict(pack_to=48, fields=["tokens"]) if how == "pack_to" else dict(ragged=how, batch_size=12))
    with fastload.Loader(local, **kw) as lo:
        want = batches(lo)
    limit = 4 * max(s["bytes"] for s in _manifest(local)["shards"])
    with fastload.Loader(url, cache_dir=tmp_path / "c1", cache_limit=limit, **kw) as lo:
        it = iter(lo)
        first = [{k: v.numpy().copy() for k, v in next(it).items()} for _ in range(40)]
        state = lo.state_dict()
    with fastload.Loader(url, cache_dir=tmp_path / "c2", cache_limit=limit, **kw) as lo:
        lo.load_state_dict(json.loads(json.dumps(state)))
        rest = batches(lo)
    assert_same(first + rest, want)


def test_pack_to_plans_downloads_at_construction(tok, tmp_path):
    """The warm start works in tokens too: the first shard of the packed pass is downloaded
    while the model is built, and no other GET than byte ranges of the offsets came first."""
    import time

    local, url, _ = tok
    kw = dict(batch_size=4, pack_to=64, fields=["tokens"], seed=2, shuffle_mode="window", window=1, device="cpu")
    with fastload.Loader(url, cache_dir=tmp_path / "c", **kw) as lo:
        first = int(np.searchsorted(lo.dataset.shard_starts, lo.sampler.stream(0)[0], side="right") - 1)
        path = lo.dataset.cache.path(first)
        deadline = time.monotonic() + 30
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert path.exists()
        got = batches(lo)
    with fastload.Loader(local, **kw) as lo:
        assert_same(got, batches(lo))


def test_a_damaged_offsets_read_is_read_again(proxy, tmp_path, s3_env):
    """A ranged read of the offsets that comes back damaged in a way the checks see (not
    non-decreasing from 0 to the item count) is read again."""
    local = tmp_path / "tok3"
    lengths = make_tokens(local, first=False, seed=2)
    upload_dir(s3_filesystem(proxy.upstream, "testing", "testing"), local, f"{BUCKET}/tok3")
    name = _manifest(local)["shards"][3]["file"]
    # the third GET of shard 3 is its offsets buffer: byte 4 of entry 10 (~2^32 added)
    f = proxy.add("corrupt", re.escape(name), method="GET", skip=2, times=1, at=8 * 10 + 4)
    with fastload.Dataset(s3_url(proxy.endpoint, "tok3"), cache_dir=tmp_path / "c") as ds:
        assert np.array_equal(ds.lengths("tokens"), lengths)
    assert f.applied == 1
    assert len(_shard_gets(proxy.log, name)) == 6  # twice: footer, metadata, offsets


def test_a_damaged_offsets_read_the_checks_miss_stops_the_run(proxy, tmp_path, s3_env):
    """Damage that keeps the offsets plausible (one entry off by one) is caught when the shard
    is downloaded and verified, before any batch is made from it or after it: the run stops
    naming the sample, the stored lengths are removed, and the next run reads them again."""
    local = tmp_path / "tok4"
    lengths = make_tokens(local, first=False, seed=3)
    m = _manifest(local)
    url = s3_url(proxy.endpoint, "tok4")
    upload_dir(s3_filesystem(proxy.upstream, "testing", "testing"), local, f"{BUCKET}/tok4")
    starts = np.concatenate([[0], np.cumsum([s["num_samples"] for s in m["shards"]])])
    s = 2
    rows = lengths[starts[s]:starts[s + 1]]
    k = next(i for i in range(1, len(rows)) if rows[i - 1] >= 2 and rows[i] >= 2)  # offset k moves by one
    proxy.add("corrupt", re.escape(m["shards"][s]["file"]), method="GET", skip=2, times=1, at=8 * k, xor=1)
    kw = dict(batch_size=4, pack_to=64, fields=["tokens"], seed=4, shuffle=False, device="cpu", prefetch=2)
    with fastload.Loader(local, **kw) as lo:
        want = batches(lo)
    got = []
    with fastload.Loader(url, cache_dir=tmp_path / "c", **kw) as lo:
        bad = lo.dataset.lengths("tokens")
        assert int(np.abs(bad - lengths).sum()) == 2  # the checks could not see it
        with pytest.raises(FormatError, match=rf"sample {starts[s] + k - 1} has {rows[k - 1]} items of 'tokens'.*"
                                              r"damaged ranged read"):
            for b in lo:
                got.append({n: v.numpy().copy() for n, v in b.items()})
        assert not (lo.dataset.cache.dir / "lengths-tokens.npy").exists()
    # every batch delivered before the error is right (the stream is in order: shard 2's
    # documents come after shards 0 and 1)
    assert 0 < len(got) < len(want)
    assert_same(got, want[:len(got)])
    with fastload.Loader(url, cache_dir=tmp_path / "c", **kw) as lo:
        assert np.array_equal(lo.dataset.lengths("tokens"), lengths)
        assert_same(batches(lo), want)


def test_a_mixture_of_remote_ragged_datasets(proxy, tmp_path, s3_env):
    fs = s3_filesystem(proxy.upstream, "testing", "testing")
    locals_, urls = [], []
    for i, name in enumerate(("m1", "m2")):
        make_tokens(tmp_path / name, seed=10 + i, docs=900)
        upload_dir(fs, tmp_path / name, f"{BUCKET}/{name}")
        locals_.append(tmp_path / name)
        urls.append(s3_url(proxy.endpoint, name))
    for extra in (dict(pack_to=32, fields=["tokens"]), dict(ragged="packed")):
        kw = dict(mix=[0.7, 0.3], epoch_size=600, batch_size=6, seed=1, device="cpu", prefetch=2, **extra)
        with fastload.Loader([str(p) for p in locals_], **kw) as lo:
            want = batches(lo, epochs=(0, 1))
        with fastload.Loader(urls, cache_dir=tmp_path / "c", **kw) as lo:
            got = batches(lo, epochs=(0, 1))
        assert_same(got, want)


@pytest.mark.parametrize("ranges", [True, False])
def test_lengths_over_http(tmp_path, ranges):
    """http(s): the same ranged reads (GETs with Range, no HEAD); a server that answers a
    Range with the whole file (200) makes the lengths come from whole shards instead."""
    from _servers import FaultProxy, HttpFileServer

    root = tmp_path / "www"
    lengths = make_tokens(root / "tok", docs=600)
    m = _manifest(root / "tok")
    with HttpFileServer(root, ranges=ranges) as srv, FaultProxy(srv.url.split("//")[1]) as px:
        with fastload.Dataset(f"{px.url}/tok", cache_dir=tmp_path / "c") as ds:
            assert np.array_equal(ds.lengths("tokens"), lengths)
            cached = sorted(p.name for p in ds.cache.dir.glob("shard-*.arrow"))
        gets = [r for r in px.log if "shard-" in r.path]
        if ranges:
            assert cached == [] and all(r.method == "GET" and r.status == 206 for r in gets)
            assert len(gets) <= 2 * len(m["shards"])
        else:
            assert cached == [s["file"] for s in m["shards"]]  # read through the cache
        with pytest.raises(TypeError, match="not a ragged one"):
            ds.lengths("label")


def test_one_rank_of_the_node_reads_the_lengths(tok, proxy, tmp_path):
    """Two readers of one cache directory (two local ranks) ask at once: one reads the lengths
    with byte ranges (under the cache's flock), the other takes them from its file."""
    import threading

    local, url, lengths = tok
    got = {}
    with fastload.Dataset(url, cache_dir=tmp_path / "c") as a, fastload.Dataset(url, cache_dir=tmp_path / "c") as b:
        threads = [threading.Thread(target=lambda d=d, k=k: got.__setitem__(k, d.lengths("tokens")),
                                    name=f"fastload-test-rank{k}") for k, d in enumerate((a, b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert np.array_equal(got[0], lengths) and np.array_equal(got[1], lengths)
    for s in _manifest(local)["shards"]:
        assert len(_shard_gets(proxy.log, s["file"])) == 2  # read once, not once per reader


def test_the_layout_parser_refuses_damage_with_its_own_error(tmp_path):
    """Damaged footers and record batch headers raise LayoutError (read again, then a
    FormatError naming the shard), never a stray IndexError or struct.error."""
    from fastload.remote.ipc_layout import LayoutError, list_column, parse_footer

    make_tokens(tmp_path / "t", first=False, docs=300)
    m = _manifest(tmp_path / "t")
    data = (tmp_path / "t" / m["shards"][0]["file"]).read_bytes()
    footer = parse_footer(data, len(data))
    b = footer.batches[0]
    meta = data[b.offset:b.offset + b.meta_length]
    col = list_column(footer, meta, "tokens")
    off = np.frombuffer(data[col.offsets_at:col.offsets_at + col.offsets_bytes], "<i8")
    assert col.rows == m["shards"][0]["num_samples"] and off[-1] == col.items
    with pytest.raises(LayoutError, match="no column 'nope'"):
        list_column(footer, meta, "nope")
    with pytest.raises(LayoutError, match="not a large_list"):
        list_column(footer, meta, "label")
    rng = np.random.default_rng(0)
    tail_at = len(data) - 10 - int.from_bytes(data[-10:-6], "little")
    outcomes = {"ok": 0, "refused": 0}
    for trial in range(3000):
        tail, head = bytearray(data[tail_at:]), bytearray(meta)
        buf = tail if trial % 2 else head
        for _ in range(rng.integers(1, 4)):
            buf[rng.integers(0, len(buf))] = rng.integers(0, 256)
        try:
            fb = parse_footer(bytes(tail), len(data))
            list_column(fb, bytes(head), "tokens")
            outcomes["ok"] += 1
        except LayoutError:
            outcomes["refused"] += 1
    assert outcomes["refused"] > 100 and outcomes["ok"] > 100, outcomes


def test_a_packed_pass_is_planned_as_its_scan_goes_on(tok, tmp_path, monkeypatch):
    """pack_to over a URL: the training thread scans the first chunk of a packed pass's
    documents (here 97 documents, 100 tokens; at scale 65,536 and 2^22), never the pass or
    the next epoch whole; a background thread scans the rest (slowed down here, so that the
    reader reads while it does): the batches equal the local dataset's over two epochs and a
    resume, within a small cache budget, with shards evicted."""
    import threading
    import time

    import fastload.loader.remote as lr
    import fastload.sampling.packing as packing
    from fastload.remote.schedule import PackScan

    local, url, _ = tok
    kw = dict(batch_size=4, pack_to=64, fields=["tokens"], seed=3, shuffle_mode="window", window=1, device="cpu",
              prefetch=2, threads=1)
    with fastload.Loader(local, **kw) as lo:
        want = batches(lo, epochs=(0, 1))
    monkeypatch.setattr(packing, "CHUNK", 97)
    monkeypatch.setattr(lr, "SYNC_POSITIONS", 100)
    monkeypatch.setattr(lr, "SCAN", 1)  # a chunk per step
    monkeypatch.setattr(lr._Planner, "EVERY_S", 0.0)
    docs: dict[str, int] = {}
    step = PackScan.step

    def slow(self, positions=None):
        before = self.horizon
        step(self, positions)
        if self.horizon > before:
            name = threading.current_thread().name
            docs[name] = docs.get(name, 0) + 1
            if name == "fastload-plan":
                time.sleep(0.03)

    monkeypatch.setattr(PackScan, "step", slow)
    limit = 4 * max(s["bytes"] for s in _manifest(local)["shards"])
    got, scanning, peak, st = read_while_planned(url, tmp_path / "c", limit, kw)
    assert_same(got, want)
    assert peak <= limit and st["evictions"] > 0
    assert sum(scanning) >= 5, (sum(scanning), len(scanning), docs)  # read while planned
    # two passes and the warm start: a chunk each on the training thread, ~21 each in the background
    assert docs.get("MainThread", 0) <= 3 and docs.get("fastload-plan", 0) >= 40, docs
    # a resume: the rest of the pass planned in the background from the resumed position
    n = len(want) // 2
    with fastload.Loader(url, cache_dir=tmp_path / "c1", cache_limit=limit, **kw) as lo:
        it = iter(lo)
        first = [{k: v.numpy().copy() for k, v in next(it).items()} for _ in range(n // 2)]
        state = lo.state_dict()
    with fastload.Loader(url, cache_dir=tmp_path / "c2", cache_limit=limit, **kw) as lo:
        lo.load_state_dict(json.loads(json.dumps(state)))
        rest = batches(lo)
    assert_same(first + rest, want[:n])


def test_a_packed_pass_is_never_read_ahead_of_its_plan(tok, tmp_path, monkeypatch):
    """The background planner of each pass held half a second (a loaded machine: the reader
    far faster than the scan): the reader waits at the first batch past what the caches
    were told, so every shard a prepared batch reads is planned, its use spanning the batch;
    never released (a shard of the previous pass) or evicted (one not planned yet) under a
    batch in flight: the ring's "shard was dropped after the batch was planned" (issue 30, a
    flake of test_a_packed_pass_is_planned_as_its_scan_goes_on). Batches equal the local
    dataset's over two epochs in a tight budget."""
    import fastload.loader.remote as lr
    import fastload.sampling.packing as packing
    from fastload.remote.schedule import PackScan

    local, url, _ = tok
    kw = dict(batch_size=4, pack_to=64, fields=["tokens"], seed=3, shuffle_mode="window", window=1, device="cpu",
              prefetch=2, threads=1)
    with fastload.Loader(local, **kw) as lo:
        want = batches(lo, epochs=(0, 1))
    monkeypatch.setattr(packing, "CHUNK", 97)
    monkeypatch.setattr(lr, "SYNC_POSITIONS", 100)
    monkeypatch.setattr(lr, "SCAN", 1)  # a chunk per step
    monkeypatch.setattr(lr._Planner, "EVERY_S", 0.0)
    limit = 4 * max(s["bytes"] for s in _manifest(local)["shards"])
    got, scanning, violations = read_ahead_of_planner(url, tmp_path / "c", limit, kw, monkeypatch, PackScan,
                                                    step_s=0.03)
    assert not violations, violations[:5]
    assert_same(got, want)
    assert sum(scanning) >= 5, sum(scanning)  # read while planned


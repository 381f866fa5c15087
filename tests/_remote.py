"""Fixtures and helpers shared by the remote-dataset tests (servers on 127.0.0.1 only)."""
from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from _resume import as_numpy, assert_same  # noqa: F401  (assert_same: for the remote tests)
from fastload.remote import RemoteDataset, RetryPolicy, ShardCache, epoch_uses
from _servers import FaultProxy, MotoS3, upload_dir

BUCKET = "fastload-test"
ROWS, DIM = 3000, 64  # float32 rows of 256 B + an int64: ~30 KB of data per shard at 32 KB shards


def make_dataset(path: Path, rows: int = ROWS, shard_size: int = 32_000) -> Path:
    from fastload.store.writer import ShardWriter

    x = (np.arange(rows * DIM, dtype=np.float32) % 9973).reshape(rows, DIM)
    with ShardWriter(path, {"x": f"float32[{DIM}]", "y": "int64"}, shard_size=shard_size) as w:
        w.write_batch({"x": x, "y": np.arange(rows, dtype=np.int64)})
    return path


def batches(loader, epochs=(0,), on_batch=None) -> list[dict]:
    """Every batch of ``epochs`` as numpy arrays (``epochs=None``: the loader's current
    epoch, ``set_epoch`` not called); ``on_batch(i)`` runs after the i-th batch."""
    out = []
    for e in (None,) if epochs is None else epochs:
        if e is not None:
            loader.set_epoch(e)
        for b in loader:
            out.append(as_numpy(b))
            if on_batch is not None:
                on_batch(len(out) - 1)
    return out


@pytest.fixture(scope="session", autouse=True)
def _aws_sdk_event_loop():
    """The AWS SDK starts one event-loop thread ("AwsEventLoop1") with the first S3 client and
    keeps it for the life of the process: start it before any test's thread snapshot."""
    import pyarrow.fs as pafs

    pafs.S3FileSystem(access_key="x", secret_key="x", endpoint_override="127.0.0.1:9", scheme="http",
                      region="us-east-1")


@pytest.fixture(scope="session")
def _local_ds_template(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("local-ds") / "local")


@pytest.fixture
def local_ds(tmp_path, _local_ds_template) -> Path:
    """``make_dataset``'s dataset in this test's own directory: a copy of one made once per
    session (the same bytes; the test may change its copy)."""
    return Path(shutil.copytree(_local_ds_template, tmp_path / "local"))


@pytest.fixture
def moto():
    with MotoS3((BUCKET,)) as srv:
        yield srv


@pytest.fixture
def s3_env(monkeypatch):
    """Credentials moto accepts, from the environment (where real jobs keep them)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    for v in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        monkeypatch.delenv(v, raising=False)


@pytest.fixture
def proxy(moto):
    """A fault-injecting proxy in front of moto."""
    with FaultProxy(moto.endpoint) as p:
        yield p


def upload(srv, local: Path, prefix: str = "ds") -> str:
    fs = srv.filesystem()
    upload_dir(fs, local, f"{BUCKET}/{prefix}")
    return f"{BUCKET}/{prefix}"


def s3_url(endpoint: str, prefix: str = "ds") -> str:
    return f"s3://{BUCKET}/{prefix}?endpoint_override={endpoint}&scheme=http"


@pytest.fixture
def remote_url(moto, proxy, local_ds, s3_env):
    """``local_ds`` uploaded to moto, its URL through the fault proxy."""
    upload(moto, local_ds)
    return s3_url(proxy.endpoint)


def open_remote(endpoint: str, prefix: str = "ds", **storage_options) -> RemoteDataset:
    # max_attempts=1: pyarrow's own request retries off, so the cache's retry layer is what
    # the fault tests see (in production both layers are on)
    storage_options.setdefault("max_attempts", 1)
    return RemoteDataset(s3_url(endpoint, prefix), storage_options=storage_options)


FAST_RETRY = RetryPolicy(attempts=6, backoff_s=0.02, backoff_max_s=0.2, timeout_s=30)
BACKOFF_SCALE = 0.25


@pytest.fixture
def quick_backoff(monkeypatch):
    """The default RetryPolicy's pauses (its own schedule: doubling, full jitter, capped) at
    ``BACKOFF_SCALE`` of their length, for tests that meet faults through a Loader or Dataset
    (which build the default policy themselves): a quarter still spans a 1 s outage within a
    file's 6 attempts (the 5 pauses sum to >= 0.25 * 0.5 * 15.5 s), in a quarter of the wait.
    test_remote_faults.py checks the unscaled schedule."""
    real = RetryPolicy.pause
    monkeypatch.setattr(RetryPolicy, "pause", lambda self, attempt: BACKOFF_SCALE * real(self, attempt))


def make_cache(remote: RemoteDataset, cache_dir: Path, **kw) -> ShardCache:
    kw.setdefault("retry", FAST_RETRY)
    kw.setdefault("local_world_size", 1)
    kw.setdefault("local_rank", 0)
    return ShardCache(remote, cache_dir=cache_dir, **kw)


def shard_starts(remote: RemoteDataset) -> np.ndarray:
    return np.concatenate([[0], np.cumsum([s["num_samples"] for s in remote.manifest["shards"]])]).astype(np.int64)


def window_stream(remote: RemoteDataset, window: int = 1, seed: int = 0, epoch: int = 0) -> np.ndarray:
    from fastload.sampling import window_permutation

    return window_permutation([s["num_samples"] for s in remote.manifest["shards"]], window, seed, epoch)


def read_pass(cache: ShardCache, remote: RemoteDataset, stream: np.ndarray, *, batch: int = 64, start: int = 0,
              end: int | None = None, sample: list | None = None, check: bool = True) -> list[int]:
    """Act as the Loader: ask for the shards of positions up to ``consumed + ahead``, read
    the rows from the cached files, report progress. Returns the shards in the order first
    asked for. With ``check``, every row read equals the dataset's (x[i] pattern)."""
    import pyarrow as pa

    starts = shard_starts(remote)
    end = len(stream) if end is None else end
    asked: list[int] = []
    seen = set()
    for pos in range(start, end, batch):
        hi = min(end, pos + batch + cache.ahead)
        idx = stream[np.arange(pos, hi) % len(stream)]
        sh = np.searchsorted(starts, idx, side="right") - 1
        for s in dict.fromkeys(sh.tolist()):
            p = cache.ensure(int(s))
            if s not in seen:
                seen.add(s)
                asked.append(int(s))
            if check:
                bidx = idx[: min(batch, end - pos)]
                mine = bidx[(np.searchsorted(starts, bidx, side="right") - 1) == s]
                if len(mine):
                    with pa.memory_map(str(p)) as mm:
                        b = pa.ipc.open_file(mm).get_batch(0)
                        y = b.column("y").to_numpy()
                        rows = mine - starts[s]
                        assert np.array_equal(y[rows], mine), f"shard {s}: wrong rows"
        cache.advance(min(end, pos + batch))
        if sample is not None:
            sample.append(cache.disk_usage())
    return asked


def read_while_planned(url, cache_dir: Path, limit, kw: dict, epochs=(0, 1)) -> tuple[list, list, int, dict]:
    """Read ``epochs`` of a remote Loader while its background planner scans: ``(batches, after
    each batch whether the pass's scan was still going on, the disk's peak bytes (DiskSampler),
    the Loader's stats)``."""
    import fastload

    scanning: list[bool] = []
    with fastload.Loader(url, cache_dir=cache_dir, cache_limit=limit, **kw) as lo:
        planner = lambda: lo._remote._planner  # noqa: E731
        with DiskSampler(lo.dataset.cache.dir) as disk:
            got = batches(lo, epochs=epochs, on_batch=lambda i: scanning.append(
                planner() is not None and not planner()._scan.done))
        st = lo.stats()
    return got, scanning, disk.peak, st


def read_ahead_of_planner(url, cache_dir: Path, limit, kw: dict, monkeypatch, scan_cls,
                          epochs=(0, 1), hold_s: float = 0.5, step_s: float = 0.0) -> tuple[list, list, list]:
    """Read ``epochs`` of a remote Loader whose background planner thread (one per pass) is
    held ``hold_s`` at its first step of ``scan_cls`` (PassScan / PackScan), and ``step_s``
    at each (so that the reader reads while it scans): a reader not held back would read far
    past what the caches were told. ``(batches, after each batch
    whether the pass's scan was still going on, violations)``: each time the Loader's source
    put batches (their shards prepared), every shard they read must be planned in the
    cache's current pass with a use spanning the batch's positions; a violation is
    ``(epoch, first position, shard)`` of one that was not (the cache could release or
    evict it while the batch is in flight)."""
    import fastload
    from fastload.loader.source import RingFedSource  # (BatchSource is a Protocol: no source inherits its put)

    held: list = []
    step = scan_cls.step

    def holding(self, positions=None):
        me = threading.current_thread()
        if me.name == "fastload-plan" and not any(t is me for t in held):
            held.append(me)
            time.sleep(hold_s)
        if me.name == "fastload-plan":
            time.sleep(step_s)
        return step(self, positions)

    monkeypatch.setattr(scan_cls, "step", holding)
    violations: list = []
    loader: list = []
    put = RingFedSource.put
    puts: list = []

    def checked(self, requests):
        put(self, requests)
        puts.append(len(requests))
        (lo,) = loader
        tl = lo.dataset.cache.timeline
        cur = next(p for p in tl._passes if p["k"] == tl.pass_no)["uses"]
        for r in requests:
            p0 = int(r.position)
            p1 = p0 + (int(np.sum(r.count)) if r.count is not None else len(r.index))
            for s in np.unique(lo.dataset.locate(r.index, check=False, verify=False)[0]).tolist():
                j = np.flatnonzero(cur.shards == s)
                if not np.any((cur.first[j] < p1) & (cur.last[j] >= p0)):
                    violations.append((cur.epoch, p0, s))

    monkeypatch.setattr(RingFedSource, "put", checked)
    scanning: list[bool] = []
    with fastload.Loader(url, cache_dir=cache_dir, cache_limit=limit, **kw) as lo:
        loader.append(lo)
        planner = lambda: lo._remote._planner  # noqa: E731
        got = batches(lo, epochs=epochs, on_batch=lambda i: scanning.append(
            planner() is not None and not planner()._scan.done))
    assert len(held) >= len(epochs), "a pass was planned without the background planner"
    assert sum(puts) >= len(got), "the check never saw the batches put"
    return got, scanning, violations


class DiskSampler:
    """Samples the bytes of shards and partial downloads in a directory every ``every`` s
    in a background thread (the budget must hold at every moment, not only between steps)."""

    def __init__(self, directory: Path, every: float = 0.002):
        self.directory = directory
        self.every = every
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="fastload-test-disk-sampler", daemon=True)

    def _run(self):
        while not self._stop.is_set():
            sizes: dict[int, int] = {}  # by inode: a scan is no snapshot, and a download renamed
            try:                        # from .part to .arrow during it may be listed under both names
                for e in os.scandir(self.directory):
                    if e.name.endswith((".arrow", ".part")):
                        try:
                            st = e.stat()
                        except FileNotFoundError:
                            continue
                        sizes[st.st_ino] = st.st_size
            except FileNotFoundError:
                pass
            self.samples.append(sum(sizes.values()))
            time.sleep(self.every)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()

    @property
    def peak(self) -> int:
        return max(self.samples, default=0)


class PlannedCache:
    """What a background planner (``fastload.loader.remote._Planner``) hands a cache,
    recorded in ``updates`` (pass_no 1: the pass it plans)."""

    limit = 1 << 62
    pass_no = 1

    def __init__(self):
        self.updates: list = []

    def update(self, pass_no, uses, next_uses=None):
        self.updates.append((uses, next_uses))
        return True

    def minimum_limit(self, uses):
        return 0

    def fail(self, error):
        self.updates.append(error)


class PlannerOwner:
    """A RemoteShards as a _Planner sees it: one cache, and the next pass's scan (``nxt``, or
    ``nxt(epoch, start, check)`` making it)."""

    def __init__(self, cache, nxt):
        self._caches, self._nxt = [cache], nxt

    def _check(self, seen):
        pass

    def _parts(self, uses):
        return [uses]

    def _scan(self, epoch, start, check=None):
        return self._nxt(epoch, start, check) if callable(self._nxt) else self._nxt


__all__ = ["_aws_sdk_event_loop", "BUCKET", "DiskSampler", "FAST_RETRY", "epoch_uses", "local_ds", "make_cache", "make_dataset", "moto",
           "open_remote", "PlannedCache", "PlannerOwner", "quick_backoff", "proxy", "read_ahead_of_planner", "read_pass",
           "s3_env", "s3_url", "shard_starts", "upload", "window_stream"]

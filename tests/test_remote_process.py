"""A remote Dataset in other processes: forked children (DataLoader workers) read without
hanging, and pickles (spawn / forkserver workers) reopen the same place, never carrying a
secret."""
from __future__ import annotations

import os
import pickle
import select
import signal
import time

import numpy as np
import pytest

import fastload
from _remote import (  # noqa: F401  (fixtures)
    _aws_sdk_event_loop, BUCKET, local_ds, moto, proxy, s3_env, s3_url, upload,
)
from fastload.errors import RemoteError
from fastload.remote.testing import s3_filesystem, upload_dir

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


@pytest.fixture
def remote_url(proxy, local_ds, s3_env):
    upload_dir(s3_filesystem(proxy.upstream, "testing", "testing"), local_ds, f"{BUCKET}/ds")
    return s3_url(proxy.endpoint)


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

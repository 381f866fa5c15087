"""gs:// through pyarrow's GcsFileSystem against a Google Cloud Storage emulator on 127.0.0.1
(the gcp-storage-emulator package): the Dataset and the Loader read what the local copy
holds, and a pickle reopens the same endpoint. (Azure's emulator, Azurite, is an npm
package, not a pip one; az:// is covered by URL and option checks only.)"""
from __future__ import annotations

import pickle

import numpy as np
import pytest

import fastload
from _remote import DiskSampler
from _servers import GcsEmulator, upload_dir

pytestmark = pytest.mark.skipif(GcsEmulator.binary() is None, reason="gcp-storage-emulator is not installed")


@pytest.fixture
def gcs(local_ds):
    with GcsEmulator(("fastload-test",)) as srv:
        upload_dir(srv.filesystem(), local_ds, "fastload-test/ds")
        yield srv


def test_gs_dataset_and_loader_equal_the_local_copy(gcs, local_ds, tmp_path):
    url = "gs://fastload-test/ds"
    with fastload.Dataset(url, cache_dir=tmp_path / "c", storage_options=gcs.storage_options) as ds, \
            fastload.Dataset(local_ds) as local:
        assert ds.path == url and len(ds) == len(local)
        idx = np.random.default_rng(0).permutation(len(ds))[:500]
        got, want = ds.get_batch(idx), local.get_batch(idx)
        assert all(np.array_equal(got[k], want[k]) for k in want)
        with pickle.loads(pickle.dumps(ds)) as again:  # anonymous + endpoint: nothing secret, same place
            assert again[1234]["y"] == 1234
    kw = dict(batch_size=50, seed=4, shuffle_mode="window", window=1, device="cpu", prefetch=2)
    with fastload.Loader(local_ds, **kw) as lo:
        want = [b["x"].numpy().copy() for b in lo]
        limit = 4 * max(s["bytes"] for s in lo.dataset.manifest["shards"])
    with fastload.Dataset(url, cache_dir=tmp_path / "c2", cache_limit=limit,
                          storage_options=gcs.storage_options) as ds, fastload.Loader(ds, **kw) as lo:
        with DiskSampler(ds.cache.dir) as disk:
            got = [b["x"].numpy().copy() for b in lo]
        st = lo.stats()
    assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want))
    assert disk.peak <= limit and st["evictions"] > 0

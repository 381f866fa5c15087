"""Ragged fields, mixtures and transforms on the CUDA delivery, against the fake torch.cuda
(tests/fake_cuda.py: the fake GPU copies host memory only when it runs, so a batch that is
byte-exact here was kept alive and ordered right)."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import fastload
from fastload import Loader
from fastload.store import Ragged


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("rc") / "ds"
    rng = np.random.default_rng(0)
    lens = rng.integers(0, 40, 120)
    with fastload.ShardWriter(path, {"tokens": "int32[]", "label": "int64", "name": "string"}, shard_size="3KB") as w:
        w.write_batch({"tokens": Ragged.from_lengths(rng.integers(0, 1000, int(lens.sum()), dtype=np.int32), lens),
                       "label": np.arange(120) % 5, "name": [f"d{i}" for i in range(120)]})
    return fastload.Dataset(path)


def _host(b):
    return {k: (v.cpu().numpy() if isinstance(v, torch.Tensor) else v) for k, v in b.items()}


def _same(gpu_batches, cpu_batches):
    assert len(gpu_batches) == len(cpu_batches)
    for g, c in zip(gpu_batches, cpu_batches):
        assert g.keys() == c.keys()
        for k in g:
            if isinstance(g[k], list):
                assert g[k] == c[k]
            else:
                assert g[k].dtype == c[k].dtype and g[k].tobytes() == c[k].tobytes(), k


@pytest.mark.parametrize("kw", [{}, {"ragged": "packed"}, {"pack_to": 32, "fields": ["tokens", "label"]},
                                {"pad_to_multiple": 8, "fields": ["tokens", "label", "name"]}])
def test_ragged_batches_on_the_gpu_equal_the_cpu_ones(fake, corpus, kw):
    with Loader(corpus, batch_size=8, seed=3, device="cpu", **kw) as lo:
        want = [_host(b) for b in lo]
    with Loader(corpus, batch_size=8, seed=3, device="cuda:1", **kw) as lo:
        got = list(lo)  # nothing forced the fake GPU to run yet
        assert all(b["tokens"].is_cuda for b in got)
        _same([_host(b) for b in got], want)


def test_transforms_on_cuda_host_first_then_device_on_the_copy_stream(fake, corpus):
    seen = {}

    def host(b):
        seen.setdefault("host", (threading.current_thread().name, b["tokens"].is_cuda))
        return {**b, "twice": b["label"] * 2}

    def device(b):
        seen.setdefault("device", (b["twice"].is_cuda, torch.cuda.current_stream(torch.device("cuda:0")).cuda_stream))
        return b

    with Loader(corpus, batch_size=8, seed=1, device="cpu", batch_transform=host) as lo:
        want = [_host(b) for b in lo]
    with Loader(corpus, batch_size=8, seed=1, device="cuda:0", batch_transform=host, device_transform=device) as lo:
        got = [_host(b) for b in lo]
    _same(got, want)
    assert seen["host"] == ("fastload-transform", False)
    assert seen["device"][0] is True and seen["device"][1] != 0  # fastload's copy stream, not the default


def test_a_mixture_on_the_gpu(fake, corpus, tmp_path):
    with fastload.ShardWriter(tmp_path / "b", {"tokens": "int32[]", "label": "int64", "name": "string"}) as w:
        w.write_batch({"tokens": [np.full(i % 3, 7, np.int32) for i in range(10)], "label": np.zeros(10, np.int64),
                       "name": [f"b{i}" for i in range(10)]})
    kw = dict(mix=[0.75, 0.25], epoch_size=64, batch_size=8, seed=2, fields=["tokens", "label"])
    with Loader([corpus, fastload.Dataset(tmp_path / "b")], device="cpu", **kw) as lo:
        want = [_host(b) for b in lo]
    with Loader([corpus, fastload.Dataset(tmp_path / "b")], device="cuda:0", **kw) as lo:
        got = [_host(b) for b in lo]
    _same(got, want)
    assert all(np.bincount(b["source"], minlength=2).tolist() == [6, 2] for b in got)

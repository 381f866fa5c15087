"""``fastload bench`` on CUDA (F13), against the fake torch.cuda: the simulated step is GPU
work on the training stream (not a host sleep), and an epoch's clock stops only after the
device has finished the work its batches caused."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import fastload
from fake_cuda import FakeCuda, fake_dali_on_gpu
from fastload.bench import runs
from fastload.bench.cli import BenchOptions


@pytest.fixture
def raw(tmp_path):
    with fastload.ShardWriter(tmp_path / "ds", {"x": "float32[16]", "label": "int64"}, label="label") as wr:
        wr.write_batch({"x": np.zeros((1000, 16), np.float32), "label": np.arange(1000) % 3})
    return tmp_path / "ds"


def test_cuda_step_is_gpu_work_and_the_clock_waits_for_the_device(raw, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    fake = FakeCuda.install(monkeypatch, device_count=1)
    slept = []
    monkeypatch.setattr(runs.time, "sleep", slept.append)
    o = BenchOptions(batch_size=64, transform="none", device="cuda", warmup=0, step_ms=4.0, progress=False)
    m = runs.run_fastload(raw, o)
    assert m.extra["device"] == "cuda" and m.samples == 1000
    assert slept == []  # no host sleep stands in for the step
    calls = fake.calls_of(thread="MainThread")
    steps = [i for i, c in enumerate(calls) if c.kind == "kernel" and c.info.get("cycles") == int(4e-3 * fake.clock_hz)]
    assert len(steps) == 16  # one 4 ms GPU step per batch, calibrated against the device's clock
    assert all(calls[i].info["stream"] == torch.cuda.default_stream(0) for i in steps)  # the training stream
    syncs = [i for i, c in enumerate(calls) if c.kind == "device_synchronize"]
    assert syncs and syncs[-1] > steps[-1]  # the clock stopped after the device finished


@pytest.fixture
def images(tmp_path):
    from fastload.demo.photos import make_image_folder

    make_image_folder(tmp_path / "src", 24, seed=0, min_side=64, max_side=96)
    fastload.convert("imagefolder", tmp_path / "src", tmp_path / "ds", progress=False)
    return tmp_path / "ds"


def test_the_limit_runs_dali_on_the_loader_s_gpu(images, monkeypatch):
    """``--limit`` with images on a GPU: "DALI alone" runs the same CUDA graph on the GPU the
    Loader used (a CUDA graph without a device id does not run: DALI's CPU-only mode)."""
    from fastload.pipeline import Runner

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    fake = FakeCuda.install(monkeypatch, device_count=2)
    builds = fake_dali_on_gpu(fake, monkeypatch)
    ids = []
    fake_build = Runner._build
    monkeypatch.setattr(Runner, "_build", lambda self: (ids.append((self.device, self.device_id)), fake_build(self))[1])
    torch.cuda.set_device(1)  # the script's GPU: the Loader delivers there
    o = BenchOptions(batch_size=8, transform="eval224", device="cuda", warmup=0, limit=True, progress=False)
    report = runs.run(images, o)
    ours, limit = report["results"]
    assert ours["system"] == "fastload Loader" and limit["system"].startswith("DALI alone")
    assert ours["samples"] == limit["samples"] == 24
    assert builds and set(ids) == {("cuda", 1)}, ids  # every CUDA graph on cuda:1, the limit's too
    assert fake.contexts == {1}, fake.devices_by_thread()


def test_cpu_step_is_a_host_sleep(monkeypatch):
    slept = []
    monkeypatch.setattr(runs.time, "sleep", slept.append)
    step = runs.Step(0.004, torch.device("cpu"))
    step()
    step.finish()
    assert slept == [0.004] and step.cycles == 0

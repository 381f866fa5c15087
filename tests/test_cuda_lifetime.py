"""Lifetimes and stream order on the CUDA delivery, against the fake CUDA (tests/fake_cuda.py)
as a training loop really uses batches: each step is *queued* on the consumer's stream and
runs later, and the loop drops the batch before the GPU got to it. The fake's caching
allocator then hands the batch's device memory out again as torch's does (on its allocation
stream at once, unless ``record_stream`` recorded the consumer's stream), a ring slot is
poisoned the moment its last view goes, a pending copy reads its host source by address when
it runs, and a tensor used on a stream that never waited for its allocation is flagged. So
each of these fails here: releasing a slot before its copy ran, dropping ``record_stream``,
allocating DALI's output on a stream other than the copying one, and a missing wait
(``tools/cuda_mutations.py`` checks that they do).

Also G1 (a device transform of GPU-decoded images does not wait for the training stream),
G6 (a GPU run leaves standard error alone), G7 (the device of a rank of a job on fewer GPUs
than the node has) and G8 (fastload's streams are its own, not torch's shared pool's)."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from fake_cuda import POISON, FakeCuda, fake_dali_on_gpu

import fastload
from fastload import Loader, vision

EVAL = vision.eval(32, resize=40, dtype="uint8", layout="HWC")


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    path = tmp_path_factory.mktemp("raw") / "ds"
    rng = np.random.default_rng(0)
    x = rng.standard_normal((640, 7, 5)).astype(np.float32)
    with fastload.ShardWriter(path, {"x": "float32[7,5]", "label": "int64"}, label="label",
                              shard_size="32KB") as wr:
        wr.write_batch({"x": x, "label": np.arange(640) % 7})
    return fastload.Dataset(path), x


def _cpu_images(ds, **kw):
    from unittest import mock

    from fastload.pipeline import presets

    with mock.patch.object(presets._Normalized, "finishes_on_cpu", False), Loader(ds, device="cpu", **kw) as lo:
        return [{k: v.clone() for k, v in b.items()} for b in lo]


def _queued_steps(fake, lo, names) -> list[list]:
    """A training loop whose steps run later on the GPU: each step reads ``names`` of its
    batch when the fake GPU gets to it; the loop keeps no reference to the batch."""
    steps = []
    for b in lo:
        steps.append(fake.consume(*(b[n] for n in names)))
    return steps


def test_raw_batches_read_by_steps_that_run_later_are_exact(fake, raw):
    """Record_stream keeps each batch's device memory from the next batches' copies until the
    step ran; the slot stays leased until its copy ran (a released slot is poisoned)."""
    ds, x = raw
    with Loader(ds, batch_size=64, device="cuda:1", shuffle=False) as lo:
        steps = _queued_steps(fake, lo, ["x", "index"])
        assert fake.poisoned_slots > 0  # slots did go back to the ring meanwhile
        torch.cuda.synchronize(1)
    assert all(len(s) == 2 for s in steps), "a queued step never ran"
    got = np.concatenate([s[0].numpy() for s in steps])
    assert np.array_equal(got, x), "a step read device memory that had been reused, or a poisoned slot"
    assert np.concatenate([s[1].numpy() for s in steps]).tolist() == list(range(len(ds)))
    assert fake.hazards == []


def test_image_batches_read_by_steps_that_run_later_are_exact(fake, image_ds, monkeypatch):
    fake_dali_on_gpu(fake, monkeypatch)
    kw = dict(batch_size=4, shuffle=False, transforms={"image": EVAL})
    ref = _cpu_images(image_ds, **kw)
    with Loader(image_ds, device="cuda:1", **kw) as lo:
        steps = _queued_steps(fake, lo, ["image", "label", "index"])
        torch.cuda.synchronize(1)
    assert len(steps) == len(ref) == 15
    for (img, label, index), r in zip(steps, ref, strict=True):
        assert index.tolist() == r["index"].tolist()
        assert torch.equal(label, r["label"])
        assert torch.equal(img, r["image"]), "a step read DALI's output after its memory was reused"
    assert fake.hazards == []


def test_dali_output_is_allocated_on_the_stream_that_copies_it(fake, image_ds, monkeypatch):
    fake_dali_on_gpu(fake, monkeypatch)
    with Loader(image_ds, batch_size=8, device="cuda:1", shuffle=False, transforms={"image": EVAL}) as lo:
        b = next(iter(lo))
        block = b["image"]._block
        dali = [c for c in fake.copies if c.src == "dali"]
        assert block.stream in {c.stream for c in dali} and block.stream.cuda_stream != 0
    assert fake.hazards == []


def test_a_slot_released_before_its_copy_ran_shows(fake):
    """What the lifetime rule prevents, shown: a copy queued out of a slot whose lease is gone
    reads the poisoned slot (the fake's copy holds no reference to its source)."""
    from fastload.ring.ring import Ring

    x = np.arange(64 * 4, dtype=np.int64).reshape(64, 4)
    with Ring({"x": (np.int64, (4,)), "index": (np.int64, ())}, 8, {"x": [x]}, index_field="index", threads=1,
              slots=4) as ring:
        rt = torch.cuda.cudart()
        mem = ring.slot_memory(0)
        assert int(rt.cudaHostRegister(mem.ctypes.data, mem.nbytes, 1)) == 0
        try:
            ring.submit(np.zeros(8, np.int64), np.arange(8), index=np.arange(8))
            rb = ring.get_batch()
            assert rb.slot == 0
            dev = rb.tensors["x"].to("cuda:0", non_blocking=True)
            del rb  # the slot goes back before the GPU ran the copy
            torch.cuda.synchronize(0)
            assert (dev.cpu().numpy().view(np.uint8) == POISON).all()
        finally:
            rt.cudaHostUnregister(mem.ctypes.data)


# -- G1: the device transform of GPU-decoded images -----------------------------------------------
def test_device_transform_of_gpu_images_never_waits_for_the_training_stream(fake, image_ds, monkeypatch):
    fake_dali_on_gpu(fake, monkeypatch)
    seen = []

    def flip(batch):
        seen.append(torch.cuda.current_stream(torch.device("cuda", 1)).cuda_stream)
        return {**batch, "image": batch["image"]}

    kw = dict(batch_size=8, shuffle=False, transforms={"image": EVAL})
    ref = _cpu_images(image_ds, **kw)
    with Loader(image_ds, device="cuda:1", device_transform=flip, **kw) as lo:
        got = [(b["image"].cpu(), b["index"].cpu()) for b in lo]
    for (img, idx), r in zip(got, ref, strict=True):
        assert torch.equal(img, r["image"]) and idx.tolist() == r["index"].tolist()
    assert seen and 0 not in seen  # on fastload's stream
    training = fake._default[1]
    bg = [c for c in fake.calls if c.thread.startswith("fastload") and c.kind in ("event_wait", "event_record")]
    assert bg, "no stream order at all in the background"
    into_training = [c for c in bg if c.info["stream"] == training]
    assert into_training == [], "a background thread waits or records on the training stream (G1)"
    waited = {c.info["event"].stream for c in bg if c.kind == "event_wait"}
    assert training not in waited, "the transform waits for the training stream (G1): no overlap"


# -- G6: standard error during GPU runs -------------------------------------------------------------
def test_a_gpu_run_leaves_standard_error_alone_and_the_search_captures_it(fake, monkeypatch, tmp_path):
    from fastload.pipeline import quiet
    from fastload.pipeline.runner import Runner

    fake_dali_on_gpu(fake, monkeypatch)
    captured = []
    real_once = Runner._run_once

    def run_once(self, encoded, params, capture=True):
        captured.append((self.device, capture))
        return real_once(self, encoded, params, capture)

    monkeypatch.setattr(Runner, "_run_once", run_once)
    import io

    from PIL import Image

    path = tmp_path / "ds"
    with fastload.ShardWriter(path, {"image": "image", "label": "int64"}) as wr:
        for i in range(8):
            b = io.BytesIO()
            Image.fromarray(np.full((48, 48, 3), i * 20, np.uint8)).save(b, "JPEG")
            data = b.getvalue() if i != 5 else b"\xff\xd8\xff" + b"junk" * 30
            wr.write({"image": data, "label": i}, key=f"{i}.jpg", image_sizes={"image": (48, 48)})
    with Loader(fastload.Dataset(path), batch_size=8, device="cuda:0", transforms={"image": EVAL},
                on_error="skip", shuffle=False) as lo:
        b = next(iter(lo))
        assert 5 not in b["index"].cpu().tolist()
    gpu = [c for d, c in captured if d == "cuda"]
    assert gpu and gpu[0] is False, "the first GPU run captured the process's standard error (G6)"
    assert any(c for d, c in captured if d == "cpu"), "the search for the bad sample should capture"
    assert quiet._depth == 0


# -- G7: ranks on fewer GPUs than the node has --------------------------------------------------------
def test_a_rank_that_put_its_model_on_its_local_gpu_gets_batches_there(monkeypatch):
    from fastload.runtime import device as D

    FakeCuda.install(monkeypatch, device_count=8)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    model = torch.zeros(16, device="cuda:3")  # model.to(f"cuda:{local_rank}"), no set_device
    assert D.resolve_device(None) == torch.device("cuda", 3)
    del model


def test_an_ambiguous_rank_keeps_the_current_device_and_says_so(monkeypatch, caplog):
    from fastload.runtime import device as D

    FakeCuda.install(monkeypatch, device_count=8)
    monkeypatch.setattr(D, "_warned_ambiguous", False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    torch.cuda.current_device()  # used CUDA, holds nothing anywhere
    with caplog.at_level(logging.WARNING, logger="fastload"):
        assert D.resolve_device(None) == torch.device("cuda", 0)
    assert "torch.cuda.set_device(3)" in caplog.text


# -- G8: streams of fastload's own --------------------------------------------------------------------
def test_fastload_s_streams_are_its_own_and_reused_after_close(fake, raw):
    ds, _ = raw
    user = torch.cuda.Stream(device=1)  # the script's streams come from torch's pool
    with Loader(ds, batch_size=64, device="cuda:1", shuffle=False) as lo:
        next(iter(lo))
        side = lo._machinery._delivery._stream
    made = [c.info["handle"] for c in fake.calls_of("cudaStreamCreateWithFlags")]
    assert side.cuda_stream in made and side != user and side not in fake.streams[:1]
    assert all(c.info["flags"] == 1 for c in fake.calls_of("cudaStreamCreateWithFlags"))  # non-blocking
    assert {c.device for c in fake.calls_of("cudaStreamCreateWithFlags")} == {1}
    with Loader(ds, batch_size=64, device="cuda:1", shuffle=False) as lo:
        next(iter(lo))
        assert lo._machinery._delivery._stream == side
    assert len(fake.calls_of("cudaStreamCreateWithFlags")) == len(made)


def test_without_a_reachable_runtime_the_stream_is_torch_s(fake, monkeypatch):
    from fastload.runtime import device as D

    monkeypatch.setattr(D, "_torch_cudart", lambda: None)
    s = D.private_stream(torch.device("cuda", 1))
    assert s.device_index == 1 and fake.calls_of("cudaStreamCreateWithFlags") == []
    D.release_stream(s)  # a pooled torch stream: not kept
    assert D._free_streams == {}


def test_a_device_transform_that_raises_keeps_the_slot_until_its_copy_ran(fake):
    """The copies are queued before the transform runs: when it raises, the slot must still
    wait for them (and close() for them before unregistering the slot)."""
    from fastload.loader.cuda import CudaDelivery
    from fastload.ring.ring import Ring
    from fastload.runtime.device import guard

    x = np.arange(64 * 4, dtype=np.int64).reshape(64, 4)
    with Ring({"x": (np.int64, (4,)), "index": (np.int64, ())}, 8, {"x": [x]}, index_field="index", threads=1,
              slots=4) as ring:
        delivery = CudaDelivery(ring, torch.device("cuda", 1))
        try:
            ring.submit(np.zeros(8, np.int64), np.arange(8), index=np.arange(8))

            def boom(batch):
                raise ZeroDivisionError

            with pytest.raises(ZeroDivisionError):
                delivery.deliver(ring.get_batch(), device_fn=boom)
            assert ring.stats()["in_use"] == 1 and fake.poisoned_slots == 0  # held by the queued copy
            fake.run_gpu()
            with guard(torch.device("cuda", 1)):
                delivery._reap(block=False)
            assert ring.stats()["in_use"] == 0 and fake.poisoned_slots == 1
        finally:
            delivery.close()  # raises CudaHazard if it unregistered under a queued copy
    assert fake.hazards == []

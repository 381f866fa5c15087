"""The Loader's CUDA delivery against a fake torch.cuda (tests/fake_cuda.py): what it asks of
the GPU, without a GPU. The fake GPU runs work only when the host waits for it (or the test
says so), copies read their source when they run and device tensors start as POISON bytes,
so a batch that is exact here was ordered right: its host slot was not refilled before its
copy ran, and the consumer's stream waited for the copy before reading.

Review tests B-D, F, G, J and the checks for F2-F12."""
from __future__ import annotations

import io
import logging

import numpy as np
import pytest
import torch
from PIL import Image

import fastload
from fake_cuda import ERROR_MEMORY_ALLOCATION, FakeCuda, fake_dali_on_gpu
from fastload import DecodeError, Loader, vision
from fastload.demo.photos import photos


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    path = tmp_path_factory.mktemp("raw") / "ds"
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1000, 7, 5)).astype(np.float32)
    with fastload.ShardWriter(path, {"x": "float32[7,5]", "label": "int64"}, label="label",
                              shard_size="32KB") as wr:
        wr.write_batch({"x": x, "label": np.arange(1000) % 7})
    return fastload.Dataset(path), x


def _jpeg(a: np.ndarray) -> bytes:
    b = io.BytesIO()
    Image.fromarray(a).save(b, "JPEG", quality=90)
    return b.getvalue()


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """40 photo crops (JPEG), several shards; sample 13 is not an image."""
    path = tmp_path_factory.mktemp("img") / "ds"
    p = list(photos(["astronaut", "chelsea", "coffee"]).values())
    rng = np.random.default_rng(1)
    with fastload.ShardWriter(path, {"image": "image", "label": "int64"}, label="label", shard_size="100KB") as wr:
        for i in range(40):
            if i == 13:
                wr.write({"image": b"\xff\xd8\xff" + b"junk" * 40, "label": 1}, key="bad/013.jpg",
                         image_sizes={"image": (64, 64)})
                continue
            src = p[i % len(p)]
            h, w = rng.integers(60, 120), rng.integers(60, 120)
            wr.write({"image": _jpeg(src[:h, :w]), "label": i % 4}, key=f"img{i:03d}.jpg")
    return fastload.Dataset(path)


EVAL = vision.eval(32, resize=40, dtype="uint8", layout="HWC")


def _h2d(fake):
    return [c for c in fake.copies if c.src == "cpu"]


def _cpu_reference(ds, epoch=0, **kw):
    """The same batches (of ``epoch``) from a CPU Loader whose presets run their whole graph
    in DALI, as the (fake) GPU does: on the CPU they resize in torch instead (host_tail.py)."""
    from unittest import mock

    from fastload.pipeline import presets

    with mock.patch.object(presets._Normalized, "finishes_on_cpu", False), Loader(ds, device="cpu", **kw) as lo:
        lo.set_epoch(epoch)
        return [{k: v.clone() for k, v in b.items()} for b in lo]


# -- raw fields ---------------------------------------------------------------------------------
def test_raw_batches_are_async_pinned_copies_on_a_side_stream_and_byte_exact(fake, raw):
    ds, x = raw
    with Loader(ds, batch_size=64, device="cuda:1", shuffle=False) as lo:
        batches = list(lo)  # the fake GPU runs only when the host waits: nothing forced it yet
        copies = _h2d(fake)
        assert copies and all(c.non_blocking for c in copies), "a blocking host-to-device copy (F2)"
        assert all(c.src_pinned for c in copies), "a copy from pageable memory"
        assert {c.stream.cuda_stream for c in copies} != {0}  # the side stream, not the default one
        assert {c.dst for c in copies} == {"cuda:1"}
        row = 7 * 5 * 4 + 8 + 8  # x, label, index
        assert sum(c.nbytes for c in copies) == len(ds) * row
        # read on the consumer's stream: it waited for the copies, whose slots were kept
        idx = np.concatenate([b["index"].cpu().numpy() for b in batches])
        assert idx.tolist() == list(range(len(ds)))
        got = np.concatenate([b["x"].cpu().numpy() for b in batches])
        assert np.array_equal(got, x)
        assert all(b["x"].is_cuda and b["index"].is_cuda for b in batches)


def test_raw_path_under_torchrun_uses_only_its_own_gpu(fake, raw, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    ds, _ = raw
    with Loader(ds, batch_size=100, shuffle=False) as lo:
        assert lo.device == torch.device("cuda", 1)
        for _ in lo:
            pass
    assert fake.contexts == {1}, f"CUDA calls on other devices (F3): {fake.devices_by_thread()}"


def test_two_ranks_on_four_gpus_use_local_rank_and_only_that_gpu(raw, monkeypatch):
    """F3/F11 with torch's lazy initialisation: a rank that has not used CUDA yet gets
    cuda:LOCAL_RANK even when LOCAL_WORLD_SIZE != device_count (asking for the current
    device must not count as using CUDA), and touches no other GPU."""
    fake = FakeCuda.install(monkeypatch, device_count=4)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    ds, x = raw
    with Loader(ds, batch_size=100, shuffle=False) as lo:
        assert lo.device == torch.device("cuda", 1)
        got = np.concatenate([b["x"].cpu().numpy() for b in lo])
    assert np.array_equal(got, x)
    assert fake.contexts == {1}, f"CUDA calls on other devices (F3): {fake.devices_by_thread()}"


def test_a_batch_transform_runs_on_the_loader_s_gpu(fake, raw):
    """The fastload-transform thread (batch_transform / device_transform) selects the loader's
    device before it runs any code: a transform that touches CUDA uses cuda:1, not cuda:0."""
    import threading

    ds, x = raw
    seen = []

    def double(batch):
        seen.append((threading.current_thread().name, torch.cuda.current_device()))
        return {**batch, "x": batch["x"] * 2}

    with Loader(ds, batch_size=100, device="cuda:1", shuffle=False, batch_transform=double) as lo:
        got = np.concatenate([b["x"].cpu().numpy() for b in lo])
    assert np.array_equal(got, 2 * x)
    assert set(seen) == {("fastload-transform", 1)}, seen
    first = fake.calls_of(thread="fastload-transform")[0]
    assert (first.kind, first.device) == ("set_device", 1), first
    assert fake.contexts == {1}, f"CUDA calls on other devices (F3): {fake.devices_by_thread()}"


def test_every_slot_is_pinned_once_when_created_and_unpinned_at_close(fake, raw):
    ds, _ = raw
    lo = Loader(ds, batch_size=64, device="cuda:0", shuffle=False)
    try:
        it = iter(lo)
        next(it)
        ring = lo._machinery._ring
        initial = {ring.slot_memory(s).ctypes.data: ring.slot_memory(s).nbytes for s in range(ring.num_slots)}
        regs = list(fake.registrations)
        assert len(regs) == len(initial), "slots are pinned lazily, on first delivery (F8)"
        assert {p: s for p, s, _f in regs} == initial  # each slot once, its whole memory
        assert all(p % 4096 == 0 and f == 1 for p, _s, f in regs)  # page-aligned, cudaHostRegisterPortable
        for _ in it:  # the fake GPU lags (it runs only when the host waits): the ring may grow
            pass
        every = {ring.slot_memory(s).ctypes.data for s in range(ring.num_slots)}
        ptrs = [p for p, _s, _f in fake.registrations]
        assert len(ptrs) == len(set(ptrs)) and set(ptrs) <= every  # grown slots: pinned once, when delivered
    finally:
        lo.close()
    assert sorted(fake.unregistrations) == sorted(ptrs) and fake.registered == {}


def test_a_failed_pin_falls_back_without_leaving_a_cuda_error(fake, raw, caplog):
    ds, x = raw
    fake.register_error = ERROR_MEMORY_ALLOCATION
    with caplog.at_level(logging.WARNING, logger="fastload"), \
            Loader(ds, batch_size=64, device="cuda:0", shuffle=False) as lo:
        b = next(iter(lo))
        assert "pageable" in caplog.text and "ulimit -l" in caplog.text  # what to do about it
        fake.launch_kernel("the training step")  # raises if the failed register left its error (F7)
        assert np.array_equal(b["x"].cpu().numpy(), x[:64])
    assert fake.registered == {}


@pytest.mark.parametrize("fail_at", [0, 2])
def test_a_failed_pin_whose_error_cannot_be_cleared_stops_with_what_to_do(fake, raw, monkeypatch, fail_at):
    """A CUDA runtime fastload cannot reach (statically linked) keeps the failed registration
    as its last error: fastload stops at once, naming the cause and the remedy (no option of
    the public API can ask for pageable memory, so the message names none), and unpins the
    slots it had pinned before."""
    import fastload.loader.cuda as cuda_mod

    ds, _ = raw
    monkeypatch.setattr(cuda_mod, "clear_cuda_error", lambda: None)
    fake.register_error = lambda ptr, size: ERROR_MEMORY_ALLOCATION if len(fake.registrations) == fail_at else 0
    with pytest.raises(RuntimeError, match=f"ring slot {fail_at}") as e, \
            Loader(ds, batch_size=64, device="cuda:0", shuffle=False) as lo:
        next(iter(lo))
    msg = str(e.value)
    assert "ulimit -l" in msg and "pin=" not in msg and "out of memory" in msg, msg
    assert len(fake.registrations) == fail_at and fake.registered == {}  # the pinned ones unpinned


# -- image fields -------------------------------------------------------------------------------
def test_image_batches_on_cuda(fake, images, monkeypatch):
    builds = fake_dali_on_gpu(fake, monkeypatch)
    ref = _cpu_reference(images, batch_size=8, shuffle=False, transforms={"image": EVAL}, on_error="skip")
    with Loader(images, batch_size=8, device="cuda:1", shuffle=False, transforms={"image": EVAL},
                on_error="skip") as lo:
        batches = list(lo)
        threads = {c.thread for c in fake.calls if c.thread.startswith("fastload")}
        assert threads, "no feeder thread made a CUDA call"
        for t in threads:  # each of our threads selects the loader's device before anything else
            first = fake.calls_of(thread=t)[0]
            assert (first.kind, first.device) == ("set_device", 1), f"{t} did not select cuda:1 first (F3)"
        assert fake.contexts == {1}, f"CUDA calls on other devices (F3): {fake.devices_by_thread()}"
        assert fake.blocking_copies() == [], "a blocking copy (F2)"
        dali = [c for c in fake.copies if c.src == "dali"]
        assert dali and all(c.stream.cuda_stream != 0 for c in dali), "DALI's output copied on a default stream (F4)"
        feeder_waits = [w for w in fake.host_waits if w.thread != "MainThread"]
        assert feeder_waits == [], f"the feeder waits on the host before the next DALI run (F4): {feeder_waits}"
        assert all(w.blocking for w in fake.host_waits if w.what == "event"), "a spinning host wait (F12)"
        assert len({rid for _t, rid in builds}) >= 2, "one DALI pipeline: no batch decodes while another copies (F5)"
        for b, r in zip(batches, ref, strict=True):
            assert b["image"].is_cuda and b["index"].is_cuda and b["label"].is_cuda
            assert b["index"].cpu().tolist() == r["index"].tolist()
            assert torch.equal(b["image"].cpu(), r["image"]) and torch.equal(b["label"].cpu(), r["label"])
        assert 13 not in torch.cat([b["index"].cpu() for b in batches]).tolist()  # replaced


def test_images_consumed_under_a_user_stream(fake, images, monkeypatch):
    fake_dali_on_gpu(fake, monkeypatch)
    ref = _cpu_reference(images, batch_size=8, shuffle=False, transforms={"image": EVAL}, on_error="skip")
    user = torch.cuda.Stream(device=1)
    with Loader(images, batch_size=8, device="cuda:1", shuffle=False, transforms={"image": EVAL},
                on_error="skip") as lo, torch.cuda.stream(user):
        for b, r in zip(lo, ref, strict=True):
            assert torch.equal(b["image"].cpu(), r["image"])  # read on `user`, which waited
            assert torch.equal(b["label"].cpu(), r["label"])


def test_a_bad_image_is_located_without_rebuilding_the_gpu_pipeline(fake, images, monkeypatch):
    builds = fake_dali_on_gpu(fake, monkeypatch)
    with Loader(images, batch_size=16, device="cuda:1", shuffle=False, transforms={"image": EVAL}) as lo:
        with pytest.raises(DecodeError, match="bad/013.jpg"):
            for _ in lo:
                pass
    per_runner: dict[int, int] = {}
    for _t, rid in builds:
        per_runner[rid] = per_runner.get(rid, 0) + 1
    assert max(per_runner.values()) <= 2, f"GPU pipeline rebuilt {per_runner} times to find one bad image (F10)"


def test_epochs_on_cuda_through_one_feeder_are_exact(fake, images, monkeypatch):
    """The feeder (and its GPU pipelines) outlives an epoch; nothing is decoded ahead on a GPU
    (it would hold device memory between epochs); both epochs equal the CPU's, batch for batch."""
    fake_dali_on_gpu(fake, monkeypatch)
    kw = dict(batch_size=8, transforms={"image": EVAL}, on_error="skip", seed=5)
    refs = [_cpu_reference(images, e, **kw) for e in range(2)]
    feeders = []
    with Loader(images, device="cuda:1", **kw) as lo:
        for e in range(2):
            lo.set_epoch(e)
            got = list(lo)
            assert lo.stats()["batches_ahead"] == 0
            for b, r in zip(got, refs[e], strict=True):
                assert b["index"].cpu().tolist() == r["index"].tolist()
                assert torch.equal(b["image"].cpu(), r["image"]) and torch.equal(b["label"].cpu(), r["label"])
            feeders.append(lo._machinery.feeder())  # noqa: SLF001
        assert feeders[0] is feeders[1] and fake.contexts == {1}


def test_cuda_image_prefetch_is_budgeted_in_device_bytes(fake, images):
    big = Loader(images, batch_size=512, device="cuda:0", transforms={"image": vision.train(224)})
    mid = Loader(images, batch_size=256, device="cuda:0", transforms={"image": vision.train(224)})
    small = Loader(images, batch_size=8, device="cuda:0", transforms={"image": EVAL})
    assert (big.prefetch, mid.prefetch, small.prefetch) == (2, 3, 3)  # 308 MB, 154 MB, 25 KB a batch (F9)
    assert Loader(images, batch_size=256, device="cpu", transforms={"image": vision.train(224)}).prefetch == 2
    assert Loader(images, batch_size=8, device="cuda:0", transforms={"image": EVAL}, prefetch=5).prefetch == 5


def test_a_slot_is_held_until_its_copy_has_run(fake):
    """The ring's slot stays leased while the GPU has not run the copy out of it, and only
    then goes back to the free list (review test B: leases held until their events complete)."""
    from fastload.runtime.device import guard
    from fastload.loader.cuda import CudaDelivery
    from fastload.ring.ring import Ring

    x = np.arange(64 * 4, dtype=np.int64).reshape(64, 4)
    with Ring({"x": (np.int64, (4,)), "index": (np.int64, ())}, 8, {"x": [x]}, index_field="index", threads=1,
              slots=4) as ring:
        delivery = CudaDelivery(ring, torch.device("cuda", 1))
        try:
            ring.submit(np.zeros(8, np.int64), np.arange(8, 16), index=np.arange(8, 16))
            out = delivery.deliver(ring.get_batch())  # the RingBatch is dropped at once
            assert ring.stats()["in_use"] == 1  # held by the copy the GPU has not run yet
            with guard(torch.device("cuda", 1)):  # as deliver() does before it reaps
                delivery._reap(block=False)
                assert ring.stats()["in_use"] == 1
                fake.run_gpu()
                delivery._reap(block=False)
            assert ring.stats()["in_use"] == 0
            assert out["x"].cpu().numpy().tolist() == x[8:16].tolist() and out["index"].cpu().tolist() == list(range(8, 16))
        finally:
            delivery.close()
    assert fake.registered == {} and fake.contexts == {1}

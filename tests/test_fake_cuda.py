"""The fake CUDA harness (tests/fake_cuda.py) behaves like CUDA where fastload's tests rely
on it: per-thread devices and contexts, streams that run when the host waits, copies that
read their source when they run, blocking copies, events, pinning and the sticky error."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from fake_cuda import (
    ERROR_HOST_MEMORY_ALREADY_REGISTERED,
    ERROR_MEMORY_ALLOCATION,
    POISON,
    CudaHazard,
    FakeCuda,
    FakeCudaTensor,
    as_numpy,
)


@pytest.fixture
def fake(monkeypatch):
    return FakeCuda.install(monkeypatch, device_count=2)


def _in_thread(fn, name="worker"):
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # pragma: no cover - surfaced below
            out["error"] = e

    t = threading.Thread(target=run, name=name)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out.get("value")


def test_install_and_undo(monkeypatch):
    real = (torch.cuda.is_available(), torch.cuda.Stream, torch.Tensor.to, torch.empty)
    with monkeypatch.context() as mp:
        fake = FakeCuda.install(mp, device_count=3)
        assert torch.cuda.is_available() and torch.cuda.device_count() == 3
        assert isinstance(torch.cuda.current_stream(), torch.cuda.Stream)
        assert fake.contexts == set()  # nothing touched a device yet
    assert (torch.cuda.is_available(), torch.cuda.Stream, torch.Tensor.to, torch.empty) == real


def test_each_thread_starts_on_device_0_and_selection_is_per_thread(fake):
    torch.cuda.set_device(1)
    assert torch.cuda.current_device() == 1
    assert _in_thread(torch.cuda.current_device) == 0  # a new thread: device 0, like CUDA

    def guarded():
        with torch.cuda.device(1):
            inside = torch.cuda.current_device()
        return inside, torch.cuda.current_device()

    assert _in_thread(guarded, "guarded") == (1, 0)
    assert fake.selected_by_thread() == {"MainThread": [1], "guarded": [1]}


def test_unguarded_calls_use_the_thread_s_current_device(fake):
    torch.cuda.set_device(1)
    s = torch.cuda.Stream()  # on the current device
    assert s.device == torch.device("cuda", 1)
    ev = torch.cuda.Event()
    ev.record(s)

    def waiter():  # a thread that never selected a device: the wait runs on device 0
        ev.synchronize()
        torch.cuda.cudart().cudaHostRegister(np.zeros(4096, np.uint8).ctypes.data, 4096, 1)

    _in_thread(waiter, "waiter")
    assert fake.devices_by_thread() == {"MainThread": {1}, "waiter": {0}}
    assert fake.contexts == {0, 1}


def test_stream_context_switches_stream_and_device_and_restores_them(fake):
    side = torch.cuda.Stream(device=1)
    assert torch.cuda.current_device() == 0
    with torch.cuda.stream(side):
        assert torch.cuda.current_device() == 1
        assert torch.cuda.current_stream() == side and torch.cuda.current_stream(1) == side
        assert torch.cuda.current_stream(0) == torch.cuda.default_stream(0)
    assert torch.cuda.current_device() == 0
    assert torch.cuda.current_stream(1) == torch.cuda.default_stream(1)
    assert torch.cuda.default_stream(0).cuda_stream == 0 and side.cuda_stream != 0


def test_async_copy_runs_when_the_gpu_runs_and_reads_the_source_then(fake):
    src = torch.arange(16, dtype=torch.int32).pin_memory()
    assert src.is_pinned()
    side = torch.cuda.Stream(device=0)
    with torch.cuda.stream(side):
        dev = src.to("cuda:0", non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(side)
    assert isinstance(dev, FakeCudaTensor) and dev.is_cuda and dev.device == torch.device("cuda", 0)
    assert (as_numpy(dev).view(np.uint8) == POISON).all()  # not run yet
    assert not ev.query()
    src += 100  # the host buffer is reused before the copy ran: the DMA reads the new bytes
    ev.synchronize()
    assert ev.query() and ev.done
    assert as_numpy(dev).tolist() == list(range(100, 116))
    c, = fake.copies
    assert (c.src, c.dst, c.nbytes, c.non_blocking, c.src_pinned, c.stream) == ("cpu", "cuda:0", 64, True, True, side)
    w, = fake.host_waits
    assert (w.what, w.blocking) == ("event", False)  # torch.cuda.Event() spins by default


def test_blocking_copy_waits_on_the_host(fake):
    dev = torch.arange(4).to(torch.device("cuda", 1))  # non_blocking=False
    assert as_numpy(dev).tolist() == [0, 1, 2, 3]  # memcpy_and_sync: done on return
    assert [c.non_blocking for c in fake.blocking_copies()] == [False]
    assert [w.what for w in fake.host_waits] == ["copy"]
    assert fake.copies[0].stream == torch.cuda.default_stream(1)


def test_pageable_async_copy_is_staged_at_call_time(fake):
    src = torch.arange(4)
    dev = src.to("cuda:0", non_blocking=True)
    src += 10  # pageable: staged when the call returned
    fake.run_gpu()
    assert as_numpy(dev).tolist() == [0, 1, 2, 3]
    assert not fake.copies[0].src_pinned


def test_reading_on_a_stream_that_did_not_wait_sees_poison_and_is_flagged(fake):
    src = torch.arange(8, dtype=torch.int64).pin_memory()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        dev = src.to("cuda", non_blocking=True)
    # .cpu() runs on the current (default) stream, which did not wait for `side`
    with pytest.raises(CudaHazard, match="without that stream's allocation being ordered"):
        dev.cpu()
    fake.strict = False
    assert (dev.cpu().numpy().view(np.uint8) == POISON).all()
    fake.strict = True
    torch.cuda.current_stream().wait_stream(side)
    assert dev.cpu().tolist() == list(range(8))
    with pytest.raises(TypeError, match="can't convert cuda:0"):
        dev.numpy()


def test_event_wait_orders_streams(fake):
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    src = torch.ones(4).pin_memory()
    with torch.cuda.stream(a):
        dev = src.to("cuda", non_blocking=True)
    ev = a.record_event(torch.cuda.Event(blocking=True))
    b.wait_event(ev)
    fake.launch_kernel("consumer", stream=b)
    b.synchronize()  # runs b, which first runs a up to the event
    assert ev.done and as_numpy(dev).tolist() == [1.0] * 4
    assert torch.cuda.Event(blocking=True).blocking


def test_eager_mode_runs_at_once(monkeypatch):
    fake = FakeCuda.install(monkeypatch, device_count=1, eager=True)
    dev = torch.arange(3).pin_memory().to("cuda", non_blocking=True)
    assert as_numpy(dev).tolist() == [0, 1, 2] and fake.pending_ops() == 0


def test_host_register_records_overlaps_and_the_sticky_error(fake):
    buf = np.zeros(3 * 4096, np.uint8)
    rt = torch.cuda.cudart()
    ptr = buf.ctypes.data
    assert int(rt.cudaHostRegister(ptr, 8192, 1)) == 0
    t = torch.from_numpy(buf)
    assert t.is_pinned() and not torch.from_numpy(np.zeros(4)).is_pinned()
    err = rt.cudaHostRegister(ptr + 4096, 4096, 1)
    assert int(err) == ERROR_HOST_MEMORY_ALREADY_REGISTERED
    assert "already mapped" in rt.cudaGetErrorString(err)
    with pytest.raises(RuntimeError, match="earlier CUDA call"):  # the next kernel launch fails
        torch.cuda._sleep(10)
    torch.cuda._sleep(10)  # torch's check cleared it
    fake.register_error = ERROR_MEMORY_ALLOCATION
    assert int(rt.cudaHostRegister(ptr + 8192, 4096, 1)) == ERROR_MEMORY_ALLOCATION
    assert int(rt.cudaGetLastError()) == ERROR_MEMORY_ALLOCATION  # cleared by the caller ...
    torch.cuda._sleep(10)  # ... so no stale error later
    assert int(rt.cudaHostUnregister(ptr)) == 0 and int(rt.cudaHostUnregister(ptr)) != 0
    assert fake.registrations == [(ptr, 8192, 1)] and fake.unregistrations == [ptr]
    assert fake.registered == {}


def test_device_allocations_and_record_stream(fake):
    s = torch.cuda.Stream(device=1)
    t = torch.empty((2, 3), dtype=torch.float32, device=torch.device("cuda", 1))
    z = torch.zeros(4, device="cuda:1")
    assert t.is_cuda and t.shape == (2, 3) and t.device.index == 1
    t.record_stream(s)
    assert [c.kind for c in fake.calls_of(thread="MainThread")] == ["stream_create", "alloc", "alloc",
                                                                   "record_stream"]
    assert z.cpu().tolist() == [0.0] * 4  # the memset ran before the read on the same stream
    with pytest.raises(RuntimeError, match="only supported for CUDA tensors"):
        torch.zeros(2).record_stream(s)
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.cuda.set_device(2)


# torch.cuda calls that run torch.cuda._lazy_init (torch 2.13 torch/cuda/__init__.py, the C++
# bindings' cuda_lazy_init / device_lazy_init), and calls that do not
_INITIALISES = {
    "current_device": lambda f: torch.cuda.current_device(),
    "set_device": lambda f: torch.cuda.set_device(0),
    "device(1)": lambda f: torch.cuda.device(1).__enter__(),
    "Stream(device=0)": lambda f: torch.cuda.Stream(device=0),
    "current_stream": lambda f: torch.cuda.current_stream(),
    "default_stream": lambda f: torch.cuda.default_stream(0),
    "stream(s)": lambda f: torch.cuda.stream(f._default[1]).__enter__(),
    "Event.record()": lambda f: torch.cuda.Event().record(),
    "synchronize": lambda f: torch.cuda.synchronize(),
    "cudart": lambda f: torch.cuda.cudart(),
    "get_device_properties": lambda f: torch.cuda.get_device_properties(0),
    "get_device_name": lambda f: torch.cuda.get_device_name(0),
    "mem_get_info": lambda f: torch.cuda.mem_get_info(0),
    "init": lambda f: torch.cuda.init(),
    "Tensor.to(cuda)": lambda f: torch.zeros(2).to("cuda:1", non_blocking=True),
    "Tensor.cuda()": lambda f: torch.zeros(2).cuda(),
    "empty(device=cuda)": lambda f: torch.empty(2, device="cuda:0"),
    "zeros(device=cuda)": lambda f: torch.zeros(2, device="cuda:0"),
}
_DOES_NOT = {
    "is_available": lambda f: torch.cuda.is_available(),
    "device_count": lambda f: torch.cuda.device_count(),
    "Event()": lambda f: torch.cuda.Event(blocking=True),
    "device(None)": lambda f: torch.cuda.device(None).__enter__(),
    "device(-1)": lambda f: torch.cuda.device(-1).__enter__(),
    "host tensors": lambda f: torch.zeros(2).to(torch.float64) + torch.empty(2),
}


@pytest.mark.parametrize("name", sorted(_INITIALISES))
def test_lazy_initialisation_is_torch_s(name, monkeypatch):
    """As in torch: merely asking for the current device (or stream) initialises CUDA, so a
    check of "has this process used CUDA?" must come before any such call."""
    fake = FakeCuda.install(monkeypatch, device_count=2)
    assert not torch.cuda.is_initialized()
    for other in _DOES_NOT.values():
        other(fake)
    assert not torch.cuda.is_initialized()
    _INITIALISES[name](fake)
    assert torch.cuda.is_initialized() and fake.initialized


# -- the caching allocator, DMA by address, released slots -------------------------------------
def _copied_on(stream, src):
    with torch.cuda.stream(stream):
        return src.to("cuda", non_blocking=True)


def test_a_freed_tensor_s_memory_is_reused_on_its_stream_and_a_pending_reader_is_flagged(fake):
    """torch's allocator hands a freed block out again on its allocation stream at once: a
    kernel queued on another stream that still reads it reads the new owner's bytes. With
    record_stream(reader) the block waits for the reader."""
    side, user = torch.cuda.Stream(), torch.cuda.current_stream()
    src = torch.arange(8, dtype=torch.int64).pin_memory()
    dev = _copied_on(side, src)
    user.wait_stream(side)
    seen = fake.consume(dev, stream=user)  # queued, not run
    del dev  # no record_stream(user): the block is free for `side` now
    with pytest.raises(CudaHazard, match="still had work queued"):
        _copied_on(side, src)
    fake.strict = False
    torch.cuda.synchronize()
    assert (seen[0].numpy().view(np.uint8) == POISON).all()  # the step read the reused block


def test_record_stream_keeps_the_block_until_the_reader_passed(fake):
    side, user = torch.cuda.Stream(), torch.cuda.current_stream()
    src = torch.arange(8, dtype=torch.int64).pin_memory()
    dev = _copied_on(side, src)
    user.wait_stream(side)
    dev.record_stream(user)
    seen = fake.consume(dev, stream=user)
    del dev
    again = _copied_on(side, src)  # a new block: the freed one waits for `user`
    assert fake.reused_blocks == 0
    torch.cuda.synchronize()
    assert seen[0].tolist() == list(range(8))
    del again
    _copied_on(side, src)
    assert fake.reused_blocks == 1  # `user` passed its event: the block is free again


def test_a_tensor_written_on_a_stream_other_than_its_allocation_stream_is_flagged(fake):
    copy = torch.cuda.Stream()
    t = torch.empty(4, device="cuda:0")  # allocated on the current (default) stream
    with pytest.raises(CudaHazard, match="allocated on"):
        fake.consume(t, stream=copy)
    with torch.cuda.stream(copy):
        u = torch.empty(4, device="cuda:0")
    fake.consume(u, stream=copy)  # its own stream: fine
    ev = torch.cuda.Event()
    ev.record(copy)
    torch.cuda.current_stream().wait_event(ev)
    fake.consume(u)  # after a wait for an event recorded after the allocation: fine


def test_a_pinned_copy_reads_its_source_by_address_and_holds_no_reference(fake):
    import gc
    import weakref

    buf = np.arange(1024, dtype=np.int64)
    rt = torch.cuda.cudart()
    assert int(rt.cudaHostRegister(buf.ctypes.data, buf.nbytes, 1)) == 0
    src = torch.from_numpy(buf)
    ref = weakref.ref(src)
    dev = src.to("cuda", non_blocking=True)
    del src
    gc.collect()
    assert ref() is None  # the pending copy keeps nothing alive, as a DMA
    buf[:] = 7  # the host refills the memory before the copy ran: the copy reads that
    torch.cuda.synchronize()
    assert set(as_numpy(dev).tolist()) == {7}
    dev2 = torch.from_numpy(buf).to("cuda", non_blocking=True)
    with pytest.raises(CudaHazard, match="have not run"):
        rt.cudaHostUnregister(buf.ctypes.data)  # unregistered under a pending copy
    fake.strict = False
    rt.cudaHostUnregister(buf.ctypes.data)
    torch.cuda.synchronize()
    assert (as_numpy(dev2).view(np.uint8) == POISON).all()


def test_a_released_ring_slot_is_poisoned(fake):
    from fastload.ring.ring import Ring

    x = np.arange(64 * 4, dtype=np.int64).reshape(64, 4)
    with Ring({"x": (np.int64, (4,)), "index": (np.int64, ())}, 8, {"x": [x]}, index_field="index", threads=1,
              slots=4) as ring:
        ring.submit(np.zeros(8, np.int64), np.arange(8), index=np.arange(8))
        rb = ring.get_batch()
        mem = ring.slot_memory(rb.slot)
        view = rb.tensors["x"][2:4]  # a view outlives the batch dict: the slot stays leased
        del rb
        assert ring.stats()["in_use"] == 1 and view.tolist() == x[2:4].tolist()
        del view
        assert ring.stats()["in_use"] == 0 and fake.poisoned_slots == 1
        assert (mem[:8 * 4 * 8] == POISON).all()

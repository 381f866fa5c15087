"""A fake ``torch.cuda`` for testing the CUDA paths on a machine without a GPU.

``FakeCuda.install(monkeypatch, device_count=2)`` replaces the parts of ``torch.cuda`` (and
of ``torch.Tensor``) that fastload's CUDA code uses, and records what that code does, per
thread: the device each thread selected, the streams and events it used, every copy (with
its ``non_blocking`` flag, its bytes and the stream it ran on), every host wait, every
``cudaHostRegister``/``cudaHostUnregister`` and on which device each call created or used a
CUDA context. ``monkeypatch`` undoes it all at the end of the test.

The semantics follow the real sources (torch 2.13, CUDA 12), so that a test that passes here
says something about a GPU:

* **Devices and contexts.** Every thread starts on device 0 (CUDA's current device is
  per thread). ``set_device(d)`` and entering ``device(d)`` switch it (CUDA 12's
  ``cudaSetDevice`` creates the primary context of ``d``); leaving ``device(d)`` restores the
  previous device without touching it (torch's ``MaybeExchangeDevice``). A runtime call
  that torch does not guard runs on the thread's *current* device and creates a context
  there: ``cudaHostRegister``/``Unregister`` (``torch/csrc/cuda/shared/cudart.cpp``),
  ``Event.synchronize``/``query`` (``cudaEventSynchronize``/``Query``, no guard in
  ``ATen/cuda/CUDAEvent.h``). Guarded calls use the device of their stream or tensor:
  ``Event.record``/``wait``, ``Stream(...)``, ``Stream.synchronize``, copies to or from a
  device, ``torch.empty(device=...)``. ``contexts`` is the set of devices touched.
* **Lazy initialisation.** ``torch.cuda.is_initialized()`` is False until something runs
  torch's ``_lazy_init`` (``torch/cuda/__init__.py``): ``current_device()`` (yes: merely
  asking initialises), ``set_device``, entering ``device(d)`` for ``d >= 0``
  (``_cuda_exchangeDevice``), ``Stream(device=...)`` (its device guard),
  ``current_stream``/``default_stream``, ``stream(s)`` (it asks for the current stream),
  ``Event.record()``/``wait()`` without a stream, ``synchronize``, ``cudart()``,
  ``get_device_properties``/``name``/``capability``, ``mem_get_info``, ``init()``, and
  tensors made on or moved to a CUDA device (``device_lazy_init`` in torch's C++ argument
  handling). ``is_available()``, ``device_count()``, ``Event()`` and ``device(None)`` do not.
  Initialising creates no context (torch's ``_cuda_init`` only counts devices).
* **Streams.** Each thread has a current stream per device, the device's default stream
  until ``stream(s)``/``set_stream(s)`` changes it; ``stream(s)`` also makes ``s``'s device
  current inside the block (``torch._C._cuda_setStream`` sets the device).
* **A GPU that runs when told.** Work enqueued on a stream (copies, kernels, event waits)
  runs only when the host waits for it (``Event.synchronize``, ``Stream.synchronize``,
  ``torch.cuda.synchronize``, a blocking copy, a device-to-host copy) or when the test calls
  :meth:`FakeCuda.run_gpu` — or at once with ``eager=True``. A stream's work runs in order
  and waits for the events it was told to wait for. A copy reads its source *when it runs*
  (as a DMA does), and a new device tensor is filled with ``POISON`` bytes: so a host buffer
  reused before its copy ran, or a device tensor read on a stream that did not wait for the
  copy, shows up as wrong bytes.
* **A caching allocator, per stream.** A device tensor is a block handed out on the stream
  current when it was allocated (torch's allocator pools freed blocks per stream). When the
  tensor goes, its block is free for that stream again at once, or, for streams given with
  ``record_stream``, once they have reached where they were then. Handing a block out again
  lets its stream's queued work run first (a schedule a real GPU may take), then poisons
  it: work of another stream still queued on it (a training step that ran later) reads
  garbage, and the reuse raises :class:`CudaHazard` ("used on that stream without
  record_stream"). Work on a tensor from a stream that never waited for an event recorded
  after its allocation raises too (DALI's output allocated off the copying stream). Only
  tensors made by the fake carry a block: views and the results of arithmetic do not.
* **Copies read by address.** A ``non_blocking`` copy out of page-locked memory reads its
  source by address when it runs and holds no reference to it (a ``cudaMemcpyAsync``
  holds none), so nothing but the code under test keeps a ring slot alive; memory no longer
  registered by then reads as ``POISON`` (and ``cudaHostUnregister`` under a queued copy
  raises).
* **Released ring slots are poisoned.** fastload's ``Ring.get_batch`` is wrapped so that the
  moment the last view of a batch goes, its slot's bytes become ``POISON`` *before* the slot
  goes back to the ring: a copy that still reads a released slot reads garbage every time.
  ``FakeCuda.strict = False`` keeps hazards in ``FakeCuda.hazards`` without raising.
* **Streams of fastload's own.** ``fastload.runtime.device`` creates its streams through the
  process's ``libcudart`` (``cudaStreamCreateWithFlags``): here :attr:`FakeCuda.runtime_lib`,
  and ``torch.cuda.ExternalStream`` wraps the handle as a fake stream.
* **Blocking copies.** ``Tensor.to(cuda, non_blocking=False)`` is ``memcpy_and_sync``
  (``ATen/native/cuda/Copy.cu``): the copy runs and the host waits for its stream; it is
  recorded in ``copies`` with ``non_blocking=False`` and in ``host_waits``.
* **Sticky last error.** A failed ``cudaHostRegister`` sets the thread's last error, as the
  runtime does; ``cudaGetLastError()`` returns and clears it; :meth:`FakeCuda.launch_kernel`
  (what torch's ``C10_CUDA_KERNEL_LAUNCH_CHECK`` does after every kernel) raises it.

Device tensors are :class:`FakeCudaTensor` (a ``torch.Tensor`` subclass on the host with
``is_cuda``/``device`` of a GPU). ``.numpy()`` on them raises like torch does; read them
with ``.cpu()`` (a blocking device-to-host copy on the current stream). Arithmetic on them
runs at once on the host and returns plain tensors: no stream semantics there.
"""
from __future__ import annotations

import bisect
import contextlib
import ctypes
import threading
import types
import weakref
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

POISON = 0xA5  # the byte a fresh device tensor holds until a copy writes it

# cudaError_t values used here (driver_types.h)
SUCCESS = 0
ERROR_INVALID_VALUE = 1
ERROR_MEMORY_ALLOCATION = 2
ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
ERROR_HOST_MEMORY_NOT_REGISTERED = 713
_ERROR_NAMES = {
    SUCCESS: "no error",
    ERROR_INVALID_VALUE: "invalid argument",
    ERROR_MEMORY_ALLOCATION: "out of memory",
    ERROR_HOST_MEMORY_ALREADY_REGISTERED: "part or all of the requested memory range is already mapped",
    ERROR_HOST_MEMORY_NOT_REGISTERED: "pointer does not correspond to a registered memory region",
}


class CudaError:
    """What torch's ``cudart()`` bindings return: a pybind enum, ``int()``-able."""

    def __init__(self, code: int):
        self.code = int(code)

    def __int__(self) -> int:
        return self.code

    def __index__(self) -> int:
        return self.code

    def __eq__(self, other) -> bool:
        return int(other) == self.code

    def __hash__(self) -> int:
        return hash(self.code)

    def __repr__(self) -> str:
        return f"<cudaError.{self.code}>"


class CudaHazard(AssertionError):
    """Work a real GPU could run in an order that corrupts data: memory reused while a stream
    that was never recorded on it (``record_stream``) still had work queued on it, a tensor
    used on a stream that never waited for its allocation, page-locked memory unregistered
    under a pending copy. Raised where the code under test made the mistake (with
    ``FakeCuda.strict``, the default) and kept in ``FakeCuda.hazards``."""


class _Block:
    """One block of the fake caching allocator: device memory handed out on one stream (torch
    pools freed blocks per stream and hands one out again on that stream only)."""

    __slots__ = ("buf", "device", "stream", "nbytes", "alloc_pos", "recorded", "uses", "free_events")

    def __init__(self, buf: torch.Tensor, device: int, stream: FakeStream, nbytes: int):
        self.buf = buf  # uint8 host memory standing for the device memory (owned by the allocator)
        self.device = device
        self.stream = stream  # the allocation stream
        self.nbytes = nbytes
        self.alloc_pos = len(stream.ops)  # the allocation stream's position when handed out
        self.recorded: set = set()  # streams given with record_stream
        self.uses: list[tuple[FakeStream, int]] = []  # (stream, position) of queued work touching it
        self.free_events: list[tuple[FakeStream, int]] = []  # (stream, position) it waits for once freed


@dataclass
class Call:
    """One recorded CUDA call: what, in which thread, on which device (the device the call
    ran on: its guard's, else the thread's current device), and details."""

    kind: str
    thread: str
    device: int
    info: dict = field(default_factory=dict)


@dataclass
class Copy:
    thread: str
    src: str  # "cpu" or "cuda:N"
    dst: str
    nbytes: int
    non_blocking: bool
    stream: FakeStream
    src_pinned: bool


@dataclass
class HostWait:
    thread: str
    what: str  # "event", "stream", "device", "copy"
    blocking: bool  # a blocking-sync event (yields the core) or a spin wait
    device: int


class _Op:
    __slots__ = ("kind", "run", "wait_for", "done", "seconds")

    def __init__(self, kind: str, run: Callable[[], None] | None = None, wait_for=None, seconds: float = 0.0):
        self.kind = kind
        self.run = run
        self.wait_for = wait_for  # (stream, position) for a wait op
        self.done = False
        self.seconds = seconds  # how long the GPU takes for it (kernels of known length: _sleep)


class FakeStream:
    """A CUDA stream: an ordered queue of work on one device. Installed as
    ``torch.cuda.Stream`` (a subclass bound to its :class:`FakeCuda`), so ``isinstance``
    checks hold for created and current streams alike."""

    _fake: FakeCuda

    def __init__(self, device=None, priority: int = 0, *, _handle: int | None = None, **kw):
        fake = self._fake
        if device is not None and _handle is None:
            fake._lazy_init()  # torch: `with torch.cuda.device(device)` around the creation
        idx = fake._index(device)
        if _handle is None:
            with fake._lock:
                _handle = fake._next_handle
                fake._next_handle += 0x10
        self.device_index = idx
        self.device = torch.device("cuda", idx)
        self.cuda_stream = _handle
        self.priority = priority
        self.ops: list[_Op] = []
        self.executed = 0
        # ordering: {stream: n} = this stream's later work runs after that stream's first n ops
        # (through event waits, transitively); with its history, for other streams' waits
        self.clock: dict = {}
        self._hist_pos: list[int] = []
        self._hist_clock: list[dict] = []
        if _handle != 0:  # torch: `with torch.cuda.device(device)` around the creation
            fake._call("stream_create", idx, stream=self)
            fake.streams.append(self)

    # -- torch.cuda.Stream API --------------------------------------------------------------
    def wait_event(self, event: FakeEvent) -> None:
        event.wait(self)

    def wait_stream(self, stream: FakeStream) -> None:
        self.wait_event(stream.record_event())

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        if event is None:
            event = self._fake.Event()
        event.record(self)
        return event

    def query(self) -> bool:
        self._fake._call("stream_query", self.device_index, stream=self)
        return self.executed == len(self.ops)

    def synchronize(self) -> None:
        fake = self._fake
        fake._call("stream_synchronize", self.device_index, stream=self)
        fake._host_wait("stream", blocking=False, device=self.device_index)
        fake._execute(self, len(self.ops))

    def __cuda_stream__(self):
        return (0, self.cuda_stream)

    def __eq__(self, other) -> bool:
        return isinstance(other, FakeStream) and (other.cuda_stream, other.device_index) == (
            self.cuda_stream, self.device_index)

    def __hash__(self) -> int:
        return hash((self.cuda_stream, self.device_index))

    def __repr__(self) -> str:
        return f"<FakeStream device=cuda:{self.device_index} cuda_stream={self.cuda_stream:#x}>"

    # -- the fake GPU -------------------------------------------------------------------------
    def _clock_at(self, pos: int) -> dict:
        """What work that waits for this stream's first ``pos`` ops is ordered after."""
        i = bisect.bisect_right(self._hist_pos, pos) - 1
        out = dict(self._hist_clock[i]) if i >= 0 else {}
        out[self] = max(out.get(self, 0), pos)
        return out

    def _merge(self, clock: dict) -> None:
        for k, v in clock.items():
            if k != self and v > self.clock.get(k, 0):
                self.clock[k] = v
        self._hist_pos.append(len(self.ops))
        self._hist_clock.append(dict(self.clock))

    def after(self, other: FakeStream, pos: int) -> bool:
        """Whether work enqueued on this stream now runs after ``other``'s first ``pos`` ops."""
        return other == self or self.clock.get(other, -1) >= pos  # a wait at or after `pos`

    def _enqueue(self, op: _Op) -> int:
        self.ops.append(op)
        if self._fake.eager:
            self._fake._execute(self, len(self.ops))
        return len(self.ops)


class FakeEvent:
    """A CUDA event: a position in one stream's queue, once recorded. Installed as
    ``torch.cuda.Event`` (a subclass bound to its :class:`FakeCuda`)."""

    _fake: FakeCuda

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                 external: bool = False):
        fake = self._fake
        self.enable_timing = enable_timing
        self.blocking = blocking
        self.stream: FakeStream | None = None
        self.position = 0
        fake.events.append(self)

    def record(self, stream: FakeStream | None = None) -> None:
        fake = self._fake
        if stream is None:
            fake._lazy_init()  # torch.cuda.current_stream()
            stream = fake.current_stream()
        fake._call("event_record", stream.device_index, event=self, stream=stream)
        self.stream = stream
        self.position = len(stream.ops)

    def query(self) -> bool:
        fake = self._fake
        if self.stream is None:
            return True
        fake._call("event_query", fake._tls_device(), event=self)  # unguarded
        return self.stream.executed >= self.position

    def synchronize(self) -> None:
        fake = self._fake
        if self.stream is None:  # never recorded: torch returns at once
            return
        fake._call("event_synchronize", fake._tls_device(), event=self)  # unguarded
        fake._host_wait("event", blocking=self.blocking, device=self.stream.device_index)
        fake._execute(self.stream, self.position)

    def wait(self, stream: FakeStream | None = None) -> None:
        fake = self._fake
        if stream is None:
            fake._lazy_init()  # torch.cuda.current_stream()
            stream = fake.current_stream()
        fake._call("event_wait", stream.device_index, event=self, stream=stream)
        if self.stream is None:
            return
        stream._enqueue(_Op("wait", wait_for=(self.stream, self.position)))
        stream._merge(self.stream._clock_at(self.position))

    def elapsed_time(self, end: FakeEvent) -> float:
        """Milliseconds of modelled GPU time between two events of one stream (the kernels of
        known length between them, e.g. ``torch.cuda._sleep`` at ``FakeCuda.clock_hz``)."""
        if self.stream is None or end.stream is not self.stream:
            raise RuntimeError("elapsed_time: both events must be recorded on the same (fake) stream")
        return 1e3 * sum(op.seconds for op in self.stream.ops[self.position:end.position])

    @property
    def done(self) -> bool:
        """Whether the GPU has reached this event (no call recorded; for assertions)."""
        return self.stream is None or self.stream.executed >= self.position


class FakeCudaTensor(torch.Tensor):
    """A tensor "on a GPU": host memory that only the fake GPU writes (copies run when the
    GPU runs), with ``is_cuda``/``device`` of a CUDA tensor."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def is_cuda(self) -> bool:
        return True

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self._fake_device)

    def numpy(self, *a, **kw):
        raise TypeError(f"can't convert cuda:{self._fake_device} device type tensor to numpy. "
                        "Use Tensor.cpu() to copy the tensor to host memory first.")

    def _host(self) -> torch.Tensor:
        """The bytes on the "device" as a plain host tensor (no copy, no stream semantics)."""
        return self.as_subclass(torch.Tensor)


class _PoisonLease:
    """Holds a ring batch (and so its slot's lease); when the last view of the batch goes,
    poisons the slot's bytes *before* the slot is released (no producer can be filling it)."""

    def __init__(self, fake: FakeCuda, rb):
        self.fake = fake
        self.rb = rb

    def __del__(self):
        for a in self.rb.arrays.values():
            if a.nbytes and a.flags.c_contiguous:
                ctypes.memset(a.ctypes.data, POISON, a.nbytes)
        self.fake.poisoned_slots += 1


class _LeasedView:
    """The base of a re-made view of a slot array: holds the lease, exposes the array's memory."""

    def __init__(self, lease: _PoisonLease, a: np.ndarray):
        self.lease = lease
        self.__array_interface__ = dict(a.__array_interface__)


class _DeviceContext:
    """``torch.cuda.device(d)``: select ``d`` inside the block, restore on exit."""

    def __init__(self, fake: FakeCuda, device):
        self._fake = fake
        self.idx = fake._index(device, optional=True)
        self.prev = None

    def __enter__(self):
        fake = self._fake
        if self.idx is None or self.idx < 0:
            return self
        fake._lazy_init()  # _cuda_exchangeDevice
        self.prev = fake._tls_device()
        if self.idx != self.prev:  # ExchangeDevice: cudaSetDevice only when it changes
            fake._select(self.idx, how="device_guard")
        return self

    def __exit__(self, *exc):
        if self.prev is not None:
            self._fake._tls().device = self.prev  # MaybeExchangeDevice: no context created
        return False


class _StreamContext:
    """``torch.cuda.stream(s)`` as torch's ``StreamContext``: current stream (and device) is
    ``s``'s inside the block; the previous streams and device come back on exit."""

    def __init__(self, fake: FakeCuda, stream: FakeStream | None):
        self._fake = fake
        self.stream = stream

    def __enter__(self):
        fake, s = self._fake, self.stream
        if s is None:
            return self
        fake._lazy_init()  # StreamContext.__enter__ asks torch.cuda.current_stream()
        tls = fake._tls()
        self.prev_device = tls.device
        self.src_prev = fake.current_stream()
        self.dst_prev = fake.current_stream(s.device_index)
        fake.set_stream(s)
        return self

    def __exit__(self, *exc):
        fake, s = self._fake, self.stream
        if s is None:
            return False
        tls = fake._tls()
        tls.streams[s.device_index] = self.dst_prev
        tls.streams[self.src_prev.device_index] = self.src_prev
        tls.device = self.prev_device  # set_stream(src_prev) sets its device back
        return False


class _FakeCudart:
    """``torch.cuda.cudart()``: the runtime bindings fastload uses, plus
    ``cudaGetLastError`` (not bound by torch; here so tests can check it gets cleared)."""

    def __init__(self, fake: FakeCuda):
        self._fake = fake
        self.cudaError = types.SimpleNamespace(success=CudaError(SUCCESS))

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> CudaError:
        fake = self._fake
        dev = fake._tls_device()  # no device guard in torch's binding
        code = SUCCESS
        inject = fake.register_error
        if inject is not None:
            code = int(inject(ptr, size) if callable(inject) else inject)
        if code == SUCCESS and size == 0:
            code = ERROR_INVALID_VALUE
        if code == SUCCESS and any(p < ptr + size and ptr < p + s for p, (s, _f) in fake.registered.items()):
            code = ERROR_HOST_MEMORY_ALREADY_REGISTERED
        fake._call("cudaHostRegister", dev, ptr=ptr, size=size, flags=flags, error=code)
        with fake._lock:
            if code == SUCCESS:
                fake.registered[ptr] = (size, flags)
                fake.registrations.append((ptr, size, flags))
            else:
                fake._tls().last_error = code
        return CudaError(code)

    def cudaHostUnregister(self, ptr: int) -> CudaError:
        fake = self._fake
        dev = fake._tls_device()
        with fake._lock:
            code = SUCCESS if ptr in fake.registered else ERROR_HOST_MEMORY_NOT_REGISTERED
            if code == SUCCESS:
                size = fake.registered[ptr][0]
                fake._dma_reads = [r for r in fake._dma_reads if r[2].executed < r[3]]  # those still queued
                pending = [(p, n) for p, n, s, pos in fake._dma_reads if p < ptr + size and ptr < p + n]
                if pending:
                    fake._hazard(f"cudaHostUnregister({ptr:#x}) while {len(pending)} copy(ies) out of it have not run")
            if code == SUCCESS:
                del fake.registered[ptr]
                fake.unregistrations.append(ptr)
            else:
                fake._tls().last_error = code
        fake._call("cudaHostUnregister", dev, ptr=ptr, error=code)
        return CudaError(code)

    def cudaGetErrorString(self, err) -> str:
        return _ERROR_NAMES.get(int(err), f"unknown error {int(err)}")

    def cudaGetLastError(self) -> CudaError:
        tls = self._fake._tls()
        code, tls.last_error = tls.last_error, SUCCESS
        return CudaError(code)

    def cudaMemGetInfo(self, device: int) -> tuple[int, int]:
        fake = self._fake
        fake._call("cudaMemGetInfo", int(device))
        return fake.free_memory, fake.total_memory


class _FakeRuntimeLib:
    """The process's ``libcudart`` as fastload reaches it through ctypes
    (``fastload.runtime.device._torch_cudart``): the calls it makes there."""

    def __init__(self, fake: FakeCuda):
        self._fake = fake

    def cudaStreamCreateWithFlags(self, ref, flags) -> int:
        fake = self._fake
        with fake._lock:
            handle = fake._next_handle
            fake._next_handle += 0x10
        ref._obj.value = handle  # ctypes.byref(c_void_p): the stream handle written back
        fake._call("cudaStreamCreateWithFlags", fake._tls_device(), handle=handle, flags=int(flags))
        return SUCCESS

    def cudaGetLastError(self) -> int:
        return int(self._fake.cudart.cudaGetLastError())


class FakeCuda:
    """The fake GPU(s) and everything recorded. See the module docstring."""

    def __init__(self, device_count: int = 2, *, eager: bool = False, total_memory: int = 16 << 30,
                 name: str = "Fake GPU", cuda_version: str = "12.8"):
        self.device_count = int(device_count)
        self.eager = eager
        self.total_memory = int(total_memory)
        self.free_memory = int(total_memory)
        self.name = name
        self.cuda_version = cuda_version
        self.clock_hz = 1.5e9  # cycles per second of torch.cuda._sleep
        self.register_error: int | Callable[[int, int], int] | None = None  # inject cudaHostRegister failures
        self.initialized = False  # torch.cuda.is_initialized(): see "Lazy initialisation"
        self._lock = threading.RLock()
        self._local = threading.local()
        self._next_handle = 0x1000
        self.Stream = type("Stream", (FakeStream,), {"_fake": self})
        self.Event = type("Event", (FakeEvent,), {"_fake": self})
        self.calls: list[Call] = []
        self.copies: list[Copy] = []
        self.host_waits: list[HostWait] = []
        self.streams: list[FakeStream] = []  # created with torch.cuda.Stream
        self.events: list[FakeEvent] = []
        self.registered: dict[int, tuple[int, int]] = {}  # ptr -> (size, flags), currently registered
        self.registrations: list[tuple[int, int, int]] = []  # every successful (ptr, size, flags)
        self.unregistrations: list[int] = []
        self.pinned_allocations: list[torch.Tensor] = []  # pin_memory() results (kept alive)
        self.strict = True  # raise CudaHazard where it happens (else only keep it in `hazards`)
        self.hazards: list[str] = []
        self._free_blocks: dict[tuple, list[_Block]] = {}  # (device, stream, nbytes) -> freed blocks
        self.reused_blocks = 0
        self.allocated = [0] * self.device_count  # bytes of live device tensors (memory_allocated)
        self.poisoned_slots = 0  # ring slots poisoned when their last view went away
        self._dma_reads: list[tuple[int, int, FakeStream, int]] = []  # (ptr, nbytes, stream, pos) from pinned memory
        self.cudart = _FakeCudart(self)
        self.runtime_lib = _FakeRuntimeLib(self)
        self._default = {d: self.Stream(d, _handle=0) for d in range(self.device_count)}

    # -- installing ---------------------------------------------------------------------------
    @classmethod
    def install(cls, monkeypatch, device_count: int = 2, *, outside_torchrun: bool = False, **kw) -> FakeCuda:
        """Patch torch.cuda for the test; ``outside_torchrun``: also unset the launcher's
        rank variables, so that device selection sees a single process."""
        if outside_torchrun:
            for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE"):
                monkeypatch.delenv(k, raising=False)
        fake = cls(device_count, **kw)
        fake._patch(monkeypatch)
        return fake

    def _patch(self, mp) -> None:
        c = torch.cuda
        mp.setattr(c, "is_available", lambda: self.device_count > 0)
        mp.setattr(c, "device_count", lambda: self.device_count)
        init = self._initialising  # what runs torch.cuda._lazy_init first
        mp.setattr(c, "is_initialized", lambda: self.initialized)
        mp.setattr(c, "init", self._lazy_init)
        mp.setattr(c, "current_device", init(self._tls_device))
        mp.setattr(c, "set_device", init(lambda d: self._select(self._index(d), how="set_device")))
        mp.setattr(c, "device", lambda d: _DeviceContext(self, d))
        mp.setattr(c, "Stream", self.Stream)
        mp.setattr(c, "Event", self.Event)
        mp.setattr(c, "current_stream", init(self.current_stream))
        mp.setattr(c, "default_stream", init(lambda device=None: self._default[self._index(device)]))
        mp.setattr(c, "set_stream", self.set_stream)
        mp.setattr(c, "stream", lambda s: _StreamContext(self, s))
        mp.setattr(c, "synchronize", init(self.synchronize))
        mp.setattr(c, "cudart", init(lambda: self.cudart))
        mp.setattr(c, "_sleep", lambda cycles: self.launch_kernel("_sleep", seconds=cycles / self.clock_hz,
                                                                  cycles=cycles))
        props = init(lambda device=None: types.SimpleNamespace(
            name=self.name, total_memory=self.total_memory, major=9, minor=0, multi_processor_count=132))
        mp.setattr(c, "get_device_properties", props)
        mp.setattr(c, "get_device_name", lambda device=None: props(device).name)
        mp.setattr(c, "get_device_capability", lambda device=None: (props(device).major, props(device).minor))
        mp.setattr(c, "memory_allocated", lambda device=None: self.allocated[self._index(device)])
        mp.setattr(c, "ExternalStream", lambda stream_ptr, device=None: self.Stream(device, _handle=int(stream_ptr)))
        mp.setattr(c, "mem_get_info", init(lambda device=None: self.cudart.cudaMemGetInfo(self._index(device))))
        mp.setattr(torch.backends.cuda, "is_built", lambda: True)
        mp.setattr(torch.version, "cuda", self.cuda_version)
        T = torch.Tensor
        orig_to, orig_pin = T.to, T.pin_memory
        mp.setattr(T, "to", lambda t, *a, **kw: self._to(orig_to, t, *a, **kw))
        mp.setattr(T, "cuda", lambda t, device=None, non_blocking=False, **kw: self._to(
            orig_to, t, torch.device("cuda", self._index(device)), non_blocking=non_blocking))
        mp.setattr(T, "cpu", lambda t, **kw: self._to(orig_to, t, "cpu"))
        mp.setattr(T, "record_stream", lambda t, stream: self._record_stream(t, stream))
        mp.setattr(T, "pin_memory", lambda t, *a, **kw: self._pin(t))
        mp.setattr(T, "is_pinned", lambda t, *a, **kw: self.is_pinned(t))
        orig_empty, orig_zeros = torch.empty, torch.zeros
        mp.setattr(torch, "empty", lambda *a, **kw: self._alloc(orig_empty, *a, **kw))
        mp.setattr(torch, "zeros", lambda *a, **kw: self._alloc(orig_zeros, *a, **kw))
        del orig_pin
        self._poison_released_slots(mp)
        try:  # fastload's own streams come from the (fake) runtime, and its free list is this fake's
            from fastload.runtime import device as device_mod
        except ImportError:  # pragma: no cover
            return
        mp.setattr(device_mod, "_torch_cudart", lambda: self.runtime_lib)
        mp.setattr(device_mod, "_free_streams", {})
        mp.setattr(device_mod, "_ours", set())

    def _poison_released_slots(self, mp) -> None:
        """fastload's ring hands out a batch as views of a slot, and takes the slot back when
        the last view goes away: here the slot's bytes are first overwritten with ``POISON``,
        so work that still reads a released slot (a copy the GPU has not run) reads garbage
        deterministically, not only when a producer happens to refill the slot first."""
        try:
            from fastload.ring import ring as ring_mod
        except ImportError:  # pragma: no cover - fastload not importable
            return
        orig = ring_mod.Ring.get_batch

        def get_batch(ring):
            return self._poisoned_on_release(orig(ring))
        mp.setattr(ring_mod.Ring, "get_batch", get_batch)

    def _poisoned_on_release(self, rb):
        if rb.copied or rb.slot < 0 or not rb.arrays:
            return rb
        lease = _PoisonLease(self, rb)
        arrays = {k: np.asarray(_LeasedView(lease, a)) for k, a in rb.arrays.items()}
        return type(rb)({k: torch.from_numpy(a) for k, a in arrays.items()}, rb.slot, rb.copied, arrays)

    def _lazy_init(self) -> None:
        """``torch.cuda._lazy_init``: from now on ``is_initialized()``; no context is made."""
        self.initialized = True

    def _initialising(self, fn):
        """``fn`` as a torch.cuda function that runs ``_lazy_init()`` first."""
        def call(*a, **kw):
            self._lazy_init()
            return fn(*a, **kw)
        return call

    # -- per-thread state ---------------------------------------------------------------------
    def _tls(self):
        tls = self._local
        if not hasattr(tls, "device"):
            tls.device = 0  # a new thread's current device is 0
            tls.streams = {}
            tls.last_error = SUCCESS
        return tls

    def _tls_device(self) -> int:
        return self._tls().device

    def _index(self, device, optional: bool = False) -> int | None:
        if device is None:
            return None if optional else self._tls_device()
        if isinstance(device, int):
            idx = device
        else:
            if isinstance(device, FakeStream):
                return device.device_index
            d = torch.device(device)
            if d.type != "cuda":
                raise ValueError(f"expected a cuda device, got {device!r}")
            idx = self._tls_device() if d.index is None else d.index
        if optional and idx < 0:
            return None
        if not 0 <= idx < self.device_count:
            raise RuntimeError(f"CUDA error: invalid device ordinal {idx} ({self.device_count} device(s))")
        return idx

    def _thread(self) -> str:
        return threading.current_thread().name

    def _call(self, kind: str, device: int, **info) -> None:
        with self._lock:
            self.calls.append(Call(kind, self._thread(), int(device), info))

    def _host_wait(self, what: str, blocking: bool, device: int) -> None:
        with self._lock:
            self.host_waits.append(HostWait(self._thread(), what, blocking, device))

    def _select(self, idx: int, how: str) -> None:
        self._tls().device = idx
        self._call(how, idx)

    # -- streams ------------------------------------------------------------------------------
    def current_stream(self, device=None) -> FakeStream:
        idx = self._index(device)
        return self._tls().streams.get(idx, self._default[idx])

    def set_stream(self, stream: FakeStream) -> None:
        tls = self._tls()
        tls.streams[stream.device_index] = stream
        tls.device = stream.device_index

    def synchronize(self, device=None) -> None:
        idx = self._index(device)
        self._call("device_synchronize", idx)
        self._host_wait("device", blocking=False, device=idx)
        self.run_gpu(device=idx)

    # -- the GPU ------------------------------------------------------------------------------
    def _execute(self, stream: FakeStream, upto: int) -> None:
        with self._lock:
            while stream.executed < upto:
                op = stream.ops[stream.executed]
                if op.wait_for is not None:
                    other, pos = op.wait_for
                    self._execute(other, pos)
                if op.run is not None:
                    op.run()
                op.run = op.wait_for = None  # like a GPU, hold no reference to what the work read
                op.done = True
                stream.executed += 1

    def run_gpu(self, stream: FakeStream | None = None, device: int | None = None) -> None:
        """Let the GPU finish the work enqueued so far (on one stream, one device, or all)."""
        with self._lock:
            if stream is not None:
                self._execute(stream, len(stream.ops))
                return
            for s in [*self._default.values(), *self.streams]:
                if device is None or s.device_index == device:
                    self._execute(s, len(s.ops))

    def pending_ops(self) -> int:
        with self._lock:
            return sum(len(s.ops) - s.executed for s in [*self._default.values(), *self.streams])

    def launch_kernel(self, name: str = "kernel", stream: FakeStream | None = None, seconds: float = 0.0,
                      **info) -> None:
        """A kernel launch as torch does it: enqueue, then ``C10_CUDA_KERNEL_LAUNCH_CHECK()``
        (``cudaGetLastError``), which raises — and clears — an error left by any earlier
        runtime call of this thread."""
        stream = stream or self.current_stream()
        self._call("kernel", stream.device_index, name=name, stream=stream, **info)
        stream._enqueue(_Op("kernel", seconds=seconds))
        tls = self._tls()
        if tls.last_error != SUCCESS:
            code, tls.last_error = tls.last_error, SUCCESS
            raise RuntimeError(f"CUDA error: {_ERROR_NAMES.get(code, code)} (launching {name}: an error "
                               "left behind by an earlier CUDA call of this thread)")

    # -- tensors ------------------------------------------------------------------------------
    def device_tensor(self, shape, dtype, device: int, stream: FakeStream | None = None) -> FakeCudaTensor:
        """A new device tensor (``POISON`` bytes) from the fake caching allocator, allocated on
        ``stream`` (torch: the current stream of ``device``)."""
        idx = int(device)
        stream = stream if stream is not None else self.current_stream(idx)
        shape = tuple(int(d) for d in shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * _orig_empty((), dtype=dtype).element_size()
        block = self._reuse_block(idx, stream, nbytes)
        if block is None:
            block = _Block(_orig_empty(max(nbytes, 1), dtype=torch.uint8).fill_(POISON), idx, stream, nbytes)
        t = block.buf[:nbytes].view(dtype).view(shape).as_subclass(FakeCudaTensor)
        t._fake_device = idx
        t._block = block
        with self._lock:
            self.allocated[idx] += nbytes
        weakref.finalize(t, self._free_block, block)
        return t

    # -- the caching allocator -----------------------------------------------------------------
    def _free_block(self, block: _Block) -> None:
        """The tensor is gone: as torch's allocator, the block may be handed out again on its
        allocation stream at once, or, if it was recorded on other streams, once those streams
        have reached where they were now."""
        with self._lock:
            self.allocated[block.device] -= block.nbytes
            block.free_events = [(s, len(s.ops)) for s in block.recorded]
            self._free_blocks.setdefault((block.device, block.stream, block.nbytes), []).append(block)

    def _reuse_block(self, idx: int, stream: FakeStream, nbytes: int) -> _Block | None:
        with self._lock:
            free = self._free_blocks.get((idx, stream, nbytes))
            block = None
            for i, b in enumerate(free or ()):
                if all(s.executed >= pos for s, pos in b.free_events):
                    block = free.pop(i)
                    break
            if block is None:
                return None
            # The allocation stream's queued work is ordered before the new owner's: let the GPU
            # run it now (a schedule a real GPU may take), then the block's bytes are the new
            # owner's. Work of another stream still queued on it reads garbage from now on.
            self._execute(stream, len(stream.ops))
            racing = sorted({repr(s) for s, pos in block.uses if s.executed < pos and s != stream})
            block.buf.fill_(POISON)
            block.alloc_pos = len(stream.ops)
            block.recorded, block.uses, block.free_events = set(), [], []
            self.reused_blocks += 1
        if racing:
            self._hazard(f"device memory freed and handed out again on {stream} while {', '.join(racing)} still had "
                         "work queued on it: the tensor was used on that stream without record_stream(stream) (or "
                         "without its allocation stream waiting for that stream before the tensor was dropped)")
        return block

    def _use(self, t: torch.Tensor, stream: FakeStream, what: str) -> None:
        """Work just enqueued on ``stream`` reads or writes device tensor ``t``: it must be
        ordered after ``t``'s allocation (on its allocation stream, or after a wait for it)."""
        block = getattr(t, "_block", None)
        if block is None:
            return
        with self._lock:
            block.uses.append((stream, len(stream.ops)))
            ok = stream.after(block.stream, block.alloc_pos)
        if not ok:
            self._hazard(f"{what} on {stream} uses a tensor allocated on {block.stream} without that stream's "
                         "allocation being ordered before it (allocate it on the stream that uses it, or wait for "
                         "an event recorded after the allocation)")

    def _hazard(self, msg: str, raise_: bool = True) -> None:
        with self._lock:
            self.hazards.append(msg)
        if raise_ and self.strict:
            raise CudaHazard(msg)

    def consume(self, *tensors: torch.Tensor, stream: FakeStream | None = None, name: str = "step") -> list:
        """A kernel reading ``tensors`` on ``stream`` (the current stream of the first one's
        device) as a training step would: it holds no reference to them, and it reads their
        memory when it runs. Returns a list that then receives a host copy of each."""
        fakes = [t for t in tensors if isinstance(t, FakeCudaTensor)]
        if not fakes:
            return []
        stream = stream or self.current_stream(fakes[0]._fake_device)
        specs = [(t._block, t.dtype, tuple(t.shape), t.element_size() * t.nelement()) for t in fakes]
        out: list = []

        def run():
            out.extend(b.buf[:n].view(dt).view(sh).clone() for b, dt, sh, n in specs)

        self._call("kernel", stream.device_index, name=name, stream=stream)
        stream._enqueue(_Op("kernel", run))
        for t in fakes:
            self._use(t, stream, f"kernel {name!r}")
        return out

    def _pinned_range(self, ptr: int, nbytes: int) -> bool:
        with self._lock:
            if any(p <= ptr and ptr + nbytes <= p + s for p, (s, _f) in self.registered.items()):
                return True
            return any(a.data_ptr() <= ptr and ptr + nbytes <= a.data_ptr() + a.element_size() * a.nelement()
                       for a in self.pinned_allocations)

    def _dma_source(self, src: torch.Tensor, stream: FakeStream):
        """A reader of page-locked ``src`` *by address*, as a DMA engine reads it when the copy
        runs: it keeps nothing alive (a real cudaMemcpyAsync holds no reference to its source),
        and it returns None if the memory is no longer page-locked by then."""
        ptr, nbytes, dtype, shape = src.data_ptr(), src.element_size() * src.nelement(), src.dtype, tuple(src.shape)
        with self._lock:
            self._dma_reads.append((ptr, nbytes, stream, len(stream.ops) + 1))

        def read():
            if nbytes == 0:
                return _orig_empty(shape, dtype=dtype)
            if not self._pinned_range(ptr, nbytes):
                self._hazard(f"a host-to-device copy ran after its page-locked source ({nbytes} bytes at {ptr:#x}) "
                             "was unregistered", raise_=False)
                return None
            raw = (ctypes.c_uint8 * nbytes).from_address(ptr)
            return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).view(shape).clone()
        return read

    def _alloc(self, orig, *args, **kw):
        dev = kw.get("device")
        pin = kw.pop("pin_memory", False)
        if dev is not None and torch.device(dev).type == "cuda":
            self._lazy_init()  # torch's C++ device_lazy_init for a CUDA factory
            idx = self._index(dev)
            kw.pop("device")
            shape = kw.pop("size", None) or (
                args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else args)
            self._call("alloc", idx, shape=tuple(shape))
            t = self.device_tensor(tuple(shape), kw.get("dtype") or torch.get_default_dtype(), idx)
            if orig is _orig_zeros:  # zeros: a memset kernel on the current stream
                host = t._host()
                self.current_stream(idx)._enqueue(_Op("memset", lambda: host.zero_()))
            return t
        out = orig(*args, **kw)
        return self._pin(out, copy=False) if pin else out

    def _pin(self, t: torch.Tensor, copy: bool = True) -> torch.Tensor:
        if isinstance(t, FakeCudaTensor):
            raise RuntimeError("cannot pin 'torch.cuda.FloatTensor' only dense CPU tensors can be pinned")
        dev = min(self.contexts) if self.contexts else self._tls_device()
        out = t.clone() if copy else t
        self._call("pinned_alloc", dev, nbytes=out.element_size() * out.nelement())
        with self._lock:
            self.pinned_allocations.append(out)
        return out

    def is_pinned(self, t: torch.Tensor) -> bool:
        if isinstance(t, FakeCudaTensor) or t.nelement() == 0:
            return False
        ptr = t.data_ptr()
        with self._lock:
            if any(ptr >= p and ptr < p + s for p, (s, _f) in self.registered.items()):
                return True
            return any(a.data_ptr() <= ptr < a.data_ptr() + a.element_size() * a.nelement()
                       for a in self.pinned_allocations)

    def _to(self, orig, t: torch.Tensor, *args, **kw):
        copy_flag = kw.pop("copy", False)
        dst, dtype, non_blocking, _fmt = torch._C._nn._parse_to(*args, **kw)
        src_fake = isinstance(t, FakeCudaTensor)
        if dst is None:
            if src_fake:  # a dtype change on the device: a kernel, run at once (no stream model)
                out = self.device_tensor(tuple(t.shape), dtype or t.dtype, t._fake_device)
                out._host().copy_(orig(t._host(), dtype))
                return out
            return orig(t, *args, copy=copy_flag, **kw)
        if dst.type == "cpu":
            if not src_fake:
                return orig(t, *args, copy=copy_flag, **kw)
            return self._d2h(t, dtype)
        if dst.type != "cuda":
            return orig(t, *args, copy=copy_flag, **kw)
        self._lazy_init()  # THPVariable_to: device_lazy_init for a CUDA destination
        idx = self._index(dst)
        if src_fake and t._fake_device == idx and dtype in (None, t.dtype) and not copy_flag:
            return t
        return self._h2d(t, idx, dtype, non_blocking)

    def _h2d(self, t: torch.Tensor, idx: int, dtype, non_blocking: bool) -> FakeCudaTensor:
        stream = self.current_stream(idx)  # the copy runs under a guard of the destination device
        src_fake = isinstance(t, FakeCudaTensor)
        src = t._host() if src_fake else t
        pinned = (not src_fake) and self.is_pinned(t)
        out = self.device_tensor(tuple(t.shape), dtype or t.dtype, idx, stream)
        dst_host = out._host()
        nbytes = src.element_size() * src.nelement()
        dma = None
        if not src_fake and not (non_blocking and pinned):
            src = src.clone()  # pageable source: staged at call time (the host is not free until then)
        elif not src_fake and src.is_contiguous():
            dma = self._dma_source(src, stream)  # read by address when the copy runs
        src_name = f"cuda:{t._fake_device}" if src_fake else "cpu"
        self._call("copy", idx, src=src_name, nbytes=nbytes, non_blocking=non_blocking, stream=stream)
        with self._lock:
            self.copies.append(Copy(self._thread(), src_name, f"cuda:{idx}", nbytes, non_blocking, stream, pinned))
        src_ref = None if dma is not None else src  # a DMA holds no reference to its source

        def copy():
            now = dma() if dma is not None else src_ref
            if now is None:  # the source was unpinned first: the DMA read garbage
                dst_host.view(torch.uint8).fill_(POISON)
            else:
                dst_host.copy_(now.to(dst_host.dtype) if now.dtype != dst_host.dtype else now)

        stream._enqueue(_Op("copy", copy))
        self._use(out, stream, "a copy to the device")
        if src_fake:
            self._use(t, stream, "a device-to-device copy")
        if not non_blocking:  # memcpy_and_sync: the host waits for the stream
            self._host_wait("copy", blocking=False, device=idx)
            self._execute(stream, len(stream.ops))
        return out

    def _d2h(self, t: FakeCudaTensor, dtype) -> torch.Tensor:
        idx = t._fake_device
        stream = self.current_stream(idx)
        src = t._host()
        out = _orig_empty(tuple(t.shape), dtype=dtype or t.dtype)
        nbytes = src.element_size() * src.nelement()
        self._call("copy", idx, src=f"cuda:{idx}", nbytes=nbytes, non_blocking=False, stream=stream)
        with self._lock:
            self.copies.append(Copy(self._thread(), f"cuda:{idx}", "cpu", nbytes, False, stream, False))
        stream._enqueue(_Op("copy", lambda: out.copy_(src)))
        self._use(t, stream, "a copy to the host")
        self._host_wait("copy", blocking=False, device=idx)
        self._execute(stream, len(stream.ops))
        return out

    def _record_stream(self, t: torch.Tensor, stream: FakeStream) -> None:
        if not isinstance(t, FakeCudaTensor):
            raise RuntimeError("record_stream is only supported for CUDA tensors (expected a cuda device)")
        self._call("record_stream", stream.device_index, tensor=id(t), stream=stream)
        block = getattr(t, "_block", None)
        if block is not None and stream != block.stream:  # torch ignores the allocation stream
            with self._lock:
                block.recorded.add(stream)

    # -- what happened ------------------------------------------------------------------------
    @property
    def contexts(self) -> set[int]:
        """Devices on which some call created or used a CUDA context."""
        with self._lock:
            return {c.device for c in self.calls}

    def calls_of(self, kind: str | None = None, thread: str | None = None) -> list[Call]:
        with self._lock:
            return [c for c in self.calls if (kind is None or c.kind == kind)
                    and (thread is None or c.thread == thread)]

    def threads(self) -> set[str]:
        """Threads that made any CUDA call."""
        with self._lock:
            return {c.thread for c in self.calls}

    def devices_by_thread(self) -> dict[str, set[int]]:
        """{thread: devices its calls ran on}: one entry per device whose context it used."""
        out: dict[str, set[int]] = {}
        with self._lock:
            for c in self.calls:
                out.setdefault(c.thread, set()).add(c.device)
        return out

    def selected_by_thread(self) -> dict[str, list[int]]:
        """{thread: devices it selected with set_device / device(...)}, in order."""
        out: dict[str, list[int]] = {}
        with self._lock:
            for c in self.calls:
                if c.kind in ("set_device", "device_guard"):
                    out.setdefault(c.thread, []).append(c.device)
        return out

    def blocking_copies(self) -> list[Copy]:
        with self._lock:
            return [c for c in self.copies if not c.non_blocking]

    def reset_records(self) -> None:
        """Forget what was recorded so far (not the state: streams, registrations stay)."""
        with self._lock:
            self.calls.clear()
            self.copies.clear()
            self.host_waits.clear()


_orig_empty = torch.empty
_orig_zeros = torch.zeros


@contextlib.contextmanager
def thread_name(name: str):
    """Run a block under another thread name (to tell a test's own calls apart)."""
    t = threading.current_thread()
    old, t.name = t.name, name
    try:
        yield
    finally:
        t.name = old


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """Host bytes of a tensor, fake-device or not, *without* any synchronisation: what the
    GPU memory holds right now (POISON where no copy has run yet)."""
    if isinstance(t, FakeCudaTensor):
        return t._host().numpy()
    return t.numpy()


def fake_dali_on_gpu(fake: FakeCuda, monkeypatch) -> list[tuple[str, int]]:
    """Make a CUDA :class:`fastload.pipeline.Runner` work without a GPU: its graph is built for
    the CPU (the same operators, the decoder on the CPU), and DALI's ``feed_ndarray`` into a
    fake device tensor becomes a copy on the given stream, as DALI 2.4 does it
    (``CopyToExternal`` on ``cuda_stream``: asynchronous when a stream is given, else
    host-synchronous). The copy reads DALI's output when called: on a GPU DALI's own stream
    waits for the copy before it reuses that buffer (``wait_order.wait(copy_order)``), which a
    CPU pipeline does not model. As DALI's legacy executor does (``RunCPU``), a CUDA graph
    built without a ``device_id`` refuses to run ("Cannot run a pipeline with Mixed/GPU ops in
    CPU-only mode"). Returns the list of (thread, runner id) of every CUDA graph built, to
    count pipeline (re)builds."""
    import copy

    import nvidia.dali.plugin.pytorch as dali_torch

    from fastload.pipeline import Runner

    builds: list[tuple[str, int]] = []
    real_build = Runner._build

    def build(self):
        if self.device != "cuda":
            return real_build(self)
        cpu = copy.copy(self)
        cpu.device, cpu.device_id = "cpu", None
        with fake._lock:
            builds.append((threading.current_thread().name, id(self)))
        pipe = real_build(cpu)
        if self.device_id is None:
            def cpu_only(*a, **kw):
                raise RuntimeError("Cannot run a pipeline with Mixed/GPU ops in CPU-only mode. Please provide "
                                   "valid device id or change the operators' device.")
            pipe.run = cpu_only
        return pipe

    real_feed = dali_torch.feed_ndarray

    def feed_ndarray(dali_tensor, arr, cuda_stream=None):
        if not isinstance(arr, FakeCudaTensor):
            return real_feed(dali_tensor, arr, cuda_stream=cuda_stream)
        data = torch.from_numpy(np.array(dali_tensor.as_cpu() if hasattr(dali_tensor, "as_cpu") else dali_tensor))
        if tuple(data.shape) != tuple(arr.shape) or data.dtype != arr.dtype:  # DALI asserts both
            raise AssertionError(f"feed_ndarray: DALI tensor {tuple(data.shape)} {data.dtype} into torch "
                                 f"{tuple(arr.shape)} {arr.dtype}")
        idx = arr._fake_device
        stream = cuda_stream if cuda_stream is not None else fake._default[idx]
        dst = arr._host()
        nbytes = dst.element_size() * dst.nelement()
        fake._call("dali_copy", idx, stream=stream, nbytes=nbytes, non_blocking=cuda_stream is not None)
        with fake._lock:
            fake.copies.append(Copy(threading.current_thread().name, "dali", f"cuda:{idx}", nbytes,
                                    cuda_stream is not None, stream, False))
        stream._enqueue(_Op("copy", lambda: dst.copy_(data)))
        fake._use(arr, stream, "DALI's output copy (feed_ndarray)")
        if cuda_stream is None:
            fake._host_wait("copy", blocking=False, device=idx)
            fake._execute(stream, len(stream.ops))
        return arr

    monkeypatch.setattr(Runner, "_build", build)
    monkeypatch.setattr(dali_torch, "feed_ndarray", feed_ndarray)
    return builds

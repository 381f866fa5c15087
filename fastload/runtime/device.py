"""Where batches are delivered, and how fastload's threads touch CUDA: the one home of both.

**Resolution.** ``device=None`` means CUDA when it is available, else the CPU;
``device="cuda"`` (no index) means :func:`default_cuda_index`; ``device="cuda:N"`` or a
``torch.device`` is taken as is. Pass ``device=`` explicitly whenever the script's layout is
unusual (several GPUs per rank, a rank on another rank's GPU): it always wins.

**One CUDA context per rank.** CUDA's current device is per *thread*, and a new thread
starts on device 0: a runtime call that torch does not guard (``cudaHostRegister``,
``cudaEventSynchronize``/``Query``) made from such a thread creates a context on cuda:0 —
a few hundred MB on GPU 0 for every rank of the node. So every thread fastload starts calls
:func:`select` before anything else, and code running in the caller's thread (which must
not change the caller's current device) wraps its CUDA calls in :func:`guard`.

**Streams of fastload's own.** ``torch.cuda.Stream()`` hands out one of a pool of 32 streams
per device, round-robin: a stream fastload takes from it can be the very stream the script
(or another library) uses, and fastload's copies would then queue behind that work.
:func:`private_stream` creates a stream of its own instead (``cudaStreamCreateWithFlags``,
non-blocking, through the runtime torch uses), wrapped as ``torch.cuda.ExternalStream``;
:func:`release_stream` gives it back to fastload's free list (streams are reused, never
destroyed: a later Loader's stream is ordered after the earlier work on it, which is harmless).

**Errors a call leaves behind.** The CUDA runtime remembers the last error per thread until
``cudaGetLastError`` reads it; torch's kernel-launch check reads it after every kernel, so an
error fastload handled (a failed ``cudaHostRegister``, say) would surface later in the
training step, blaming an unrelated operation. :func:`clear_cuda_error` reads it away.
"""
from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

__all__ = ["clear_cuda_error", "default_cuda_index", "guard", "private_stream", "release_stream", "resolve_device",
           "select"]


def default_cuda_index() -> int:
    """The CUDA device for ``device="cuda"`` / ``None``:

    1. the device the script selected with ``torch.cuda.set_device`` (any but 0);
    2. under torchrun (``LOCAL_RANK`` set), ``LOCAL_RANK`` (modulo the visible devices) where
       that cannot be wrong: one GPU per local rank (``LOCAL_WORLD_SIZE`` equals the device
       count), or the process has not used CUDA yet (so the script cannot have chosen cuda:0
       on purpose);
    3. fewer ranks than GPUs (a job on 4 of a node's 8): ``LOCAL_RANK`` when the script has
       memory on ``cuda:LOCAL_RANK`` and none on cuda:0 (it put its model there with
       ``.to(f"cuda:{local_rank}")`` and never called ``set_device``); when it has memory on
       neither, nothing says which it means: the current device, with a warning;
    4. else the current device (0): a script that put its model on cuda:0 gets its batches
       there too.

    "Used CUDA yet" is ``torch.cuda.is_initialized()``, asked *before* anything else:
    ``torch.cuda.current_device()`` itself runs torch's lazy initialisation, after which the
    answer is always yes. A process that has not initialised CUDA has selected no device.
    """
    import torch

    used = torch.cuda.is_initialized()
    cur = torch.cuda.current_device() if used else 0
    if cur != 0:
        return cur
    from .world import local_env

    local, lws = local_env()
    if local is None:
        return cur
    count = max(1, torch.cuda.device_count())
    if lws == count or not used:
        return local % count
    if lws is not None and lws < count and 0 < local < count:
        on_local, on_0 = _allocated(torch, local), _allocated(torch, 0)
        if on_local and not on_0:
            return local
        if not on_0:
            _warn_ambiguous(local, lws, count)
    return cur


_warned_ambiguous = False


def _allocated(torch, index: int) -> int:
    """Bytes the script holds on ``cuda:index`` (torch's caching allocator; creates no context)."""
    try:
        return int(torch.cuda.memory_allocated(index))
    except Exception:  # pragma: no cover - a build without the caching allocator's stats
        return 0


def _warn_ambiguous(local: int, lws: int, count: int) -> None:
    global _warned_ambiguous
    if _warned_ambiguous:
        return
    _warned_ambiguous = True
    import logging

    logging.getLogger("fastload").warning(
        "fastload: LOCAL_RANK=%d with LOCAL_WORLD_SIZE=%d on %d GPUs, the script has used CUDA but selected no "
        "device and holds no memory on cuda:%d yet: delivering to cuda:0. If this rank trains on cuda:%d, call "
        "torch.cuda.set_device(%d) first (or pass device='cuda:%d')", local, lws, count, local, local, local, local)


def resolve_device(device: Any):
    """``None`` / ``"cpu"`` / ``"cuda"`` / ``"cuda:N"`` / a ``torch.device`` -> a
    ``torch.device`` with an explicit index for CUDA. ValueError names the bad value."""
    import torch

    if device is None:
        return torch.device("cuda", default_cuda_index()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (TypeError, RuntimeError) as e:
        raise ValueError(f"device={device!r} is not a torch device ({e})") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: fastload delivers to 'cpu' or 'cuda'")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but CUDA is not available here; use device='cpu' (or None)")
        if dev.index is None:
            dev = torch.device("cuda", default_cuda_index())
        elif dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r}: this process sees {torch.cuda.device_count()} CUDA device(s) "
                             "(CUDA_VISIBLE_DEVICES?)")
    return dev


def select(device) -> None:
    """Make ``device`` this thread's current CUDA device. The first call of every thread
    fastload starts, so that none of its CUDA calls lands on cuda:0."""
    import torch

    torch.cuda.set_device(device)


def guard(device):
    """``with guard(device):`` the block's CUDA calls run on ``device``; the caller's current
    device is restored after it (``torch.cuda.device``)."""
    import torch

    return torch.cuda.device(device)


_streams_lock = threading.Lock()
_free_streams: dict[int, list] = {}  # device index -> fastload's streams not in use
_ours: set[int] = set()  # cuda_stream handles fastload created
_CUDA_STREAM_NON_BLOCKING = 1  # cudaStreamNonBlocking: no implicit sync with the legacy default stream


def private_stream(device):
    """A CUDA stream on ``device`` that nothing else uses (see the module docstring): one
    fastload made and was given back, else a new one; torch's pooled ``torch.cuda.Stream``
    where the CUDA runtime cannot be reached (a statically linked runtime)."""
    import torch

    idx = torch.device(device).index if not isinstance(device, int) else device
    idx = torch.cuda.current_device() if idx is None else idx
    with _streams_lock:
        free = _free_streams.get(idx)
        if free:
            return free.pop()
    with guard(idx):
        lib = _torch_cudart()
        handle = ctypes.c_void_p()
        if lib is None or int(lib.cudaStreamCreateWithFlags(ctypes.byref(handle), _CUDA_STREAM_NON_BLOCKING)) != 0 \
                or not handle.value:
            if lib is not None:
                clear_cuda_error()
            return torch.cuda.Stream(device=idx)
        stream = torch.cuda.ExternalStream(handle.value, device=torch.device("cuda", idx))
    with _streams_lock:
        _ours.add(int(stream.cuda_stream))
    return stream


def release_stream(stream) -> None:
    """Give a stream of :func:`private_stream` back for reuse (a pooled torch stream: nothing)."""
    if stream is None or int(stream.cuda_stream) not in _ours:
        return
    with _streams_lock:
        _free_streams.setdefault(stream.device.index, []).append(stream)


def clear_cuda_error() -> int | None:
    """Read (and so clear) this thread's last CUDA runtime error; its code (0: none), or
    None when the runtime torch uses cannot be reached (then the error stays)."""
    import torch

    get = getattr(torch.cuda.cudart(), "cudaGetLastError", None)
    if get is not None:  # not bound by torch 2.13; present in test fakes and perhaps later
        return int(get())
    lib = _torch_cudart()
    if lib is None:
        return None
    fn = lib.cudaGetLastError
    fn.restype = ctypes.c_int
    return int(fn())


def _torch_cudart():
    """The ``libcudart`` already mapped into this process (the one torch links against:
    its last-error state is the one that matters), or None (a statically linked runtime)."""
    try:
        with open("/proc/self/maps") as f:
            path = libcudart_path(f.read())
    except OSError:  # pragma: no cover - not Linux
        return None
    if path is None:
        return None
    try:
        return ctypes.CDLL(path)  # already loaded: the same handle, no second runtime
    except OSError:  # pragma: no cover
        return None


def libcudart_path(maps: str) -> str | None:
    """The path of the CUDA runtime library in a ``/proc/<pid>/maps`` text, if mapped."""
    for line in maps.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6:
            path = parts[5].strip()
            if os.path.basename(path).startswith("libcudart.so"):
                return path
    return None

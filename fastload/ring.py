"""Python face of the C++ ring buffer (``fastload._C``): slots as tensors, pinning, device copy.

A :class:`Ring` owns a fixed set of aligned host slots, each large enough for one batch of
every field, and a pool of C++ producer threads. ``submit(shard, row)`` enqueues one batch
(the producers gather those rows of every field from the source arrays into a free slot,
GIL released); ``get()`` returns the next batch **in submission order** as a dict of torch
tensors. ``acquire()`` reserves the next batch for an *external fill* (e.g. DALI output) with
the same ordering and lifetime rules.

Lifetime rule (CPU). A batch returned by ``get()`` is a zero-copy view of its slot. The slot
is not reused while any array or tensor of that batch is alive: every view holds a reference
to a small ``SlotLease`` object, and the slot goes back to the free list only when the last
view dies. If the user keeps so many batches that no slot is left for the producers, the
ring grows by one slot at a time up to ``max_slots``; past the cap, batches are delivered as
copies (a warning is logged once). Nothing is ever overwritten and nothing deadlocks.

Lifetime rule (CUDA). With ``device="cuda"`` the slot is copied to the device with
``non_blocking=True`` on a side stream, the current stream waits for that stream, the
outputs are ``record_stream``-ed on the current stream, and an event is recorded after the
copy; the slot's lease is dropped (so the slot can be refilled) only once that event has
completed. Slots are page-locked with ``cudaHostRegister`` (through ``torch.cuda.cudart()``)
and unregistered on ``close()``.

Defaults (measured on a 2-core AMD EPYC VM, ``bench/bench_tensor.py``): ``threads`` = number
of usable cores (capped at 8) — the gather is memory-bound and more threads than cores only
add switching; ``slots`` = ``threads + 3`` — one slot held by the training loop while the
next ``get()`` runs, one in the hand-off, one per producer thread, and one spare; batches
larger than ``min_part_bytes`` (256 KiB) are split across threads.
"""
from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from . import _C

__all__ = ["FillSlot", "Ring", "default_slots", "default_threads"]

logger = logging.getLogger(__name__)

_MIN_PART_BYTES = 256 << 10  # split a batch across producers above this many bytes per part
_GROWTH_BUDGET = 512 << 20  # default max_slots lets the ring grow by about this many bytes
_CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context


def default_threads() -> int:
    """Producer threads used when ``threads=None``: the usable cores, at most 8."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        n = os.cpu_count() or 1
    return max(1, min(8, n))


def default_slots(threads: int) -> int:
    """Initial slots used when ``slots=None`` for ``threads`` producers."""
    return threads + 3


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


_INT64 = np.dtype(np.int64)


def _as_index(a: Any, name: str) -> np.ndarray:
    if type(a) is np.ndarray and a.dtype == _INT64 and a.ndim == 1:
        return a  # fast path; the C++ side makes it contiguous if needed
    arr = np.asarray(a)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must be an integer array, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _parse_fields(fields: Mapping[str, Any]) -> tuple[list[str], list[np.dtype], list[tuple[int, ...]]]:
    if not isinstance(fields, Mapping) or not fields:
        raise ValueError("fields must be a non-empty dict of name -> (dtype, shape)")
    names, dtypes, shapes = [], [], []
    for name, spec in fields.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"field names must be non-empty strings, got {name!r}")
        try:
            dt, shape = spec
        except (TypeError, ValueError):
            raise ValueError(f"field {name!r}: expected (dtype, shape), got {spec!r}") from None
        try:
            dt = np.dtype(dt)
        except TypeError as e:
            raise ValueError(f"field {name!r}: {dt!r} is not a numpy dtype ({e})") from None
        if dt.hasobject or dt.itemsize == 0:
            raise ValueError(f"field {name!r}: dtype {dt} has no fixed binary layout")
        if _is_int(shape):
            shape = (int(shape),)
        try:
            shape = tuple(int(d) for d in shape)
        except TypeError:
            raise ValueError(f"field {name!r}: shape must be a tuple of ints, got {shape!r}") from None
        if any(d < 0 for d in shape):
            raise ValueError(f"field {name!r}: shape {shape} has a negative dimension")
        names.append(name)
        dtypes.append(dt)
        shapes.append(shape)
    return names, dtypes, shapes


def _parse_sources(
    sources: Mapping[str, Any] | None, names: list[str], dtypes: list[np.dtype], shapes: list[tuple[int, ...]]
) -> list[list[np.ndarray] | None]:
    sources = {} if sources is None else sources
    if not isinstance(sources, Mapping):
        raise ValueError("sources must be a dict of field name -> list of per-shard arrays")
    unknown = sorted(set(sources) - set(names))
    if unknown:
        raise ValueError(f"sources has fields {unknown} that are not in fields {names}")
    out: list[list[np.ndarray] | None] = []
    ref_name, ref_rows = None, None
    for name, dt, shape in zip(names, dtypes, shapes):
        if name not in sources or sources[name] is None:
            out.append(None)
            continue
        shards = sources[name]
        if isinstance(shards, np.ndarray):
            shards = [shards]
        shards = list(shards)
        checked = []
        for s, a in enumerate(shards):
            if not isinstance(a, np.ndarray):
                raise ValueError(f"field {name!r} shard {s}: source must be a numpy array, got {type(a).__name__}")
            if a.dtype != dt:
                raise ValueError(f"field {name!r} shard {s}: source dtype {a.dtype} != field dtype {dt}")
            if a.ndim < 1 or a.shape[1:] != shape:
                raise ValueError(
                    f"field {name!r} shard {s}: source shape {a.shape} is not (rows, *{shape})"
                )
            if not a.flags.c_contiguous:
                raise ValueError(
                    f"field {name!r} shard {s}: source must be C-contiguous (use np.ascontiguousarray)"
                )
            checked.append(a)
        rows = [a.shape[0] for a in checked]
        if ref_rows is None:
            ref_name, ref_rows = name, rows
        elif rows != ref_rows:
            raise ValueError(
                f"field {name!r} has shard sizes {rows[:8]}{'...' if len(rows) > 8 else ''} "
                f"but field {ref_name!r} has {ref_rows[:8]}{'...' if len(ref_rows) > 8 else ''}; "
                "every field must have the same shards"
            )
        out.append(checked)
    return out


class FillSlot:
    """A ring slot reserved by :meth:`Ring.acquire` for an external fill.

    ``arrays`` (numpy) and ``tensors`` (torch, same memory) are writable views of the whole
    slot, shape ``(batch_size, *shape)`` per field. Write the batch, then ``commit(rows)`` to
    publish it as the next batch in order (or ``fail(message)`` to make ``get()`` raise for
    it). Used as a context manager, an exception inside the block fails the batch. A slot
    dropped without commit/fail is published as an error, so the consumer never waits forever.
    The slot is not reused while any of these views (or the delivered batch) is alive.
    """

    __slots__ = ("_handle", "_arrays", "_names", "_done", "seq")

    def __init__(self, handle: Any, names: list[str], arrays: tuple) -> None:
        self._handle = handle
        self._names = names
        self._arrays = dict(zip(names, arrays))
        self._done = False
        self.seq = handle.seq

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        self._check_open()
        return self._arrays

    @property
    def tensors(self) -> dict[str, Any]:
        import torch

        self._check_open()
        return {k: torch.from_numpy(v) for k, v in self._arrays.items()}

    def gather(self, shard: Any, row: Any) -> None:
        """Gather the fields that have sources for rows ``(shard, row)`` into this slot,
        in the calling thread with the GIL released."""
        self._check_open()
        self._handle.gather(_as_index(shard, "shard"), _as_index(row, "row"))

    def commit(self, rows: int) -> None:
        """Publish the first ``rows`` rows of every field as the next batch."""
        self._check_open()
        if not _is_int(rows):
            raise ValueError(f"rows must be an int, got {rows!r}")
        self._handle.commit(int(rows))
        self._release()

    def fail(self, message: str) -> None:
        """Publish an error instead of a batch: ``get()`` raises ``RuntimeError(message)``."""
        self._check_open()
        self._handle.fail(str(message))
        self._release()

    def _check_open(self) -> None:
        if self._done:
            raise RuntimeError(f"batch {self.seq}: this slot was already committed or failed")

    def _release(self) -> None:
        # Our references go; the slot stays held only by views the caller kept.
        self._done = True
        self._handle = None
        self._arrays = {}

    def __enter__(self) -> FillSlot:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and not self._done:
            try:
                self.fail(f"{exc_type.__name__}: {exc}")
            except RuntimeError:  # ring already closed: nothing left to notify
                self._release()


class Ring:
    """A ring of host slots filled by C++ producer threads; batches come out in order.

    Args:
        fields: ``{name: (dtype, shape)}``; ``shape`` is the per-row shape (``()`` for scalars).
        batch_size: rows per slot (the largest batch ``submit`` accepts).
        sources: ``{name: [array per shard]}``; each array is C-contiguous with shape
            ``(rows, *shape)`` and the field's exact dtype (read-only / memory-mapped is fine).
            Every field gathered by ``submit`` needs sources; a field without sources can only
            be filled through ``acquire()``. The ring keeps the arrays alive (buffer protocol).
        threads: producer threads (default :func:`default_threads`).
        slots: initial slots (default :func:`default_slots`).
        max_slots: growth cap when the user holds batches (default: ``slots`` plus about
            512 MiB worth of slots, at least 2 and at most 64 extra).
        device: ``"cpu"`` (default) or a CUDA device; batches are returned on this device.
        pin: page-lock slots for fast async copies. ``None``: pin when ``device`` is CUDA and
            log a warning (falling back to pageable memory) if pinning fails; ``True``:
            pinning is required (errors raise); ``False``: never pin.
        min_part_bytes: batches with more bytes than this are split across producer threads.
    """

    def __init__(
        self,
        fields: Mapping[str, Any],
        batch_size: int,
        sources: Mapping[str, Sequence[np.ndarray] | np.ndarray] | None = None,
        *,
        threads: int | None = None,
        slots: int | None = None,
        max_slots: int | None = None,
        device: Any = "cpu",
        pin: bool | None = None,
        min_part_bytes: int = _MIN_PART_BYTES,
    ) -> None:
        import torch

        self._core = None
        self._closed = True
        self._torch = torch
        if not _is_int(batch_size) or batch_size <= 0:
            raise ValueError(f"batch_size={batch_size!r} must be an int > 0")
        names, dtypes, shapes = _parse_fields(fields)
        srcs = _parse_sources(sources, names, dtypes, shapes)
        if threads is None:
            threads = default_threads()
        if not _is_int(threads) or not 1 <= threads <= 256:
            raise ValueError(f"threads={threads!r} must be an int in [1, 256]")
        if slots is None:
            slots = default_slots(int(threads))
        if not _is_int(slots) or slots < 1:
            raise ValueError(f"slots={slots!r} must be an int >= 1")
        slot_bytes = sum(int(batch_size) * dt.itemsize * int(np.prod(s, dtype=np.int64)) for dt, s in zip(dtypes, shapes))
        if max_slots is None:
            max_slots = int(slots) + max(2, min(64, _GROWTH_BUDGET // max(slot_bytes, 1)))
        if not _is_int(max_slots) or max_slots < slots:
            raise ValueError(f"max_slots={max_slots!r} must be an int >= slots={slots}")
        if not _is_int(min_part_bytes) or min_part_bytes < 1:
            raise ValueError(f"min_part_bytes={min_part_bytes!r} must be an int > 0")

        try:
            dev = torch.device(device)
        except (TypeError, RuntimeError) as e:
            raise ValueError(f"device={device!r} is not a torch device ({e})") from None
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"device={device!r}: only 'cpu' and 'cuda' devices are supported")
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device={device!r} but CUDA is not available; use device='cpu'")
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
        if pin is not None and not isinstance(pin, bool):
            raise ValueError(f"pin={pin!r} must be None, True or False")
        if pin and not torch.cuda.is_available():
            raise ValueError("pin=True needs CUDA (page-locking is for device copies); use pin=None or False")

        self._names = names
        self._dtypes = dtypes
        self._shapes = shapes
        self._batch_size = int(batch_size)
        self._device = dev
        self._pin = bool(pin) if pin is not None else dev.type == "cuda"
        self._pin_required = pin is True
        self._pinned: dict[int, tuple[int, np.ndarray]] = {}
        self._inflight: collections.deque = collections.deque()
        self._warned_copy = False
        self._stream = torch.cuda.Stream(device=dev) if dev.type == "cuda" else None
        self.copy_s = 0.0  # host time issuing device copies (CUDA; asynchronous, so a lower bound)

        self._core = _C.RingCore(
            names, dtypes, [list(s) for s in shapes], int(batch_size), srcs,
            int(threads), int(slots), int(max_slots), int(min_part_bytes),
        )
        self._closed = False

    # ------------------------------------------------------------------ properties
    @property
    def fields(self) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        return {n: (d, s) for n, d, s in zip(self._names, self._dtypes, self._shapes)}

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self) -> Any:
        return self._device

    @property
    def threads(self) -> int:
        return self._live().threads

    @property
    def num_slots(self) -> int:
        return self._live().num_slots

    @property
    def max_slots(self) -> int:
        return self._live().max_slots

    @property
    def pending(self) -> int:
        """Batches submitted or acquired and not yet returned by ``get()``."""
        return 0 if self._core is None else self._core.pending

    @property
    def closed(self) -> bool:
        return self._closed

    def stats(self) -> dict[str, int]:
        """Slot states and counters: slots, free, filling, ready, in_use, submitted,
        delivered, grown, copies, pending, max_slots, slot_bytes, threads, pinned, and
        gather_ns (time spent gathering rows since the ring was made, summed over threads)."""
        s = self._live().stats()
        s["pinned"] = len(self._pinned)
        return s

    # ------------------------------------------------------------------ producer side
    def submit(self, shard: Any, row: Any) -> None:
        """Enqueue one batch: row ``row[i]`` of shard ``shard[i]`` for every field.

        Never blocks (the request queue is unbounded; index arrays are copied). Bad ids are
        reported by ``get()`` for this batch (IndexError); bad arguments raise ValueError now.
        """
        if self._closed:
            raise RuntimeError("this Ring is closed; create a new one")
        self._core.submit(_as_index(shard, "shard"), _as_index(row, "row"))

    def submit_many(self, shard: Any, row: Any, batch_size: int | None = None) -> int:
        """Enqueue many rows at once as consecutive batches of ``batch_size`` rows (default:
        the ring's), the last one possibly shorter — e.g. a whole epoch from
        ``Dataset.locate(order)``. Same rules as :meth:`submit`; returns the number of batches.
        """
        if self._closed:
            raise RuntimeError("this Ring is closed; create a new one")
        per = self._batch_size if batch_size is None else batch_size
        if not _is_int(per):
            raise ValueError(f"batch_size={per!r} must be an int")
        return self._core.submit_many(_as_index(shard, "shard"), _as_index(row, "row"), int(per))

    def acquire(self) -> FillSlot:
        """Reserve the next batch for an external fill; waits (GIL released, Ctrl-C aware)
        until a slot is free. See :class:`FillSlot`."""
        core = self._live()
        handle, arrays = core.acquire()
        return FillSlot(handle, self._names, arrays)

    # ------------------------------------------------------------------ consumer side
    def get_arrays(self) -> dict[str, np.ndarray]:
        """The next batch as zero-copy numpy views of its host slot, shape ``(rows, *shape)``.

        Waits with the GIL released; Ctrl-C raises KeyboardInterrupt. A producer error for
        this batch raises here (IndexError for bad shard/row ids, RuntimeError otherwise).
        """
        return dict(zip(self._names, self._next()))

    def get(self) -> dict[str, Any]:
        """The next batch in submission order as ``{name: torch.Tensor}`` on ``device``.

        On the CPU the tensors are zero-copy views of the slot (see the lifetime rule in the
        module docstring); their first dimension is the batch's row count.
        """
        from_numpy = self._torch.from_numpy
        host = {k: from_numpy(a) for k, a in zip(self._names, self._next())}
        if self._stream is None:
            return host
        return self._to_device(host)

    def _next(self) -> tuple:
        if self._closed:
            raise RuntimeError("this Ring is closed; create a new one")
        core = self._core
        if self._inflight:
            self._reap(block=False)
        rows, arrays, slot, copied = core.get()
        if copied and not self._warned_copy:
            self._warned_copy = True
            logger.warning(
                "fastload ring: the caller holds %d batches (max_slots=%d), so batches are now "
                "delivered as copies; drop references to old batches (or raise max_slots) to "
                "get zero-copy batches back",
                core.stats()["in_use"], core.max_slots,
            )
        if self._pin and not copied and slot not in self._pinned:
            self._pin_slot(slot)
        return arrays

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Yield ``get()`` until no submitted/acquired batch is pending."""
        while self.pending > 0:
            yield self.get()

    # ------------------------------------------------------------------ CUDA
    def _to_device(self, host: dict[str, Any]) -> dict[str, Any]:
        torch = self._torch
        t0 = time.perf_counter()
        # Keep the number of slots waiting on copies below the ring size so the ring does
        # not grow just because the GPU is behind.
        while len(self._inflight) >= max(1, self._core.num_slots - 2):
            ev, _ = self._inflight.popleft()
            ev.synchronize()
        with torch.cuda.stream(self._stream):
            out = {k: t.to(self._device, non_blocking=True) for k, t in host.items()}
            ev = torch.cuda.Event()
            ev.record(self._stream)
        current = torch.cuda.current_stream(self._device)
        current.wait_stream(self._stream)  # the training stream never sees a half copy
        for t in out.values():
            t.record_stream(current)  # output memory is not reused before `current` is done
        # The host tensors hold the slot lease: the slot is refilled only after `ev`.
        self._inflight.append((ev, host))
        self.copy_s += time.perf_counter() - t0
        return out

    def _reap(self, block: bool) -> None:
        while self._inflight:
            ev, _ = self._inflight[0]
            if block:
                ev.synchronize()
            elif not ev.query():
                break
            self._inflight.popleft()

    def _pin_slot(self, slot: int) -> None:
        torch = self._torch
        mem = self._core.slot_memory(slot)
        ptr, size = mem.ctypes.data, mem.nbytes
        err = torch.cuda.cudart().cudaHostRegister(ptr, size, _CUDA_HOST_REGISTER_PORTABLE)
        code = int(err)
        if code == 0:
            self._pinned[slot] = (ptr, mem)  # `mem` keeps the slot memory alive while pinned
            return
        msg = (
            f"fastload ring: cudaHostRegister of slot {slot} ({size} bytes) failed with cudaError "
            f"{code} ({torch.cuda.cudart().cudaGetErrorString(err)})"
        )
        if self._pin_required:
            raise RuntimeError(msg + "; pass pin=None to fall back to pageable memory")
        logger.warning("%s; continuing with pageable memory (host-to-device copies will not overlap)", msg)
        self._pin = False

    def _unpin_all(self) -> None:
        if not self._pinned:
            return
        cudart = self._torch.cuda.cudart()
        for slot, (ptr, _mem) in sorted(self._pinned.items()):
            code = int(cudart.cudaHostUnregister(ptr))
            if code != 0:
                logger.warning("fastload ring: cudaHostUnregister of slot %d failed with cudaError %d", slot, code)
        self._pinned.clear()

    # ------------------------------------------------------------------ lifetime
    def _live(self) -> Any:
        if self._closed or self._core is None:
            raise RuntimeError("this Ring is closed; create a new one")
        return self._core

    def close(self) -> None:
        """Stop and join every producer thread, wait for pending device copies and unpin the
        slots. Idempotent. Batches already returned stay valid."""
        if self._closed:
            return
        self._closed = True
        core = self._core
        if core is None:
            return
        core.close()
        if self._inflight:
            self._reap(block=True)
        self._unpin_all()

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_core", None) is not None and not getattr(self, "_closed", True):
            self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"slots={self._core.num_slots}, pending={self._core.pending}"
        fields = ", ".join(f"{n}: {d}{list(s)}" for n, d, s in zip(self._names, self._dtypes, self._shapes))
        return f"Ring({fields}; batch_size={self._batch_size}, device={self._device}, {state})"

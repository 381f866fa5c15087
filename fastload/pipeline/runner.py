"""One DALI pipeline for one image field on one device (see the package docstring).

``Runner.run`` feeds a batch of encoded images (zero-copy views of the shards) and their
per-sample parameters into the transform's DALI graph and writes the result into the given
host tensor (a ring slot) or returns a CUDA tensor. A batch DALI fails on is bisected to
the failing samples, raised as :class:`fastload.errors.BadSamples`
(:mod:`fastload.pipeline.badsamples`).

On the CPU, DALI's dynamic executor runs the graph, in runs of at most ``CPU_RUN`` images
unless the images were checked at convert time (a failed larger run can crash DALI 2.4,
see CPU_RUN). The presets' graph ends at the decoder there (``host_tail``): their
``finish`` resizes each decoded image in torch straight into the output (a ring slot), run
by run. Other graphs: a batch of one run is handed over as DALI's own output buffer without
a copy (DLPack; reference-counted, never reused while held), a larger one is concatenated
from its runs.

On CUDA (the thin part): DALI runs host-synchronously (the legacy executor; ``run(stream)``
needs the dynamic one), and its output is copied into a new torch tensor on the runner's own
*copy stream*, asynchronously (:mod:`fastload.pipeline.cuda_copy`); the runner records
``ready_event`` after the copy, and whoever uses the tensor makes its stream wait for that
event. A bad batch is bisected with a CPU runner of the same graph, so the GPU pipeline
(nvJPEG, the hardware decoder, its streams and pools) is rebuilt once per failing batch
rather than at every bisection step.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable

import numpy as np

from ..runtime import lifecycle
from ..errors import BadSamples
from ..runtime.system import rank_cores
from .badsamples import BadSampleSearch
from .badsamples import reason as _reason
from .badsamples import strip_tags as _strip_tags
from .quiet import decoder_output_captured, messages_since

logger = logging.getLogger("fastload")

__all__ = ["Runner", "default_threads", "refuse_sizes"]


GPU_PIPELINE_THREADS = 4  # CPU threads of a GPU pipeline: parsing and nvJPEG's host stage
# Images per DALI run on the CPU. DALI 2.4's CPU image decoder crashes the process when a run
# of more than ~24 images fails on a bad image while the cores are busy: its thread pool
# still decodes the rest after the run raised (SIGSEGV in ImageDecoder<CPUBackend>::RunImplImpl,
# either executor; 10 of 20 processes at 32 images, 0 of 20 at 16, 20 and 24). Larger batches
# are decoded in runs of this size and concatenated (one copy, and slower: see
# bench/bench_jpeg.py), unless every image was decoded by DALI at convert time (``whole_batches``,
# set for stores ``fastload convert`` wrote: their manifest metadata says images_checked).
CPU_RUN = 16


def default_threads(device: str = "cpu") -> int:
    """DALI worker threads of one pipeline: this rank's share of the cores on the CPU
    (see bench/bench_jpeg.py); on the GPU, where the CPU only parses
    and feeds the decoder, at most :data:`GPU_PIPELINE_THREADS`."""
    cores = rank_cores()
    return min(GPU_PIPELINE_THREADS, cores) if device == "cuda" else cores


def refuse_sizes(widths: np.ndarray, heights: np.ndarray, max_pixels: int, what: str = "") -> None:
    """BadSamples for the images whose recorded size is invalid or above ``max_pixels``
    (refused before any decoding); ``what`` prefixes each reason (e.g. the input's name)."""
    widths, heights = np.asarray(widths), np.asarray(heights)
    pixels = widths.astype(np.int64) * heights.astype(np.int64)
    refused = np.flatnonzero((pixels > max_pixels) | (widths <= 0) | (heights <= 0))
    if len(refused):
        raise BadSamples(refused, [
            what + (f"the header declares {int(widths[i])}x{int(heights[i])} pixels, more than max_pixels="
                    f"{max_pixels} (raise it in the transform if the image is genuine)"
                    if pixels[i] > max_pixels else f"invalid recorded size {int(widths[i])}x{int(heights[i])}")
            for i in refused])


class Runner(BadSampleSearch):
    """One DALI pipeline for one image field on one device.

    ``run(encoded, widths, heights, indices, epoch, out=None)`` decodes and augments one
    batch (``len(encoded) <= batch_size``). With ``out`` (a tensor of shape
    ``(n, *out_shape)`` in host memory, e.g. a ring slot), the result is written there; on
    CUDA a new CUDA tensor is returned, ready once ``ready_event`` (recorded on the runner's
    copy stream) has completed: wait for it on the stream that reads the tensor.
    """

    def __init__(self, transform, *, device: str, batch_size: int, num_threads: int | None,
                 prefetch: int | None, seed: int, device_id: int | None, dali_only: bool = False):
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device={device!r} must be 'cpu' or 'cuda'")
        self.transform = transform
        self.device = device
        self.batch_size = int(batch_size)
        self.num_threads = default_threads(device) if num_threads is None else int(num_threads)
        self.seed = int(seed)
        self.device_id = device_id if device == "cuda" else None
        self.out_shape = tuple(transform.out_shape)
        self.out_dtype = np.dtype(transform.out_dtype)
        self.max_pixels = transform.max_pixels
        self._pipe = None
        self._build_lock = threading.Lock()  # prepare() in a warm-up thread vs the first run()
        self._copy_stream = None  # CUDA: where DALI's output is copied out (made on first use)
        self.ready_event = None  # CUDA: recorded after the last copy out of DALI's output buffer
        self._cpu = None  # CUDA: a CPU runner of the same graph, to locate bad samples
        self._pid = os.getpid()
        self.rebuilds = 0
        # CPU: decode a batch in one DALI run even when it has more than CPU_RUN images (set
        # when every image was decoded by DALI at convert time, see CPU_RUN)
        self.whole_batches = False
        self.copy_s = 0.0  # time copying DALI's output out (into a ring slot / a CUDA tensor)
        # CPU: the graph ends at the decoder, transform.finish() resizes into the output
        # (host_tail.py); dali_only keeps the transform's whole graph in DALI (the GPU's)
        self.host_tail = device == "cpu" and transform.finishes_on_cpu and not dali_only
        # (the keyword only when set: a Transform subclass written before it keeps working)
        self._only = {"decoded_only": True} if self.host_tail else {}
        self._fed = tuple(transform.param_names(**self._only))  # DALI's inputs

    # -- the graph ---------------------------------------------------------------------------
    def _define(self):
        """The DALI pipeline, defined but not built: no threads, no device touched
        (:mod:`fastload.pipeline.offline` validates it without a GPU)."""
        from nvidia.dali import fn, pipeline_def, types

        t = self.transform
        gpu = self.device == "cuda"
        names = t.param_names(**self._only)

        @pipeline_def(batch_size=self._pipeline_batch(), num_threads=self.num_threads,
                      device_id=self.device_id if gpu else None, prefetch_queue_depth=1,
                      exec_dynamic=not gpu, seed=self.seed & 0x7FFFFFFF)
        def graph():
            enc = fn.external_source(name="encoded", dtype=types.UINT8, no_copy=True)
            params = {n: fn.external_source(name=n, dtype=types.FLOAT if d == np.float32 else types.INT32,
                                            no_copy=True) for n, d in names.items()}
            return t.graph(enc, params, decode_device="mixed" if gpu else "cpu",
                           device="gpu" if gpu else "cpu", **self._only)

        return graph()

    def _pipeline_batch(self) -> int:
        whole = self.device == "cuda" or self.whole_batches
        return self.batch_size if whole else min(self.batch_size, CPU_RUN)

    def _build(self):
        if self.device == "cuda" and self.device_id is None:  # only offline validation defines such a graph
            raise ValueError("a CUDA runner needs device_id= (the GPU to run on) to build its pipeline; "
                             "fastload.pipeline.offline validates a CUDA graph without one")
        pipe = self._define()
        # DALI shuts its pipelines down in an atexit hook; ours (registered after DALI's
        # import, so it runs first) closes live Loaders before that, while DALI still runs.
        lifecycle.close_at_exit("nvidia.dali")
        lifecycle.track(self)
        pipe.build()
        return pipe

    def _pipeline(self):
        pipe = self._pipe
        if pipe is None:
            with self._build_lock:  # a warm-up thread may be building it right now
                if self._pipe is None:
                    self._pipe = self._build()
                pipe = self._pipe
        return pipe

    def prepare(self) -> None:
        """Build the pipeline now (DALI starts its threads, which inherit the calling thread's
        priority and CUDA device), so the first batch does not wait for it."""
        self._pipeline()

    def _after_fork_in_child(self) -> None:
        """In a forked child the pipeline's threads do not exist: shutting it down (DALI's own
        atexit hook does, and so does its destructor) would wait for them forever. Keep the
        backend pipeline alive for good and out of DALI's registry; the child builds its own."""
        pipe, self._pipe = self._pipe, None
        self.ready_event = None
        self._build_lock = threading.Lock()  # a warm-up thread may have held it at fork time
        if pipe is not None:
            _leak(pipe)

    def _drop_pipeline(self) -> None:
        if os.getpid() != self._pid:  # a forked child's copy (see _after_fork_in_child)
            pipe, self._pipe = self._pipe, None
            self.ready_event = None
            if pipe is not None:
                _leak(pipe)
            return
        ev, self.ready_event = self.ready_event, None
        if ev is not None:  # CUDA: the last copy out of DALI's buffer must be done before it goes
            from ..runtime.device import guard

            with guard(self.device_id):
                ev.synchronize()
        pipe, self._pipe = self._pipe, None
        if pipe is not None:
            # Stop and join DALI's threads now rather than whenever the last reference (a
            # traceback, say) goes away; _shutdown is what Pipeline.__del__ calls.
            shutdown = getattr(pipe, "_shutdown", None)
            if shutdown is not None:
                shutdown()

    # -- one batch ---------------------------------------------------------------------------
    def _run_once(self, encoded: list, params: dict[str, np.ndarray], capture: bool = True):
        pipe = self._pipeline()
        pipe.feed_input("encoded", encoded)
        for n in self._fed:
            pipe.feed_input(n, params[n])  # one (n, ...) array: a uniform batch, no per-sample list
        # Host-synchronous run on both devices. On the CPU, DALI's dynamic executor: its output
        # buffers are reference-counted, so _deliver hands them over without a copy. On CUDA
        # (the legacy executor) the output stays on the device and _deliver copies it out on
        # the copy stream; DALI's stream waits for that copy before a run overwrites the buffer.
        # The decoders' own [ERROR] lines are reported by fastload instead (quiet.py). Not for
        # the batches of a dataset every image of which DALI decoded at convert time (there a
        # failure means a changed shard, which verification catches first): descriptor 2 then
        # stays the terminal's for the whole epoch, so no other native message is held back.
        with decoder_output_captured() if capture else contextlib.nullcontext():
            out, = pipe.run()
        return out

    def _try(self, encoded, params, capture: bool = True):
        seen, _ = messages_since(0)
        try:
            return self._run_once(encoded, params, capture), None
        except Exception as e:  # DALI raises RuntimeError/IndexError; the pipeline is dead
            reason = _reason(e)  # keep the text, not the traceback (it holds the pipeline)
            _, said = messages_since(seen)  # what the decoder printed (kept off the terminal)
            if said:
                reason = f"{reason} [decoder: {'; '.join(_strip_tags(m) for m in said[-2:])}]"[:500]
        self._drop_pipeline()
        self.rebuilds += 1
        return None, reason

    def run(self, encoded: list, widths: np.ndarray, heights: np.ndarray, indices: np.ndarray, epoch: int,
            out=None):
        n = len(encoded)
        if n == 0 or n > self.batch_size:
            raise ValueError(f"batch of {n} images; this runner takes 1..{self.batch_size}")
        widths = np.asarray(widths)
        heights = np.asarray(heights)
        refuse_sizes(widths, heights, self.max_pixels)
        params = self.transform.params(self.seed, epoch, indices, widths, heights)
        if out is not None or self.host_tail:  # one tensor for every path below
            import torch

            if out is None:  # the presets' torch finish writes into an output of its own
                out = torch.empty((n, *self.out_shape), dtype=getattr(torch, self.out_dtype.name))
            elif not isinstance(out, torch.Tensor):
                out = torch.from_numpy(out)
        if n > self._pipeline_batch():
            return self._run_chunked(encoded, params, n, out)
        # Standard error is captured (quiet.py) for the runs that may fail on a bad image; on a
        # GPU only the search for a bad sample after a failed run: descriptor 2 is the whole
        # process's, and a GPU run is most of the time, so other libraries' messages would go.
        res, err = self._try(encoded, params, capture=not self.whole_batches and self.device != "cuda")
        if err is not None:
            self._raise_bad(self._locate_bad(encoded, params, err), n, err)
        return self._deliver(res, n, out, params)

    def _run_chunked(self, encoded: list, params: dict[str, np.ndarray], n: int, out):
        """``run`` on the CPU in runs of at most CPU_RUN images (see CPU_RUN), each finished into
        its rows of ``out`` (``host_tail``) or concatenated."""
        import torch

        def take(res, start: int, count: int, run_params: dict):
            if self.host_tail:  # straight into its rows of the output
                return self._deliver(res, count, out[start:start + count], run_params)
            return self._deliver(res, count, None)

        parts = self._cpu_runs(encoded, params, n, take)
        if self.host_tail:
            return out
        whole = torch.cat(parts)
        if out is None:
            return whole
        out.copy_(whole)
        return out

    def _cpu_runs(self, samples: list, params: dict[str, np.ndarray], n: int, take: Callable) -> list:
        """``run`` on the CPU in runs of at most CPU_RUN samples (see CPU_RUN), in order:
        ``take(result, start, count, run_params)`` for each run, its returns listed. A run that
        fails has its bad samples searched and the rest go on being tried (only for that), so
        that one BadSamples names every bad sample of the batch."""
        parts, bad, err = [], {}, None
        for start in range(0, n, CPU_RUN):
            pos = np.arange(start, min(n, start + CPU_RUN))
            run_params = {k: a[pos] for k, a in params.items()}
            res, e = self._try([samples[i] for i in pos], run_params)
            if e is not None:
                err = e
                self._find_bad(samples, params, pos, e, bad)
            elif not bad and err is None:
                parts.append(take(res, start, len(pos), run_params))
        if err is not None:
            self._raise_bad(bad, n, err)
        return parts

    def _deliver(self, res, n: int, out, params: dict | None = None):
        if self.host_tail:  # augmentation work, not a copy: counted as decoding
            if len(res) != n:
                raise RuntimeError(f"the decoder produced {len(res)} images for a batch of {n}")
            self.transform.finish(res, params or {}, out)
            return out
        t0 = time.perf_counter()
        try:
            return self._deliver_into(res, n, out)
        finally:
            self.copy_s += time.perf_counter() - t0

    def _deliver_into(self, res, n: int, out):
        import torch
        from nvidia.dali.plugin.pytorch import feed_ndarray

        shape = tuple(res.as_tensor().shape()) if res.is_dense_tensor() else None
        if shape != (n, *self.out_shape):
            got = shape or [tuple(res[i].shape()) for i in range(min(n, 3))]
            raise RuntimeError(f"the transform produced {got}; it declares {(n, *self.out_shape)} "
                               "(every image must come out with the declared shape)")
        if self.device == "cuda":
            from .cuda_copy import copy_to_cuda

            t, self.ready_event, self._copy_stream = copy_to_cuda(
                res.as_tensor(), (n, *self.out_shape), self.out_dtype.name, self.device_id, self._copy_stream)
            return t
        if out is None:
            # DALI's own buffer, zero-copy: the dynamic executor never reuses a buffer that a
            # DLPack capsule still references (faster than a copy into a slot: see bench/bench_jpeg.py)
            return torch.from_dlpack(res.as_tensor())
        feed_ndarray(res.as_tensor(), out)
        return out

    def close(self) -> None:
        self._drop_pipeline()
        stream, self._copy_stream = self._copy_stream, None
        if stream is not None:
            from ..runtime.device import release_stream

            release_stream(stream)
        cpu, self._cpu = self._cpu, None
        if cpu is not None:
            cpu.close()

    def __del__(self):
        try:
            self._drop_pipeline()
        except Exception:
            pass


_LEAKED: list = []  # pipelines never shut down: inherited by a forked child, or abandoned


def _leak(pipe) -> None:
    """Make a DALI pipeline inert for good: out of DALI's exit-time registry, its backend
    object referenced forever (an extra reference that even the interpreter's teardown does
    not drop), so nothing ever shuts it down or joins its threads. For a pipeline inherited
    by a forked child (its threads do not exist there) and for one DALI might crash in
    shutting down (a failed CPU batch, see Runner._abandon_pipeline)."""
    import ctypes
    import weakref

    backend = getattr(pipe, "_pipe", None)
    try:
        type(pipe)._pipes.discard(weakref.ref(pipe))
    except Exception:  # pragma: no cover - another DALI version
        pass
    if backend is not None:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(backend))
        pipe._pipe = None  # Pipeline.__del__ / _shutdown now have nothing to shut down
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(pipe))
    _LEAKED.append(pipe)

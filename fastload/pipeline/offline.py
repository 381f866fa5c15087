"""A transform's DALI graph checked for a device without running it: no GPU needed.

DALI defines a pipeline in Python and hands it to its C++ backend, which checks every
operator's arguments against its schema, every input's device against what the operator
accepts, and that named arguments stay on the CPU. ``Pipeline.serialize()`` runs all of that
without building the executor, and with ``device_id=None`` it never touches CUDA: a
``mixed``/``gpu`` graph can be validated on a machine without a GPU (with ``device_id=0``
it fails in ``cuInit``). :func:`check` does that for the graph a runner defines
(``Runner._define``, the same definition ``Runner`` builds) and reads the serialized
``PipelineDef`` back, so the report says where DALI will run every operator.

That is the schema and the placement only: ``serialize()`` builds no operator, so argument
*values*, supported types and layouts, and the output's shape are not checked. :func:`run_twin`
builds the graph's *CPU twin* — the same operators with the same arguments, the whole graph in
DALI on the CPU (``dali_only``), as the GPU runs it — runs one batch of valid JPEGs through
it and compares the result with the transform's declared ``out_shape``/``out_dtype``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["GraphReport", "Op", "TwinRun", "check", "parse_pipeline_def", "run_twin"]


@dataclass(frozen=True)
class Op:
    """One operator of a serialized graph: its schema (``decoders__ImageSlice``), instance
    name, the device it runs on, and its inputs and outputs as ``(name, device)``."""

    schema: str
    name: str
    device: str
    inputs: tuple[tuple[str, str], ...] = ()
    outputs: tuple[tuple[str, str], ...] = ()
    args: tuple[tuple[str, bytes], ...] = ()  # (name, serialized Argument), DALI's private ones left out

    @property
    def is_decoder(self) -> bool:
        return self.schema.startswith("decoders__")

    @property
    def is_source(self) -> bool:
        return self.schema in ("ExternalSource", "_ExternalSource")


@dataclass(frozen=True)
class GraphReport:
    """What DALI accepted: the operators, the pipeline outputs ``(name, device)``, and the
    executor settings the runner chose."""

    device: str  # "cuda" or "cpu": what the graph was defined for
    ops: tuple[Op, ...]
    outputs: tuple[tuple[str, str], ...]
    batch_size: int
    num_threads: int
    exec_dynamic: bool
    exec_pipelined: bool
    exec_async: bool
    prefetch_queue_depth: int | dict
    serialized_bytes: int = field(default=0, compare=False)

    @property
    def decoders(self) -> tuple[Op, ...]:
        return tuple(op for op in self.ops if op.is_decoder)

    def problems(self) -> list[str]:
        """Placements that contradict the design (empty when the graph is right): on CUDA the
        external sources are on the CPU, decoders ``mixed``, every other operator and the
        output on the GPU; on the CPU everything is on the CPU."""
        out = []
        if not self.decoders:
            out.append("the graph has no image decoder")
        for op in self.ops:
            if op.is_source:
                want = "cpu"
            elif self.device == "cpu":
                want = "cpu"
            else:
                want = "mixed" if op.is_decoder else "gpu"
            if op.device != want:
                out.append(f"{op.schema} ({op.name}) runs on {op.device!r}, expected {want!r}")
        want_out = "gpu" if self.device == "cuda" else "cpu"
        for name, dev in self.outputs:
            if dev != want_out:
                out.append(f"output {name} is on {dev!r}, expected {want_out!r}")
        return out

    def summary(self) -> str:
        """One line: operators with their devices, in graph order."""
        ops = ", ".join(f"{op.schema.replace('decoders__', 'decoders.')}@{op.device}" for op in self.ops
                        if not op.is_source)
        return f"{ops} -> {', '.join(d for _, d in self.outputs)}"


def check(transform, *, device: str = "cuda", batch_size: int = 8, num_threads: int = 1,
          seed: int = 0, dali_only: bool = False) -> GraphReport:
    """Define ``transform``'s graph for ``device`` as a runner would, let DALI validate and
    serialize it (offline: ``device_id=None``), and report what it accepted. DALI's own
    errors (a misspelled argument, an input on the wrong device, ...) propagate.
    ``dali_only``: the whole graph in DALI on the CPU too (see ``Runner``)."""
    runner = transform.runner(device=device, batch_size=batch_size, num_threads=num_threads, seed=seed,
                              device_id=None, dali_only=dali_only)
    pipe = runner._define()
    try:
        blob = pipe.serialize()
        header, ops, outputs = parse_pipeline_def(blob)
        return GraphReport(device=device, ops=tuple(ops), outputs=tuple(outputs),
                           batch_size=int(header.get("batch_size", batch_size)),
                           num_threads=int(header.get("num_threads", num_threads)),
                           exec_dynamic=bool(pipe.exec_dynamic), exec_pipelined=bool(pipe.exec_pipelined),
                           exec_async=bool(pipe.exec_async), prefetch_queue_depth=pipe.prefetch_queue_depth,
                           serialized_bytes=len(blob))
    finally:
        shutdown = getattr(pipe, "_shutdown", None)
        if shutdown is not None:
            shutdown()
        runner.close()


@dataclass(frozen=True)
class TwinRun:
    """One batch through a graph's CPU twin: the output's shape and dtype, and the time."""

    shape: tuple[int, ...]
    dtype: str
    seconds: float

    def summary(self) -> str:
        return f"{self.shape[0]} JPEGs -> {tuple(self.shape)} {self.dtype}"


TWIN_SIZES = ((256, 256), (320, 200))  # the JPEGs of the twin's batch: one square, one not


def run_twin(transform, *, seed: int = 0) -> TwinRun:
    """Build ``transform``'s CPU twin (see the module docstring), run a batch of
    ``len(TWIN_SIZES)`` valid JPEGs through it, and check the output: RuntimeError naming
    what DALI refused, or what came out against what the transform declares."""
    import time

    import numpy as np

    jpegs = [_jpeg(w, h) for w, h in TWIN_SIZES]
    n = len(jpegs)
    runner = transform.runner(device="cpu", batch_size=n, num_threads=1, seed=seed, device_id=None, dali_only=True)
    t0 = time.perf_counter()
    try:
        out = runner.run(jpegs, np.array([w for w, _ in TWIN_SIZES], np.int32),
                         np.array([h for _, h in TWIN_SIZES], np.int32), np.arange(n, dtype=np.int64), 0)
        shape, dtype = tuple(out.shape), str(out.dtype).replace("torch.", "")
    except Exception as e:  # DALI's refusal, or BadSamples for every valid image: the graph's fault
        raise RuntimeError(f"the CPU twin of the graph fails on {n} valid JPEGs: {_reason(e)}") from None
    finally:
        runner.close()
    want = (n, *tuple(transform.out_shape))
    want_dtype = np.dtype(transform.out_dtype).name
    if shape != want or dtype != want_dtype:
        raise RuntimeError(f"the CPU twin of the graph produced {shape} {dtype}; the transform declares {want} "
                           f"{want_dtype}")
    return TwinRun(shape, dtype, time.perf_counter() - t0)


def _reason(e: BaseException) -> str:
    from ..errors import BadSamples

    if isinstance(e, BadSamples):
        return "; ".join(dict.fromkeys(str(r) for r in e.reasons))[:400] or str(e)
    from .badsamples import reason

    return reason(e)


def _jpeg(w: int, h: int):
    """A valid, smooth ``w`` x ``h`` RGB JPEG (its bytes as a uint8 array)."""
    import io

    import numpy as np
    from PIL import Image

    x = np.linspace(0, 255, w).astype(np.uint8)[None, :].repeat(h, 0)
    y = np.linspace(0, 255, h).astype(np.uint8)[:, None].repeat(w, 1)
    buf = io.BytesIO()
    Image.fromarray(np.stack([x, y, np.full_like(x, 100)], -1)).save(buf, "JPEG", quality=90)
    return np.frombuffer(buf.getvalue(), np.uint8)


# -- reading DALI's PipelineDef (dali/pipeline/proto/dali.proto) back: protobuf wire format ----
def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        if i >= len(buf):
            raise ValueError("truncated varint in a serialized DALI pipeline")
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7


def _fields(buf: bytes):
    """(field number, wire type, value) of one protobuf message: ints for varints, bytes for
    length-delimited fields (fixed-width fields are skipped: PipelineDef uses none we read)."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, i = _varint(buf, i)
        elif wt == 2:
            n, i = _varint(buf, i)
            v, i = buf[i:i + n], i + n
        elif wt == 1:
            v, i = buf[i:i + 8], i + 8
        elif wt == 5:
            v, i = buf[i:i + 4], i + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wt} in a serialized DALI pipeline")
        yield num, wt, v


def _io(buf: bytes) -> tuple[str, str]:
    name = device = ""
    for num, _wt, v in _fields(buf):
        if num == 1:
            name = v.decode()
        elif num == 2:
            device = v.decode()
    return name, device


def _op(buf: bytes) -> Op:
    schema = inst = device = ""
    inputs, outputs, args = [], [], []
    for num, _wt, v in _fields(buf):
        if num == 1:
            schema = v.decode()
        elif num == 2:
            inputs.append(_io(v))
        elif num == 3:
            outputs.append(_io(v))
        elif num == 4:  # Argument: name = 1, strings = 5
            arg = {n: val for n, _w, val in _fields(v) if n in (1, 5)}
            if arg.get(1) == b"device" and 5 in arg:
                device = arg[5].decode()
            elif not arg.get(1, b"_").startswith(b"_"):
                args.append((arg[1].decode(), bytes(v)))
        elif num == 5:
            inst = v.decode()
    return Op(schema, inst or (outputs[0][0] if outputs else schema), device, tuple(inputs), tuple(outputs),
              tuple(sorted(args)))


def parse_pipeline_def(blob: bytes) -> tuple[dict, list[Op], list[tuple[str, str]]]:
    """``({num_threads, batch_size, device_id, seed}, ops, outputs)`` of a ``PipelineDef``."""
    header: dict = {}
    ops: list[Op] = []
    outputs: list[tuple[str, str]] = []
    for num, _wt, v in _fields(blob):
        if num == 1:
            header["num_threads"] = v
        elif num == 2:
            header["batch_size"] = v
        elif num == 5:
            ops.append(_op(v))
        elif num == 7:
            outputs.append(_io(v))
        elif num == 8:
            header["device_id"] = v
        elif num == 9:
            header["seed"] = v
    return header, ops, outputs

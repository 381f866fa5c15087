"""Sample transforms over several fields: one DALI graph reading several fields of a sample
(an encoded image, its boxes, labels, a mask) and writing several outputs.

A :class:`SampleTransform` declares

* ``inputs``: ``{graph input name: dataset field}``. Image fields reach the graph as their
  encoded bytes (``fn.external_source``, zero-copy views of the shards, like a one-field
  transform); ragged and fixed-size fields as one array per sample (``(k, *item)`` for a
  ragged field: ``(k, 4)`` float32 boxes).
* ``outputs``: ``{name: Spec}``, what a batch gets. ``Spec(shape, dtype)``: a dense output
  has the same ``shape`` in every sample (the ring sizes its slots from it); a shape that
  starts with ``None`` (``Spec((None, 4), "float32")``) is ragged along its first dimension
  and delivered by the Loader's ragged rules: padded ``(B, Lmax, *item)`` with
  ``name + "_lengths"``, or with ``ragged={name: "packed"}`` ``(T, *item)`` with
  ``name + "_offsets"`` (int32, ``B + 1``).

Per batch, ``prepare(seed, epoch, index, data)`` computes in numpy, on the host, the
per-sample parameters the graph reads (crop windows, flips: pure functions of
(seed, epoch, global index), so a resumed run at another world size sees the same crops) and
the outputs that are cheaper as arithmetic than as graph nodes (the boxes of a crop); then
``graph(inputs, params, ...)`` builds the DALI graph returning the other outputs. The same
graph runs with the ``mixed`` decoder and GPU operators on a GPU and on the CPU without one;
like the presets, a transform may end its CPU graph at the decoder and finish in torch
(``finishes_on_cpu``, ``finish``).

:class:`MultiRunner` runs it: the one-field :class:`~fastload.pipeline.runner.Runner` with
several inputs and outputs (bad images are located by the same bisection, every sample one
entry of the batch). ``vision.custom(build, inputs=..., outputs=...)`` is the user's form:
``build(inputs, device=...)`` returns ``{output name: DALI node}``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from ..validate import check_int
from .crops import uniforms
from .presets import DEFAULT_MAX_PIXELS, Transform
from .runner import Runner, refuse_sizes

__all__ = ["MultiRunner", "SampleTransform", "Spec", "CustomSample", "as_spec", "pad_ragged", "RANDOM_DRAWS"]

RANDOM_DRAWS = 8  # uniforms per sample in a custom graph's ``inputs["random"]``

_DALI_TYPES = {"uint8": "UINT8", "int8": "INT8", "int16": "INT16", "int32": "INT32", "int64": "INT64",
               "uint16": "UINT16", "uint32": "UINT32", "uint64": "UINT64", "float16": "FLOAT16",
               "float32": "FLOAT", "float64": "FLOAT64", "bool": "BOOL"}


@dataclass(frozen=True)
class Spec:
    """One output of a sample transform: ``shape`` of one sample (a leading ``None``: ragged
    along dimension 0, e.g. ``(None, 4)`` for boxes) and its numpy ``dtype`` name."""

    shape: tuple
    dtype: str

    def __post_init__(self):
        shape = tuple(self.shape) if isinstance(self.shape, (tuple, list)) else None
        if shape is None:
            raise ValueError(f"Spec shape={self.shape!r} must be a tuple of ints (a leading None: ragged)")
        dims = shape[1:] if shape[:1] == (None,) else shape
        for i, s in enumerate(dims):
            check_int(f"Spec shape[{i + (len(shape) - len(dims))}]", s, min=1)
        try:
            dt = np.dtype(self.dtype).name
        except TypeError:
            raise ValueError(f"Spec dtype={self.dtype!r} is not a numpy dtype name") from None
        if dt not in _DALI_TYPES:
            raise ValueError(f"Spec dtype={self.dtype!r} must be one of {sorted(_DALI_TYPES)}")
        object.__setattr__(self, "shape", tuple(None if s is None else int(s) for s in shape))
        object.__setattr__(self, "dtype", dt)

    @property
    def ragged(self) -> bool:
        return self.shape[:1] == (None,)

    @property
    def item(self) -> tuple[int, ...]:
        """The shape of one item of a ragged output, or of the whole sample of a dense one."""
        return self.shape[1:] if self.ragged else self.shape

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    def row_bytes(self) -> int:
        return 0 if self.ragged else self.np_dtype.itemsize * int(np.prod(self.shape))

    def describe(self) -> list:
        return [list(self.shape), self.dtype]


def as_spec(name: str, v: Any) -> Spec:
    if isinstance(v, Spec):
        return v
    if isinstance(v, (tuple, list)) and len(v) == 2 and isinstance(v[1], str):
        return Spec(tuple(v[0]), v[1])
    raise ValueError(f"outputs[{name!r}]={v!r} must be a fastload.vision.Spec(shape, dtype) or a "
                     "(shape, dtype) pair, e.g. ((3, 224, 224), 'float32') or ((None, 4), 'float32')")


class SampleTransform(Transform):
    """Base of the multi-field transforms (see the module docstring). ``key``: the image input
    whose field names the transform in ``Loader.transforms`` and in error messages."""

    inputs: dict[str, str]
    outputs: dict[str, Spec]
    host_outputs: tuple[str, ...] = ()  # outputs ``prepare`` computes (the rest come from the graph)

    @property
    def key(self) -> str:
        return self.inputs[self.image_inputs[0]]

    @property
    def image_inputs(self) -> tuple[str, ...]:
        """The graph inputs that are encoded images (set by ``bind``, from the dataset's kinds)."""
        return tuple(n for n in self.inputs if n in self._image_inputs)

    _image_inputs: frozenset = frozenset({"image"})

    def fed_inputs(self, decoded_only: bool = False) -> tuple[str, ...]:
        """The inputs the DALI graph reads (image inputs first)."""
        return self.image_inputs

    def graph_outputs(self, decoded_only: bool = False) -> tuple[str, ...]:
        """The names of what ``graph`` returns, in order."""
        return tuple(n for n in self.outputs if n not in self.host_outputs)

    def row_bytes(self) -> int:
        return sum(s.row_bytes() for s in self.outputs.values())

    def prepare(self, seed: int, epoch: int, index: np.ndarray, data: dict) -> tuple[dict, dict]:
        """``(params, host outputs)`` of one batch. ``data``: per input, a list of per-sample
        arrays (array inputs) or ``(widths, heights)`` (image inputs, as stored)."""
        return {}, {}

    def runner(self, *, device: str = "cpu", batch_size: int, num_threads: int | None = None,
               prefetch: int | None = None, seed: int = 0, device_id: int | None = None,
               dali_only: bool = False, ragged: Mapping | None = None) -> MultiRunner:
        return MultiRunner(self, device=device, batch_size=batch_size, num_threads=num_threads, prefetch=prefetch,
                           seed=seed, device_id=device_id, dali_only=dali_only, ragged=ragged)

    def bind(self, fields: Mapping) -> None:
        """Check the inputs against a dataset's ``fields`` (``{name: Field}``) and learn which
        are images; ValueError naming the input and field otherwise."""
        images = set()
        for n, f in self.inputs.items():
            field = fields.get(f)
            if field is None:
                raise ValueError(f"{self!r} reads input {n!r} from field {f!r}, which the dataset does not have; "
                                 f"its fields are {list(fields)}")
            if field.kind == "image":
                images.add(n)
            elif not (field.fixed or field.ragged):
                raise ValueError(f"{self!r} reads input {n!r} from field {f!r}, a {field.kind} field; inputs are "
                                 "image, tensor, scalar or ragged fields")
        if not images:
            raise ValueError(f"{self!r} reads no image field (inputs {self.inputs}); a sample transform decodes at "
                             "least one image")
        self._image_inputs = frozenset(images)
        self._input_dtypes = {n: fields[f].np_dtype.name for n, f in self.inputs.items() if n not in images}


class CustomSample(SampleTransform):
    """A user's multi-field DALI graph: ``build(inputs, device=...)`` gets ``{input name: DALI
    node}`` — the encoded bytes of each image input (decode them with ``fn.decoders.image(...,
    device="mixed" if device == "gpu" else "cpu")``), one array per sample of each other input,
    and ``inputs["random"]``: ``RANDOM_DRAWS`` float32 uniforms in [0, 1) per sample, a pure
    function of (seed, epoch, sample index), for random choices that a resumed run repeats —
    and returns ``{output name: DALI node}`` for every declared output."""

    def __init__(self, build: Callable, *, inputs: Mapping[str, str], outputs: Mapping[str, Any],
                 name: str | None = None, max_pixels: int = DEFAULT_MAX_PIXELS):
        if not callable(build):
            raise ValueError(f"custom(build=...) needs a function that builds a DALI graph, got {build!r}")
        if not isinstance(inputs, Mapping) or not inputs or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in inputs.items()):
            raise ValueError(f"inputs={inputs!r} must be a non-empty dict {{graph input name: dataset field}}")
        if "random" in inputs:
            raise ValueError("inputs: 'random' is the name of the per-sample uniforms fastload feeds; name the "
                             "input otherwise")
        if not isinstance(outputs, Mapping) or not outputs:
            raise ValueError(f"outputs={outputs!r} must be a non-empty dict {{name: Spec(shape, dtype)}}")
        self.build = build
        self.inputs = dict(inputs)
        self.outputs = {str(k): as_spec(k, v) for k, v in outputs.items()}
        self.name = name or f"{getattr(build, '__module__', '?')}.{getattr(build, '__qualname__', repr(build))}"
        self.max_pixels = check_int("max_pixels", max_pixels, min=1)
        dense = [s for s in self.outputs.values() if not s.ragged]
        self.out_shape = dense[0].shape if dense else (1,)
        self.out_dtype = dense[0].dtype if dense else "uint8"

    def describe(self) -> dict:
        return {"kind": "custom", "name": self.name, "inputs": dict(self.inputs),
                "outputs": {k: s.describe() for k, s in self.outputs.items()}, "max_pixels": self.max_pixels}

    def fed_inputs(self, decoded_only=False):
        return self.image_inputs + tuple(n for n in self.inputs if n not in self.image_inputs)

    def param_names(self, decoded_only=False):
        return {"random": np.float32}

    def prepare(self, seed, epoch, index, data):
        return {"random": uniforms(seed, epoch, index, RANDOM_DRAWS, stream=7).astype(np.float32)}, {}

    def graph(self, inputs, params, *, decode_device, device, decoded_only=False):
        out = self.build({**inputs, "random": params["random"]}, device=device)
        if not isinstance(out, Mapping):
            raise ValueError(f"{self.name} must return a dict {{output name: DALI node}}, got {type(out).__name__}")
        missing = [k for k in self.outputs if k not in out]
        extra = [k for k in out if k not in self.outputs]
        if missing or extra:
            raise ValueError(f"{self.name} returned outputs {list(out)}; it declares {list(self.outputs)} "
                             f"(missing {missing}, undeclared {extra})")
        return out


def pad_ragged(values: np.ndarray, lengths: np.ndarray, mode: str, pad_value: Any = 0,
               max_length: int | None = None, multiple: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """A ragged output in the Loader's delivered form: ``"padded"``: ``(B, L, *item)`` filled
    with ``pad_value`` (``L``: the longest after ``max_length``, rounded up to ``multiple``)
    and the int64 lengths; ``"packed"``: ``(T, *item)`` and the int32 offsets (``B + 1``)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    kept = lengths if max_length is None else np.minimum(lengths, max_length)
    if mode == "packed":
        if max_length is not None and (kept != lengths).any():
            sel = np.concatenate([np.arange(s, s + k) for s, k in zip(starts[:-1], kept)]) if len(kept) else []
            values = values[np.asarray(sel, dtype=np.int64)]
        offsets = np.zeros(len(kept) + 1, dtype=np.int32)
        np.cumsum(kept, out=offsets[1:])
        return np.ascontiguousarray(values), offsets
    longest = int(kept.max(initial=0))
    width = max(-(-longest // multiple) * multiple, multiple if multiple > 1 else 0)
    out = np.full((len(kept), width, *values.shape[1:]), pad_value, dtype=values.dtype)
    rows = np.repeat(np.arange(len(kept)), kept)
    cols = np.arange(int(kept.sum())) - np.repeat(np.cumsum(kept) - kept, kept)
    src = np.repeat(starts[:-1], kept) + cols
    out[rows, cols] = values[src]
    return out, kept


class MultiRunner(Runner):
    """The DALI pipeline of one :class:`SampleTransform` on one device (see the module
    docstring). ``run_batch(dataset, idx, epoch, out=None)`` returns ``{key: tensor}``: the
    dense outputs (written into ``out[name]`` when given, a host tensor of ``(n, *shape)``),
    the ragged ones in their delivered form (``ragged``: ``{output: RaggedDelivery}``, default
    padded with 0). On CUDA every tensor is on the device, ready once ``ready_event``
    completed."""

    def __init__(self, transform: SampleTransform, *, ragged: Mapping | None = None, **kw):
        super().__init__(transform, **kw)
        self.ragged = dict(ragged or {})
        self._fed_inputs = transform.fed_inputs(**self._only)
        self._graph_out = transform.graph_outputs(**self._only)

    def _define(self):
        from nvidia.dali import fn, pipeline_def, types

        t = self.transform
        gpu = self.device == "cuda"
        names = t.param_names(**self._only)
        images = set(t.image_inputs)
        kinds = dict(getattr(t, "_input_dtypes", {}))

        @pipeline_def(batch_size=self._pipeline_batch(), num_threads=self.num_threads,
                      device_id=self.device_id if gpu else None, prefetch_queue_depth=1,
                      exec_dynamic=not gpu, seed=self.seed & 0x7FFFFFFF)
        def graph():
            inputs = {}
            for n in self._fed_inputs:
                dt = types.UINT8 if n in images else getattr(types, _DALI_TYPES[kinds.get(n, "float32")])
                inputs[n] = fn.external_source(name=f"in_{n}", dtype=dt, no_copy=n in images)
            params = {n: fn.external_source(name=n, dtype=types.FLOAT if d == np.float32 else types.INT32,
                                            no_copy=True) for n, d in names.items()}
            out = t.graph(inputs, params, decode_device="mixed" if gpu else "cpu",
                          device="gpu" if gpu else "cpu", **self._only)
            return tuple(out[k] for k in self._graph_out)

        return graph()

    def _run_once(self, samples: list, params: dict[str, np.ndarray], capture: bool = True):
        import contextlib

        from .quiet import decoder_output_captured

        pipe = self._pipeline()
        for k, n in enumerate(self._fed_inputs):
            pipe.feed_input(f"in_{n}", [s[k] for s in samples])
        for n in self._fed:
            pipe.feed_input(n, params[n])
        with decoder_output_captured() if capture else contextlib.nullcontext():
            return pipe.run()

    def _try(self, samples, params, capture: bool = True):
        try:  # a graph that cannot be built is the transform's fault, never the samples'
            self._pipeline()
        except Exception as e:
            raise RuntimeError(f"{self.transform!r}: its DALI graph cannot be built: {type(e).__name__}: {e}") from e
        return super()._try(samples, params, capture)

    def _canary_error(self) -> str | None:
        return None  # a canary needs every input of the transform: the batch's own verdict stands

    def read(self, dataset, idx: np.ndarray) -> tuple[list, dict]:
        """The inputs of samples ``idx``: per-sample tuples of what the graph is fed, and
        ``data`` for ``prepare`` (see ``SampleTransform.prepare``)."""
        t = self.transform
        data: dict[str, Any] = {}
        cols = []
        arrays = [n for n in t.inputs if n not in t.image_inputs]
        got = dataset.get_batch(idx, fields=[t.inputs[n] for n in arrays]) if arrays else {}
        for n in t.inputs:
            f = t.inputs[n]
            if n in t.image_inputs:
                data[n] = dataset.image_sizes(f, idx)
                if n in self._fed_inputs:
                    cols.append(dataset.views(f, idx, copy=True))
            else:
                v = got[f]
                data[n] = v
                if n in self._fed_inputs:
                    cols.append([np.ascontiguousarray(a) for a in v] if isinstance(v, list) else list(v))
        return list(zip(*cols)) if cols else [()] * len(idx), data

    def _check_sizes(self, data: dict) -> None:
        for n in self.transform.image_inputs:
            refuse_sizes(*data[n], self.max_pixels, what=f"image input {n!r}: ")

    def run_batch(self, dataset, idx: np.ndarray, epoch: int, out: Mapping | None = None) -> dict:
        idx = np.asarray(idx, dtype=np.int64)
        n = len(idx)
        if n == 0 or n > self.batch_size:
            raise ValueError(f"batch of {n} samples; this runner takes 1..{self.batch_size}")
        samples, data = self.read(dataset, idx)
        self._check_sizes(data)
        params, host = self.transform.prepare(self.seed, epoch, idx, data)
        import torch

        t = self.transform
        out = dict(out or {})
        if self.host_tail:  # the transform's torch finish writes into outputs of its own
            for k in self._graph_out:
                s = t.outputs.get(k)
                if s is not None and not s.ragged and k not in out:
                    out[k] = torch.empty((n, *s.shape), dtype=getattr(torch, s.dtype))
        if n > self._pipeline_batch():
            res = self._run_multi_chunked(samples, params, n, out)
        else:
            r, err = self._try(samples, params, capture=not self.whole_batches)
            if err is not None:
                self._raise_bad(self._locate_bad(samples, params, err), n, err)
            res = self._take_outputs(r, n, out, params)
        res.update(host)
        return self._shape(res, n)

    def _run_multi_chunked(self, samples, params, n, out) -> dict:
        def take(r, start: int, count: int, run_params: dict) -> dict:
            return self._take_outputs(r, count, {k: v[start:start + count] for k, v in out.items()}, run_params)

        parts: list[dict] = self._cpu_runs(samples, params, n, take)
        res: dict = {}
        for k in parts[0]:
            if k in out:
                res[k] = out[k]
            elif isinstance(parts[0][k], tuple):  # ragged: (values, lengths)
                res[k] = (np.concatenate([p[k][0] for p in parts]), np.concatenate([p[k][1] for p in parts]))
            else:
                res[k] = torch_cat([p[k] for p in parts])
        return res

    def _take_outputs(self, res: tuple, n: int, out: dict, params: dict) -> dict:
        """DALI's outputs of one run: dense ones as tensors (into ``out`` where given), ragged
        ones as ``(values, lengths)`` host arrays."""
        import torch

        t = self.transform
        named = dict(zip(self._graph_out, res))
        for k, v in named.items():
            if len(v) != n:
                raise RuntimeError(f"the transform's output {k!r} has {len(v)} samples for a batch of {n}")
        got: dict = {}
        if self.host_tail:
            t.finish(named, params, out)
            for k in named:
                if k in out:
                    got[k] = out[k]
        t0 = time.perf_counter()
        try:
            for k, v in named.items():
                if k in got or k not in t.outputs:
                    continue
                s = t.outputs[k]
                if s.ragged:
                    got[k] = _ragged_host(k, v, s)
                    continue
                shape = tuple(v.as_tensor().shape()) if v.is_dense_tensor() else None
                if shape != (n, *s.shape):
                    got_shape = shape or [tuple(v[i].shape()) for i in range(min(n, 3))]
                    raise RuntimeError(f"the transform's output {k!r} came out as {got_shape}; it declares "
                                       f"{(n, *s.shape)}")
                if self.device == "cuda":
                    got[k] = self._to_cuda(k, v.as_tensor(), n, s)
                    continue
                a = torch.from_dlpack(v.as_tensor()).reshape(n, *s.shape)
                if a.dtype != getattr(torch, s.dtype):
                    a = a.to(dtype=getattr(torch, s.dtype))  # (on the host: a dtype conversion)
                if k in out:
                    out[k].copy_(a)
                    a = out[k]
                got[k] = a
        finally:
            self.copy_s += time.perf_counter() - t0
        return got

    def _to_cuda(self, name: str, dali_tensor, n: int, s: Spec):
        """A dense DALI GPU output as a new CUDA tensor, copied on the runner's copy stream."""
        from .cuda_copy import copy_to_cuda

        dali_dtype = np.dtype(_np_of(dali_tensor)).name
        if dali_dtype != s.dtype:
            raise RuntimeError(f"the transform's output {name!r} came out as {dali_dtype}; it declares {s.dtype} "
                               "(cast it in the graph: fn.cast(node, dtype=...))")
        t, self.ready_event, self._copy_stream = copy_to_cuda(dali_tensor, (n, *s.shape), s.dtype, self.device_id,
                                                              self._copy_stream)
        return t

    def _shape(self, res: dict, n: int) -> dict:
        """Ragged outputs in their delivered form; on CUDA, host values copied to the device
        on the copy stream (``ready_event`` recorded after the last copy)."""
        import torch

        out: dict = {}
        for k, v in res.items():
            if isinstance(v, tuple):
                d = self.ragged.get(k)
                mode = getattr(d, "mode", "padded")
                vals, lens = pad_ragged(v[0], v[1], mode, getattr(d, "pad_value", 0), getattr(d, "max_length", None),
                                        getattr(d, "multiple", 1))
                out[k] = torch.from_numpy(vals)
                out[k + ("_offsets" if mode == "packed" else "_lengths")] = torch.from_numpy(lens)
            elif isinstance(v, np.ndarray):
                out[k] = torch.from_numpy(np.ascontiguousarray(v))
            else:
                out[k] = v
        if self.device != "cuda":
            return out
        from ..runtime.device import guard

        dev = torch.device("cuda", self.device_id)
        with guard(self.device_id):
            if self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream(device=self.device_id)
            with torch.cuda.stream(self._copy_stream):
                for k, v in out.items():
                    if isinstance(v, torch.Tensor) and not v.is_cuda:
                        out[k] = v.to(dev, non_blocking=True)
                ev = torch.cuda.Event(blocking=True)
                ev.record(self._copy_stream)
            self.ready_event = ev
        return out


def torch_cat(parts):
    import torch

    return torch.cat(parts)


def _np_of(dali_tensor) -> np.dtype:
    from nvidia.dali.types import to_numpy_type

    return to_numpy_type(dali_tensor.dtype)


def _ragged_host(name: str, v, s: Spec) -> tuple[np.ndarray, np.ndarray]:
    """A ragged DALI output as ``(values (T, *item), lengths)`` host arrays."""
    if hasattr(v, "as_cpu"):
        v = v.as_cpu()
    arrs = [np.asarray(v[i]) for i in range(len(v))]
    item = s.item
    rows = []
    for i, a in enumerate(arrs):
        if a.size == 0:
            a = a.reshape(0, *item)
        if a.shape[1:] != item:
            raise RuntimeError(f"the transform's ragged output {name!r} has items of shape {a.shape[1:]} in sample "
                               f"{i}; it declares {item}")
        rows.append(a.astype(s.np_dtype, copy=False))
    lengths = np.array([len(a) for a in rows], dtype=np.int64)
    values = np.concatenate(rows) if rows else np.zeros((0, *item), s.np_dtype)
    return values, lengths

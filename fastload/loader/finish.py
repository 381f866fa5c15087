"""From a ring batch to the user's batch, on the host: ``Finish`` and ``BatchInfo``.

``Finish(tensors, request)`` runs once per batch, in order, on host tensors: it gives ragged
fields their delivered form (``ragged.py``), splits a mixture's index into ``"source"`` and
the index within that dataset, adds string and bytes fields (lists), and then runs the
user's ``batch_transform`` — and, without a GPU, the ``device_transform`` (the device *is*
the host). On CUDA the delivery copies the result to the device and runs
``device_transform`` there, on fastload's copy stream (``cuda.py``).

``batch_transform(batch)`` or ``batch_transform(batch, info)``: ``info`` is a
:class:`BatchInfo` with a seed derived from (loader seed, epoch, the batch's stream
position), so random transforms give the same result after a resume; ``info.sample_seeds``
(one per row, from each sample's stream position) stay the same even when a different world
size regroups samples into other batches. An exception names the batch's samples
(:class:`~fastload.errors.TransformError`).

What a transform returns is checked (``Finish._check``: ``batch_transform``, and
``device_transform`` on the host and on CUDA alike, where it also gets ``info`` when it takes
two arguments), so a wrong batch fails at once, naming the batch and the key, instead of
putting every later batch out of line:

* a ``dict`` (any ``Mapping``) of ``str`` keys; keys may be added and dropped;
* every value a ``torch.Tensor``. A numpy array is converted with ``torch.from_numpy`` (no
  copy; a read-only array is copied first), from a ``batch_transform`` and from a
  ``device_transform`` on the CPU; on CUDA a ``device_transform``'s tensors must be on the
  loader's device. Lists are allowed only for the string and bytes fields named in
  ``fields=`` (one item per row), as fastload delivers them;
* every value has the batch's rows along dimension 0: ``len(index)`` of the batch as fastload
  delivered it (a transform cannot drop or add samples). Exempt: the keys of a ragged field
  delivered ``ragged="packed"`` or with ``pack_to`` (``name``, ``name + "_offsets"``,
  ``name + "_positions"``), whose lengths count tokens and pieces; a key the transform adds
  may also have the length of such a field's dimension 0 (per-token values, e.g. labels);
* ``"index"`` (and a mixture's ``"source"``) are fastload's: put back when the transform's
  dict leaves them out.

Anything else raises ``TransformError`` naming the transform, the batch (stream position,
epoch, samples) and the offending key.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from ..errors import TransformError
from ..sampling.packing import Request
from ..sampling.streams import splitmix64 as _mix64
from .ragged import shape_batch
from .source import INDEX

__all__ = ["SOURCE", "BatchInfo", "Finish", "takes_info"]

SOURCE = "source"  # a mixture's batch key: which dataset each row came from
_MASK = (1 << 64) - 1


def derive_seeds(seed: int, epoch: int, positions: np.ndarray) -> np.ndarray:
    """One 63-bit seed per stream position: a pure function of (seed, epoch, position)."""
    with np.errstate(over="ignore"):
        key = _mix64(np.array([seed & _MASK], np.uint64) ^ _mix64(np.array([epoch & _MASK], np.uint64)
                                                                   + np.uint64(0x9E3779B97F4A7C15)))
        x = _mix64(np.asarray(positions, dtype=np.int64).astype(np.uint64) + key)
    return (x >> np.uint64(1)).astype(np.int64)


@dataclass(frozen=True)
class BatchInfo:
    """What a ``batch_transform`` may want to know about its batch.

    ``seed``: the batch's seed, from (loader seed, epoch, ``position``) — the same after a
    resume. ``position``: the stream position of the batch's first sample (its first token
    with ``pack_to``). ``index``: the global sample indices (within each dataset of a
    mixture; ``source`` says which). ``sample_seeds``: one seed per row, from each sample's
    own stream position, so per-sample randomness is also the same at another world size.
    """

    seed: int
    epoch: int
    position: int
    index: np.ndarray
    source: np.ndarray | None = None
    sample_seeds: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64), repr=False)

    def generator(self):
        """A ``torch.Generator`` seeded with ``seed`` (private to this batch: thread-safe)."""
        import torch

        return torch.Generator().manual_seed(self.seed)

    def rng(self) -> np.random.Generator:
        """A numpy ``Generator`` seeded with ``seed``."""
        return np.random.default_rng(self.seed)


def takes_info(fn: Callable) -> bool:
    """True when ``fn`` accepts a second positional argument (``fn(batch, info)``)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # builtins without a signature: called with the batch only
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)


class Finish:
    """See the module docstring. Built once per epoch by the Loader's machinery (machinery.py)."""

    def __init__(self, *, dataset, options, epoch: int, on_host_device: bool) -> None:
        self._dataset = dataset
        self._ragged = dict(options.ragged)
        self._lists = list(options.list_fields)
        self._split = getattr(dataset, "split", None)  # a mixture: index -> (source, local index)
        self._transform = options.batch_transform
        self._device_transform = options.device_transform if on_host_device else None
        fns = (options.batch_transform, options.device_transform)
        self._info = {fn: takes_info(fn) for fn in fns if fn is not None}
        self._seed = options.seed
        self._epoch = epoch
        # keys whose length is not the batch's rows (ragged fields delivered packed / pack_to),
        # and those of them whose dimension 0 a transform's new per-token values may have
        self._free: set[str] = set()
        self._tokens: list[str] = []
        for name, d in self._ragged.items():
            if d.mode != "padded":
                self._free.update((name, *d.keys(name)))
                self._tokens.extend(k for k in (name, *d.keys(name)) if not k.endswith("_offsets"))
        for name, d in getattr(options, "output_ragged", {}).items():  # a sample transform's, shaped by its runner
            if d.mode != "padded":
                self._free.update((name, *d.keys(name)))
                self._tokens.append(name)
        self._list_set = frozenset(self._lists)
        self.names = [_name(w, fn) for w, fn in (("batch_transform", options.batch_transform),
                                                 ("device_transform", options.device_transform)) if fn is not None]

    @property
    def trivial(self) -> bool:
        """Nothing to do beyond the ring's own batch (the common fixed-field case)."""
        return not (self._ragged or self._lists or self._split or self._transform or self._device_transform)

    def __call__(self, batch: dict, req: Request) -> dict:
        index = gidx = batch[INDEX].numpy()
        for name, d in self._ragged.items():
            shape_batch(batch, name, d)
        source = None
        if self._split is not None:
            import torch

            source, local = self._split(index)
            batch[SOURCE] = torch.from_numpy(source)
            batch[INDEX] = torch.from_numpy(local)
            index = local
        if self._lists:
            batch.update(self._dataset.get_batch(gidx, fields=self._lists))
        for what, fn in (("batch_transform", self._transform), ("device_transform", self._device_transform)):
            if fn is not None:
                batch = self._run(what, fn, batch, req, index, source)
        return batch

    def device_transform(self, fn: Callable, batch: dict, req: Request, index: np.ndarray, device) -> dict:
        """``fn`` as the ``device_transform`` of a batch on a CUDA ``device`` (``cuda.py``), with
        the same info, error and result checks as on the host; ``index``: the batch's global
        sample indices (a host array)."""
        source = None
        if self._split is not None:
            source, index = self._split(index)
        return self._run("device_transform", fn, batch, req, index, source, device=device)

    def _run(self, what: str, fn: Callable, batch: dict, req: Request, index: np.ndarray, source,
             device=None) -> dict:
        args = (batch,)
        if self._info[fn]:
            seed = int(derive_seeds(self._seed, self._epoch, np.array([req.position]))[0])
            args = (batch, BatchInfo(seed, self._epoch, int(req.position), index, source,
                                     derive_seeds(self._seed, self._epoch, req.stream_positions())))
        # what the result is checked against, taken before fn can change the dict in place
        kept = {k: batch[k] for k in (INDEX, SOURCE) if k in batch}
        given = {k: _dim0(v) for k, v in batch.items()}
        try:
            out = fn(*args)
        except Exception as e:
            raise TransformError(f"{_name(what, fn)} failed on the batch at stream position {req.position} of epoch "
                                 f"{self._epoch}, {_samples(index, source)}: {type(e).__name__}: {e}") from e
        if not isinstance(out, Mapping) or not all(isinstance(k, str) for k in out):
            raise TransformError(f"{_name(what, fn)} must return a dict of str -> tensor; it returned "
                                 f"{type(out).__name__} for the batch at stream position {req.position} of "
                                 f"epoch {self._epoch}, {_samples(index, source)}")
        return self._check(what, fn, dict(out), rows=len(index), kept=kept, given=given, req=req, index=index,
                           source=source, device=device)

    def _check(self, what: str, fn: Callable, out: dict, *, rows: int, kept: dict, given: dict, req: Request,
               index: np.ndarray, source, device) -> dict:
        """``out`` as the rules of the module docstring say (numpy arrays converted, ``index``
        put back), or TransformError naming the key."""
        import torch

        def bad(key: str, problem: str) -> TransformError:
            return TransformError(
                f"{_name(what, fn)} returned {key!r} {problem}, for the batch at stream position {req.position} "
                f"of epoch {self._epoch} ({rows} rows), {_samples(index, source)}. A transform returns a dict "
                "of tensors, each with the batch's rows along dimension 0 (see fastload.loader.finish)")

        for k, v in kept.items():
            out.setdefault(k, v)  # fastload's keys: always delivered
        for k, v in out.items():
            if isinstance(v, np.ndarray):
                if device is not None:
                    raise bad(k, f"as a numpy array (on the host); a device_transform returns tensors on {device}")
                try:
                    v = out[k] = torch.from_numpy(v if v.flags.writeable else v.copy())
                except TypeError as e:
                    raise bad(k, f"as a numpy array of dtype {v.dtype}, which torch cannot hold ({e})") from None
            if isinstance(v, torch.Tensor):
                if device is not None and not _on(v, device):
                    raise bad(k, f"on {v.device}, not on the loader's device {device}; create new tensors "
                                 "with device=batch['index'].device")
                if k in self._free:
                    continue
                if v.dim() == 0:
                    raise bad(k, f"as a 0-d tensor ({_short(v)}); it needs one row per sample: {rows} along "
                                 "dimension 0")
                n = int(v.shape[0])
                if n != rows and (k in given or n not in self._token_lengths(out, given)):
                    raise bad(k, f"with {n} rows along dimension 0 (shape {tuple(v.shape)}), not the batch's "
                                 f"{rows}")
            elif isinstance(v, (list, tuple)) and k in self._list_set:
                if len(v) != rows:
                    raise bad(k, f"as a {type(v).__name__} of {len(v)} items, not the batch's {rows}")
            else:
                lists = f"; lists only for the string/bytes fields {self._lists}" if self._lists else ""
                raise bad(k, f"as {_kind(v)}, not a tensor (numpy arrays are converted{lists})")
        return out

    def _token_lengths(self, out: dict, given: dict) -> set[int]:
        """Dimension 0 of the packed ragged fields' values (tokens, token rows), as given to the
        transform and as returned: a value the transform adds may have one of these lengths."""
        got = {given.get(k) for k in self._tokens} | {_dim0(out.get(k)) for k in self._tokens}
        got.discard(None)
        return got


def _dim0(v: Any) -> int | None:
    shape = getattr(v, "shape", None)
    return int(shape[0]) if shape is not None and len(shape) else None


def _on(t, device) -> bool:
    d = t.device
    return d.type == device.type and (device.index is None or d.index == device.index)


def _short(v) -> str:
    try:
        return repr(v.item())
    except Exception:  # pragma: no cover
        return "a scalar"


def _kind(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return f"a {type(v).__name__} of {len(v)} items"
    return f"a {type(v).__module__}.{type(v).__qualname__}" if type(v).__module__ != "builtins" else \
        f"a {type(v).__name__} ({v!r:.40})"


def _name(what: str, fn: Callable) -> str:
    return f"{what} {getattr(fn, '__qualname__', None) or type(fn).__name__}"


def _samples(index: np.ndarray, source: np.ndarray | None, limit: int = 16) -> str:
    ids = index[:limit].tolist()
    if source is not None:
        ids = [f"{int(s)}:{int(i)}" for s, i in zip(source[:limit], index[:limit])]
        what = "samples (dataset:index)"
    else:
        what = "samples"
    more = f", ... ({len(index)} in all)" if len(index) > limit else ""
    return f"{what} {', '.join(map(str, ids))}{more}"

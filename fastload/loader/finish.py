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
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from ..errors import TransformError
from ..packing import Request
from .ragged import shape_batch
from .source import INDEX

__all__ = ["SOURCE", "BatchInfo", "Finish", "takes_info"]

SOURCE = "source"  # a mixture's batch key: which dataset each row came from
_MASK = (1 << 64) - 1


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, vectorised (uint64 arithmetic wraps)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


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
    """See the module docstring. Built once per epoch by the Loader's parts."""

    def __init__(self, *, dataset, options, epoch: int, on_host_device: bool) -> None:
        self._dataset = dataset
        self._ragged = dict(options.ragged)
        self._lists = list(options.list_fields)
        self._split = getattr(dataset, "split", None)  # a mixture: index -> (source, local index)
        self._transform = options.batch_transform
        self._device_transform = options.device_transform if on_host_device else None
        self._info = {fn: takes_info(fn) for fn in (self._transform, self._device_transform) if fn is not None}
        self._seed = options.seed
        self._epoch = epoch

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

    def _run(self, what: str, fn: Callable, batch: dict, req: Request, index: np.ndarray, source) -> dict:
        args = (batch,)
        if self._info[fn]:
            seed = int(derive_seeds(self._seed, self._epoch, np.array([req.position]))[0])
            args = (batch, BatchInfo(seed, self._epoch, int(req.position), index, source,
                                     derive_seeds(self._seed, self._epoch, req.stream_positions())))
        try:
            out = fn(*args)
        except Exception as e:
            raise TransformError(f"{_name(what, fn)} failed on the batch at stream position {req.position} of epoch "
                                 f"{self._epoch}, {_samples(index, source)}: {type(e).__name__}: {e}") from e
        if not isinstance(out, Mapping) or not all(isinstance(k, str) for k in out):
            raise TransformError(f"{_name(what, fn)} must return a dict of str -> tensor; it returned "
                                 f"{type(out).__name__} for the batch at stream position {req.position} of "
                                 f"epoch {self._epoch}, {_samples(index, source)}")
        return dict(out)


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

"""What video and audio transforms share (``fastload.video``, ``fastload.audio``).

A media transform is a :class:`~fastload.pipeline.presets.Transform` whose per-sample
parameters need what convert probed of each file (a video's frame count, an audio file's
sample rate): the Loader binds it to its dataset and field (:meth:`MediaTransform.for_dataset`,
a bound copy; the transform the user made stays unbound), and ``params`` reads those hidden
columns for the batch's global indices. Its DALI runner refuses, before DALI runs, the samples
the device cannot decode (``refuse``: H.264 in DALI's CPU video graph), as
:class:`~fastload.errors.BadSamples` naming the codec and what to do.
"""
from __future__ import annotations

import copy
import math
from typing import Any, Sequence

import numpy as np

from ..errors import BadSamples
from .presets import Transform
from .runner import Runner

__all__ = ["MediaRunner", "MediaTransform", "channels", "check_dtype_layout"]


def channels(name: str, v: Any) -> tuple[float, ...] | None:
    if v is None:
        return None
    try:
        t = tuple(float(x) for x in (v if isinstance(v, (list, tuple)) else [v] * 3))
    except (TypeError, ValueError):
        raise ValueError(f"{name}={v!r} must be 3 numbers (one per RGB channel, in 0..1 units)") from None
    if len(t) != 3 or not all(math.isfinite(x) for x in t):
        raise ValueError(f"{name}={v!r} must be 3 finite numbers (one per RGB channel, in 0..1 units)")
    return t


def check_dtype_layout(dtype: str, layout: str, dtypes: Sequence[str], layouts: Sequence[str]) -> None:
    if dtype not in dtypes:
        raise ValueError(f"dtype={dtype!r} must be one of {', '.join(dtypes)}")
    if layout not in layouts:
        raise ValueError(f"layout={layout!r} must be one of {', '.join(layouts)}")


class MediaTransform(Transform):
    """A transform of a ``video`` or ``audio`` field (see the module docstring)."""

    field_kind = "video"
    _ds: Any = None
    _field: str | None = None

    def for_dataset(self, ds, name: str) -> MediaTransform:
        """A copy bound to field ``name`` of ``ds`` (the dataset whose global indices the
        Loader hands to ``params``); ValueError when the field is not of this transform's kind."""
        kind = ds.fields[name].kind
        if kind != self.field_kind:
            raise ValueError(f"transforms[{name!r}]: {self!r} is for {self.field_kind} fields; {name!r} is a "
                             f"{kind} field")
        t = copy.copy(self)
        t._ds, t._field = ds, name
        t._bound(ds, name)
        return t

    def _bound(self, ds, name: str) -> None:
        """Settle what depends on the dataset (e.g. the frame size a ``size=None`` clip keeps)."""

    def info(self, index: np.ndarray, names: Sequence[str]) -> dict[str, Any]:
        if self._ds is None:
            raise RuntimeError(f"{self!r} reads what convert probed of each file: it runs inside a Loader "
                               "(Loader(..., transforms={field: ...})), which binds it to the dataset")
        return self._ds.media_info(self._field, np.asarray(index, dtype=np.int64), list(names))

    def refuse(self, index: np.ndarray, device: str) -> list[tuple[int, str]]:
        """``[(position, reason)]`` of the samples ``device`` cannot decode."""
        return []

    def runner(self, *, device: str = "cpu", batch_size: int, num_threads: int | None = None,
               prefetch: int | None = None, seed: int = 0, device_id: int | None = None,
               dali_only: bool = False) -> Runner:
        return MediaRunner(self, device=device, batch_size=batch_size, num_threads=num_threads, prefetch=prefetch,
                           seed=seed, device_id=device_id, dali_only=dali_only)

    def __repr__(self) -> str:
        d = self.describe()
        kind = d.pop("kind")
        return f"fastload.{self.field_kind}.{kind}({', '.join(f'{k}={v!r}' for k, v in d.items())})"


class MediaRunner(Runner):
    """A :class:`Runner` that refuses what the device cannot decode before DALI sees it."""

    def run(self, encoded: list, widths: np.ndarray, heights: np.ndarray, indices: np.ndarray, epoch: int,
            out=None):
        refused = self.transform.refuse(np.asarray(indices), self.device)
        if refused:
            raise BadSamples([p for p, _ in refused], [r for _, r in refused])
        return super().run(encoded, widths, heights, indices, epoch, out=out)

    def _locate_bad(self, encoded: list, params: dict[str, np.ndarray], err: str) -> dict[int, str]:
        """Bisected on this runner's own device: DALI's CPU video decoder does not read every
        codec the GPU's does, so a CPU search would blame every H.264 video of a batch."""
        bad: dict[int, str] = {}
        self._find_bad(encoded, params, np.arange(len(encoded)), err, bad)
        return bad

    def _canary_error(self) -> str | None:
        """No built-in canary (the image runners decode a JPEG): a batch every sample of which
        fails is reported as such, each with DALI's reason."""
        return None

"""``fastload.Mixture``: several datasets read as one, in fixed proportions.

    mix = fastload.Mixture({"web": web, "books": books}, weights={"web": 0.7, "books": 0.3},
                           epoch_size=1_000_000)
    loader = fastload.Loader(mix, batch_size=32)          # or:
    loader = fastload.Loader([web, books], mix=[0.7, 0.3], epoch_size=1_000_000, batch_size=32)

This is the container: it opens the datasets (paths or URLs; their caches share one budget),
checks the proportions and the epoch's length, and reads them as one
:class:`~fastload.store.concat.ConcatReader`. The order a Loader reads it in — the model of
what a mixture epoch is — lives in :mod:`fastload.sampling.mixture`.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..validate import check_choice, check_int

__all__ = ["PER", "Mixture"]

PER = ("batch", "epoch")


class Mixture:
    """Datasets mixed in fixed proportions (see the module docstring).

    Args:
        datasets: a list of datasets (or paths), or a dict name -> dataset.
        weights: proportions (any positive numbers; normalised), a list in the same order
            or a dict by name.
        epoch_size: positions per epoch; or ``stop_on``: the name (or position) of the
            dataset whose one complete pass is an epoch. Exactly one of the two.
        per: ``"batch"`` (each batch holds floor/ceil of ``B * p`` of each dataset) or
            ``"epoch"`` (exact totals per epoch, random per batch).
        fields: fields to read (default: every dataset must have the same fields).
        remote: how the datasets given as URLs are opened (a
            :class:`~fastload.remote.options.RemoteOptions`; see :class:`fastload.Dataset`);
            its ``cache_limit`` is the budget of all of them together, shared out by what
            each one's order needs (default: what fits in 80% of the free disk, shared the
            same way).
        cache_dir, cache_limit, filesystem, storage_options, download_timeout, download_threads: the
            same settings as keywords (not together with ``remote``).

    The Loader's ``shuffle`` decides whether each dataset's passes are in random or natural
    order (the mixture's layout is always random). ``close()`` closes the datasets the
    mixture opened from paths or URLs.
    """

    def __init__(self, datasets: Sequence[Any] | Mapping[str, Any], weights: Sequence[float] | Mapping[str, float],
                 *, epoch_size: int | None = None, stop_on: str | int | None = None, per: str = "batch",
                 fields: Sequence[str] | None = None, cache_dir: Any = None, cache_limit: Any = None,
                 filesystem: Any = None, storage_options: Any = None, download_timeout: Any = None,
                 download_threads: Any = None, remote: Any = None):
        from ..remote.options import RemoteOptions
        from . import DatasetReader
        from .concat import ConcatReader

        remote = RemoteOptions.from_keywords(remote, cache_dir=cache_dir, cache_limit=cache_limit,
                                             filesystem=filesystem, storage_options=storage_options,
                                             download_timeout=download_timeout, download_threads=download_threads)

        if isinstance(datasets, Mapping):
            names, items = [str(k) for k in datasets], list(datasets.values())
        elif isinstance(datasets, (list, tuple)):
            items = list(datasets)
            names = [_default_name(d, i) for i, d in enumerate(items)]
        else:
            raise ValueError(f"datasets must be a list or a dict of datasets, got {type(datasets).__name__}")
        if not items:
            raise ValueError("a Mixture needs at least one dataset")
        if len(set(names)) != len(names):
            names = [f"{n}#{i}" for i, n in enumerate(names)]
        self.cache_limit: int | None = None  # the budget shared by the caches of the URLs this mixture opened
        self.shared_caches: list = []  # those caches (a Loader shares the budget again by their needs)
        self._opened: list = []  # readers opened here (closed by close())
        try:
            readers = self._open(items, remote, DatasetReader)
        except BaseException:
            self.close()
            raise
        self.names = names
        self.weights = _weights(weights, names)
        self.per = check_choice("per", per, PER)
        if (epoch_size is None) == (stop_on is None):
            raise ValueError("say how long a mixture epoch is: epoch_size=N (positions) or stop_on=NAME "
                             "(one complete pass over that dataset), not both")
        self.epoch_size = None if epoch_size is None else check_int("epoch_size", epoch_size, min=1)
        if stop_on is not None:
            if isinstance(stop_on, str) and stop_on in names:
                stop_on = names.index(stop_on)
            if not (isinstance(stop_on, int) and not isinstance(stop_on, bool) and 0 <= stop_on < len(names)):
                raise ValueError(f"stop_on={stop_on!r} must name one of the datasets {names} (or be its position)")
        self.stop_on = stop_on
        try:
            self.reader = ConcatReader(readers, names, fields)
            self.sizes = np.array([len(r) for r in readers], dtype=np.int64)
            if (self.sizes == 0).any():
                raise ValueError(f"the mixture's dataset {names[int(np.flatnonzero(self.sizes == 0)[0])]!r} is empty")
        except BaseException:
            self.close()
            raise

    def _open(self, items: list, remote: Any, reader_type: type) -> list:
        from ..remote.url import is_remote

        urls = [d for d in items if is_remote(d)]
        if remote.given() and not urls:
            raise ValueError(f"{sorted(remote.given())} go with datasets given as URLs (s3://, gs://, az://, "
                             "https://); this mixture has none")
        each = remote.replace(cache_limit=None)  # the one budget is shared out below
        readers = []
        for d in items:
            if isinstance(d, reader_type):
                readers.append(d)
            elif isinstance(d, (str, os.PathLike)):
                from . import Dataset

                readers.append(Dataset(d, remote=each) if is_remote(d) else Dataset(d))
                self._opened.append(readers[-1])
            else:
                raise ValueError(f"a mixture's dataset must be a fastload Dataset or a path, got {type(d).__name__}")
        caches = [r.cache for r in self._opened if getattr(r, "cache", None) is not None]
        if caches:
            from ..remote.budget import share_budget

            self.cache_limit = share_budget(caches, remote.cache_limit)
            self.shared_caches = caches
        return readers

    def close(self) -> None:
        """Close the datasets this mixture opened (their download threads and caches)."""
        opened, self._opened = self._opened, []
        for r in opened:
            r.close()

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}: {w:.3g}" for n, w in zip(self.names, self.weights))
        epoch = f"epoch_size={self.epoch_size}" if self.stop_on is None else f"stop_on={self.names[self.stop_on]!r}"
        return f"fastload.Mixture({{{parts}}}, {epoch}, per={self.per!r})"



def _default_name(d: Any, i: int) -> str:
    path = getattr(d, "path", d)
    from ..remote.url import display_url, is_remote

    if is_remote(path):
        path = display_url(path)  # no query (endpoint, options) in the name
    try:
        return os.path.basename(os.fspath(path).rstrip("/")) or str(i)
    except TypeError:
        return str(i)


def _weights(weights: Any, names: list[str]) -> np.ndarray:
    if isinstance(weights, Mapping):
        unknown = [k for k in weights if k not in names]
        if unknown or len(weights) != len(names):
            raise ValueError(f"weights {dict(weights)} must give one weight per dataset {names}")
        weights = [weights[n] for n in names]
    try:
        w = np.asarray(weights, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"weights={weights!r} must be numbers, one per dataset") from None
    if w.shape != (len(names),):
        raise ValueError(f"weights={list(np.atleast_1d(w))} must have one entry per dataset ({len(names)}: {names})")
    if not np.isfinite(w).all() or (w <= 0).any():
        raise ValueError(f"weights={w.tolist()} must be finite and > 0 (leave a dataset out instead of weight 0)")
    return w / w.sum()

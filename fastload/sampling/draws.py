"""Weighted and class-balanced draws: :func:`weighted_draws` (with or without replacement),
:func:`balanced_draws` (every batch holds each class equally often), and the checks of
their per-sample arguments (``weights``, ``balance_labels``)."""
from __future__ import annotations

from typing import Any

import numpy as np

from .order import Balanced, Weighted
from .tables import CHUNK, balance_table, own_copy, weight_table
from .streams import WEIGHTED, _index_dtype, generator


def weighted_draws(weights: np.ndarray, num_draws: int, replacement: bool, seed: int, epoch: int) -> np.ndarray:
    """``num_draws`` indices drawn with probability proportional to ``weights``.

    With replacement: the materialised :class:`~fastload.sampling.order.Weighted` stream
    (inverse CDF over float64 cumulative weights of a uniform per position: exact for any
    number of samples, where ``torch.multinomial`` stops at 2^24). Without:
    Efraimidis–Spirakis (the ``num_draws`` smallest ``Exp(1) / w`` keys), which is
    sequential sampling without replacement."""
    n = len(weights)
    if replacement:
        stream = Weighted(weight_table(weights), num_draws, seed, epoch)
        return np.asarray(stream).astype(_index_dtype(n), copy=False)
    rng = generator(seed, epoch, WEIGHTED)
    with np.errstate(divide="ignore"):
        keys = rng.standard_exponential(n) / weights  # weight 0 -> inf: never chosen
    if num_draws < n:
        part = np.argpartition(keys, num_draws - 1)[:num_draws]
        idx = part[np.argsort(keys[part], kind="stable")]
    else:
        idx = np.argsort(keys, kind="stable")
    return idx.astype(_index_dtype(n), copy=False)


def balanced_draws(labels: np.ndarray, num_draws: int, batch_size: int, seed: int, epoch: int) -> np.ndarray:
    """``num_draws`` indices in which every run of ``batch_size`` positions holds each class
    ``batch_size // C`` times, the ``batch_size % C`` extra slots rotating over the classes
    in random order (so over the epoch every class is drawn equally often): the materialised
    :class:`~fastload.sampling.order.Balanced` stream. Each class's samples are read in
    reshuffled passes (minority classes repeat, majority classes are subsampled)."""
    stream = Balanced(balance_table(labels), num_draws, batch_size, seed, epoch)
    return np.asarray(stream).astype(_index_dtype(len(labels)), copy=False)


def check_weights(weights: Any, num_samples: int) -> tuple[np.ndarray, int]:
    """``weights`` as an array, one per sample (>= 0, finite, not all zero; real numbers or
    bools), and how many of them are positive. Checked in chunks; then the sampler's own,
    read-only (:func:`~fastload.sampling.tables.own_copy`: a copy, kept per node when large,
    unless nothing can change the array, e.g. a read-only memory map), so that an in-place
    change of the caller's array after construction changes neither the draws nor the
    state's digest. The tables convert them to float64 chunk by chunk."""
    w = np.asarray(weights)
    if w.ndim != 1 or len(w) != num_samples:
        raise ValueError(f"weights has shape {w.shape}; expected ({num_samples},), one per sample")
    if (not np.issubdtype(w.dtype, np.number) and w.dtype.kind != "b") or np.issubdtype(w.dtype, np.complexfloating):
        raise ValueError(f"weights must be real numbers (or bools), got dtype {w.dtype}")
    positive = 0
    bad = neg = None  # (first index, value, count)
    for a in range(0, len(w), CHUNK):
        part = w[a:a + CHUNK].astype(np.float64, copy=False)
        nonfinite = np.flatnonzero(~np.isfinite(part))
        if len(nonfinite):
            bad = bad or (a + int(nonfinite[0]), part[nonfinite[0]], 0)
            bad = bad[:2] + (bad[2] + len(nonfinite),)
        below = np.flatnonzero(part < 0)
        if len(below):
            neg = neg or (a + int(below[0]), part[below[0]], 0)
            neg = neg[:2] + (neg[2] + len(below),)
        positive += int(np.count_nonzero(part))
    if bad:
        raise ValueError(f"weights[{bad[0]}]={bad[1]} is not finite ({bad[2]} such weights)")
    if neg:
        raise ValueError(f"weights[{neg[0]}]={neg[1]} is negative ({neg[2]} negative weights)")
    if positive == 0:
        raise ValueError("weights are all zero; at least one sample needs a positive weight")
    return own_copy(w, "weights"), positive


def check_balance_labels(balance_labels: Any, num_samples: int) -> np.ndarray:
    """``balance_labels`` as an array, one label per sample (no NaN or inf): the sampler's
    own, read-only, like the weights (:func:`check_weights`)."""
    lab = np.asarray(balance_labels)
    if lab.ndim != 1 or len(lab) != num_samples:
        raise ValueError(f"balance_labels has shape {lab.shape}; expected ({num_samples},)")
    if lab.dtype.kind == "f" and not all(np.isfinite(lab[a:a + CHUNK]).all() for a in range(0, len(lab), CHUNK)):
        raise ValueError("balance_labels contains NaN or inf")
    return own_copy(lab, "labels")

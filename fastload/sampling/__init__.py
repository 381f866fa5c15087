"""Which global sample indices each rank reads at each step.

Everything here is a pure function of (sizes, seed, epoch, world size, batch size) plus a
thin :class:`Sampler` object that remembers the epoch and how far the epoch has been read.

The model
---------
An epoch is a **stream**: a sequence of ``M`` global sample indices, identical on every rank
and every machine for the same arguments (random streams keyed by ``(seed, epoch)`` through
numpy's ``SeedSequence``):

* plain: a permutation of ``0..N-1`` (``shuffle=False``: the natural order), ``M = N``: a
  keyed bijection of ``[0, N)`` (a Feistel network with cycle walking, keyed by seed and
  epoch; ``bijection.py``) computed **per position**, so a rank computes only the indices of
  its batches in flight: no memory per sample, the first batch in microseconds at any ``N``,
  ~30 ns per index (docs/explanation/sampling-order.md);
* ``shuffle_mode="window"``: shards in a random order (a keyed bijection of the shards),
  samples shuffled within each window of ``window`` consecutive shards of that order (each
  window by its own keyed bijection), also per position (locality for data bigger than
  RAM);
* weighted: ``M = num_draws`` (default ``N``) draws by ``weights``, with replacement (inverse
  CDF over float64 cumulative weights, so any ``N``) or without (Efraimidis–Spirakis keys);
* class-balanced: ``M = num_draws`` draws where every run of ``batch_size`` stream positions
  holds the same number of samples of each class (as nearly as ``batch_size`` allows),
  each class cycled through in reshuffled passes.

Ranks read the stream in **global steps**. With ``W`` ranks and batch size ``B`` a step
covers ``B * W`` consecutive stream positions, rank ``r`` taking the ``r``-th block of ``B``
(contiguous runs per rank: shard-local reads). After ``k`` steps, exactly the first
``k * B * W`` positions have been read, by all ranks together — that count (``consumed``) is
the whole resume state, and it means the same thing at any world size.

Coverage is ``DistributedSampler``'s: every rank reads ``ceil(M / W)`` samples
(``drop_last=False``: the stream is extended by wrapping around to its start, so the
repeated samples are the first ``pad = ceil(M/W)*W - M`` positions of the epoch's stream,
again and again if ``pad > M``), or ``M // W`` samples (``drop_last=True``: the last
``M % W`` positions of the stream are not read this epoch). The last step may be shorter
than ``B`` (the same size on every rank), so every rank yields the same number of batches.

Resuming with a different world size ``W'`` from ``consumed = C``: the positions ``C..M-1``
not read yet are split over ``W'`` ranks by the same rules (padding again wraps to the
epoch's first positions). Before and after the restart together, every stream position is
read exactly once, up to the padding/dropping described above. With the same world size the
remaining batches equal an uninterrupted run's.

The package
-----------
``streams`` (the keyed random streams), ``bijection`` (the keyed bijection), ``order`` (an
epoch's stream as a function of the position: :class:`~fastload.sampling.order.Stream`;
:func:`permutation`, :func:`window_permutation` materialise one), ``tables``
(the per-sample tables of weighted and class-balanced draws, built once per node and
memory-mapped by its ranks), ``draws`` (:func:`weighted_draws`, :func:`balanced_draws`),
``plan`` (:func:`epoch_order`, :func:`epoch_stream`, the rank partition
:class:`RankBatches`, :class:`EpochPlan`),
``state`` (the resume state and its checks), ``sampler`` (the :class:`Sampler` object).
Every name is importable from here.
"""
from __future__ import annotations

from . import streams  # noqa: F401  (the submodule, named in the docstring)
from .draws import balanced_draws, weighted_draws
from .order import Stream, permutation, window_permutation
from .plan import EpochPlan, RankBatches, epoch_order, epoch_stream, per_rank_count, rank_batch_bounds
from .sampler import SHUFFLE_MODES, Sampler
from .state import SAMPLER_STATE_VERSION

__all__ = ["SAMPLER_STATE_VERSION", "SHUFFLE_MODES", "EpochPlan", "RankBatches", "Sampler", "Stream",
           "balanced_draws", "epoch_order", "epoch_stream", "per_rank_count", "permutation", "rank_batch_bounds",
           "weighted_draws", "window_permutation"]


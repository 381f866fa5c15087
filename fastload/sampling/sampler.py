"""The :class:`Sampler` object: its arguments checked once, the current epoch and how far
it has been read, each pass as an :class:`EpochPlan`, and its state for an exact resume at
any world size (the order itself comes from the pure functions of ``plan``, ``streams``
and ``draws``)."""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import format_bytes
from ..runtime.system import check_fits_in_memory
from ..validate import check_bool, check_int, check_seed
from .draws import check_balance_labels, check_weights
from .order import Drawn, Stream
from .tables import balance_table, weight_table
from .plan import EpochPlan, RankBatches, epoch_order, epoch_stream, per_rank_count
from .state import SAMPLER_STATE_VERSION, check_state, digest

SHUFFLE_MODES = ("full", "window")


def _int(name: str, v: Any, lo: int) -> int:
    return check_int(name, v, min=lo)


# Weighted draws without replacement, computed whole on every rank each epoch: bytes per
# sample while drawing (measured peak: the keys, their exponentials and the sort's indices)
# and per draw (the epoch's stream and the next one's, prepared ahead)
_DRAWN_SAMPLE_BYTES, _DRAWN_DRAW_BYTES = 20, 8
DRAWN_WARN = 10**8  # samples: past this, a warning says what each epoch's order costs each rank
logger = logging.getLogger("fastload")


def _check_drawn(n: int, m: int) -> None:
    """A clear error where weighted draws without replacement over ``n`` samples (``m`` draws)
    cannot be computed in this machine's memory, a warning past :data:`DRAWN_WARN` samples."""
    what = (f"num_draws={m:,} weighted draws without replacement over {n:,} samples (each epoch's order is "
            "computed whole, on every rank: Efraimidis-Spirakis keys need a global sort)")
    hint = ("use replacement=True (drawn per position from a table kept once per node: any number of samples), "
            "or fewer samples / a lower num_draws")
    nbytes = n * _DRAWN_SAMPLE_BYTES + m * _DRAWN_DRAW_BYTES
    check_fits_in_memory(nbytes, what, hint)
    if n >= DRAWN_WARN:
        logger.warning("fastload: %s: each epoch costs every rank about %s of memory and a sort of %s keys "
                       "(1-10 s of one core per 10^7 samples); %s", what, format_bytes(nbytes), f"{n:,}", hint)


PREPARE_MIN_NS = 2_000_000  # prepare() computes an order in the background only above ~2 ms


class Sampler:
    """Per-rank batches of global sample indices; ``DistributedSampler`` semantics plus
    weighted and class-balanced sampling and exact mid-epoch resume at any world size.

    Args:
        num_samples: dataset size ``N``.
        batch_size: samples per batch on each rank.
        world_size, rank: this process's place among the ranks.
        shuffle: random order per epoch (``False``: natural order, partitioned over ranks).
        seed: shared by every rank. The order is a pure function of (seed, epoch, sizes).
        drop_last: ``False``: pad every rank to ``ceil(M/W)`` samples by wrapping around;
            ``True``: drop the ``M % W`` tail (both exactly as ``DistributedSampler``).
        drop_last_batch: also drop a final batch smaller than ``batch_size`` (static shapes).
        weights: per-sample weights (>= 0, finite, not all zero; numbers or bools) for weighted
            sampling. Taken as they are at construction (copied unless nothing can change them,
            e.g. a read-only memory map): a later in-place change of the caller's array changes
            neither the draws nor the resume state. The same holds for ``balance_labels``.
        replacement: weighted draws with replacement (default) or without.
        num_draws: stream length ``M`` for weighted / balanced sampling (default ``N``).
        balance_labels: per-sample labels; each batch then holds every class equally often.
        shuffle_mode: ``"full"`` (default) or ``"window"`` (needs ``shard_sizes``, ``window``).

    Iterating yields int64 numpy arrays. ``len()`` is the number of batches the next
    iteration yields (a full epoch, or what is left of a loaded mid-epoch state).
    ``state_dict()`` is a small JSON-able dict; it is up to date after every yielded batch.
    """

    def __init__(self, num_samples: int, *, batch_size: int, world_size: int = 1, rank: int = 0,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, drop_last_batch: bool = False,
                 weights: Any = None, replacement: bool = True, num_draws: int | None = None,
                 balance_labels: Any = None, shuffle_mode: str = "full",
                 shard_sizes: Sequence[int] | None = None, window: int | None = None):
        self.num_samples = _int("num_samples", num_samples, 1)
        self.batch_size = _int("batch_size", batch_size, 1)
        self.world_size = _int("world_size", world_size, 1)
        self.rank = _int("rank", rank, 0)
        if self.rank >= self.world_size:
            raise ValueError(f"rank={rank} must be < world_size={world_size}")
        self.seed = check_seed("seed", seed)
        self.shuffle = check_bool("shuffle", shuffle)
        self.drop_last = check_bool("drop_last", drop_last)
        self.drop_last_batch = check_bool("drop_last_batch", drop_last_batch)
        self.replacement = check_bool("replacement", replacement)
        if weights is not None and balance_labels is not None:
            raise ValueError("pass weights= or balance_labels=, not both")

        self.weights = None
        if weights is not None:
            self.weights, positive = check_weights(weights, self.num_samples)
        self.labels = None
        if balance_labels is not None:
            self.labels = check_balance_labels(balance_labels, self.num_samples)
        if num_draws is not None:
            if self.weights is None and self.labels is None:
                raise ValueError("num_draws applies to weighted or class-balanced sampling only")
            num_draws = _int("num_draws", num_draws, 1)
        if self.weights is not None and not self.replacement:  # (the others: per position, any size)
            m = positive if num_draws is None else num_draws
            _check_drawn(self.num_samples, m)
            if m > positive:
                raise ValueError(f"num_draws={m} without replacement exceeds the {positive} "
                                 "samples with a positive weight")
            num_draws = m  # default: every sample with a positive weight, once, in weighted order
        self.num_draws = num_draws
        if shuffle_mode not in SHUFFLE_MODES:
            raise ValueError(f"shuffle_mode={shuffle_mode!r} must be one of {SHUFFLE_MODES}")
        self.shuffle_mode = shuffle_mode
        if window is not None and shuffle_mode != "window":
            raise ValueError(f"window={window!r} only applies to shuffle_mode='window' "
                             f"(shuffle_mode is {shuffle_mode!r}); pass both or neither")
        self.shard_sizes = None
        self.window = 1
        if shuffle_mode == "window":
            if shard_sizes is None:
                raise ValueError("shuffle_mode='window' needs shard_sizes (the dataset's per-shard sample counts)")
            sizes = [int(s) for s in shard_sizes]
            if sum(sizes) != self.num_samples or min(sizes, default=0) < 0:
                raise ValueError(f"shard_sizes sum to {sum(sizes)}, not num_samples={self.num_samples}")
            self.shard_sizes = sizes
            self.window = _int("window", 4 if window is None else window, 1)

        self.epoch = 0
        self.epochs_set = 0  # set_epoch calls so far: a loader reads from it that its script moves the epochs
        self._consumed = 0
        self._resume_pending = False
        self._held = False  # a pass was planned from the loaded position (hold=True), not yet begun
        self._cache: dict[int, np.ndarray] = {}  # the materialised streams of the current epoch and the next
        self._orders: dict[int, Stream] = {}  # the per-position streams of the current epoch and the next
        self._orders_lock = threading.Lock()  # (prepare's background thread computes orders too)
        self._table: tuple | None = None  # tables.weight_table(weights) or tables.balance_table(labels): kept per node
        self._materialised = False  # stream() was asked for a per-position order: prepare() computes ahead
        self._ahead: _Ahead | None = None  # an epoch's stream computed in the background (prepare)
        self._identity_cache: dict | None = None

    # -- the order ---------------------------------------------------------------------------
    @property
    def stream_len(self) -> int:
        """``M``: stream positions per epoch (before padding)."""
        return self.num_samples if self.num_draws is None else self.num_draws

    @property
    def _drawn(self) -> bool:
        """True when the stream is computed whole (weighted draws without replacement), not
        per position."""
        return self.weights is not None and not self.replacement

    def order_stream(self, epoch: int | None = None) -> Stream:
        """The epoch's stream as a :class:`~fastload.sampling.order.Stream` (identical on every
        rank): computed per position (nothing per sample is held) except weighted and
        class-balanced draws, whose array :meth:`stream` computes."""
        e = self.epoch if epoch is None else int(epoch)
        if self._drawn:
            return Drawn(self.stream(e), self.num_samples)
        with self._orders_lock:
            o = self._orders.get(e)
            if o is None:
                if self._table is None:  # once per sampler, not per epoch
                    self._table = (weight_table(self.weights) if self.weights is not None else
                                   balance_table(self.labels) if self.labels is not None else None)
                o = epoch_order(self.num_samples, seed=self.seed, epoch=e, shuffle=self.shuffle,
                                weights=self.weights, num_draws=self.num_draws, balance_labels=self.labels,
                                batch_size=self.batch_size, shuffle_mode=self.shuffle_mode,
                                shard_sizes=self.shard_sizes, window=self.window, table=self._table)
                keep = (self.epoch, self.epoch + 1)
                if e in keep:
                    self._orders = {k: v for k, v in self._orders.items() if k in keep}
                    self._orders[e] = o
        return o

    def stream(self, epoch: int | None = None) -> np.ndarray:
        """The epoch's full stream materialised (identical on every rank): ``M`` indices. The
        sampler's own batches read it only for weighted draws without replacement (an array by
        nature); the per-position orders (:meth:`order_stream`) are never read whole by
        fastload (a remote cache plans from them a chunk at a time). Cached for the current epoch and the next (the cache plans
        the next epoch's downloads while this one runs: then :meth:`prepare` has nothing
        left to compute)."""
        e = self.epoch if epoch is None else int(epoch)
        s = self._cache.get(e)
        if s is not None:
            return s
        if not self._drawn:
            # a per-position order held whole (asked for by a caller): the current epoch's
            # and the next, so a clear error rather than an allocation this machine cannot make
            check_fits_in_memory(self.stream_len * 8 * 2,  # int64 indices
                                 f"the whole stream of {self.stream_len:,} positions (this epoch's and the next)",
                                 "lower num_draws, or read the dataset where it needs no whole stream (a local "
                                 "dataset's Loader computes its positions as it goes)")
            self._materialised = True  # someone reads whole streams: prepare() computes them ahead
        s = self._take_ahead(e)
        if s is None:
            s = self._compute(e)
        keep = (self.epoch, self.epoch + 1)
        if e in keep:
            self._cache = {k: v for k, v in self._cache.items() if k in keep}
            self._cache[e] = s
        return s

    def _compute(self, e: int) -> np.ndarray:
        if self._drawn:
            s = epoch_stream(self.num_samples, seed=self.seed, epoch=e, weights=self.weights,
                             replacement=self.replacement, num_draws=self.num_draws, balance_labels=self.labels,
                             batch_size=self.batch_size)
        else:
            s = np.asarray(self.order_stream(e))  # (kept with the stream: computed once per epoch)
        s.flags.writeable = False
        return s

    def prepare(self, epoch: int) -> None:
        """Compute ``stream(epoch)`` now in a background thread (at the loader's priority), so
        that the pass over that epoch does not wait for its order: a Loader asks for the next
        epoch's as each epoch starts. Only streams computed whole are prepared: weighted draws
        without replacement (seconds at 10^7), and the per-position
        orders (weighted draws with replacement included) only once
        :meth:`stream` has been asked for one (a caller reads them whole; ~30 ns
        per sample). An order cheaper to compute than :data:`PREPARE_MIN_NS` (a thread's
        start costs about as much) and the natural order (``shuffle=False``) are computed when
        asked for. Only the latest prepared epoch is kept."""
        e = _int("epoch", epoch, 0)
        drawn = self._drawn
        if not (self.shuffle or drawn) or not (drawn or self._materialised):
            return
        # Only where it pays: starting a thread costs ~0.1-0.3 ms, a per-position order ~30 ns
        # per sample, weighted or balanced draws ~200 ns.
        if self.stream_len * (200 if drawn else 30) < PREPARE_MIN_NS:
            return
        if e in self._cache or (self._ahead is not None and self._ahead.epoch == e):
            return
        self.join_ahead()
        self._ahead = _Ahead(e, self._compute)

    def join_ahead(self) -> None:
        """Wait for a stream being prepared in the background (e.g. before closing)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.wait()

    def _take_ahead(self, e: int) -> np.ndarray | None:
        ahead = self._ahead
        if ahead is None or ahead.epoch != e:
            return None
        self._ahead = None
        return ahead.wait()  # None: it failed or this is a forked child (then computed here)

    def _bounds(self, start: int) -> RankBatches:
        return RankBatches(start, self.stream_len, self.world_size, self.rank, self.batch_size,
                                 self.drop_last, self.drop_last_batch)

    @property
    def num_samples_per_rank(self) -> int:
        """Samples this rank reads in a full epoch (``DistributedSampler.num_samples``)."""
        return per_rank_count(self.stream_len, self.world_size, self.drop_last)

    @property
    def batches_per_epoch(self) -> int:
        return len(self._bounds(0))

    def __len__(self) -> int:
        return len(self._bounds(self.length_start()))

    def length_start(self) -> int:
        """The position ``len()`` counts from: a loaded mid-epoch position no pass was planned
        from yet, else 0. Once a pass is planned (``iter()``, even one that holds the position
        until its first batch) ``len()`` is the whole epoch's, as a DataLoader's is: PyTorch
        Lightning reads it after ``iter()`` and counts a resumed epoch's batches up to it."""
        return 0 if self._held else self.start_position()

    def start_position(self) -> int:
        """Where the next pass over the current epoch starts (the consumed count
        :meth:`begin_pass` will return): a loaded mid-epoch position, else 0. Reads only."""
        return self._consumed if self._resume_pending else 0

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (call before each epoch, like ``DistributedSampler.set_epoch``).
        After ``load_state_dict``, setting the loaded epoch keeps the loaded position."""
        epoch = _int("epoch", epoch, 0)
        self.epochs_set += 1
        if self._resume_pending and epoch == self.epoch:
            return
        self._resume_pending = self._held = False
        self.epoch = epoch
        self._consumed = 0

    def epoch_plan(self, *, hold: bool = False) -> EpochPlan:
        """Begin a pass over the current epoch (from a loaded mid-epoch position, if any)
        and return it as a value; what ``iter(sampler)`` walks through. ``hold``: a loaded
        position stays pending until :meth:`pass_begun` (a loader plans its pass at ``iter()``,
        but a pass dropped before its first ``next()`` must not use the position up)."""
        start = self._begin(hold)
        return EpochPlan(self.epoch, start, self.order_stream(self.epoch), self._bounds(start))

    def plan(self, epoch: int) -> EpochPlan:
        """A whole pass over ``epoch`` as a value, leaving the sampler's state as it is (a
        loader requests the next pass's first batches with it while this one ends)."""
        epoch = _int("epoch", epoch, 0)
        return EpochPlan(epoch, 0, self.order_stream(epoch), self._bounds(0))

    def begin_pass(self, *, hold: bool = False) -> tuple[int, int, Stream]:
        """Begin a pass: ``(epoch, consumed count it starts at, the epoch's stream)``. The
        count is the caller's unit (stream positions; tokens for a packing loader). The
        stream is :meth:`order_stream`'s (a packing plan reads it in chunks). ``hold``: as
        :meth:`epoch_plan`'s."""
        start = self._begin(hold)
        return self.epoch, start, self.order_stream(self.epoch)

    @property
    def reads_every_sample_once(self) -> bool:
        """True when every epoch's stream is a permutation of all the samples (no weights,
        classes or ``num_draws``): what depends only on the set of samples read (a packed
        epoch's token count) is then known without computing the stream."""
        return self.weights is None and self.labels is None and self.num_draws is None

    def _begin(self, hold: bool = False) -> int:
        start = self.start_position()
        if not hold:
            self._resume_pending = self._held = False
        elif self._resume_pending:
            self._held = True
        self._consumed = start
        return start

    def pass_begun(self) -> None:
        """The pass planned with ``hold`` reached its first ``next()``: a loaded position is used
        up (a pass begun after it starts the epoch from 0)."""
        self._resume_pending = self._held = False

    def __iter__(self) -> Iterator[np.ndarray]:
        return self._generate(self.epoch_plan())

    def _generate(self, plan: EpochPlan) -> Iterator[np.ndarray]:
        for idx, after in plan:
            if self.epoch == plan.epoch:
                self._consumed = after
            yield idx
        if self.epoch == plan.epoch:
            self._consumed = plan.end  # the epoch is complete (a dropped tail included)

    # -- resume ------------------------------------------------------------------------------
    def _identity(self) -> dict:
        if self._identity_cache is None:  # immutable after __init__; hashing weights is not free
            self._identity_cache = self._compute_identity()
        return self._identity_cache

    def _compute_identity(self) -> dict:
        """What defines this order (JSON-able; arrays as digests): a saved state must match it
        to resume."""
        return {
            "num_samples": self.num_samples, "seed": self.seed, "shuffle": self.shuffle,
            "weights": digest(self.weights, np.float64), "balance_labels": digest(self.labels),
            "stream_len": self.stream_len, "replacement": self.replacement if self.weights is not None else None,
            "shuffle_mode": self.shuffle_mode, "window": self.window if self.shuffle_mode == "window" else None,
            "shard_sizes": digest(np.asarray(self.shard_sizes, np.int64)) if self.shard_sizes else None,
            "balance_batch_size": self.batch_size if self.labels is not None else None,
        }

    @property
    def consumed(self) -> int:
        """Global stream positions read so far this epoch (all ranks together)."""
        return int(self._consumed)

    def state_dict(self, *, consumed: int | None = None) -> dict:
        """Epoch, global stream positions consumed (``consumed`` overrides the current count,
        e.g. a loader's position behind its prefetch), and what defines the order (JSON-able)."""
        consumed = int(self._consumed if consumed is None else consumed)
        return {"version": SAMPLER_STATE_VERSION, "epoch": self.epoch, "consumed": consumed,
                "world_size": self.world_size, "batch_size": self.batch_size, "drop_last": self.drop_last,
                **self._identity()}

    def load_state_dict(self, state: Mapping[str, Any], *,
                        epoch_end: Callable[[int, int, bool], int] | None = None) -> None:
        """Continue from ``state``; the world size (and batch size, except for class-balanced
        sampling, whose stream depends on it) may differ from when it was saved. A position
        beyond the end of its epoch is refused: ``epoch_end(epoch, world_size, drop_last)``
        gives that end in the caller's unit (default: stream positions; a packing loader
        counts tokens)."""
        epoch, consumed = check_state(state, self._identity(), self.stream_len, epoch_end)
        self.epoch = epoch
        self._consumed = consumed
        self._resume_pending, self._held = True, False


class _Ahead:
    """One epoch's stream computed in a daemon thread at the loader's nice value. Its
    ``wait()`` returns the stream, or None if it failed (the caller computes it again, so
    the error surfaces there) or if this is a child forked after the thread started (whose
    copy of the thread does not exist)."""

    def __init__(self, epoch: int, compute: Callable[[int], np.ndarray]) -> None:
        self.epoch = epoch
        self._out: list = []
        self._pid = os.getpid()
        self._thread = threading.Thread(target=self._run, args=(compute,), name="fastload-order", daemon=True)
        self._thread.start()

    def _run(self, compute: Callable[[int], np.ndarray]) -> None:
        from ..runtime.system import lower_priority

        try:
            lower_priority()
            self._out.append(compute(self.epoch))
        except BaseException:  # computed again by the caller, which then sees the error
            pass

    def wait(self) -> np.ndarray | None:
        if os.getpid() != self._pid:
            return None
        self._thread.join()
        return self._out[0] if self._out else None

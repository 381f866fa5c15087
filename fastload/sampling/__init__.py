"""Which global sample indices each rank reads at each step.

Everything here is a pure function of (sizes, seed, epoch, world size, batch size) plus a
thin :class:`Sampler` object that remembers the epoch and how far the epoch has been read.

The model
---------
An epoch is a **stream**: a sequence of ``M`` global sample indices, identical on every rank
and every machine for the same arguments (random streams keyed by ``(seed, epoch)`` through
numpy's ``SeedSequence``):

* plain: a permutation of ``0..N-1`` (``shuffle=False``: the natural order), ``M = N``,
  made by fastload's C++ Fisher–Yates (xoshiro256**, Lemire's unbiased bounded integers,
  csrc/permute.h): ~6x faster than numpy's ``Generator.permutation`` and independent of the
  numpy version;
* ``shuffle_mode="window"``: shards in a random order, samples shuffled within each window of
  ``window`` consecutive shards of that order (locality for data bigger than RAM);
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
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..system import check_fits_in_memory
from ..validate import check_bool, check_int, check_seed

SAMPLER_STATE_VERSION = 2  # 2: plain permutations by fastload._C.permutation (1: numpy's)
SHUFFLE_MODES = ("full", "window")

__all__ = ["EpochPlan", "Sampler", "SAMPLER_STATE_VERSION", "epoch_stream", "rank_batch_bounds", "per_rank_count"]


# -- pure functions --------------------------------------------------------------------------
def _seeds(seed: int, epoch: int, purpose: int) -> np.random.SeedSequence:
    """The entropy of one random stream: (seed, epoch, purpose), purpose 0..3 per stream kind."""
    return np.random.SeedSequence([seed & (2**64 - 1), epoch, purpose])


def _rng(seed: int, epoch: int, purpose: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(_seeds(seed, epoch, purpose)))


def _index_dtype(n: int):
    return np.int32 if n < 2**31 else np.int64


def per_rank_count(remaining: int, world_size: int, drop_last: bool) -> int:
    """Samples each rank reads from ``remaining`` stream positions (DistributedSampler's rule)."""
    if remaining <= 0:
        return 0
    return remaining // world_size if drop_last else -(-remaining // world_size)


def permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """A uniformly random permutation of ``0..n-1`` keyed by (seed, epoch)."""
    from .. import _C

    key = _seeds(seed, epoch, 0).generate_state(2, np.uint64)
    out = np.empty(n, dtype=_index_dtype(n))
    _C.permutation(out, int(key[0]), int(key[1]))
    return out


def window_permutation(shard_sizes: Sequence[int], window: int, seed: int, epoch: int) -> np.ndarray:
    """Shards in random order; samples shuffled within each window of ``window`` shards.

    Memory: at most ``window`` shards are being read at any time (by all ranks together),
    at the price of a less random order (samples from the same window are close together)."""
    sizes = np.asarray(shard_sizes, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    n = int(sizes.sum())
    rng = _rng(seed, epoch, 1)
    order = rng.permutation(len(sizes))
    dt = _index_dtype(n)
    out = np.empty(n, dtype=dt)
    pos = 0
    for w0 in range(0, len(order), window):
        chunk = [np.arange(starts[s], starts[s] + sizes[s], dtype=dt) for s in order[w0:w0 + window]]
        block = np.concatenate(chunk) if chunk else np.empty(0, dt)
        rng.shuffle(block)
        out[pos:pos + len(block)] = block
        pos += len(block)
    return out


def weighted_draws(weights: np.ndarray, num_draws: int, replacement: bool, seed: int, epoch: int) -> np.ndarray:
    """``num_draws`` indices drawn with probability proportional to ``weights``.

    With replacement: inverse CDF (float64 cumulative sum + binary search), exact for any
    number of samples (``torch.multinomial`` stops at 2^24). Without: Efraimidis–Spirakis (the ``num_draws`` smallest
    ``Exp(1) / w`` keys), which is sequential sampling without replacement."""
    rng = _rng(seed, epoch, 2)
    n = len(weights)
    if replacement:
        cdf = np.cumsum(weights, dtype=np.float64)
        # Sorted uniforms make the binary searches cache-friendly (10x faster at 10^7);
        # shuffling the result afterwards gives back an i.i.d. sequence.
        u = rng.random(num_draws)
        u.sort()
        u *= cdf[-1]
        idx = np.searchsorted(cdf, u, side="right")
        del u
        rng.shuffle(idx)
        # u can round up to cdf[-1]: such a draw goes to the last positive weight
        np.minimum(idx, int(np.flatnonzero(weights)[-1]), out=idx)
        return idx.astype(_index_dtype(n), copy=False)
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
    in random order (so over the epoch every class is drawn equally often). Each class's
    samples are read in reshuffled passes (minority classes repeat, majority classes are
    subsampled)."""
    rng = _rng(seed, epoch, 3)
    classes, inverse = np.unique(labels, return_inverse=True)
    c = len(classes)
    nchunks = -(-num_draws // batch_size)
    per, extra = divmod(batch_size, c)
    chunk_cls = np.empty((nchunks, batch_size), dtype=np.int32)
    if per:
        chunk_cls[:, :per * c] = np.tile(np.arange(c, dtype=np.int32), per)
    if extra:
        need = nchunks * extra
        perms = rng.permuted(np.tile(np.arange(c, dtype=np.int32), (-(-need // c), 1)), axis=1)
        chunk_cls[:, per * c:] = perms.ravel()[:need].reshape(nchunks, extra)
    chunk_cls = rng.permuted(chunk_cls, axis=1).ravel()[:num_draws]
    n = len(labels)
    out = np.empty(num_draws, dtype=_index_dtype(n))
    members_of = np.argsort(inverse, kind="stable")
    mbounds = np.concatenate([[0], np.cumsum(np.bincount(inverse, minlength=c))])
    slots_of = np.argsort(chunk_cls, kind="stable")
    sbounds = np.concatenate([[0], np.cumsum(np.bincount(chunk_cls, minlength=c))])
    for k in range(c):
        members = members_of[mbounds[k]:mbounds[k + 1]]
        where = slots_of[sbounds[k]:sbounds[k + 1]]
        if not len(where):
            continue
        reps = -(-len(where) // len(members))
        passes = rng.permuted(np.broadcast_to(members, (reps, len(members))), axis=1)
        out[where] = passes.ravel()[:len(where)]
    return out


def rank_batch_bounds(start: int, stream_len: int, world_size: int, rank: int, batch_size: int,
                      drop_last: bool, drop_last_batch: bool = False) -> list[tuple[int, int, int]]:
    """This rank's batches when the stream positions ``start..stream_len-1`` are split over
    ``world_size`` ranks: a list of ``(begin, end, consumed_after)``, where ``begin..end-1``
    are stream positions (``>= stream_len`` means wrapped-around padding) and
    ``consumed_after`` is the global consumed count once every rank has read that step."""
    per = per_rank_count(stream_len - start, world_size, drop_last)
    out = []
    done = 0
    while done < per:
        b = min(batch_size, per - done)
        if b < batch_size and drop_last_batch:
            break
        step0 = start + done * world_size
        out.append((step0 + rank * b, step0 + (rank + 1) * b, step0 + b * world_size))
        done += b
    return out


def epoch_stream(num_samples: int, *, seed: int, epoch: int, shuffle: bool = True,
                 weights: np.ndarray | None = None, replacement: bool = True, num_draws: int | None = None,
                 balance_labels: np.ndarray | None = None, batch_size: int = 1,
                 shuffle_mode: str = "full", shard_sizes: Sequence[int] | None = None,
                 window: int = 1) -> np.ndarray:
    """The epoch's stream of global sample indices (see the module docstring)."""
    m = num_samples if num_draws is None else num_draws
    if balance_labels is not None:
        return balanced_draws(balance_labels, m, batch_size, seed, epoch)
    if weights is not None:
        return weighted_draws(weights, m, replacement, seed, epoch)
    if not shuffle:
        return np.arange(num_samples, dtype=_index_dtype(num_samples))
    if shuffle_mode == "window":
        return window_permutation(shard_sizes, window, seed, epoch)
    return permutation(num_samples, seed, epoch)


@dataclass(frozen=True)
class EpochPlan:
    """One rank's pass over an epoch, as a value: what a loader iterates, with no reference
    back to the :class:`Sampler`.

    ``stream`` is the epoch's full stream (identical on every rank), ``bounds`` this rank's
    batches as ``(begin, end, consumed_after)`` stream positions (positions past the stream
    wrap around: ``DistributedSampler``'s padding), ``start`` the global consumed count the
    pass begins at (a resumed position, or 0)."""

    epoch: int
    start: int
    stream: np.ndarray
    bounds: tuple[tuple[int, int, int], ...]

    def __len__(self) -> int:
        return len(self.bounds)

    @property
    def end(self) -> int:
        """The consumed count once the pass is complete: the epoch is then over (a tail
        dropped by ``drop_last`` included), so a state saved here resumes to nothing."""
        last = self.bounds[-1][2] if self.bounds else self.start
        return max(last, len(self.stream))

    def indices(self, k: int) -> np.ndarray:
        """Global sample indices (int64) of this rank's ``k``-th batch."""
        b, e, _ = self.bounds[k]
        m = len(self.stream)
        if e <= m:
            return self.stream[b:e].astype(np.int64)
        return self.stream[np.arange(b, e) % m].astype(np.int64)  # padding: wrap around

    def __iter__(self) -> Iterator[tuple[np.ndarray, int]]:
        """``(indices, consumed_after)`` per batch, in order."""
        for k, (_, _, after) in enumerate(self.bounds):
            yield self.indices(k), after

    def requests(self):
        """``(Request, consumed_after)`` per batch: the indices with the batch's stream
        position (what a loader hands its source; see fastload.packing.Request)."""
        from ..packing import Request

        for k, (b, _, after) in enumerate(self.bounds):
            yield Request(self.indices(k), b), after


def _digest(a: np.ndarray | None) -> str | None:
    if a is None:
        return None
    a = np.ascontiguousarray(a)
    return hashlib.blake2b(a.dtype.str.encode() + a.tobytes(), digest_size=8).hexdigest()


def _int(name: str, v: Any, lo: int) -> int:
    return check_int(name, v, min=lo)


# Bytes per stream position while drawing an epoch (the stream itself, sorted uniforms and
# the drawn indices of weighted draws, the class slots of balanced draws).
_DRAW_BYTES = 24


# -- the object ------------------------------------------------------------------------------
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
        weights: per-sample weights (>= 0, finite, not all zero) for weighted sampling.
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
            w = np.asarray(weights)
            if w.ndim != 1 or len(w) != self.num_samples:
                raise ValueError(f"weights has shape {w.shape}; expected ({self.num_samples},), one per sample")
            if not np.issubdtype(w.dtype, np.number) or np.issubdtype(w.dtype, np.complexfloating):
                raise ValueError(f"weights must be real numbers, got dtype {w.dtype}")
            w = w.astype(np.float64)
            bad = np.flatnonzero(~np.isfinite(w))
            if len(bad):
                raise ValueError(f"weights[{bad[0]}]={w[bad[0]]} is not finite ({len(bad)} such weights)")
            neg = np.flatnonzero(w < 0)
            if len(neg):
                raise ValueError(f"weights[{neg[0]}]={w[neg[0]]} is negative ({len(neg)} negative weights)")
            positive = int(np.count_nonzero(w))
            if positive == 0:
                raise ValueError("weights are all zero; at least one sample needs a positive weight")
            self.weights = w
        self.labels = None
        if balance_labels is not None:
            lab = np.asarray(balance_labels)
            if lab.ndim != 1 or len(lab) != self.num_samples:
                raise ValueError(f"balance_labels has shape {lab.shape}; expected ({self.num_samples},)")
            if lab.dtype.kind == "f" and not np.isfinite(lab).all():
                raise ValueError("balance_labels contains NaN or inf")
            self.labels = lab
        if num_draws is not None:
            if self.weights is None and self.labels is None:
                raise ValueError("num_draws applies to weighted or class-balanced sampling only")
            num_draws = _int("num_draws", num_draws, 1)
            check_fits_in_memory(num_draws * _DRAW_BYTES, f"num_draws={num_draws:,} (the epoch's stream of draws)",
                                 "lower num_draws (it is the number of samples drawn per epoch, all ranks together)")
            if self.weights is not None and not self.replacement and num_draws > positive:
                raise ValueError(f"num_draws={num_draws} without replacement exceeds the {positive} "
                                 "samples with a positive weight")
        elif self.weights is not None and not self.replacement:
            num_draws = positive  # every sample with a positive weight, once, in weighted order
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
        self._consumed = 0
        self._resume_pending = False
        self._cache: tuple[int, np.ndarray] | None = None
        self._identity_cache: dict | None = None

    # -- the order ---------------------------------------------------------------------------
    @property
    def stream_len(self) -> int:
        """``M``: stream positions per epoch (before padding)."""
        return self.num_samples if self.num_draws is None else self.num_draws

    def stream(self, epoch: int | None = None) -> np.ndarray:
        """The epoch's full stream (identical on every rank). Cached for the current epoch."""
        e = self.epoch if epoch is None else int(epoch)
        if self._cache is not None and self._cache[0] == e:
            return self._cache[1]
        s = epoch_stream(self.num_samples, seed=self.seed, epoch=e, shuffle=self.shuffle, weights=self.weights,
                         replacement=self.replacement, num_draws=self.num_draws, balance_labels=self.labels,
                         batch_size=self.batch_size, shuffle_mode=self.shuffle_mode,
                         shard_sizes=self.shard_sizes, window=self.window)
        s.flags.writeable = False
        if epoch is None or e == self.epoch:
            self._cache = (e, s)
        return s

    def _bounds(self, start: int) -> list[tuple[int, int, int]]:
        return rank_batch_bounds(start, self.stream_len, self.world_size, self.rank, self.batch_size,
                                 self.drop_last, self.drop_last_batch)

    @property
    def num_samples_per_rank(self) -> int:
        """Samples this rank reads in a full epoch (``DistributedSampler.num_samples``)."""
        return per_rank_count(self.stream_len, self.world_size, self.drop_last)

    @property
    def batches_per_epoch(self) -> int:
        return len(self._bounds(0))

    def __len__(self) -> int:
        return len(self._bounds(self._start()))

    def _start(self) -> int:
        return self._consumed if self._resume_pending else 0

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (call before each epoch, like ``DistributedSampler.set_epoch``).
        After ``load_state_dict``, setting the loaded epoch keeps the loaded position."""
        epoch = _int("epoch", epoch, 0)
        if self._resume_pending and epoch == self.epoch:
            return
        self._resume_pending = False
        self.epoch = epoch
        self._consumed = 0

    def epoch_plan(self) -> EpochPlan:
        """Begin a pass over the current epoch (from a loaded mid-epoch position, if any)
        and return it as a value; what ``iter(sampler)`` walks through."""
        epoch, start, stream = self.begin_pass()
        return EpochPlan(epoch, start, stream, tuple(self._bounds(start)))

    def begin_pass(self) -> tuple[int, int, np.ndarray]:
        """Begin a pass: ``(epoch, consumed count it starts at, the epoch's stream)``. The
        count is the caller's unit (stream positions; tokens for a packing loader)."""
        start = self._start()
        self._resume_pending = False
        self._consumed = start
        return self.epoch, start, self.stream(self.epoch)

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
        return {
            "num_samples": self.num_samples, "seed": self.seed, "shuffle": self.shuffle,
            "weights": _digest(self.weights), "balance_labels": _digest(self.labels),
            "stream_len": self.stream_len, "replacement": self.replacement if self.weights is not None else None,
            "shuffle_mode": self.shuffle_mode, "window": self.window if self.shuffle_mode == "window" else None,
            "shard_sizes": _digest(np.asarray(self.shard_sizes, np.int64)) if self.shard_sizes else None,
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
        if not isinstance(state, Mapping):
            raise ValueError(f"sampler state must be a dict, got {type(state).__name__}")
        if state.get("version") != SAMPLER_STATE_VERSION:
            raise ValueError(f"sampler state version {state.get('version')!r} is not {SAMPLER_STATE_VERSION} "
                             "(saved by another fastload version)")
        for key, mine in self._identity().items():
            if key not in state:
                raise ValueError(f"sampler state lacks {key!r}; not a fastload Sampler state?")
            if state[key] != mine:
                raise ValueError(f"sampler state was saved with {key}={state[key]!r}, but this sampler has "
                                 f"{key}={mine!r}; resume with the same {key}")
        epoch = _int("state['epoch']", state.get("epoch"), 0)
        consumed = _int("state['consumed']", state.get("consumed"), 0)
        saved_world = _int("state['world_size']", state.get("world_size"), 1)
        saved_drop = state.get("drop_last")
        if not isinstance(saved_drop, bool):
            raise ValueError(f"sampler state has drop_last={saved_drop!r}; not a fastload Sampler state?")
        # The most a run can have consumed: the whole stream, padded to whole steps of the
        # world size it was saved at (a state at the end of an epoch resumes to nothing).
        if epoch_end is None:
            end = max(self.stream_len, per_rank_count(self.stream_len, saved_world, saved_drop) * saved_world)
            unit = f"an epoch of {self.stream_len} stream positions"
        else:
            end = int(epoch_end(epoch, saved_world, saved_drop))
            unit = "its epoch"
        if consumed > end:
            raise ValueError(f"sampler state has consumed={consumed}, beyond the end of {unit} (at most {end} with "
                             f"world_size={saved_world}); the state is damaged or belongs to another dataset")
        self.epoch = epoch
        self._consumed = consumed
        self._resume_pending = True

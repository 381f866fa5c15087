"""Loader: the public face. It builds its parts and hands them down; none reaches back up.

    options    (options.py)    every keyword, checked once and frozen; the sampler they define
    sampler    (sampling/)     the order; each pass is an EpochPlan value
    machinery  (machinery.py)  the ring, the DALI decoders, the feeders, the device delivery:
                               what holds threads and memory, closed as one
    source     (host.py / cuda.py)  an epoch's source of ready batches (machinery.source)
    lookahead  (epoch.py)      the next pass's first batches, requested while this one ends
    stats      (stats.py)      the one object every part reports into
    progress   (epoch.py)      the position after the last batch handed over (for state_dict)

Resume: the position is the sampler's after every batch *handed to the user* (not after the
ones merely prefetched), so ``state_dict()`` taken between steps continues at exactly the next
step.
"""
from __future__ import annotations

import functools
import os
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence, cast

from ..store.mixture import Mixture
from ..sampling.packing import PackPlan, pack_plan, token_total
from ..store import Dataset, DatasetReader
from ..remote.options import REMOTE_KEYWORDS, RemoteOptions
from ..remote.manifest import dataset_fingerprint
from ..runtime.world import World
from .epoch import EpochIterator, LookAhead, Progress, look_ahead_pays
from ..store.verified_record import DEFAULT_VERIFY
from .machinery import Machinery
from .options import Options, as_mixture, build_options
from .ranks import DatasetCheck
from .stats import Stats

if TYPE_CHECKING:
    import torch

    from ..sampling import EpochPlan, Sampler
    from ..store.concat import ConcatReader
    from .remote import RemoteShards

__all__ = ["LOADER_STATE_VERSION", "Loader", "dataset_fingerprint"]

LOADER_STATE_VERSION = 1


def packed_pass(ds: Any, sampler: Sampler, options: Options, epoch: int, start: int,
                stream: Any = None, check: Callable[[], None] | None = None) -> PackPlan:
    """The PackPlan of a pass over ``epoch`` from token ``start`` (a function of values, not
    of the Loader: remote.py plans the cache's downloads with it; ``check``: called between
    chunks of a count of the epoch's tokens, see :func:`~fastload.sampling.packing.pack_plan`)."""
    assert options.pack is not None  # (packed passes only)
    name, d = options.pack
    stream = sampler.order_stream(epoch) if stream is None else stream
    lengths = ds.lengths(name)
    total = token_total(lengths, d.max_length) if sampler.reads_every_sample_once else None
    return pack_plan(epoch, start, stream, lengths, rows=options.batch_size, length=cast(int, d.pack_to),
                     world_size=sampler.world_size, rank=sampler.rank, drop_last=sampler.drop_last,
                     max_length=d.max_length, total=total, check=check)


class Loader:
    """Batches of a fastload dataset for a training loop.

    Args:
        dataset: a :class:`fastload.Dataset` or the path of one.
        batch_size: samples per batch on this rank.
        shuffle, seed, drop_last: as ``DistributedSampler`` (the order is a pure function
            of seed, epoch and world size; see :class:`fastload.Sampler`).
        device: ``None`` (default: CUDA when available, else the CPU), ``"cpu"``, ``"cuda"``
            or ``"cuda:N"`` / a ``torch.device``. ``"cuda"`` without an index: the device the
            script chose with ``torch.cuda.set_device``; if none, torchrun's ``LOCAL_RANK``
            where that cannot be wrong (one GPU per local rank, or CUDA not used yet by this
            process), else ``cuda:0``. Pass ``"cuda:N"`` when ranks and GPUs are laid out
            otherwise. Put the model on ``loader.device``.
        rank, world_size: default from ``torch.distributed`` when initialised (the ranks
            then check that they opened the same dataset), else the ``RANK``/``WORLD_SIZE``
            environment variables, else a single process.
        fields: fields to deliver (default: every tensor, scalar and image field; string and
            bytes fields are delivered as lists when named here).
        transforms: ``{image_field: fastload.vision.train(224) | eval(...) | custom(...)}``, or
            one transform over several fields: ``fastload.vision.detection(640)``,
            ``segmentation(512)``, ``custom(build, inputs=..., outputs=...)`` (its outputs
            replace the fields it reads; ragged outputs follow ``ragged=``/``pad_value=``).
        threads: gather threads (default: this rank's share of the usable cores, i.e. the
            cores divided by ``LOCAL_WORLD_SIZE``, minus one; at least 1, at most 7).
        prefetch: batches in flight (default: enough to keep the gather threads busy, up
            to 8, fewer for big batches to stay near 256 MB of host slots, at least 2; with
            image fields decoded on a GPU, 2 or 3, so that the decoded images in flight stay
            near 512 MB of device memory).
        weights, replacement, num_draws, balance: weighted / class-balanced sampling
            (``weights`` may name a field of the dataset; ``balance=True`` balances the label
            field); shuffle_mode / window: locality-preserving shuffle (see Sampler).
        on_error: for undecodable images: "raise" (an error naming shard, row and key) or
            "skip" (replaced deterministically by the next decodable sample, counted in stats).
        log_every: log ``stats()`` every this many batches (``logging`` at INFO).
        ragged: how ragged fields (``int32[]``, ``float32[*,4]``) are delivered: ``"padded"``
            (default: ``(B, L, ...)`` plus ``batch[name + "_lengths"]``) or ``"packed"``
            (``(T, ...)`` plus int32 ``batch[name + "_offsets"]``, the cu_seqlens form); one
            value for every ragged field or a dict per field. ``pad_value``, ``max_length``
            (truncation) and ``pad_to_multiple`` (static shapes) likewise.
        pack_to: ``N``: pack the ragged field's documents into rows of exactly ``N`` tokens
            (``batch_size`` rows per batch), with ``name + "_offsets"`` (piece boundaries,
            cu_seqlens) and ``name + "_positions"``; see :mod:`fastload.sampling.packing`. The state
            counts tokens, so a resume continues inside a document, at any world size.
        batch_transform: ``fn(batch) -> batch`` (or ``fn(batch, info)``, ``info`` a
            :class:`~fastload.loader.finish.BatchInfo` with a per-batch seed) run on host
            tensors in a fastload thread, before the device copy; errors name the samples.
        device_transform: ``fn(batch) -> batch`` on the device, on fastload's copy stream
            (on the CPU: right after ``batch_transform``). Either transform must return a dict
            of tensors with the batch's rows along dim 0 (numpy arrays are converted; lists only
            for string fields; packed ragged keys exempt; ``index`` put back if left out; see
            :mod:`fastload.loader.finish`), else :class:`~fastload.TransformError`. Either may
            take ``(batch, info)``; on CUDA, ``device_transform``'s tensors must be on
            ``loader.device``. ``close()`` waits at most 10 s for a transform that does not
            return, then warns (its thread is a daemon: the process still exits).
        mix, epoch_size, stop_on: with a list (or dict) of datasets as ``dataset``: their
            proportions and how long an epoch is (see :class:`fastload.Mixture`, which may
            also be passed as ``dataset``). Each batch then has ``batch["source"]``.
        cache_dir, cache_limit, filesystem: for a remote ``dataset`` URL (``s3://``, ``gs://``,
            ``az://``, ``abfs://``, ``https://``): where the node-local shard cache lives (default
            ``$FASTLOAD_CACHE`` or ``~/.cache/fastload``), its byte budget (int or ``"200GB"``;
            default: the whole dataset if it fits in 80% of the free disk), and a
            ``pyarrow.fs.FileSystem`` (or a callable making one) instead of the URL's default.
            ``download_timeout`` (seconds a shard may take, default 600) and
            ``download_threads`` (downloads in flight, default 4); checked at once, as one
            :class:`~fastload.remote.options.RemoteOptions`. For a mixture of URLs, the
            settings of all of them (``cache_limit``: their one budget, shared out).
            Shards are downloaded in the sampler's first-use order and deleted after their
            last use; ``stats()`` then also reports ``bytes_downloaded``, ``download_wait_s``,
            ``download_MBps``, ``cache_hits``, ``evictions`` and ``retries``, and
            ``plan_wait_s`` / ``plan_waits`` (time and times the loader waited for the
            plan of a pass too long to plan at once).
        verify: when ``dataset`` is a path or URL, how its shards are checked against the
            manifest's checksums: "first-use" (default: each shard hashed once before its rows
            are delivered, remembered for the node), "always" (every process hashes), "off".

    Every batch is a dict of tensors (plus ``batch["index"]``, the global sample indices);
    ``len(loader)`` is the number of batches per epoch on this rank. The configuration is
    fixed at construction (``loader.options``).
    """

    def __init__(self, dataset: DatasetReader | Mixture | Sequence | str | os.PathLike, *, batch_size: int,
                 shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False, device: str | torch.device | None = None,
                 rank: int | None = None, world_size: int | None = None, fields: Sequence[str] | None = None,
                 transforms: Mapping[str, Any] | None = None, threads: int | None = None,
                 prefetch: int | None = None, weights: Any = None, replacement: bool = True,
                 num_draws: int | None = None, balance: bool | str = False, shuffle_mode: str = "full",
                 window: int | None = None, on_error: str = "raise", log_every: int | None = None,
                 ragged: Any = None, pad_value: Any = None, max_length: Any = None, pad_to_multiple: Any = None,
                 pack_to: Any = None, batch_transform: Any = None, device_transform: Any = None,
                 mix: Any = None, epoch_size: int | None = None, stop_on: Any = None,
                 cache_dir: str | os.PathLike | None = None, cache_limit: int | str | None = None,
                 filesystem: Any = None, verify: str | None = None, download_timeout: float | None = None,
                 download_threads: int | None = None):
        keywords = dict(locals())  # every keyword above, as named there: build_options checks and freezes them
        del keywords["self"], keywords["dataset"]
        self._closed = True  # until fully built (__del__ / close() of a half-built Loader)
        # None only until built (close() and __del__ of a half-built Loader check); set by _make_machinery
        self._machinery: Machinery = None  # type: ignore[assignment]
        self._lookahead: LookAhead = None  # type: ignore[assignment]
        self._remote: RemoteShards | None = None
        # the remote keywords (cache_dir, cache_limit, ...): one frozen value, checked here once
        remote = RemoteOptions.from_keywords(**{k: v for k, v in keywords.items() if k in REMOTE_KEYWORDS})
        mixed = isinstance(dataset, (list, tuple, Mapping))  # a mixture opened here (remote= for its URLs)
        self._mixture = as_mixture(dataset, mix=mix, epoch_size=epoch_size, stop_on=stop_on, fields=fields,
                                   remote=remote if mixed else None)
        self._owns_dataset = (self._mixture is None and not isinstance(dataset, DatasetReader)) or mixed
        if remote.given() and not self._owns_dataset:
            if isinstance(self._mixture, Mixture) and self._mixture is dataset:
                raise ValueError(f"{' / '.join(remote.given())} go with the URLs of a mixture: pass them to "
                                 "fastload.Mixture(...) (or a list of URLs and mix= to the Loader)")
            raise ValueError(f"{' / '.join(remote.given())} go with a URL; a Dataset passed in has its own "
                             "(fastload.Dataset(url, cache_dir=..., cache_limit=..., filesystem=...))")
        ds: DatasetReader | ConcatReader  # the dataset, or the mixture's reader
        if self._mixture is not None or isinstance(dataset, DatasetReader):
            ds = self._mixture.reader if self._mixture is not None else cast(DatasetReader, dataset)
            if verify is not None and verify != ds.verify_policy:
                raise ValueError(f"verify={verify!r}: the dataset was opened with verify={ds.verify_policy!r}; open it "
                                 f"with fastload.Dataset(path, verify={verify!r}) or pass the path")
        else:
            ds = Dataset(cast("str | os.PathLike", dataset), remote=remote,
                         verify=DEFAULT_VERIFY if verify is None else verify)
        owned = (self._mixture if mixed else ds) if self._owns_dataset else None  # closed with the Loader
        if self._mixture is None and getattr(ds, "transform", None) is not None:
            if owned is not None:
                owned.close()
            raise ValueError("Dataset(transform=...) is per-sample code for DataLoader use; the Loader gathers "
                             "whole batches: pass batch_transform= (or a DALI graph in transforms=) instead")
        self._dataset = ds
        try:
            self._world = World.detect(rank, world_size)
            self._ranks = DatasetCheck(self._world, lambda: dataset_fingerprint(ds), ds.path)  # under torch.distributed
            self._ranks.check()
            self._options, self._sampler = build_options(ds, self._world, mixture=self._mixture, **keywords)
            self._make_machinery(ds, owned)
        except BaseException:
            if self._remote is not None and self._machinery is None:  # its downloads started at construction
                self._remote.close()
            if owned is not None:
                owned.close()
            raise

    def _make_machinery(self, ds: DatasetReader | ConcatReader, owned: Any) -> None:
        """The stats, a remote dataset's downloads, the machinery and the look-ahead, from the
        options and the sampler: values handed down, none holding the Loader."""
        self._stats = Stats()
        sampler = self._sampler  # a closure over the sampler, not the Loader: the machinery holds the stats
        self._stats.gauge("epoch", lambda: sampler.epoch)
        self._progress = Progress()
        self._pass_epoch: int | None = None  # the epoch of the pass that last moved the progress
        from .remote import RemoteShards, remote_members

        if remote_members(ds):  # a remote dataset, or a mixture with remote datasets (see remote.py)
            pack = self._options.pack  # a packed pass's positions count tokens: its plans give the uses
            self._remote = RemoteShards(ds, self._sampler, batch_size=self._options.batch_size,
                                        world_size=self._world.world_size, prefetch=self._options.prefetch,
                                        stats=self._stats, mixture=self._mixture,
                                        pack=None if pack is None else functools.partial(
                                            packed_pass, ds, self._sampler, self._options),
                                        pack_to=1 if pack is None else cast(int, pack[1].pack_to))
        # Threads, the ring and DALI pipelines live in the Machinery, which holds no reference
        # to the Loader: the finalizer can then run when the Loader is garbage collected.
        self._machinery = Machinery(ds, self._options, self._stats, remote=self._remote, owned=owned)
        self._finalizer = weakref.finalize(self, self._machinery.close)
        self._lookahead = LookAhead(self._sampler, self._machinery.source,
                                    enabled=look_ahead_pays(self._options, self._remote is not None))
        self._closed = False
        self._machinery.warm()  # DALI pipelines built while the script sets up its model

    # -- the configuration (read-only) ------------------------------------------------------
    dataset = property(lambda self: self._dataset)
    mixture = property(lambda self: self._mixture)  # the Mixture being read, or None
    sampler = property(lambda self: self._sampler)
    world = property(lambda self: self._world)

    @property
    def options(self) -> Options:
        return self._options

    batch_size = property(lambda self: self._options.batch_size)
    seed = property(lambda self: self._options.seed)
    device = property(lambda self: self._options.device)
    fields = property(lambda self: list(self._options.fields))
    raw_fields = property(lambda self: list(self._options.raw_fields))
    image_fields = property(lambda self: list(self._options.image_fields))
    list_fields = property(lambda self: list(self._options.list_fields))
    transforms = property(lambda self: dict(self._options.transforms))
    threads = property(lambda self: self._options.threads)
    prefetch = property(lambda self: self._options.prefetch)
    on_error = property(lambda self: self._options.on_error)
    log_every = property(lambda self: self._options.log_every)

    # -- iteration -----------------------------------------------------------------------------
    def __len__(self) -> int:
        if self._options.pack is None:
            return len(self._sampler)
        s = self._sampler
        return len(self._pack_plan(s.epoch, s.length_start(), s.order_stream(s.epoch)))  # a loaded position, or 0

    def _pack_plan(self, epoch: int, start: int, stream: Any) -> PackPlan:
        return packed_pass(self._dataset, self._sampler, self._options, epoch, start, stream)

    @property
    def epoch(self) -> int:
        return self._sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's order (call before iterating, like DistributedSampler). After
        ``load_state_dict``, setting the loaded epoch keeps the loaded mid-epoch position."""
        self._machinery.stop_iter(f"set_epoch({epoch}) was called during this pass")
        if epoch != self._sampler.epoch:
            self._progress.position = None
        self._sampler.set_epoch(epoch)
        self._lookahead.set_epoch(self._sampler.epoch)  # an Ahead of another epoch stops now

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self._closed:
            raise RuntimeError("this Loader is closed")
        self._machinery.check_process()
        self._ranks.check()  # every rank built its Loader by now, usually: compare once
        self._machinery.stop_iter("a new pass over this Loader began (iter(loader)); each Loader runs one pass at "
                              "a time: iterate the new one")
        o = self._options
        fixed = o.fixed_size and o.batch_transform is None and o.device_transform is None
        plan, source, ahead, lookahead = self._begin_pass(wait=True)
        try:
            it = EpochIterator(plan, source, prefetch=o.prefetch, stats=self._stats, progress=self._progress,
                               fixed_size=fixed, log_every=o.log_every, ahead=ahead, lookahead=lookahead,
                               on_position=self._remote.advance if self._remote is not None else None,
                               replan=self._replan, keep=self._lookahead.hand_back if self._lookahead.enabled else None,
                               owner=self)  # the pass keeps its Loader alive: `for b in Loader(...)` works
        except BaseException:  # (a Ctrl-C before the pass held its source: nothing left in the feeder)
            if source is not None:
                source.close()
            raise
        self._machinery.track(it)
        self._sampler.prepare(plan.epoch + 1)  # the next epoch's order, in the background while this one runs
        return it

    def _begin_pass(self, plan: EpochPlan | PackPlan | None = None, *,
                    wait: bool = False) -> tuple[EpochPlan | PackPlan, Any, Any, Any]:
        """A pass over the sampler's epoch (from a loaded mid-epoch position, if any), or over
        ``plan`` (planned already: a loaded position is used up by planning): its plan, its
        source, the Ahead requested for it (if any: taken over) and its iterator's look-ahead;
        a remote dataset's cache follows the plan. ``wait`` (at ``iter()``): when the look-ahead
        holds another epoch's Ahead, no source (nothing requested): the first ``next()`` decides
        (:meth:`_replan`); and until then a loaded position stays pending in the sampler and
        the look-ahead's guess is not begun (no iterator's look-ahead: :meth:`_replan` gives
        it), so a pass dropped before its first ``next()`` uses up neither."""
        if plan is None:
            if self._options.pack is None:
                plan = self._sampler.epoch_plan(hold=wait)  # resumes a loaded position, else starts the epoch
            else:  # the same stream of samples, read as tokens (the position counts tokens)
                plan = self._pack_plan(*self._sampler.begin_pass(hold=wait))
                self._machinery.check_pieces(plan)
            if self._remote is not None:
                self._remote.begin(plan)
            self._pass_epoch = plan.epoch
            if wait and self._lookahead.holds_another_epoch(plan):
                return plan, None, None, None
        ahead = None
        try:
            ahead = self._lookahead.take(plan)  # before any new request: a stale one is closed first
            source = ahead.source if ahead is not None else self._machinery.source(plan.epoch)
            self._pass_epoch = plan.epoch
            return plan, source, ahead, None if wait else self._lookahead.after(plan.epoch)
        except BaseException:  # (a Ctrl-C: what the Ahead requested must not stay in the feeder)
            if ahead is not None:
                ahead.close()
            raise

    def _replan(self, it: EpochIterator) -> None:
        """At a pass's first ``next()``: if the sampler was moved to another epoch since ``iter()``,
        the pass is that epoch's, from its start, as a ``DataLoader``'s would be (it reads its
        sampler only at the first ``next()``). PyTorch Lightning does this: ``iter(loader)``, then
        ``loader.sampler.set_epoch(epoch)``, when a fit begins or resumes and when it reloads its
        dataloaders. The epoch set to the pass's own keeps its plan (a loaded mid-epoch
        position included). A pass that waited (an Ahead of another epoch was held at ``iter()``)
        takes that Ahead over if the sampler was moved to its epoch, else closes it and requests
        its own batches now."""
        epoch = self._sampler.epoch
        if epoch == it.plan.epoch:
            self._sampler.pass_begun()  # the loaded position it was planned from (if any) is used up
        if epoch == it.plan.epoch and not it.waiting:
            it.follow(self._lookahead.after(epoch))
            return
        it.discard()  # what was requested for the old epoch is dropped, its threads joined
        if epoch == it.plan.epoch:  # it waited, the sampler stayed: the pass planned at iter() (the Ahead closed)
            plan, source, ahead, lookahead = self._begin_pass(it.plan)
        else:
            self._lookahead.set_epoch(epoch)  # an Ahead of another epoch than the sampler's stops
            plan, source, ahead, lookahead = self._begin_pass()
        try:
            it.restart(plan, source, ahead=ahead, lookahead=lookahead)
        except BaseException:
            source.close()  # (idempotent: restart closes it too once it holds it)
            raise
        self._sampler.prepare(plan.epoch + 1)

    # -- resume --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain JSON-able state: where the next batch starts, plus what must match on load."""
        return {
            "version": LOADER_STATE_VERSION,
            "dataset": {"num_samples": len(self._dataset), "fingerprint": dataset_fingerprint(self._dataset)},
            "batch_size": self.batch_size,
            "fields": self.fields,
            "transforms": {n: t.describe() for n, t in self._options.transforms.items()},
            "ragged": {n: d.describe() for n, d in {**self._options.ragged, **self._options.output_ragged}.items()},
            "seed": self.seed,
            # the pass's position, unless the sampler was set to another epoch since (Lightning
            # calls loader.sampler.set_epoch, not loader.set_epoch): then the sampler's own count
            "sampler": self._sampler.state_dict(
                consumed=self._progress.position if self._pass_epoch == self._sampler.epoch else None),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (same or different world size). Refuses a state taken on
        another dataset or with other settings, naming what differs."""
        if not isinstance(state, Mapping) or "sampler" not in state:
            raise ValueError("not a fastload Loader state (no 'sampler' key)")
        if state.get("version") != LOADER_STATE_VERSION:
            raise ValueError(f"Loader state version {state.get('version')!r} is not {LOADER_STATE_VERSION}")
        mine = self.state_dict()
        for key in ("dataset", "seed", "fields", "transforms", "ragged"):
            if state.get(key, {} if key == "ragged" else None) != mine[key]:
                raise ValueError(f"Loader state mismatch in {key}: saved {state.get(key)!r}, "
                                 f"this loader has {mine[key]!r}")
        self._machinery.stop_iter("load_state_dict() was called during this pass")
        self._sampler.load_state_dict(state["sampler"], epoch_end=self._token_epoch_end())  # validates seed, size, version, position
        self._progress.position = None

    def _token_epoch_end(self):
        """With packing, a resume position counts tokens: at most the epoch's, padded (else None)."""
        if self._options.pack is None:
            return None
        d = self._options.pack[1]

        def epoch_end(epoch: int, world: int, drop_last: bool) -> int:
            plan = self._pack_plan(epoch, 0, self._sampler.order_stream(epoch))
            return plan.total + world * self.batch_size * d.pack_to
        return epoch_end

    # -- stats and lifetime --------------------------------------------------------------------
    def stats(self) -> dict:
        """Throughput and where the time went, since the current epoch's iteration began.

        wait_fraction = time the training loop spent blocked in ``next()`` / wall time: near 0
        means data loading keeps up; near 1 means the loop is starved. ``loop_s`` is the
        loop's own time (outside ``next()``); ``bottleneck`` names what sets the pace after
        the first batch: ``"loop"`` (the training step; a faster loader gains nothing),
        ``"loader"`` (the loop waits over 20% of the time) or ``"both"``."""
        return self._stats.report()  # every part registered what it reports (see stats.py)

    def close(self) -> None:
        """Stop and join every thread, release the ring and DALI pipelines. Idempotent. Every
        wait has a deadline (a stuck transform: 10 s, then a warning). In a child forked from the process that made this Loader, it
        only marks it closed (the threads belong to the parent)."""
        self._closed = True
        if self._machinery is None:
            return
        if self._machinery.forked:
            self._machinery.close()
            return
        self._machinery.stop_iter("the Loader was closed during this pass")
        self._lookahead.close()
        self._sampler.join_ahead()
        self._stats.detach_all()  # stats() stays complete after close()
        self._finalizer()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self):
        try:
            if self._machinery is not None:
                self._machinery.stop_iter()
        except Exception:
            pass

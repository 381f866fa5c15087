"""A Loader's configuration: every keyword checked once, then frozen (``Options``), and the
sampler those values define.

``build_options`` turns the Loader's keyword arguments (all of them, passed once) into an
immutable ``Options``: which fields are delivered and how (raw fields through the ring, image
fields through their DALI transform, string/bytes fields as lists), the device, the sampler's
settings, the threads, the prefetch and the ring's size (the sizing policy itself is
:mod:`fastload.ring.size`). It returns the :class:`fastload.Sampler` made from them too: the
ring is sized from what an epoch of it holds.

Adding a Loader keyword: the Loader's signature and docstring, a field of ``Options`` and its
check in ``build_options`` — nothing else.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from types import MappingProxyType, SimpleNamespace
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..runtime.device import resolve_device
from ..pipeline.multi import SampleTransform
from ..pipeline.presets import Transform
from ..ring.size import (batch_bytes, default_cuda_image_prefetch, default_gather_threads, default_prefetch,
                         ring_slots, slot_bytes)
from ..sampling import Sampler
from ..sampling.length_summary import length_summary
from ..store.format import INDEX_KEY
from ..runtime.system import check_fits_in_memory
from ..validate import ON_ERROR, check_bool, check_choice, check_int, check_seed
from .ragged import RaggedDelivery, resolve_ragged

__all__ = ["ON_ERROR", "Options", "as_mixture", "build_options", "make_sampler"]

logger = logging.getLogger("fastload")


@dataclass(frozen=True)
class Options:
    # what a batch holds
    batch_size: int
    seed: int
    device: Any  # torch.device
    fields: tuple[str, ...]  # delivered, in the dataset's order or the user's
    raw_fields: tuple[str, ...]  # fixed-size fields gathered by the ring
    image_fields: tuple[str, ...]  # decoded by their transform
    list_fields: tuple[str, ...]  # string / bytes fields, delivered as lists
    transforms: Mapping[str, Transform]  # read-only
    on_error: str
    log_every: int | None
    ragged: Mapping[str, RaggedDelivery] = field(default_factory=lambda: MappingProxyType({}))  # ragged fields
    # the ragged outputs of a sample transform (transforms=vision.detection(...)): shaped by its runner
    output_ragged: Mapping[str, RaggedDelivery] = field(default_factory=lambda: MappingProxyType({}))
    batch_transform: Callable | None = None  # host, in a fastload thread, before the device copy
    device_transform: Callable | None = None  # on the device, on fastload's stream
    # the order: the Sampler's settings, as given (make_sampler)
    shuffle: bool = True
    drop_last: bool = False
    weights: Any = field(default=None, repr=False, compare=False)  # per-sample weights, or a field's name
    replacement: bool = True
    num_draws: int | None = None
    balance: bool | str = False
    shuffle_mode: str = "full"
    window: int | None = None
    # the machinery's size (fastload.ring.size)
    threads: int = 1  # gather threads
    prefetch: int = 2  # batches in flight
    slot_rows: int = 1  # rows a ring slot / DALI batch holds: min(batch_size, samples per rank)
    slots: int = 3  # ring slots: for min(prefetch, batches per epoch) in flight

    @property
    def pack(self) -> tuple[str, RaggedDelivery] | None:
        """The field packed with ``pack_to`` (and its delivery), if any."""
        return next(((n, d) for n, d in self.ragged.items() if d.mode == "pack"), None)

    @property
    def fixed_size(self) -> bool:
        """True when every batch of a given row count has the same bytes: no list field, and
        no ragged field but the one packed with ``pack_to`` (rows of N tokens; one row of
        the other keys per piece), no ragged output of a sample transform."""
        return (not self.list_fields and not self.output_ragged
                and all(d.mode == "pack" for d in self.ragged.values()))


def _resolve_sample(ds, fields: Sequence[str] | None, t: SampleTransform) -> tuple[list[str], dict]:
    """A transform over several fields: its key (first image input) stands for it among the
    fields; the fields it reads are not delivered as stored (its outputs are); beside them, by
    default, the dataset's fixed-size fields (ragged ones would no longer match the boxes a
    crop keeps: name them in ``fields=`` to have them as stored)."""
    t.bind(ds.fields)
    consumed = set(t.inputs.values())
    if fields is None:  # (a field an output replaces is left out; named in fields=, it is an error below)
        fields = [n for n, f in ds.fields.items()
                  if f.kind in ("tensor", "scalar") and n != INDEX_KEY and n not in t.outputs]
    elif isinstance(fields, (str, bytes)):
        raise ValueError(f"fields={fields!r} must be a list of field names, e.g. fields=[{fields!r}]")
    for n in fields:
        if n not in ds.fields and n not in t.outputs:
            raise ValueError(f"fields: {n!r} is not a field of {ds.path} nor an output of {t!r}; fields are "
                             f"{list(ds.fields)}, outputs {list(t.outputs)}")
        if n in ds.fields and ds.fields[n].kind == "image" and n not in consumed:
            raise ValueError(f"fields: image field {n!r} is not read by {t!r}; leave it out (one transform decodes "
                             "the images of a sample transform's batch)")
    if INDEX_KEY in t.outputs:
        raise ValueError(f"{t!r} declares an output named {INDEX_KEY!r}, which batch['index'] (the global sample "
                         "indices) would shadow; rename it")
    return [t.key] + [n for n in fields if n not in consumed and n in ds.fields], {t.key: t}


_DECODED = ("image", "video", "audio")  # the kinds a transform decodes (video/audio: see fastload.pipeline.media)

def _resolve_fields(ds, fields: Sequence[str] | None, transforms: Any) -> tuple[list[str], dict]:
    if isinstance(transforms, SampleTransform):
        return _resolve_sample(ds, fields, transforms)
    if transforms is not None and not isinstance(transforms, Mapping):
        raise ValueError(f"transforms={transforms!r} must be a dict {{image field: transform}}, "
                         "e.g. transforms={'image': fastload.vision.train(224)}, or one transform over several "
                         "fields, e.g. transforms=fastload.vision.detection(640)")
    transforms = dict(transforms or {})
    if fields is None:
        fields = [n for n, f in ds.fields.items() if f.kind in ("tensor", "scalar", "ragged", *_DECODED)]
        if INDEX_KEY in fields:  # only in datasets written before the name was reserved
            fields.remove(INDEX_KEY)
            logger.warning("fastload: %s has a field named 'index'; it is not delivered, because "
                           "batch['index'] holds the global sample indices", ds.path)
    elif isinstance(fields, (str, bytes)):
        raise ValueError(f"fields={fields!r} must be a list of field names, e.g. fields=[{fields!r}]")
    fields = list(fields)
    dup = sorted({n for n in fields if fields.count(n) > 1})
    if dup:
        raise ValueError(f"fields: {dup} named more than once; name each field once")
    for n in fields:
        if n not in ds.fields:
            raise ValueError(f"fields: {n!r} is not a field of {ds.path}; fields are {list(ds.fields)}")
        if n == INDEX_KEY:
            raise ValueError(f"field {n!r} of {ds.path} would be shadowed by batch['index'] (the global "
                             "sample indices); leave it out with fields=[...]")
    for n, t in transforms.items():
        if isinstance(t, SampleTransform):
            raise ValueError(f"transforms[{n!r}]={t!r} reads several fields; pass it as transforms= itself, "
                             "not in a dict")
        if n not in ds.fields or ds.fields[n].kind not in _DECODED:
            raise ValueError(f"transforms: {n!r} is not an image, video or audio field of {ds.path}")
        if not isinstance(t, Transform):
            hint = " (call it: vision.train(224))" if callable(t) and getattr(t, "__module__", "").startswith(
                "fastload") else ""
            raise ValueError(f"transforms[{n!r}]={t!r} is not a fastload transform{hint}; use "
                             "fastload.vision.train(...), .eval(...) or .custom(...) (a DALI graph)")
    for n, t in transforms.items():  # video/audio transforms read what convert probed of each file
        if hasattr(t, "for_dataset"):
            transforms[n] = t.for_dataset(ds, n)
        elif ds.fields[n].kind != "image":
            raise ValueError(f"transforms[{n!r}]={t!r} is an image transform; {n!r} is a {ds.fields[n].kind} field: "
                             f"use fastload.{ds.fields[n].kind}.clip(...)")
    media = [n for n in fields if ds.fields[n].kind in ("video", "audio") and n not in transforms]
    if media:
        k = ds.fields[media[0]].kind
        raise ValueError(f"{k} field {media[0]!r} has no transform; pass transforms={{{media[0]!r}: "
                         f"fastload.{k}.clip(...)}}, or leave the field out with fields=[...]")
    missing = [n for n in fields if ds.fields[n].kind == "image" and n not in transforms]
    if missing:
        raise ValueError(
            f"image field {missing[0]!r} has no transform; pass transforms={{{missing[0]!r}: "
            "fastload.vision.train(224)} (or fastload.vision.eval(224, resize=256), or "
            "fastload.vision.custom(...)), or leave the field out with fields=[...]")
    if not fields:
        raise ValueError(f"no field to deliver; {ds.path} has fields {list(ds.fields)}")
    return fields, transforms


def build_options(ds, world, *, mixture: Any = None, batch_size: Any, seed: Any, device: Any,
                  fields: Sequence[str] | None, transforms: Any, threads: Any, prefetch: Any, on_error: Any,
                  log_every: Any, ragged: Any, pad_value: Any, max_length: Any, pad_to_multiple: Any, pack_to: Any,
                  batch_transform: Any, device_transform: Any, shuffle: Any, drop_last: Any, weights: Any,
                  replacement: Any, num_draws: Any, balance: Any, shuffle_mode: Any, window: Any,
                  **opening: Any) -> tuple[Options, Sampler]:
    """The Loader's keywords for ``ds`` (opened) on ``world``, checked and frozen, and the
    sampler they define (a MixtureSampler for ``mixture``). ``opening``: the keywords the
    Loader used to open the data and find the ranks (``verify``, ``mix``, the remote settings,
    ``rank``, ...); they are no option."""
    batch_size = check_int("batch_size", batch_size, min=1)
    seed = check_seed("seed", seed)
    check_choice("on_error", on_error, ON_ERROR)
    if log_every is not None:
        log_every = check_int("log_every", log_every, min=1)
    for name, fn in (("batch_transform", batch_transform), ("device_transform", device_transform)):
        if fn is not None and not callable(fn):
            raise ValueError(f"{name}={fn!r} must be a function batch -> batch (dict of tensors)")
    fields, transforms = _resolve_fields(ds, fields, transforms)
    ragged_names = tuple(n for n in fields if ds.fields[n].ragged)
    sample = next((t for t in transforms.values() if isinstance(t, SampleTransform)), None)
    outputs = {n: s for n, s in sample.outputs.items() if s.ragged} if sample is not None else {}
    if outputs:  # ragged outputs take the ragged keywords as ragged fields do
        shim = SimpleNamespace(path=ds.path, fields={**ds.fields, **{n: _OutputField(s) for n, s in outputs.items()}})
        every = resolve_ragged(shim, ragged_names + tuple(outputs), ragged=ragged, pad_value=pad_value,
                               max_length=max_length, pad_to_multiple=pad_to_multiple, pack_to=pack_to)
        deliveries = {n: d for n, d in every.items() if n not in outputs}
        out_ragged = {n: d for n, d in every.items() if n in outputs}
        packs = [n for n, d in out_ragged.items() if d.mode == "pack"]
        if packs:
            raise ValueError(f"pack_to packs a stored sequence field; {packs[0]!r} is an output of {sample!r}")
    else:
        deliveries = resolve_ragged(ds, ragged_names, ragged=ragged, pad_value=pad_value, max_length=max_length,
                                    pad_to_multiple=pad_to_multiple, pack_to=pack_to)
        out_ragged = {}
    _check_keys(ds, fields, deliveries)
    if sample is not None:
        _check_output_keys(fields, deliveries, sample, out_ragged)
    if balance and any(d.mode == "pack" for d in deliveries.values()):
        raise ValueError(f"balance={balance!r} makes class-balanced batches of samples, and pack_to= cuts "
                         "documents into rows of tokens, so a packed batch is not class-balanced; use "
                         "weights= (per-document draw weights, e.g. 1 / the frequency of its class) with pack_to")
    raw = tuple(n for n in fields if ds.fields[n].fixed)
    images = tuple(n for n in fields if ds.fields[n].kind in _DECODED)  # decoded by a transform
    lists = tuple(n for n in fields if ds.fields[n].kind in ("string", "bytes"))
    transforms = {n: transforms[n] for n in images}
    threads = default_gather_threads() if threads is None else check_int("threads", threads, min=1, max=256)
    device = resolve_device(device)
    host_bytes = batch_bytes(batch_size, sum(ds.fields[n].row_nbytes for n in raw))
    for n, d in deliveries.items():  # a typical batch: the mean length (rows of N when packing)
        mean = d.pack_to if d.pack_to else length_summary(ds.lengths(n), d.max_length).mean
        host_bytes += int(batch_size * mean * ds.fields[n].item_nbytes)
    image_bytes = batch_size * sum(t.row_bytes() for t in transforms.values())
    if prefetch is not None:
        prefetch = check_int("prefetch", prefetch, min=1)
    elif device.type == "cuda" and images:
        prefetch = default_cuda_image_prefetch(image_bytes)
    else:
        prefetch = default_prefetch(threads, host_bytes + image_bytes)
    o = Options(batch_size=batch_size, seed=seed, device=device,
                fields=tuple(fields), raw_fields=raw, image_fields=images, list_fields=lists,
                transforms=MappingProxyType(transforms), on_error=on_error, log_every=log_every,
                ragged=MappingProxyType(deliveries), output_ragged=MappingProxyType(out_ragged),
                batch_transform=batch_transform,
                device_transform=device_transform, shuffle=shuffle, drop_last=drop_last, weights=weights,
                replacement=replacement, num_draws=num_draws, balance=balance, shuffle_mode=shuffle_mode,
                window=window, threads=threads, prefetch=prefetch)
    sampler = make_sampler(ds, world, o, mixture=mixture)
    return _fit_to_epoch(o, ds, sampler), sampler


class _OutputField:
    """A ragged output of a sample transform as ``resolve_ragged`` reads a field."""

    ragged = True

    def __init__(self, spec):
        self.shape, self.np_dtype, self.dtype = spec.item, spec.np_dtype, spec.dtype

    def __str__(self) -> str:
        return f"{self.dtype}[*{''.join(f',{d}' for d in self.shape)}] (an output)"


def _check_output_keys(fields: Sequence[str], deliveries: Mapping[str, RaggedDelivery], t: SampleTransform,
                       out_ragged: Mapping[str, RaggedDelivery]) -> None:
    """A sample transform's outputs (and their ragged keys) must not shadow a delivered field
    or another key."""
    taken = {n: f"field {n!r}" for n in fields[1:]}
    taken.update({k: f"a key of ragged field {n!r}" for n, d in deliveries.items() for k in d.keys(n)})
    for n in t.outputs:
        keys = (n, *(out_ragged[n].keys(n) if n in out_ragged else ()))
        for k in keys:
            if k in taken:
                raise ValueError(f"{t!r}: its output key {k!r} would shadow {taken[k]}; leave that field out with "
                                 "fields=[...] or rename it")
            taken[k] = f"output {n!r}"


def _fit_to_epoch(o: Options, ds, sampler) -> Options:
    """Size the ring from what the dataset can fill, not from the nominal arguments: a batch
    never holds more rows than this rank reads per epoch (``batch_size=10**7`` on a 60,000-sample
    dataset makes 60,000-row slots), there are no more slots than an epoch has batches to put
    in them (``prefetch=10**7``), and the slots must fit in the memory available — else a
    ValueError naming batch_size and prefetch, before anything is allocated (the ring checks
    its exact size again, ragged fields included)."""
    rows = max(1, min(o.batch_size, sampler.num_samples_per_rank))
    if o.pack is not None:  # packed rows are not samples: the plan decides their number
        rows = o.batch_size
    row_bytes = sum(ds.fields[n].row_nbytes for n in o.raw_fields)
    if o.device.type != "cuda":  # images decoded on the host may be finished into the slot
        row_bytes += sum(t.row_bytes() for t in o.transforms.values())
    slots = ring_slots(max(1, min(o.prefetch, sampler.batches_per_epoch)))  # prefetch itself stays as asked
    size = slot_bytes(rows, row_bytes, len(o.raw_fields) + len(o.image_fields))
    check_fits_in_memory(
        slots * size,
        f"batch_size={o.batch_size} ({rows:,} rows per batch on this rank) with prefetch={o.prefetch} "
        f"({slots} ring slots of {size:,} bytes)",
        "lower batch_size or prefetch")
    return replace(o, slot_rows=rows, slots=slots)


def _check_keys(ds, fields: Sequence[str], deliveries: Mapping[str, RaggedDelivery]) -> None:
    """The keys a batch gets beside the fields (lengths/offsets/positions of ragged fields,
    ``"source"`` of a mixture) must not shadow a delivered field; packing takes no image."""
    extra = {k: n for n, d in deliveries.items() for k in d.keys(n)}
    if getattr(ds, "split", None) is not None:
        extra["source"] = "the mixture"
    for k, owner in extra.items():
        if k in fields:
            raise ValueError(f"field {k!r} would be shadowed by batch[{k!r}] (added for {owner!r}); leave it out "
                             "with fields=[...] or rename it")
    pack = next((n for n, d in deliveries.items() if d.mode == "pack"), None)
    images = [n for n in fields if ds.fields[n].kind == "image"]
    if pack is not None and images:
        raise ValueError(f"pack_to packs {pack!r} across samples, so a row has no single image; leave the image "
                         f"field(s) {images} out with fields=[...]")


def as_mixture(dataset: Any, *, mix: Any, epoch_size: Any, stop_on: Any, fields: Any, remote: Any = None):
    """The Mixture a Loader reads: ``dataset`` itself, or one built from a list / dict of
    datasets with ``mix`` (weights; ``remote``: a RemoteOptions, how its URLs are opened);
    None for a single dataset."""
    from ..store.mixture import Mixture

    given = {k: v for k, v in (("mix", mix), ("epoch_size", epoch_size), ("stop_on", stop_on)) if v is not None}
    if isinstance(dataset, Mixture):
        if given:
            raise ValueError(f"{next(iter(given))}= is set on the Mixture itself, not the Loader")
        return dataset
    if isinstance(dataset, (list, tuple, Mapping)):
        if mix is None:
            raise ValueError("a list of datasets is a mixture: pass mix=[weights] (and epoch_size= or stop_on=), "
                             "or a fastload.Mixture")
        return Mixture(dataset, mix, epoch_size=epoch_size, stop_on=stop_on, fields=fields, remote=remote)
    if given:
        raise ValueError(f"{next(iter(given))}= mixes several datasets; pass a list of datasets (or a fastload.Mixture)")
    return None


def _field_values(ds, field: str) -> np.ndarray:
    """Every sample's value of scalar ``field``: a dataset's (local or remote) kept once per
    node and memory-mapped (fastload.store.lengths.kept_values: never one copy per rank), others
    (a concatenation of datasets) read."""
    from ..store.lengths import kept_values
    from ..store.reader import DatasetReader

    if isinstance(ds, DatasetReader):
        return kept_values(ds, field)
    return ds.get_batch(np.arange(len(ds)), fields=[field])[field]


def make_sampler(ds, world, o: Options, *, mixture: Any = None) -> Sampler:
    """The Sampler of a Loader from its options: ``weights`` may name a scalar field,
    ``balance=True`` balances the label field (or the named one); a mixture's is a
    MixtureSampler."""
    weights, balance = o.weights, o.balance
    if mixture is not None:
        from ..sampling.mixture import MixtureSampler

        other = {"weights": weights is not None, "num_draws": o.num_draws is not None, "balance": bool(balance),
                 "shuffle_mode": o.shuffle_mode != "full", "window": o.window is not None}
        bad = [k for k, v in other.items() if v]
        if bad:
            raise ValueError(f"{bad[0]}= does not apply to a mixture (its proportions are the mixture's weights)")
        return MixtureSampler(mixture, batch_size=o.batch_size, world_size=world.world_size, rank=world.rank,
                              seed=o.seed, shuffle=o.shuffle, drop_last=o.drop_last)
    if isinstance(weights, str):
        wf = ds.fields.get(weights)
        if wf is None or wf.kind != "scalar":
            raise ValueError(f"weights={weights!r} must name a scalar field of {ds.path}")
        weights = _field_values(ds, weights)
    labels = None
    if not isinstance(balance, str):
        balance = check_bool("balance", balance)
    if balance:
        lf = balance if isinstance(balance, str) else ds.label_field
        if lf is None or lf not in ds.fields or ds.fields[lf].kind != "scalar":
            raise ValueError(f"balance={balance!r} needs a label field; {ds.path} has "
                             f"{'no label field' if ds.label_field is None else 'label ' + repr(ds.label_field)}")
        labels = _field_values(ds, lf)
    return Sampler(len(ds), batch_size=o.batch_size, world_size=world.world_size, rank=world.rank,
                   shuffle=o.shuffle, seed=o.seed, drop_last=o.drop_last, weights=weights,
                   replacement=o.replacement, num_draws=o.num_draws, balance_labels=labels,
                   shuffle_mode=o.shuffle_mode, shard_sizes=ds.shard_sizes if o.shuffle_mode != "full" else None,
                   window=o.window)

"""How a Loader delivers ragged fields: the options, the ring field, the batch's keys.

Per field, one of three forms (``RaggedDelivery.mode``):

* ``"padded"`` (default): ``batch[name]`` is ``(B, L, *item)`` with ``L`` the longest sample
  of the batch (after ``max_length`` truncation) rounded up to ``pad_to_multiple`` (at least
  one multiple), filled up with ``pad_value``; ``batch[name + "_lengths"]`` (int64, ``B``)
  says how many items of each row are real.
* ``"packed"``: ``batch[name]`` is every sample's items one after the other, ``(T, *item)``,
  and ``batch[name + "_offsets"]`` (int32, ``B + 1``) where each sample starts: the
  ``cu_seqlens`` that variable-length attention kernels take.
* ``"pack"`` (``pack_to=N``): ``batch[name]`` is ``(rows, N)``, documents concatenated and
  cut into rows (see :mod:`fastload.sampling.packing`); ``batch[name + "_offsets"]`` (int32) are the
  piece boundaries over the flattened batch (``cu_seqlens``: a document cut by a row end is
  two pieces) and ``batch[name + "_positions"]`` (int64, ``(rows, N)``) each token's position
  within its document. Every other field, ``"index"`` and ``"source"`` have one row per piece.

The C++ ring gathers each form directly (one copy of the items; with ``pack_to`` its
producers also write the positions); this module sizes the ring's region for the field and
turns the ring's ``(values, offsets[, positions])`` into these keys.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from ..ring.spec import RaggedField, pad_check
from ..sampling.length_summary import length_summary
from ..validate import check_choice, check_int

__all__ = ["MODES", "RAGGED_SLOT_BUDGET", "RaggedDelivery", "resolve_ragged", "ring_field", "shape_batch"]

MODES = ("padded", "packed")
RAGGED_SLOT_BUDGET = 64 << 20  # bytes a slot region may take when the exact bound is larger


@dataclass(frozen=True)
class RaggedDelivery:
    mode: str  # "padded", "packed" or "pack"
    pad_value: Any = 0
    max_length: int | None = None
    multiple: int = 1
    pack_to: int | None = None

    def keys(self, name: str) -> tuple[str, ...]:
        """The batch keys this field adds beside ``name``."""
        if self.mode == "padded":
            return (name + "_lengths",)
        if self.mode == "packed":
            return (name + "_offsets",)
        return (name + "_offsets", name + "_positions")

    def describe(self) -> dict:
        return {"mode": self.mode, "pad_value": _plain(self.pad_value), "max_length": self.max_length,
                "pad_to_multiple": self.multiple, "pack_to": self.pack_to}


def _plain(v: Any) -> Any:
    """A pad value as plain JSON (a state_dict compares it with ``==``): NaN and infinities as
    the strings ``"nan"``, ``"inf"``, ``"-inf"``; a complex number as ``[real, imag]``."""
    v = v.item() if isinstance(v, np.generic) else v
    if isinstance(v, complex):
        return [_plain(v.real), _plain(v.imag)]
    if isinstance(v, float) and not np.isfinite(v):
        return str(v)
    return v


def _per_field(arg: str, value: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """``value`` for every field, or a dict naming some of them (which must be ragged)."""
    if isinstance(value, Mapping):
        bad = [k for k in value if k not in names]
        if bad:
            raise ValueError(f"{arg}: {bad[0]!r} is not a delivered ragged field; ragged fields are {list(names)}")
        return dict(value)
    return {n: value for n in names}


def resolve_ragged(ds, names: tuple[str, ...], *, ragged: Any, pad_value: Any, max_length: Any,
                   pad_to_multiple: Any, pack_to: Any) -> dict[str, RaggedDelivery]:
    """Each delivered ragged field's checked delivery (see the module docstring)."""
    given = {"ragged": ragged, "pad_value": pad_value, "max_length": max_length,
             "pad_to_multiple": pad_to_multiple, "pack_to": pack_to}
    if not names:
        used = [k for k, v in given.items() if v is not None]
        if used:
            raise ValueError(f"{used[0]}= applies to ragged fields, and no ragged field is delivered "
                             f"(fields of {ds.path}: {list(ds.fields)})")
        return {}
    modes = _per_field("ragged", "padded" if ragged is None else ragged, names)
    pads = _per_field("pad_value", pad_value, names) if pad_value is not None else {}
    maxlen = _per_field("max_length", max_length, names) if max_length is not None else {}
    mult = _per_field("pad_to_multiple", pad_to_multiple, names) if pad_to_multiple is not None else {}
    packs = _per_field("pack_to", pack_to, names) if pack_to is not None else {}
    if len(packs) > 1 or (packs and len(names) > 1):
        raise ValueError(f"pack_to packs one ragged field, and {list(names)} are delivered; pass "
                         f"fields=[...] without the others (or pack_to={{{names[0]!r}: N}} with only that field)")
    out = {}
    for n in names:
        f = ds.fields[n]
        mode = check_choice(f"ragged[{n!r}]", modes.get(n, "padded"), MODES)
        ml = maxlen.get(n)
        ml = None if ml is None else check_int(f"max_length[{n!r}]", ml, min=1)
        if n in packs:
            if n in pads or n in mult or (isinstance(ragged, Mapping) and n in ragged):
                raise ValueError(f"field {n!r}: pack_to fills every row, so pad_value, pad_to_multiple and "
                                 "ragged= do not apply")
            if f.shape:
                raise ValueError(f"pack_to packs 1-d sequences; field {n!r} is {f} (items of shape {f.shape})")
            out[n] = RaggedDelivery("pack", max_length=ml, pack_to=check_int("pack_to", packs[n], min=1))
            continue
        if mode == "packed" and (n in pads or n in mult):
            raise ValueError(f"field {n!r} is delivered packed (no padding): pad_value and pad_to_multiple "
                             "apply to ragged='padded'")
        pad = pads.get(n, 0)
        cast, why = pad_check(pad, f.np_dtype)
        if cast is None:
            raise ValueError(f"pad_value[{n!r}]={pad!r} is not a value of the field's dtype {f.dtype} ({why}); "
                             "pass a value the dtype holds exactly")
        out[n] = RaggedDelivery(mode, pad_value=cast, max_length=ml,
                                multiple=check_int(f"pad_to_multiple[{n!r}]", mult.get(n, 1), min=1))
    return out


def ring_field(ds, name: str, d: RaggedDelivery, batch_size: int) -> RaggedField:
    """The ring field of a ragged field, its slot region sized for the batch's worst case
    when that fits in ``RAGGED_SLOT_BUDGET`` bytes (rarer larger batches get memory of their
    own): ``batch_size`` rows of the longest sample (padded), the ``batch_size`` longest
    samples (packed), or exactly ``rows * N`` tokens (pack). The lengths are read through their
    summary (:func:`~fastload.sampling.length_summary.length_summary`), never copied whole."""
    f = ds.fields[name]
    if d.mode == "pack":  # the producers also write each token's position in its document
        return RaggedField(f.np_dtype, f.shape, capacity=batch_size * d.pack_to, positions=True)
    s = length_summary(ds.lengths(name), d.max_length)  # one pass in chunks, kept per node: no copy
    if d.mode == "padded":
        width = max(-(-s.longest // d.multiple) * d.multiple, d.multiple if d.multiple > 1 else 0)
        bound = batch_size * width
    else:
        bound = s.longest_sum(batch_size)
    typical = 2 * batch_size * -(-s.total // s.n) if s.n else 0
    budget = max(RAGGED_SLOT_BUDGET // max(f.item_nbytes, 1), typical)
    return RaggedField(f.np_dtype, f.shape, padded=d.mode == "padded", pad_value=d.pad_value,
                       max_items=d.max_length, multiple=d.multiple, capacity=min(bound, budget))


def shape_batch(batch: dict, name: str, d: RaggedDelivery) -> None:
    """Turn the ring's ``name`` / ``name + "_offsets"`` (int64) / ``name + "_positions"``
    (packing) into the delivered keys, in place."""
    import torch

    offsets = batch.pop(name + "_offsets")
    if d.mode == "padded":
        batch[name + "_lengths"] = offsets[1:] - offsets[:-1]
        return
    off = offsets.numpy()
    batch[name + "_offsets"] = torch.from_numpy(off.astype(np.int32))  # numpy: cheaper than Tensor.to
    if d.mode == "pack":  # the ring wrote each token's position in its document (int64)
        rows = batch[name].shape[0] // d.pack_to
        batch[name] = batch[name].view(rows, d.pack_to)
        batch[name + "_positions"] = batch[name + "_positions"].view(rows, d.pack_to)

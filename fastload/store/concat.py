"""ConcatReader: several datasets read as one, for a mixture (torch-free).

The datasets' shards are laid end to end (shard ``s`` of the whole is shard ``s - base[d]``
of dataset ``d``) and so are their samples: global index ``starts[d] + i`` is sample ``i``
of dataset ``d``. Everything a Loader reads — zero-copy columns for the ring, encoded image
views for DALI, ragged lengths, string fields, descriptions for errors — is routed to the
dataset that holds it, so the ring gathers a mixed batch exactly like a plain one.
``split(index)`` turns global indices back into ``(source, index within the dataset)``.

Only fields that every dataset has, with the same kind, dtype and shape, can be read:
``fields=`` restricts the mixture to some of them (by default every dataset must have the
same fields).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..errors import FormatError
from ..validate import check_index_array
from .format import Field
from .lengths import concat_lengths

__all__ = ["ConcatReader"]


class ConcatReader:
    def __init__(self, readers: Sequence[Any], names: Sequence[str], fields: Sequence[str] | None = None):
        if len(readers) < 1:
            raise ValueError("a mixture needs at least one dataset")
        self.readers = list(readers)
        self.names = list(names)
        self.fields: dict[str, Field] = _common_fields(self.readers, self.names, fields)
        sizes = np.array([len(r) for r in self.readers], dtype=np.int64)
        self.starts = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(sizes, out=self.starts[1:])
        nshards = np.array([r.num_shards for r in self.readers], dtype=np.int64)
        self._shard_base = np.zeros(len(nshards) + 1, dtype=np.int64)
        np.cumsum(nshards, out=self._shard_base[1:])
        self._shard_owner = np.repeat(np.arange(len(self.readers)), nshards)
        self.shard_sizes = np.concatenate([r.shard_sizes for r in self.readers])
        self._starts = np.zeros(len(self.shard_sizes) + 1, dtype=np.int64)
        np.cumsum(self.shard_sizes, out=self._starts[1:])
        self.shard_files = [f for r in self.readers for f in r.shard_files]
        self.path = "mixture(" + ", ".join(f"{n}={r.path}" for n, r in zip(self.names, self.readers)) + ")"
        labels = {getattr(r, "label_field", None) for r in self.readers}
        self.label_field = labels.pop() if len(labels) == 1 and None not in labels else None
        self.class_names = None
        self.class_counts = None
        self._lengths: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __repr__(self) -> str:
        fields = ", ".join(f"{n}: {f}" for n, f in self.fields.items())
        return f"fastload.store.ConcatReader({self.path}, {len(self)} samples, {{{fields}}})"

    @property
    def num_shards(self) -> int:
        return len(self.shard_files)

    @property
    def shard_starts(self) -> np.ndarray:
        return self._starts

    @property
    def manifest(self) -> dict:
        """What identifies the data (for a Loader's state): the datasets' shards, in order."""
        return {"num_samples": len(self), "fields": {n: f.to_json() for n, f in self.fields.items()},
                "shards": [s for r in self.readers for s in r.manifest["shards"]],
                "datasets": self.names}

    # -- index -----------------------------------------------------------------------------
    def split(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Global indices -> (which dataset, index within it), both int64."""
        index = np.asarray(index, dtype=np.int64)
        source = np.searchsorted(self.starts, index, side="right") - 1
        return source.astype(np.int64), index - self.starts[source]

    def locate(self, indices: Any, *, check: bool = True, verify: bool = True) -> tuple[np.ndarray, np.ndarray]:
        idx = check_index_array(indices, "indices") if check else np.asarray(indices, dtype=np.int64)
        if check and idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            bad = int(idx.min() if idx.min() < 0 else idx.max())
            raise IndexError(f"sample index {bad} is out of range for {self.path} ({len(self)} samples)")
        shard = np.searchsorted(self._starts, idx, side="right") - 1
        if verify and idx.size:
            self.ensure_verified(shard)
        return shard, idx - self._starts[shard]

    # -- verification: each dataset's own policy ---------------------------------------------
    @property
    def verify_policy(self) -> str:
        policies = {r.verify_policy for r in self.readers}
        return policies.pop() if len(policies) == 1 else "mixed"

    def ensure_verified(self, shards: Any) -> None:
        """Each shard verified by its own dataset (as its policy says) before its rows are read."""
        shards = np.unique(np.asarray(shards, dtype=np.int64))
        owner = self._shard_owner[shards]
        for d in np.unique(owner):
            self.readers[int(d)].ensure_verified(shards[owner == d] - int(self._shard_base[d]))

    @property
    def fully_verified(self) -> bool:
        return all(r.fully_verified for r in self.readers)

    def verify_ahead(self, shards: Any) -> None:
        """Each dataset hashes its own of these shards ahead of use (see DatasetReader)."""
        shards = np.asarray(shards, dtype=np.int64).reshape(-1)
        owner = self._shard_owner[shards]
        for d in np.unique(owner):
            self.readers[int(d)].verify_ahead(shards[owner == d] - int(self._shard_base[d]))

    def stop_verify_ahead(self) -> None:
        for r in self.readers:
            r.stop_verify_ahead()

    def verify_stats(self) -> dict:
        """The datasets' verification counters added up (see DatasetReader.verify_stats)."""
        out: dict = {"policy": self.verify_policy}
        for r in self.readers:
            for k, v in r.verify_stats().items():
                if k != "policy":
                    out[k] = out.get(k, 0) + v
        return out

    @property
    def shard_bases(self) -> np.ndarray:
        """Shard ``s`` of dataset ``d`` is shard ``shard_bases[d] + s`` of the whole."""
        return self._shard_base

    def shard(self, i: int):
        """Shard ``i`` of the whole, mapped by its dataset (a remote one fetches it first)."""
        r, s = self._local(i)
        return r.shard(s)

    def _local(self, shard: int) -> tuple[Any, int]:
        d = int(self._shard_owner[shard])
        return self.readers[d], shard - int(self._shard_base[d])

    def _by_dataset(self, indices: Any):
        """(dataset, positions in the batch, local indices) per dataset present."""
        source, local = self.split(indices)
        for d in np.unique(source):
            sel = np.flatnonzero(source == d)
            yield int(d), sel, local[sel]

    # -- reading ---------------------------------------------------------------------------
    def column(self, shard: int, field: str, *, verify: bool = True) -> np.ndarray:
        r, s = self._local(shard)
        return r.column(s, field, verify=verify)

    def ragged_column(self, shard: int, field: str, *, verify: bool = True) -> tuple[np.ndarray, np.ndarray]:
        r, s = self._local(shard)
        return r.ragged_column(s, field, verify=verify)

    def lengths(self, field: str) -> np.ndarray:
        v = self._lengths.get(field)
        if v is None:
            v = concat_lengths(self.readers, field)
            if v.flags.writeable:
                v.flags.writeable = False
            self._lengths[field] = v
        return v

    def views(self, field: str, indices: Any, *, copy: bool = False) -> list:
        out: list = [None] * len(np.asarray(indices))
        for d, sel, local in self._by_dataset(indices):
            for p, v in zip(sel.tolist(), self.readers[d].views(field, local, copy=copy)):
                out[p] = v
        return out

    def image_sizes(self, field: str, indices: Any) -> tuple[np.ndarray, np.ndarray]:
        n = len(np.asarray(indices))
        w, h = np.empty(n, np.int32), np.empty(n, np.int32)
        for d, sel, local in self._by_dataset(indices):
            w[sel], h[sel] = self.readers[d].image_sizes(field, local)
        return w, h

    def media_info(self, field: str, indices: Any, names: Any = None) -> dict:
        n = len(np.asarray(indices))
        out: dict = {}
        for d, sel, local in self._by_dataset(indices):
            for k, v in self.readers[d].media_info(field, local, names).items():
                if k not in out:
                    out[k] = [None] * n if isinstance(v, list) else np.empty(n, dtype=v.dtype)
                if isinstance(v, list):
                    for p, x in zip(sel.tolist(), v):
                        out[k][p] = x
                else:
                    out[k][sel] = v
        return out

    def keys(self, indices: Any) -> list[str]:
        out: list = [None] * len(np.asarray(indices))
        for d, sel, local in self._by_dataset(indices):
            for p, k in zip(sel.tolist(), self.readers[d].keys(local)):
                out[p] = k
        return out

    def describe(self, index: int) -> str:
        (d,), (local,) = self.split([index])
        return f"dataset {self.names[d]!r} {self.readers[d].describe(int(local))}"

    def get_batch(self, indices: Any, fields: Sequence[str] | None = None) -> dict:
        names = list(fields if fields is not None else self.fields)
        for n in names:
            if n not in self.fields:
                raise KeyError(f"{n!r} is not a field of {self.path}; fields are {list(self.fields)}")
        n = len(np.asarray(indices))
        out: dict[str, Any] = {}
        for d, sel, local in self._by_dataset(indices):
            part = self.readers[d].get_batch(local, fields=names)
            for name, v in part.items():
                f = self.fields[name]
                if name not in out:
                    out[name] = np.empty((n, *f.shape), f.np_dtype) if f.fixed else [None] * n
                if f.fixed:
                    out[name][sel] = v
                else:
                    for p, x in zip(sel.tolist(), v):
                        out[name][p] = x
        return out


def _common_fields(readers: list, names: list[str], fields: Sequence[str] | None) -> dict[str, Field]:
    first = readers[0].fields
    if fields is None:
        for r, name in zip(readers[1:], names[1:]):
            if r.fields != first:
                common = [n for n in first if all(x.fields.get(n) == first[n] for x in readers)]
                diff = sorted(set(first) ^ set(r.fields)) or [n for n in first if r.fields.get(n) != first[n]]
                raise FormatError(f"the mixture's datasets {names[0]!r} and {name!r} differ in field(s) {diff} "
                                  f"({_desc(readers[0], diff)} vs {_desc(r, diff)}); pass fields=[...] with fields "
                                  f"they share: {common}")
        return dict(first)
    if isinstance(fields, (str, bytes)):
        raise ValueError(f"fields={fields!r} must be a list of field names")
    out = {}
    for n in fields:
        specs = [r.fields.get(n) for r in readers]
        for spec, name in zip(specs, names):
            if spec is None:
                raise FormatError(f"field {n!r} is not a field of the mixture's dataset {name!r} "
                                  f"(its fields: {list(readers[names.index(name)].fields)})")
        if any(s != specs[0] for s in specs):
            kinds = ", ".join(f"{name}: {s}" for name, s in zip(names, specs))
            raise FormatError(f"field {n!r} differs between the mixture's datasets ({kinds}); every dataset "
                              "must store it the same way")
        out[n] = specs[0]
    return out


def _desc(reader, names: list[str]) -> str:
    return "{" + ", ".join(f"{n}: {reader.fields[n]}" if n in reader.fields else f"{n}: absent" for n in names) + "}"

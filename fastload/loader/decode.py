"""Decoding the image fields of a batch, and the one policy for images that cannot be decoded.

``decode_with_replacement`` is the bad-image policy as one function: it calls ``decode(idx)``
and, when the decoder refuses some samples (``BadSamples``), either raises a
:class:`~fastload.errors.DecodeError` naming each one (``on_error="raise"``) or replaces each
by the next sample of the dataset — deterministically, so a resumed run sees the same — and
decodes again (``on_error="skip"``). ``decode_fields`` applies it to every image field of a
batch so that all fields of a row come from the same sample. Both take plain callables, so
the policy is tested without DALI.

``Decoders`` owns a Loader's DALI runners (one per image field and feeder worker), built on
first use and closed with the Loader.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping, MutableMapping, Sequence

import numpy as np

from ..errors import BadSamples, DecodeError

__all__ = ["MAX_REPLACEMENT_ROUNDS", "Decoders", "decode_fields", "decode_with_replacement"]

logger = logging.getLogger("fastload")

MAX_REPLACEMENT_ROUNDS = 64


def _skip_known(idx: np.ndarray, known_bad: Mapping[int, str], num_samples: int) -> int:
    """Replace (in place) every index already known to be undecodable by the next one that
    is not; returns the number of replacements."""
    if not known_bad:
        return 0
    bad = np.fromiter(known_bad.keys(), dtype=np.int64, count=len(known_bad))
    replaced = 0
    for _ in range(min(num_samples, MAX_REPLACEMENT_ROUNDS)):
        hit = np.isin(idx, bad)
        if not hit.any():
            break
        idx[hit] = (idx[hit] + 1) % num_samples
        replaced += int(hit.sum())
    return replaced


def decode_with_replacement(decode: Callable[[np.ndarray], Any], idx: np.ndarray, *, num_samples: int,
                            on_error: str, describe: Callable[[int], str], field: str,
                            known_bad: MutableMapping[int, str] | None = None) -> tuple[Any, np.ndarray, int]:
    """``(decode(final), final, replaced)``: ``final`` is ``idx`` with every sample the
    decoder refused replaced by the next sample (``on_error="skip"``), ``replaced`` how many
    replacements were made. With ``on_error="raise"`` the first refusal raises DecodeError
    naming shard, row and key of each refused sample (``describe(index)``).

    ``known_bad`` (``{index: reason}``, kept by the caller across epochs): samples already
    found undecodable are replaced before decoding (the same result, without running the
    decoder on them again and bisecting every epoch); a newly found one is added and logged
    once (one line naming shard, row, key and the reason)."""
    idx = np.array(idx, dtype=np.int64, copy=True)
    replaced = 0
    if known_bad is not None and on_error == "skip":
        replaced += _skip_known(idx, known_bad, num_samples)
    for _round in range(MAX_REPLACEMENT_ROUNDS):
        try:
            return decode(idx), idx, replaced
        except BadSamples as e:
            if on_error == "raise":
                lines = [f"{describe(int(idx[p]))}: {r}" for p, r in zip(e.positions, e.reasons)]
                raise DecodeError(f"cannot decode image field {field!r}: " + "; ".join(lines)
                                  + " (pass on_error='skip' to replace such samples)") from None
            for p, r in zip(e.positions, e.reasons):
                bad = int(idx[p])
                if known_bad is not None and bad not in known_bad:
                    known_bad[bad] = r
                    logger.warning("fastload: image field %r of %s cannot be decoded (%s); on_error='skip' "
                                   "replaces it by the next sample", field, describe(bad), r)
                idx[p] = (idx[p] + 1) % num_samples  # deterministic: the next sample
            replaced += len(e.positions)
            if known_bad is not None:
                replaced += _skip_known(idx, known_bad, num_samples)
    raise DecodeError(f"image field {field!r}: gave up replacing undecodable samples near index {int(idx[0])} "
                      f"after {MAX_REPLACEMENT_ROUNDS} rounds (is most of the dataset undecodable?)")


def decode_fields(decoders: Mapping[str, Callable[[np.ndarray], Any]], idx: np.ndarray, *, num_samples: int,
                  on_error: str, describe: Callable[[int], str],
                  known_bad: MutableMapping[str, dict] | None = None) -> tuple[dict[str, Any], np.ndarray, int]:
    """Decode every image field of one batch: ``(results by field, final indices,
    replacements)``. If a field replaces samples, the fields decoded before it are decoded
    again with the replacements, so every field of a row comes from the same sample.
    ``known_bad``: ``{field: {index: reason}}`` (see :func:`decode_with_replacement`)."""
    replaced = 0
    while True:
        results: dict[str, Any] = {}
        restart = False
        for i, (name, decode) in enumerate(decoders.items()):
            results[name], final, n = decode_with_replacement(
                decode, idx, num_samples=num_samples, on_error=on_error, describe=describe, field=name,
                known_bad=None if known_bad is None else known_bad.setdefault(name, {}))
            replaced += n
            if n:
                idx = final
                if i > 0:  # fields before this one hold the replaced samples' rows
                    restart = True
                    break
        if not restart:
            return results, idx, replaced


def runner_decoder(runner, dataset, name: str, epoch: int, out: Any, stats) -> Callable[[np.ndarray], Any]:
    """``decode(idx)`` for one image field: the encoded bytes (copied out of the mapping by a
    guarded C++ read, so a shard that fails under its mapping is a ``ShardReadError`` naming
    it, not a SIGBUS in a DALI thread; one memcpy of the compressed bytes, small beside their
    decode) and their recorded sizes through a DALI runner (writing into ``out`` when given),
    timed into ``stats`` as ``decode_s`` (DALI's work) and ``copy_s`` (its output copied out)."""
    if hasattr(runner, "run_batch"):  # a sample transform: it reads its fields itself (MultiRunner)
        def decode_sample(idx: np.ndarray) -> Any:
            t0 = time.perf_counter()
            c0 = runner.copy_s
            try:
                return runner.run_batch(dataset, idx, epoch, out=out)
            finally:
                copied = runner.copy_s - c0
                stats.add("decode_s", time.perf_counter() - t0 - copied)
                stats.add("copy_s", copied)
        return decode_sample

    def decode(idx: np.ndarray) -> Any:
        enc = dataset.views(name, idx, copy=True)
        w, h = dataset.image_sizes(name, idx)
        t0 = time.perf_counter()
        c0 = runner.copy_s
        try:
            return runner.run(enc, w, h, idx, epoch, out=out)
        finally:
            copied = runner.copy_s - c0
            stats.add("decode_s", time.perf_counter() - t0 - copied)
            stats.add("copy_s", copied)
    return decode


class Decoders:
    """The DALI runners of one Loader: ``get(field, worker)`` builds on first use; ``close()``
    stops them all. ``device`` is ``"cpu"`` or ``"cuda"``; ``device_id`` the CUDA index.
    ``checked``: every image was decoded by DALI when the dataset was converted, so the CPU
    runners decode whole batches (``Runner.whole_batches``)."""

    def __init__(self, transforms: Mapping[str, Any], *, device: str, device_id: int | None, batch_size: int,
                 seed: int, checked: bool = False, output_ragged: Mapping[str, Any] | None = None) -> None:
        self._checked = bool(checked)
        self._output_ragged = dict(output_ragged or {})  # how a sample transform's ragged outputs are delivered
        self._transforms = dict(transforms)
        self._device = device
        self._device_id = device_id
        self._batch_size = batch_size
        self._seed = seed
        self._runners: dict[tuple[str, int], Any] = {}
        # {field: {global index: reason}}: samples found undecodable, kept across epochs
        self.known_bad: dict[str, dict[int, str]] = {}

    def undecodable(self) -> int:
        """Distinct samples found undecodable so far (over all image fields)."""
        return len({i for d in self.known_bad.values() for i in d})

    def get(self, field: str, worker: int = 0):
        r = self._runners.get((field, worker))
        if r is None:
            t = self._transforms[field]
            kw = {"ragged": self._output_ragged} if hasattr(t, "outputs") else {}
            r = t.runner(device=self._device, batch_size=self._batch_size, num_threads=None, prefetch=None,
                         seed=self._seed, device_id=self._device_id, **kw)
            r.whole_batches = self._checked
            self._runners[(field, worker)] = r
        return r

    def for_worker(self, fields: Sequence[str], worker: int) -> dict[str, Any]:
        return {n: self.get(n, worker) for n in fields}

    def close(self) -> None:
        runners, self._runners = self._runners, {}
        for r in runners.values():
            try:
                r.close()
            except Exception:  # pragma: no cover - best effort at interpreter exit
                pass

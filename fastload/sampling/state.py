"""A Sampler's resume state: its version, what defines the order (the identity a saved
state must match), and the checks of a saved state before a Sampler continues from it."""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..validate import check_int
from .plan import per_rank_count

# 3: full and window shuffles are keyed bijections computed per position (bijection.py);
# 2: plain permutations by fastload._C.permutation; 1: numpy's
SAMPLER_STATE_VERSION = 3


FAST_DIGEST_MIN = 1 << 20  # elements: larger arrays are digested with xxh3 (10 GB/s; blake2b: ~0.3 GB/s)


def digest(a: np.ndarray | None, dtype=None) -> str | None:
    """A short digest of an array (its dtype and bytes; ``dtype``: of its values converted to
    it) for an order's identity; None stays None. Hashed in chunks: an array of 10^10
    samples (memory-mapped, say) costs no copy. 16 hex digits: blake2b-64 below
    :data:`FAST_DIGEST_MIN` elements, ``x`` + 15 of xxh3-64 from there (blake2b would cost
    each rank minutes at 10^10 weights)."""
    if a is None:
        return None
    a = np.asarray(a)
    if a.dtype.hasobject:  # (Python objects: their pointers, as always)
        a = np.ascontiguousarray(a)
        return hashlib.blake2b(a.dtype.str.encode() + a.tobytes(), digest_size=8).hexdigest()
    flat = a if a.ndim == 1 else a.reshape(-1)
    dt = np.dtype(dtype) if dtype is not None else flat.dtype
    fast = flat.size >= FAST_DIGEST_MIN
    if fast:
        import xxhash

        h: Any = xxhash.xxh3_64()
        h.update(dt.str.encode())
    else:
        h = hashlib.blake2b(dt.str.encode(), digest_size=8)
    step = max(1, (1 << 24) // max(1, dt.itemsize))
    for i in range(0, flat.size, step):
        h.update(np.ascontiguousarray(flat[i:i + step], dtype=dt).data)
    return "x" + h.hexdigest()[:15] if fast else h.hexdigest()


def check_state(state: Mapping[str, Any], identity: dict, stream_len: int,
                epoch_end: Callable[[int, int, bool], int] | None = None) -> tuple[int, int]:
    """``(epoch, consumed)`` of a saved ``state``, once it is known to be a state of this
    version, saved with the same ``identity``, and not beyond the end of its epoch:
    ``epoch_end(epoch, world_size, drop_last)`` gives that end in the caller's unit
    (default: ``stream_len`` stream positions, padded to whole steps of the saved world size)."""
    if not isinstance(state, Mapping):
        raise ValueError(f"sampler state must be a dict, got {type(state).__name__}")
    version = state.get("version")
    if isinstance(version, int) and not isinstance(version, bool) and version < SAMPLER_STATE_VERSION:
        raise ValueError(f"sampler state version {version} was saved by an older fastload, whose orders differ "
                         f"from this one's (version {SAMPLER_STATE_VERSION}: shuffles computed per position, "
                         "bijection.py), so its position cannot be continued here: start the epoch afresh "
                         "(set_epoch(state['epoch']) without load_state_dict), or finish the run with the "
                         "fastload that saved it")
    if version != SAMPLER_STATE_VERSION:
        raise ValueError(f"sampler state version {version!r} is not {SAMPLER_STATE_VERSION} "
                         "(saved by another fastload version)")
    for key, mine in identity.items():
        if key not in state:
            raise ValueError(f"sampler state lacks {key!r}; not a fastload Sampler state?")
        if state[key] != mine:
            raise ValueError(f"sampler state was saved with {key}={state[key]!r}, but this sampler has "
                             f"{key}={mine!r}; resume with the same {key}")
    epoch = check_int("state['epoch']", state.get("epoch"), min=0)
    consumed = check_int("state['consumed']", state.get("consumed"), min=0)
    saved_world = check_int("state['world_size']", state.get("world_size"), min=1)
    saved_drop = state.get("drop_last")
    if not isinstance(saved_drop, bool):
        raise ValueError(f"sampler state has drop_last={saved_drop!r}; not a fastload Sampler state?")
    # The most a run can have consumed: the whole stream, padded to whole steps of the
    # world size it was saved at (a state at the end of an epoch resumes to nothing).
    if epoch_end is None:
        end = max(stream_len, per_rank_count(stream_len, saved_world, saved_drop) * saved_world)
        unit = f"an epoch of {stream_len} stream positions"
    else:
        end = int(epoch_end(epoch, saved_world, saved_drop))
        unit = "its epoch"
    if consumed > end:
        raise ValueError(f"sampler state has consumed={consumed}, beyond the end of {unit} (at most {end} with "
                         f"world_size={saved_world}); the state is damaged or belongs to another dataset")
    return epoch, consumed

"""Per-sample augmentation parameters as pure functions of (seed, epoch, global index).

Random numbers come from a counter-based hash (SplitMix64's finaliser,
:func:`fastload.sampling.streams.splitmix64`, over a 64-bit counter built from seed, epoch,
sample index and draw number), vectorised in numpy: the crop window
and flip of a sample do not depend on the batch it lands in, the rank, the world size or the
thread, so a run resumed on another number of GPUs sees the same pixels.
"""
from __future__ import annotations

import math

import numpy as np

from ..sampling.streams import GOLDEN_GAMMA, MIX_C2, splitmix64


def uniforms(seed: int, epoch: int, index: np.ndarray, draws: int, stream: int = 0) -> np.ndarray:
    """``(len(index), draws)`` float64 uniforms in [0, 1), a pure function of
    (seed, epoch, stream, index, draw number)."""
    idx = np.asarray(index, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        key = splitmix64(np.uint64(seed & 0xFFFFFFFFFFFFFFFF) * GOLDEN_GAMMA + np.uint64(stream))
        key = splitmix64(key ^ (np.uint64(epoch & 0xFFFFFFFFFFFFFFFF) * MIX_C2))
        base = splitmix64(key ^ splitmix64(idx * GOLDEN_GAMMA))  # one key per sample
        ctr = base[:, None] + (np.arange(1, draws + 1, dtype=np.uint64) * GOLDEN_GAMMA)[None, :]
        bits = splitmix64(ctr)
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def random_resized_crop(width: np.ndarray, height: np.ndarray, u: np.ndarray,
                        scale: tuple[float, float], ratio: tuple[float, float], attempts: int = 10):
    """torchvision's ``RandomResizedCrop.get_params``, vectorised over samples.

    ``u`` holds ``4 * attempts`` uniforms per sample (scale, ratio, x, y per attempt). Returns float32 arrays
    ``(x, y, w, h)`` in pixels of the source image (integers, inside the image)."""
    W = np.asarray(width, dtype=np.float64)
    H = np.asarray(height, dtype=np.float64)
    n = len(W)
    area = W * H
    log_r = (math.log(ratio[0]), math.log(ratio[1]))
    x = np.zeros(n)
    y = np.zeros(n)
    w = np.zeros(n)
    h = np.zeros(n)
    done = np.zeros(n, dtype=bool)
    for k in range(attempts):
        target = area * (scale[0] + (scale[1] - scale[0]) * u[:, 4 * k])
        ar = np.exp(log_r[0] + (log_r[1] - log_r[0]) * u[:, 4 * k + 1])
        cw = np.rint(np.sqrt(target * ar))
        ch = np.rint(np.sqrt(target / ar))
        ok = ~done & (cw > 0) & (ch > 0) & (cw <= W) & (ch <= H)
        cx = np.floor(u[:, 4 * k + 2] * (W - cw + 1))
        cy = np.floor(u[:, 4 * k + 3] * (H - ch + 1))
        x = np.where(ok, cx, x)
        y = np.where(ok, cy, y)
        w = np.where(ok, cw, w)
        h = np.where(ok, ch, h)
        done |= ok
    if not done.all():  # fallback: central crop with the ratio clamped into range
        in_r = W / np.maximum(H, 1)
        fw = np.where(in_r < ratio[0], W, np.where(in_r > ratio[1], np.rint(H * ratio[1]), W))
        fh = np.where(in_r < ratio[0], np.rint(W / ratio[0]), H)
        fw = np.clip(fw, 1, W)
        fh = np.clip(fh, 1, H)
        nd = ~done
        w = np.where(nd, fw, w)
        h = np.where(nd, fh, h)
        x = np.where(nd, np.floor((W - fw) / 2), x)
        y = np.where(nd, np.floor((H - fh) / 2), y)
    # positions drawn per attempt may exceed the bounds only through rounding; clamp
    x = np.clip(x, 0, W - w)
    y = np.clip(y, 0, H - h)
    return x.astype(np.float32), y.astype(np.float32), w.astype(np.float32), h.astype(np.float32)


def train_params(seed: int, epoch: int, index: np.ndarray, width: np.ndarray, height: np.ndarray,
                 scale, ratio, flip_p: float):
    """Crop anchors ``(n, 2)`` as (x, y), crop shapes ``(n, 2)`` as (w, h), and flips ``(n,)``."""
    attempts = 10
    u = uniforms(seed, epoch, index, 4 * attempts + 1)
    x, y, w, h = random_resized_crop(width, height, u, scale, ratio, attempts)
    flip = (u[:, -1] < flip_p).astype(np.int32)
    return np.stack([x, y], axis=1), np.stack([w, h], axis=1), flip

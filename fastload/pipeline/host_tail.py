"""The end of the train and eval presets on the CPU, in torch: resize, crop, flip, normalize.

On the CPU, DALI's linear antialiased resize costs about twice its JPEG decode
(bench/dali_stages.py: ~0.48 ms against ~0.25 ms per 224x224 crop of a 300-500 px photo on
this project's machine), while torch's uint8 antialiased bilinear ``interpolate`` — the same
triangle filter, ported from Pillow — resizes the same crop in ~0.12 ms on one thread. So on
the CPU the presets' DALI graph ends at the decoder (ROI decode for ``train``), and the
feeder thread that ran it finishes each image here, writing straight into the batch (a ring
slot): no intermediate batch, no copy. On a GPU the whole graph stays in DALI.

Every function runs in the calling thread: feeders call :func:`one_torch_thread` first, so
torch's ops there use that thread alone (OpenMP's thread count is per thread; the training
loop keeps its own).
"""
from __future__ import annotations

import ctypes
import logging
import re
import threading
from typing import Any, Sequence

import numpy as np

logger = logging.getLogger("fastload")

__all__ = ["one_torch_thread", "finish_batch", "finish_letterbox", "finish_masks", "eval_window"]

_omp_lock = threading.Lock()
_omp: list = []  # the OpenMP runtimes loaded in this process (ctypes), found once


def _openmp() -> list:
    """Every OpenMP runtime loaded in this process (torch's libgomp in Linux wheels; another
    library may have brought its own), as ctypes handles; empty where none is found."""
    with _omp_lock:
        if not _omp:
            libs = []
            try:
                with open("/proc/self/maps") as f:
                    paths = sorted(set(re.findall(r"(/\S*/lib(?:g|i)?omp[^/\s]*\.so[^/\s]*)", f.read())))
            except OSError:  # no /proc (not Linux)
                paths = []
            for p in paths:
                try:
                    lib = ctypes.CDLL(p)  # already loaded: the same handle
                    lib.omp_set_num_threads.argtypes = [ctypes.c_int]
                    libs.append(lib)
                except (OSError, AttributeError):
                    continue
            _omp.append(libs)
        return _omp[0]


def one_torch_thread() -> bool:
    """Make torch's CPU operators called from this thread run on this thread alone, leaving
    the process's setting (the training loop's ``torch.get_num_threads()``) alone:
    ``torch.set_num_threads`` would change the default for every new thread too. True if
    it took effect."""
    import torch

    if torch.get_num_threads() == 1:
        return True
    for lib in _openmp():  # the count is per thread in each runtime: set it in all of them
        lib.omp_set_num_threads(1)
    ok = torch.get_num_threads() == 1
    if not ok:
        logger.debug("fastload: could not limit torch to one thread in %s", threading.current_thread().name)
    return ok


def eval_window(h: int, w: int, resize: int, size: tuple[int, int]) -> tuple[int, int, int, int]:
    """``(resized h, resized w, top, left)`` of the eval preset: the shorter side resized to
    ``resize`` (the longer one rounded, as DALI's ``resize_shorter``), then a center crop of
    ``size`` whose half-pixel margin rounds up (as DALI's ``crop_pos=0.5``)."""
    s = resize / min(h, w)
    nh, nw = (resize, max(resize, int(round(w * s)))) if h <= w else (max(resize, int(round(h * s))), resize)
    ch, cw = size
    return nh, nw, int(np.floor((nh - ch) / 2 + 0.5)), int(np.floor((nw - cw) / 2 + 0.5))


class _Normalizer:
    """Per (dtype, layout, mean, std): writes one resized uint8 image (1, 3, h, w; any
    memory format) into one output row, flipped or not."""

    def __init__(self, dtype: str, layout: str, mean: Sequence[float] | None, std: Sequence[float] | None):
        import torch

        self.layout = layout
        self.float = dtype != "uint8"
        if self.float:
            shape = (3, 1, 1) if layout == "CHW" else (3,)
            m = torch.tensor([255.0 * v for v in mean], dtype=torch.float32).view(shape)
            self.inv = 1.0 / torch.tensor([255.0 * v for v in std], dtype=torch.float32).view(shape)
            self.bias = -m * self.inv
            self.half = dtype == "float16"

    def write(self, img, row, flip: bool, scratch: dict) -> None:
        x = img[0]  # (3, h, w)
        if flip:
            x = x.flip(-1)
        if self.layout == "HWC":
            x = x.permute(1, 2, 0)
        if not self.float:
            row.copy_(x)
            return
        if self.half:  # normalize in float32, then round once to float16
            buf = scratch.get(row.shape)
            if buf is None:
                import torch

                buf = scratch[row.shape] = torch.empty(row.shape, dtype=torch.float32)
            buf.copy_(x)
            buf.mul_(self.inv).add_(self.bias)
            row.copy_(buf)
            return
        import torch

        # one pass, uint8 in, float32 out (x * inv + bias, rounded as the two steps are): about
        # half the time of a copy then an in-place multiply and add over a channels-last source
        torch.addcmul(self.bias, x, self.inv, out=row)


_normalizers: dict[tuple, _Normalizer] = {}


def _normalizer(t) -> _Normalizer:
    key = (t.dtype, t.layout, t.mean, t.std)
    n = _normalizers.get(key)
    if n is None:
        n = _normalizers[key] = _Normalizer(t.dtype, t.layout, t.mean, t.std)
    return n


def finish_batch(transform, decoded, params: dict[str, np.ndarray], out, *,
                 resize_shorter: int | None = None) -> None:
    """Resize (to ``transform.size``; with ``resize_shorter``, the eval preset: the shorter
    side to it, then a center crop of ``transform.size``), flip, normalize and lay out each
    decoded image of ``decoded`` (DALI's output: a batch of HWC uint8 images of any sizes)
    into the rows of ``out`` (a host tensor ``(n, *transform.out_shape)``)."""
    import torch
    from torch.nn.functional import interpolate

    norm = _normalizer(transform)
    flips = params.get("flip")
    size = tuple(transform.size)
    resize = resize_shorter
    scratch: dict[Any, Any] = {}
    for i in range(len(out)):
        hwc = torch.from_dlpack(decoded[i])  # DALI's buffer, zero-copy
        if hwc.ndim != 3 or hwc.shape[2] != 3 or hwc.dtype != torch.uint8:
            raise RuntimeError(f"the decoder produced {tuple(hwc.shape)} {hwc.dtype} for image {i}; "
                               "expected height x width x 3 uint8")
        img = hwc.permute(2, 0, 1).unsqueeze(0)  # (1, 3, h, w), channels-last memory: torch's fast path
        if resize is None:
            if tuple(img.shape[2:]) != size:
                img = interpolate(img, size=size, mode="bilinear", antialias=True, align_corners=False)
        else:
            nh, nw, top, left = eval_window(int(img.shape[2]), int(img.shape[3]), resize, size)
            if (nh, nw) != tuple(img.shape[2:]):
                img = interpolate(img, size=(nh, nw), mode="bilinear", antialias=True, align_corners=False)
            img = img[:, :, top:top + size[0], left:left + size[1]]
        norm.write(img, out[i], bool(flips[i]) if flips is not None else False, scratch)


def finish_letterbox(transform, decoded, params: dict[str, np.ndarray], out) -> None:
    """The detection preset's ``letterbox=True`` on the CPU: each decoded window resized to
    ``(params["resize_y"], params["resize_x"])`` (its aspect kept), normalized into the top-left
    of its zeroed output row, the whole row mirrored where ``params["flip"]`` says (as DALI's
    resize, normalize, pad and flip do on a GPU)."""
    import torch
    from torch.nn.functional import interpolate

    norm = _normalizer(transform)
    flips = params["flip"]
    rh, rw = params["resize_y"], params["resize_x"]
    hwc_out = transform.layout == "HWC"
    width = out.shape[2] if hwc_out else out.shape[3]
    scratch: dict[Any, Any] = {}
    for i in range(len(out)):
        hwc = torch.from_dlpack(decoded[i])
        img = hwc.permute(2, 0, 1).unsqueeze(0)
        h, w = int(rh[i]), int(rw[i])
        if (h, w) != tuple(img.shape[2:]):
            img = interpolate(img, size=(h, w), mode="bilinear", antialias=True, align_corners=False)
        row = out[i]
        row.zero_()
        flip = bool(flips[i])
        cols = slice(width - w, width) if flip else slice(0, w)  # a mirrored row has its image on the right
        region = row[:h, cols, :] if hwc_out else row[:, :h, cols]
        norm.write(img, region, flip, scratch)


def finish_masks(decoded, params: dict[str, np.ndarray], out) -> None:
    """Masks (DALI's decoded windows, ``h x w x 1`` uint8 class ids) resized nearest-neighbour
    to ``out``'s ``(S, S)`` rows (torch's ``nearest-exact``: the source pixel under each output
    pixel's centre, as DALI's ``INTERP_NN``; ids are never blended), mirrored where
    ``params["flip"]`` says, in ``out``'s dtype."""
    import torch
    from torch.nn.functional import interpolate

    flips = params.get("flip")
    size = tuple(out.shape[1:])
    for i in range(len(out)):
        m = torch.from_dlpack(decoded[i])
        if m.ndim != 3 or m.shape[2] != 1:
            raise RuntimeError(f"the mask decoder produced {tuple(m.shape)} for sample {i}; "
                               "expected height x width x 1")
        x = m.permute(2, 0, 1).unsqueeze(0)
        if tuple(x.shape[2:]) != size:
            x = interpolate(x, size=size, mode="nearest-exact")
        x = x[0, 0]
        if flips is not None and flips[i]:
            x = x.flip(-1)
        out[i].copy_(x)

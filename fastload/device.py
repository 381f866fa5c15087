"""Where batches are delivered: the one home of device resolution.

``device=None`` means CUDA when it is available, else the CPU. The CUDA device is the one
the script selected with ``torch.cuda.set_device``; under torchrun, when the script selected
none (the current device is still 0), it is this process's GPU ``LOCAL_RANK`` (modulo the
visible devices) rather than every rank piling onto cuda:0.
"""
from __future__ import annotations

import os
from typing import Any

__all__ = ["default_cuda_index", "resolve_device"]


def default_cuda_index() -> int:
    """The CUDA device index for ``device="cuda"`` / ``None`` (see the module docstring)."""
    import torch

    cur = torch.cuda.current_device()
    local = os.environ.get("LOCAL_RANK")
    if cur == 0 and local is not None and local.strip().isdigit():
        return int(local) % max(1, torch.cuda.device_count())
    return cur


def resolve_device(device: Any):
    """``None`` / ``"cpu"`` / ``"cuda"`` / ``"cuda:N"`` / a ``torch.device`` -> a
    ``torch.device`` with an explicit index for CUDA. ValueError names the bad value."""
    import torch

    if device is None:
        return torch.device("cuda", default_cuda_index()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (TypeError, RuntimeError) as e:
        raise ValueError(f"device={device!r} is not a torch device ({e})") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: fastload delivers to 'cpu' or 'cuda'")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but CUDA is not available here; use device='cpu' (or None)")
        if dev.index is None:
            dev = torch.device("cuda", default_cuda_index())
    return dev

"""The report's verdicts in order: every check of :class:`Facts`, the graphs, and the
no-GPU note when nothing ran on a device."""
from __future__ import annotations

from typing import Callable

from .facts import NO_GPU_NOTE, WARN, Check, Facts
from .gpu import check_dali, check_gpu, check_torch
from .imports import check_import_path
from .limits import check_dataset, check_memlock, check_nofile, check_shm, check_threads, check_torch_threads

CHECKS: tuple[Callable[[Facts], Check | None], ...] = (
    check_import_path, check_gpu, check_torch, check_dali, check_dataset, check_memlock, check_nofile, check_shm,
    check_threads, check_torch_threads)


def assess(f: Facts) -> list[Check]:
    """Every verdict for ``f``, graphs included, and the no-GPU note when nothing ran on one."""
    out = [c for c in (check(f) for check in CHECKS) if c is not None]
    out.extend(f.graphs)
    if f.device == "cuda" and not f.gpu_usable:
        out.append(Check(WARN, "summary", f"{NO_GPU_NOTE}; the CUDA graphs were checked offline (operators and "
                         "placement) and their CPU twins built and run; none was built on a GPU"))
    return out

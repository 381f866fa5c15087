"""Verdicts on the GPU stack: the GPUs and their driver, torch's CUDA build and DALI's, and
whether they fit the driver and each other (pure functions of :class:`Facts`)."""
from __future__ import annotations

from .facts import FAIL, NO_GPU_NOTE, OK, WARN, Check, Facts, _cuda_str


def check_gpu(f: Facts) -> Check:
    if f.device == "cpu" and f.device_chosen:  # no --device, and torch cannot use a GPU here
        if f.gpus:
            return Check(WARN, "gpu", f"the driver sees {len(f.gpus)} GPU(s) but torch {f.torch_version} cannot use "
                         "CUDA" + (" (a CPU-only build)" if f.torch_cuda is None else " (CUDA_VISIBLE_DEVICES?)")
                         + ": checking the CPU path; fastload doctor --device cuda says what to fix")
        return Check(OK, "gpu", "no GPU on this machine: checking the CPU path, which Loader(device=None) uses "
                     "here (--device cuda checks the GPU path)")
    if f.device == "cpu":
        seen = f"{len(f.gpus)} GPU(s) present, unused" if f.gpus else "none needed"
        return Check(OK, "gpu", f"{seen} (--device cpu)")
    if f.driver is None and not f.gpu_usable:
        why = f" ({f.driver_error})" if f.driver_error else ""
        return Check(WARN, "gpu", f"no GPU on this machine: no NVIDIA GPU or driver found{why}, so a job with "
                     "device='cuda' cannot run here (fastload doctor without --device checks the CPU path); "
                     f"{NO_GPU_NOTE}")
    if not f.gpu_usable:
        what = ", ".join(f.gpus) or "no GPU"
        return Check(FAIL, "gpu", f"driver {f.driver} sees {what}, but torch {f.torch_version} cannot use CUDA"
                     + (" (a CPU-only build)" if f.torch_cuda is None else " (check CUDA_VISIBLE_DEVICES)"))
    names = ", ".join(f.gpus) if f.gpus else f"{f.torch_gpus} device(s)"
    drv = f"driver {f.driver}" + (f" (CUDA {_cuda_str(f.driver_cuda)})" if f.driver_cuda else "") if f.driver else \
        "driver version unknown"
    msg = f"{f.torch_gpus} visible: {names}; {drv}"
    if f.local_world_size > f.torch_gpus:
        return Check(WARN, "gpu", f"{msg}; {f.local_world_size} local ranks share {f.torch_gpus} GPU(s) "
                     "(one rank per GPU is the usual layout: torchrun --nproc-per-node "
                     f"{f.torch_gpus})")
    return Check(OK, "gpu", msg)


def check_torch(f: Facts) -> Check:
    if f.device == "cpu":
        return Check(OK, "torch", f"{f.torch_version}" + (f" (CUDA {f.torch_cuda} build)" if f.torch_cuda else ""))
    if f.torch_cuda is None:
        status = FAIL if f.driver is not None else WARN
        return Check(status, "torch", f"{f.torch_version} is a CPU-only build: on a GPU machine install a CUDA "
                     "build (https://pytorch.org/get-started/locally/)")
    msg = f"{f.torch_version}, built for CUDA {f.torch_cuda}"
    if f.driver_cuda:
        major, minor = (int(x) for x in f.torch_cuda.split(".")[:2])
        dmaj, dmin = f.driver_cuda // 1000, (f.driver_cuda % 1000) // 10
        if dmaj < major:
            return Check(FAIL, "torch", f"{msg}, but the driver supports CUDA {dmaj}.{dmin} only: update the "
                         "NVIDIA driver or install a torch built for your CUDA")
        if (dmaj, dmin) < (major, minor):
            return Check(WARN, "torch", f"{msg}; the driver supports CUDA {dmaj}.{dmin}: runs by CUDA's minor "
                         "version compatibility, but kernels JIT-compiled from PTX will not")
    return Check(OK, "torch", msg)


def check_dali(f: Facts) -> Check:
    if f.dali_version is None:
        return Check(FAIL, "dali", f"nvidia.dali cannot be imported ({f.dali_error}); image fields need it: "
                     "pip install nvidia-dali-cuda120")
    msg = f"{f.dali_version}" + (f", a CUDA {f.dali_cuda_major} build" if f.dali_cuda_major else "")
    if f.device == "cpu":
        return Check(OK, "dali", msg + " (CPU operators only with --device cpu)")
    if f.driver_cuda and f.dali_cuda_major and f.driver_cuda // 1000 < f.dali_cuda_major:
        return Check(FAIL, "dali", f"{msg}, but the driver supports CUDA {_cuda_str(f.driver_cuda)}: update the "
                     f"driver or install nvidia-dali-cuda{f.driver_cuda // 1000}0")
    if f.torch_cuda and f.dali_cuda_major and int(f.torch_cuda.split(".")[0]) != f.dali_cuda_major:
        return Check(FAIL, "dali", f"{msg}, torch is built for CUDA {f.torch_cuda}: one process would load two "
                     f"CUDA major versions; install nvidia-dali-cuda{f.torch_cuda.split('.')[0]}0")
    if f.dali_missing_libs:
        return Check(WARN, "dali", f"{msg}; CUDA libraries not found: {', '.join(f.dali_missing_libs)} (some "
                     "GPU operators need them; fastload's presets are checked below; pip install "
                     + " ".join(f"nvidia-{lib.lower()}-cu{f.dali_cuda_major or 12}" for lib in f.dali_missing_libs)
                     + ")")
    return Check(OK, "dali", msg)

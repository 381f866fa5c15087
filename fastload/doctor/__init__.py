"""``fastload doctor [DATASET] [--device cuda|cpu]``: is this machine ready for a long job?

One line per check, each ``ok``, ``warn`` or ``fail``: the GPUs and their driver, the CUDA
builds of torch and DALI and whether they fit the driver and each other, the pinned-memory
limit (``ulimit -l``) against what the ring pins, the open-file limit against the dataset's
shards, ``/dev/shm``, the thread plan of this rank (``LOCAL_WORLD_SIZE`` ranks share the
cores), torch's intra-op threads against fastload's, and every preset's DALI graph for the
device. With a GPU the graphs are built and run on a JPEG on the device; without one the
CUDA graphs are still validated by DALI offline (``fastload.pipeline.offline``), and the
report says plainly that nothing ran on a device. The exit status is 1 if any check fails.

The checks are pure functions of :class:`Facts` (gathered once by :func:`gather`), so each
verdict is unit-tested without the machine it describes.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["Check", "Facts", "add_arguments", "assess", "gather", "main", "run", "run_command"]

OK, WARN, FAIL = "ok", "warn", "fail"
NO_GPU_NOTE = "no GPU: nothing ran on a device"
FD_RESERVE = 64  # descriptors a process needs: Python, torch, DALI, sockets, logs
MAP_RESERVE = 4096  # memory mappings beyond the shards: libraries, allocator arenas, ring slots
SHM_MIN = 1 << 30  # /dev/shm below this breaks NCCL between local ranks (Docker's default is 64 MB)
GiB, MiB = 1 << 30, 1 << 20


@dataclass(frozen=True)
class Check:
    status: str  # "ok" | "warn" | "fail"
    name: str
    message: str

    def line(self) -> str:
        return f"{self.status:<5} {self.name:<17} {self.message}"


@dataclass
class Facts:
    """What the checks look at. ``gather()`` fills it from this machine; tests build it."""

    device: str = "cuda"  # what the job will ask for: "cuda" or "cpu"
    driver: str | None = None  # NVIDIA driver version, None when there is none
    driver_cuda: int | None = None  # the CUDA version the driver supports, e.g. 12040
    gpus: list[str] = field(default_factory=list)  # names NVML reports
    driver_error: str | None = None
    torch_version: str = ""
    torch_cuda: str | None = None  # torch.version.cuda: None for a CPU build
    torch_gpus: int = 0  # torch.cuda.device_count() when torch.cuda.is_available()
    dali_version: str | None = None  # None: DALI cannot be imported
    dali_error: str | None = None
    dali_cuda_major: int | None = None
    dali_missing_libs: list[str] = field(default_factory=list)  # CUDA libraries DALI did not find
    memlock: tuple[int, int] | None = None  # RLIMIT_MEMLOCK (soft, hard); -1 = unlimited
    nofile: tuple[int, int] | None = None  # RLIMIT_NOFILE (soft, hard)
    max_map_count: int | None = None  # vm.max_map_count: memory mappings a process may hold
    shm: tuple[int, int] | None = None  # /dev/shm (total, free) bytes; None when missing
    cores: int = 1
    local_world_size: int = 1
    local_world_size_set: bool = False  # LOCAL_WORLD_SIZE is in the environment
    local_rank: int | None = None
    torch_threads: int = 1
    gather_threads: int = 1  # fastload's plan for this rank
    dali_threads: int = 1
    dataset: str | None = None
    dataset_error: str | None = None
    shards: int | None = None
    samples: int | None = None
    pinned_bytes: int | None = None  # what the ring would page-lock for this dataset
    graphs: list[Check] = field(default_factory=list)  # one per preset, from check_graphs()

    @property
    def gpu_usable(self) -> bool:
        return self.torch_gpus > 0


# -- the verdicts ------------------------------------------------------------------------------
def _cuda_str(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def _bytes(n: int) -> str:
    if n < 0:
        return "unlimited"
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}".replace(".0 ", " ")
    return f"{n} B"


def check_gpu(f: Facts) -> Check:
    if f.device == "cpu":
        seen = f"{len(f.gpus)} GPU(s) present, unused" if f.gpus else "none needed"
        return Check(OK, "gpu", f"{seen} (--device cpu)")
    if f.driver is None and not f.gpu_usable:
        why = f" ({f.driver_error})" if f.driver_error else ""
        return Check(WARN, "gpu", f"no NVIDIA GPU or driver found{why}; {NO_GPU_NOTE}")
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


def check_memlock(f: Facts) -> Check:
    if f.device == "cpu":
        return Check(OK, "pinned memory", "not used with --device cpu")
    if f.memlock is None:
        return Check(WARN, "pinned memory", "cannot read RLIMIT_MEMLOCK (ulimit -l)")
    soft = f.memlock[0]
    limit = _bytes(soft)
    if f.pinned_bytes is None:
        return Check(OK, "pinned memory", f"ulimit -l {limit} (pass a DATASET to compare with the ring's slots)")
    need = f"the ring page-locks up to {_bytes(f.pinned_bytes)}"
    if soft < 0 or soft >= f.pinned_bytes:
        return Check(OK, "pinned memory", f"ulimit -l {limit}; {need}")
    return Check(WARN, "pinned memory", f"ulimit -l {limit} < {need}: page-locking may be refused (the loader "
                 "then falls back to slower pageable copies) and NCCL over InfiniBand needs it unlimited; raise "
                 "it: ulimit -l unlimited (docker run --ulimit memlock=-1)")


def check_nofile(f: Facts) -> Check:
    """Shards are memory-mapped without keeping a file descriptor (``fastload._C.map_file``),
    so ``ulimit -n`` does not bound them: each is one memory mapping, and the limit on those
    is ``vm.max_map_count``."""
    if f.nofile is None:
        return Check(WARN, "open files", "cannot read RLIMIT_NOFILE (ulimit -n)")
    soft, hard = f.nofile
    base = f"ulimit -n {soft}; shards are memory-mapped without keeping a file descriptor"
    if 0 <= soft < FD_RESERVE:
        return Check(WARN, "open files", f"{base}, but {soft} descriptors leave too few for Python, torch, DALI "
                     f"and sockets; raise it: ulimit -n {FD_RESERVE if hard < 0 else min(hard, 4096)}")
    if f.shards is None:
        return Check(OK, "open files", f"{base} (pass a DATASET to compare its shards with vm.max_map_count)")
    need = f.shards + MAP_RESERVE
    msg = f"{base}; the dataset's {f.shards} shard(s) are {f.shards} memory mapping(s)"
    if f.max_map_count is None or need <= f.max_map_count:
        limit = "" if f.max_map_count is None else f" (vm.max_map_count {f.max_map_count})"
        return Check(OK, "open files", msg + limit)
    return Check(WARN, "open files", f"{msg}, more than vm.max_map_count {f.max_map_count} allows with "
                 f"{MAP_RESERVE} for the process; raise it (sysctl -w vm.max_map_count={need * 2}) or convert "
                 "with a larger --shard-size")


def _max_map_count() -> int | None:
    try:
        with open("/proc/sys/vm/max_map_count") as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None


def check_shm(f: Facts) -> Check:
    needs = f.device == "cuda" and f.local_world_size > 1
    why = "NCCL between the local ranks uses it" if needs else "fastload itself does not use it"
    if f.shm is None:
        return Check(WARN if needs else OK, "/dev/shm", f"missing; {why}")
    total, free = f.shm
    msg = f"{_bytes(total)} ({_bytes(free)} free)"
    if needs and total < SHM_MIN:
        return Check(WARN, "/dev/shm", f"{msg}: too small for NCCL between {f.local_world_size} local ranks "
                     "(Docker's default is 64 MB): docker run --shm-size=8g or --ipc=host")
    return Check(OK, "/dev/shm", f"{msg}; {why}")


def check_threads(f: Facts) -> Check:
    per_rank = max(1, f.cores // f.local_world_size)
    rank = f"LOCAL_WORLD_SIZE={f.local_world_size}" + (f", LOCAL_RANK={f.local_rank}" if f.local_rank is not None
                                                       else "")
    msg = (f"{f.cores} usable cores, {rank}: {per_rank} core(s) per rank; fastload starts {f.gather_threads} gather "
           f"+ {f.dali_threads} DALI thread(s) per rank ({DECODE_WORKERS} {f.device.upper()} pipelines)")
    if f.local_rank is not None and not f.local_world_size_set:
        return Check(WARN, "threads", f"{msg}; LOCAL_RANK is set but LOCAL_WORLD_SIZE is not, so every rank sizes "
                     "its threads as if it had the node to itself: export LOCAL_WORLD_SIZE (torchrun does)")
    if per_rank < 2:
        return Check(WARN, "threads", f"{msg}; one core per rank runs the training loop, the gather and DALI's "
                     "host work together: expect the loader to be the bottleneck")
    return Check(OK, "threads", msg)


def check_torch_threads(f: Facts) -> Check:
    per_rank = max(1, f.cores // f.local_world_size)
    msg = f"torch uses {f.torch_threads} intra-op thread(s) per rank"
    if f.torch_threads > per_rank:
        return Check(WARN, "torch threads", f"{msg}, more than the {per_rank} core(s) a rank has: set "
                     f"OMP_NUM_THREADS={per_rank} (or torch.set_num_threads({per_rank}))")
    if f.device == "cpu" and f.torch_threads + f.gather_threads + f.dali_threads > 2 * per_rank:
        return Check(WARN, "torch threads", f"{msg}; with fastload's {f.gather_threads + f.dali_threads} the "
                     f"training step and the loader fight for {per_rank} core(s): lower one of them")
    return Check(OK, "torch threads", f"{msg} ({per_rank} core(s) per rank)")


def check_dataset(f: Facts) -> Check | None:
    if f.dataset is None:
        return None
    if f.dataset_error is not None:
        return Check(FAIL, "dataset", f"{f.dataset}: {f.dataset_error}")
    return Check(OK, "dataset", f"{f.dataset}: {f.samples:,} samples in {f.shards} shard(s)")


CHECKS: tuple[Callable[[Facts], Check | None], ...] = (
    check_gpu, check_torch, check_dali, check_dataset, check_memlock, check_nofile, check_shm, check_threads,
    check_torch_threads)


def assess(f: Facts) -> list[Check]:
    """Every verdict for ``f``, graphs included, and the no-GPU note when nothing ran on one."""
    out = [c for c in (check(f) for check in CHECKS) if c is not None]
    out.extend(f.graphs)
    if f.device == "cuda" and not f.gpu_usable:
        out.append(Check(WARN, "summary", f"{NO_GPU_NOTE}; the CUDA graphs were validated offline only"))
    return out


# -- the preset graphs -------------------------------------------------------------------------
def presets() -> dict[str, Any]:
    from .. import vision

    return {"train": vision.train(224), "train-uint8": vision.train(224, dtype="uint8", layout="HWC"),
            "eval": vision.eval(224), "eval-fp16": vision.eval(224, dtype="float16")}


def check_graphs(device: str, gpu_usable: bool, device_id: int | None = None) -> list[Check]:
    """Each preset's graph: validated offline for ``device`` (DALI's checks, operator
    placement) and, on the CPU or a usable GPU, built and run on a valid JPEG."""
    from ..pipeline import offline

    out = []
    for name, t in presets().items():
        label = f"graph {name}"
        try:
            report = offline.check(t, device=device)
        except Exception as e:  # DALI refused the graph
            out.append(Check(FAIL, label, f"DALI rejects the {device} graph: {_first_line(e)}"))
            continue
        problems = report.problems()
        if problems:
            out.append(Check(FAIL, label, "; ".join(problems)))
            continue
        where = report.summary()
        if device == "cuda" and not gpu_usable:
            out.append(Check(OK, label, f"CUDA graph valid (offline): {where}"))
            continue
        runner = t.runner(device=device, batch_size=2, num_threads=1, device_id=device_id)
        try:
            err = runner._canary_error()
        finally:
            runner.close()
        on = f"cuda:{device_id}" if device == "cuda" else "the CPU"
        if err is not None:
            out.append(Check(FAIL, label, f"fails on a valid JPEG on {on}: {err}"))
        else:
            out.append(Check(OK, label, f"built and ran a JPEG on {on}: {where}"))
    return out


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:300]


# -- gathering the facts -----------------------------------------------------------------------
def _nvml() -> tuple[str | None, int | None, list[str], str | None]:
    """(driver version, CUDA driver version, GPU names, error) from NVML, without CUDA."""
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        version = None
        try:
            with open("/proc/driver/nvidia/version") as fh:
                version = fh.readline().split("Kernel Module")[-1].split()[0]
        except (OSError, IndexError):
            pass
        return version, None, [], None if version else "libnvidia-ml.so.1 not found"
    if lib.nvmlInit_v2() != 0:
        return None, None, [], "nvmlInit failed (driver not loaded?)"
    try:
        buf = ctypes.create_string_buffer(96)
        driver = buf.value.decode() if lib.nvmlSystemGetDriverVersion(buf, 96) == 0 else None
        v = ctypes.c_int()
        cuda = v.value if lib.nvmlSystemGetCudaDriverVersion_v2(ctypes.byref(v)) == 0 else None
        n = ctypes.c_uint()
        names = []
        if lib.nvmlDeviceGetCount_v2(ctypes.byref(n)) == 0:
            for i in range(n.value):
                h = ctypes.c_void_p()
                if lib.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(h)) == 0 and \
                        lib.nvmlDeviceGetName(h, buf, 96) == 0:
                    names.append(buf.value.decode())
        return driver, cuda, names, None
    finally:
        lib.nvmlShutdown()


def _rlimit(name: str) -> tuple[int, int] | None:
    try:
        import resource

        soft, hard = resource.getrlimit(getattr(resource, name))
        inf = resource.RLIM_INFINITY
        return (-1 if soft == inf else int(soft), -1 if hard == inf else int(hard))
    except (ImportError, AttributeError, OSError, ValueError):  # pragma: no cover - not Linux
        return None


def _shm() -> tuple[int, int] | None:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


DECODE_WORKERS = 2  # image feeder workers per Loader (host and CUDA), each with its own DALI pipeline


def _thread_plan(f: Facts) -> None:
    """fastload's per-rank threads, from the functions the Loader sizes them with."""
    from ..loader.options import default_gather_threads
    from ..pipeline import default_threads as dali_default

    f.gather_threads = default_gather_threads()
    f.dali_threads = DECODE_WORKERS * dali_default(f.device)


def _dataset(f: Facts, batch_size: int) -> None:
    """Shards, samples and the ring's page-locked bytes for this dataset (CUDA: raw fields
    only; DALI hands images over on the device)."""
    import numpy as np

    from ..store import Dataset

    try:
        ds = Dataset(f.dataset)
    except Exception as e:  # FormatError, FileNotFoundError, ...
        f.dataset_error = _first_line(e)
        return
    f.shards, f.samples = ds.num_shards, len(ds)
    raw = [fl for fl in ds.fields.values() if fl.fixed]
    row = sum(fl.np_dtype.itemsize * int(np.prod(fl.shape)) for fl in raw) + 8  # + the int64 index
    from ..loader.options import default_prefetch

    batch = batch_size * row
    slots = max(default_prefetch(f.gather_threads, batch) + 2, 3)
    f.pinned_bytes = slots * batch


def gather(device: str = "cuda", dataset: str | None = None, batch_size: int = 256) -> Facts:
    import torch

    from ..system import local_world_size, usable_cores

    f = Facts(device=device, dataset=dataset)
    f.driver, f.driver_cuda, f.gpus, f.driver_error = _nvml()
    f.torch_version, f.torch_cuda = torch.__version__, torch.version.cuda
    f.torch_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        import nvidia.dali as dali
        from nvidia.dali import backend

        f.dali_version = dali.__version__
        f.dali_cuda_major = int(str(dali.__cuda_version__)[:2])
        f.dali_missing_libs = [lib for lib, v in (("NPP", backend.GetNppVersion()),
                                                  ("cuFFT", backend.GetCufftVersion())) if v == -1]
    except Exception as e:  # ImportError, or a broken install
        f.dali_error = _first_line(e)
    f.memlock, f.nofile, f.shm = _rlimit("RLIMIT_MEMLOCK"), _rlimit("RLIMIT_NOFILE"), _shm()
    f.max_map_count = _max_map_count()
    f.cores, f.local_world_size = usable_cores(), local_world_size()
    f.local_world_size_set = bool(os.environ.get("LOCAL_WORLD_SIZE", "").strip())
    lr = os.environ.get("LOCAL_RANK", "").strip()
    f.local_rank = int(lr) if lr.isdigit() else None
    f.torch_threads = torch.get_num_threads()
    _thread_plan(f)
    if dataset is not None:
        _dataset(f, batch_size)
    if f.dali_version is not None:
        dev_id = None
        if device == "cuda" and f.gpu_usable:
            from ..device import resolve_device, select

            dev_id = resolve_device("cuda").index  # the GPU a Loader of this rank would use
            select(dev_id)  # and nothing of this process on another one
        f.graphs = check_graphs(device, f.gpu_usable, dev_id)
    return f


def run(device: str = "cuda", dataset: str | None = None, batch_size: int = 256, out=None) -> int:
    """Print the report; 1 if any check failed, else 0."""
    out = out or sys.stdout
    checks = assess(gather(device, dataset, batch_size))
    print(f"fastload doctor: --device {device}" + (f", dataset {dataset}" if dataset else ""), file=out)
    for c in checks:
        print(c.line(), file=out)
    fails = sum(c.status == FAIL for c in checks)
    warns = sum(c.status == WARN for c in checks)
    print(f"{fails} fail, {warns} warn, {len(checks) - fails - warns} ok", file=out)
    return 1 if fails else 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command's arguments (standard library only: ``fastload --help`` loads no torch)."""
    p.add_argument("dataset", nargs="?", default=None, help="a dataset to check the limits against")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="the device the job will use "
                   "(default cuda)")
    p.add_argument("--batch-size", type=int, default=256, help="batch size of the job (default 256), for the "
                   "ring's pinned memory")


def run_command(a: argparse.Namespace, out) -> int:
    """``fastload doctor`` (``fastload.cli``): the report on ``out.text``."""
    from ..errors import UsageError

    if a.batch_size < 1:
        raise UsageError(f"--batch-size={a.batch_size} must be >= 1", code=2)
    return run(a.device, a.dataset, a.batch_size, out=out.text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fastload doctor", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    a = p.parse_args(argv)
    if a.batch_size < 1:
        p.error(f"--batch-size={a.batch_size} must be >= 1")
    return run(a.device, a.dataset, a.batch_size)

"""What the checks look at and what they say: :class:`Facts` (one machine, as data),
:class:`Check` (one verdict), the statuses, the thresholds, and the formatting helpers the
messages share."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import format_bytes
from ..runtime.system import IMAGE_FEEDERS, LOADER_NICE

OK, WARN, FAIL = "ok", "warn", "fail"
NO_GPU_NOTE = "no GPU: nothing ran on a device"
FD_RESERVE = 64  # descriptors a process needs: Python, torch, DALI, sockets, logs
MAP_RESERVE = 4096  # memory mappings beyond the shards: libraries, allocator arenas, ring slots
SHM_MIN = 1 << 30  # /dev/shm below this breaks NCCL between local ranks (Docker's default is 64 MB)
GiB, MiB = 1 << 30, 1 << 20
DECODE_WORKERS = IMAGE_FEEDERS  # image feeder workers per Loader (host and CUDA), each with its own DALI pipeline


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
    device_chosen: bool = False  # no --device: doctor chose it as Loader(device=None) does (cuda if usable)
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
    local_world_size_set: bool = False  # LOCAL_WORLD_SIZE is set (a positive integer)
    local_rank: int | None = None
    world_size: int | None = None  # WORLD_SIZE (torchrun's), None when unset
    torch_threads: int = 1
    gather_threads: int = 1  # fastload's plan for this rank
    dali_threads: int = 1
    loader_nice: int = LOADER_NICE  # the nice value of fastload's threads (FASTLOAD_NICE)
    loader_nice_error: str | None = None  # FASTLOAD_NICE is malformed
    dataset: str | None = None
    import_shadow: list[str] = field(default_factory=list)  # a namespace 'fastload' python in cwd would import
    cwd: str | None = None
    dataset_error: str | None = None
    shards: int | None = None
    samples: int | None = None
    pinned_bytes: int | None = None  # what the ring would page-lock for this dataset
    graphs: list[Check] = field(default_factory=list)  # one per preset, from check_graphs()

    @property
    def gpu_usable(self) -> bool:
        return self.torch_gpus > 0


def _cuda_str(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def _bytes(n: int) -> str:
    """A limit as ``ulimit`` shows it: powers of 1024, or "unlimited" (RLIM_INFINITY, -1)."""
    return "unlimited" if n < 0 else format_bytes(n, binary=True)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:300]

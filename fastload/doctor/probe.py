"""Gathering the :class:`Facts` of this machine: NVML, torch, DALI, the resource limits,
``/dev/shm``, the thread plan of this rank, the dataset, and the preset graphs' checks."""
from __future__ import annotations

import ctypes
import os

from .facts import DECODE_WORKERS, Facts, _first_line
from .graphs import check_graphs
from .imports import probe_shadow


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


def _max_map_count() -> int | None:
    try:
        with open("/proc/sys/vm/max_map_count") as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None


def _shm() -> tuple[int, int] | None:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def _thread_plan(f: Facts) -> None:
    """fastload's per-rank threads, from the functions the Loader sizes them with."""
    from ..errors import UsageError
    from ..pipeline import default_threads as dali_default
    from ..ring.size import default_gather_threads
    from ..runtime.system import loader_nice

    f.gather_threads = default_gather_threads()
    f.dali_threads = DECODE_WORKERS * dali_default(f.device)
    try:
        f.loader_nice = loader_nice()
    except UsageError as e:
        f.loader_nice_error = str(e)


def _dataset(f: Facts, batch_size: int) -> None:
    """Shards, samples and the ring's page-locked bytes for this dataset (CUDA: raw fields
    and the index only; DALI hands images over on the device, and with image fields the
    Loader keeps at most 3 batches in flight: ``default_cuda_image_prefetch``)."""
    import numpy as np

    from ..store import Dataset

    try:
        ds = Dataset(f.dataset)
    except Exception as e:  # FormatError, FileNotFoundError, ...
        f.dataset_error = _first_line(e)
        return
    f.shards, f.samples = ds.num_shards, len(ds)
    from ..ring.size import batch_bytes, default_cuda_image_prefetch, default_prefetch, ring_slots

    raw = [fl for fl in ds.fields.values() if fl.fixed]
    batch = batch_bytes(batch_size, sum(fl.np_dtype.itemsize * int(np.prod(fl.shape)) for fl in raw))  # + the index
    images = any(fl.kind == "image" for fl in ds.fields.values())
    prefetch = default_cuda_image_prefetch(1) if images else default_prefetch(f.gather_threads, batch)  # 1: the most
    f.pinned_bytes = ring_slots(prefetch) * batch


def gather(device: str | None = None, dataset: str | None = None, batch_size: int = 256) -> Facts:
    """The facts of this machine for a job on ``device``; ``None`` (no ``--device``) picks the
    device as ``Loader(device=None)`` does: CUDA when torch can use a GPU, else the CPU."""
    import torch

    from ..runtime.system import usable_cores
    from ..runtime.world import local_env

    chosen = device is None
    if chosen:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    f = Facts(device=device, dataset=dataset, device_chosen=chosen)
    f.cwd = os.getcwd()
    f.import_shadow = probe_shadow(f.cwd) or []
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
    f.local_rank, lws = local_env()
    ws = os.environ.get("WORLD_SIZE", "").strip()
    f.world_size = int(ws) if ws.isdigit() and int(ws) > 0 else None
    f.cores, f.local_world_size, f.local_world_size_set = usable_cores(), lws or 1, lws is not None
    f.torch_threads = torch.get_num_threads()
    _thread_plan(f)
    if dataset is not None:
        _dataset(f, batch_size)
    if f.dali_version is not None:
        dev_id = None
        if device == "cuda" and f.gpu_usable:
            from ..runtime.device import resolve_device, select

            dev_id = resolve_device("cuda").index  # the GPU a Loader of this rank would use
            select(dev_id)  # and nothing of this process on another one
        f.graphs = check_graphs(device, f.gpu_usable, dev_id)
    return f

"""``fastload doctor [DATASET] [--device cuda|cpu]``: is this machine ready for a long job?
Without ``--device`` it checks the device ``Loader(device=None)`` would use (CUDA when torch
can use a GPU, else the CPU path); ``--device cuda`` on a machine without a GPU says so plainly.

One line per check, each ``ok``, ``warn`` or ``fail``: the GPUs and their driver, the CUDA
builds of torch and DALI and whether they fit the driver and each other, the pinned-memory
limit (``ulimit -l``) against what the ring pins, the open-file limit against the dataset's
shards, ``/dev/shm``, the thread plan of this rank (``LOCAL_WORLD_SIZE`` ranks share the
cores), torch's intra-op threads against fastload's, and every preset's DALI graph for the
device. Each graph line says what was done (``graphs``): checked offline by DALI (operators
and placement), its CPU twin (the whole graph in DALI on the CPU) built and run on a batch of
JPEGs with the output checked against the declared shape and dtype, and, on the CPU or a GPU,
the graph itself built and run on a JPEG there; without a GPU it says ``not built on a GPU
(no GPU)``, and the report says plainly that nothing ran on a device. The memlock check
names what NCCL over InfiniBand needs (unlimited) and warns for a job across nodes. The exit
status is 1 if any check fails.

The checks are pure functions of :class:`Facts` (gathered once by :func:`gather`), so each
verdict is unit-tested without the machine it describes.

The package: ``facts`` (:class:`Facts`, :class:`Check`, the thresholds), ``gpu`` and
``limits`` (the verdicts), ``graphs`` (the preset DALI graphs), ``probe`` (:func:`gather`),
``imports`` (a clone that shadows the package), ``report`` (:func:`assess`); the command's entry points are here.
"""
from __future__ import annotations

import argparse
import sys

from . import probe
from .facts import (DECODE_WORKERS, FAIL, FD_RESERVE, MAP_RESERVE, NO_GPU_NOTE, OK, SHM_MIN, WARN, Check, Facts, GiB,
                    MiB)
from .gpu import check_dali, check_gpu, check_torch
from .graphs import check_graphs, presets
from .limits import check_dataset, check_memlock, check_nofile, check_shm, check_threads, check_torch_threads
from .probe import gather
from .report import CHECKS, assess

__all__ = ["CHECKS", "DECODE_WORKERS", "FAIL", "FD_RESERVE", "MAP_RESERVE", "NO_GPU_NOTE", "OK", "SHM_MIN", "WARN",
           "Check", "Facts", "GiB", "MiB", "add_arguments", "assess", "check_dali", "check_dataset", "check_gpu",
           "check_graphs", "check_memlock", "check_nofile", "check_shm", "check_threads", "check_torch",
           "check_torch_threads", "gather", "main", "presets", "run", "run_command"]

_nvml = probe._nvml  # is there an NVIDIA driver (tests ask doctor._nvml())


def run(device: str | None = None, dataset: str | None = None, batch_size: int = 256, out=None) -> int:
    """Print the report; 1 if any check failed, else 0. ``device=None`` checks the device a
    ``Loader(device=None)`` would use here: CUDA when torch can use a GPU, else the CPU."""
    out = out or sys.stdout
    facts = gather(device, dataset, batch_size)
    checks = assess(facts)
    head = f"--device {facts.device}"
    if facts.device_chosen:
        head += " (no --device: a GPU is usable)" if facts.device == "cuda" else \
            " (no --device and no usable GPU: the CPU path; --device cuda checks the GPU path)"
    print(f"fastload doctor: {head}" + (f", dataset {dataset}" if dataset else ""), file=out)
    for c in checks:
        print(c.line(), file=out)
    fails = sum(c.status == FAIL for c in checks)
    warns = sum(c.status == WARN for c in checks)
    print(f"{fails} fail, {warns} warn, {len(checks) - fails - warns} ok", file=out)
    return 1 if fails else 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command's arguments (standard library only: ``fastload --help`` loads no torch)."""
    p.add_argument("dataset", nargs="?", default=None, help="a dataset to check the limits against")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="the device the job will use "
                   "(default: the one Loader(device=None) picks, cuda when torch can use a GPU, else cpu)")
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

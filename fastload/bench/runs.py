"""The runs of ``fastload bench``: the fastload Loader, torch's DataLoader doing the same
work (:mod:`fastload.bench.baseline`), and the hardware limit of the workload (memcpy of the
same bytes for raw fields, the same DALI graph alone on the same encoded bytes for images).

Each run takes the dataset path and the validated :class:`fastload.bench.cli.BenchOptions`
and returns a :class:`fastload.bench.report.Measurement`; :func:`run` makes the whole report.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from .report import Measurement, machine_info

__all__ = ["run", "run_fastload", "run_limit", "run_torch", "transform_for"]


def transform_for(name: str):
    """The fastload transform of a ``--transform`` name (None for "none")."""
    from .. import vision

    makers = {"train224": lambda: vision.train(224), "eval224": lambda: vision.eval(224, resize=256),
              "none": lambda: None}
    if name not in makers:
        raise ValueError(f"transform={name!r} must be one of {', '.join(makers)}")
    return makers[name]()


def _image_fields(ds) -> list[str]:
    return [n for n, f in ds.fields.items() if f.kind == "image"]


def _raw_fields(ds) -> list[str]:
    return [n for n, f in ds.fields.items() if f.kind in ("tensor", "scalar")]


def _batch_bytes(batch: dict) -> int:
    import torch
    return sum(int(v.element_size() * v.nelement()) for v in batch.values() if isinstance(v, torch.Tensor))


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm as _tqdm

    class Bar(_tqdm):
        monitor_interval = 0  # no monitor thread

    return Bar(total=total, desc=desc, unit="batch", disable=not enabled, leave=False, dynamic_ncols=True)


def _warm_up(loader, batches: int) -> float:
    """Cold time to the first batch (pipeline build, worker start-up), then ``batches``
    batches untimed so that the measured epochs see the steady state."""
    t0 = time.perf_counter()
    it = iter(loader)
    first = None
    for _ in range(max(1, batches)):
        try:
            next(it)
        except StopIteration:
            break
        if first is None:
            first = time.perf_counter() - t0
    del it
    return first if first is not None else 0.0


def _timed_loop(it, step_s: float, max_batches: int | None, bar) -> tuple[int, int, float, float]:
    """(samples, bytes, seconds, seconds waiting in next()) of one epoch."""
    batches = samples = nbytes = 0
    wait = 0.0
    t0 = time.perf_counter()
    it = iter(it)
    while max_batches is None or batches < max_batches:
        t1 = time.perf_counter()
        try:
            b = next(it)
        except StopIteration:
            break
        wait += time.perf_counter() - t1
        batches += 1
        samples += len(next(iter(b.values())))
        nbytes += _batch_bytes(b)
        bar.update(1)
        if step_s:
            time.sleep(step_s)  # the simulated training step
    return samples, nbytes, time.perf_counter() - t0, wait


def run_fastload(path, o) -> Measurement:
    """Epochs of ``fastload.Loader`` over the dataset (rank 0 of ``o.world_size``)."""
    from ..loader import Loader
    from ..store import Dataset

    ds = Dataset(path)
    images = _image_fields(ds)
    fields = _raw_fields(ds)
    transforms = {}
    if o.transform != "none" and images:
        transforms = {images[0]: transform_for(o.transform)}
        fields.append(images[0])
    device = None if o.device == "auto" else o.device  # the Loader resolves "auto"
    loader = Loader(ds, batch_size=o.batch_size, device=device, rank=0, world_size=o.world_size,
                    fields=fields, transforms=transforms, threads=o.threads, seed=0)
    try:
        res = Measurement("fastload Loader", 0, 0, 0.0, "ours",
                          note=f"device={loader.device.type}, threads={loader.threads}")
        res.extra["device"] = loader.device.type
        res.first_batch_s = _warm_up(loader, o.warmup)
        total = sum(min(len(loader), o.max_batches or len(loader)) for _ in range(o.epochs))
        stages = {"gather_s": 0.0, "decode_s": 0.0, "copy_s": 0.0}
        wait = 0.0
        with _progress(total, "fastload", o.progress) as bar:
            for e in range(o.epochs):
                loader.set_epoch(e)
                n, nb, sec, w = _timed_loop(loader, o.step_ms / 1e3, o.max_batches, bar)
                s = loader.stats()
                for k in stages:
                    stages[k] += s["stages"][k]
                res.samples += n
                res.nbytes += nb
                res.seconds += sec
                wait += w
        res.wait_fraction = wait / res.seconds if res.seconds else 0.0
        res.stages = stages
        return res
    finally:
        loader.close()


def run_torch(path, o, workers: int) -> Measurement:
    """Epochs of ``torch.utils.data.DataLoader`` over ``fastload.Dataset`` with
    ``num_workers=workers``, doing the same work (PIL decode and the same augmentation)."""
    import torch
    from torch.utils.data import DataLoader, DistributedSampler

    from ..store import Dataset
    from .baseline import EpochSampler, ImageCollate, PILImageWork, TaggedDataset

    ds = Dataset(path)
    images = _image_fields(ds)
    keep = tuple(_raw_fields(ds))
    sampler = DistributedSampler(ds, num_replicas=o.world_size, rank=0, shuffle=True, seed=0)
    collate: Callable[[list], Any]
    source: Any = ds
    if o.transform != "none" and images:
        sampler = EpochSampler(sampler)  # each sample's (epoch, index) picks its crop, as in the Loader
        source = TaggedDataset(ds)
        collate = ImageCollate(images[0], PILImageWork(transform_for(o.transform), seed=0))
        note = "PIL decode + the same augmentation"
    else:
        def collate(samples, keep=keep):  # the default collate on the kept fields
            return {k: torch.as_tensor(np.stack([s[k] for s in samples])) for k in keep}
        note = "fastload.Dataset"
    dl = DataLoader(source, batch_size=o.batch_size, sampler=sampler, num_workers=workers, collate_fn=collate,
                    persistent_workers=workers > 0, pin_memory=False)
    res = Measurement(f"DataLoader num_workers={workers}", 0, 0, 0.0, "dataloader", note=note)
    res.first_batch_s = _warm_up(dl, o.warmup)  # starts the (persistent) workers
    wait = 0.0
    total = sum(min(len(dl), o.max_batches or len(dl)) for _ in range(o.epochs))
    with _progress(total, f"torch w={workers}", o.progress) as bar:
        for e in range(o.epochs):
            sampler.set_epoch(e)
            it = iter(dl)
            try:
                n, nb, sec, w = _timed_loop(it, o.step_ms / 1e3, o.max_batches, bar)
            finally:
                del it
            res.samples += n
            res.nbytes += nb
            res.seconds += sec
            wait += w
    del dl  # persistent workers exit here
    res.wait_fraction = wait / res.seconds if res.seconds else 0.0
    return res


def _dali_args(ds, name: str, idx: np.ndarray) -> tuple:
    w, h = ds.image_sizes(name, idx)
    return ds.views(name, idx), w, h, idx, 0


def run_limit(path, o, device: str, nbytes_per_sample: float, samples: int) -> Measurement | None:
    """memcpy of the same bytes (raw fields) or the same DALI graph alone on the same encoded
    bytes (images); None when there is nothing to copy."""
    from ..store import Dataset

    ds = Dataset(path)
    images = _image_fields(ds)
    if o.transform != "none" and images:
        name = images[0]
        runner = transform_for(o.transform).runner(device=device, batch_size=o.batch_size, seed=0)
        order = np.random.default_rng(0).permutation(len(ds))[:samples]
        try:
            runner.run(*_dali_args(ds, name, order[:o.batch_size]))  # warm-up: build the graph
            t0 = time.perf_counter()
            for s in range(0, len(order), o.batch_size):
                runner.run(*_dali_args(ds, name, order[s:s + o.batch_size]))
            sec = time.perf_counter() - t0
        finally:
            runner.close()
        return Measurement("DALI alone (same graph, same bytes)", len(order), int(nbytes_per_sample * len(order)),
                           sec, "limit")
    nb = int(nbytes_per_sample * o.batch_size)
    if nb == 0:
        return None
    src = np.ones(max(nb * 64, 1 << 26) // nb * nb, np.uint8)
    dst = np.empty(nb, np.uint8)
    reps = max(1, samples // o.batch_size)
    t0 = time.perf_counter()
    for r in range(reps):
        off = (r * nb) % (len(src) - nb + 1)
        np.copyto(dst, src[off:off + nb])
    sec = time.perf_counter() - t0
    return Measurement("memcpy of the same bytes", reps * o.batch_size, reps * nb, sec, "limit")


def run(path, o) -> dict:
    """Every run the options ask for; returns the report (JSON-ready): title, machine,
    dataset, settings, results (``Measurement.as_dict()``) and what was not measured."""
    import dataclasses

    import torch

    from ..store import Dataset

    ds = Dataset(path)
    if o.transform != "none" and not _image_fields(ds):
        o = dataclasses.replace(o, transform="none")
    not_measured = []
    if not torch.cuda.is_available():
        not_measured.append("the GPU path (device='cuda': nvJPEG/mixed decoding, pinned-memory copies): "
                            "no CUDA GPU on this machine")
    ours = run_fastload(path, o)
    device = ours.extra["device"]  # what the Loader chose for "auto"
    results = [ours]
    if o.compare == "torch":
        results += [run_torch(path, o, w) for w in o.workers]
    if o.limit:
        per = ours.nbytes / ours.samples if ours.samples else 0
        lim = run_limit(path, o, device, per, ours.samples)
        if lim is not None:
            results.append(lim)
    title = (f"fastload bench {ds.path.name}: {len(ds):,} samples, batch {o.batch_size}, transform {o.transform}, "
             f"device {device}, rank 0 of {o.world_size}")
    settings = {k: v for k, v in dataclasses.asdict(o).items() if k != "progress"}
    settings["device"] = device
    settings["workers"] = list(o.workers)
    return {"title": title, "machine": machine_info(),
            "dataset": {"path": str(ds.path), "samples": len(ds), "fields": {n: f.kind for n, f in ds.fields.items()},
                        "shards": ds.num_shards},
            "settings": settings, "results": [r.as_dict() for r in results], "not_measured": not_measured}

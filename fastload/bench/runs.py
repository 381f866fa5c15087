"""The runs of ``fastload bench``: the fastload Loader, torch's DataLoader doing the same
work (:mod:`fastload.bench.baseline`), and the hardware limit of the workload (memcpy of the
same bytes for raw fields, the transform's whole graph in DALI alone on the same encoded bytes
for images).

Each run takes the dataset path and the validated :class:`fastload.bench.cli.BenchOptions`
and returns a :class:`fastload.bench.report.Measurement`; :func:`run` makes the whole report.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from .report import Measurement, machine_info

__all__ = ["Step", "run", "run_fastload", "run_limit", "run_torch", "second_epoch_rate", "transform_for"]


def second_epoch_rate(loader, key: str) -> float:
    """Samples per second of ``loader``'s second epoch, counted by ``batch[key]``'s rows (the
    first epoch builds and warms its pipelines and decoders); on a CUDA loader each batch is
    waited for (``torch.cuda.synchronize``)."""
    cuda = loader.device.type == "cuda"
    for epoch in range(2):
        loader.set_epoch(epoch)
        t0, n = time.perf_counter(), 0
        for b in loader:
            n += len(b[key])
            if cuda:
                import torch

                torch.cuda.synchronize()
    return n / (time.perf_counter() - t0)


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


def _warm_up(loader, batches: int, step: Step | None = None,
             to_device: Callable[[dict], dict] | None = None) -> float:
    """Cold time to the first batch (pipeline build, worker start-up), then ``batches``
    batches untimed so that the measured epochs see the steady state; a real training step
    (``step.model``) runs on them too, so that its model is made and torch's one-time set-up
    is paid before the clock starts."""
    t0 = time.perf_counter()
    it = iter(loader)
    first = None
    for _ in range(max(1, batches)):
        try:
            b = next(it)
        except StopIteration:
            break
        if first is None:
            first = time.perf_counter() - t0
        if step is not None and step.model is not None:
            step.model(to_device(b) if to_device is not None else b)
    del it
    return first if first is not None else 0.0


class Step:
    """The training step after each batch: ``model`` (a :class:`fastload.bench.models.ModelStep`:
    a real forward + backward + SGD step on the batch, ``--step mlp|cnn``), or a simulated one.
    Simulated, on the CPU: ``step_s`` of sleep (the cores stay idle, so it shows whether
    loading keeps up, not how the loader and torch's threads share the cores). On a CUDA
    device: ``step_s`` of GPU work (``torch.cuda._sleep``, calibrated once) enqueued on the
    current stream, as a real step is, so that a loader that waits for the training stream (a
    blocking copy, a host sync) shows it; and ``finish()`` waits for the device, so the clock
    of an epoch includes the GPU work its batches caused."""

    def __init__(self, step_s: float, device=None, model=None):
        self.step_s = step_s
        self.model = model
        self.device = device if device is not None and getattr(device, "type", None) == "cuda" else None
        self.cycles = _gpu_sleep_cycles(step_s, self.device) if self.device is not None and step_s else 0

    def __call__(self, batch: dict | None = None) -> None:
        if self.model is not None:
            self.model(batch)
            return
        if not self.step_s:
            return
        if self.device is None:
            time.sleep(self.step_s)
            return
        import torch

        torch.cuda._sleep(self.cycles)

    def finish(self) -> None:
        if self.device is not None:
            import torch

            torch.cuda.synchronize(self.device)


def _gpu_sleep_cycles(seconds: float, device) -> int:
    """``torch.cuda._sleep`` cycles that keep ``device`` busy for ``seconds`` (measured)."""
    import torch

    probe = 1 << 22
    with torch.cuda.device(device):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True, blocking=True)
        torch.cuda._sleep(probe)  # warm-up: the kernel loaded
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end)
    return max(1, round(probe * seconds * 1e3 / ms)) if ms > 0 else probe


def _timed_loop(it, step: Step, max_batches: int | None, bar,
                to_device: Callable[[dict], dict] | None = None) -> tuple[int, int, float, float]:
    """(samples, bytes, seconds, seconds waiting in next()) of one epoch. ``to_device``: what
    a training loop does with a host batch before its step (the DataLoader on CUDA)."""
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
        if to_device is not None:
            b = to_device(b)
        wait += time.perf_counter() - t1
        batches += 1
        samples += len(next(iter(b.values())))
        nbytes += _batch_bytes(b)
        bar.update(1)
        step(b)  # the training step (real or simulated)
    step.finish()  # the epoch ends when the device has done its work
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
        res.extra["torch_device"] = str(loader.device)
        step = Step(o.step_ms / 1e3, loader.device, model_step(o, ds, images[0] if images else None))
        res.first_batch_s = _warm_up(loader, o.warmup, step)
        total = sum(min(len(loader), o.max_batches or len(loader)) for _ in range(o.epochs))
        stages = {"gather_s": 0.0, "decode_s": 0.0, "copy_s": 0.0}
        wait = 0.0
        with _progress(total, "fastload", o.progress) as bar:
            for e in range(o.epochs):
                loader.set_epoch(e)
                n, nb, sec, w = _timed_loop(loader, step, o.max_batches, bar)
                if sec > 0:
                    res.round_rates.append(n / sec)  # each epoch's rate: the row's spread
                s = loader.stats()
                for k in stages:
                    stages[k] += s["stages"][k]
                res.samples += n
                res.nbytes += nb
                res.seconds += sec
                wait += w
        res.wait_fraction = wait / res.seconds if res.seconds else 0.0
        res.stages = stages
        if step.model is not None:
            res.extra["steps"] = step.model.calls  # the warm-up batches' included
        return res
    finally:
        loader.close()


def run_torch(path, o, workers: int, device=None) -> Measurement:
    """Epochs of ``torch.utils.data.DataLoader`` over ``fastload.Dataset`` with
    ``num_workers=workers``, doing the same work (PIL decode and the same augmentation); on
    a CUDA ``device`` its batches are pinned and copied there as a training loop does."""
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
    cuda = device is not None and device.type == "cuda"
    dl = DataLoader(source, batch_size=o.batch_size, sampler=sampler, num_workers=workers, collate_fn=collate,
                    persistent_workers=workers > 0, pin_memory=cuda)

    def to_device(b: dict) -> dict:
        return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in b.items()}

    step = Step(o.step_ms / 1e3, device, model_step(o, ds, "image" if images else None))
    res = Measurement(f"DataLoader num_workers={workers}", 0, 0, 0.0, "dataloader", note=note)
    res.first_batch_s = _warm_up(dl, o.warmup, step, to_device if cuda else None)  # starts the (persistent) workers
    wait = 0.0
    total = sum(min(len(dl), o.max_batches or len(dl)) for _ in range(o.epochs))
    with _progress(total, f"torch w={workers}", o.progress) as bar:
        for e in range(o.epochs):
            sampler.set_epoch(e)
            it = iter(dl)
            try:
                n, nb, sec, w = _timed_loop(it, step, o.max_batches, bar, to_device if cuda else None)
            finally:
                del it
            if sec > 0:
                res.round_rates.append(n / sec)
            res.samples += n
            res.nbytes += nb
            res.seconds += sec
            wait += w
    del dl  # persistent workers exit here
    res.wait_fraction = wait / res.seconds if res.seconds else 0.0
    if step.model is not None:
        res.extra["steps"] = step.model.calls
    return res


def model_step(o, ds, image_key: str | None):
    """The real training step ``--step`` asks for (a fresh model for each system), or None."""
    if o.step is None:
        return None
    from .models import ModelStep

    classes = len(ds.class_names) if getattr(ds, "class_names", None) else 10
    return ModelStep(o.step, classes=classes, label_key=ds.label_field or "label", image_key=image_key)


def check_step(o, ds) -> None:
    """ValueError when ``--step`` cannot train on what this dataset delivers."""
    images = _image_fields(ds)
    if o.step == "cnn" and (not images or o.transform == "none"):
        raise ValueError(f"--step cnn trains a CNN on images: {ds.path} has no image field"
                         if not images else "--step cnn needs the images decoded: --transform train224 or eval224")
    if o.step == "mlp":
        floats = [n for n in _raw_fields(ds) if ds.fields[n].kind == "tensor"
                  and np.dtype(ds.fields[n].np_dtype).kind == "f"]
        if not floats and not (images and o.transform != "none"):
            raise ValueError(f"--step mlp trains on a floating-point tensor field (e.g. float32[784]) or decoded "
                             f"images; {ds.path} has neither (fields: {', '.join(ds.fields)})")


def _dali_args(ds, name: str, idx: np.ndarray) -> tuple:
    w, h = ds.image_sizes(name, idx)
    return ds.views(name, idx), w, h, idx, 0


def run_limit(path, o, device: str, nbytes_per_sample: float, samples: int,
              device_id: int | None = None) -> Measurement | None:
    """memcpy of the same bytes (raw fields) or the transform's whole graph in DALI alone on
    the same encoded bytes (images; on CUDA on GPU ``device_id``, the Loader's); None when
    there is nothing to copy."""
    from ..store import Dataset

    ds = Dataset(path)
    images = _image_fields(ds)
    if o.transform != "none" and images:
        name = images[0]
        if device == "cuda" and device_id is None:
            raise ValueError("run_limit: device='cuda' needs the device_id of the GPU to run DALI on")
        from ..loader.machinery import images_checked

        # the transform's whole graph in DALI (on the CPU the Loader resizes in torch instead)
        runner = transform_for(o.transform).runner(device=device, batch_size=o.batch_size, seed=0,
                                                   device_id=device_id if device == "cuda" else None,
                                                   dali_only=True)
        runner.whole_batches = images_checked(ds)  # whole batches where the Loader's runners decode them
        order = np.random.default_rng(0).permutation(len(ds))[:samples]
        try:
            runner.run(*_dali_args(ds, name, order[:o.batch_size]))  # warm-up: build the graph
            t0 = time.perf_counter()
            for s in range(0, len(order), o.batch_size):
                runner.run(*_dali_args(ds, name, order[s:s + o.batch_size]))
            if runner.ready_event is not None:  # CUDA: the last copy out of DALI is part of the work
                runner.ready_event.synchronize()
            sec = time.perf_counter() - t0
        finally:
            runner.close()
        return Measurement("DALI alone (the whole graph in DALI, same bytes)", len(order),
                           int(nbytes_per_sample * len(order)), sec, "limit")
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
    check_step(o, ds)
    not_measured = []
    if not torch.cuda.is_available():
        not_measured.append("the GPU path (device='cuda': nvJPEG/mixed decoding, pinned-memory copies): "
                            "no CUDA GPU on this machine")
    ours = run_fastload(path, o)
    device = ours.extra["device"]  # what the Loader chose for "auto"
    results = [ours]
    on = torch.device(ours.extra["torch_device"]) if device == "cuda" else None  # the Loader's GPU
    if o.compare == "torch":
        results += [run_torch(path, o, w, on) for w in o.workers]
    if o.limit:
        per = ours.nbytes / ours.samples if ours.samples else 0
        lim = run_limit(path, o, device, per, ours.samples, device_id=on.index if on is not None else None)
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

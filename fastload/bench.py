"""``fastload bench DST``: can this loader keep a GPU fed on my data?

Iterates a dataset with the chosen settings and reports samples/s, MB/s, time to first
batch, per-stage times and the stall fraction; ``--compare torch`` runs
``torch.utils.data.DataLoader`` on the same data doing the same work (PIL decode and the same
augmentations for images) in the same run; ``--limit`` adds the hardware limit for the
workload (memcpy of the same bytes for raw fields, the same DALI graph alone for images).
``--json`` writes every figure with the machine description; ``--plot`` draws them.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

TRANSFORMS = ("train224", "eval224", "none")


# -- the machine -------------------------------------------------------------------------------
def machine_info() -> dict:
    """CPU, cores, memory, GPU (if any) and library versions."""
    info: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform()}
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    info["cpu"] = cpu
    try:
        info["cores"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover
        info["cores"] = os.cpu_count()
    try:
        with open("/proc/meminfo") as f:
            info["memory_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):  # pragma: no cover
        info["memory_gib"] = None
    import pyarrow
    import torch
    info["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    versions = {"numpy": np.__version__, "torch": torch.__version__, "pyarrow": pyarrow.__version__}
    try:
        import nvidia.dali
        versions["dali"] = nvidia.dali.__version__
    except ImportError:  # pragma: no cover
        versions["dali"] = None
    from . import __version__
    versions["fastload"] = __version__
    info["versions"] = versions
    return info


@dataclass
class Result:
    system: str
    kind: str  # "ours" | "dataloader" | "limit"
    samples: int
    seconds: float
    nbytes: int
    first_batch_s: float | None = None
    wait_fraction: float | None = None
    stages: dict = field(default_factory=dict)
    note: str = ""

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e6 if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "samples_per_s": self.samples_per_s, "mb_per_s": self.mb_per_s}


# -- the torch baseline: PIL decode + the same augmentations -----------------------------------
class TorchImageWork:
    """Collate for a DataLoader over ``fastload.Dataset``: PIL decode, then torchvision's
    RandomResizedCrop + flip (train) or resize + center crop (eval), normalise, float32 CHW.
    What a user without fastload writes; torchvision itself is not used (see the README)."""

    MEAN = np.array([0.485, 0.456, 0.406], np.float32)
    STD = np.array([0.229, 0.224, 0.225], np.float32)

    def __init__(self, image_field: str, transform: str, size: int = 224, seed: int = 0):
        self.field, self.transform, self.size = image_field, transform, size
        self.rng = np.random.default_rng(seed)

    def _one(self, data: bytes):
        from PIL import Image, ImageOps

        # upright, as DALI decodes it (same work on both sides for EXIF-rotated photos)
        img = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")
        W, H = img.size
        s = self.size
        if self.transform == "train224":
            box = None
            for _ in range(10):
                area = W * H * self.rng.uniform(0.08, 1.0)
                r = np.exp(self.rng.uniform(np.log(3 / 4), np.log(4 / 3)))
                w, h = int(round((area * r) ** 0.5)), int(round((area / r) ** 0.5))
                if 0 < w <= W and 0 < h <= H:
                    x, y = self.rng.integers(0, W - w + 1), self.rng.integers(0, H - h + 1)
                    box = (x, y, x + w, y + h)
                    break
            if box is None:
                m = min(W, H)
                box = ((W - m) // 2, (H - m) // 2, (W - m) // 2 + m, (H - m) // 2 + m)
            img = img.resize((s, s), Image.BILINEAR, box=box)
            if self.rng.random() < 0.5:
                img = img.transpose(Image.FLIP_LEFT_RIGHT)
        else:
            r = round(s / 0.875)
            k = r / min(W, H)
            img = img.resize((max(r, round(W * k)), max(r, round(H * k))), Image.BILINEAR)
            w2, h2 = img.size
            left, top = (w2 - s) // 2, (h2 - s) // 2
            img = img.crop((left, top, left + s, top + s))
        a = (np.asarray(img, np.float32) / 255.0 - self.MEAN) / self.STD
        return a.transpose(2, 0, 1)

    def __call__(self, samples: list[dict]) -> dict:
        import torch

        out = {"image": torch.from_numpy(np.stack([self._one(s[self.field]) for s in samples]))}
        for k, v in samples[0].items():
            if k != self.field and isinstance(v, (int, float, np.integer, np.floating, np.ndarray)):
                out[k] = torch.as_tensor(np.stack([s[k] for s in samples]))
        return out


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


def _timed_loop(it, step_s: float, max_batches: int | None, bar) -> tuple[int, int, int, float, float | None, float]:
    """(batches, samples, bytes, seconds, first batch s, seconds waiting in next())."""
    batches = samples = nbytes = 0
    wait = 0.0
    first = None
    t0 = time.perf_counter()
    it = iter(it)
    while max_batches is None or batches < max_batches:
        t1 = time.perf_counter()
        try:
            b = next(it)
        except StopIteration:
            break
        t2 = time.perf_counter()
        wait += t2 - t1
        if first is None:
            first = t2 - t0
        n = len(next(iter(b.values())))
        batches += 1
        samples += n
        nbytes += _batch_bytes(b)
        bar.update(1)
        if step_s:
            time.sleep(step_s)  # the simulated training step
    return batches, samples, nbytes, time.perf_counter() - t0, first, wait


# -- the runs ----------------------------------------------------------------------------------
def _transform_for(name: str):
    from . import vision
    return {"train224": vision.train(224), "eval224": vision.eval(224, resize=256)}.get(name)


def run_fastload(path, a) -> Result:
    from .loader import Loader
    from .store import Dataset

    ds = Dataset(path)
    image_fields = [n for n, f in ds.fields.items() if f.kind == "image"]
    fields = [n for n, f in ds.fields.items() if f.kind in ("tensor", "scalar")]
    transforms = {}
    if a.transform != "none" and image_fields:
        transforms = {image_fields[0]: _transform_for(a.transform)}
        fields.append(image_fields[0])
    loader = Loader(ds, batch_size=a.batch_size, device=a.device, rank=0, world_size=a.world_size,
                    fields=fields, transforms=transforms, threads=a.threads, seed=0)
    try:
        res = Result("fastload Loader", "ours", 0, 0.0, 0, note=f"device={loader.device.type}, threads={loader.threads}")
        res.first_batch_s = _warm_up(loader, a.warmup)
        total = sum(min(len(loader), a.max_batches or len(loader)) for _ in range(a.epochs))
        stages = {"gather_s": 0.0, "decode_s": 0.0, "copy_s": 0.0}
        wait = 0.0
        with _progress(total, "fastload", a.progress) as bar:
            for e in range(a.epochs):
                loader.set_epoch(e)
                _, n, nb, sec, first, w = _timed_loop(loader, a.step_ms / 1e3, a.max_batches, bar)
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


def run_torch(path, a, workers: int) -> Result:
    import torch
    from torch.utils.data import DataLoader, DistributedSampler

    from .store import Dataset

    ds = Dataset(path)
    image_fields = [n for n, f in ds.fields.items() if f.kind == "image"]
    keep = [n for n, f in ds.fields.items() if f.kind in ("tensor", "scalar")]
    collate: Callable | None = None
    if a.transform != "none" and image_fields:
        collate = TorchImageWork(image_fields[0], a.transform)
    else:
        def collate(samples, keep=tuple(keep)):  # noqa: E731 - the default collate on the kept fields
            return {k: torch.as_tensor(np.stack([s[k] for s in samples])) for k in keep}
    sampler = DistributedSampler(ds, num_replicas=a.world_size, rank=0, shuffle=True, seed=0)
    dl = DataLoader(ds, batch_size=a.batch_size, sampler=sampler, num_workers=workers, collate_fn=collate,
                    persistent_workers=workers > 0, pin_memory=False)
    res = Result(f"DataLoader num_workers={workers}", "dataloader", 0, 0.0, 0,
                 note="PIL decode + same augmentation" if image_fields and a.transform != "none" else "fastload.Dataset")
    res.first_batch_s = _warm_up(dl, a.warmup)  # starts the (persistent) workers
    wait = 0.0
    total = sum(min(len(dl), a.max_batches or len(dl)) for _ in range(a.epochs))
    with _progress(total, f"torch w={workers}", a.progress) as bar:
        for e in range(a.epochs):
            sampler.set_epoch(e)
            it = iter(dl)
            try:
                _, n, nb, sec, first, w = _timed_loop(it, a.step_ms / 1e3, a.max_batches, bar)
            finally:
                del it
            res.samples += n
            res.nbytes += nb
            res.seconds += sec
            wait += w
    del dl  # persistent workers exit here
    res.wait_fraction = wait / res.seconds if res.seconds else 0.0
    return res


def _args(ds, name: str, idx: np.ndarray) -> tuple:
    w, h = ds.image_sizes(name, idx)
    return ds.views(name, idx), w, h, idx, 0


def run_limit(path, a, nbytes_per_sample: float, samples: int) -> Result | None:
    """memcpy of the same bytes (raw) or the same DALI graph alone on the same encoded bytes."""
    from .store import Dataset

    ds = Dataset(path)
    image_fields = [n for n, f in ds.fields.items() if f.kind == "image"]
    if a.transform != "none" and image_fields:
        name = image_fields[0]
        runner = _transform_for(a.transform).runner(device="cuda" if a.device == "cuda" else "cpu",
                                                    batch_size=a.batch_size, seed=0)
        order = np.random.default_rng(0).permutation(len(ds))[:samples]
        try:
            runner.run(*_args(ds, name, order[:a.batch_size]))  # warm-up: build the graph
            t0 = time.perf_counter()
            for s in range(0, len(order), a.batch_size):
                runner.run(*_args(ds, name, order[s:s + a.batch_size]))
            sec = time.perf_counter() - t0
        finally:
            runner.close()
        return Result("DALI alone (same graph, same bytes)", "limit", len(order), sec, int(nbytes_per_sample * len(order)))
    nb = int(nbytes_per_sample * a.batch_size)
    if nb == 0:
        return None
    src = np.ones(max(nb * 64, 1 << 26) // nb * nb, np.uint8)
    dst = np.empty(nb, np.uint8)
    reps = max(1, samples // a.batch_size)
    t0 = time.perf_counter()
    for r in range(reps):
        off = (r * nb) % (len(src) - nb + 1)
        np.copyto(dst, src[off:off + nb])
    sec = time.perf_counter() - t0
    return Result("memcpy of the same bytes", "limit", reps * a.batch_size, sec, reps * nb)


# -- report ------------------------------------------------------------------------------------
def _table(results: list[Result]) -> str:
    dl = [r.samples_per_s for r in results if r.kind == "dataloader"]
    lim = [r.samples_per_s for r in results if r.kind == "limit"]
    rows = [("system", "samples/s", "MB/s", "first batch (cold)", "stall", "vs DataLoader", "vs limit")]
    for r in results:
        rows.append((r.system, f"{r.samples_per_s:,.0f}", f"{r.mb_per_s:,.1f}",
                     f"{r.first_batch_s:.3f} s" if r.first_batch_s is not None else "-",
                     f"{100 * r.wait_fraction:.0f}%" if r.wait_fraction is not None else "-",
                     f"{r.samples_per_s / max(dl):.2f}x" if dl else "-",
                     f"{100 * r.samples_per_s / max(lim):.0f}%" if lim else "-"))
    w = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(row)) for row in rows)


def plot(results: list[Result], path: str | os.PathLike, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.system for r in results]
    colors = {"ours": "#1f77b4", "dataloader": "#7f7f7f", "limit": "#2ca02c"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 0.6 * len(results) + 2.2),
                                   gridspec_kw={"width_ratios": [3, 1.2]})
    y = np.arange(len(results))[::-1]
    rates = [r.samples_per_s for r in results]
    ax1.barh(y, rates, color=[colors.get(r.kind, "#999") for r in results])
    ax1.set_yticks(y, names)
    ax1.set_xlabel("samples / s (higher is better)")
    for yi, v in zip(y, rates):
        ax1.text(v, yi, f" {v:,.0f}", va="center", fontsize=9)
    ax1.set_xlim(0, max(rates) * 1.25 if rates and max(rates) > 0 else 1)
    stalls = [100 * (r.wait_fraction or 0.0) for r in results]
    ax2.barh(y, stalls, color="#d62728")
    ax2.set_yticks(y, [""] * len(y))
    ax2.set_xlim(0, 100)
    ax2.set_xlabel("% of time the loop waited for data")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(a) -> dict:
    import torch

    from .store import Dataset

    ds = Dataset(a.path)
    if a.device in (None, "auto"):
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    has_images = any(f.kind == "image" for f in ds.fields.values())
    if a.transform != "none" and not has_images:
        a.transform = "none"
    not_measured = []
    if not torch.cuda.is_available():
        not_measured.append("the GPU path (device='cuda': nvJPEG/mixed decoding, pinned-memory copies): "
                            "no CUDA GPU on this machine")
    results = [run_fastload(a.path, a)]
    ours = results[0]
    if a.compare == "torch":
        for w in a.workers:
            results.append(run_torch(a.path, a, w))
    if a.limit:
        per = ours.nbytes / ours.samples if ours.samples else 0
        lim = run_limit(a.path, a, per, ours.samples)
        if lim is not None:
            results.append(lim)
    title = (f"fastload bench {ds.path.name}: {len(ds):,} samples, batch {a.batch_size}, transform {a.transform}, "
             f"device {a.device}, rank 0 of {a.world_size}")
    report = {"title": title, "machine": machine_info(), "dataset": {"path": str(ds.path), "samples": len(ds),
              "fields": {n: f.kind for n, f in ds.fields.items()}, "shards": ds.num_shards},
              "settings": {k: getattr(a, k) for k in ("batch_size", "transform", "device", "epochs", "world_size",
                                                      "compare", "workers", "limit", "max_batches", "step_ms", "warmup")},
              "results": [r.as_dict() for r in results], "not_measured": not_measured}
    return report


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="measure a dataset's loading speed (optionally against torch's DataLoader)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("path", help="a dataset made by fastload convert")
    b.add_argument("--batch-size", type=int, default=64)
    b.add_argument("--transform", choices=TRANSFORMS, default="train224", help="for image fields (default train224)")
    b.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    b.add_argument("--epochs", type=int, default=1)
    b.add_argument("--world-size", type=int, default=1, help="simulate rank 0 of this many ranks")
    b.add_argument("--threads", type=int, default=None, help="loader threads (default: measured default)")
    b.add_argument("--compare", choices=("torch",), default=None, help="also run torch's DataLoader")
    b.add_argument("--workers", default="0,2", help="num_workers values for --compare torch (default 0,2)")
    b.add_argument("--limit", action="store_true", help="also measure the hardware limit for this workload")
    b.add_argument("--max-batches", type=int, default=None, help="stop each epoch after this many batches")
    b.add_argument("--warmup", type=int, default=3, help="untimed batches per system before measuring")
    b.add_argument("--step-ms", type=float, default=0.0, help="simulated training step per batch (ms)")
    b.add_argument("--json", default=None, help="write every figure and the machine description here")
    b.add_argument("--plot", default=None, help="draw throughput and stall fraction to this PNG")
    b.add_argument("--no-progress", dest="progress", action="store_false")
    b.set_defaults(func=cmd_bench)


def cmd_bench(a) -> int:
    from .cli import _Fail

    for name in ("batch_size", "epochs", "world_size"):
        if getattr(a, name) < 1:
            raise _Fail(f"--{name.replace('_', '-')}={getattr(a, name)} must be >= 1")
    if a.max_batches is not None and a.max_batches < 1:
        raise _Fail(f"--max-batches={a.max_batches} must be >= 1")
    if a.step_ms < 0:
        raise _Fail(f"--step-ms={a.step_ms} must be >= 0")
    try:
        a.workers = [int(w) for w in str(a.workers).split(",") if w.strip()]
    except ValueError:
        raise _Fail(f"--workers={a.workers!r} must be comma-separated ints, e.g. 0,2") from None
    if any(w < 0 for w in a.workers):
        raise _Fail(f"--workers={a.workers} must be >= 0")
    for out in (a.json, a.plot):
        if out is not None and not Path(out).resolve().parent.is_dir():
            raise _Fail(f"cannot write {out}: directory {Path(out).resolve().parent} does not exist")
    if a.plot is not None and not a.plot.lower().endswith(".png"):
        raise _Fail(f"--plot={a.plot}: give a .png file name")
    try:
        report = run(a)
    except (FileNotFoundError, ValueError) as e:
        raise _Fail(str(e)) from None
    results = [Result(**{k: v for k, v in r.items() if k not in ("samples_per_s", "mb_per_s")})
               for r in report["results"]]
    print(report["title"])
    m = report["machine"]
    print(f"machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, GPU: {m['gpu'] or 'none'}")
    print(_table(results))
    ours = results[0]
    st = ours.stages
    print(f"fastload stages: gather {st['gather_s']:.3f} s, decode {st['decode_s']:.3f} s, copy {st['copy_s']:.3f} s;"
          f" the loop waited {100 * (ours.wait_fraction or 0):.0f}% of the time"
          + (" (no training step simulated: use --step-ms to see whether loading keeps up)" if not a.step_ms else ""))
    for s in report["not_measured"]:
        print(f"not measured: {s}")
    if a.json:
        tmp = Path(a.json).with_name(Path(a.json).name + ".tmp")
        tmp.write_text(json.dumps(report, indent=2))
        os.replace(tmp, a.json)
        print(f"wrote {a.json}")
    if a.plot:
        plot(results, a.plot, report["title"])
        print(f"wrote {a.plot}")
    return 0

"""Speed inside a real training loop: the model's torch ops share the cores with the loader.

    .venv/bin/python bench/bench_loop.py            # full run (several minutes on 2 cores)
    .venv/bin/python bench/bench_loop.py --smoke    # tiny sizes, one repeat
    .venv/bin/python bench/bench_loop.py --only mlp --repeats 7

A loader-only benchmark hides what users meet: torch's intra-op (OpenMP) threads and the
loader's threads competing for the same cores. Each case trains a model on the CPU, forward
and backward, with every system feeding the same batches:

* **MLP on MNIST-like rows**: 60,000 x 784 float32 + int64 labels, batch 300, a 784-256-10
  MLP with SGD. Systems: the batches pre-gathered in memory (the limit: the loop alone),
  ``DataLoader(TensorDataset)`` with num_workers 0 and 2, and ``fastload.Loader``.
* **Small CNN on photos**: real-photo JPEGs (``fastload.sample_data``), RandomResizedCrop 224
  + flip + normalise (float32 CHW), batch 32, a small 3-layer CNN. Systems: the decoded
  batches held in memory (the limit), ``DataLoader`` + PIL doing the same crops
  (``fastload.bench.baseline``) with num_workers 0 and 2, and ``fastload.Loader`` with
  ``vision.train(224)`` (DALI on the CPU).

Each case runs twice: with torch's default intra-op threads and with one torch thread. The
systems of one setting are run round-robin, epoch by epoch, so drifts of a shared machine hit
them alike; the table gives the median epoch time, its spread (min-max), the slowdown of the
loop against the limit, and the wait fraction (time blocked in ``next()`` / epoch time).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))

import fastload  # noqa: E402
from fastload.bench.baseline import EpochSampler, ImageCollate, PILImageWork, TaggedDataset  # noqa: E402
from fastload.bench.report import Measurement, headline, print_table, system_info  # noqa: E402
from fastload.sample_data import make_image_folder  # noqa: E402


# ---------------------------------------------------------------------------- the loops
def train_epoch(batches, model, opt, xkey, ykey) -> tuple[int, float]:
    """One epoch of forward + backward + step; returns (samples, seconds blocked in next())."""
    it = iter(batches)
    seen, wait = 0, 0.0
    while True:
        t0 = time.perf_counter()
        try:
            b = next(it)
        except StopIteration:
            break
        wait += time.perf_counter() - t0
        x, y = (b[xkey], b[ykey]) if isinstance(b, dict) else b
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        seen += len(y)
    return seen, wait


class System:
    """One way of feeding the loop: ``epoch(k)`` -> an iterable of batches for epoch ``k``."""

    def __init__(self, name: str, kind: str, epoch, close=lambda: None, keys=("x", "label")):
        self.name, self.kind, self.epoch, self.close, self.keys = name, kind, epoch, close, keys
        self.times: list[float] = []
        self.waits: list[float] = []
        self.samples = 0


def run_setting(systems: list[System], make_model, repeats: int, warmup: int) -> None:
    """Round-robin epochs of every system (fresh model each system, same seed)."""
    models = {}
    for s in systems:
        torch.manual_seed(0)
        m = make_model()
        models[s.name] = (m, torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9))
    for r in range(warmup + repeats):
        for s in systems:
            model, opt = models[s.name]
            t0 = time.perf_counter()
            n, wait = train_epoch(s.epoch(r), model, opt, *s.keys)
            dt = time.perf_counter() - t0
            if r >= warmup:
                s.times.append(dt)
                s.waits.append(wait)
                s.samples = n


def report(title: str, systems: list[System], nbytes_per_sample: int) -> dict[str, Measurement]:
    limit = statistics.median(next(s for s in systems if s.kind == "limit").times)
    rows = {}
    for s in systems:
        med = statistics.median(s.times)
        wf = statistics.median(w / t for w, t in zip(s.waits, s.times))
        m = Measurement(s.name, s.samples, s.samples * nbytes_per_sample, med, s.kind,
                        f"{med:.3f} s/epoch ({min(s.times):.3f}-{max(s.times):.3f}); {med / limit:.2f}x the limit; "
                        f"waits {100 * wf:.0f}%", wait_fraction=wf,
                        extra={"slowdown": med / limit, "epoch_s": s.times, "wait_s": s.waits})
        rows[s.name] = m
    print_table(title, list(rows.values()), rate="MB/s")
    return rows


# ---------------------------------------------------------------------------- MLP on rows
def mlp_case(tmp: Path, n: int, batch: int, repeats: int, warmup: int, threads: int) -> dict[str, Measurement]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 784), dtype=np.float32)
    y = (x @ rng.standard_normal((784, 10)).astype(np.float32)).argmax(1).astype(np.int64)
    path = tmp / "mnist"
    if not (path / "manifest.json").exists():
        with fastload.ShardWriter(path, {"x": "float32[784]", "label": "int64"}, label="label") as w:
            w.write_batch({"x": x, "label": y})
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)

    def pregathered(k):  # batches already in memory, in a shuffled order: only the loop runs
        return pre[k % len(pre)]

    orders = [np.random.default_rng(100 + k).permutation(n) for k in range(2)]
    pre = [[(xt[o[i:i + batch]].clone(), yt[o[i:i + batch]].clone()) for i in range(0, n, batch)] for o in orders]
    systems = [System("batches in memory (the limit)", "limit", pregathered, keys=(0, 1))]
    dls = []
    for w in (0, 2):
        dl = DataLoader(TensorDataset(xt, yt), batch_size=batch, shuffle=True, num_workers=w,
                        persistent_workers=w > 0)
        dls.append(dl)
        systems.append(System(f"DataLoader num_workers={w}", "dataloader", lambda k, dl=dl: dl, keys=(0, 1)))
    loader = fastload.Loader(path, batch_size=batch, seed=0, device="cpu")

    def fl(k):
        loader.set_epoch(k)
        return loader

    systems.append(System("fastload Loader", "ours", fl))
    torch.set_num_threads(threads)
    try:
        run_setting(systems, lambda: nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10)),
                    repeats, warmup)
    finally:
        loader.close()
        for dl in dls:
            dl._iterator = None  # shut persistent workers down  # noqa: SLF001
    return report(f"MLP 784-256-10 on {n:,} x 784 float32 rows, batch {batch}, torch threads={threads}",
                  systems, 784 * 4 + 8)


# ---------------------------------------------------------------------------- CNN on photos
def small_cnn(classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 5, stride=4, padding=2), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, classes))


def cnn_case(tmp: Path, n: int, batch: int, repeats: int, warmup: int, threads: int) -> dict[str, Measurement]:
    src, store = tmp / "photos", tmp / "photos-store"
    if not (store / "manifest.json").exists():
        make_image_folder(src, n, seed=0)
        fastload.convert("imagefolder", src, store, progress=False)
    tf = fastload.vision.train(224)
    loader = fastload.Loader(store, batch_size=batch, transforms={"image": tf}, seed=0, device="cpu")
    classes = len(loader.dataset.class_names)

    def fl(k):
        loader.set_epoch(k)
        return loader

    # The limit: the Loader's own batches of two epochs, decoded once and held in memory.
    pre = []
    for k in range(2):
        loader.set_epoch(1000 + k)
        pre.append([(b["image"].clone(), b["label"].clone()) for b in loader])
    systems = [System("decoded batches in memory (the limit)", "limit", lambda k: pre[k % 2], keys=(0, 1))]
    ds = fastload.Dataset(store)
    dls = []
    for w in (0, 2):
        sampler = EpochSampler(RandomSampler(range(len(ds))))
        dl = DataLoader(TaggedDataset(ds), batch_size=batch, sampler=sampler, num_workers=w,
                        persistent_workers=w > 0, collate_fn=ImageCollate("image", PILImageWork(tf, seed=0)))
        dls.append(dl)

        def epoch(k, dl=dl, sampler=sampler):
            sampler.set_epoch(k)
            return dl

        systems.append(System(f"DataLoader + PIL, num_workers={w}", "dataloader", epoch, keys=("image", "label")))
    systems.append(System("fastload Loader (DALI, cpu)", "ours", fl, keys=("image", "label")))
    torch.set_num_threads(threads)
    try:
        run_setting(systems, lambda: small_cnn(classes), repeats, warmup)
    finally:
        loader.close()
        for dl in dls:
            dl._iterator = None  # noqa: SLF001
    return report(f"small CNN on {n:,} photo JPEGs, RandomResizedCrop 224 float32 CHW, batch {batch}, "
                  f"torch threads={threads}", systems, 3 * 224 * 224 * 4 + 8)


# ---------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat")
    ap.add_argument("--only", choices=("mlp", "cnn"), default=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--images", type=int, default=640)
    a = ap.parse_args(argv)
    rows_n, images, repeats, warmup = 60_000, a.images, a.repeats, 1
    if a.smoke:
        rows_n, images, repeats, warmup = 3_000, 64, 1, 0
    default_threads = torch.get_num_threads()
    settings = [default_threads] + ([1] if default_threads != 1 else [])
    tmp = Path(tempfile.mkdtemp(prefix="bench_loop_"))
    results: dict[tuple[str, int], dict[str, Measurement]] = {}
    print(f"{system_info()}; torch default intra-op threads: {default_threads}")
    try:
        for th in settings:
            if a.only in (None, "mlp"):
                results[("mlp", th)] = mlp_case(tmp, rows_n, 300, repeats, warmup, th)
            if a.only in (None, "cnn"):
                results[("cnn", th)] = cnn_case(tmp, images, 32, repeats, warmup, th)
    finally:
        torch.set_num_threads(default_threads)
        shutil.rmtree(tmp, ignore_errors=True)

    print("\n## Summary (epoch time as a multiple of the limit; lower is better)")
    for (case, th), rows in results.items():
        ours = next(r for r in rows.values() if r.kind == "ours")
        best_dl = min((r for r in rows.values() if r.kind == "dataloader"), key=lambda r: r.seconds)
        print(f"{case} torch threads={th}: fastload {ours.extra['slowdown']:.2f}x (waits {100 * ours.wait_fraction:.0f}%), "
              f"best DataLoader {best_dl.extra['slowdown']:.2f}x (waits {100 * best_dl.wait_fraction:.0f}%)")
        limit = next(r for r in rows.values() if r.kind == "limit")
        what = ("MLP 784-256-10 on 60,000 MNIST-like rows, batch 300" if case == "mlp"
                else f"small CNN on {images:,} photos, RandomResizedCrop 224, batch 32")
        headline(f"Training loop: {what}, torch threads={th}", script="bench_loop.py", unit="epochs/s",
                 smoke=a.smoke, ours=("fastload Loader", 1 / ours.seconds),
                 baseline=(best_dl.system, 1 / best_dl.seconds), limit=(limit.system, 1 / limit.seconds),
                 note=f"epoch {ours.extra['slowdown']:.2f}x the limit, loop waits {100 * ours.wait_fraction:.0f}%; "
                      f"{best_dl.system} waits {100 * best_dl.wait_fraction:.0f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())

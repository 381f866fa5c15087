"""Speed inside a real training loop: the model's torch ops share the cores with the loader.

    .venv/bin/python bench/bench_loop.py            # full run (several minutes on 2 cores)
    .venv/bin/python bench/bench_loop.py --smoke    # tiny sizes, one repeat, default torch threads only
    .venv/bin/python bench/bench_loop.py --only mlp --repeats 7

A loader-only benchmark hides what users meet: torch's intra-op (OpenMP) threads and the
loader's threads competing for the same cores. Each case trains a model on the CPU, forward
and backward, with every system feeding the same batches:

* **MLP on MNIST-like rows**: 60,000 x 784 float32 + int64 labels, batch 300, a 784-256-10
  MLP with SGD. Systems: the batches pre-gathered in memory (the limit: the loop alone),
  ``DataLoader(TensorDataset)`` with num_workers 0 and 2, and ``fastload.Loader``.
* **Small CNN on photos**: real-photo JPEGs (``fastload.demo.photos``), RandomResizedCrop 224
  + flip + normalise (float32 CHW), batch 32, a small 3-layer CNN. Systems: the decoded
  batches held in memory (the limit), ``DataLoader`` + PIL doing the same crops
  (``fastload.bench.baseline``) with num_workers 0 and 2, and ``fastload.Loader`` with
  ``vision.train(224)`` (DALI on the CPU).

Each case runs twice: with torch's default intra-op threads and with one torch thread. The
systems of one setting are run round-robin, epoch by epoch (one untimed warm-up round, then
the repeats), so drifts of a shared machine hit them alike; the table gives the median epoch
time with its spread (min–max), the slowdown of the loop against the limit (median and
min–max of the per-round ratios), the wait fraction (time blocked in ``next()`` / epoch time)
and the cold time to the first batch (the Loader's constructor plus its first ``next()``; the
DataLoader's first ``next()``, which starts its workers).

**The CPU bound (CNN).** On the CPU the decoder and the model share the cores, so no loader
can bring the wait to zero: each round also runs the Loader's decoding alone (its DALI
decode and torch resize on the same bytes, in a thread of its own like a feeder's, no
training) and measures its process CPU time per epoch (C_decode), and the limit
epoch's wall and CPU time (T_loop, C_loop, every thread). The bound is
max(T_loop, (C_loop + C_decode) / cores): the shortest epoch any loader can give on these
cores, at which the loop still waits 1 - T_loop / bound. Each row says how far it is from it,
so "CNN wait <= 5%" is judged against what the cores can do.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
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
from fastload.bench.models import mlp, sgd, small_cnn  # noqa: E402
from fastload.bench.report import Measurement, Spread, headline, paired_ratios, print_table, system_info  # noqa: E402
from fastload.loader.machinery import images_checked  # noqa: E402
from fastload.pipeline.host_tail import one_torch_thread  # noqa: E402
from fastload.demo.photos import make_image_folder  # noqa: E402
from fastload.runtime.system import loader_nice, usable_cores  # noqa: E402


# ---------------------------------------------------------------------------- the loops
def train_epoch(batches, model, opt, xkey, ykey) -> tuple[int, float, float]:
    """One epoch of forward + backward + step; returns (samples, seconds blocked in next(),
    seconds to the first batch)."""
    it = iter(batches)
    seen, wait, first = 0, 0.0, None
    while True:
        t0 = time.perf_counter()
        try:
            b = next(it)
        except StopIteration:
            break
        dt = time.perf_counter() - t0
        wait += dt
        if first is None:
            first = dt
        x, y = (b[xkey], b[ykey]) if isinstance(b, dict) else b
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        seen += len(y)
    return seen, wait, first or 0.0


class System:
    """One way of feeding the loop: ``epoch(k)`` -> an iterable of batches for epoch ``k``.
    ``build_s``: the seconds it took to make (the Loader's constructor; 0 for the others, made
    in no time); its first batch (cold) is that plus the first ``next()`` of its first epoch,
    where the DataLoader starts its workers and the Loader its pipelines."""

    def __init__(self, name: str, kind: str, epoch, close=lambda: None, keys=("x", "label"), build_s=0.0):
        self.name, self.kind, self.epoch, self.close, self.keys = name, kind, epoch, close, keys
        self.build_s = build_s
        self.times: list[float] = []
        self.waits: list[float] = []
        self.cpu: list[float] = []  # process CPU seconds of each timed epoch (every thread)
        self.first_batch_s: float | None = None
        self.samples = 0


def run_setting(systems: list[System], make_model, repeats: int, warmup: int,
                probes: dict | None = None) -> dict[str, list[tuple[float, float]]]:
    """Round-robin epochs of every system (fresh model each system, same seed); each round
    also runs the ``probes`` (name -> fn), returning their (wall, CPU) seconds per round."""
    models = {}
    for s in systems:
        torch.manual_seed(0)
        m = make_model()
        models[s.name] = (m, sgd(m))
    probed: dict[str, list[tuple[float, float]]] = {k: [] for k in (probes or {})}
    for r in range(warmup + repeats):
        for s in systems:
            model, opt = models[s.name]
            c0, t0 = time.process_time(), time.perf_counter()
            n, wait, first = train_epoch(s.epoch(r), model, opt, *s.keys)
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            if r == 0 and s.kind != "limit":
                s.first_batch_s = s.build_s + first
            if r >= warmup:
                s.times.append(dt)
                s.waits.append(wait)
                s.cpu.append(cpu)
                s.samples = n
        for k, fn in (probes or {}).items():
            c0, t0 = time.process_time(), time.perf_counter()
            fn(r)
            if r >= warmup:
                probed[k].append((time.perf_counter() - t0, time.process_time() - c0))
    return probed


class Bound:
    """The CPU bound of an epoch on ``cores`` cores: max(T_loop, (C_loop + C_decode) / cores),
    from the loop's own wall and CPU seconds (the limit system: batches in memory) and the
    decoder's CPU seconds for an epoch's images (decoding alone, measured in the same rounds). No
    loader on these cores can finish an epoch sooner; at the bound the loop still waits
    1 - T_loop / bound of the time. C_loop counts every thread of the loop, torch's OpenMP
    workers spinning at their barriers included, so with torch threads > 1 the bound can
    overstate what the loop needs (a loader that takes the cores while OpenMP spins beats it)."""

    def __init__(self, t_loop: float, c_loop: float, c_decode: float, cores: int):
        self.t_loop, self.c_loop, self.c_decode, self.cores = t_loop, c_loop, c_decode, cores
        self.seconds = max(t_loop, (c_loop + c_decode) / cores)
        self.min_wait = 1 - t_loop / self.seconds

    def describe(self) -> str:
        return (f"CPU bound {self.seconds:.3f} s/epoch = max(loop {self.t_loop:.3f} s, (loop CPU {self.c_loop:.3f} s "
                f"+ decoding-alone CPU {self.c_decode:.3f} s) / {self.cores} cores): a loop fed at the bound "
                f"still waits {100 * self.min_wait:.0f}%")


def report(title: str, systems: list[System], nbytes_per_sample: int, bound: Bound | None = None
           ) -> dict[str, Measurement]:
    limit = next(s for s in systems if s.kind == "limit")
    lim_t = statistics.median(limit.times)
    rows = {}
    for s in systems:
        m = Measurement.from_times(s.name, s.samples, s.samples * nbytes_per_sample, s.times, s.kind, group="epoch")
        wf = statistics.median(w / t for w, t in zip(s.waits, s.times))
        slow = paired_ratios(s.times, limit.times)
        m.wait_fraction, m.first_batch_s = wf, s.first_batch_s
        m.extra.update({"slowdown": m.seconds / lim_t, "slowdown_range": [slow.lo, slow.hi], "epoch_s": s.times,
                        "wait_s": s.waits, "cpu_s": s.cpu, "repeats": len(s.times)})
        note = f"{Spread.of(s.times).fmt('.3f')} s/epoch; {slow.fmt('.2f', 'x')} the limit"
        if bound is not None:
            vs = Spread.of([t / bound.seconds for t in s.times])
            m.extra.update({"bound_s": bound.seconds, "vs_bound": vs.median, "vs_bound_range": [vs.lo, vs.hi]})
            note += f"; {vs.fmt('.2f', 'x')} the CPU bound"
        m.note = f"{note}; waits {100 * wf:.0f}%"
        rows[s.name] = m
    print_table(title, list(rows.values()), rate="MB/s")
    if bound is not None:
        print(bound.describe())
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
    t0 = time.perf_counter()
    loader = fastload.Loader(path, batch_size=batch, seed=0, device="cpu")
    build_s = time.perf_counter() - t0

    def fl(k):
        loader.set_epoch(k)
        return loader

    systems.append(System("fastload Loader", "ours", fl, build_s=build_s))
    torch.set_num_threads(threads)
    try:
        run_setting(systems, lambda: mlp(784, 10), repeats, warmup)
    finally:
        loader.close()
        for dl in dls:
            dl._iterator = None  # shut persistent workers down  # noqa: SLF001
    return report(f"MLP 784-256-10 on {n:,} x 784 float32 rows, batch {batch}, torch threads={threads}",
                  systems, 784 * 4 + 8)


# ---------------------------------------------------------------------------- CNN on photos
def cnn_case(tmp: Path, n: int, batch: int, repeats: int, warmup: int, threads: int) -> dict[str, Measurement]:
    src, store = tmp / "photos", tmp / "photos-store"
    if not (store / "manifest.json").exists():
        make_image_folder(src, n, seed=0)
        fastload.convert("imagefolder", src, store, progress=False)
    tf = fastload.vision.train(224)
    ds = fastload.Dataset(store)
    classes = len(ds.class_names)
    # The limit: the Loader's own batches of two epochs, decoded once (by a Loader of their
    # own, closed before anything is timed) and held in memory.
    with fastload.Loader(store, batch_size=batch, transforms={"image": tf}, seed=0, device="cpu") as once:
        pre = []
        for k in range(2):
            once.set_epoch(1000 + k)
            pre.append([(b["image"].clone(), b["label"].clone()) for b in once])
    systems = [System("decoded batches in memory (the limit)", "limit", lambda k: pre[k % 2], keys=(0, 1))]
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
    t0 = time.perf_counter()
    loader = fastload.Loader(store, batch_size=batch, transforms={"image": tf}, seed=0, device="cpu")
    build_s = time.perf_counter() - t0

    def fl(k):
        loader.set_epoch(k)
        return loader

    systems.append(System("fastload Loader (DALI, cpu)", "ours", fl, keys=("image", "label"), build_s=build_s))
    # the Loader's decoding alone on the same bytes (its runner: DALI's decode with as many
    # threads as the Loader's pipelines, torch's resize on one thread, as in a feeder): the
    # decoding's CPU time per epoch, for the CPU bound
    runner = tf.runner(device="cpu", batch_size=batch, seed=0)
    runner.whole_batches = images_checked(ds)  # as the Loader's runners
    name = "image"

    def decode_epoch(k: int) -> None:
        one_torch_thread()  # as a feeder: torch's resize on this thread alone
        order = np.random.default_rng(k).permutation(len(ds))
        for s in range(0, len(order), batch):
            idx = order[s:s + batch]
            w, h = ds.image_sizes(name, idx)
            runner.run(ds.views(name, idx), w, h, idx, k)

    def decoding_alone(k: int) -> None:
        failed: list = []

        def work() -> None:
            try:
                decode_epoch(k)
            except BaseException as e:  # raised in the bench's thread below
                failed.append(e)
        t = threading.Thread(target=work, name="bench-decode")
        t.start()
        t.join()
        if failed:
            raise failed[0]

    torch.set_num_threads(threads)
    try:
        probed = run_setting(systems, lambda: small_cnn(classes), repeats, warmup, probes={"decode": decoding_alone})
    finally:
        loader.close()
        runner.close()
        for dl in dls:
            dl._iterator = None  # noqa: SLF001
    limit = systems[0]
    bound = Bound(statistics.median(limit.times), statistics.median(limit.cpu),
                  statistics.median(c for _, c in probed["decode"]), usable_cores())
    rows = report(f"small CNN on {n:,} photo JPEGs, RandomResizedCrop 224 float32 CHW, batch {batch}, "
                  f"torch threads={threads}", systems, 3 * 224 * 224 * 4 + 8, bound)
    decode_s = Spread.of([w for w, _ in probed["decode"]])
    print(f"decoding alone (no training, same rounds): {decode_s.rate(n).fmt(',.0f')} img/s, "
          f"{Spread.of([c for _, c in probed['decode']]).fmt('.3f')} CPU s per epoch")
    for r in rows.values():
        r.extra["bound"] = {"seconds": bound.seconds, "min_wait": bound.min_wait, "t_loop": bound.t_loop,
                            "c_loop": bound.c_loop, "c_decode": bound.c_decode, "cores": bound.cores,
                            "decoding_alone_img_s": n / decode_s.median}
    return rows


# ---------------------------------------------------------------------------- main
def _verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def summarize(results: dict, rows_n: int, images: int, smoke: bool) -> None:
    print("\n## Summary (epoch time as a multiple of the limit, median (min–max) of the per-round ratios; "
          "lower is better)")
    default = max(th for _, th in results)
    for (case, th), rows in results.items():
        ours = next(r for r in rows.values() if r.kind == "ours")
        dls = [r for r in rows.values() if r.kind == "dataloader"]
        best_dl = min(dls, key=lambda r: r.seconds)
        limit = next(r for r in rows.values() if r.kind == "limit")
        sl, n = ours.extra["slowdown"], ours.extra["repeats"]
        slow = Spread(sl, *ours.extra["slowdown_range"], n).fmt(".2f", "x")
        line = (f"{case} torch threads={th}: fastload {slow}, waits {100 * ours.wait_fraction:.0f}%; best DataLoader "
                f"({best_dl.system}) {best_dl.extra['slowdown']:.2f}x, waits {100 * best_dl.wait_fraction:.0f}%")
        note = f"epoch {slow} the limit, loop waits {100 * ours.wait_fraction:.0f}%"
        if case == "mlp":
            target = 1.10 if th == default and th > 1 else 1.05
            ok = sl <= target and (th != default or ours.seconds < best_dl.seconds)
            line += (f" — target: <= {target:.2f}x the limit" + (" and faster than the best DataLoader"
                                                               if th == default else "") + f": {_verdict(ok)}")
        else:
            b = ours.extra["bound"]
            vb = ours.extra["vs_bound"]
            vbs = Spread(vb, *ours.extra["vs_bound_range"], n).fmt(".2f", "x")
            dl_wait = max(r.wait_fraction for r in dls)
            line += (f"; CPU bound {b['seconds']:.3f} s/epoch ({b['decoding_alone_img_s']:,.0f} img/s decoding alone): "
                     f"fastload {vbs} the bound, at which the loop would wait "
                     f"{100 * b['min_wait']:.0f}%")
            if dl_wait > 0.20:
                line += (f" — target: wait <= 5% (a DataLoader waits {100 * dl_wait:.0f}%): "
                         f"{_verdict(ours.wait_fraction <= 0.05)}")
                if vb < 1:  # then it is no bound: the loop's CPU counted OpenMP's spin-waits as work
                    line += ("; fastload beats the CPU bound, which therefore overstates the loop's work here "
                             "(its CPU time includes OpenMP's spin-waits) and proves nothing")
                elif b["min_wait"] > 0.05:
                    line += (f"; not reachable on {b['cores']} CPU cores with this decoder if the loop needs all "
                             f"its CPU time: the bound implies >= {100 * b['min_wait']:.0f}%")
            note += (f", {vbs} the CPU bound {b['seconds']:.3f} s (loop CPU {b['c_loop']:.2f} s + decode CPU "
                     f"{b['c_decode']:.2f} s over {b['cores']} cores: a loop fed at the bound waits "
                     f"{100 * b['min_wait']:.0f}%)")
        print(line)
        note += f"; {best_dl.system} waits {100 * best_dl.wait_fraction:.0f}%"
        what = (f"MLP 784-256-10 on {rows_n:,} MNIST-like rows, batch 300" if case == "mlp"
                else f"small CNN on {images:,} photos, RandomResizedCrop 224, batch 32")
        first = {k: r.first_batch_s for k, r in (("Loader", ours), (best_dl.system, best_dl))
                 if r.first_batch_s and r.first_batch_s > 0}
        per_epoch = 1 / ours.samples  # samples/s -> epochs/s
        headline(f"Training loop: {what}, torch threads={th}", script="bench_loop.py", unit="epochs/s",
                 smoke=smoke, ours=("fastload Loader", ours.rate_spread.scale(per_epoch)),
                 baseline=(best_dl.system, best_dl.rate_spread.scale(1 / best_dl.samples)),
                 limit=(limit.system, limit.rate_spread.scale(1 / limit.samples)),
                 vs_baseline=ours.paired(best_dl), vs_limit=ours.paired(limit), first_batch=first or None, note=note)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat, default torch threads only")
    ap.add_argument("--only", choices=("mlp", "cnn"), default=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--images", type=int, default=640)
    a = ap.parse_args(argv)
    rows_n, images, repeats, warmup = 60_000, a.images, a.repeats, 1
    if a.smoke:
        rows_n, images, repeats, warmup = 3_000, 32, 1, 0
    default_threads = torch.get_num_threads()
    # (the smoke run measures the default setting only: the one-thread one is the same code)
    settings = [default_threads] + ([1] if default_threads != 1 and not a.smoke else [])
    tmp = Path(tempfile.mkdtemp(prefix="bench_loop_"))
    results: dict[tuple[str, int], dict[str, Measurement]] = {}
    print(f"{system_info()}; torch default intra-op threads: {default_threads}; fastload's threads at nice "
          f"{loader_nice()}")
    try:
        for th in settings:
            if a.only in (None, "mlp"):
                results[("mlp", th)] = mlp_case(tmp, rows_n, 300, repeats, warmup, th)
            if a.only in (None, "cnn"):
                results[("cnn", th)] = cnn_case(tmp, images, 32, repeats, warmup, th)
    finally:
        torch.set_num_threads(default_threads)
        shutil.rmtree(tmp, ignore_errors=True)
    summarize(results, rows_n, images, a.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the default shard verification costs: first-epoch and later-epoch throughput of a
Loader with ``verify="first-use"`` (each shard hashed, xxh3-128 in C++ with the GIL released,
before its rows are delivered; remembered for the node) against ``verify="off"``.

Three cases per policy, run interleaved (off, first-use, off, first-use, ...) on the same data
in the page cache, each first-use repeat with an empty node record (a cold node):

* first epoch on a cold node: the hashing is paid here, once per node;
* later epochs: nothing left to hash (the reader knows its shards are verified);
* first epoch after a restart (a new Loader, the record warm): only a stat() per shard.

Raw rows (MNIST-like 784 float32) are the worst case: the gather runs at memory speed, so
hashing the same bytes once costs about as much as an epoch. With images, decoding dominates
and the hash is noise (shown when ``--images`` is given).

    python bench/bench_verify.py [--samples 60000] [--repeats 5] [--images 0] [--smoke]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from fastload.bench.report import Spread, headline, paired_ratios, system_info


def _epoch_seconds(loader) -> float:
    t0 = time.perf_counter()
    for _ in loader:
        pass
    return time.perf_counter() - t0


def _let_settle() -> None:
    """A shard hashed within RACY_WINDOW_S of its last change is not remembered (it may still
    be being written), so a dataset measured right after it was written would be hashed again
    at every restart; a user's dataset is older than that. Wait the window out."""
    from fastload.store.verified_record import RACY_WINDOW_S

    time.sleep(RACY_WINDOW_S + 0.1)


def run_case(path: Path, policy: str, cache: Path, *, batch_size: int, transforms=None) -> dict:
    """Seconds of the first and second epoch of a new Loader, and of a restart's first epoch."""
    import fastload

    os.environ["FASTLOAD_CACHE"] = str(cache)
    shutil.rmtree(cache, ignore_errors=True)  # a cold node
    kw = dict(batch_size=batch_size, device="cpu", verify=policy, transforms=transforms)
    with fastload.Loader(path, **kw) as loader:
        first = _epoch_seconds(loader)
        loader.set_epoch(1)
        later = _epoch_seconds(loader)
        hashed = loader.stats()["verify"]
    with fastload.Loader(path, **kw) as loader:  # a restarted job on the same node
        restart = _epoch_seconds(loader)
        remembered = loader.stats()["verify"]
    return {"first": first, "later": later, "restart": restart, "hashed": hashed, "remembered": remembered}


def measure(path: Path, n: int, repeats: int, batch_size: int, transforms=None) -> dict:
    cache_root = Path(tempfile.mkdtemp(prefix="fastload-bench-verify-cache-"))
    try:
        runs: dict[str, list[dict]] = {"off": [], "first-use": []}
        run_case(path, "off", cache_root / "warm", batch_size=batch_size, transforms=transforms)  # warm-up
        for r in range(repeats):
            for policy in ("off", "first-use"):
                runs[policy].append(run_case(path, policy, cache_root / f"{policy}-{r}", batch_size=batch_size,
                                             transforms=transforms))
        out = {}
        for policy, rs in runs.items():
            out[policy] = {k: n / statistics.median(x[k] for x in rs) for k in ("first", "later", "restart")}
            out[policy]["spread"] = {k: Spread.of([x[k] for x in rs]).rate(n) for k in ("first", "later", "restart")}
            out[policy]["seconds"] = {k: [x[k] for x in rs] for k in ("first", "later", "restart")}
            out[policy]["hashed"] = rs[-1]["hashed"]
            out[policy]["remembered"] = rs[-1]["remembered"]
        return out
    finally:
        shutil.rmtree(cache_root, ignore_errors=True)


def print_rows(title: str, res: dict, unit: str) -> None:
    print(f"\n## {title}")
    print(f"{'policy':12s} {'first epoch':>16s} {'later epochs':>16s} {'restart, 1st epoch':>20s}  hashed")
    for policy, r in res.items():
        h = r["hashed"]
        note = (f"{h['shards_hashed']} shards, {h['bytes_hashed'] / 1e6:.0f} MB in {h['hash_s']:.3f} s; restart "
                f"hashed {r['remembered']['shards_hashed']}, remembered {r['remembered']['shards_remembered']}")
        print(f"{policy:12s} {r['first']:>12,.0f} {unit} {r['later']:>12,.0f} {unit} {r['restart']:>16,.0f} {unit}  "
              f"{note if policy != 'off' else '-'}")
    off, fu = res["off"], res["first-use"]
    print(f"first-use / off: first epoch {fu['first'] / off['first']:.2f}x, later epochs "
          f"{fu['later'] / off['later']:.2f}x, restart {fu['restart'] / off['restart']:.2f}x")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=60_000)
    ap.add_argument("--batch-size", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--images", type=int, default=0, help="also measure an image dataset of this many JPEGs")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    if a.smoke:
        a.samples, a.repeats, a.images = 6_000, 1, min(a.images, 64)
    import fastload

    old_cache = os.environ.get("FASTLOAD_CACHE")
    tmp = Path(tempfile.mkdtemp(prefix="fastload-bench-verify-"))
    try:
        n = a.samples
        rng = np.random.default_rng(0)
        with fastload.ShardWriter(tmp / "raw", {"x": "float32[784]", "label": "int64"}, label="label",
                                  shard_size="16MB") as w:
            w.write_batch({"x": rng.random((n, 784), dtype=np.float32), "label": np.arange(n) % 10})
        shards = fastload.Dataset(tmp / "raw").num_shards
        _let_settle()
        print(f"verify='first-use' vs 'off': {n:,} x 784 float32 ({n * 3136 / 1e6:.0f} MB, {shards} shards), batch "
              f"{a.batch_size}, medians of {a.repeats} interleaved repeats; {system_info()}")
        res = measure(tmp / "raw", n, a.repeats, a.batch_size)
        print_rows(f"raw rows, {n:,} x 784 float32", res, "samples/s")
        out = {"raw": res}
        if a.images:
            from fastload.demo.photos import make_image_folder
            make_image_folder(tmp / "jpg", a.images, classes=4, min_side=200, max_side=320)
            fastload.convert("imagefolder", tmp / "jpg", tmp / "img", progress=False)
            _let_settle()
            t = {"image": fastload.vision.train(224)}
            ires = measure(tmp / "img", a.images, a.repeats, 64, transforms=t)
            print_rows(f"{a.images:,} JPEGs -> vision.train(224)", ires, "img/s")
            out["images"] = ires
        off, fu = res["off"], res["first-use"]
        paired = paired_ratios(off["seconds"]["first"], fu["seconds"]["first"]) if a.repeats > 1 else None
        headline(f"shard verification (default verify='first-use'), {n:,} x 784 float32 rows, batch {a.batch_size}",
                 script="bench_verify.py", unit="samples/s", smoke=a.smoke,
                 ours=("first-use, first epoch on a cold node", fu["spread"]["first"]),
                 baseline=("verify='off', first epoch", off["spread"]["first"]), vs_baseline=paired,
                 note=f"later epochs {fu['later']:,.0f} vs {off['later']:,.0f} samples/s; first epoch after a "
                      f"restart {fu['restart']:,.0f} vs {off['restart']:,.0f}")
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old_cache is None:
            os.environ.pop("FASTLOAD_CACHE", None)
        else:
            os.environ["FASTLOAD_CACHE"] = old_cache


if __name__ == "__main__":
    main()

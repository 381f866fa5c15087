"""Sampler cost per epoch: what fastload.Sampler does against what the alternatives do.

The Sampler computes its stream **per position** (a keyed bijection of ``[0, N)``, see
``fastload.sampling``): one rank's epoch computes only its own ``N / W`` indices, in batches.
The alternatives materialise the whole epoch on every rank: torch's ``DistributedSampler``
(``torch.randperm(N).tolist()``, padded, then sliced by rank) with a ``BatchSampler``, numpy's
``Generator.permutation`` of N (a sampler that holds its permutation), and torch's
``WeightedRandomSampler`` (no rank split: it draws on every rank). The limit is memory
bandwidth: writing the rank's ``N / W`` indices (int64) once, as ``np.copyto`` of that many.

Every row yields one rank's share of an epoch (world size 8); the headline gives the
Sampler's time as ratios to DistributedSampler and to the limit (paired rounds of an
interleaved run), with its cost per index.

    python bench/bench_sampler.py [--samples 10000000] [--smoke]
"""
from __future__ import annotations

import argparse

import numpy as np

from fastload.bench.report import (Measurement, Spread, headline, interleaved_times, paired_ratios, print_table,
                                   system_info)


class _Sized:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=10_000_000)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    if a.smoke:
        a.samples, a.repeats = 100_000, 1
    import torch
    from torch.utils.data import BatchSampler, DistributedSampler, WeightedRandomSampler

    from fastload import Sampler

    n, w, b = a.samples, a.world_size, a.batch_size
    weights = (np.arange(n) % 10 + 1).astype(np.float64)
    epoch = [0]

    def ours(**kw):
        def run():
            s = Sampler(n, batch_size=b, world_size=w, rank=w - 1, seed=0, **kw)
            epoch[0] += 1
            s.set_epoch(epoch[0])
            for _ in s:
                pass
        return run

    def torch_dist():
        s = DistributedSampler(_Sized(n), num_replicas=w, rank=w - 1, seed=0)
        epoch[0] += 1
        s.set_epoch(epoch[0])
        for _ in BatchSampler(s, b, drop_last=False):
            pass

    per_rank = -(-n // w)
    src, dst = np.arange(per_rank, dtype=np.int64), np.empty(per_rank, np.int64)

    def limit():
        np.copyto(dst, src)

    def numpy_perm():
        np.random.default_rng(epoch[0]).permutation(n)

    limit_name = f"limit: write the rank's {per_rank:,} indices (memory bandwidth)"
    fns = {"fastload Sampler": ours(), "fastload Sampler, weighted": ours(weights=weights),
           "DistributedSampler + BatchSampler": torch_dist, "numpy Generator.permutation of N": numpy_perm,
           limit_name: limit}
    if n <= 2**24:  # torch.multinomial refuses more categories
        wt = torch.from_numpy(weights)

        def torch_weighted():
            # WeightedRandomSampler has no rank split: it draws the whole epoch on every rank
            for _ in BatchSampler(WeightedRandomSampler(wt, n // w), b, drop_last=False):
                pass
        fns["WeightedRandomSampler (n/W draws)"] = torch_weighted
    times = interleaved_times(fns, repeats=a.repeats)
    t = {k: Spread.of(v).median for k, v in times.items()}
    kinds = {limit_name: "limit", "DistributedSampler + BatchSampler": "dataloader"}
    rows = [Measurement.from_times(k, per_rank, per_rank * 8, v,
                                   kinds.get(k, "ours" if k.startswith("fastload") else "other"), group="epoch")
            for k, v in times.items()]
    for r in rows:
        r.note = f"{Spread.of(times[r.system]).scale(1e3).fmt('.1f')} ms per epoch"
    ms = {k: Spread.of(v).scale(1e3) for k, v in times.items()}
    ours_t, base_t, lim_t, np_t = (times[k] for k in ("fastload Sampler", "DistributedSampler + BatchSampler",
                                                      limit_name, "numpy Generator.permutation of N"))
    paired = len(ours_t) > 1
    vs_numpy = paired_ratios(np_t, ours_t).median if paired else t["numpy Generator.permutation of N"] / t[
        "fastload Sampler"]
    print(f"one rank's epoch of {n:,} samples, world size {w}, batch {b}; {system_info()}")
    print_table("sampler: one rank's epoch", rows)
    ns = 1e9 * t["fastload Sampler"] / per_rank
    print(f"fastload Sampler: {ns:.1f} ns per index of the rank; DistributedSampler / Sampler "
          f"{t['DistributedSampler + BatchSampler'] / t['fastload Sampler']:.2f}x, numpy permutation of N / Sampler "
          f"{vs_numpy:.2f}x, Sampler / limit "
          f"{t['fastload Sampler'] / t[limit_name]:.1f}x")
    headline(f"sampler, one rank's epoch of {n:,} samples, world {w}, batch {b}", script="bench_sampler.py",
             unit="ms", lower_is_better=True, smoke=a.smoke,
             ours=("Sampler (per-position stream, this rank's N/W)", ms["fastload Sampler"]),
             baseline=("DistributedSampler + BatchSampler", ms["DistributedSampler + BatchSampler"]),
             limit=(limit_name, ms[limit_name]),
             vs_baseline=paired_ratios(base_t, ours_t) if paired else None,
             vs_limit=paired_ratios(lim_t, ours_t) if paired else None,
             note=f"{ns:.1f} ns per index; numpy permutation of N: {1e3 * t['numpy Generator.permutation of N']:,.0f} "
                  f"ms ({vs_numpy:.2f}x the Sampler's time); "
                  f"weighted: {1e3 * t['fastload Sampler, weighted']:,.0f} ms")
    return rows


if __name__ == "__main__":
    main()

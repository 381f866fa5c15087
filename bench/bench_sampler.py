"""Sampler cost per epoch: fastload.Sampler against torch's DistributedSampler and
WeightedRandomSampler. The limit is the shuffle alone: one permutation of N indices by
fastload's C++ Fisher-Yates (what the Sampler's epoch costs before any batching); numpy's
``Generator.permutation`` of N is shown beside it for reference.

Every row yields one rank's share of an epoch (world size 8) as ready-to-use batches.

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

    from fastload import _C

    def limit():
        _C.permutation(np.empty(n, np.int32 if n < 2**31 else np.int64), epoch[0], 1)

    def numpy_perm():
        np.random.default_rng(epoch[0]).permutation(n)

    fns = {"fastload Sampler": ours(), "fastload Sampler, weighted": ours(weights=weights),
           "DistributedSampler + BatchSampler": torch_dist, "shuffle alone (C++ permutation of N)": limit,
           "numpy Generator.permutation of N": numpy_perm}
    if n <= 2**24:  # torch.multinomial refuses more categories
        wt = torch.from_numpy(weights)

        def torch_weighted():
            # WeightedRandomSampler has no rank split: it draws the whole epoch on every rank
            for _ in BatchSampler(WeightedRandomSampler(wt, n // w), b, drop_last=False):
                pass
        fns["WeightedRandomSampler (n/W draws)"] = torch_weighted
    times = interleaved_times(fns, repeats=a.repeats)
    t = {k: Spread.of(v).median for k, v in times.items()}
    per_rank = -(-n // w)
    kinds = {"shuffle alone (C++ permutation of N)": "limit", "DistributedSampler + BatchSampler": "dataloader"}
    rows = [Measurement.from_times(k, per_rank, per_rank * 8, v,
                                   kinds.get(k, "ours" if k.startswith("fastload") else "other"), group="epoch")
            for k, v in times.items()]
    for r in rows:
        r.note = f"{Spread.of(times[r.system]).scale(1e3).fmt('.0f')} ms per epoch"
    ms = {k: Spread.of(v).scale(1e3) for k, v in times.items()}
    ours_t, base_t, lim_t = (times[k] for k in ("fastload Sampler", "DistributedSampler + BatchSampler",
                                                "shuffle alone (C++ permutation of N)"))
    print(f"one rank's epoch of {n:,} samples, world size {w}, batch {b}; {system_info()}")
    print_table("sampler: one rank's epoch", rows)
    headline(f"sampler, one rank's epoch of {n:,} samples, world {w}, batch {b}", script="bench_sampler.py",
             unit="ms", lower_is_better=True, smoke=a.smoke,
             ours=("Sampler", ms["fastload Sampler"]),
             baseline=("DistributedSampler + BatchSampler", ms["DistributedSampler + BatchSampler"]),
             limit=("shuffle alone (C++ permutation of N)", ms["shuffle alone (C++ permutation of N)"]),
             vs_baseline=paired_ratios(base_t, ours_t) if len(ours_t) > 1 else None,
             vs_limit=paired_ratios(lim_t, ours_t) if len(ours_t) > 1 else None,
             note=f"weighted: {1e3 * t['fastload Sampler, weighted']:,.0f} ms; numpy permutation of N: "
                  f"{1e3 * t['numpy Generator.permutation of N']:,.0f} ms")
    return rows


if __name__ == "__main__":
    main()

"""convert imagefolder speed on every engine, against the raw read speed of the same files.

The limit for `convert` is reading the source files (and, since convert decodes every image
once to validate it and record its size, decoding them). This prints, in one run, for the
same JPEG folder (real photos from scikit-image, 300-500 px, quality 90):

  raw read           open + read every file, nothing else (page cache warm) -> the I/O limit
  read + decode      the same plus a full PIL decode of each                -> the validation limit
  local w=N          --engine local (this process writes, N validation processes)
  ray w=1, ray w=2   --engine ray: a private local Ray with 1 and 2 CPUs, one task per group
  torch 2 ranks      --engine torch under `torchrun --standalone --nproc-per-node 2`

Every engine row runs `fastload.convert` in a fresh process and times the whole call
(planning, starting Ray or the process group, the tasks, the commit; "tasks alone" is the
task phase only, without the engine's start), and reports the peak
memory (RSS) of one converting worker: a Ray worker or a torch task process (each reads,
PIL-validates and DALI-checks its images); for local, the larger of the writer process (which
reads and DALI-checks the images) and its PIL validation processes, both shown. `--shard-size` is chosen so the source
makes about 16 groups (4 with --smoke, which also leaves out ray w=1).

    python bench/bench_convert.py [--images 2000] [--repeats 3] [--smoke] [--ray-address HOST:PORT]

``--ray-address`` (default ``$FASTLOAD_BENCH_RAY_ADDRESS``) runs the ray rows on a Ray cluster
that is already running, which the times then include instead of a private Ray's start (the
tests' smoke run joins the session's cluster, tests/_ray.py).
"""
from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fastload.bench.report import Measurement, headline, interleaved_times, print_table, system_info

# One conversion in a fresh process; writes its summary and the peak memory of the process
# and of its largest finished child (the local engine's validation processes) as JSON to
# a file of its own per rank (torchrun's ranks share one stdout, where their lines can mix).
_RUN = """
import json, os, resource, sys
from fastload.convert import convert
r = convert(**json.loads(sys.argv[1]))
r["self_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
r["children_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
with open(sys.argv[2] + "." + os.environ.get("RANK", "0"), "w") as f:
    json.dump(r, f)
"""


def run_engine(src: Path, dst: Path, engine: str, workers: int, shard_size: int, ranks: int = 1,
               ray_address: str | None = None) -> dict:
    shutil.rmtree(dst, ignore_errors=True)
    kw = {"kind": "imagefolder", "src": str(src), "dst": str(dst), "engine": engine,
          "workers": workers, "shard_size": shard_size, "allow_small_shards": True,  # groups, on purpose
          "progress": False}
    if engine == "ray" and ray_address:
        kw["ray_address"] = ray_address
    args = json.dumps(kw)
    result = dst.parent / f"result-{engine}"
    for old in dst.parent.glob(f"result-{engine}.*"):
        old.unlink()
    cmd = [sys.executable, "-c", _RUN, args, str(result)]
    if engine == "torch":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               "--no-python", *cmd]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{engine} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    r = json.loads(Path(f"{result}.0").read_text())  # rank 0's (the one that committed)
    r["wall"] = wall
    if engine == "local":  # the work is split: the writer DALI-checks, the validation processes PIL-decode
        r["worker_peak_rss_bytes"] = max(r["self_peak_rss_bytes"], r["children_peak_rss_bytes"])
    return r


def have_ray() -> bool:
    return subprocess.run([sys.executable, "-c", "import ray"], capture_output=True).returncode == 0


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny run that only checks the script works")
    ap.add_argument("--ray-address", default=os.environ.get("FASTLOAD_BENCH_RAY_ADDRESS") or None,
                    help="run the ray rows on this running Ray cluster (HOST:PORT) instead of a private Ray "
                         "each (default: $FASTLOAD_BENCH_RAY_ADDRESS)")
    a = ap.parse_args(argv)
    if a.smoke:
        a.images, a.repeats = 60, 1
    from PIL import Image

    from fastload.demo.photos import make_image_folder
    from fastload.runtime.system import usable_cores

    tmp = Path(tempfile.mkdtemp(prefix="fastload-bench-convert-"))
    try:
        src = make_image_folder(tmp / "src", a.images, seed=0)
        files = sorted(p for p in src.rglob("*.jpg"))
        nbytes = sum(p.stat().st_size for p in files)
        shard_size = max(64 * 1024, nbytes // (4 if a.smoke else 16))  # groups for the distributed engines

        def raw_read():
            for p in files:
                with open(p, "rb") as f:
                    f.read()

        def read_decode():
            for p in files:
                with open(p, "rb") as f:
                    Image.open(io.BytesIO(f.read())).load()

        t = interleaved_times({"raw": raw_read, "decode": read_decode}, repeats=a.repeats)
        rows = [Measurement.from_times("raw read", a.images, nbytes, t["raw"], "limit", "I/O limit, page cache warm"),
                Measurement.from_times("read + PIL decode (1 process)", a.images, nbytes, t["decode"], "other",
                                       "what validation must do")]
        cpus = usable_cores()
        configs = [("local", cpus, 1, f"--engine local --workers {cpus}")]
        skipped = []
        if have_ray():
            if not a.smoke:  # (the smoke run only checks that each engine works)
                configs.append(("ray", 1, 1, "--engine ray --workers 1"))
            configs.append(("ray", 2, 1, "--engine ray --workers 2"))
        else:
            skipped.append("--engine ray (not installed: pip install 'fastload[ray]')")
        configs.append(("torch", 1, 2, "--engine torch, torchrun 2 ranks"))
        for engine, workers, ranks, label in configs:
            runs = [run_engine(src, tmp / "dst", engine, workers, shard_size, ranks, a.ray_address)
                    for _ in range(a.repeats)]
            runs.sort(key=lambda r: r["seconds"])
            r = runs[len(runs) // 2]  # the median run
            peak = max(x["worker_peak_rss_bytes"] for x in runs) / 2**20
            tasks = f"tasks alone {a.images / r['tasks_seconds']:,.0f}/s; " if r.get("tasks_seconds") else ""
            split = ""
            if engine == "local":
                split = (f" (writer {max(x['self_peak_rss_bytes'] for x in runs) / 2**20:.0f} MB, validators "
                         f"{max(x['children_peak_rss_bytes'] for x in runs) / 2**20:.0f} MB)")
            joined = f" (joined the Ray at {a.ray_address})" if engine == "ray" and a.ray_address else ""
            m = Measurement.from_times(label, a.images, nbytes, [x["seconds"] for x in runs], "ours",
                                       f"{tasks}{peak:.0f} MB peak RSS per worker{split}; {r['num_shards']} shards; "
                                       f"{r['wall']:.1f} s with process start{joined}")
            m.extra = {"engine": engine, "workers": workers, "ranks": ranks, "worker_peak_rss_mb": peak,
                       "tasks_seconds": r.get("tasks_seconds"),
                       "heavy_modules": r.get("worker_heavy_modules", [])}
            rows.append(m)
        print(f"convert imagefolder: {a.images} JPEGs, {nbytes / 1e6:.1f} MB, groups of ~{shard_size / 1e6:.1f} MB; "
              f"{system_info()}")
        print_table("fastload convert imagefolder, every engine (whole call: plan, engine start, tasks, commit)", rows)
        for s in skipped:
            print(f"not measured: {s}")
        ours = [r for r in rows if r.kind == "ours"]
        best = max(ours, key=lambda r: r.samples_per_s)
        headline(f"`convert imagefolder`, {a.images:,} JPEGs ({nbytes / 1e6:.0f} MB)", script="bench_convert.py",
                 unit="img/s", smoke=a.smoke, ours=(best.system, best.rate_spread),
                 baseline=("read + PIL decode", rows[1].rate_spread), limit=("raw read", rows[0].rate_spread),
                 note="every image fully decoded to validate it; ray/torch include their start-up; engines run "
                      "one after the other, not round-robin")
        return rows
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

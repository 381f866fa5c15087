"""convert imagefolder speed against the raw read speed of the same files.

The limit for `convert` is reading the source files (and, since convert decodes every image
once to validate it and record its size, decoding them). This prints, in one run, for the
same JPEG folder (real photos from scikit-image, 300-500 px, quality 90):

  raw read        open + read every file, nothing else (page cache warm)   -> the I/O limit
  read + decode   the same plus a full PIL decode of each                  -> the validation limit
  convert w=N     fastload.convert("imagefolder") with N validation workers

    python bench/bench_convert.py [--images 2000] [--smoke]
"""
from __future__ import annotations

import argparse
import io
import shutil
import tempfile
from pathlib import Path

from fastload.bench.report import Measurement, headline, median_seconds, print_table, system_info
from fastload.system import usable_cores


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny run that only checks the script works")
    a = ap.parse_args(argv)
    if a.smoke:
        a.images, a.repeats = 40, 1
    from PIL import Image

    import fastload
    from fastload.sample_data import make_image_folder

    tmp = Path(tempfile.mkdtemp(prefix="fastload-bench-convert-"))
    try:
        src = make_image_folder(tmp / "src", a.images, seed=0)
        files = sorted(p for p in src.rglob("*.jpg"))
        nbytes = sum(p.stat().st_size for p in files)

        def raw_read():
            for p in files:
                with open(p, "rb") as f:
                    f.read()

        def read_decode():
            for p in files:
                with open(p, "rb") as f:
                    Image.open(io.BytesIO(f.read())).load()

        def convert(workers):
            def run():
                fastload.convert("imagefolder", src, tmp / "dst", workers=workers, overwrite=True, progress=False)
            return run

        t_raw = median_seconds(raw_read, repeats=a.repeats)
        t_dec = median_seconds(read_decode, repeats=a.repeats)
        rows = [Measurement("raw read", a.images, nbytes, t_raw, "limit", "I/O limit, page cache warm"),
                Measurement("read + PIL decode", a.images, nbytes, t_dec, "other", "what validation must do")]
        for w in sorted({0, usable_cores()}):
            rows.append(Measurement(f"fastload convert workers={w}", a.images, nbytes,
                                    median_seconds(convert(w), repeats=a.repeats), "ours"))
        for r in rows[2:]:
            r.note = f"{t_dec / r.seconds:.2f}x read+decode"
        print(f"convert imagefolder: {a.images} JPEGs, {nbytes / 1e6:.1f} MB; {system_info()}")
        print_table("fastload convert imagefolder", rows)
        best = max(rows[2:], key=lambda r: r.samples_per_s)
        headline(f"`convert imagefolder`, {a.images:,} JPEGs ({nbytes / 1e6:.0f} MB)", script="bench_convert.py",
                 unit="img/s", smoke=a.smoke, ours=(best.system.replace("fastload convert ", ""), best.samples_per_s),
                 baseline=("read + PIL decode", rows[1].samples_per_s), limit=("raw read", rows[0].samples_per_s),
                 note="every image fully decoded to validate it")
        return rows
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

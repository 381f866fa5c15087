"""Run every benchmark in bench/, one after the other, each in its own process.

    python bench/run_all.py                # the full suite (tens of minutes on 2 cores)
    python bench/run_all.py --smoke        # tiny sizes: checks every script still works (CI)
    python bench/run_all.py --only tensor,jpeg --out results.txt

Exits non-zero if any script fails. ``--out`` also writes everything printed to a file (the
README's results table is made from such a file; say which machine).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = sorted(p.stem[len("bench_"):] for p in HERE.glob("bench_*.py"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat")
    ap.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(SCRIPTS)}")
    ap.add_argument("--out", default=None, help="also write the output to this file")
    a = ap.parse_args(argv)
    names = SCRIPTS if a.only is None else [n.strip() for n in a.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCRIPTS]
    if unknown:
        ap.error(f"unknown benchmark(s) {unknown}; choose from {SCRIPTS}")
    out = open(a.out, "w") if a.out else None
    failed = []
    try:
        for n in names:
            cmd = [sys.executable, str(HERE / f"bench_{n}.py")] + (["--smoke"] if a.smoke else [])
            header = f"\n# bench_{n}.py{' --smoke' if a.smoke else ''}\n"
            print(header, flush=True)
            t0 = time.perf_counter()
            p = subprocess.run(cmd, capture_output=True, text=True)
            text = p.stdout + (f"\n[stderr]\n{p.stderr[-3000:]}" if p.returncode else "")
            print(text, flush=True)
            print(f"(bench_{n}.py: exit {p.returncode}, {time.perf_counter() - t0:.0f} s)", flush=True)
            if out:
                out.write(header + text + "\n")
            if p.returncode:
                failed.append(n)
    finally:
        if out:
            out.close()
    if failed:
        print(f"FAILED: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

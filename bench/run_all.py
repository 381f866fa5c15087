"""Run every benchmark in bench/, one after the other, each in its own process.

    python bench/run_all.py                # the full suite (tens of minutes on 2 cores)
    python bench/run_all.py --smoke        # tiny sizes: checks every script still works (CI)
    python bench/run_all.py --smoke --jobs 2   # the same, two scripts at a time
    python bench/run_all.py --only tensor,jpeg --out results.txt
    python bench/run_all.py --docs         # full suite, then rewrite the docs' Results table
    python bench/run_all.py --docs --only sampler   # measure one script again: only its rows change

Exits non-zero if any script fails. ``--out`` also writes everything printed to a file. Every
script records its headline (fastload, the baseline, the limit, measured in one run) through
``fastload.bench.report.headline``; ``--results FILE`` writes those records as JSON, ``--markdown FILE`` as
the results table, and ``--docs`` replaces the table between the markers in docs/benchmarks.md
(full runs only: smoke-size figures are never published). ``--readme`` is its old name.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fastload.bench.report import RESULTS_ENV, markdown_table

HERE = Path(__file__).resolve().parent

RESULTS_PAGE = HERE.parent / "docs" / "benchmarks.md"  # the Benchmarks page of the docs site
BEGIN, END = "<!-- bench-results:begin -->", "<!-- bench-results:end -->"
_FIRST = ["tensor", "tokens", "jpeg", "loop", "cow", "sampler", "open", "convert", "remote", "verify"]  # table order
SCRIPTS = sorted((p.stem[len("bench_"):] for p in HERE.glob("bench_*.py")),
                 key=lambda n: (_FIRST.index(n) if n in _FIRST else len(_FIRST), n))


def main(argv=None, run=subprocess.run) -> int:
    """``run``: how a script's process is run (``subprocess.run``'s signature; the tests
    fork theirs from a launcher that has imported torch once)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat")
    ap.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(SCRIPTS)}")
    ap.add_argument("--jobs", type=int, default=1,
                    help="with --smoke: run this many scripts side by side (they only check that each works)")
    ap.add_argument("--out", default=None, help="also write the output to this file")
    ap.add_argument("--results", default=None, help="write every script's headline record (JSON) here")
    ap.add_argument("--markdown", default=None, help="write the results table (markdown) here")
    ap.add_argument("--docs", "--readme", dest="docs", action="store_true",
                    help="rewrite the Results table of docs/benchmarks.md from this run (full runs only)")
    a = ap.parse_args(argv)
    if a.docs and a.smoke:
        ap.error("--docs publishes figures: run the full suite, not --smoke")
    if a.jobs < 1 or (a.jobs > 1 and not a.smoke):
        ap.error(f"--jobs {a.jobs}: scripts side by side would measure each other; "
                 "use --jobs 2 or more only with --smoke (default 1)")
    names = SCRIPTS if a.only is None else [n.strip() for n in a.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCRIPTS]
    if unknown:
        ap.error(f"unknown benchmark(s) {unknown}; choose from {SCRIPTS}")
    out = open(a.out, "w") if a.out else None
    failed = []
    records: list[dict] = []

    def one(n: str):
        cmd = [sys.executable, str(HERE / f"bench_{n}.py")] + (["--smoke"] if a.smoke else [])
        rec_file = HERE / f".results-{os.getpid()}-{n}.jsonl"
        rec_file.unlink(missing_ok=True)
        env = {**os.environ, RESULTS_ENV: str(rec_file)}
        t0 = time.perf_counter()
        try:
            p = run(cmd, capture_output=True, text=True, env=env)
            mine = []
            if rec_file.exists():
                mine = [json.loads(line) for line in rec_file.read_text().splitlines() if line.strip()]
        finally:
            rec_file.unlink(missing_ok=True)
        return p, mine, time.perf_counter() - t0

    pool = ThreadPoolExecutor(a.jobs) if a.jobs > 1 else None
    try:
        # side by side (--jobs, smoke only), each script's output still printed whole, in order
        runs = [pool.submit(one, n) for n in names] if pool else None
        for i, n in enumerate(names):
            header = f"\n# bench_{n}.py{' --smoke' if a.smoke else ''}\n"
            print(header, flush=True)
            p, mine, took = runs[i].result() if runs else one(n)
            records += mine
            text = p.stdout + (f"\n[stderr]\n{p.stderr[-3000:]}" if p.returncode else "")
            if p.returncode == 0 and not mine:
                text += f"\nbench_{n}.py recorded no headline (call fastload.bench.report.headline)"
                failed.append(n)
            print(text, flush=True)
            print(f"(bench_{n}.py: exit {p.returncode}, {took:.0f} s)", flush=True)
            if out:
                out.write(header + text + "\n")
            if p.returncode:
                failed.append(n)
    finally:
        if pool:
            pool.shutdown(wait=True, cancel_futures=True)
        if out:
            out.close()
    if failed:
        print(f"FAILED: {failed}", file=sys.stderr)
        return 1
    table = markdown_table(records)
    print("\n# Results table\n\n" + table)
    if a.results:
        Path(a.results).write_text(json.dumps(records, indent=1) + "\n")
    if a.markdown:
        Path(a.markdown).write_text(table + "\n")
    if a.docs:
        update_results_page(records, table, names)
    return 0


def update_results_page(records: list[dict], table: str, names: list[str], page: Path = RESULTS_PAGE) -> None:
    """Replace the text between BEGIN and END in docs/benchmarks.md (written to a temporary
    file and renamed, so an interrupted run never leaves a half-written page).

    A run of every script replaces the whole table. A run of some (``--only``) replaces only
    their rows, in place, keeps every other row as it was published, and adds a line saying
    which rows were measured when, on what machine (the other rows keep their own line)."""
    text = page.read_text()
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise SystemExit(f"{page}: expected one {BEGIN} ... {END} block to replace")
    head, rest = text.split(BEGIN, 1)
    old, tail = rest.split(END, 1)
    machines = "; ".join(sorted({r["machine"] for r in records}))
    today = datetime.date.today().isoformat()
    old_rows = [line for line in old.splitlines() if _ROW.match(line)]
    if set(names) == set(SCRIPTS) or not old_rows:
        only = "" if set(names) == set(SCRIPTS) else f" --only {','.join(names)}"
        block = f"_Generated on {today} by `python bench/run_all.py --docs{only}` on: {machines}._\n\n{table}\n"
    else:
        block = _merge_rows(old, old_rows, table, names, today, machines)
    tmp = page.with_suffix(".md.tmp")
    tmp.write_text(f"{head}{BEGIN}\n{block}{END}{tail}")
    os.replace(tmp, page)
    print(f"\nwrote the results table into {page}")


_ROW = re.compile(r"^\| .*\(`python bench/(bench_\w+)\.py`\) \|")  # a table row and its script


def _all_rerun(line: str, rerun: set[str]) -> bool:
    """Whether ``line`` is an earlier partial run's attribution whose rows are all measured again."""
    if not line.startswith("_Rows of "):
        return False
    return set(re.findall(r"(bench_\w+)\.py", line.split(" measured again", 1)[0])) <= rerun


def _merge_rows(old: str, old_rows: list[str], table: str, names: list[str], today: str, machines: str) -> str:
    """The block with the rows of ``names``' scripts replaced by ``table``'s (each script's
    rows where its old ones stood; a script with no old row after the others)."""
    rerun = {f"bench_{n}" for n in names}
    new_rows: dict[str, list[str]] = {}
    for line in table.splitlines():
        m = _ROW.match(line)
        if m:
            new_rows.setdefault(m.group(1), []).append(line)
    rows: list[str] = []
    for line in old_rows:
        script = _ROW.match(line).group(1)  # type: ignore[union-attr]  # old_rows all match
        if script not in rerun:
            rows.append(line)
        elif script in new_rows:
            rows += new_rows.pop(script)
    for script in sorted(new_rows):
        rows += new_rows[script]
    scripts = ", ".join(f"bench_{n}.py" for n in names)
    lead = [line for line in old.splitlines() if line.startswith("_") and not _all_rerun(line, rerun)]
    command = f"python bench/run_all.py --docs --only {','.join(names)}"
    lead.append(f"_Rows of {scripts} measured again on {today} by `{command}` on: {machines}._")
    header = table.splitlines()[:2]
    return "\n\n".join(lead) + "\n\n" + "\n".join(header + rows) + "\n"


if __name__ == "__main__":
    sys.exit(main())

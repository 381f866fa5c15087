"""The ``fastload`` command: convert, inspect, verify, bench, demo."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


class _Fail(Exception):
    """A user-facing error: printed as one line, exit code 1 (2 for bad usage)."""

    def __init__(self, msg: str, code: int = 1):
        super().__init__(msg)
        self.code = code


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n}"


# -- convert -----------------------------------------------------------------------------
def cmd_convert(a) -> int:
    from .convert import ConvertError, convert

    try:
        r = convert(a.kind, a.src, a.dst, workers=a.workers, shard_size=a.shard_size, on_error=a.on_error,
                    overwrite=a.overwrite, label=a.label, image_columns=a.image_column or (),
                    max_pixels=a.max_pixels, progress=not a.quiet)
    except (ConvertError, FileExistsError, FileNotFoundError, ValueError) as e:
        raise _Fail(str(e)) from None
    rate = r["num_samples"] / r["seconds"] if r["seconds"] else float("inf")
    print(f"wrote {r['num_samples']} samples in {r['num_shards']} shard(s), {_human(r['bytes'])}, to {r['dst']} "
          f"in {r['seconds']:.1f} s ({rate:,.0f} samples/s)")
    if r["skipped"]:
        print(f"skipped {r['skipped']} sample(s) that could not be read; the list is in {r['report']}")
    return 0


# -- inspect -----------------------------------------------------------------------------
def inspect_text(path: str | os.PathLike) -> str:
    from .store import Dataset

    ds = Dataset(path)
    m = ds.manifest
    lines = [f"dataset   {ds.path}",
             f"format    fastload v{m['format_version']}",
             f"samples   {len(ds):,}",
             f"shards    {ds.num_shards} ({_human(m['total_bytes'])}; "
             f"{min(ds.shard_sizes, default=0):,}..{max(ds.shard_sizes, default=0):,} samples each)",
             "fields"]
    for name, f in ds.fields.items():
        extra = " (label)" if name == ds.label_field else ""
        lines.append(f"  {name:<20} {f.kind:<7} {str(f) if f.fixed or f.ragged else ''}{extra}")
    if ds.class_counts is not None:
        counts = ds.class_counts
        names = ds.class_names or [str(i) for i in range(len(counts))]
        total = max(int(counts.sum()), 1)
        lines.append(f"classes   {len(counts)} (min {int(counts.min()) if len(counts) else 0}, "
                     f"max {int(counts.max()) if len(counts) else 0} samples per class)")
        for i, (n, c) in enumerate(zip(names, counts.tolist())):
            if i == 20:
                lines.append(f"  … {len(counts) - 20} more")
                break
            lines.append(f"  {i:>4} {n:<24} {c:>9,} {100 * c / total:5.1f}%")
    skipped = ds.path / "skipped.jsonl"
    if skipped.exists():
        with open(skipped) as f:
            lines.append(f"skipped   {sum(1 for _ in f)} source sample(s) at convert time (see {skipped})")
    return "\n".join(lines)


def cmd_inspect(a) -> int:
    from .store import FormatError

    try:
        if a.json:
            from .store import Dataset
            print(json.dumps(Dataset(a.path).manifest, indent=1))
        else:
            print(inspect_text(a.path))
    except (FormatError, FileNotFoundError) as e:
        raise _Fail(str(e)) from None
    return 0


# -- verify ------------------------------------------------------------------------------
def cmd_verify(a) -> int:
    from .store import FormatError, verify

    try:
        problems = verify(a.path)
    except (FormatError, FileNotFoundError) as e:
        raise _Fail(str(e)) from None
    if problems:
        for p in problems:
            print(f"DAMAGED {p}")
        print(f"{a.path}: {len(problems)} problem(s) found")
        return 1
    print(f"{a.path}: OK (checksums and Arrow validation passed)")
    return 0


# -- demo --------------------------------------------------------------------------------
def cmd_demo(a) -> int:
    from .demo import run_demo

    return run_demo(out=Path(a.out), num_images=a.images, quick=a.quick)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fastload", description="Arrow-shard data loading for PyTorch at hardware speed.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser("convert", help="turn a source (image folder, arrays, table, tar shards) into a dataset")
    c.add_argument("kind", choices=["imagefolder", "arrays", "table", "webdataset"], help="source kind")
    c.add_argument("src", help="source file or directory")
    c.add_argument("dst", help="dataset directory to create (must be new or empty)")
    c.add_argument("--workers", type=int, default=None, help="processes that read and validate (default: CPU count)")
    c.add_argument("--shard-size", default="256MB", help="bytes per shard, e.g. 256MB, 1GiB (default 256MB)")
    c.add_argument("--on-error", choices=["raise", "skip"], default="raise",
                   help="a bad sample stops the run (raise) or is left out and listed in DST/skipped.jsonl (skip)")
    c.add_argument("--overwrite", action="store_true", help="replace the fastload dataset already in DST")
    c.add_argument("--label", default=None, help="label column / array name (default: 'label' or 'labels' if present)")
    c.add_argument("--image-column", action="append", help="table column holding image paths or bytes (repeatable)")
    c.add_argument("--max-pixels", type=int, default=None, help="refuse images with more pixels than this")
    c.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    c.set_defaults(func=cmd_convert)

    i = sub.add_parser("inspect", help="print fields, counts, shards, sizes and class balance")
    i.add_argument("path")
    i.add_argument("--json", action="store_true", help="print the manifest as JSON")
    i.set_defaults(func=cmd_inspect)

    v = sub.add_parser("verify", help="recompute checksums and validate every shard; exit 1 if any is damaged")
    v.add_argument("path")
    v.set_defaults(func=cmd_verify)

    d = sub.add_parser("demo", help="generate a small photo dataset, convert it, load it, benchmark it")
    d.add_argument("--out", default="fastload-demo", help="output directory (default ./fastload-demo)")
    d.add_argument("--images", type=int, default=512, help="number of JPEGs to generate (default 512)")
    d.add_argument("--quick", action="store_true", help="smaller and faster (for CI)")
    d.set_defaults(func=cmd_demo)

    from .bench import add_bench_parser
    add_bench_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        return int(a.func(a) or 0)
    except _Fail as e:
        print(f"fastload {a.command}: error: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print(f"fastload {a.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""The ``fastload`` command: convert, inspect, verify, recover, prefetch, bench, doctor, demo.

This module imports nothing heavy: the parser is built from the standard library alone, so
``fastload --help`` answers at once, and each command imports its own module when it runs
(``convert``, ``inspect`` and ``verify`` never load torch or DALI).

Output conventions, the same for every command:

* results go to stdout, errors to stderr as one line ``fastload COMMAND: error: ...``
  (exit status 1; 2 for bad usage; 130 on Ctrl-C);
* ``--json [FILE]`` writes the command's JSON document to FILE, or to stdout when FILE is
  omitted or ``-``; when the JSON goes to stdout, stdout carries the JSON document only
  (a command's human-readable report, if any, goes to stderr);
* a closed stdout (``fastload inspect --json DS | head``) ends the command quietly with
  exit status 141 (128 + SIGPIPE), as for other Unix tools.
"""
from __future__ import annotations

import argparse
import os
import sys

EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a tool stopped by a closed pipe
STDOUT = "-"


class Output:
    """Where a command writes. ``text`` is the stream for the human-readable report (stdout,
    or stderr when ``--json`` sends the JSON document to stdout); ``json(doc)`` writes the
    JSON document to the ``--json`` destination."""

    def __init__(self, json_dest: str | None = None):
        self.json_dest = json_dest
        self.text = sys.stderr if json_dest == STDOUT else sys.stdout

    def print(self, *args, **kwargs) -> None:
        print(*args, file=self.text, **kwargs)

    def json(self, doc) -> None:
        import json

        text = json.dumps(doc, indent=1) + "\n"
        if self.json_dest in (None, STDOUT):
            sys.stdout.write(text)
            return
        from .files import atomic_write

        dest = self.json_dest
        try:  # an interrupted run never leaves a half-written file
            atomic_write(dest, text)
        except OSError as e:
            from .errors import UsageError

            raise UsageError(f"cannot write --json {dest}: {e.strerror or e}") from None
        self.print(f"wrote {dest}")


def add_json_option(p: argparse.ArgumentParser, what: str) -> None:
    """The one ``--json [FILE]`` option of every command (see the module docstring)."""
    p.add_argument("--json", nargs="?", const=STDOUT, default=None, metavar="FILE",
                   help=f"write {what} as JSON to FILE, or to stdout if FILE is omitted or '-' "
                        "(stdout then holds the JSON only)")


def check_json_dest(a: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """``fastload inspect --json DS``: argparse gives DS to ``--json`` (its value is optional);
    with the positional ``path`` left empty, DS is the dataset and the JSON goes to stdout."""
    if a.path is None:
        if a.json in (None, STDOUT):
            parser.error("the following arguments are required: PATH")
        a.path, a.json = a.json, STDOUT
    if a.json not in (None, STDOUT):
        parent = os.path.dirname(os.path.abspath(a.json))
        if not os.path.isdir(parent):
            from .errors import UsageError

            raise UsageError(f"cannot write --json {a.json}: directory {parent} does not exist")


# -- convert -----------------------------------------------------------------------------
def cmd_convert(a, out: Output) -> int:
    from .convert import convert
    from .errors import FastloadError, UsageError
    from .files import printable
    from .errors import format_bytes

    kw = dict(workers=a.workers, shard_size=a.shard_size, on_error=a.on_error, label=a.label,
              image_columns=a.image_column or (), max_pixels=a.max_pixels, progress=not a.quiet,
              engine=a.engine, ray_address=a.ray_address, resume=a.resume,
              allow_small_shards=a.force_small_shards, max_size=a.max_size, quality=a.quality)
    if a.kind == "coco":  # fastload convert coco INSTANCES_JSON IMAGES_DIR DST
        if a.coco_dst is None:
            raise UsageError("coco takes three paths: fastload convert coco INSTANCES_JSON IMAGES_DIR DST", code=2)
        a.dst, a.coco_dst = a.coco_dst, a.dst
        kw.update(images=a.coco_dst, masks=a.masks, skip_empty=a.skip_empty)
    elif a.coco_dst is not None or a.masks or a.skip_empty:
        extra = f"a third path ({a.coco_dst})" if a.coco_dst is not None else ("--masks" if a.masks else "--skip-empty")
        raise UsageError(f"{extra}: only for coco sources (fastload convert coco INSTANCES_JSON IMAGES_DIR DST)",
                         code=2)
    kw.update({k: v for k, v in (("min_frames", a.min_frames), ("video_codec", a.video_codec)) if v is not None})
    try:  # (an object-store DST: see convert(); every engine writes there, the manifest last)
        r = convert(a.kind, a.src, a.dst, overwrite=a.overwrite, **kw)
    except (FastloadError, OSError, ValueError) as e:  # ENOSPC, a FIFO, a bad option: one line
        raise UsageError(printable(str(e))) from None
    if r.get("rank", 0) != 0:  # torchrun: rank 0 reports for all
        return 0
    rate = r["num_samples"] / r["seconds"] if r["seconds"] else float("inf")
    out.print(f"wrote {r['num_samples']} samples in {r['num_shards']} shard(s), {format_bytes(r['bytes'])}, "
              f"to {r['dst']} in {r['seconds']:.1f} s ({rate:,.0f} samples/s)")
    if r.get("max_pixels"):
        out.print(f"images were checked with PIL and DALI (the Loader's decoder) and limited to {r['max_pixels']:,} "
                  "pixels each (--max-pixels; the Loader's transforms refuse larger ones too)")
    if r.get("max_size"):
        out.print(f"{r.get('resized_images') or 0:,} image(s) with a longer side above {r['max_size']} pixels were "
                  f"stored re-encoded at {r['max_size']} (--max-size); the others as they were")
    if r["skipped"]:
        out.print(f"skipped {r['skipped']} sample(s) that could not be read; the list is in {r['report']}")
    if "tasks_run" in r:
        out.print(f"{a.engine}: {r['num_groups']} group(s); {r['tasks_run']} converted by this run, "
                  f"{r['tasks_reused']} reused from an interrupted one")
    if r.get("resumed_changed"):  # --resume: finished groups whose files changed in place were redone
        from .convert.sourcestate import shown

        redo = r["resumed_changed"]
        files = [p for g in sorted(redo) for p in redo[g]]
        out.print(f"--resume: {len(files)} source file(s) had changed since their group was converted "
                  f"({shown(files, os.path.abspath(a.src))}); group(s) {', '.join(map(str, sorted(redo)))} were "
                  "converted again from the files as they are now, the other finished groups reused")
    return 0


# -- inspect -----------------------------------------------------------------------------
def cmd_inspect(a, out: Output) -> int:
    from .errors import UsageError
    from .store import FormatError
    from .store.inspect import inspect_json, inspect_text

    try:
        if a.json is not None:
            out.json(inspect_json(a.path))
        else:
            out.print(inspect_text(a.path))
    except (FormatError, FileNotFoundError) as e:
        raise UsageError(str(e)) from None
    return 0


# -- verify ------------------------------------------------------------------------------
def cmd_verify(a, out: Output) -> int:
    from .errors import UsageError
    from .store import FormatError, verify

    from .remote.url import is_remote

    try:
        if is_remote(a.path):  # every shard downloaded and checked, or the copy in --local DIR
            from .convert.publish import verify_remote

            problems = verify_remote(a.path, local=a.local)
        elif a.local is not None:
            raise UsageError("--local DIR checks a copy against a remote dataset: give the URL as PATH")
        else:
            problems = verify(a.path)
    except (FormatError, FileNotFoundError) as e:
        raise UsageError(str(e)) from None
    if a.json is not None:
        out.json({"path": str(a.path), "ok": not problems, "problems": [str(p) for p in problems]})
    if problems:
        for p in problems:
            out.print(f"DAMAGED {p}")
        out.print(f"{a.path}: {len(problems)} problem(s) found")
        return 1
    out.print(f"{a.path}: OK (checksums and Arrow validation passed)")
    return 0


# -- recover -----------------------------------------------------------------------------
def cmd_recover(a, out: Output) -> int:
    from pathlib import Path

    from .errors import UsageError
    from .store.transaction import recover

    path = Path(a.path)
    if not path.is_dir():
        raise UsageError(f"{path} is not a directory (give the dataset directory an overwrite was replacing)")
    did = recover(path)
    out.print(f"{path}: {did or 'no interrupted overwrite to finish'}")
    return 0


# -- prefetch ----------------------------------------------------------------------------
def cmd_prefetch(a, out: Output) -> int:
    from .convert.publish import prefetch
    from .errors import format_bytes

    def progress(done: int, total: int) -> None:
        if not a.quiet:
            print(f"\r{done}/{total} shards", end="" if done < total else "\n", file=sys.stderr, flush=True)

    r = prefetch(a.url, a.dir, threads=a.threads, progress=progress)
    out.print(f"mirrored {r['shards']} shard(s) of {a.url} into {r['dst']} ({format_bytes(r['bytes_downloaded'])} "
              "downloaded); checksums and Arrow validation passed")
    return 0


# -- demo --------------------------------------------------------------------------------
def cmd_demo(a, out: Output) -> int:
    from pathlib import Path

    from .demo import run_demo

    return run_demo(out=Path(a.out), num_images=a.images, quick=a.quick)


def cmd_bench(a, out: Output) -> int:
    from .bench.cli import run_command

    return run_command(a, out)


def cmd_doctor(a, out: Output) -> int:
    from .doctor import run_command

    return run_command(a, out)


def _version() -> str:
    from . import __version__

    return f"fastload {__version__} (Python {sys.version.split()[0]})"


def build_parser() -> argparse.ArgumentParser:
    from .bench.cli import add_bench_arguments

    p = argparse.ArgumentParser(
        prog="fastload", description="Arrow-shard data loading for PyTorch at hardware speed.",
        epilog="Every command writes results to stdout and errors to stderr. '--json [FILE]' writes JSON to "
               "FILE, or to stdout when FILE is omitted or '-' (stdout then holds the JSON only). "
               "Exit status: 0 ok, 1 failed, 2 bad usage, 130 interrupted, 141 stdout closed early.")
    p.add_argument("--version", action="version", version=_version())
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser("convert", help="turn a source (image folder, arrays, table, tar shards) into a dataset")
    c.add_argument("kind", choices=["imagefolder", "arrays", "table", "webdataset", "coco", "videofolder",
                                    "audiofolder"], help="source kind")
    c.add_argument("src", help="source file or directory")
    c.add_argument("dst", help="dataset directory to create (must be new or empty), or an object-store URL "
                               "(s3://, gs://, az://): shards uploaded (by the tasks with ray/torch), the manifest last")
    c.add_argument("coco_dst", nargs="?", default=None, metavar="COCO_DST",
                   help="coco only: `convert coco INSTANCES_JSON IMAGES_DIR DST` (SRC is the JSON, then the "
                        "images folder, then DST)")
    c.add_argument("--masks", action="store_true",
                   help="coco: add a 'mask' field, an 8-bit PNG of category ids per image (0 = background; ids "
                        "must be 1..255), rasterised from polygons and RLE")
    c.add_argument("--skip-empty", action="store_true", help="coco: leave out images without annotations")
    c.add_argument("--workers", type=int, default=None,
                   help="tasks converting at once: validation processes (local, default: CPU count), Ray tasks "
                        "(ray, default: the cluster's CPUs), worker processes of all ranks together (torch, split "
                        "between the ranks, at least one each; default one per rank)")
    c.add_argument("--shard-size", default="256MB", help="bytes per shard, e.g. 256MB, 1GiB (default 256MB)")
    c.add_argument("--on-error", choices=["raise", "skip"], default="raise",
                   help="a bad sample stops the run (raise) or is left out and listed in DST/skipped.jsonl (skip)")
    c.add_argument("--overwrite", action="store_true", help="replace the fastload dataset already in DST")
    c.add_argument("--label", default=None, help="label column / array name (default: 'label' or 'labels' if present)")
    c.add_argument("--image-column", action="append", help="table column holding image paths or bytes (repeatable)")
    c.add_argument("--max-pixels", type=int, default=None,
                   help="refuse images with more pixels than this (default 2**26 = 67,108,864, the Loader's limit)")
    c.add_argument("--max-size", type=int, default=None, metavar="N",
                   help="store images pre-resized: those whose longer side exceeds N pixels are re-encoded with "
                        "a longer side of N (aspect kept, Lanczos, EXIF orientation applied; JPEG stays JPEG, PNG "
                        "stays PNG, other formats become JPEG); the others are stored unchanged (N >= 16)")
    c.add_argument("--quality", type=int, default=None, metavar="Q",
                   help="JPEG quality of the images --max-size re-encodes (1-100, default 90)")
    c.add_argument("--min-frames", type=int, default=None, metavar="N",
                   help="videofolder: refuse (or with --on-error skip, leave out) videos of fewer than N frames "
                        "(by default a short video is padded with its last frame when a clip is cut)")
    c.add_argument("--video-codec", choices=["keep", "vp9"], default=None,
                   help="videofolder: vp9 re-encodes the videos DALI's CPU decoder cannot read (H.264, HEVC, "
                        "MPEG-4, AV1) as VP9, so the dataset decodes without a GPU; keep (default) stores them as is")
    c.add_argument("--force-small-shards", action="store_true",
                   help="allow --shard-size below 1 MB (one shard per few samples)")
    c.add_argument("--engine", choices=["local", "ray", "torch"], default="local",
                   help="local: this machine's process pool (default); ray: one Ray task per group of about "
                        "one shard; torch: the ranks of torchrun share the groups (see docs/how-to/convert-at-scale.md)")
    c.add_argument("--ray-address", default=None, metavar="auto|HOST:PORT",
                   help="--engine ray: join this Ray cluster (default: a private Ray on this machine, 127.0.0.1 only)")
    c.add_argument("--resume", action="store_true",
                   help="--engine ray/torch: finish an interrupted conversion into DST, reusing its finished parts. "
                        "A source whose files were added or removed, or whose table/.npy/.tar files changed, is "
                        "refused (the error names the files; --overwrite starts over); finished groups whose "
                        "images changed in place are converted again (and the run says which)")
    c.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    c.set_defaults(func=cmd_convert)

    i = sub.add_parser("inspect", help="print fields, counts, shards, sizes and class balance",
                       usage="%(prog)s [-h] [--json [FILE]] PATH",
                       description="Print a dataset's fields, counts, shards, sizes and class balance; with "
                                   "--json, its manifest as JSON (to stdout, or to FILE).")
    i.add_argument("path", nargs="?", metavar="PATH", help="a dataset directory or URL (required)")
    add_json_option(i, "the manifest")
    i.set_defaults(func=cmd_inspect, json_check=lambda a: check_json_dest(a, i))

    v = sub.add_parser("verify", help="recompute checksums and validate every shard; exit 1 if any is damaged",
                       usage="%(prog)s [-h] [--local DIR] [--json [FILE]] PATH")
    # PATH is optional to argparse only: ``verify --json DS`` hands DS to --json, and
    # check_json_dest moves it back (a missing PATH is still a usage error there)
    v.add_argument("path", nargs="?", metavar="PATH",
                   help="a dataset directory, or a URL (every shard is downloaded and checked) (required)")
    v.add_argument("--local", metavar="DIR", default=None,
                   help="with a URL: check the shards in DIR (a prefetched copy, a cache directory) against "
                        "the URL's manifest instead of downloading")
    add_json_option(v, "the result ({path, ok, problems})")
    v.set_defaults(func=cmd_verify, json_check=lambda a: check_json_dest(a, v))

    r = sub.add_parser("recover", help="finish (or roll back) an overwrite of a dataset that was killed while it "
                       "swapped the new dataset in; changes nothing when there is none")
    r.add_argument("path", help="the dataset directory")
    r.set_defaults(func=cmd_recover)

    f = sub.add_parser("prefetch", help="mirror a remote dataset into a plain, verified local dataset")
    f.add_argument("url", help="s3://, gs://, az://, abfs:// or https:// URL of a dataset")
    f.add_argument("dir", help="local directory to create (new or empty)")
    f.add_argument("--threads", type=int, default=8, help="downloads in flight (default 8)")
    f.add_argument("-q", "--quiet", action="store_true", help="no progress")
    f.set_defaults(func=cmd_prefetch)

    d = sub.add_parser("demo", help="generate a small photo dataset, convert it, load it, benchmark it")
    d.add_argument("--out", default="fastload-demo", help="output directory (default ./fastload-demo)")
    d.add_argument("--images", type=int, default=512, help="number of JPEGs to generate (default 512)")
    d.add_argument("--quick", action="store_true", help="smaller and faster (for CI)")
    d.set_defaults(func=cmd_demo)

    b = add_bench_arguments(sub)
    add_json_option(b, "every figure and the machine description")
    b.set_defaults(func=cmd_bench, json_check=lambda a: check_json_dest(a, b))

    from .doctor import add_arguments as add_doctor_arguments

    dr = sub.add_parser("doctor", help="check this machine before a long job: GPUs, CUDA builds, limits, "
                        "threads, every preset's DALI graph (exit 1 on any fail)",
                        description="One ok/warn/fail line per check: GPUs and driver, torch/DALI CUDA builds, "
                                    "ulimit -l and -n, /dev/shm, this rank's threads, and every preset's DALI "
                                    "graph (validated offline without a GPU). Exit status 1 if any check fails.")
    add_doctor_arguments(dr)
    dr.set_defaults(func=cmd_doctor)
    return p


def _quiet_stdout() -> None:
    """After a broken pipe: point stdout at /dev/null so that the interpreter's final flush
    of what is still buffered cannot raise again at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # pragma: no cover - stdout without a file descriptor
        pass


def main(argv: list[str] | None = None) -> int:
    from .errors import FastloadError, UsageError

    parser = build_parser()
    try:
        try:
            a = parser.parse_args(argv)
        except SystemExit:  # --help, --version, a usage error: argparse printed and exits
            sys.stdout.flush()  # here, so that a closed pipe is seen now and not at exit
            raise
        try:
            check = getattr(a, "json_check", None)
            if check is not None:
                check(a)
            code = int(a.func(a, Output(getattr(a, "json", None))) or 0)
        except UsageError as e:
            print(f"fastload {a.command}: error: {e}", file=sys.stderr)
            return e.code
        except FastloadError as e:
            print(f"fastload {a.command}: error: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print(f"fastload {a.command}: interrupted", file=sys.stderr)
            return 130
        sys.stdout.flush()  # inside the try: a reader that went away is seen here, not at exit
        return code
    except BrokenPipeError:
        _quiet_stdout()
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())

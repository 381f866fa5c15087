"""``fastload bench DST``: can this loader keep a GPU fed on my data?

Iterates a dataset with the chosen settings and reports samples/s, MB/s, time to first
batch, per-stage times and the stall fraction; ``--compare torch`` runs
``torch.utils.data.DataLoader`` on the same data doing the same work (PIL decode and the same
augmentations, with the same crop windows, for images) in the same run; ``--limit`` adds the
hardware limit for the workload (memcpy of the same bytes for raw fields, the transform's whole DALI graph
alone for images). ``--json [FILE]`` writes every figure with the machine description (to
stdout when FILE is omitted or '-'; the text report then goes to stderr); ``--plot`` draws them.
"""
from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, fields

from .models import STEPS

__all__ = ["DEVICES", "TRANSFORMS", "BenchOptions", "add_bench_arguments", "run_command"]

TRANSFORMS = ("train224", "eval224", "none")
DEVICES = ("auto", "cpu", "cuda")
COMPARES = ("torch",)


def _int(name: str, v, low: int, *, none_ok: bool = False) -> None:
    from ..errors import UsageError

    if v is None and none_ok:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise UsageError(f"--{name.replace('_', '-')}={v!r} must be an int >= {low}"
                         + (" (or left unset)" if none_ok else ""))


def _choice(name: str, v, allowed) -> None:
    from ..errors import UsageError

    if v not in allowed:
        raise UsageError(f"--{name.replace('_', '-')}={v!r} must be one of {', '.join(map(str, allowed))}")


@dataclass(frozen=True)
class BenchOptions:
    """What ``fastload bench`` measures (the output options --json/--plot are not here).
    Checked on creation: a bad value raises ``UsageError`` naming it and what is allowed."""

    batch_size: int = 64
    transform: str = "train224"
    device: str = "auto"
    epochs: int = 1
    world_size: int = 1
    threads: int | None = None
    compare: str | None = None
    workers: tuple[int, ...] = (0, 2)
    limit: bool = False
    max_batches: int | None = None
    warmup: int = 3
    step_ms: float = 0.0
    step: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        from ..errors import UsageError

        for name in ("batch_size", "epochs", "world_size"):
            _int(name, getattr(self, name), 1)
        _int("threads", self.threads, 1, none_ok=True)
        _int("max_batches", self.max_batches, 1, none_ok=True)
        _int("warmup", self.warmup, 0)
        _choice("transform", self.transform, TRANSFORMS)
        _choice("device", self.device, DEVICES)
        if self.compare is not None:
            _choice("compare", self.compare, COMPARES)
        if not self.workers:
            raise UsageError("--workers names no num_workers value; give e.g. 0,2")
        for w in self.workers:
            _int("workers", w, 0)
        if isinstance(self.step_ms, bool) or not isinstance(self.step_ms, (int, float)) \
                or not math.isfinite(self.step_ms) or self.step_ms < 0:
            raise UsageError(f"--step-ms={self.step_ms!r} must be a number >= 0")
        if self.step is not None:
            _choice("step", self.step, STEPS)
            if self.step_ms:
                raise UsageError(f"--step {self.step} and --step-ms {self.step_ms:g}: choose one training step "
                                 "(a real model, or a simulated one)")

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> BenchOptions:
        from ..errors import UsageError

        try:
            workers = tuple(int(w) for w in str(a.workers).split(",") if w.strip())
        except ValueError:
            raise UsageError(f"--workers={a.workers!r} must be comma-separated ints, e.g. 0,2") from None
        kw = {f.name: getattr(a, f.name) for f in fields(cls) if f.name != "workers"}
        return cls(workers=workers, **kw)


def add_bench_arguments(sub) -> argparse.ArgumentParser:
    """The ``bench`` subcommand's parser (standard library only: building it imports no torch).
    The caller adds ``--json`` (the convention shared by every command)."""
    d = BenchOptions()
    b = sub.add_parser("bench", help="measure a dataset's loading speed (optionally against torch's DataLoader)",
                       usage="%(prog)s [options] PATH", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("path", nargs="?", metavar="PATH", help="a dataset made by fastload convert (required)")
    b.add_argument("--batch-size", type=int, default=d.batch_size)
    b.add_argument("--transform", choices=TRANSFORMS, default=d.transform,
                   help=f"for image fields (default {d.transform})")
    b.add_argument("--device", choices=DEVICES, default=d.device)
    b.add_argument("--epochs", type=int, default=d.epochs)
    b.add_argument("--world-size", type=int, default=d.world_size, help="simulate rank 0 of this many ranks")
    b.add_argument("--threads", type=int, default=d.threads, help="loader threads (default: measured default)")
    b.add_argument("--compare", choices=COMPARES, default=d.compare, help="also run torch's DataLoader")
    b.add_argument("--workers", default=",".join(map(str, d.workers)),
                   help=f"num_workers values for --compare torch (default {','.join(map(str, d.workers))})")
    b.add_argument("--limit", action="store_true", help="also measure the hardware limit for this workload")
    b.add_argument("--max-batches", type=int, default=d.max_batches, help="stop each epoch after this many batches")
    b.add_argument("--warmup", type=int, default=d.warmup, help="untimed batches per system before measuring")
    b.add_argument("--step-ms", type=float, default=d.step_ms, help="simulated training step per batch (ms)")
    b.add_argument("--step", choices=STEPS, default=d.step,
                   help="a real training step per batch: forward + backward + SGD of an MLP (784-256-10 on a float "
                        "tensor field) or a small CNN (on the decoded images), on the batch's device; on the CPU "
                        "it shares the cores with the loader as a user's model does")
    b.add_argument("--plot", default=None, metavar="PNG", help="draw throughput and stall fraction to this PNG")
    b.add_argument("--no-progress", dest="progress", action="store_false")
    return b


def print_report(report: dict, out) -> None:
    """The text report of one ``fastload bench`` run, through ``out.print``."""
    from .report import Measurement, format_table, system_info

    rows = [Measurement.from_dict(r) for r in report["results"]]
    out.print(report["title"])
    out.print(f"machine: {system_info(report['machine'])}" + ("" if report["machine"]["gpu"] else "; GPU: none"))
    out.print(format_table(rows, rate="MB/s"))
    ours = rows[0]
    st = ours.stages
    s = report["settings"]
    if s.get("step"):
        how = f"; training step: {s['step']} ({ours.extra.get('steps', 0)} forward + backward + SGD steps, real)"
    elif s["step_ms"]:
        how = f"; training step: simulated, {s['step_ms']:g} ms"
    else:
        how = (" (no training step: use --step mlp|cnn for a real one on the CPU, or --step-ms to simulate one, "
               "to see whether loading keeps up)")
    out.print(f"fastload stages: gather {st['gather_s']:.3f} s, decode {st['decode_s']:.3f} s, "
              f"copy {st['copy_s']:.3f} s; the loop waited {100 * (ours.wait_fraction or 0):.0f}% of the time" + how)
    for s in report["not_measured"]:
        out.print(f"not measured: {s}")


def run_command(a: argparse.Namespace, out) -> int:
    """``fastload bench``: check the arguments, run, print the report, write --json/--plot."""
    from ..errors import UsageError

    opts = BenchOptions.from_args(a)
    if a.plot is not None:
        if not a.plot.lower().endswith(".png"):
            raise UsageError(f"--plot={a.plot}: give a .png file name")
        parent = os.path.dirname(os.path.abspath(a.plot))
        if not os.path.isdir(parent):
            raise UsageError(f"cannot write {a.plot}: directory {parent} does not exist")
        try:  # before any work: a missing matplotlib must not cost a whole benchmark run
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError(f"--plot={a.plot} needs matplotlib, which is not installed: "
                             "pip install 'fastload[bench]' (or pip install matplotlib), "
                             "or leave out --plot") from None
    from .machine import equal_priority
    from .runs import run

    nice_was = os.environ.get("FASTLOAD_NICE")
    try:
        if opts.step is None and not opts.step_ms:  # loaders side by side, no training step: one priority
            equal_priority()                        # (with a step, the Loader's own default is what counts)
        report = run(a.path, opts)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(str(e)) from None
    finally:  # (called in-process too: the environment is left as it was)
        if nice_was is None:
            os.environ.pop("FASTLOAD_NICE", None)
        else:
            os.environ["FASTLOAD_NICE"] = nice_was
    print_report(report, out)
    if a.json is not None:
        out.json(report)
    if a.plot:
        from .report import Measurement, plot

        plot([Measurement.from_dict(r) for r in report["results"]], a.plot, report["title"])
        out.print(f"wrote {a.plot}")
    return 0

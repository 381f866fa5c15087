"""One task of a distributed conversion: convert one group of the plan into its part.

``run_group(dst, g)`` is the whole task, the same on every engine. It opens the group's
rows of the source (see plan.py), runs fastload's own single-process conversion
(``run_convert``: every check, the skipped report) into ``g-NNNNNNNN.attempt-<random>/``,
records ``part.json`` there and renames the attempt to ``g-NNNNNNNN/``. So:

* the part's name depends only on the group: a retried or duplicated task finds the part
  done and returns at once, or redoes exactly the same work;
* a killed attempt leaves only its ``.attempt-*`` directory, which nothing reads (the
  commit removes it with the parts directory);
* two attempts running at once both finish, the first rename wins and the other deletes
  its copy (renaming onto a non-empty directory fails).

For an object-store DST (objstore.py) the task converts into local scratch space instead,
uploads the shards under their final names (named by the group: a retry PUTs the same
bytes to the same keys) and then its record ``.fastload-parts/g-NNNNNNNN.json``.

A task returns a small dict (counts, timings, its process id and peak memory), never
sample data. A sample error under ``on_error="raise"`` comes back as ``{"error": ...}``
naming the sample's key, not as an exception, so an engine does not retry it.
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from ._store import MANIFEST, PARTS, SKIPPED_REPORT, fsync_dir, read_report, write_json
from .common import ConvertError, Source, run_convert
from .objstore import Store, record_name, remote_shard_name
from .plan import Plan, load_plan
from .parts import PART, _intact_record, discard_group, finished_groups, finished_part, read_part  # noqa: F401
from .sourcestate import SourceChanged

TASK_THREADS = 1  # the CPUs a task may use: Ray gives each task num_cpus=1
# Heavy modules a task reports having loaded. torch must never be among them (~1.9 s and
# ~250 MB per process); DALI is expected in a task that converts images: every image is also
# decoded by the Loader's decoder, DALI on the CPU (see imagecheck.py), and non-image sources
# never load it.
HEAVY_MODULES = ("torch", "nvidia.dali")


class RangeSource(Source):
    """Samples ``start..stop-1`` of another source, numbered from 0 (keys unchanged)."""

    def __init__(self, inner: Source, start: int, stop: int):
        super().__init__(fields=inner.fields, num_samples=stop - start, label=inner.label,
                         class_names=inner.class_names, metadata=inner.metadata, max_pixels=inner.max_pixels,
                         max_size=inner.max_size, quality=inner.quality)
        self.inner, self.start = inner, start
        self.opened = inner.opened

    def inputs(self):
        return self.inner.inputs()

    def key(self, i: int) -> str:
        return self.inner.key(self.start + i)

    def read(self, i: int) -> dict[str, Any]:
        return self.inner.read(self.start + i)

    def check(self, i: int) -> tuple[dict[str, tuple[int, int]], dict[str, bytes]]:
        return self.inner.check(self.start + i)

    def fast_chunks(self):
        chunks = self.inner.fast_chunks()
        return None if chunks is None else self._ranged(chunks)

    def _ranged(self, chunks):
        a, b = self.start, self.start + self.num_samples
        for s, e, batch in chunks:  # the inner chunks are views: skipping them costs nothing
            lo, hi = max(s, a), min(e, b)
            if lo < hi:
                yield lo - a, hi - a, {n: v[lo - s:hi - s] for n, v in batch.items()}
            if e >= b:
                break

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()


def open_group(plan: Plan, g: int) -> Source:
    """The source of group ``g`` alone: same fields, keys, labels and class names as the
    whole source, samples numbered from 0."""
    a, b = plan.bounds(g)
    spec, opts = plan.spec, plan.options
    resize = {"max_size": opts.get("max_size"), "quality": opts.get("quality")}  # (absent from older plans)
    if plan.kind in ("imagefolder", "videofolder", "audiofolder"):
        from .imagefolder import ImageFolderSource
        from .media import AudioFolderSource, VideoFolderSource
        from .plan import _media_options

        cls = {"imagefolder": ImageFolderSource, "videofolder": VideoFolderSource,
               "audiofolder": AudioFolderSource}[plan.kind]
        if plan.kind != "imagefolder":
            resize = _media_options(opts)  # (what a media folder takes instead)
        rows = _listing_rows(plan, a, b)
        paths = [os.fsdecode(p) for p in rows.column("path").to_pylist()]  # bytes: any file name
        return cls.from_listing(
            spec["root"], spec["classes"], np.array(paths, dtype=str),
            rows.column("label").to_numpy(), spec["ignored"], opts["max_pixels"], spec.get("repeated_dirs", 0),
            **resize)
    if plan.kind == "table":
        from .table import TableSource

        return TableSource(plan.src, label=spec["label"], image_columns=spec["image_columns"],
                           max_pixels=opts["max_pixels"], rows=(a, b), classes=spec["classes"], detect_images=False,
                           ragged=spec.get("ragged", ()), media_columns=spec.get("media_columns", {}), **resize)
    if plan.kind == "coco":
        from .coco import CocoSource

        return CocoSource.from_listing(plan.src, spec["images"], _listing_rows(plan, a, b), spec["metadata"],
                                       masks=spec["masks"], max_pixels=opts["max_pixels"])
    from .kinds import make_source

    if plan.kind == "arrays":  # (the only kind left that takes --label; a webdataset's label is its .cls)
        return RangeSource(make_source("arrays", plan.src, label=spec.get("label")), a, b)
    return RangeSource(make_source(plan.kind, plan.src, max_pixels=opts["max_pixels"], **resize), a, b)


def _listing_rows(plan: Plan, a: int, b: int):
    """Rows ``a..b-1`` of the listing the plan wrote (an image folder's files, coco's
    annotations): only the row groups needed are read, also under an object store's parts prefix."""
    from .table import parquet_rows

    if plan.remote:
        with Store(plan.dst).open_input(f"{PARTS}/{plan.spec['listing']}") as f:
            return parquet_rows(f, a, b)
    return parquet_rows(plan.parts / plan.spec["listing"], a, b)


def _peak_rss() -> int:
    """Peak resident memory of this process's program, in bytes. Linux's VmHWM (unlike
    getrusage's maxrss, which keeps the high-water mark of a parent the process was forked
    from before it exec'd: a torch-sized rank for the torch engine's workers)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux; macOS: bytes


def _result(rec: dict, t0: float, reused: bool) -> dict:
    return {"group": rec["group"], "num_samples": rec["num_samples"], "skipped": rec["skipped"],
            "source_samples": rec["stop"] - rec["start"], "seconds": time.perf_counter() - t0, "reused": reused,
            "pid": os.getpid(), "host": socket.gethostname(),
            "peak_rss_bytes": _peak_rss(),
            "heavy_modules": [m for m in HEAVY_MODULES if m in sys.modules], "error": None}


def _count_lines(path: Path) -> int:
    try:
        with open(path, encoding="utf-8") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def _convert_group(plan: Plan, g: int, on_error: str, out: Path, t0: float) -> dict:
    """Convert group ``g`` into the local directory ``out``: the record of the part, or a
    result dict with the error (a data error: reported, never retried)."""
    a, b = plan.bounds(g)
    where = f"group {g} (samples {a}..{b - 1})"

    def failed(msg: str) -> dict:
        shutil.rmtree(out, ignore_errors=True)
        return {**_result({"group": g, "num_samples": 0, "skipped": 0, "start": a, "stop": b}, t0, False),
                "error": f"{where}: {msg}"}

    try:
        source = open_group(plan, g)
    except ConvertError as e:
        return failed(str(e))
    try:
        changed = _unplanned(plan, source.opened)  # the files read as the source opened: the plan's?
        if changed:
            return {**failed(f"{plan.src} changed since the conversion was planned: {changed}; the planned groups "
                             "no longer fit it: pass --overwrite (instead of --resume) to convert it as it is now"),
                    "source_changed": True}
        fields = {n: f.to_json() for n, f in source.fields.items()}
        if fields != plan.fields or source.num_samples != b - a:
            return failed(f"the source changed since the conversion was planned (fields {fields} and "
                          f"{source.num_samples} samples, planned {plan.fields} and {b - a}); start over "
                          "with --overwrite")
        try:
            # one CPU per task (Ray's num_cpus=1, one torch worker process): one validation
            # process (this one) and one DALI decoder thread, never a pool sized to the machine
            r = run_convert(source, out, workers=1, shard_size=plan.part_shard_size, on_error=on_error,
                            progress=False, desc=f"group {g}", check_threads=TASK_THREADS, record_inputs=True)
            n, skipped = r["num_samples"], r["skipped"]
            inputs = [x for x in r["inputs"] if x[0] not in source.opened]  # (those are the plan's)
        except SourceChanged as e:
            return failed(str(e))
        except ConvertError as e:
            if not (on_error == "skip" and _count_lines(out / SKIPPED_REPORT) == b - a):
                return failed(str(e))
            n, skipped = 0, b - a  # every sample of the group skipped: an empty part
            inputs = _states(source)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            close()
    return {"group": g, "start": a, "stop": b, "num_samples": n, "skipped": skipped,
            "seconds": round(time.perf_counter() - t0, 3), "host": socket.gethostname(), "pid": os.getpid(),
            "inputs": inputs}


def _unplanned(plan: Plan, opened: dict) -> str:
    """How the files a group's source read as it opened (its table, ``.npy`` or ``.tar``
    files) differ from the plan's fingerprint; "" when they do not."""
    from .sourcestate import describe

    planned = {p: None if s is None else (s, m) for p, s, m in plan.fingerprint}
    changed = [p for p in opened if p in planned and planned[p] != (None if opened[p] is None else tuple(opened[p]))]
    added = [p for p in opened if p not in planned]
    removed = [p for p in planned if p not in opened]
    src = Path(plan.src)
    return describe(src if src.is_dir() else src.parent, changed=changed, added=added, removed=removed)


def _states(source: Source) -> list[list]:
    """``[[path, size, mtime_ns], ...]`` of the files ``source`` reads besides those it read
    as it opened (sourcestate.py)."""
    from .sourcestate import as_records, stat_files

    paths = [p for p in source.inputs() if p not in source.opened]
    return as_records(paths, stat_files(paths))


def run_group(dst: str, g: int, on_error: str = "raise") -> dict:
    """Convert group ``g`` of the plan in ``dst`` (idempotent); return a small result dict."""
    t0 = time.perf_counter()
    plan = load_plan(dst)
    if plan.remote:
        return _run_remote_group(plan, g, on_error, t0)
    final = plan.part_dir(g)
    done = finished_part(final)
    if done is not None:
        return _result(done, t0, reused=True)
    attempt = plan.parts / f"{final.name}.attempt-{uuid.uuid4().hex[:12]}"
    rec = _convert_group(plan, g, on_error, attempt, t0)
    if rec.get("error"):
        return rec
    write_json(attempt / PART, rec)
    try:
        os.rename(attempt, final)  # fails when another attempt of this group got there first
    except OSError:
        winner = read_part(final)
        shutil.rmtree(attempt, ignore_errors=True)
        if winner is None:
            raise
        return _result(winner, t0, reused=True)
    fsync_dir(plan.parts)
    return _result(rec, t0, reused=False)


def _run_remote_group(plan: Plan, g: int, on_error: str, t0: float) -> dict:
    """The task for an object-store DST (objstore.py): convert into local scratch space, PUT
    the shards under their final names, then the group's record (last: the group is done)."""
    import tempfile

    store = Store(plan.dst)
    done = _intact_record(store.get_json(record_name(g)), store.size, plan.token)
    if done is not None:
        return _result(done, t0, reused=True)
    with tempfile.TemporaryDirectory(prefix=f"convert-part-{g}-", dir=_scratch_root()) as tmp:
        out = Path(tmp) / "part"
        rec = _convert_group(plan, g, on_error, out, t0)
        if rec.get("error"):
            return rec
        m = None
        if rec["num_samples"]:
            with open(out / MANIFEST, encoding="utf-8") as f:
                m = json.load(f)
            shards = []
            for j, s in enumerate(m["shards"]):  # named by the group: a retry PUTs the same bytes to the same keys
                name = remote_shard_name(g, j, plan.token)
                store.put_file(out / s["file"], name)
                shards.append({**s, "file": name})
            m["shards"] = shards
        rec = {**rec, "token": plan.token, "manifest": m, "report": read_report(out)}
        store.put_json(record_name(g), rec)  # last: from here on the group counts as done
    return _result(rec, t0, reused=False)


def _scratch_root() -> Path:
    """Where an object-store task converts its group before uploading it: fastload's cache
    directory (:func:`fastload.runtime.system.cache_root`: $FASTLOAD_CACHE, ~/.cache/fastload, or
    without a home directory $XDG_CACHE_HOME/fastload or a private temporary directory; the
    temporary directory itself when none of those is safely this user's)."""
    import tempfile

    from ..runtime.system import cache_root

    root = cache_root()
    if root is None:
        return Path(tempfile.gettempdir())
    root.mkdir(parents=True, exist_ok=True)
    return root

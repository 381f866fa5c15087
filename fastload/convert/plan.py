"""The plan of a distributed conversion: the source order cut into groups of about one shard.

The driver numbers the source samples exactly as a single-process ``convert`` does, then cuts
that order into equal runs of ``group_size`` samples, sized from an estimate of the bytes per
stored sample so that one group makes about one shard. The plan is written to
``DST/.fastload-parts/plan.json`` (plus, for an image folder, the listing of its files as
``files.parquet``) before any task starts, so a restarted or resumed conversion uses the very
same groups. It is small: a task reads the plan, then its own row range of the source. For
an object-store DST the plan is made in a local scratch directory and uploaded under
``DST/.fastload-parts/`` (``plan.json`` last), with the shard-name token of the conversion
(see objstore.py).

What a task needs to open its group without redoing the driver's work (``spec``):

* ``imagefolder``: the driver walks SRC once and writes the listing (path, label) to the parts
  directory; a task reads its row range of that listing.
* ``table``: the file list at scale. A task reads only its rows (Parquet: only the row groups
  holding them); the driver reads the schema, the first rows and, for a string label column,
  that one column (for the class names). Nobody walks or stats every file.
* ``arrays``, ``webdataset``: each task opens the source (memory-mapped .npy, tar headers)
  and takes its range.

What the plan read is recorded (sourcestate.py): the listing for an image folder, the
state (size, modification time) of the table, ``.npy`` or ``.tar`` files (``fingerprint``)
otherwise; each finished group's record adds the state of every other file it read (its
images). ``--resume`` refuses a source whose listing or files of the fingerprint changed,
naming the files (``--overwrite`` converts it anew), and converts again the finished groups
whose own files changed in place (``Plan.redo`` says which); the commit refuses a source
changed while the run went on.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from ..files import atomic_write
from ..remote.url import display_url
from ._store import MAX_SHARD_SIZE, PARTS, check_destination, remove_tree, write_json
from .common import ConvertError, Source
from .objstore import Store, check_remote_destination, is_remote

PLAN = "plan.json"
LISTING = "files.parquet"
PLAN_FORMAT = "fastload-convert-plan"
PLAN_VERSION = 2  # 2: the fingerprint names its files by absolute path; groups record what they read
_SAMPLE_FOR_ESTIMATE = 256  # samples read (evenly spaced) to estimate the bytes per sample
_LISTING_ROW_GROUP = 65536


@dataclass
class Plan:
    dst: str
    kind: str
    src: str
    options: dict           # label, image_columns, max_pixels, max_size, quality, shard_size: what the user asked
    num_samples: int
    group_size: int
    bytes_per_sample: float
    spec: dict              # how a task opens its group (see the module docstring)
    fields: dict            # name -> Field JSON, as every part must have them
    label: str | None = None
    class_names: list | None = None
    metadata: dict = field(default_factory=dict)
    fingerprint: list = field(default_factory=list)
    overwrite: bool = False
    created: float = 0.0
    token: str | None = None  # object-store DST: the shard-name token of this conversion (objstore.py)
    # --resume: {group: [files changed in place since it was converted]} of the finished groups
    # the resume converts again (not part of the plan on disk)
    redo: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def remote(self) -> bool:
        """DST is an object store (objstore.py), not a directory."""
        return is_remote(self.dst)

    @property
    def parts_where(self) -> str:
        """Where the plan and the finished parts are, to name it in messages."""
        return f"{display_url(self.dst)}/{PARTS}" if self.remote else str(self.parts)

    @property
    def num_groups(self) -> int:
        return max(1, math.ceil(self.num_samples / self.group_size))

    def bounds(self, g: int) -> tuple[int, int]:
        if not 0 <= g < self.num_groups:
            raise IndexError(f"group {g} is not in 0..{self.num_groups - 1}")
        return g * self.group_size, min(self.num_samples, (g + 1) * self.group_size)

    @property
    def parts(self) -> Path:
        return Path(self.dst) / PARTS

    def part_dir(self, g: int) -> Path:
        """The part of group ``g``: its name depends on the group only, so a retried or
        duplicated task finds (or makes) the same part."""
        return self.parts / f"g-{g:08d}"

    @property
    def part_shard_size(self) -> int:
        """The writer's budget inside a part: a group makes one shard unless the estimate
        was far off (then a second one rather than a huge one)."""
        return min(MAX_SHARD_SIZE, 2 * int(self.options["shard_size"]))

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("redo")
        return {"format": PLAN_FORMAT, "version": PLAN_VERSION, **d}


def load_plan(dst: str | os.PathLike) -> Plan:
    import json

    if is_remote(dst):
        store = Store(dst)
        path, d = store.where(f"{PARTS}/{PLAN}"), store.get_json(f"{PARTS}/{PLAN}")
        if d is None:
            raise ConvertError(f"{path}: no conversion plan here; the parts prefix must stay until the commit")
    else:
        path = Path(dst) / PARTS / PLAN
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except FileNotFoundError:
            raise ConvertError(f"{path}: no conversion plan here; on a cluster, DST must be a path every node sees "
                               "(a shared filesystem), and the parts directory must stay until the commit") from None
        except ValueError as e:
            raise ConvertError(f"{path}: not a readable plan ({e})") from None
    if not isinstance(d, dict) or d.pop("format", None) != PLAN_FORMAT or d.pop("version", None) != PLAN_VERSION:
        raise ConvertError(f"{path}: not a plan of this fastload version; start over with --overwrite")
    return Plan(**d)


# -- sizing ------------------------------------------------------------------------------
def _stored_bytes(source: Source, i: int) -> int | None:
    """About what sample ``i`` takes in a shard (None when it cannot be read: a bad sample
    is the task's to report, not the planner's)."""
    try:
        sample = source.read(i)
    except Exception:
        return None
    n = len(source.key(i))
    for name, f in source.fields.items():
        v = sample.get(name)
        if f.fixed:
            n += f.row_nbytes
        elif hasattr(v, "nbytes"):  # a ragged row (numpy)
            n += int(v.nbytes)
        elif isinstance(v, str):
            n += len(v.encode())
        elif f.kind == "image" and v is not None:
            n += _stored_image_bytes(v, source.max_size) + 8
        elif v is not None:
            n += len(v)
    return n


def _stored_image_bytes(data: bytes, max_size: int | None) -> int:
    """An image's bytes as stored: with ``max_size``, a larger image scaled by its area (from
    its header: a rough estimate, enough to size the groups)."""
    if max_size is None:
        return len(data)
    from ..store.geometry import image_size
    from .images import pil_limit

    try:
        with pil_limit(None):  # a header read: no PIL bomb warning (the task checks the limit)
            w, h = image_size(data)
    except Exception:  # a bad image is the task's to report
        return len(data)
    longer = max(w, h)
    return len(data) if longer <= max_size else max(1, int(len(data) * (max_size / longer) ** 2))


def estimate_bytes_per_sample(source: Source, rows: Sequence[int] | None = None) -> float:
    """Mean stored bytes of up to 256 evenly spaced samples (a deterministic choice)."""
    if source.fields and all(f.fixed for f in source.fields.values()):
        return float(sum(f.row_nbytes for f in source.fields.values()) + len(source.key(0)))
    n = source.num_samples
    idx = rows if rows is not None else np.unique(np.linspace(0, n - 1, min(n, _SAMPLE_FOR_ESTIMATE)).astype(np.int64))
    sizes = [s for s in (_stored_bytes(source, int(i)) for i in idx) if s is not None]
    return float(np.mean(sizes)) if sizes else 1.0


def _fingerprint(source: Source) -> list:
    """``[[path, size, mtime_ns], ...]`` of the files the source read when it opened (its
    table, ``.npy`` or ``.tar`` files; taken before reading them), sorted by path."""
    from .sourcestate import as_records

    paths = sorted(source.opened)
    states = np.array([(-1, -1) if source.opened[p] is None else source.opened[p] for p in paths],
                      dtype=np.int64).reshape(-1, 2)
    return as_records(paths, states)


def _container_files(kind: str, src: Path) -> list[str]:
    """The files whose state the fingerprint of a ``kind`` source holds, as they are now."""
    if kind == "arrays":
        from .arrays import array_files

        return [os.fspath(p) for p in array_files(src)]
    if kind == "webdataset":
        return [os.fspath(p) for p in (sorted(src.glob("*.tar")) if src.is_dir() else [src])]
    if kind in ("table", "coco"):
        return [os.fspath(src)]
    return []


# -- planning per source kind --------------------------------------------------------------
FOLDER_KINDS = ("imagefolder", "videofolder", "audiofolder")  # class folders: planned from one listing


def open_folder(kind: str, src, options: dict):
    """The class-folder source of ``kind`` at ``src``, walked, with the plan's ``options``."""
    if kind == "imagefolder":
        from .imagefolder import ImageFolderSource

        return ImageFolderSource(src, max_pixels=options["max_pixels"], max_size=options.get("max_size"),
                                 quality=options.get("quality"))
    from .media import media_folder

    return media_folder(kind, src, **_media_options(options))


def _plan_imagefolder(src: Path, parts: Path, options: dict, kind: str = "imagefolder") -> tuple[Source, dict, list,
                                                                                                  float]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    source = open_folder(kind, src, options)
    # paths as bytes: a file name need not be UTF-8 (os.fsencode / os.fsdecode carry it exactly)
    table = pa.table({"path": pa.array([os.fsencode(p) for p in source.paths.tolist()], pa.binary()),
                      "label": pa.array(source.labels)})
    atomic_write(parts / LISTING, lambda f: pq.write_table(table, f, row_group_size=_LISTING_ROW_GROUP))
    spec = {"root": str(src), "listing": LISTING, "classes": source.class_names, "ignored": source.ignored,
            "repeated_dirs": source.repeated_dirs}
    return source, spec, [], estimate_bytes_per_sample(source)


def _plan_table(src: Path, parts: Path, options: dict) -> tuple[Source, dict, list, float]:
    from .table import TABLE_SUFFIXES, TableSource

    kw = dict(label=options["label"], image_columns=options["image_columns"], max_pixels=options["max_pixels"],
              max_size=options["max_size"], quality=options["quality"])
    if TABLE_SUFFIXES.get(src.suffix.lower()) == "parquet" and src.is_file():
        # The file list at scale: the schema, the first rows and (for string labels) the
        # label column are all the driver reads.
        import pyarrow.parquet as pq

        n = pq.ParquetFile(src).metadata.num_rows
        if n == 0:
            raise ConvertError(f"{src}: the table has no rows")
        head = TableSource(src, rows=(0, min(n, 4096)), **kw)
        classes = _string_classes(src, head.label) if head.class_names is not None else None
        ragged = _ragged_columns(src, head)
        if classes is not None or ragged:
            head = TableSource(src, rows=(0, min(n, 4096)), classes=classes, ragged=ragged, **kw)
        source, num = head, n
    else:
        source = TableSource(src, **kw)
        classes, num = source.class_names, source.num_samples
    spec = {"label": source.label, "image_columns": sorted(n for n, f in source.fields.items() if f.kind == "image"),
            "classes": classes, "ragged": sorted(n for n, f in source.fields.items() if f.kind == "ragged"),
            "media_columns": {n: f.kind for n, f in source.fields.items() if f.kind in ("video", "audio")},
            "num_samples": num}
    return source, spec, _fingerprint(source), estimate_bytes_per_sample(source)


def _string_classes(path: Path, column: str) -> list[str]:
    """Sorted distinct values of a string column, one row group at a time."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    seen: set[str] = set()
    for g in range(pf.metadata.num_row_groups):
        col = pf.read_row_group(g, columns=[column]).column(column)
        seen.update(pc.unique(col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col).to_pylist())
    return sorted(str(v) for v in seen if v is not None)


def _ragged_columns(path: Path, head) -> list[str]:
    """List columns the first rows show as ragged, plus those that look fixed there but whose
    lengths vary further down (read one column and row group at a time)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    out = sorted(n for n, f in head.fields.items() if f.kind == "ragged")
    fixed = {n: f.shape[0] for n, f in head.fields.items() if f.kind == "tensor" and len(f.shape) == 1}
    if not fixed:
        return out
    pf = pq.ParquetFile(path)
    for name, length in fixed.items():
        for g in range(pf.metadata.num_row_groups):
            lens = pc.list_value_length(pf.read_row_group(g, columns=[name]).column(name))
            if pc.min_max(lens).as_py() != {"min": length, "max": length}:
                out.append(name)
                break
    return sorted(out)


def _plan_coco(src: Path, parts: Path, options: dict) -> tuple[Source, dict, list, float]:
    """The JSON is parsed once, here: its listing (one row per sample) goes to the parts
    directory, and each task reads its rows (coco.py)."""
    import pyarrow.parquet as pq

    from .coco import LISTING, CocoSource

    source = CocoSource(src, options["images"], masks=options.get("masks", False),
                        skip_empty=options.get("skip_empty", False), max_pixels=options["max_pixels"])
    atomic_write(parts / LISTING, lambda f: pq.write_table(source.listing, f, row_group_size=_LISTING_ROW_GROUP))
    spec = {"listing": LISTING, "images": options["images"], "masks": bool(options.get("masks", False)),
            "metadata": source.metadata}
    return source, spec, _fingerprint(source), estimate_bytes_per_sample(source)


def _plan_whole(kind: str, src: Path, options: dict) -> tuple[Source, dict, list, float]:
    from .kinds import make_source

    source = make_source(kind, src, label=options["label"], image_columns=options["image_columns"],
                         max_pixels=options["max_pixels"], max_size=options["max_size"], quality=options["quality"])
    return source, {"label": source.label}, _fingerprint(source), estimate_bytes_per_sample(source)


def _media_options(options: dict) -> dict:
    """A videofolder's options among a plan's (absent from other plans)."""
    return {k: options[k] for k in ("min_frames", "video_codec") if options.get(k) is not None}


def make_plan(kind: str, src: str | os.PathLike, dst: str | os.PathLike, *, shard_size: int, overwrite: bool,
              resume: bool, label: str | None = None, image_columns: Sequence[str] = (),
              max_pixels: int | None = None, max_size: int | None = None, quality: int | None = None,
              source_options: dict | None = None) -> Plan:
    """Check DST, then reuse the plan of an interrupted conversion (``resume``) or write a new one.
    ``source_options``: the options of one source kind (coco's ``images``, ``masks``,
    ``skip_empty``), recorded with the others."""
    options = {"label": label, "image_columns": sorted(image_columns or ()), "max_pixels": max_pixels,
               "max_size": max_size, "quality": quality, "shard_size": int(shard_size), **(source_options or {})}
    if is_remote(dst):
        return _make_remote_plan(kind, Path(src).resolve(), str(dst), options, overwrite, resume)
    src, dst = Path(src).resolve(), Path(dst).absolute()
    parts = dst / PARTS
    if (parts / PLAN).exists() and resume:
        plan = load_plan(dst)
        _check_same(plan, kind, src, options)
        check_destination(dst, overwrite=overwrite or plan.overwrite, allow_leftovers=True)
        _check_resumed_source(plan)
        return plan
    if parts.exists() and not (resume or overwrite):
        raise FileExistsError(f"{dst} holds an unfinished conversion ({parts}); pass --resume to finish it "
                              "(finished parts are reused), or --overwrite to start over")
    check_destination(dst, overwrite=overwrite)
    if parts.exists():  # a stale, unfinished conversion of our own: start over
        remove_tree(parts)
    parts.mkdir(parents=True)
    try:
        plan = _new_plan(kind, src, str(dst), parts, options, overwrite)
        write_json(parts / PLAN, plan.to_json())  # last: a plan that exists is complete
    except BaseException:
        remove_tree(parts)
        raise
    return plan


def _new_plan(kind: str, src: Path, dst: str, parts: Path, options: dict, overwrite: bool,
              token: str | None = None) -> Plan:
    """Walk or open the source, write the listing a task needs into ``parts``, cut the groups."""
    if kind in FOLDER_KINDS:
        source, spec, fp, est = _plan_imagefolder(src, parts, options, kind)
    elif kind == "table":
        source, spec, fp, est = _plan_table(src, parts, options)
    elif kind == "coco":
        source, spec, fp, est = _plan_coco(src, parts, options)
    else:
        source, spec, fp, est = _plan_whole(kind, src, options)
    try:
        num = int(spec.get("num_samples", source.num_samples))
        shard_size = options["shard_size"]
        return Plan(dst=dst, kind=kind, src=str(src), options=options, num_samples=num,
                    group_size=max(1, min(num, int(shard_size // max(est, 1.0)))), bytes_per_sample=est,
                    spec=spec, fields={n: f.to_json() for n, f in source.fields.items()},
                    label=source.label, class_names=source.class_names, metadata=dict(source.metadata),
                    fingerprint=fp, overwrite=bool(overwrite), created=time.time(), token=token)
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            close()


def _make_remote_plan(kind: str, src: Path, dst: str, options: dict, overwrite: bool, resume: bool) -> Plan:
    """The plan of a conversion into an object store (objstore.py): made in a local scratch
    directory, uploaded under DST's parts prefix, ``plan.json`` last."""
    import tempfile

    from ..store.transaction import new_generation

    store = Store(dst)
    if resume and store.size(f"{PARTS}/{PLAN}") is not None:
        plan = load_plan(dst)
        _check_same(plan, kind, src, options)
        check_remote_destination(store, overwrite=overwrite or plan.overwrite, allow_leftovers=True)
        _check_resumed_source(plan)
        return plan
    if store.sizes(PARTS) and not (resume or overwrite):
        raise FileExistsError(f"{store.display} holds an unfinished conversion ({store.display}/{PARTS}/); pass "
                              "--resume to finish it (finished parts are reused), or --overwrite to start over")
    names = check_remote_destination(store, overwrite=overwrite)
    store.remove_parts()  # a stale, unfinished conversion of our own: start over
    token = new_generation(names)  # no shard at DST has it: the new shards replace none
    with tempfile.TemporaryDirectory(prefix="fastload-plan-") as tmp:
        plan = _new_plan(kind, src, dst, Path(tmp), options, overwrite, token)
        try:
            for name in sorted(os.listdir(tmp)):
                store.put_file(Path(tmp) / name, f"{PARTS}/{name}")
            store.put_json(f"{PARTS}/{PLAN}", plan.to_json())  # last: a plan that exists is complete
        except BaseException:
            store.remove_parts()
            raise
    return plan


def _check_same(plan: Plan, kind: str, src: Path, options: dict) -> None:
    where = f"{Path(plan.dst) / PARTS / PLAN}"
    if plan.kind != kind or plan.src != str(src):
        raise ConvertError(f"--resume: {where} is the plan of `convert {plan.kind} {plan.src}`, not of "
                           f"`convert {kind} {src}`; pass --overwrite to start over")
    for k in sorted(set(options) | set(plan.options)):  # (an option the interrupted run had, and this one not)
        v = options.get(k)
        if plan.options.get(k) != v:
            raise ConvertError(f"--resume: the interrupted conversion used {k}={plan.options.get(k)!r}, this one "
                               f"{k}={v!r}; repeat the same options, or pass --overwrite to start over")


# -- has the source changed? (sourcestate.py) -------------------------------------------------
def source_changes(plan: Plan) -> str:
    """What differs between the source now and the files that number its samples in the plan:
    the listing of an image folder (files added or removed, non-image files counted), the
    state of a table, ``.npy`` or ``.tar`` file. "" when nothing does."""
    from .sourcestate import describe, from_records, stat_files

    src = Path(plan.src)
    if plan.kind in FOLDER_KINDS:
        return _listing_changes(plan)
    paths, then = from_records(plan.fingerprint)
    now_paths = _container_files(plan.kind, src) if src.exists() else []
    planned = set(paths)
    added = [p for p in now_paths if p not in planned]
    present = set(now_paths)
    removed = [p for p in paths if p not in present]
    kept = [i for i, p in enumerate(paths) if p in present]
    now = stat_files([paths[i] for i in kept])
    changed = [paths[i] for i, s in zip(kept, now) if (s != then[i]).any()]
    return describe(src if src.is_dir() else src.parent, changed=changed, added=added, removed=removed)


def _listing_changes(plan: Plan) -> str:
    """A class folder walked again and compared with the plan's listing."""
    import pyarrow.parquet as pq

    from .sourcestate import describe

    spec, src = plan.spec, Path(plan.src)
    try:
        now = open_folder(plan.kind, src, plan.options)
    except ConvertError as e:
        return f"it cannot be listed as it was ({e})"
    if plan.remote:
        with Store(plan.dst).open_input(f"{PARTS}/{spec['listing']}") as f:
            listing = pq.read_table(f, columns=["path"]).column("path").to_pylist()
    else:
        listing = pq.read_table(plan.parts / spec["listing"], columns=["path"]).column("path").to_pylist()
    then = [os.fsdecode(p) for p in listing]
    paths = now.paths.tolist()
    out = ""
    if paths != then:
        old, new = set(then), set(paths)
        out = describe(src, added=[os.path.join(src, p) for p in paths if p not in old],
                       removed=[os.path.join(src, p) for p in then if p not in new])
        if not out:  # the same files in another order (cannot happen with sorted walks)
            out = "its files are listed in another order"
    extra = []
    if now.class_names != spec["classes"]:
        extra.append(f"class folders {now.class_names[:5]} where the plan has {spec['classes'][:5]}")
    if now.ignored != spec["ignored"]:
        extra.append(f"{now.ignored} non-{now.WHAT} file(s) where the plan counted {spec['ignored']} "
                     "(the manifest records the number)")
    if now.repeated_dirs != spec.get("repeated_dirs", 0):
        extra.append(f"{now.repeated_dirs} folder(s) reached twice through links where the plan had "
                     f"{spec.get('repeated_dirs', 0)}")
    return "; ".join(x for x in [out, *extra] if x)


def changed_groups(plan: Plan, records: dict[int, dict]) -> dict[int, list[str]]:
    """{group: files changed since it read them} among groups with records ``{g: record}``
    (every file's state is taken once, on threads: see sourcestate.stat_files)."""
    from .sourcestate import from_records, stat_files

    owners, recs = [], []
    for g, rec in sorted(records.items()):
        inputs = rec.get("inputs") or []
        owners += [g] * len(inputs)
        recs += inputs
    paths, then = from_records(recs)
    out: dict[int, list[str]] = {}
    if paths:
        now = stat_files(paths)
        for i in map(int, np.flatnonzero((now != then).any(axis=1))):
            out.setdefault(owners[i], []).append(paths[i])
    return out


def _check_resumed_source(plan: Plan) -> None:
    """--resume: refuse a source whose numbering changed; set the finished groups whose own
    files changed in place aside (``plan.redo``), to be converted again."""
    from .sourcestate import SourceChanged
    from .parts import discard_group, finished_groups

    what = source_changes(plan)
    if what:
        raise SourceChanged(f"--resume refused: {plan.src} changed since the conversion was planned: {what}. "
                            "The planned groups no longer fit it, so no finished part is reused; pass --overwrite "
                            "(instead of --resume) to convert the source as it is now")
    redo = changed_groups(plan, finished_groups(plan, range(plan.num_groups)))
    for g in redo:
        discard_group(plan, g)
    plan.redo = redo


def check_source_at_commit(plan: Plan, records: dict[int, dict]) -> None:
    """Refuse to commit parts read from a source that changed meanwhile: files of the plan's
    numbering (added, removed, changed: start over), or a file changed after its group read
    it (--resume converts those groups again)."""
    from .sourcestate import SourceChanged, shown

    what = source_changes(plan)
    if what:
        raise SourceChanged(f"{plan.src} changed while it was being converted: {what}; the dataset would mix "
                            "two states of it, so nothing was committed. Pass --overwrite (instead of --resume) "
                            "to convert the source as it is now")
    redo = changed_groups(plan, records)
    if redo:
        files = [p for g in sorted(redo) for p in redo[g]]
        raise SourceChanged(f"{plan.src} changed while it was being converted: {len(files)} file(s) changed after "
                            f"their group read them ({shown(files, plan.src)}); the dataset would mix two states "
                            "of it, so nothing was committed. Run the same command with --resume: the group(s) "
                            f"{', '.join(map(str, sorted(redo)))} are converted again, the others reused")

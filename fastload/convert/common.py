"""The convert driver shared by every source kind.

A source describes its fields and numbers its samples 0..n-1. Worker *processes* validate
samples (read the file, decode the image fully, read its size) and send back only small
tuples — never the source data; only an image re-encoded for ``--max-size`` (small by then,
see resize.py) comes back as bytes. The main process reads each valid sample (putting the
re-encoded images in) and hands it to the ShardWriter in source order, so the output is
deterministic whatever ``workers`` is.
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from ..errors import NO_SPACE_ERRNOS, ConvertError, NoSpaceError, SampleError
from ..files import printable
from ..store.format import MEDIA_KINDS, DEFAULT_SHARD_SIZE, MANIFEST, MIN_SHARD_SIZE, SKIPPED_REPORT, Field, parse_size
from ..store.geometry import DEFAULT_MAX_PIXELS
from ..store.report import write_report
from ..store.writer import ShardWriter
from ..runtime.system import usable_cores
from ..validate import ON_ERROR, check_bool, check_choice, check_int
from .imagecheck import DaliImageCheck, MAX_BATCH as MAX_CHECK_BATCH
from .images import DECODABLE_FORMATS, IMAGE_EXTENSIONS, check_image, prepare_image  # noqa: F401 (re-exported)
from ..store.keys import escape_key
from .resize import DEFAULT_QUALITY

IMAGES_CHECKED = "images_checked"  # manifest metadata: the images were decoded by DALI at convert time
RESIZED_IMAGES = "resized_images"  # manifest metadata: images re-encoded for --max-size (a count)


@dataclass
class Source:
    """A conversion source: fields, sample count, and per-sample read/validate."""

    fields: dict[str, Field]
    num_samples: int
    label: str | None = None
    class_names: list[str] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    max_pixels: int | None = DEFAULT_MAX_PIXELS
    max_size: int | None = None  # images re-encoded so that their longer side is at most this
    quality: int | None = None   # the JPEG quality of those (default DEFAULT_QUALITY)
    # {path: (size, mtime_ns)} of the files the source read when it opened (before reading
    # them): a conversion checks that they are still so at its end (sourcestate.py)
    opened: dict[str, tuple[int, int] | None] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_pixels is None:  # one limit: the Loader's (a source asked for none gets it too)
            self.max_pixels = DEFAULT_MAX_PIXELS
        if self.quality is None:
            self.quality = DEFAULT_QUALITY
        if any(f.kind == "image" for f in self.fields.values()):
            self.metadata["max_pixels"] = int(self.max_pixels)  # stated in the dataset's manifest
            if self.max_size is not None:  # (the count of resized images is added by the writer)
                self.metadata["max_size"] = int(self.max_size)
                self.metadata["quality"] = int(self.quality)
            # every image went through DALI's decoder before it was written: the Loader may
            # decode whole batches on the CPU (see fastload.pipeline.runner.CPU_RUN)
            self.metadata[IMAGES_CHECKED] = "dali"

    def key(self, i: int) -> str:
        return str(i)

    def inputs(self) -> Sequence[str]:
        """The paths of the files this source reads (its table, array or tar files, its images):
        a conversion records their state and refuses to finish when one changed meanwhile
        (sourcestate.py). None for data handed over in memory."""
        return ()

    def read(self, i: int) -> dict[str, Any]:
        """Sample i as a dict of field values (bytes for images)."""
        raise NotImplementedError

    def validate(self, i: int) -> dict[str, tuple[int, int]]:
        """Check sample i; return the (width, height) of each image field. Raise on bad data."""
        return self.check(i)[0]

    def check(self, i: int) -> tuple[dict[str, tuple[int, int]], dict[str, bytes]]:
        """Check sample i: the (width, height) of each image field as stored, and the images
        re-encoded for ``max_size`` (field -> new bytes; the others are stored as read; see
        ``read_checked``)."""
        sample = self.read(i)
        sizes, new = {}, {}
        for n, f in self.fields.items():
            if f.kind == "image":
                small, sizes[n] = prepare_image(sample[n], self.max_pixels, self.max_size, self.quality)
                if small is not None:
                    new[n] = small
            elif f.kind in MEDIA_KINDS:  # what decoding the whole file found (store/media.py)
                from ..store.media import probe

                try:
                    sizes[n] = probe(f.kind, sample[n])
                except ValueError as e:
                    several = sum(g.kind in ("image", *MEDIA_KINDS) for g in self.fields.values()) > 1
                    raise ValueError(f"field {n!r}: {e}" if several else str(e)) from None
        return sizes, new

    def read_checked(self, i: int, new: dict[str, bytes]) -> dict[str, Any]:
        """Sample i as it is written: ``read(i)`` with the fields ``check(i)`` made (``new``: the
        images re-encoded for ``max_size``) put in. A source whose check makes a field in the
        validation workers (coco's mask) reads the rest without making it again."""
        sample = self.read(i)
        sample.update(new)
        return sample

    @property
    def needs_validation(self) -> bool:
        return any(f.kind in ("image", *MEDIA_KINDS) for f in self.fields.values())

    def fast_chunks(self) -> Iterator[tuple[int, int, dict[str, Any]]] | None:
        """``(start, stop, {field: rows start..stop})`` chunks to write in bulk when the source
        allows it (fixed-size fields only), else None (sample by sample)."""
        return None


def bulk_chunks(columns: Mapping[str, Any], n: int, step: int = 65536) -> Iterator[tuple[int, int, dict[str, Any]]]:
    """``Source.fast_chunks`` for sources holding whole columns: rows in runs of ``step``."""
    for a in range(0, n, step):
        b = min(n, a + step)
        yield a, b, {name: col[a:b] for name, col in columns.items()}


# The source of the running conversion, inherited by forked workers (never pickled).
_SOURCE: Source | None = None


def _validate_chunk(bounds: tuple[int, int]) -> list[tuple[int, Any, str | None]]:
    out = []
    for i in range(*bounds):
        try:
            out.append((i, _SOURCE.check(i), None))
        except Exception as e:  # reported to the user with the sample's key
            out.append((i, None, str(e) or type(e).__name__))
    return out


def _ignore_sigint() -> None:
    """Validation workers leave Ctrl-C (SIGINT to the process group) to the main process,
    which stops them and prints one line; they never print a traceback of their own. (They
    start with SIGINT blocked, see _validated, so none arrives before this runs.)"""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _validated(source: Source, workers: int) -> Iterator[tuple[int, Any, str | None]]:
    n = source.num_samples
    chunk = 32
    bounds = [(a, min(n, a + chunk)) for a in range(0, n, chunk)]
    if workers <= 1 or n <= chunk or "fork" not in mp.get_all_start_methods():
        for b in bounds:
            yield from _validate_chunk(b)
        return
    ctx = mp.get_context("fork")
    # Forked with SIGINT blocked (the workers ignore it before unblocking); here a Ctrl-C that
    # came meanwhile is delivered when it is unblocked, as a KeyboardInterrupt.
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        pool = ctx.Pool(workers, initializer=_ignore_sigint)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
    try:
        for res in pool.imap(_validate_chunk, bounds):
            yield from res
        pool.close()
    except BaseException:
        pool.terminate()
        raise
    finally:
        pool.join()


def check_shard_size(shard_size: int | str, allow_small_shards: bool) -> int:
    """``shard_size`` in bytes; below MIN_SHARD_SIZE (1 MB) only when forced: ``--shard-size 10``
    means 10 bytes, one shard per sample."""
    n = parse_size(shard_size)
    if n < MIN_SHARD_SIZE and not allow_small_shards:
        raise ValueError(f"shard_size={shard_size!r} is {n:,} bytes, below the floor of {MIN_SHARD_SIZE:,} "
                         "(1 MB): that writes one small shard per few samples (sizes are bytes: use e.g. 256MB). "
                         "Pass --force-small-shards (allow_small_shards=True) if you mean it")
    return n


def run_convert(source: Source, dst: str | os.PathLike, *, workers: int | None = None,
                shard_size: int | str = DEFAULT_SHARD_SIZE, on_error: str = "raise",
                overwrite: bool = False, progress: bool = True, desc: str = "convert",
                check_threads: int | None = None, record_inputs: bool = False) -> dict:
    """Write ``source`` into the dataset directory ``dst``; return a summary. ``check_threads``:
    the threads of the DALI decoder that checks the images (default: every usable core; a
    task of a distributed conversion passes its own allotment, 1).

    The state (size, modification time) of every file the source reads is taken before the
    first sample is read and again after the last one: a file that changed meanwhile is a
    ``SourceChanged`` error naming it, and nothing is written (sourcestate.py).
    ``record_inputs``: the summary's ``inputs`` holds those states ``[[path, size, mtime_ns],
    ...]``, which a distributed conversion keeps with each group."""
    global _SOURCE
    from .sourcestate import SourceChanged, as_records, describe, differing, stat_files

    check_choice("on_error", on_error, ON_ERROR)
    workers = usable_cores() if workers is None else check_int("workers", workers, min=0)
    check_bool("overwrite", overwrite)
    parse_size(shard_size)  # the 1 MB floor is convert()'s (tasks of a distributed convert write parts)
    from tqdm import tqdm as _tqdm

    class tqdm(_tqdm):  # noqa: N801
        monitor_interval = 0  # no monitor thread left running after convert() returns

    t0 = time.perf_counter()
    # before anything is made that must be closed (a Ctrl-C while thousands of files are
    # stat'ed leaves no progress bar or DALI checker behind)
    inputs = source.inputs()
    before = stat_files(inputs)
    if source.opened:  # the states of the files the source read when it opened
        for i, p in enumerate(inputs):
            if p in source.opened:
                s = source.opened[p]
                before[i] = (-1, -1) if s is None else s
    skipped: list[dict] = []
    dst = Path(dst)
    image_fields = [n for n, f in source.fields.items() if f.kind == "image"]
    media_fields = [n for n, f in source.fields.items() if f.kind in MEDIA_KINDS]  # sizes[n]: what was probed
    metadata = dict(source.metadata)
    writer = ShardWriter(dst, source.fields, shard_size=shard_size, label=source.label,
                         class_names=source.class_names, overwrite=overwrite, metadata=metadata)
    bar = tqdm(total=source.num_samples, unit="samples", desc=desc, disable=not progress,
               file=sys.stderr, dynamic_ncols=True, smoothing=0.1)
    checker = DaliImageCheck(threads=check_threads) if image_fields else None
    pending: list[tuple[int, dict, dict, int]] = []  # read, waiting for the DALI check, in source order
    resized = [0]  # images written re-encoded (--max-size)
    _SOURCE = source
    try:
        with writer:
            def key_of(i: int) -> str:
                return escape_key(source.key(i))  # any file name: one line of valid UTF-8, one key per name

            def bad(i: int, err: str) -> None:
                err = printable(err)
                if on_error == "raise":
                    raise ConvertError(f"{key_of(i)}: {err} (use --on-error skip to leave it out)")
                skipped.append({"index": i, "key": key_of(i), "reason": err})

            def write(i: int, sample: dict, sizes: dict, new: int = 0) -> None:
                try:  # the writer checks shapes, dtypes and value ranges
                    media = {n: sizes[n] for n in media_fields if n in sizes}
                    writer.write(sample, key=key_of(i), image_sizes={n: v for n, v in sizes.items() if n not in media},
                                 media_info=media or None)
                    resized[0] += new
                except SampleError as e:  # refused before buffering: the writer goes on
                    bad(i, str(e))

            def flush_pending() -> None:
                """Decode the pending images with DALI (the Loader's decoder); write in order."""
                if not pending:
                    return
                errors: dict[int, str] = {}
                for name in image_fields:
                    ok = [j for j in range(len(pending)) if j not in errors]
                    verdicts = checker.check([pending[j][1][name] for j in ok],
                                             [pending[j][2][name] for j in ok])
                    for j, v in zip(ok, verdicts):
                        if v is not None:
                            errors[j] = v if len(image_fields) == 1 else f"field {name!r}: {v}"
                for j, (i, sample, sizes, new) in enumerate(pending):
                    if j in errors:
                        bad(i, errors[j])
                    else:
                        write(i, sample, sizes, new)
                pending.clear()

            def one(i: int, checked: tuple[dict, dict] | None, err: str | None) -> None:
                sizes, new = checked or ({}, {})
                if err is None:
                    try:
                        sample = source.read_checked(i, new)  # (with the images re-encoded for --max-size)
                    except Exception as e:
                        err = str(e) or type(e).__name__
                if err is not None:
                    flush_pending()  # keep the order of errors and writes
                    bad(i, err)
                elif checker is not None and sizes:
                    pending.append((i, sample, sizes, len(new)))
                    if len(pending) >= MAX_CHECK_BATCH:
                        flush_pending()
                else:
                    flush_pending()
                    write(i, sample, sizes, len(new))

            def bulk(start: int, stop: int, batch: dict, keys: list[str]) -> None:
                try:  # all rows are checked before any is buffered
                    writer.write_batch(batch, keys=keys)
                except SampleError as e:
                    if on_error == "raise":
                        raise ConvertError(f"{e} (use --on-error skip to leave it out)") from None
                    if stop - start <= 16:
                        for i in range(start, stop):  # name and skip the bad rows
                            one(i, None, None)
                        return
                    # bisect: the good rows around a few bad ones still go in bulk, in order
                    mid = (start + stop) // 2
                    k = mid - start
                    bulk(start, mid, {n: v[:k] for n, v in batch.items()}, keys[:k])
                    bulk(mid, stop, {n: v[k:] for n, v in batch.items()}, keys[k:])

            chunks = source.fast_chunks()
            if chunks is not None:
                for start, stop, batch in chunks:
                    bulk(start, stop, batch, [escape_key(source.key(i)) for i in range(start, stop)])
                    bar.update(stop - start)
            else:
                it = (_validated(source, workers) if source.needs_validation
                      else ((i, None, None) for i in range(source.num_samples)))
                with contextlib.closing(it):  # on any error: the worker pool is shut down now
                    for i, sizes, err in it:
                        one(i, sizes, err)
                        bar.update(1)
                flush_pending()
            changed = differing(inputs, before, stat_files(inputs))
            if changed:  # inside the writer: it aborts, nothing is written
                raise SourceChanged("the source changed while it was being converted: "
                                    f"{describe(None, changed=changed)}; nothing was written from it: convert it "
                                    "again once it stays unchanged")
            if writer.num_samples == 0:
                first = "; ".join(f"{r['key']}: {r['reason']}" for r in skipped[:3])
                raise ConvertError(f"no sample of {source.num_samples} could be converted"
                                   + (f" ({first}{'; …' if len(skipped) > 3 else ''})" if skipped else ""))
            if skipped:
                write_report(writer.dir / SKIPPED_REPORT, skipped)  # moves with the new dataset
            if image_fields and source.max_size is not None:
                writer.metadata[RESIZED_IMAGES] = resized[0]  # the manifest is written on close
    except NoSpaceError as e:  # one line: the destination, what it needs, what it has
        done = max(writer.num_written, 1)
        e.needed = max(e.needed, e.written * source.num_samples // done)
        raise
    except OSError as e:
        if e.errno in NO_SPACE_ERRNOS:  # e.g. the skipped report: the writer already aborted
            raise NoSpaceError(dst, needed=writer.num_written_bytes + 4096, written=writer.num_written_bytes,
                               detail=os.path.basename(getattr(e, "filename", "") or "")) from None
        raise
    finally:
        _SOURCE = None
        bar.close()
        if checker is not None:
            checker.close()
        # A failed conversion into a fresh directory keeps its report there; one that was
        # to replace a dataset leaves the old dataset (and its directory) untouched.
        if skipped and not (dst / MANIFEST).exists():
            try:
                dst.mkdir(parents=True, exist_ok=True)  # (an aborted writer took back the directory it made)
                write_report(dst / SKIPPED_REPORT, skipped)
            except OSError:
                pass
    seconds = time.perf_counter() - t0
    m = writer.manifest()
    return {"dst": str(dst), "num_samples": m["num_samples"], "num_shards": len(m["shards"]),
            "bytes": m["total_bytes"], "skipped": len(skipped), "seconds": seconds,
            "report": str(dst / SKIPPED_REPORT) if skipped else None,
            "max_pixels": source.max_pixels if image_fields else None,
            "max_size": source.max_size if image_fields else None,
            "resized_images": resized[0] if image_fields and source.max_size is not None else None,
            **({"transcoded_videos": resized[0]} if media_fields and "video_codec" in source.metadata else {}),
            **({"inputs": as_records(inputs, before)} if record_inputs else {})}


def label_from_strings(values: Sequence[str]) -> tuple[list[str], Any]:
    """String class labels -> (sorted class names, int64 ids)."""
    import numpy as np

    names, ids = np.unique(np.asarray(values, dtype=object).astype(str), return_inverse=True)
    return [str(n) for n in names], ids.astype(np.int64)


def resolve_label(fields: Mapping[str, Field], label: str | None, auto: Sequence[str] = ("label", "labels")) -> str | None:
    if label is not None:
        if label not in fields:
            raise ConvertError(f"--label {label!r} is not a column of the source; columns are {list(fields)}")
        return label
    for name in auto:
        f = fields.get(name)
        if f is not None and f.kind == "scalar" and f.dtype.startswith(("int", "uint")):
            return name
    return None

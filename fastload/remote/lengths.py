"""Per-sample lengths of a remote dataset's ragged field, without downloading its shards.

Sequence packing plans its rows from every document's length, and a Loader sizes its ring
from them, before the first batch: for a remote dataset they must not cost a download of
every shard. A ragged field's lengths are its offsets buffer (8 bytes per sample), so for
each shard not already in the node's cache this module reads just that buffer with byte-range
requests, in parallel over shards (:data:`THREADS`):

* the file's last :data:`TAIL_BYTES` (the IPC footer: schema and the record batch's block;
  a second request if the footer is longer),
* the record batch's metadata and, in the same request, the first ``(rows + 1) * 8`` bytes of
  its body (where the offsets are when the ragged field is the first column),
* the offsets buffer itself, when it was not in that guess.

On an object store that is one HEAD (pyarrow opens a file with one) and two or three ranged
GETs per shard, about ``8 * rows`` bytes plus a few KB; over http(s), the GETs only. The
layout is parsed by :mod:`fastload.remote.ipc_layout`. Each shard's offsets are checked
(``rows + 1`` entries, from 0, never decreasing, ending at the column's item count; a batch
of the manifest's rows) and fetched again once when they are not; twice wrong is a
:class:`~fastload.errors.FormatError` naming the shard. Transient errors are retried like
downloads (:class:`~fastload.remote.pacing.RetryPolicy`).

The lengths are kept in the dataset's cache directory (``lengths-<field>.npy``; the
directory is keyed by the manifest's fingerprint) by the machinery that keeps every per-node
table (:func:`fastload.runtime.kept.kept_arrays`: written once per node under a flock,
through a memory map, never whole in memory), so
later runs and the node's other ranks read them from disk, memory-mapped (read-only, the
page cache shared by the node's ranks: 10^9 documents cost 8 GB once per node, not per rank). Nothing here is trusted blindly:
when a shard is downloaded (verified against the manifest's checksum) and mapped, its
offsets are compared with the lengths in use (:func:`check_shard`); a difference removes
the file and raises, before any batch from that shard (or after it in the stream) is made.

A server that does not answer byte ranges (an http server replying 200): the shards are read
through the cache instead, as for a local dataset.

Every wait is bounded by ``download_timeout`` (the policy's ``timeout_s``): each shard's read
(its attempts run in a daemon thread, left behind at the deadline whatever the client's own
timeouts are), and the wait for the node's rank that reads them (past it, this rank reads
them itself).
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import numpy as np

from ..errors import DownloadError, DownloadTimeout, FormatError
from ..runtime.kept import kept_arrays
from .bounded import call_within
from .download import TRANSIENT_ERRORS
from .pacing import Cancelled
from .ipc_layout import LayoutError, footer_length, list_column, parse_footer
from .url import FaultKind, RangesUnsupported, classify

__all__ = ["TAIL_BYTES", "THREADS", "check_shard", "fetch_offsets", "kept_name", "lengths_path", "remote_lengths"]

logger = logging.getLogger("fastload")

TAIL_BYTES = 16 << 10  # the first read of a shard's tail: footers of a few dozen fields fit
THREADS = 16           # shards read at once (each request is small: latency-bound)

class _Reads:
    """Ranged reads of one file, counted, served from what was already read when possible."""

    def __init__(self, f, size: int):
        self.f, self.size = f, size
        self.pieces: list[tuple[int, bytes]] = []
        self.requests, self.bytes = 0, 0

    def read(self, offset: int, n: int) -> bytes:
        for start, data in self.pieces:
            if start <= offset and offset + n <= start + len(data):
                return data[offset - start:offset - start + n]
        data = bytes(self.f.read_at(n, offset))
        self.requests += 1
        self.bytes += len(data)
        if len(data) != n:
            raise OSError(f"a byte range of {n} bytes at {offset} came back with {len(data)}")
        self.pieces.append((offset, data))
        return data


def _attempt(transport, name: str, size: int, rows: int, field: str) -> tuple[np.ndarray, int, int]:
    f = transport.open_ranged(name)
    r = _Reads(f, size)
    try:
        t = min(size, TAIL_BYTES)
        tail = r.read(size - t, t)
        n = footer_length(tail, size)
        if n + 10 > t:
            tail = r.read(size - n - 10, n + 10)
        footer = parse_footer(tail, size)
        if len(footer.batches) != 1:
            raise LayoutError(f"the file holds {len(footer.batches)} record batches; fastload shards hold one")
        b = footer.batches[0]
        guess = min(b.body_length, (rows + 1) * 8 + 64)  # the body's start, read with the metadata
        head = r.read(b.offset, b.meta_length + guess)
        col = list_column(footer, head[:b.meta_length], field)
        if col.rows != rows:
            raise LayoutError(f"the record batch has {col.rows} rows, the manifest says {rows}")
        raw = r.read(col.offsets_at, col.offsets_bytes)
    finally:
        try:
            f.close()
        except Exception:
            pass
    offsets = np.frombuffer(raw, dtype="<i8").astype(np.int64)
    if offsets[0] != 0 or offsets[-1] != col.items or (rows and np.any(offsets[1:] < offsets[:-1])):
        raise LayoutError(f"the offsets of {field!r} are not {rows + 1} non-decreasing values from 0 to the "
                          f"column's {col.items} items")
    return offsets, r.requests + (1 if getattr(transport, "ranged", False) else 0), r.bytes


def fetch_offsets(transport, name: str, *, size: int, rows: int, field: str, policy,
                  stop: threading.Event | None = None) -> tuple[np.ndarray, int, int]:
    """``(offsets, requests, bytes)``: the int64 offsets (``rows + 1``) of the large_list column
    ``field`` of the remote shard ``name`` (``size`` bytes, ``rows`` rows), read with byte
    ranges and checked; fetched again once when they do not check out. Transient errors are
    retried as ``policy`` says; raises :class:`RangesUnsupported`, :class:`FormatError` or
    :class:`DownloadError` naming the shard."""
    url = transport.file_url(name)
    deadline = time.monotonic() + policy.timeout_s
    attempt = bad = 0
    rebuilt = False
    last: BaseException | None = None
    while True:
        generation = transport.generation
        if time.monotonic() >= deadline:
            raise DownloadTimeout(f"the offsets of ragged field {field!r} in shard {name} were not read from {url} "
                                  f"within {policy.timeout_s:g}s ({attempt} attempt(s); last error: "
                                  f"{type(last).__name__}: {last}); check the network and the server, or raise "
                                  "download_timeout=", shard=name, url=url)
        try:  # in a daemon thread: the deadline holds whatever the client's own timeouts are
            return call_within(lambda: _attempt(transport, name, size, rows, field), deadline,
                               what=f"reading the offsets of {name}", stop=stop)
        except Cancelled:
            raise DownloadError(f"reading the lengths of {field!r} from {url} was stopped", shard=name,
                                url=url) from None
        except (RangesUnsupported, DownloadError):
            raise
        except LayoutError as e:
            bad += 1
            if bad >= 2:
                raise FormatError(
                    f"shard {name} at {url}: the offsets of ragged field {field!r}, read twice with byte ranges, are "
                    f"not valid ({e}); the remote dataset is damaged or was not written by fastload: run "
                    f"`fastload verify` on the URL") from None
            logger.warning("fastload: the offsets of %r in %s did not check out (%s); reading them again", field,
                           url, e)
            continue  # at once: not a network fault
        except TRANSIENT_ERRORS as e:
            last = e
            kind = classify(e)
            if kind == FaultKind.MISSING:
                raise DownloadError(f"shard {name} does not exist at {url} ({e}); the remote dataset is incomplete "
                                    "or was moved", shard=name, url=url) from None
            if kind == FaultKind.AUTH and not rebuilt:
                try:  # a new client: pyarrow's waits for the S3 requests in flight (bounded here)
                    again = call_within(lambda g=generation: transport.rebuild(g), deadline, what="reloading credentials",
                                        stop=stop)
                except TimeoutError:
                    continue  # the deadline: raised at the loop's top
                except Cancelled:
                    raise DownloadError(f"reading the lengths of {field!r} from {url} was stopped", shard=name,
                                        url=url) from None
                if again:
                    rebuilt = True
                    continue
        attempt += 1
        if attempt >= policy.attempts and time.monotonic() < deadline:
            raise DownloadError(f"the offsets of ragged field {field!r} in shard {name} could not be read from {url} "
                                f"after {attempt} attempts (last error: {type(last).__name__}: {last}); check the "
                                "network and the server", shard=name, url=url)
        pause = min(policy.pause(attempt - 1), max(0.0, deadline - time.monotonic()))
        if stop is not None and stop.wait(pause):
            raise DownloadError(f"reading the lengths of {field!r} from {url} was stopped", shard=name, url=url)
        if stop is None:
            time.sleep(pause)


def kept_name(field: str, what: str = "lengths") -> str:
    """The stem of a field's kept file in a dataset's cache directory: ``lengths-<field>``
    (``what="values"``: a scalar field's values), the field's name hashed when it has odd
    characters."""
    safe = field if re.fullmatch(r"[A-Za-z0-9_.-]{1,100}", field) else hashlib.sha1(field.encode()).hexdigest()
    return f"{what}-{safe}"


def lengths_path(cache, field: str) -> Path:
    """Where a field's lengths are kept in the dataset's cache directory."""
    return cache.dir / f"{kept_name(field)}.npy"


def _nonnegative(t: dict) -> bool:
    v = next(iter(t.values()))
    return all(int(v[a:a + (1 << 24)].min()) >= 0 for a in range(0, len(v), 1 << 24))


def remote_lengths(reader, field: str, open_shard) -> np.ndarray:
    """Items per sample of ragged ``field`` of a remote dataset (see the module docstring);
    ``open_shard(s)`` maps shard ``s`` from the cache directory (a complete file there).
    Kept by :func:`fastload.runtime.kept.kept_arrays` in the dataset's cache directory (one
    rank of the node reads them, under its lock, waiting at most ``download_timeout``)."""
    cache = reader.cache
    name, n = kept_name(field), len(reader)
    got = kept_arrays(cache.dir, {name: (np.int64, (n,))}, lambda alloc: _gather(reader, field, open_shard, alloc(name)),
                      what=f"the lengths of {field!r} of {cache.url}", holds=f"{n} lengths", check=_nonnegative,
                      wait_s=cache.policy.timeout_s)
    return got[name]


def _local_offsets(reader, s: int, field: str, open_shard) -> np.ndarray | None:
    """The offsets of shard ``s`` when it is already mapped or complete in the cache."""
    shard = reader._shards[s]
    if shard is None and reader.cache.path(s).exists():
        try:
            shard = open_shard(s)
        except (FormatError, OSError):
            return None  # evicted meanwhile, or damaged: read remotely (the verifier sees it on use)
    if shard is None:
        return None
    return shard.ragged(field, reader.fields[field], reader.shard_files[s])[0]


def _gather(reader, field: str, open_shard, out: np.ndarray) -> np.ndarray:
    starts = reader.shard_starts
    todo = []
    for s in range(reader.num_shards):
        off = _local_offsets(reader, s, field, open_shard)
        if off is None:
            todo.append(s)
        else:
            np.subtract(off[1:], off[:-1], out=out[starts[s]:starts[s + 1]])
    if not todo:
        return out
    cache = reader.cache
    transport = cache.remote.transport
    shards = reader.manifest["shards"]
    t0 = time.monotonic()
    stop = threading.Event()
    requests = nbytes = 0

    def one(s: int):
        return fetch_offsets(transport, cache.names[s], size=int(shards[s]["bytes"]), rows=int(shards[s]["num_samples"]),
                             field=field, policy=cache.policy, stop=stop)

    ex = ThreadPoolExecutor(min(THREADS, len(todo)), thread_name_prefix="fastload-lengths")
    try:
        futures = {ex.submit(one, s): s for s in todo}
        for fut in as_completed(futures):
            s = futures[fut]
            off, k, b = fut.result()
            requests, nbytes = requests + k, nbytes + b
            np.subtract(off[1:], off[:-1], out=out[starts[s]:starts[s + 1]])
    except RangesUnsupported as e:
        stop.set()
        ex.shutdown(wait=True, cancel_futures=True)
        logger.warning("fastload: %s; reading the lengths of %r through the cache (whole shards)", e, field)
        for s in todo:
            off = reader.ragged_column(s, field)[0]
            np.subtract(off[1:], off[:-1], out=out[starts[s]:starts[s + 1]])
        return out
    except BaseException:
        stop.set()
        raise
    finally:
        ex.shutdown(wait=True, cancel_futures=True)
    cache.lengths_stats = {"shards": len(todo), "requests": requests, "bytes": nbytes,
                           "seconds": time.monotonic() - t0}
    logger.info("fastload: read the lengths of %r of %s from %d shards with %d ranged requests (%.1f kB) in %.2f s",
                field, cache.url, len(todo), requests, nbytes / 1e3, time.monotonic() - t0)
    return out


def check_shard(reader, s: int, shard) -> None:
    """Compare the lengths in use (ranged reads, or the cache's file) with the offsets of shard
    ``s`` just mapped from the cache (whose bytes the download verified): FormatError when
    they differ (the lengths file is removed, so the next run reads them again)."""
    cached = reader.__dict__.get("_lengths") or {}
    starts = reader.shard_starts
    for field, v in list(cached.items()):
        off = shard.ragged(field, reader.fields[field], reader.shard_files[s])[0]
        mine = v[starts[s]:starts[s + 1]]
        real = off[1:] - off[:-1]
        if not np.array_equal(mine, real):
            k = int(np.flatnonzero(mine != real)[0])
            cached.pop(field, None)
            try:
                os.unlink(lengths_path(reader.cache, field))
            except FileNotFoundError:
                pass
            raise FormatError(
                f"shard {reader.cache.names[s]} of {reader.url}: sample {int(starts[s]) + k} has {int(real[k])} items of "
                f"{field!r}, but the lengths read before its download (byte ranges, or {lengths_path(reader.cache, field).name} "
                f"in the cache) say {int(mine[k])}: a damaged ranged read. Batches planned from them would be wrong, so "
                "this run stops here; the stored lengths were removed, and the next run reads them again")

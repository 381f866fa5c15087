"""Whole remote datasets: upload a local one (``fastload convert ... s3://bucket/ds``), mirror
one into a plain local dataset (``fastload prefetch``), and verify one (``fastload verify``).

Uploads keep the format's rule that a dataset which opens is complete: shards first, the
manifest last (object stores have no rename; a PUT is atomic per object). Mirrors hash every
shard while it arrives, write ``manifest.json`` last, and run the full Arrow validation.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Mapping

from ..errors import RemoteError
from ..files import atomic_write
from ..manifest_checksum import manifest_bytes
from ..remote.download import Downloader, DownloadCounters, RetryPolicy
from ..remote.manifest import MANIFEST, RemoteDataset
from ..remote.transports import open_transport

__all__ = ["convert_to_remote", "prefetch", "upload_dataset", "verify_remote"]

_OWN = ("shard-", "manifest.json", "skipped.jsonl")


def upload_dataset(local: str | os.PathLike, url: str, *, overwrite: bool = False, filesystem: Any = None,
                   storage_options: Mapping[str, Any] | None = None, threads: int = 4) -> int:
    """Upload the complete local dataset ``local`` to ``url``: shards (in parallel), then
    ``skipped.jsonl``, then ``manifest.json`` last. Refuses a destination that already holds
    a dataset unless ``overwrite``. Replacing one never breaks it: the new shards go under
    names the old dataset does not use (``shard-NNNNN-GGGGGGGG.arrow``, a new generation),
    the manifest is replaced in one PUT (the new dataset opens from then on; until then, the
    old one still does, also when the upload fails half way), and only then are the old
    shards deleted. Returns the bytes uploaded."""
    from ..store.format import SKIPPED_REPORT, shard_name, stale_files
    from ..store.reader import read_manifest
    from ..store.transaction import new_generation

    local = Path(local)
    m = read_manifest(local)  # a complete dataset, or a clear error
    t = open_transport(url, filesystem=filesystem, storage_options=storage_options)
    if not hasattr(t, "filesystem"):
        raise RemoteError(f"{t.url}: fastload writes datasets to object stores (s3://, gs://, az://), "
                          "not over http(s)")
    listed = t.list_names()
    old = [n for n in listed if n.startswith(_OWN)]
    if MANIFEST in old and not overwrite:
        raise RemoteError(f"{t.url} already holds a fastload dataset ({MANIFEST}); pass --overwrite to replace it")
    if old and MANIFEST not in old and not overwrite:
        raise RemoteError(f"{t.url} holds shard files without a manifest (an interrupted upload?); pass "
                          "--overwrite to replace them")
    sources = [local / s["file"] for s in m["shards"]]
    if old:  # names no file there has: readers of the old dataset never see a new shard under an old name
        generation = new_generation(listed)
        m = dict(m, shards=[dict(s, file=shard_name(i, generation)) for i, s in enumerate(m["shards"])])
    files = [s["file"] for s in m["shards"]]
    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="fastload-upload") as pool:
        list(pool.map(lambda a: t.write_file(*a), zip(sources, files)))
    keep = set(files)
    if (local / SKIPPED_REPORT).exists():
        t.write_file(local / SKIPPED_REPORT, SKIPPED_REPORT)
        keep.add(SKIPPED_REPORT)
    # last, in one PUT (atomic per object): the new dataset opens from here on
    t.write_bytes(manifest_bytes(m), MANIFEST)  # sealed afresh: the shard names may have changed
    for n in stale_files(old, keep):  # the old shards, and an old report the new dataset does not have
        t.delete(n)
    return sum(int(s["bytes"]) for s in m["shards"])


def convert_to_remote(convert: Callable[..., dict], kind: str, src, url: str, *, overwrite: bool = False,
                      staging_dir: str | os.PathLike | None = None, **kw) -> dict:
    """``convert(kind, src, <local staging dir>, **kw)``, then :func:`upload_dataset` to
    ``url``; the staging directory (under ``staging_dir``, default the fastload cache
    directory) is removed afterwards, also on failure."""
    from ..remote.cache import default_cache_dir

    t = open_transport(url)
    if not hasattr(t, "filesystem"):
        raise RemoteError(f"{t.url}: fastload writes datasets to object stores (s3://, gs://, az://), "
                          "not over http(s)")
    if not overwrite and MANIFEST in t.list_names():  # before converting for nothing
        raise RemoteError(f"{t.url} already holds a fastload dataset ({MANIFEST}); pass --overwrite to replace it")
    root = Path(staging_dir) if staging_dir is not None else default_cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix="convert-staging-", dir=root))
    try:
        r = convert(kind, src, stage / "ds", **kw)
        upload_dataset(stage / "ds", url, overwrite=overwrite)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    r = dict(r)
    r["dst"] = t.url
    if r.get("report"):
        r["report"] = f"{t.url}/skipped.jsonl"
    return r


def prefetch(url: str, dest: str | os.PathLike, *, threads: int = 8, filesystem: Any = None,
             storage_options: Mapping[str, Any] | None = None, retry: RetryPolicy | None = None,
             progress: Callable[[int, int], None] | None = None) -> dict:
    """Mirror the dataset at ``url`` into ``dest``, a plain local dataset: every shard hashed
    while it arrives and checked against the manifest, ``manifest.json`` written last, then
    the full check of ``fastload verify``. An interrupted prefetch resumes (complete shards
    are checked, not downloaded again). Returns ``{"dst", "bytes_downloaded", "shards"}``."""
    from ..store.format import arrow_schema
    from ..store.reader import manifest_fields
    from ..store.full_check import check_shard

    from ..store.reader import check_manifest

    remote = RemoteDataset(url, filesystem=filesystem, storage_options=storage_options)
    check_manifest(remote.manifest, remote.transport.file_url(MANIFEST))
    dest = Path(dest)
    if (dest / MANIFEST).exists():
        raise RemoteError(f"{dest} already holds a dataset ({MANIFEST}); prefetch into a new directory")
    dest.mkdir(parents=True, exist_ok=True)
    foreign = [p.name for p in dest.iterdir() if not p.name.startswith((".shard-", "shard-"))]
    if foreign:
        raise RemoteError(f"{dest} is not empty ({foreign[0]} ...); prefetch into a new or empty directory")
    counters = DownloadCounters()
    dl = Downloader(remote.transport, threads=threads, policy=retry, counters=counters)
    schema = arrow_schema(manifest_fields(remote.manifest, dest))
    done = [0]
    lock = threading.Lock()
    problems: list[str] = []

    def one(i: int) -> None:
        s = remote.manifest["shards"][i]
        p = dest / s["file"]
        if not (p.exists() and p.stat().st_size == s["bytes"]):
            dl.fetch(s["file"], p, size=int(s["bytes"]), checksum=s["checksum"], part=dest / f".{s['file']}.part")
            found = check_shard(p, s, schema, checksum=s["checksum"])  # hashed on the way in
        else:
            found = check_shard(p, s, schema)  # from an interrupted run: hash it again
        with lock:
            problems.extend(found)
            done[0] += 1
            if progress is not None:
                progress(done[0], len(remote.shard_files))

    try:
        with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="fastload-prefetch") as pool:
            list(pool.map(one, range(len(remote.shard_files))))
    finally:
        dl.close()
    if problems:
        raise RemoteError(f"prefetch of {remote.url} into {dest}: " + "; ".join(problems[:5]))
    # last: dest is a complete dataset from now on (checked on fetching; sealed, also an old one)
    atomic_write(dest / MANIFEST, manifest_bytes(remote.manifest))
    return {"dst": str(dest), "bytes_downloaded": counters.bytes, "shards": len(remote.shard_files)}


def verify_remote(url: str, *, local: str | os.PathLike | None = None, threads: int = 4, filesystem: Any = None,
                  storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """Problems of the dataset at ``url`` (an empty list: all good). Every shard is
    downloaded (to a temporary directory, one at a time per thread) and checked as ``fastload
    verify`` checks a local one; with ``local``, the shards in that directory (a prefetched
    copy or a cache directory) are checked against the URL's manifest instead, and shards
    missing there are listed."""
    from ..store.format import arrow_schema
    from ..store.reader import manifest_fields
    from ..store.full_check import check_shard

    from ..store.reader import check_manifest

    remote = RemoteDataset(url, filesystem=filesystem, storage_options=storage_options)
    m = check_manifest(remote.manifest, remote.transport.file_url(MANIFEST))
    problems: list[str] = []
    total = sum(int(s["num_samples"]) for s in m["shards"])
    if total != m["num_samples"]:
        problems.append(f"{MANIFEST}: shard counts add up to {total}, num_samples is {m['num_samples']}")
    if local is not None:
        local = Path(local)
        schema = arrow_schema(manifest_fields(m, local))
        for s in m["shards"]:
            problems += [p.replace(": missing", f": not in {local}") for p in check_shard(local / s["file"], s, schema)]
        return problems
    schema = arrow_schema(manifest_fields(m, Path(".")))
    lock = threading.Lock()
    dl = Downloader(remote.transport, threads=threads, policy=RetryPolicy(attempts=3))
    with tempfile.TemporaryDirectory(prefix="fastload-verify-") as tmp:
        def one(s: dict) -> None:
            p = Path(tmp) / s["file"]
            try:
                dl.fetch(s["file"], p, size=int(s["bytes"]), checksum=None)  # hashed below, all problems listed
                found = check_shard(p, s, schema)
            except RemoteError as e:
                found = [f"{s['file']}: {e}"]
            finally:
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
            with lock:
                problems.extend(found)

        try:
            with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="fastload-verify") as pool:
                list(pool.map(one, m["shards"]))
        finally:
            dl.close()
    try:
        listed = {s["file"] for s in m["shards"]}
        for n in remote.transport.list_names():
            if n.startswith("shard-") and n not in listed:
                problems.append(f"{n}: not listed in {MANIFEST} (left over from another write?)")
    except RemoteError:  # http(s): no listing
        pass
    return sorted(problems)

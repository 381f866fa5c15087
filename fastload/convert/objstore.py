"""A distributed conversion into an object store (``s3://``, ``gs://``, ``az://``): the same
plan -> task -> commit core (plan.py, task.py, commit.py), with DST a URL.

Object stores cannot rename an object cheaply, and a PUT is atomic per object (a reader
never sees half an object). So, beside a local DST's scheme:

* the plan lives under the hidden prefix ``DST/.fastload-parts/`` (``plan.json``, and
  ``files.parquet`` for an image folder), uploaded by the driver before any task starts;
* a task converts its group into a local scratch directory, then uploads each shard straight
  to its **final** name in DST, ``shard-{g*1000+j:05d}-{token}.arrow`` (shard j of group g):
  the name depends only on the group and the plan, so a retried or duplicated task PUTs the
  same bytes to the same keys. Only then it PUTs its record ``.fastload-parts/g-NNNNNNNN.json``
  (counts, its part manifest with sizes and checksums, its skipped samples): a group is done
  when its record exists and its shards have the recorded sizes;
* ``token`` is 8 hex digits no shard at DST uses (as the local store names the shards of a
  dataset written over another): the new shards never replace a shard of a dataset already
  at DST, which keeps opening until the commit;
* the commit (driver) checks every record, PUTs ``skipped.jsonl``, then ``manifest.json``
  **last** (from then on DST opens as the new dataset), then deletes the shards the new
  manifest does not list (the replaced dataset's, an earlier failed run's) and the parts.

A failure leaves no new manifest: a fresh DST does not open, a replaced dataset stays as it
was. Only fastload's own names are ever deleted; other objects under DST are left alone.
Credentials come from where every fastload process finds them (environment, credential
files, instance roles): tasks get the URL, never a secret.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any

from ..remote.url import display_url, is_remote, scheme_of
from ..store.format import SHARD_FILE_RE
from ._store import MANIFEST, PARTS, shard_name
from .common import ConvertError

__all__ = ["SHARDS_PER_GROUP", "Store", "check_remote_destination", "is_remote", "record_name", "remote_shard_name"]

# Shard j of group g is shard number g * SHARDS_PER_GROUP + j (a group makes one shard, two
# when the plan's estimate was far off; numbers need not be contiguous: readers take the
# names from the manifest).
SHARDS_PER_GROUP = 1000
_RECORD = re.compile(r"g-([0-9]{8})\.json")
_OWN_SHARD = re.compile(SHARD_FILE_RE)


def record_name(g: int) -> str:
    return f"{PARTS}/g-{g:08d}.json"


def remote_shard_name(g: int, j: int, token: str) -> str:
    if j >= SHARDS_PER_GROUP:
        raise ConvertError(f"group {g} made more than {SHARDS_PER_GROUP} shards: its samples are far larger than "
                           "the plan estimated from 256 samples; convert with a larger --shard-size")
    return shard_name(g * SHARDS_PER_GROUP + j, token)


class Store:
    """The files of one object-store directory (DST), as a conversion reads and writes them.

    The client is the remote package's :class:`~fastload.remote.transport_arrow.ArrowTransport`
    (the one object-store client of fastload: the same URLs, options, credentials, upload loop
    and fork rule as reading and ``upload_dataset``); this class adds what a conversion needs
    on top: JSON documents, the sealed manifest, the parts prefix and its records, missing
    files that are not errors."""

    def __init__(self, url: str):
        from ..remote.transport_arrow import ArrowTransport

        if not is_remote(url) or scheme_of(url) in ("http", "https"):
            raise ConvertError(f"{display_url(url) if is_remote(url) else url}: fastload writes datasets to "
                               "object stores (s3://, gs://, az://) or local directories, not over http(s)")
        self.url = url  # the full URL (no secret: a URL holding one is refused)
        self.display = display_url(url)
        self.transport = ArrowTransport(url)

    def where(self, name: str) -> str:
        return f"{self.display}/{name}"

    def sizes(self, prefix: str = "") -> dict[str, int]:
        """{name: size} of the files directly under DST (or DST/prefix)."""
        return self.transport.sizes(prefix)

    def size(self, name: str) -> int | None:
        return self.transport.size(name)

    def get_json(self, name: str) -> Any:
        """The JSON object ``name`` holds, or None when it does not exist."""
        try:
            data = self.transport.read_bytes(name)
        except FileNotFoundError:
            return None
        except OSError as e:
            if self.size(name) is None:
                return None
            raise ConvertError(f"{self.where(name)}: cannot be read ({e})") from None
        try:
            return json.loads(data)
        except ValueError as e:
            raise ConvertError(f"{self.where(name)}: not readable JSON ({e})") from None

    def put_json(self, name: str, obj: Any) -> None:
        self.transport.write_bytes((json.dumps(obj, indent=1) + "\n").encode(), name)

    def put_manifest(self, manifest: dict) -> None:
        """PUT ``manifest.json``, sealed with its checksum (the store's one manifest serialiser)."""
        from ..manifest_checksum import manifest_bytes

        self.transport.write_bytes(manifest_bytes(manifest), MANIFEST)

    def put_file(self, local: str | os.PathLike, name: str) -> None:
        self.transport.write_file(local, name)

    def open_input(self, name: str):
        """A random-access file (for Parquet: only the row groups a task needs are read)."""
        return self.transport.open_ranged(name)

    def delete(self, name: str) -> None:
        try:
            self.transport.delete(name)
        except FileNotFoundError:
            pass

    def remove_parts(self) -> None:
        """Delete the parts prefix and everything under it."""
        try:
            self.transport.delete_dir(PARTS)
        except FileNotFoundError:
            pass

    def records(self) -> set[int]:
        """The groups whose record exists under the parts prefix (one listing)."""
        return {int(m.group(1)) for m in map(_RECORD.fullmatch, self.sizes(PARTS)) if m}


def check_remote_destination(store: Store, *, overwrite: bool, allow_leftovers: bool = False) -> dict[str, int]:
    """Refuse a destination the conversion may not write into; never deletes anything.
    Returns {name: size} of the files at DST. A dataset there (its manifest) needs
    ``overwrite``; so do shard files without a manifest (an interrupted upload or conversion),
    unless a resumed conversion may take them over (``allow_leftovers``). Objects that are not
    fastload's are left alone (an object-store prefix is often shared)."""
    names = store.sizes()
    if MANIFEST in names and not overwrite:
        raise FileExistsError(f"{store.display} already holds a fastload dataset ({MANIFEST}); pass --overwrite "
                              "(overwrite=True) to replace it")
    own = [n for n in names if _OWN_SHARD.fullmatch(n)]
    if own and MANIFEST not in names and not (overwrite or allow_leftovers):
        raise FileExistsError(f"{store.display} holds shard files without a manifest ({own[0]}, ...: an "
                              "interrupted upload or conversion?); pass --overwrite to replace them")
    return names

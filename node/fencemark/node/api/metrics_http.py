"""``/metrics`` over HTTP for Prometheus (``--metrics-listen``), on the node's loop.

A connection is a task, not a thread (prometheus_client's own server gave each one a
thread, held for as long as the client kept it open), under the rules every port
follows (``fencemark.node.api.handshakes``): nothing reaches the node before the
client speaks, a request has ``--handshake-timeout`` seconds to arrive whole, at most
``PENDING_PER_SOURCE`` connections from one address and ``MAX_CONNECTIONS`` in all
are open at once (a ``PendingGate``), and one more is closed as it comes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from fencemark.node.api.handshakes import BACKLOG, HANDSHAKE_TIMEOUT_S, PendingGate, defer_accept

MAX_CONNECTIONS = 16  # a scraper or two, and room to spare
MAX_REQUEST_BYTES = 8192
SEND_TIMEOUT_S = 10.0


class MetricsSite:
    """The endpoint's connections: plaintext, so every open one is still owed its
    request, and all of them are bounded as connections in handshake are."""

    def __init__(self, registry: CollectorRegistry, request_timeout_s: float) -> None:
        self.registry = registry
        self.request_timeout_s = request_timeout_s
        self.open = PendingGate(total=MAX_CONNECTIONS)  # counts what it refused, too

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        source = str(peer[0]) if peer else "?"
        if not self.open.admit(source):
            writer.close()
            return
        try:
            async with asyncio.timeout(self.request_timeout_s):
                head = await reader.readuntil(b"\r\n\r\n")
            request = head.decode("latin-1").split("\r\n", 1)[0].split()
            await self._answer(request, writer)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ConnectionError):  # fmt: skip
            pass  # a silent, slow or oversized request: closed
        finally:
            self.open.done(source)
            writer.close()
            with contextlib.suppress(ConnectionError, TimeoutError):
                async with asyncio.timeout(1.0):
                    await writer.wait_closed()

    async def _answer(self, request: list[str], writer: asyncio.StreamWriter) -> None:
        if len(request) != 3 or request[0] not in ("GET", "HEAD"):
            status, kind, body = "405 Method Not Allowed", "text/plain", b"GET /metrics\n"
        elif request[1].split("?", 1)[0] not in ("/metrics", "/"):
            status, kind, body = "404 Not Found", "text/plain", b"not found: GET /metrics\n"
        else:
            status, kind = "200 OK", CONTENT_TYPE_LATEST
            body = await asyncio.to_thread(generate_latest, self.registry)
        head = (
            f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        writer.write(head.encode("latin-1"))
        if request[:1] != ["HEAD"]:
            writer.write(body)
        async with asyncio.timeout(SEND_TIMEOUT_S):
            await writer.drain()


async def serve(
    registry: CollectorRegistry, listen: str, handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S
) -> tuple[int, MetricsSite, Callable[[], Awaitable[None]]]:
    """Serve ``registry`` on ``listen`` (HOST:PORT; port 0 picks one); returns the bound
    port, the site and a stopper."""
    host, _, port = listen.rpartition(":")
    site = MetricsSite(registry, handshake_timeout_s)
    server = await asyncio.start_server(
        site.connection, host.strip("[]"), int(port), limit=MAX_REQUEST_BYTES, backlog=BACKLOG
    )
    for sock in server.sockets:
        defer_accept(sock)

    async def stop() -> None:
        server.close()
        await server.wait_closed()

    return int(server.sockets[0].getsockname()[1]), site, stop

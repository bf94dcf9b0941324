"""The MCP server: the ``repocontext_*`` tools on the official ``mcp`` SDK's ``MCPServer``.

It is a client of one node (``target``), or of a region map, through the
published ``AsyncClient``: home-only calls (claims, renewals, releases, fenced
writes) are routed to the record's home region when ``regions`` names it.

Fail-closed (SPEC §6): when the node reports ``writes_enabled: false`` at
startup, the mutating tools are not registered at all, so they are not listed;
the read tools stay.

Besides the tools it serves one resource template, a topic's changes
(``fencemark.mcp.feed``), with ``resources/subscribe`` on the handshake era and
``subscriptions/listen`` on 2026-07-28; and it keeps state per MCP session
(``fencemark.mcp.sessions``) for ``keepAlive`` and the feeds a session follows.
"""

from __future__ import annotations

import asyncio
import functools
import signal
import socket
import sys
from collections.abc import Mapping
from typing import Any, TextIO

import grpc
from mcp.server import MCPServer
from mcp.server.mcpserver.context import Context
from mcp.server.mcpserver.exceptions import ToolError, UnexpectedToolError
from mcp.server.subscriptions import InMemorySubscriptionBus
from mcp_types import (
    CallToolResult,
    InputRequiredResult,
    SubscribeRequestParams,
    SubscriptionsListenRequestParams,
    UnsubscribeRequestParams,
)
from pydantic import ValidationError

from fencemark.client import AsyncClient, FencemarkError
from fencemark.mcp.arguments import invalid_arguments_text
from fencemark.mcp.feed import (
    URI_TEMPLATE,
    FeedHub,
    listening,
    on_subscribe,
    on_unsubscribe,
    read_changes,
)
from fencemark.mcp.holds import KeepAlives
from fencemark.mcp.sessions import session_lifespan
from fencemark.mcp.tools import MUTATING_TOOLS, READ_TOOLS
from fencemark.mcp.work import WORK_TOOLS, WorkTools

__all__ = [
    "INSTRUCTIONS",
    "RepoContextServer",
    "create_server",
    "open_server",
    "parse_listen",
    "parse_regions",
    "serve",
]

SERVER_NAME = "fencemark"
HTTP_PATH = "/mcp"
DEFAULT_LISTEN = "127.0.0.1:7480"

INSTRUCTIONS = """\
Fencemark stores agent memory and backlog items as records that several agents can drain
safely. To take work: repocontext_wait_for_work a topic (owner unique to you; or
repocontext_claim_next, which does not wait) to claim its next eligible item, with keepAlive:
true to have the claim renewed for you while this session lasts (else repocontext_renew_claim
before leaseExpiresAtUtc, e.g. every leaseSeconds/3); pass the returned fencingToken to every
repocontext_update of it; finish with repocontext_release_claim and outcome done (the result
in fields), failed or deferred. granted: false is an answer (reason empty: no work now; for
repocontext_claim of one key: contended, timeout, missing, wrong_region): pick other work. A
keepAlive whose state is lost means the claim is over. If a renewal answers renewed:
false with reason superseded, a release answers released: false, or a write fails with
RepoContextClaimConflictException (superseded, expired, released), you lost the item: stop
writing to it at once. repocontext_claim_status is never authoritative."""


class RepoContextServer(MCPServer[Any]):
    """``MCPServer`` whose argument validation errors name each argument plainly."""

    async def call_tool(
        self, name: str, arguments: dict[str, Any], context: Context[Any, Any] | None = None
    ) -> CallToolResult | InputRequiredResult:
        try:
            return await super().call_tool(name, arguments, context)
        except ToolError as error:
            cause = error.__cause__
            if isinstance(cause, ValidationError) and not isinstance(error, UnexpectedToolError):
                schema = next(
                    (tool.input_schema for tool in await self.list_tools() if tool.name == name),
                    {},
                )
                raise ToolError(invalid_arguments_text(name, cause, schema)) from cause
            raise

    def serve_feeds(self, hub: FeedHub) -> None:
        """The changes resource, and subscriptions to it on both protocol eras.

        ``MCPServer`` serves neither ``resources/subscribe`` nor a hook around its
        ``subscriptions/listen``: both are registered on its lowlevel ``Server``, the
        SDK's documented place for a method the 2026-07-28 revision removed.
        """

        async def changes(repo: str, topic: str, ctx: Context[Any, Any]) -> str:
            return await read_changes(hub, repo, topic, ctx)

        self.resource(
            URI_TEMPLATE,
            name="changes",
            title="A topic's changes",
            description="What changed in a topic (created, claimed, released, done, ...) since "
            "you last read it, with feed cursors. Subscribe to it to be notified of each change "
            "(notifications/resources/updated); it is followed only while someone subscribes "
            "or keeps a claim of the topic alive.",
            mime_type="application/json",
        )(changes)
        lowlevel = self._lowlevel_server
        lowlevel.add_request_handler(
            "resources/subscribe", SubscribeRequestParams, functools.partial(on_subscribe, hub)
        )
        lowlevel.add_request_handler(
            "resources/unsubscribe",
            UnsubscribeRequestParams,
            functools.partial(on_unsubscribe, hub),
        )
        listen = lowlevel.get_request_handler("subscriptions/listen")
        if listen is not None:
            lowlevel.add_request_handler(
                "subscriptions/listen",
                SubscriptionsListenRequestParams,
                listening(hub, listen.handler),
            )


def create_server(
    client: AsyncClient, *, writes_enabled: bool, http: bool = False
) -> RepoContextServer:
    """The tools over ``client``; without ``writes_enabled`` only the read tools exist.

    Each tool takes exactly the arguments, of exactly the JSON types, that its
    input schema lists (``fencemark.mcp.arguments``). ``http``: the server is
    served over streamable HTTP, whose 2026-07-28 requests share no session.
    """
    bus = InMemorySubscriptionBus()
    hub = FeedHub(client, bus)  # the feeds followed: for subscribers and for keepalives
    tools = WorkTools(client, KeepAlives(client, hub))
    specs = (*MUTATING_TOOLS, *WORK_TOOLS, *READ_TOOLS) if writes_enabled else READ_TOOLS
    server = RepoContextServer(
        SERVER_NAME,
        instructions=INSTRUCTIONS,
        version=_version(),
        log_level="WARNING",
        tools=[spec.tool(tools) for spec in specs],
        lifespan=session_lifespan(streams_are_sessions=not http),
        subscriptions=bus,
    )
    server.serve_feeds(hub)
    return server


async def open_server(client: AsyncClient) -> RepoContextServer:
    """Ask ``client.target`` whether it takes writes (``Node.Info``), then build the server.

    Raises ``FencemarkError`` (e.g. ``Unavailable``) when the node cannot say.
    """
    info = await client.info()
    return create_server(client, writes_enabled=info.writes_enabled)


def parse_regions(spec: str | None) -> dict[str, str]:
    """``us=127.0.0.1:7400,eu=127.0.0.1:7401`` -> ``{"us": ..., "eu": ...}``."""
    regions: dict[str, str] = {}
    for item in (spec or "").split(","):
        if not item.strip():
            continue
        name, sep, address = (part.strip() for part in item.partition("="))
        if not sep or not name or not address:
            raise ValueError(f"--regions takes REGION=HOST:PORT,... got {item.strip()!r}")
        if name in regions:
            raise ValueError(f"--regions names region {name!r} twice")
        regions[name] = address
    return regions


def parse_listen(listen: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) -> (host, port)."""
    host, sep, port = listen.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"--listen takes HOST:PORT, got {listen!r}")
    return host, int(port)


async def serve(
    target: str,
    *,
    regions: Mapping[str, str] | None = None,
    call_timeout: float = 10.0,
    transport: str = "stdio",
    listen: str = DEFAULT_LISTEN,
    log: TextIO = sys.stderr,
    credentials: grpc.ChannelCredentials | None = None,
) -> int:
    """Run the server until stdin closes (stdio) or SIGTERM/SIGINT (http); the exit code.

    Messages for people go to ``log`` (stderr): on stdio, stdout is the protocol.
    """
    async with AsyncClient(
        target, regions=regions, timeout=call_timeout, credentials=credentials
    ) as client:
        try:
            info = await client.info()
        except FencemarkError as error:
            print(
                f"fencemark mcp: cannot reach the Fencemark node at {target}: {error}."
                " Start one (fencemark node --enable-writes) or pass --target HOST:PORT.",
                file=log,
                flush=True,
            )
            return 1
        server = create_server(
            client,
            writes_enabled=info.writes_enabled,
            http=transport == "http",
        )
        tools = len(await server.list_tools())
        about = (
            f"node {info.node_id} of region {info.region!r} at {target}, writes"
            f" {'enabled' if info.writes_enabled else 'disabled'}: {tools} tools"
        )
        if transport == "stdio":
            print(f"fencemark mcp: serving over stdio for {about}", file=log, flush=True)
            await server.run_stdio_async()
            return 0
        return await _serve_http(server, listen, about, log)


async def _serve_http(server: RepoContextServer, listen: str, about: str, log: TextIO) -> int:
    import uvicorn

    host, port = parse_listen(listen)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        # Listening before the banner names the URL: a client that connects on
        # reading it is queued, not refused while uvicorn is still starting.
        sock.listen(2048)
    except OSError as error:
        sock.close()
        print(f"fencemark mcp: cannot listen on {listen}: {error}", file=log, flush=True)
        return 2
    bound = sock.getsockname()[1]
    shown_host = f"[{host}]" if family == socket.AF_INET6 else host
    app = server.streamable_http_app(host=host, streamable_http_path=HTTP_PATH)
    web = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))

    def stop(signum: int, frame: object) -> None:
        web.should_exit = True

    # uvicorn re-raises a signal it handled once it has stopped; with these
    # handlers that ends the call gracefully instead of killing the process.
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        print(
            f"fencemark mcp: serving streamable HTTP on http://{shown_host}:{bound}{HTTP_PATH}"
            f" for {about}",
            file=log,
            flush=True,
        )
        await web.serve(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            if handler is not None:
                signal.signal(sig, handler)
        sock.close()
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fencemark")
    except PackageNotFoundError:
        return ""


def run(
    target: str,
    *,
    regions: str | None = None,
    timeout: float = 10.0,
    transport: str = "stdio",
    listen: str = DEFAULT_LISTEN,
    credentials: grpc.ChannelCredentials | None = None,
) -> int:
    """``fencemark mcp``: parse the flags' values, then ``serve``; the exit code."""
    try:
        region_map = parse_regions(regions)
        if transport == "http":
            parse_listen(listen)
    except ValueError as error:
        print(f"fencemark mcp: {error}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(
            serve(
                target,
                regions=region_map,
                call_timeout=timeout,
                transport=transport,
                listen=listen,
                credentials=credentials,
            )
        )
    except KeyboardInterrupt:
        return 130

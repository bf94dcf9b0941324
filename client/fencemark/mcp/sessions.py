"""An MCP session's own state on the server, and the end of it.

What the server does for a session — claims it keeps alive (``keepAlive``), topics
it follows (``resources/subscribe``) and how far it has read them — belongs to
that session and ends with it: nothing it started outlives it. What a session
is depends on the protocol era the client speaks (the SDK's ``Connection``):

- **A handshake-era connection** (``initialize``, protocol 2025-11-25 and before)
  is a session on every transport. Its state lives in the SDK connection's
  ``state`` and is closed from the connection's ``exit_stack``, which the SDK
  unwinds when the connection ends: stdin closed, the HTTP session deleted or
  expired, the in-memory client gone.
- **The 2026-07-28 era** has no connection: every request carries its own
  envelope. Over stdio (and in memory) one stream is one client from start to
  end, and the server's lifespan is entered once per stream, so the lifespan is
  the session. Over streamable HTTP requests of that era share nothing: there is
  no session, and what needs one is refused.

The SDK hands a request its connection only through ``ServerSession``'s private
``_connection`` (``mcp`` 2.3; its own in-memory transport reaches into the server
the same way). ``_connection_of`` is the one place that does, and a session that
cannot be found is answered as having none, never guessed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol, TypeVar

from mcp.server.connection import Connection
from mcp.server.context import ServerRequestContext
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.context import Context
from mcp.server.session import ServerSession
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

__all__ = ["Session", "SessionPart", "session_lifespan", "session_of"]

log = logging.getLogger(__name__)
_STATE_KEY = "fencemark.session"


class SessionPart(Protocol):
    """Something a session keeps (its holds, its feeds) and closes when it ends."""

    async def close(self) -> None: ...


_Part = TypeVar("_Part", bound=SessionPart)


class Session:
    """One MCP session's state. ``notifier`` sends it messages outside any request
    (a handshake-era connection's own channel); ``None`` where the era has none."""

    def __init__(self, notifier: ServerSession | None) -> None:
        self.notifier = notifier
        self.closed = False
        self._parts: dict[type[Any], SessionPart] = {}

    def part(self, kind: type[_Part], make: Callable[[Session], _Part]) -> _Part:
        """This session's ``kind`` of state, made on first use."""
        found = self._parts.get(kind)
        if isinstance(found, kind):
            return found
        made = make(self)
        self._parts[kind] = made
        return made

    def find(self, kind: type[_Part]) -> _Part | None:
        """This session's ``kind`` of state, if it has made one."""
        found = self._parts.get(kind)
        return found if isinstance(found, kind) else None

    async def close(self) -> None:
        """End everything the session started (latest first); idempotent."""
        if self.closed:
            return
        self.closed = True
        for part in reversed(list(self._parts.values())):
            try:
                await part.close()
            except Exception:  # one part's failure must not leave the others running
                log.exception("closing %s of an MCP session failed", type(part).__name__)


def session_of(ctx: Context[Any, Any] | ServerRequestContext[Any, Any]) -> Session | None:
    """The session a request belongs to, or ``None`` when it has none (see the module
    docstring; also a tool called directly, outside any request)."""
    if isinstance(ctx, Context):
        try:
            request = ctx.request_context
        except ValueError:
            return None
    else:
        request = ctx
    if request.protocol_version not in MODERN_PROTOCOL_VERSIONS:
        connection = _connection_of(request.session)
        return None if connection is None else _of_connection(connection, request.session)
    lifespan = request.lifespan_context
    return lifespan if isinstance(lifespan, Session) and not lifespan.closed else None


def _connection_of(session: ServerSession) -> Connection | None:
    connection = getattr(session, "_connection", None)
    return connection if isinstance(connection, Connection) else None


def _of_connection(connection: Connection, notifier: ServerSession) -> Session:
    found = connection.state.get(_STATE_KEY)
    if isinstance(found, Session):
        return found
    session = Session(notifier)
    connection.state[_STATE_KEY] = session
    connection.exit_stack.push_async_callback(session.close)
    return session


def session_lifespan(
    *, streams_are_sessions: bool
) -> Callable[[MCPServer[Any]], contextlib.AbstractAsyncContextManager[object]]:
    """The server's lifespan: a session for the 2026-07-28 era when each entry is
    one client's stream (stdio, in memory), nothing when it is not (HTTP)."""

    @contextlib.asynccontextmanager
    async def lifespan(server: MCPServer[Any]) -> AsyncIterator[object]:
        if not streams_are_sessions:
            yield {}
            return
        session = Session(notifier=None)
        try:
            yield session
        finally:
            await session.close()

    return lifespan

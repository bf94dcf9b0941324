"""A topic's changes as an MCP resource: ``fencemark://{repo}/{topic}/changes``.

A client subscribes to the resource (``resources/subscribe`` on the handshake
era, a ``subscriptions/listen`` stream naming it on 2026-07-28); the server then
follows the topic on the target node's change feed (``Records.Watch``, one
stream per topic however many subscribe) and sends
``notifications/resources/updated`` for it on each change. Reading the resource
returns what changed since this session last read it: at most ``KEPT`` changes
(the newest), each with its feed cursor; ``missed`` counts those no longer kept.
A reader without a position (its first read, or a client with no session) gets
every change kept. A topic nobody follows is not watched: its resource reads
``following: false`` and no changes.

The same stream tells the server's keepalives (``fencemark.mcp.holds``) of every
change of a topic in which a session keeps a claim alive: they ``observe`` it, and
follow it as subscribers do. The last subscriber or observer gone (an
unsubscribe, a listen stream ended, a kept claim ended, a session closed) ends the
topic's stream at the node. Notifications are best effort: a
session's are sent one at a time, and changes that come while one is on its way
make one more notification, not one each.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from mcp.server.context import HandlerResult, ServerRequestContext
from mcp.server.mcpserver.context import Context
from mcp.server.subscriptions import SubscriptionBus
from mcp.shared.exceptions import MCPError
from mcp.shared.subscriptions import ResourceUpdated
from mcp_types import (
    INVALID_PARAMS,
    EmptyResult,
    SubscribeRequestParams,
    SubscriptionsListenRequestParams,
    UnsubscribeRequestParams,
)

from fencemark.client import (
    AsyncClient,
    CursorExpired,
    InvalidArgument,
    PermissionDenied,
    WatchEvent,
)
from fencemark.mcp.models import ChangeOut, ChangesOut
from fencemark.mcp.outcomes import argument_name
from fencemark.mcp.sessions import Session, session_of

__all__ = [
    "KEPT",
    "URI_TEMPLATE",
    "FeedHub",
    "FeedRefused",
    "Observer",
    "SessionFeeds",
    "listening",
    "on_subscribe",
    "on_unsubscribe",
    "parse_uri",
    "read_changes",
    "uri_of_key",
]

log = logging.getLogger(__name__)
URI_TEMPLATE = "fencemark://{repo}/{topic}/changes"
KEPT = 100  # changes kept per followed topic, for reading
ListenHandler_ = Callable[
    [ServerRequestContext[Any, Any], SubscriptionsListenRequestParams], Awaitable[HandlerResult]
]
# Called with a followed uri and each change of it as the node's feed told it, or
# None where changes were missed (the feed moved on past the stream's cursor). It
# runs in the follower's task: it must not block, and nothing it raises stops others.
Observer = Callable[[str, WatchEvent | None], None]
_URI = re.compile(r"fencemark://(?P<repo>[^/?#]+)/(?P<topic>[^/?#]+)/changes")
_KEY = re.compile(r"repo/(?P<repo>[^/]+)/mem/(?P<topic>[^/]+)/[^/]+")
_NAME = re.compile(r"[A-Za-z0-9._:-]{1,128}")  # a repo's or a topic's name (SPEC §2)


class FeedRefused(Exception):
    """A feed the server will not follow: ``reason`` is machine-readable."""

    def __init__(self, uri: str, reason: str, message: str, *, argument: str = "") -> None:
        super().__init__(message)
        self.uri, self.reason, self.argument = uri, reason, argument

    def error(self) -> MCPError:
        data = {"uri": self.uri, "reason": self.reason}
        if self.argument:
            data["argument"] = self.argument
        return MCPError(INVALID_PARAMS, str(self), data=data)


def parse_uri(uri: str) -> tuple[str, str]:
    """``fencemark://lattice/backlog/changes`` -> ``("lattice", "backlog")``; the names
    as SPEC §2 has them (the node checks them too)."""
    found = _URI.fullmatch(uri)
    if found is None:
        raise FeedRefused(
            uri, "unknown_resource", f"No such resource {uri!r}: the changes of a topic are "
            "fencemark://{repo}/{topic}/changes, e.g. fencemark://lattice/backlog/changes"
        )  # fmt: skip
    for argument, name in (("repoId", found["repo"]), ("topic", found["topic"])):
        if _NAME.fullmatch(name) is None:
            raise FeedRefused(
                uri, "invalid_argument",
                f"Invalid resource {uri}: {argument}: must match {_NAME.pattern}, got {name!r}",
                argument=argument,
            )  # fmt: skip
    return found["repo"], found["topic"]


def uri_of_key(key: str) -> str | None:
    """The changes resource of ``key``'s topic (``repo/lattice/mem/backlog/x`` ->
    ``fencemark://lattice/backlog/changes``); ``None`` for a key of no such shape."""
    found = _KEY.fullmatch(key)
    return None if found is None else URI_TEMPLATE.format(**found.groupdict())


@dataclass(eq=False)
class _Follower:
    """One ``Records.Watch`` of a topic, shared by its subscribers and observers."""

    client: AsyncClient
    bus: SubscriptionBus
    uri: str
    readers: set[SessionFeeds] = field(default_factory=set)
    listening: int = 0  # subscriptions/listen streams naming the uri
    observers: set[Observer] = field(default_factory=set)
    kept: deque[tuple[int, ChangeOut]] = field(default_factory=lambda: deque(maxlen=KEPT))
    seq: int = 0  # changes seen; a gap in the feed counts as one more
    opened: asyncio.Future[str] | None = None
    task: asyncio.Task[None] | None = None

    @property
    def live(self) -> bool:
        return self.task is not None and not self.task.done()

    @property
    def idle(self) -> bool:
        """Nobody follows the uri any more: no reader, listen stream or observer."""
        return not self.readers and not self.listening and not self.observers

    def start(self) -> None:
        self.opened = asyncio.get_running_loop().create_future()
        self.task = asyncio.create_task(self._follow(self.opened), name=f"follow {self.uri}")
        self.task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        failure = None if task.cancelled() else task.exception()
        if failure is not None and self.opened is not None and self.opened.done():
            # It had started: its subscribers now read following: false.
            log.warning("following %s ended: %s", self.uri, failure)

    async def ready(self) -> None:
        """Return once the node's stream is open; raise ``FeedRefused`` if it will not be."""
        assert self.task is not None and self.opened is not None
        waiting: set[asyncio.Future[Any]] = {self.task, self.opened}
        await asyncio.wait(
            waiting, timeout=self.client.timeout, return_when=asyncio.FIRST_COMPLETED
        )
        if self.opened.done():
            return
        if not self.task.done():
            await self.stop()
            raise FeedRefused(self.uri, "unavailable", f"{self.uri}: the node did not answer")
        failure = self.task.exception()
        if isinstance(failure, InvalidArgument):
            named = [argument_name(name) for name, _ in failure.violations]
            why = "; ".join(f"{argument_name(name)}: {text}" for name, text in failure.violations)
            raise FeedRefused(
                self.uri, "invalid_argument", f"Invalid resource {self.uri}: {why or failure}",
                argument=named[0] if named else "",
            )  # fmt: skip
        reason = "permission_denied" if isinstance(failure, PermissionDenied) else "unavailable"
        raise FeedRefused(self.uri, reason, f"{self.uri} cannot be followed: {failure}")

    async def _follow(self, opened: asyncio.Future[str]) -> None:
        repo, topic = parse_uri(self.uri)

        def started(cursor: str) -> None:
            if not opened.done():
                opened.set_result(cursor)

        while True:
            try:
                async for event in self.client.watch(repo, topic=topic, on_start=started):
                    self.seq += 1
                    self.kept.append((self.seq, ChangeOut.of(event)))
                    self._observe(event)
                    await self._tell()
            except CursorExpired:  # fell out of the node's window: some changes are gone
                log.warning("following %s: changes were missed; following from now", self.uri)
                self.seq += 1
                self._observe(None)
                await self._tell()

    def _observe(self, event: WatchEvent | None) -> None:
        for observer in list(self.observers):
            try:
                observer(self.uri, event)
            except Exception:  # one observer's bug must not stop the feed for the others
                log.exception("an observer of %s failed", self.uri)

    async def _tell(self) -> None:
        for reader in list(self.readers):
            reader.changed(self.uri)
        if self.listening:
            await self.bus.publish(ResourceUpdated(uri=self.uri))

    def since(self, position: int | None) -> tuple[list[ChangeOut], int]:
        """The changes after ``position`` (``None``: every one kept), and how many are gone."""
        if position is None:
            return [change for _, change in self.kept], 0
        changes = [change for seq, change in self.kept if seq > position]
        return changes, max(0, self.seq - position - len(changes))

    async def stop(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task


class FeedHub:
    """Every topic the server follows, each for as long as someone subscribes."""

    def __init__(self, client: AsyncClient, bus: SubscriptionBus) -> None:
        self.client = client
        self.bus = bus
        self.followers: dict[str, _Follower] = {}

    async def _running(self, uri: str) -> _Follower:
        parse_uri(uri)
        follower = self.followers.get(uri)
        if follower is None:
            follower = self.followers[uri] = _Follower(self.client, self.bus, uri)
        if not follower.live:
            follower.start()
        try:
            await follower.ready()
        except FeedRefused:
            if follower.idle:
                self.followers.pop(uri, None)
            raise
        return follower

    async def subscribe(self, uri: str, reader: SessionFeeds) -> int:
        """Follow ``uri`` for ``reader``; the position it reads from (now)."""
        follower = await self._running(uri)
        follower.readers.add(reader)
        return follower.seq

    async def listen(self, uri: str) -> int:
        """Follow ``uri`` for a ``subscriptions/listen`` stream; the position of now."""
        follower = await self._running(uri)
        follower.listening += 1
        return follower.seq

    async def observe(self, uri: str, observer: Observer) -> None:
        """Call ``observer`` with every change of ``uri`` from now (once the node's
        stream is open, when this returns) until ``unobserve``; raise ``FeedRefused``
        if the stream will not open. Observing again is observing once."""
        parse_uri(uri)
        follower = self.followers.get(uri)
        if follower is None:
            follower = self.followers[uri] = _Follower(self.client, self.bus, uri)
        # Counted before waiting: a last subscriber leaving meanwhile keeps it running.
        follower.observers.add(observer)
        try:
            await self._running(uri)
        except FeedRefused:
            follower.observers.discard(observer)
            if follower.idle and self.followers.get(uri) is follower:
                del self.followers[uri]
            raise

    async def unobserve(self, uri: str, observer: Observer) -> None:
        follower = self.followers.get(uri)
        if follower is not None:
            follower.observers.discard(observer)
            await self._left(uri, follower)

    async def unsubscribe(self, uri: str, reader: SessionFeeds | None = None) -> None:
        """``reader`` (``None``: a listen stream) no longer follows ``uri``."""
        follower = self.followers.get(uri)
        if follower is None:
            return
        if reader is None:
            follower.listening = max(0, follower.listening - 1)
        else:
            follower.readers.discard(reader)
        await self._left(uri, follower)

    async def _left(self, uri: str, follower: _Follower) -> None:
        if follower.idle:
            del self.followers[uri]
            await follower.stop()

    def read(self, uri: str, session: Session | None) -> ChangesOut:
        """The resource's content for ``session`` (marking what it has now read)."""
        repo, topic = parse_uri(uri)
        follower = self.followers.get(uri)
        feeds = session.part(SessionFeeds, self.feeds_of) if session is not None else None
        events: list[ChangeOut] = []
        missed = 0
        if follower is not None:
            events, missed = follower.since(feeds.positions.get(uri) if feeds else None)
            if feeds is not None:
                feeds.positions[uri] = follower.seq
        return ChangesOut(
            uri=uri,
            repo_id=repo,
            topic=topic,
            following=follower is not None and follower.live,
            events=events,
            missed=missed,
        )

    def feeds_of(self, session: Session) -> SessionFeeds:
        return SessionFeeds(self, session)

    async def close(self) -> None:
        followers, self.followers = list(self.followers.values()), {}
        for follower in followers:
            await follower.stop()


class SessionFeeds:
    """What one session follows and has read (a session part), and its notifications."""

    def __init__(self, hub: FeedHub, session: Session) -> None:
        self.hub = hub
        self.session = session
        self.positions: dict[str, int] = {}
        self.subscribed: set[str] = set()
        self._pending: dict[str, None] = {}  # uris changed since their last notification
        self._wake = asyncio.Event()
        self._sender: asyncio.Task[None] | None = None

    async def subscribe(self, uri: str) -> None:
        """Follow ``uri`` (again: as it is, or restarted if its stream had ended)."""
        position = await self.hub.subscribe(uri, self)
        self.subscribed.add(uri)
        self.positions.setdefault(uri, position)

    async def unsubscribe(self, uri: str) -> None:
        if uri in self.subscribed:
            self.subscribed.discard(uri)
            await self.hub.unsubscribe(uri, self)

    def changed(self, uri: str) -> None:
        self._pending[uri] = None
        self._wake.set()
        if self._sender is None and self.session.notifier is not None:
            self._sender = asyncio.create_task(self._send(), name="resources/updated")

    async def _send(self) -> None:
        notifier = self.session.notifier
        assert notifier is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                uri = next(iter(self._pending))
                del self._pending[uri]
                try:
                    await notifier.send_resource_updated(uri)
                except Exception:  # best effort: the client may be gone already
                    log.debug("resources/updated for %s not sent", uri, exc_info=True)

    async def close(self) -> None:
        for uri in list(self.subscribed):
            await self.unsubscribe(uri)
        if self._sender is not None:
            self._sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sender


def feeds_of_request(hub: FeedHub, request: ServerRequestContext[Any, Any]) -> SessionFeeds:
    """The session feeds of a handshake-era request (``resources/subscribe`` exists
    only there, and every such connection is a session)."""
    session = session_of(request)
    if session is None:
        raise MCPError(INVALID_PARAMS, "resources/subscribe needs a session; this has none")
    return session.part(SessionFeeds, hub.feeds_of)


async def read_changes(hub: FeedHub, repo: str, topic: str, ctx: Context[Any, Any]) -> str:
    """The resource template's function: the changes as JSON text."""
    uri = URI_TEMPLATE.format(repo=repo, topic=topic)
    try:
        return hub.read(uri, session_of(ctx)).model_dump_json(by_alias=True, exclude_none=True)
    except FeedRefused as refused:
        raise refused.error() from None


async def on_subscribe(
    hub: FeedHub, request: ServerRequestContext[Any, Any], params: SubscribeRequestParams
) -> EmptyResult:
    """``resources/subscribe``: follow the topic for the session until it unsubscribes."""
    try:
        await feeds_of_request(hub, request).subscribe(params.uri)
    except FeedRefused as refused:
        raise refused.error() from None
    return EmptyResult()


async def on_unsubscribe(
    hub: FeedHub, request: ServerRequestContext[Any, Any], params: UnsubscribeRequestParams
) -> EmptyResult:
    await feeds_of_request(hub, request).unsubscribe(params.uri)
    return EmptyResult()


def listening(hub: FeedHub, listen: ListenHandler_) -> ListenHandler_:
    """The SDK's ``subscriptions/listen`` handler, following the fencemark topics the
    stream names for as long as the stream lasts."""

    async def handler(
        request: ServerRequestContext[Any, Any], params: SubscriptionsListenRequestParams
    ) -> HandlerResult:
        wanted = params.notifications.resource_subscriptions or []
        uris = [uri for uri in dict.fromkeys(wanted) if uri.startswith("fencemark:")]
        followed: list[str] = []
        session = session_of(request)
        try:
            for uri in uris:
                position = await hub.listen(uri)
                followed.append(uri)
                if session is not None:
                    session.part(SessionFeeds, hub.feeds_of).positions.setdefault(uri, position)
            return await listen(request, params)
        except FeedRefused as refused:
            raise refused.error() from None
        finally:
            with anyio.CancelScope(shield=True):
                for uri in followed:
                    await hub.unsubscribe(uri)

    return handler

"""Claims this server keeps alive for as long as an MCP session lasts (``keepAlive``).

A claim granted with ``keepAlive: true`` is held by ``client.hold()`` (SPEC §9,
``fencemark.client.keepalive``) in a task of the session: renewed every
``leaseSeconds / 3`` until the agent releases it (``stop``, before the release, so
no renewal races it) or the session ends (``close``): the renewals stop, nothing
is released, and the claim lapses at its home when its lease runs out, as any
claim whose holder went away.

A claim ends without its own renewal saying so when the change feed the server
follows (``fencemark.mcp.feed``: one ``Records.Watch`` per topic, shared with the
resource's subscribers) shows it ended: released by anyone (another session of the
same identity too), lapsed, taken back, superseded by a newer grant, the record
deleted. The hold then ends at once, with the reason its renewal would have
answered; its renewals stop. Which claim a change is about is told by tokens, never
by the order changes arrive in (a feed may lag behind the home):

- a change whose record's fence is below the kept token is older than the grant
  (however late it comes): it says nothing of it;
- a fence above the token is final, as the fence never goes down: ``superseded``
  (``missing`` when the change deleted the record), without asking the home;
- a fence equal to the token with an ending word (``released``, ``lapsed``,
  ``done``, ``failed``, ``deferred``, ``parked``, ``deleted``) is asked of the home
  at once with a renewal, whose refusal is the reason: the word says the most of
  what one commit did, which may be the end of the claim before it (a grant that
  records its predecessor's lapse is ``lapsed``), so it alone proves nothing.

Changes the feed missed (its cursor fell out of the node's window) are asked of the
home the same way. The feed is an earlier signal, not the only one: where the
server cannot follow the topic, or for a change made before its stream of the
topic opened (the first claim kept in a topic opens it just after the grant), the
next renewal still finds the end.

A loss (superseded, expired, released, missing, unreachable, a refusal) is kept
and told: in a log message on the session's own channel where its era has one
(best effort, ``notifications/message``, logger ``fencemark.keepalive``), and in
the ``keepAlive`` of every later result about the key (``status``), until the key
is kept alive again or the session ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Literal

from mcp.server.mcpserver.context import Context
from mcp_types import CallToolResult, LoggingMessageNotification, LoggingMessageNotificationParams

from fencemark.client import (
    AsyncClient,
    ClaimNextResult,
    ClaimResult,
    FencemarkError,
    Hold,
    Unavailable,
    WatchEvent,
)
from fencemark.mcp.feed import FeedHub, FeedRefused, uri_of_key
from fencemark.mcp.models import ClaimNextOut, KeepAliveOut
from fencemark.mcp.outcomes import error_result, with_keep_alive
from fencemark.mcp.sessions import Session, session_of

__all__ = ["LOGGER", "MAX_KEPT", "KeepAlives", "SessionHolds"]

log = logging.getLogger(__name__)
LOGGER = "fencemark.keepalive"  # the logger name of the log messages a loss sends
MAX_KEPT = 256  # claims one session may keep alive at once
SUPERSEDED, MISSING = "superseded", "missing"  # the reasons a renewal would answer
# The feed's words for a change that may have ended the claim of the record's fence.
ENDING_KINDS = frozenset({"released", "lapsed", "done", "failed", "deferred", "parked", "deleted"})


@dataclass
class _Kept:
    key: str
    token: int
    lease_seconds: float
    state: Literal["holding", "lost", "stopped"] = "holding"
    reason: str = ""
    hold: Hold | None = None
    task: asyncio.Task[None] | None = None
    # Set when the feed showed the claim may have ended (or ended it: state "lost").
    doubt: asyncio.Event = field(default_factory=asyncio.Event)
    following: str = ""  # the changes uri observed for it, until it ends

    def out(self) -> KeepAliveOut:
        return KeepAliveOut(
            fencing_token=self.token,
            state=self.state,
            reason=self.reason or None,
            lease_seconds=self.lease_seconds,
            renewals=self.hold.renewals if self.hold is not None else 0,
        )

    async def cancel(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task


class SessionHolds:
    """The claims one session keeps alive, by key (a session part)."""

    def __init__(self, client: AsyncClient, session: Session, hub: FeedHub | None = None) -> None:
        self.client = client
        self.session = session
        self.hub = hub
        self._kept: dict[str, _Kept] = {}
        self._following: dict[str, int] = {}  # changes uri -> kept claims observing it

    def has_room(self, key: str) -> bool:
        """Whether the session may keep one more claim (of ``key``) alive."""
        holding = [kept for kept in self._kept.values() if kept.state == "holding"]
        return key in self._kept or len(holding) < MAX_KEPT

    async def start(
        self, key: str, claim: ClaimResult | ClaimNextResult, lease_seconds: float
    ) -> KeepAliveOut:
        """Keep the granted ``claim`` of ``key`` alive (the same one again: as it is).

        Returns once the feed of the key's topic is followed (or cannot be): a change
        after the answer reaches the hold."""
        found = self._kept.get(key)
        if found is not None and found.token == claim.fencing_token and found.state == "holding":
            return found.out()
        if len(self._kept) >= MAX_KEPT:  # forget the oldest ended ones first
            for ended in [k for k, kept in self._kept.items() if kept.state != "holding"]:
                del self._kept[ended]
        kept = _Kept(key, claim.fencing_token, lease_seconds)
        self._kept[key] = kept
        await self._follow(kept)  # before the older hold lets go: the stream stays open
        if found is not None:
            await found.cancel()
            await self._unfollow(found)
        if self._kept.get(key) is not kept:  # the session closed, or a later start replaced it
            await self._unfollow(kept)
            return kept.out()
        kept.task = asyncio.create_task(self._keep(kept, claim), name=f"keepAlive {key}")
        return kept.out()

    async def stop(self, key: str, token: int) -> KeepAliveOut | None:
        """Stop keeping ``token``'s claim of ``key`` alive (before it is released)."""
        kept = self._kept.get(key)
        if kept is None or kept.token != token:
            return None
        await kept.cancel()
        await self._unfollow(kept)
        del self._kept[key]
        if kept.state == "holding":
            kept.state = "stopped"
        return kept.out()

    def status(self, key: str) -> KeepAliveOut | None:
        kept = self._kept.get(key)
        return None if kept is None else kept.out()

    async def close(self) -> None:
        """The session ended: stop renewing every claim (they lapse; none is released)."""
        kept, self._kept = list(self._kept.values()), {}
        for one in kept:
            await one.cancel()
            await self._unfollow(one)

    async def _keep(self, kept: _Kept, claim: ClaimResult | ClaimNextResult) -> None:
        async with self.client.hold(claim, key=kept.key, lease_seconds=kept.lease_seconds) as hold:
            kept.hold = hold
            reason = await self._until_lost(kept, hold)
        self._lose(kept, reason)
        await self._tell(kept)
        await self._unfollow(kept)

    async def _until_lost(self, kept: _Kept, hold: Hold) -> str:
        """Why the claim is over: a renewal's answer, or what the feed showed."""
        renewals = asyncio.ensure_future(hold.wait_lost())
        try:
            while True:
                doubt = asyncio.ensure_future(kept.doubt.wait())
                await asyncio.wait({renewals, doubt}, return_when=asyncio.FIRST_COMPLETED)
                doubt.cancel()
                if renewals.done():
                    return renewals.result()
                if kept.state != "holding":
                    return kept.reason  # the feed showed it over for certain
                kept.doubt.clear()
                reason = await self._ask_home(kept)
                if reason:
                    return reason
        finally:
            renewals.cancel()

    async def _ask_home(self, kept: _Kept) -> str:
        """Renew now: why the home refuses, or ``""`` (renewed, or no answer: the
        hold's own renewals go on)."""
        try:
            renewed = await self.client.renew_claim(
                kept.key, kept.token, lease_seconds=kept.lease_seconds
            )
        except Unavailable:
            return ""
        except FencemarkError as refused:  # e.g. not_holder, as the hold's renewal says it
            return str(getattr(refused, "reason", "")) or refused.code.name.lower()
        return "" if renewed.renewed else renewed.reason

    def _lose(self, kept: _Kept, reason: str) -> None:
        if kept.state == "holding":
            kept.state, kept.reason = "lost", reason
        kept.doubt.set()

    def _seen(self, uri: str, event: WatchEvent | None) -> None:
        """A change of a followed topic (``None``: changes were missed), in the
        follower's task: decided by tokens alone (the module docstring)."""
        if event is None:
            for each in self._kept.values():
                if each.following == uri and each.state == "holding":
                    each.doubt.set()
            return
        kept = self._kept.get(event.key)
        if kept is None or kept.state != "holding":
            return
        record = event.record
        if record.fence < kept.token:
            return  # a change from before the grant, however late it arrives
        if record.fence > kept.token:
            self._lose(kept, MISSING if record.deleted else SUPERSEDED)
        elif event.kind in ENDING_KINDS or record.deleted:
            kept.doubt.set()

    async def _follow(self, kept: _Kept) -> None:
        uri = uri_of_key(kept.key)
        if self.hub is None or uri is None:
            return
        try:
            await self.hub.observe(uri, self._seen)
        except FeedRefused as refused:  # the renewals alone will find its end
            log.info("keepAlive of %s: the topic's feed cannot be followed: %s", kept.key, refused)
            return
        kept.following = uri
        self._following[uri] = self._following.get(uri, 0) + 1

    async def _unfollow(self, kept: _Kept) -> None:
        uri, kept.following = kept.following, ""
        if not uri or self.hub is None:
            return
        left = self._following.pop(uri) - 1
        if left:
            self._following[uri] = left
        else:
            await self.hub.unobserve(uri, self._seen)

    async def _tell(self, kept: _Kept) -> None:
        notifier = self.session.notifier
        if notifier is None or self.session.closed:
            return
        data = {
            "event": "claimLost",
            "key": kept.key,
            "fencingToken": kept.token,
            "reason": kept.reason,
            "message": f"the claim {kept.token} of {kept.key} was lost ({kept.reason}): "
            "stop working on the item and do not write to it again",
        }
        message = LoggingMessageNotification(
            params=LoggingMessageNotificationParams(level="warning", logger=LOGGER, data=data)
        )
        try:
            await notifier.send_notification(message)
        except Exception:  # best effort: the next result about the key says it too
            log.debug("could not tell the session of the loss of %s", kept.key, exc_info=True)


class KeepAlives:
    """Where the tools find a session's holds, and what they say without one."""

    def __init__(self, client: AsyncClient, hub: FeedHub | None = None) -> None:
        self.client = client
        self.hub = hub  # the feeds whose changes end holds early; None: renewals alone

    def _make(self, session: Session) -> SessionHolds:
        return SessionHolds(self.client, session, self.hub)

    def found(self, ctx: Context[Any, Any]) -> SessionHolds | None:
        """The holds of the request's session, if it has kept any claim alive."""
        session = session_of(ctx)
        return None if session is None else session.find(SessionHolds)

    def holds_for(
        self, tool: str, ctx: Context[Any, Any], key: str
    ) -> SessionHolds | CallToolResult:
        """The session's holds for one more claim, or the refusal of ``keepAlive``
        (before anything is claimed: a refused argument changes nothing)."""
        session = session_of(ctx)
        if session is None:
            return error_result(
                f"Invalid arguments for {tool}: keepAlive: this connection has no MCP session"
                " to keep a claim alive for (the 2026-07-28 protocol over streamable HTTP keeps"
                " none): leave keepAlive out and renew with repocontext_renew_claim, or connect"
                " over stdio or with the initialize handshake"
            )
        holds = session.part(SessionHolds, self._make)
        if not holds.has_room(key):
            return error_result(
                f"Invalid arguments for {tool}: keepAlive: this session keeps {MAX_KEPT} claims"
                " alive already: release one first"
            )
        return holds

    def attach(self, result: CallToolResult, ctx: Context[Any, Any], key: str) -> CallToolResult:
        """``result`` with what the session's keepalive of ``key`` is doing, if any."""
        holds = self.found(ctx) if key else None
        status = holds.status(key) if holds is not None else None
        return result if status is None else with_keep_alive(result, status)

    async def next_out(
        self, result: ClaimNextResult, holds: SessionHolds | None, lease_seconds: float
    ) -> ClaimNextOut:
        """A ``ClaimNext``'s answer, its item kept alive when ``holds`` is given."""
        out = ClaimNextOut.of(result)
        if holds is None or not result.granted or result.record is None:
            return out
        kept = await holds.start(result.record.key, result, lease_seconds)
        return out.model_copy(update={"keep_alive": kept})

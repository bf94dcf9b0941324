"""Claims this server keeps alive for as long as an MCP session lasts (``keepAlive``).

A claim granted with ``keepAlive: true`` is held by ``client.hold()`` (SPEC §9,
``fencemark.client.keepalive``) in a task of the session: renewed every
``leaseSeconds / 3`` until the agent releases it (``stop``, before the release, so
no renewal races it) or the session ends (``close``): the renewals stop, nothing
is released, and the claim lapses at its home when its lease runs out, as any
claim whose holder went away.

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
from dataclasses import dataclass
from typing import Any, Literal

from mcp.server.mcpserver.context import Context
from mcp_types import CallToolResult, LoggingMessageNotification, LoggingMessageNotificationParams

from fencemark.client import AsyncClient, ClaimNextResult, ClaimResult, Hold
from fencemark.mcp.models import ClaimNextOut, KeepAliveOut
from fencemark.mcp.outcomes import error_result, with_keep_alive
from fencemark.mcp.sessions import Session, session_of

__all__ = ["LOGGER", "MAX_KEPT", "KeepAlives", "SessionHolds"]

log = logging.getLogger(__name__)
LOGGER = "fencemark.keepalive"  # the logger name of the log messages a loss sends
MAX_KEPT = 256  # claims one session may keep alive at once


@dataclass
class _Kept:
    key: str
    token: int
    lease_seconds: float
    state: Literal["holding", "lost", "stopped"] = "holding"
    reason: str = ""
    hold: Hold | None = None
    task: asyncio.Task[None] | None = None

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

    def __init__(self, client: AsyncClient, session: Session) -> None:
        self.client = client
        self.session = session
        self._kept: dict[str, _Kept] = {}

    def has_room(self, key: str) -> bool:
        """Whether the session may keep one more claim (of ``key``) alive."""
        holding = [kept for kept in self._kept.values() if kept.state == "holding"]
        return key in self._kept or len(holding) < MAX_KEPT

    async def start(
        self, key: str, claim: ClaimResult | ClaimNextResult, lease_seconds: float
    ) -> KeepAliveOut:
        """Keep the granted ``claim`` of ``key`` alive (the same one again: as it is)."""
        found = self._kept.get(key)
        if found is not None and found.token == claim.fencing_token and found.state == "holding":
            return found.out()
        if found is not None:
            await found.cancel()
        if len(self._kept) >= MAX_KEPT:  # forget the oldest ended ones first
            for ended in [k for k, kept in self._kept.items() if kept.state != "holding"]:
                del self._kept[ended]
        kept = _Kept(key, claim.fencing_token, lease_seconds)
        self._kept[key] = kept
        kept.task = asyncio.create_task(self._keep(kept, claim), name=f"keepAlive {key}")
        return kept.out()

    async def stop(self, key: str, token: int) -> KeepAliveOut | None:
        """Stop keeping ``token``'s claim of ``key`` alive (before it is released)."""
        kept = self._kept.get(key)
        if kept is None or kept.token != token:
            return None
        await kept.cancel()
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

    async def _keep(self, kept: _Kept, claim: ClaimResult | ClaimNextResult) -> None:
        async with self.client.hold(claim, key=kept.key, lease_seconds=kept.lease_seconds) as hold:
            kept.hold = hold
            reason = await hold.wait_lost()
        kept.state, kept.reason = "lost", reason
        await self._tell(kept)

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

    def __init__(self, client: AsyncClient) -> None:
        self.client = client

    def _make(self, session: Session) -> SessionHolds:
        return SessionHolds(self.client, session)

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

"""Waiting for work without polling: ``repocontext_wait_for_work``.

``repocontext_claim_next`` with ``waitSeconds`` waits at most 300 s. This tool
waits up to ``timeoutSeconds`` (an hour at most), in rounds of the client's own
``claim_next`` with a wait: it asks the target first, then every other region the
server knows, none waiting; then it waits in the target's line, where the target
hands it an item of its own region, or — when this waiter is the first an item of
another region suits — tells it of that item, and only this waiter asks its home
(``AsyncClient.claim_next``, ``hint_elsewhere``). Waiters do not each watch the
topic nor each look at every region on every change: one new item sends one waiter
(docs/consistency.md, *Waiting across regions*).

It never asks a node on a timer: a look follows a change or the end of a wait.
While it waits it reports progress (``notifications/progress``) every
``PROGRESS_EVERY_S`` to a client that asked for it (a ``progressToken``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Annotated, Any

from mcp.server.mcpserver.context import Context
from mcp_types import CallToolResult
from pydantic import Field

from fencemark.client import ClaimNextResult
from fencemark.mcp.models import ClaimNextOut
from fencemark.mcp.outcomes import success
from fencemark.mcp.schema import (
    MAX_WAIT_FOR_WORK_S,
    MAX_WAIT_S,
    ItemTags,
    KeepAlive,
    LeaseSeconds,
    Owner,
    RepoId,
    ToolSpec,
    Topic,
    hints,
)
from fencemark.mcp.tools import RepoContextTools

__all__ = ["PROGRESS_EVERY_S", "WORK_TOOLS", "WorkTools"]

log = logging.getLogger(__name__)
PROGRESS_EVERY_S = 10.0
EMPTY = "empty"
_NEVER_FREES = frozenset({"claimed", "parked", "deleted"})  # kinds that make nothing eligible
REMEMBERED = 10_000  # records whose last state a wait remembers, to pass over renewals

TimeoutSeconds = Annotated[
    float,
    Field(
        ge=0,
        le=MAX_WAIT_FOR_WORK_S,
        allow_inf_nan=False,
        description="Give up after this long (0 to 3600 s) and answer granted: false, reason "
        "empty. Some MCP clients end a call sooner unless progress resets their timeout: "
        f"this tool reports progress every {PROGRESS_EVERY_S:g} s.",
    ),
]
Ask = Callable[..., Awaitable[ClaimNextResult]]


class WorkTools(RepoContextTools):
    """The tools, with ``repocontext_wait_for_work``."""

    async def wait_for_work(
        self,
        repoId: RepoId,
        topic: Topic,
        owner: Owner,
        leaseSeconds: LeaseSeconds,
        timeoutSeconds: TimeoutSeconds = 60.0,
        tags: ItemTags = None,
        keepAlive: KeepAlive = False,
        *,
        ctx: Context[Any, Any],
    ) -> Annotated[CallToolResult, ClaimNextOut]:
        tool = "repocontext_wait_for_work"
        holds = self.keep_alives.holds_for(tool, ctx, "") if keepAlive else None
        if isinstance(holds, CallToolResult):
            return holds
        wanted = tags or []
        ask = functools.partial(
            self.client.claim_next, repoId, topic, owner, lease_seconds=leaseSeconds, tags=wanted
        )

        async def call() -> CallToolResult:
            result = await self._wait(ask, repoId, topic, wanted, timeoutSeconds, ctx)
            return success(await self.keep_alives.next_out(result, holds, leaseSeconds))

        return await self._run(tool, "", call)

    async def _wait(
        self,
        ask: Ask,
        repo: str,
        topic: str,
        tags: Sequence[str],
        seconds: float,
        ctx: Context[Any, Any],
    ) -> ClaimNextResult:
        """Rounds of ``claim_next`` with a wait (at most ``MAX_WAIT_S`` each) until an
        answer that is not ``empty``, or ``seconds`` run out."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        beat = asyncio.create_task(_progress(ctx, seconds, f"{repo}/{topic}"))
        try:
            while True:
                left = max(0.0, deadline - loop.time())
                result = await ask(wait_seconds=min(left, MAX_WAIT_S))
                if result.granted or result.reason != EMPTY or deadline - loop.time() <= 0:
                    return result
        finally:
            beat.cancel()


async def _progress(ctx: Context[Any, Any], total: float, what: str) -> None:
    """Tell the client every ``PROGRESS_EVERY_S`` that the wait (of ``total`` s) goes on."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        while True:
            waited = min(loop.time() - started, total)
            await ctx.report_progress(waited, total, f"waiting for an eligible item of {what}")
            await asyncio.sleep(PROGRESS_EVERY_S)
    except asyncio.CancelledError:
        raise
    except Exception:  # progress is advice: a client gone or a call outside a request
        log.debug("progress of a wait for work not sent", exc_info=True)


WORK_TOOLS = (
    ToolSpec(
        "repocontext_wait_for_work",
        "wait_for_work",
        "Wait for work and claim it: like repocontext_claim_next, but when nothing is eligible "
        "it waits (up to timeoutSeconds, default 60) until an item of the topic can be claimed, "
        "then claims it — without polling: the server waits in the node's own line, which "
        "also tells it of an item homed in another region. granted: true gives fencingToken, "
        "leaseExpiresAtUtc and the record; granted: false with reason empty means there was "
        "still no work when the time ran out (an answer, not an error): call it again, or stop. "
        "With keepAlive: true the server renews the claim for you while this session lasts. "
        "Then work on the item and finish with repocontext_release_claim and an outcome.",
        hints("Wait for work", read_only=False, idempotent=True, destructive=False),
    ),
)

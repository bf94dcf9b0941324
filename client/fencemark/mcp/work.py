"""Waiting for work without polling: ``repocontext_wait_for_work``.

``repocontext_claim_next`` with ``waitSeconds`` waits in the target node's own
line: the node wakes it on a change in the topic, or when a deferral or a lease
of it ends, but it hands out only the items homed in the target's region, for at
most 300 s. This tool waits longer and for every region the server knows:

1. With other regions (``--regions``), it first opens the topic's change feed at
   the target (``Records.Watch``; the target's replica merges every region's
   changes) and waits until the node has fixed where the feed starts, so no
   change after its first look is missed.
2. It asks for the next item as ``repocontext_claim_next`` does: its own region
   first, then the others, none waiting. Granted: the answer.
3. Else it waits in the target's line (cancelled cleanly if it leaves) until the
   node hands it an item, the line's wait ends, or — with other regions — a
   change on the feed may have made an item of another region eligible (any
   change but a grant, a park, a delete or a renewal, which leaves the item's
   queue state as it was; of the target's own items only a ``done``, which may
   free ``after:`` items elsewhere; a deferral also wakes it again when it
   ends). Then it looks again (2), until ``timeoutSeconds``.

It never asks a node on a timer: a look follows a change or the end of a wait.
While it waits it reports progress (``notifications/progress``) every
``PROGRESS_EVERY_S`` to a client that asked for it (a ``progressToken``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Annotated, Any

import anyio
import grpc
from mcp.server.mcpserver.context import Context
from mcp_types import CallToolResult
from pydantic import Field

from fencemark.client import AsyncClient, ClaimNextResult, Record, Unavailable, WatchEvent
from fencemark.mcp.holds import KeepAlives
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


def _what_frees(record: Record) -> tuple[object, ...]:
    """What of a record decides whether it can be handed out (not its lease)."""
    fields = tuple(sorted(record.fields.items()))
    return (record.status, record.fence, record.tags, fields, record.not_before, record.deleted)


class _Changes:
    """The topic's changes at the target that may make an item of another region
    eligible: ``woken`` is set on each (and when a deferral seen ends)."""

    def __init__(self, client: AsyncClient, repo: str, topic: str, tags: Sequence[str]) -> None:
        self.client, self.repo, self.topic, self.tags = client, repo, topic, tags
        self.here = ""
        self.woken = asyncio.Event()
        self._timers: list[asyncio.TimerHandle] = []
        self._task: asyncio.Task[None] | None = None
        self._last: OrderedDict[str, tuple[object, ...]] = OrderedDict()

    @contextlib.asynccontextmanager
    async def open(self, here: str) -> AsyncIterator[_Changes]:
        """Follow the feed from a start the node has fixed; the watch ends on leaving."""
        self.here = here
        opened = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._follow(opened), name=f"wait for {self.topic}")
        try:
            waiting: set[asyncio.Future[Any]] = {self._task, opened}
            first = asyncio.FIRST_COMPLETED
            await asyncio.wait(waiting, timeout=self.client.timeout, return_when=first)
            if self._task.done():
                self._task.result()  # raises what ended the watch (e.g. a bad repoId)
            if not opened.done():
                raise Unavailable(grpc.StatusCode.UNAVAILABLE, "the change feed did not open")
            yield self
        finally:
            for timer in self._timers:
                timer.cancel()
            self._task.cancel()
            with anyio.CancelScope(shield=True), contextlib.suppress(asyncio.CancelledError):
                await self._task  # the node sees the stream end before the answer

    async def _follow(self, opened: asyncio.Future[str]) -> None:
        def started(cursor: str) -> None:
            if not opened.done():
                opened.set_result(cursor)

        async for event in self.client.watch(
            self.repo, topic=self.topic, tags=self.tags, on_start=started
        ):
            self._saw(event)

    def _saw(self, event: WatchEvent) -> None:
        record = event.record
        if event.kind in _NEVER_FREES or (record.home_region == self.here and event.kind != "done"):
            return  # the target's own line wakes for the target's own items
        seen = _what_frees(record)
        if event.kind == "updated" and self._last.get(record.key) == seen:
            return  # a renewal: the item's queue state did not change
        self._last[record.key] = seen
        self._last.move_to_end(record.key)
        while len(self._last) > REMEMBERED:
            self._last.popitem(last=False)
        self.woken.set()
        if event.kind == "deferred" and record.not_before is not None:
            delay = (record.not_before - datetime.now(UTC)).total_seconds()
            self._timers.append(asyncio.get_running_loop().call_later(delay, self.woken.set))


class WorkTools(RepoContextTools):
    """The tools, with ``repocontext_wait_for_work``; ``region`` is the target's."""

    def __init__(self, client: AsyncClient, keep_alives: KeepAlives, region: str) -> None:
        super().__init__(client, keep_alives)
        self.region = region

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
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        others = set(self.client.regions.values()) - {self.client.target}
        beat = asyncio.create_task(_progress(ctx, seconds, f"{repo}/{topic}"))
        try:
            if not others:
                return await self._until(ask, deadline, None)
            async with _Changes(self.client, repo, topic, tags).open(self.region) as changes:
                return await self._until(ask, deadline, changes)
        finally:
            beat.cancel()

    async def _until(self, ask: Ask, deadline: float, changes: _Changes | None) -> ClaimNextResult:
        loop = asyncio.get_running_loop()
        while True:
            if changes is not None:
                changes.woken.clear()  # a change from now on wakes the wait below
            result = await ask()
            left = deadline - loop.time()
            if result.granted or result.reason != EMPTY or left <= 0:
                return result
            waited = await _wait_round(ask, min(left, MAX_WAIT_S), changes)
            if waited is not None and (waited.granted or waited.reason != EMPTY):
                return waited


async def _wait_round(ask: Ask, seconds: float, changes: _Changes | None) -> ClaimNextResult | None:
    """A wait in the target's line, left early when ``changes`` wakes (``None`` then)."""
    if changes is not None and changes.woken.is_set():
        return None  # woken while it looked: look again rather than start and leave a wait
    waiting = asyncio.ensure_future(ask(wait_seconds=seconds, only_target=True))
    if changes is None:
        return await waiting
    woken = asyncio.ensure_future(changes.woken.wait())
    try:
        await asyncio.wait({waiting, woken}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        woken.cancel()
        if not waiting.done():
            waiting.cancel()  # the node gives back what it picked for a caller that left
    await asyncio.wait({waiting})
    return None if waiting.cancelled() else waiting.result()


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
        "then claims it — without polling: the server waits in the node's own line and follows "
        "the topic's changes in every region. granted: true gives fencingToken, "
        "leaseExpiresAtUtc and the record; granted: false with reason empty means there was "
        "still no work when the time ran out (an answer, not an error): call it again, or stop. "
        "With keepAlive: true the server renews the claim for you while this session lasts. "
        "Then work on the item and finish with repocontext_release_claim and an outcome.",
        hints("Wait for work", read_only=False, idempotent=True, destructive=False),
    ),
)

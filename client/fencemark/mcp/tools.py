"""The ``repocontext_*`` tools: one per Fencemark call, with the seed's argument names.

Each tool is a thin face over one ``AsyncClient`` method (the same rules,
deadlines, retries and home-region routing) that turns its answer into
structured content (``fencemark.mcp.models``) or a tool error
(``fencemark.mcp.outcomes``). What each call guarantees is written once, in
docs/consistency.md; the descriptions below are what an agent reads, next to each
tool's registration text, so that they are reviewed together. Shared argument
types: ``fencemark.mcp.schema``; keepAlive: ``fencemark.mcp.holds``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

from mcp.server.mcpserver.context import Context
from mcp_types import CallToolResult
from pydantic import Field

from fencemark.client import AsyncClient, ClaimConflict, FencemarkError
from fencemark.mcp.holds import KeepAlives
from fencemark.mcp.models import (
    ClaimNextOut,
    ClaimOut,
    ClaimStatusOut,
    ListOut,
    RecordOut,
    ReleaseOut,
    RememberOut,
    RenewOut,
    UpdateOut,
)
from fencemark.mcp.outcomes import conflict_result, failure_result, success
from fencemark.mcp.schema import (
    MAX_RETRY_AFTER_S,
    MAX_TOKEN,
    ItemTags,
    KeepAlive,
    Key,
    LeaseSeconds,
    Owner,
    RepoId,
    Token,
    ToolSpec,
    Topic,
    WaitSeconds,
    hints,
)

__all__ = ["MUTATING_TOOLS", "READ_TOOLS", "RepoContextTools"]


class RepoContextTools:
    """The tools, bound to the client they call through."""

    def __init__(self, client: AsyncClient, keep_alives: KeepAlives) -> None:
        self.client = client
        self.keep_alives = keep_alives

    async def _run(
        self,
        tool: str,
        key: str,
        call: Callable[[], Awaitable[CallToolResult]],
        *,
        fenced_write: bool = False,
        applied_maybe: bool = False,
        ctx: Context[Any, Any] | None = None,
    ) -> CallToolResult:
        """``call``'s result or failure; with ``ctx``, saying what the session's
        keepalive of ``key`` is doing (a loss included)."""
        try:
            result = await call()
        except FencemarkError as error:
            if fenced_write and isinstance(error, ClaimConflict):
                result = conflict_result(tool, key, error)
            else:
                result = failure_result(
                    tool, error, target=self.client.target, key=key, applied_maybe=applied_maybe
                )
        return result if ctx is None else self.keep_alives.attach(result, ctx, key)

    async def remember(
        self,
        repoId: RepoId,
        topic: Annotated[str, Field(description="Topic within the repo, e.g. backlog.")],
        id: Annotated[
            str,
            Field(description="Stable id of the item, e.g. issue-2101: it makes the key."),
        ],
        kind: Annotated[str, Field(description="e.g. Note, Task, Decision.")] = "",
        author: Annotated[str, Field(description="Who writes this, e.g. backlog-pm.")] = "",
        title: str = "",
        body: str = "",
        tags: Annotated[
            list[str],
            Field(
                description="Tags to add, e.g. backlog, priority:P1. homeRegion:R picks the "
                "region that decides the record's claims (default: this node's region)."
            ),
        ] = [],  # noqa: B006 - the SDK builds a fresh validated list per call
    ) -> Annotated[CallToolResult, RememberOut]:
        key = f"repo/{repoId}/mem/{topic}/{id}"

        async def call() -> CallToolResult:
            result = await self.client.remember(
                repoId, topic, id, kind=kind, author=author, title=title, body=body, tags=tags
            )
            return success(RememberOut(created=result.created, record=RecordOut.of(result.record)))

        return await self._run("repocontext_remember", key, call, fenced_write=True)

    async def update(
        self,
        key: Key,
        fields: Annotated[
            dict[str, str],
            Field(
                description='Fields to write, e.g. {"body": "started"}; an empty value clears '
                "a field. Names match [A-Za-z0-9._:-]{1,128}."
            ),
        ],
        fencingToken: Annotated[
            int | None,
            Field(
                ge=0,
                le=MAX_TOKEN,
                description="Your claim's fencingToken. Required while the record is claimed; "
                "omit (or 0) for an unfenced write.",
            ),
        ] = None,
        *,
        ctx: Context[Any, Any],
    ) -> Annotated[CallToolResult, UpdateOut]:
        async def call() -> CallToolResult:
            record = await self.client.update(key, fields=fields, fencing_token=fencingToken or 0)
            return success(UpdateOut(record=RecordOut.of(record)))

        return await self._run(
            "repocontext_update", key, call, fenced_write=True, applied_maybe=True, ctx=ctx
        )

    async def claim(
        self,
        key: Key,
        owner: Owner,
        leaseSeconds: LeaseSeconds,
        waitSeconds: WaitSeconds = 0.0,
        keepAlive: KeepAlive = False,
        *,
        ctx: Context[Any, Any],
    ) -> Annotated[CallToolResult, ClaimOut]:
        holds = self.keep_alives.holds_for("repocontext_claim", ctx, key) if keepAlive else None
        if isinstance(holds, CallToolResult):
            return holds

        async def call() -> CallToolResult:
            result = await self.client.claim(
                key, owner, lease_seconds=leaseSeconds, wait_seconds=waitSeconds
            )
            out = ClaimOut.of(key, owner, result)
            if holds is not None and result.granted:
                kept = await holds.start(key, result, leaseSeconds)
                out = out.model_copy(update={"keep_alive": kept})
            return success(out)

        return await self._run("repocontext_claim", key, call, ctx=ctx)

    async def renew_claim(
        self, key: Key, fencingToken: Token, leaseSeconds: LeaseSeconds, *, ctx: Context[Any, Any]
    ) -> Annotated[CallToolResult, RenewOut]:
        async def call() -> CallToolResult:
            result = await self.client.renew_claim(key, fencingToken, lease_seconds=leaseSeconds)
            return success(RenewOut.of(key, fencingToken, result))

        return await self._run("repocontext_renew_claim", key, call, ctx=ctx)

    async def release_claim(
        self,
        key: Key,
        fencingToken: Token,
        outcome: Annotated[
            Literal["done", "failed", "deferred"] | None,
            Field(
                description="How your work ended: done (never handed out again), failed "
                "(counts against the item's attempts; parked when they run out), deferred "
                "(handed out again after retryAfterSeconds). Leave it out to hand the item "
                "back as it was."
            ),
        ] = None,
        fields: Annotated[
            dict[str, str] | None,
            Field(
                description="Fields to write with the release, in the same commit under your "
                'token, e.g. {"result": "merged in #2107"}.'
            ),
        ] = None,
        retryAfterSeconds: Annotated[
            float | None,
            Field(
                ge=0,
                le=MAX_RETRY_AFTER_S,
                allow_inf_nan=False,
                description="With outcome deferred: how long to keep the item back (seconds).",
            ),
        ] = None,
        *,
        ctx: Context[Any, Any],
    ) -> Annotated[CallToolResult, ReleaseOut]:
        holds = self.keep_alives.found(ctx)
        # The keepalive stops first: no renewal of it races the release.
        stopped = await holds.stop(key, fencingToken) if holds is not None else None

        async def call() -> CallToolResult:
            result = await self.client.release_claim(
                key,
                fencingToken,
                outcome=outcome or "",
                fields=fields,
                retry_after_seconds=retryAfterSeconds or 0.0,
            )
            return success(ReleaseOut.of(key, result).model_copy(update={"keep_alive": stopped}))

        return await self._run("repocontext_release_claim", key, call, ctx=ctx)

    async def claim_next(
        self,
        repoId: RepoId,
        topic: Topic,
        owner: Owner,
        leaseSeconds: LeaseSeconds,
        waitSeconds: WaitSeconds = 0.0,
        tags: ItemTags = None,
        keepAlive: KeepAlive = False,
        *,
        ctx: Context[Any, Any],
    ) -> Annotated[CallToolResult, ClaimNextOut]:
        tool = "repocontext_claim_next"
        holds = self.keep_alives.holds_for(tool, ctx, "") if keepAlive else None
        if isinstance(holds, CallToolResult):
            return holds

        async def call() -> CallToolResult:
            result = await self.client.claim_next(
                repoId,
                topic,
                owner,
                lease_seconds=leaseSeconds,
                wait_seconds=waitSeconds,
                tags=tags or (),
            )
            return success(await self.keep_alives.next_out(result, holds, leaseSeconds))

        return await self._run(tool, "", call)

    async def claim_status(
        self, key: Key, *, ctx: Context[Any, Any]
    ) -> Annotated[CallToolResult, ClaimStatusOut]:
        async def call() -> CallToolResult:
            return success(ClaimStatusOut.of(key, await self.client.claim_status(key)))

        return await self._run("repocontext_claim_status", key, call, ctx=ctx)

    async def recall(self, key: Key) -> Annotated[CallToolResult, RecordOut]:
        async def call() -> CallToolResult:
            return success(RecordOut.of(await self.client.get(key)))

        return await self._run("repocontext_recall", key, call)

    async def list_records(
        self,
        repoId: RepoId,
        topic: Annotated[str | None, Field(description="Only this topic, e.g. backlog.")] = None,
        tag: Annotated[
            str | None, Field(description="Only records with this tag, e.g. priority:P1.")
        ] = None,
        pageToken: Annotated[
            str | None, Field(description="The nextPageToken of the previous page.")
        ] = None,
    ) -> Annotated[CallToolResult, ListOut]:
        async def call() -> CallToolResult:
            page = await self.client.list(
                repoId, topic=topic or "", tag=tag or "", page_token=pageToken or ""
            )
            return success(
                ListOut(
                    records=[RecordOut.of(record) for record in page.records],
                    next_page_token=page.next_page_token or None,
                )
            )

        return await self._run("repocontext_list", "", call)


MUTATING_TOOLS = (
    ToolSpec(
        "repocontext_remember",
        "remember",
        "Create a record (agent memory, a backlog item) at key repo/{repoId}/mem/{topic}/{id}, "
        "or merge into it if it exists. The key is deterministic: repeating the same call never "
        "creates a duplicate. Non-empty kind, author, title and body overwrite; tags are only "
        "added. A new record is homed in the region its homeRegion:R tag names (else this "
        "node's region); only that region grants its claims. Use it to seed items; record "
        "progress on an item you claimed with repocontext_update and your fencingToken. While "
        "another worker holds a live claim the call is refused with "
        "RepoContextClaimConflictException (conflict: claimed).",
        hints("Remember a record", read_only=False, idempotent=True, destructive=False),
    ),
    ToolSpec(
        "repocontext_update",
        "update",
        "Write fields of an existing record (an empty value clears a field). While the record "
        "is claimed, pass the fencingToken repocontext_claim gave you: without it the write is "
        "refused (conflict: claimed). A refused write is a tool error naming "
        "RepoContextClaimConflictException, with error.conflict, error.fence and "
        "error.homeRegion in the structured content. conflict superseded, expired or released "
        "means your claim is over: stop working on the item and do not retry the write. "
        "Updates are not retried automatically.",
        hints("Update a record", read_only=False, idempotent=False, destructive=True),
    ),
    ToolSpec(
        "repocontext_claim",
        "claim",
        "Claim a record before working on it: a lease and a fencing token. granted: true gives "
        "fencingToken and leaseExpiresAtUtc: pass the token to every repocontext_update of the "
        "item, renew with repocontext_renew_claim well before the lease expires (e.g. every "
        "leaseSeconds/3), and repocontext_release_claim when done. granted: false is a normal "
        "answer, not an error; reason contended: another worker holds it (pick other work, or "
        "claim with waitSeconds to queue); timeout: you waited in vain; missing: no such "
        "record; wrong_region: run the server with --regions naming homeRegion's node. Asking "
        "again as the owner who holds the claim returns the same token with a longer lease.",
        hints("Claim a record", read_only=False, idempotent=True, destructive=False),
    ),
    ToolSpec(
        "repocontext_renew_claim",
        "renew_claim",
        "Extend your live claim's lease (never shortens it). renewed: false is the "
        "authoritative answer that your claim is over: reason superseded means you lost the "
        "item to a higher token, so stop working on it immediately; expired or released mean "
        "your claim ended (claim again if you still want the item).",
        hints("Renew a claim", read_only=False, idempotent=True, destructive=False),
    ),
    ToolSpec(
        "repocontext_release_claim",
        "release_claim",
        "Release your claim when you stop working on the item, saying how it went: outcome "
        "done (finished: never handed out again), failed (it counts against the item's "
        "attempts; at maxAttempts the item is parked for an operator), deferred with "
        "retryAfterSeconds (try again later); fields are written in the same commit under "
        "your token, so record the result here. Leave outcome out to hand the item back as "
        "it was. With an outcome or fields only the live claim's token is accepted: "
        "released: false with reason superseded, expired or released means your claim was "
        "over and nothing was recorded. Safe to repeat. It never lowers the fence: older "
        "tokens stay refused forever.",
        hints("Release a claim", read_only=False, idempotent=True, destructive=False),
    ),
    ToolSpec(
        "repocontext_claim_next",
        "claim_next",
        "Claim the next item to work on in a topic, in one step: the most urgent eligible "
        "item (priority:P0 first, then the oldest) that is open, not claimed, not deferred, "
        "whose after:<id> items are done and that carries every tag you ask for. granted: "
        "true gives fencingToken, leaseExpiresAtUtc and the record: work on it, pass the "
        "token to repocontext_update, renew with repocontext_renew_claim, and finish with "
        "repocontext_release_claim and an outcome. granted: false with reason empty means "
        "no work now (waitSeconds waits for some). Items of every region the server knows "
        "(--regions) are offered, its own region's first. Safe to repeat: while your owner "
        "holds an item of the topic, asking again gives you that item back (same token, "
        "lease extended); release it to get the next.",
        hints("Claim the next item", read_only=False, idempotent=True, destructive=False),
    ),
)

READ_TOOLS = (
    ToolSpec(
        "repocontext_claim_status",
        "claim_status",
        "Look at a record's claim: the live claim (owner, fencingToken, leaseExpiresAtUtc) if "
        "any, the fence (largest token ever granted) and queueDepth. authoritative is always "
        "false: this snapshot may already be stale and cannot prove you still own the item; "
        "only a write presenting your token (or repocontext_renew_claim) can.",
        hints("Claim status", read_only=True, idempotent=True, destructive=False),
    ),
    ToolSpec(
        "repocontext_recall",
        "recall",
        "Read one record by key: its kind, author, title, body, other fields, tags, "
        "homeRegion and fence.",
        hints("Recall a record", read_only=True, idempotent=True, destructive=False),
    ),
    ToolSpec(
        "repocontext_list",
        "list_records",
        "List a repo's records in key order, optionally only one topic and/or only records "
        "carrying one tag (e.g. backlog, priority:P1). At most 100 per page; pass "
        "nextPageToken as pageToken for the next page.",
        hints("List records", read_only=True, idempotent=True, destructive=False),
    ),
)

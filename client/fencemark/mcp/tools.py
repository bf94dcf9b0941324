"""The ``repocontext_*`` tools: one per Fencemark call, with the seed's argument names.

Each tool is a thin face over one ``AsyncClient`` method (the same rules,
deadlines, retries and home-region routing) that turns its answer into
structured content (``fencemark.mcp.models``) or a tool error
(``fencemark.mcp.outcomes``). What each call guarantees is written once, in
docs/consistency.md; the descriptions below are what an agent reads.

About 430 lines on purpose: each tool's arguments (with the descriptions agents
read) and its registration text sit in one file, where they are reviewed together.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from mcp.server.mcpserver.tools import Tool
from mcp_types import CallToolResult, ToolAnnotations
from pydantic import Field

from fencemark.client import AsyncClient, ClaimConflict, FencemarkError
from fencemark.mcp.arguments import strict_tool
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

__all__ = ["MUTATING_TOOLS", "READ_TOOLS", "RepoContextTools", "ToolSpec"]

MAX_TOKEN = 2**64 - 1  # fencing tokens are uint64 on the wire
# SPEC §2's limits, published in the input schemas; the node checks them as well.
MIN_LEASE_S, MAX_LEASE_S, MAX_WAIT_S = 1, 3600, 300

Key = Annotated[
    str,
    Field(
        description="The record's key, repo/{repoId}/mem/{topic}/{id}, e.g. "
        "repo/lattice/mem/backlog/issue-2101 (repocontext_remember returns it)."
    ),
]
Token = Annotated[
    int,
    Field(ge=1, le=MAX_TOKEN, description="The fencingToken repocontext_claim granted you."),
]
LeaseSeconds = Annotated[
    float,
    Field(
        ge=MIN_LEASE_S,
        le=MAX_LEASE_S,
        allow_inf_nan=False,
        description="How long the lease lasts unless renewed: 1 to 3600 seconds.",
    ),
]

Owner = Annotated[
    str,
    Field(
        description="Who you are, unique per worker (e.g. worker-a-7f3c): two workers "
        "sharing an owner name are one worker to Fencemark."
    ),
]
WaitSeconds = Annotated[
    float,
    Field(
        ge=0,
        le=MAX_WAIT_S,
        allow_inf_nan=False,
        description="Wait up to this long (0 to 300 s) in a FIFO line: for the claim when "
        "someone else holds it, or for an item when none is eligible; 0 answers at once.",
    ),
]
MAX_RETRY_AFTER_S = 30 * 24 * 3600  # a deferral of at most 30 days


class RepoContextTools:
    """The tools, bound to the client they call through."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client

    async def _run(
        self,
        tool: str,
        key: str,
        call: Callable[[], Awaitable[CallToolResult]],
        *,
        fenced_write: bool = False,
        applied_maybe: bool = False,
    ) -> CallToolResult:
        try:
            return await call()
        except FencemarkError as error:
            if fenced_write and isinstance(error, ClaimConflict):
                return conflict_result(tool, key, error)
            return failure_result(
                tool, error, target=self.client.target, key=key, applied_maybe=applied_maybe
            )

    async def remember(
        self,
        repoId: Annotated[str, Field(description="Repository name, e.g. lattice.")],
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
    ) -> Annotated[CallToolResult, UpdateOut]:
        async def call() -> CallToolResult:
            record = await self.client.update(key, fields=fields, fencing_token=fencingToken or 0)
            return success(UpdateOut(record=RecordOut.of(record)))

        return await self._run(
            "repocontext_update", key, call, fenced_write=True, applied_maybe=True
        )

    async def claim(
        self,
        key: Key,
        owner: Owner,
        leaseSeconds: LeaseSeconds,
        waitSeconds: WaitSeconds = 0.0,
    ) -> Annotated[CallToolResult, ClaimOut]:
        async def call() -> CallToolResult:
            result = await self.client.claim(
                key, owner, lease_seconds=leaseSeconds, wait_seconds=waitSeconds
            )
            return success(ClaimOut.of(key, owner, result))

        return await self._run("repocontext_claim", key, call)

    async def renew_claim(
        self, key: Key, fencingToken: Token, leaseSeconds: LeaseSeconds
    ) -> Annotated[CallToolResult, RenewOut]:
        async def call() -> CallToolResult:
            result = await self.client.renew_claim(key, fencingToken, lease_seconds=leaseSeconds)
            return success(RenewOut.of(key, fencingToken, result))

        return await self._run("repocontext_renew_claim", key, call)

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
    ) -> Annotated[CallToolResult, ReleaseOut]:
        async def call() -> CallToolResult:
            result = await self.client.release_claim(
                key,
                fencingToken,
                outcome=outcome or "",
                fields=fields,
                retry_after_seconds=retryAfterSeconds or 0.0,
            )
            return success(ReleaseOut.of(key, result))

        return await self._run("repocontext_release_claim", key, call)

    async def claim_next(
        self,
        repoId: Annotated[str, Field(description="Repository name, e.g. lattice.")],
        topic: Annotated[str, Field(description="Topic of the items, e.g. backlog.")],
        owner: Owner,
        leaseSeconds: LeaseSeconds,
        waitSeconds: WaitSeconds = 0.0,
        tags: Annotated[
            list[str] | None,
            Field(description='Only items carrying every one of these tags, e.g. ["lang:go"].'),
        ] = None,
    ) -> Annotated[CallToolResult, ClaimNextOut]:
        async def call() -> CallToolResult:
            result = await self.client.claim_next(
                repoId,
                topic,
                owner,
                lease_seconds=leaseSeconds,
                wait_seconds=waitSeconds,
                tags=tags or (),
            )
            return success(ClaimNextOut.of(result))

        return await self._run("repocontext_claim_next", "", call)

    async def claim_status(self, key: Key) -> Annotated[CallToolResult, ClaimStatusOut]:
        async def call() -> CallToolResult:
            return success(ClaimStatusOut.of(key, await self.client.claim_status(key)))

        return await self._run("repocontext_claim_status", key, call)

    async def recall(self, key: Key) -> Annotated[CallToolResult, RecordOut]:
        async def call() -> CallToolResult:
            return success(RecordOut.of(await self.client.get(key)))

        return await self._run("repocontext_recall", key, call)

    async def list_records(
        self,
        repoId: Annotated[str, Field(description="Repository name, e.g. lattice.")],
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


@dataclass(frozen=True)
class ToolSpec:
    """How one tool is registered: its method, description and behaviour hints."""

    name: str
    method: str
    description: str
    annotations: ToolAnnotations

    def tool(self, tools: RepoContextTools) -> Tool:
        """The tool over ``tools``, taking exactly what its input schema says."""
        fn: Callable[..., Any] = getattr(tools, self.method)
        return strict_tool(
            Tool.from_function(
                fn,
                name=self.name,
                title=self.annotations.title,
                description=self.description,
                annotations=self.annotations,
            )
        )


def _hints(title: str, *, read_only: bool, idempotent: bool, destructive: bool) -> ToolAnnotations:
    return ToolAnnotations(
        title=title,
        read_only_hint=read_only,
        destructive_hint=None if read_only else destructive,
        idempotent_hint=idempotent,
        open_world_hint=False,
    )


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
        _hints("Remember a record", read_only=False, idempotent=True, destructive=False),
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
        _hints("Update a record", read_only=False, idempotent=False, destructive=True),
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
        _hints("Claim a record", read_only=False, idempotent=True, destructive=False),
    ),
    ToolSpec(
        "repocontext_renew_claim",
        "renew_claim",
        "Extend your live claim's lease (never shortens it). renewed: false is the "
        "authoritative answer that your claim is over: reason superseded means you lost the "
        "item to a higher token, so stop working on it immediately; expired or released mean "
        "your claim ended (claim again if you still want the item).",
        _hints("Renew a claim", read_only=False, idempotent=True, destructive=False),
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
        _hints("Release a claim", read_only=False, idempotent=True, destructive=False),
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
        _hints("Claim the next item", read_only=False, idempotent=True, destructive=False),
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
        _hints("Claim status", read_only=True, idempotent=True, destructive=False),
    ),
    ToolSpec(
        "repocontext_recall",
        "recall",
        "Read one record by key: its kind, author, title, body, other fields, tags, "
        "homeRegion and fence.",
        _hints("Recall a record", read_only=True, idempotent=True, destructive=False),
    ),
    ToolSpec(
        "repocontext_list",
        "list_records",
        "List a repo's records in key order, optionally only one topic and/or only records "
        "carrying one tag (e.g. backlog, priority:P1). At most 100 per page; pass "
        "nextPageToken as pageToken for the next page.",
        _hints("List records", read_only=True, idempotent=True, destructive=False),
    ),
)

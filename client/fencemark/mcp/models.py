"""What the ``repocontext_*`` tools return: their structured content and output schemas.

Names are camelCase on the wire (``fencingToken``, ``leaseExpiresAtUtc``,
``homeRegion``), as agents written against the seed's tools expect; every
timestamp is an absolute UTC instant decided by the home node's clock. A field
that does not apply to an answer is left out (e.g. ``fencingToken`` of a claim
that was not granted). What each value guarantees is in docs/consistency.md.
"""

from __future__ import annotations

from datetime import datetime
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from fencemark.client.types import (
    ClaimNextResult,
    ClaimResult,
    ClaimStatus,
    Record,
    ReleaseResult,
    RenewResult,
    WatchEvent,
)

__all__ = [
    "CONFLICT_EXCEPTION",
    "ChangeOut",
    "ChangesOut",
    "ClaimConflictOut",
    "ClaimNextOut",
    "ClaimOut",
    "ClaimStatusOut",
    "KeepAliveOut",
    "ListOut",
    "LiveClaimOut",
    "RecordOut",
    "ReleaseOut",
    "RememberOut",
    "RenewOut",
    "UpdateOut",
]

# The name agents written against the seed catch; a fenced-write refusal carries it.
CONFLICT_EXCEPTION: Final = "RepoContextClaimConflictException"
WELL_KNOWN_FIELDS = ("kind", "author", "title", "body")


class _Out(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, serialize_by_alias=True, frozen=True
    )

    def wire(self) -> dict[str, object]:
        """The structured content: camelCase keys, JSON types, absent fields left out."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class RecordOut(_Out):
    """A record as the answering node knows it."""

    key: str = Field(description="repo/{repoId}/mem/{topic}/{id}")
    repo_id: str
    topic: str
    id: str
    kind: str | None = None
    author: str | None = None
    title: str | None = None
    body: str | None = None
    fields: dict[str, str] = Field(
        default_factory=dict,
        description="Free-form fields other than kind, author, title and body.",
    )
    tags: list[str] = Field(description="Sorted; exactly one is homeRegion:R.")
    home_region: str = Field(description="The region whose node decides claims and fenced writes.")
    fence: int = Field(description="The largest fencing token ever granted; 0 if none.")
    updated_at_utc: datetime | None = None
    status: str = Field(
        default="open",
        description="The work-queue status: open (repocontext_claim_next may hand it out), "
        "done, or parked (failed too often; an operator reopens it).",
    )
    attempts: int = Field(default=0, description="Claims granted on the item so far.")
    not_before_utc: datetime | None = Field(
        default=None, description="A deferred item is not handed out before this."
    )
    last_outcome: str | None = Field(
        default=None,
        description="How the last claim ended: done, failed, deferred, lapsed or forced.",
    )

    @classmethod
    def of(cls, record: Record) -> RecordOut:
        return cls(
            key=record.key,
            repo_id=record.repo,
            topic=record.topic,
            id=record.id,
            kind=record.kind or None,
            author=record.author or None,
            title=record.title or None,
            body=record.body or None,
            fields={k: v for k, v in record.fields.items() if k not in WELL_KNOWN_FIELDS},
            tags=list(record.tags),
            home_region=record.home_region,
            fence=record.fence,
            updated_at_utc=record.updated_at,
            status=record.status,
            attempts=record.attempts,
            not_before_utc=record.not_before,
            last_outcome=record.last_outcome or None,
        )


class ClaimConflictOut(_Out):
    """Why a write was refused by the record's claim (the tool result has isError: true)."""

    exception: Literal["RepoContextClaimConflictException"] = CONFLICT_EXCEPTION
    key: str
    conflict: str = Field(
        description="claimed, superseded, expired, released, unknown_token or wrong_region."
    )
    fence: int = Field(description="The record's fence: the largest token ever granted.")
    home_region: str = Field(description="The region that decides fenced writes of the record.")
    message: str


class KeepAliveOut(_Out):
    """What this server's keepalive of a claim is doing (``keepAlive: true``)."""

    fencing_token: int = Field(description="The token of the claim kept alive.")
    state: Literal["holding", "lost", "stopped"] = Field(
        description="holding: renewed for as long as this MCP session lasts; lost: the claim "
        "is over (reason says why): stop working on the item; stopped: you released it."
    )
    reason: str | None = Field(
        default=None,
        description="Why it was lost: superseded (someone else holds the item now), expired, "
        "released, missing, unreachable (the home did not answer until the lease ran out), "
        "or a refusal such as not_holder.",
    )
    lease_seconds: float = Field(description="The lease each renewal asks for.")
    renewals: int = Field(description="Renewals made so far.")


class RememberOut(_Out):
    """The outcome of repocontext_remember: the record, or (isError) the claim conflict."""

    created: bool | None = Field(
        default=None, description="True when this call created the record, false when it merged."
    )
    record: RecordOut | None = Field(default=None, description="The record after the write.")
    error: ClaimConflictOut | None = Field(
        default=None, description="Present only when the write was refused (isError: true)."
    )


class UpdateOut(_Out):
    """The outcome of repocontext_update: the record, or (isError) the claim conflict."""

    record: RecordOut | None = Field(default=None, description="The record after the write.")
    error: ClaimConflictOut | None = Field(
        default=None, description="Present only when the write was refused (isError: true)."
    )
    keep_alive: KeepAliveOut | None = Field(
        default=None, description="Present while this session keeps the claim alive, or lost it."
    )


class ClaimOut(_Out):
    """The outcome of repocontext_claim. Not granted is an answer, not an error."""

    key: str
    owner: str
    granted: bool
    fencing_token: int | None = Field(
        default=None, description="Present when granted: pass it to every write of this item."
    )
    lease_expires_at_utc: datetime | None = Field(
        default=None, description="When the lease ends unless renewed (the home node's clock)."
    )
    reason: str | None = Field(
        default=None,
        description="Why not granted: contended, timeout, missing or wrong_region.",
    )
    home_region: str | None = None
    keep_alive: KeepAliveOut | None = Field(
        default=None, description="Present while this session keeps the claim alive, or lost it."
    )

    @classmethod
    def of(cls, key: str, owner: str, result: ClaimResult) -> ClaimOut:
        return cls(
            key=key,
            owner=owner,
            granted=result.granted,
            fencing_token=result.fencing_token if result.granted else None,
            lease_expires_at_utc=result.lease_expires_at if result.granted else None,
            reason=result.reason or None,
            home_region=result.home_region or None,
        )


class ClaimNextOut(_Out):
    """The outcome of repocontext_claim_next: the item claimed, or granted: false with
    reason empty when nothing is eligible (an answer, not an error)."""

    granted: bool
    fencing_token: int | None = Field(
        default=None, description="Present when granted: pass it to every write of this item."
    )
    lease_expires_at_utc: datetime | None = Field(
        default=None, description="When the lease ends unless renewed (the home node's clock)."
    )
    reason: str | None = Field(default=None, description="Why not granted: empty.")
    record: RecordOut | None = Field(
        default=None, description="The item claimed (its key is what the other tools take)."
    )
    keep_alive: KeepAliveOut | None = Field(
        default=None, description="Present while this session keeps the claim alive, or lost it."
    )

    @classmethod
    def of(cls, result: ClaimNextResult) -> ClaimNextOut:
        return cls(
            granted=result.granted,
            fencing_token=result.fencing_token if result.granted else None,
            lease_expires_at_utc=result.lease_expires_at if result.granted else None,
            reason=result.reason or None,
            record=RecordOut.of(result.record) if result.record is not None else None,
        )


class RenewOut(_Out):
    """The outcome of repocontext_renew_claim; renewed: false means stop working on the item."""

    key: str
    renewed: bool
    fencing_token: int
    lease_expires_at_utc: datetime | None = None
    reason: str | None = Field(
        default=None,
        description="Why not renewed: superseded (you lost the item), expired, released, "
        "missing, unknown_token or wrong_region.",
    )
    home_region: str | None = None
    keep_alive: KeepAliveOut | None = Field(
        default=None, description="Present while this session keeps the claim alive, or lost it."
    )

    @classmethod
    def of(cls, key: str, token: int, result: RenewResult) -> RenewOut:
        return cls(
            key=key,
            renewed=result.renewed,
            fencing_token=result.fencing_token or token,
            lease_expires_at_utc=result.lease_expires_at if result.renewed else None,
            reason=result.reason or None,
            home_region=result.home_region or None,
        )


class ReleaseOut(_Out):
    """The outcome of repocontext_release_claim (idempotent; the fence never goes down)."""

    key: str
    released: bool
    reason: str | None = Field(
        default=None,
        description="Why not released: unknown_token, missing or wrong_region; with an "
        "outcome or fields also superseded, expired or released (your claim was over: "
        "nothing was recorded).",
    )
    fence: int
    home_region: str | None = None
    keep_alive: KeepAliveOut | None = Field(
        default=None, description="Present while this session keeps the claim alive, or lost it."
    )

    @classmethod
    def of(cls, key: str, result: ReleaseResult) -> ReleaseOut:
        return cls(
            key=key,
            released=result.released,
            reason=result.reason or None,
            fence=result.fence,
            home_region=result.home_region or None,
        )


class LiveClaimOut(_Out):
    owner: str
    fencing_token: int | None = Field(
        default=None,
        description="Left out unless this server's identity is the one the claim was"
        " granted to (or may act for others): another identity's token is of no use here.",
    )
    lease_expires_at_utc: datetime | None = None


class ClaimStatusOut(_Out):
    """A snapshot of a record's claim. It proves nothing: authoritative is always false."""

    key: str
    claim: LiveClaimOut | None = Field(
        default=None, description="The live claim; absent when none is live."
    )
    fence: int
    queue_depth: int = Field(description="Claims waiting in line (waitSeconds) at this node.")
    authoritative: Literal[False] = Field(
        description="Always false: only a write presenting the token proves ownership."
    )
    home_region: str
    keep_alive: KeepAliveOut | None = Field(
        default=None, description="Present while this session keeps the claim alive, or lost it."
    )

    @classmethod
    def of(cls, key: str, status: ClaimStatus) -> ClaimStatusOut:
        live = status.claim
        return cls(
            key=key,
            claim=None
            if live is None
            else LiveClaimOut(
                owner=live.owner,
                fencing_token=live.fencing_token or None,
                lease_expires_at_utc=live.lease_expires_at,
            ),
            fence=status.fence,
            queue_depth=status.queue_depth,
            authoritative=False,  # whatever a node says: a snapshot proves nothing
            home_region=status.home_region,
        )


class ListOut(_Out):
    """One page of a repo's records, in key order."""

    records: list[RecordOut]
    next_page_token: str | None = Field(
        default=None, description="Present when more records follow: pass it as pageToken."
    )


class ChangeOut(_Out):
    """One change of a followed topic, as the target node's feed told it."""

    cursor: str = Field(description="Where the node's feed resumes right after this change.")
    kind: str = Field(description="created, updated, claimed, released, lapsed, done, ...")
    key: str
    id: str
    status: str
    fence: int
    home_region: str
    committed_at_utc: datetime | None = None

    @classmethod
    def of(cls, event: WatchEvent) -> ChangeOut:
        record = event.record
        return cls(
            cursor=event.cursor,
            kind=event.kind,
            key=event.key,
            id=record.id,
            status=record.status,
            fence=record.fence,
            home_region=record.home_region,
            committed_at_utc=event.committed_at,
        )


class ChangesOut(_Out):
    """What reading fencemark://{repo}/{topic}/changes returns."""

    uri: str
    repo_id: str
    topic: str
    following: bool = Field(description="Whether this server follows the topic now.")
    events: list[ChangeOut] = Field(description="Oldest first; since your last read.")
    missed: int = Field(description="Changes since your last read no longer kept here.")

"""What the client returns: plain frozen dataclasses, never protobuf messages.

Every datetime is timezone-aware UTC; a timestamp the node left unset is ``None``.
Each class mirrors one response message of ``proto/fencemark/v1``, whose field
comments are the reference for what a value means.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime


@dataclass(frozen=True)
class Record:
    """The value of one record as the answering node knows it."""

    key: str
    repo: str
    topic: str
    id: str
    fields: dict[str, str] = field(default_factory=dict)
    tags: tuple[str, ...] = ()
    home_region: str = ""
    fence: int = 0
    deleted: bool = False
    digest: bytes = b""
    updated_at: datetime | None = None
    # The work queue (docs/api.md, *Work queue*): open, done or parked; claims
    # granted so far; a deferral's end; how the last claim ended.
    status: str = "open"
    attempts: int = 0
    not_before: datetime | None = None
    last_outcome: str = ""

    @property
    def kind(self) -> str:
        return self.fields.get("kind", "")

    @property
    def author(self) -> str:
        return self.fields.get("author", "")

    @property
    def title(self) -> str:
        return self.fields.get("title", "")

    @property
    def body(self) -> str:
        return self.fields.get("body", "")


@dataclass(frozen=True)
class RememberResult:
    """The record after ``remember``; ``created`` when the call created it."""

    record: Record
    created: bool


@dataclass(frozen=True)
class RecordPage:
    """One page of ``list``; pass ``next_page_token`` on for the next page."""

    records: tuple[Record, ...]
    next_page_token: str


@dataclass(frozen=True)
class ClaimResult:
    """The outcome of ``claim``: a refusal is a value with a ``reason``, not an error."""

    granted: bool
    fencing_token: int
    lease_expires_at: datetime | None
    reason: str
    home_region: str


@dataclass(frozen=True)
class RenewResult:
    """The outcome of ``renew_claim``; ``reason="superseded"`` means the item is lost."""

    renewed: bool
    fencing_token: int
    lease_expires_at: datetime | None
    reason: str
    home_region: str


@dataclass(frozen=True)
class ReleaseResult:
    """The outcome of ``release_claim``; ``fence`` is never lowered by a release."""

    released: bool
    reason: str
    home_region: str
    fence: int


@dataclass(frozen=True)
class ClaimNextResult:
    """The outcome of ``claim_next``: the claim and the item it is on, or
    ``granted=False`` with reason ``empty`` when no item was eligible."""

    granted: bool
    fencing_token: int
    lease_expires_at: datetime | None
    reason: str
    home_region: str
    record: Record | None


@dataclass(frozen=True)
class ReopenResult:
    """The outcome of ``reopen``: the item open again, with no attempts counted."""

    reopened: bool
    reason: str
    home_region: str
    record: Record | None


@dataclass(frozen=True)
class ForceReleaseResult:
    """The outcome of ``force_release``: ``superseded_token`` is refused from now on."""

    released: bool
    reason: str
    home_region: str
    fence: int
    superseded_token: int


@dataclass(frozen=True)
class ClaimEvent:
    """One event of a record's claim history, as its home decided it."""

    at: datetime | None
    kind: str
    fencing_token: int
    owner: str
    identity: str
    detail: str
    actor: str = ""  # forced, reopened: the operator's identity (empty without TLS)


@dataclass(frozen=True)
class WatchEvent:
    """One change of the node's feed (``Records.Watch``): ``kind`` is one word
    (``created``, ``updated``, ``done``, ...), ``record`` the record as the change
    left it, ``cursor`` where to resume after it."""

    cursor: str
    kind: str
    key: str
    record: Record
    committed_at: datetime | None


@dataclass(frozen=True)
class WatchProgress:
    """No change: the node's feed moved on to ``cursor`` past changes the watch's
    filter does not want (yielded by ``watch(progress=True)``). Resume from
    ``cursor`` as from an event's."""

    cursor: str
    at: datetime | None


@dataclass(frozen=True)
class History:
    """A record's recent claim events, oldest first, and the home that keeps them."""

    events: tuple[ClaimEvent, ...]
    home_region: str


@dataclass(frozen=True)
class LiveClaim:
    """A claim that was live at the answering node when it answered.

    Over mutual TLS ``fencing_token`` is 0 unless the caller is the identity the
    claim was granted to, or may act for others (docs/security.md).
    """

    owner: str
    fencing_token: int
    lease_expires_at: datetime | None


@dataclass(frozen=True)
class ClaimStatus:
    """A snapshot of a record's claim; ``authoritative`` is always False.

    Only a write presenting the token proves ownership; this status may be
    stale by the time it is read.
    """

    claim: LiveClaim | None
    fence: int
    queue_depth: int
    authoritative: bool
    home_region: str


@dataclass(frozen=True)
class PeerInfo:
    """The replication state of one configured peer, as the answering node sees it."""

    region: str
    address: str
    last_sync: datetime | None
    lag_ms: int
    records_sent: int
    records_received: int
    bytes_sent: int
    bytes_received: int
    divergence: int
    skew_alarms: int
    reachable: bool
    last_error: str
    push_backlog: int
    merges_refused: int = 0  # states from the peer refused as invalid (docs/security.md)
    last_refusal: str = ""
    member: str = ""  # a fellow member of the answering node's region: its name there

    @property
    def name(self) -> str:
        """The peer's name: its region, or ``REGION/MEMBER`` for a fellow member."""
        return f"{self.region}/{self.member}" if self.member else self.region


@dataclass(frozen=True)
class DeciderInfo:
    """The member that decides for a region of several, in which term, reached where."""

    member: str
    address: str
    term: int


@dataclass(frozen=True)
class NodeInfo:
    """What a node says about itself."""

    region: str
    node_id: str
    writes_enabled: bool
    peers: tuple[PeerInfo, ...]
    record_count: int
    claims_serving: bool
    max_clock_offset_ms: int
    version: str
    now: datetime | None
    # At a member of a region of several: its name, and the decider it knows of.
    member: str = ""
    decider: DeciderInfo | None = None
    members: tuple[str, ...] = ()  # the region's configured member set, as it last read it
    # Its file is new, emptied or restored and it has not caught up yet: it may lack
    # what it acknowledged before (a member counts for no majority's states meanwhile).
    owes_catch_up: bool = False
    # A member that too few of its region's members answer to make a majority: it
    # does not campaign, and would step aside as decider.
    cut_off: bool = False

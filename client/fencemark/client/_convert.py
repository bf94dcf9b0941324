"""Conversions between fencemark.v1 messages and the client's dataclasses.

Also the client's only input checks: Python types, so that a wrong type fails
here with the argument named instead of deep inside protobuf. Whether a value
is *valid* (key syntax, limits) is the node's decision.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import UTC, datetime

from google.protobuf.timestamp_pb2 import Timestamp

from fencemark.client.types import (
    ClaimEvent,
    ClaimNextResult,
    ClaimResult,
    ClaimStatus,
    DeciderInfo,
    ForceReleaseResult,
    History,
    LiveClaim,
    NodeInfo,
    PeerInfo,
    Record,
    RecordPage,
    ReleaseResult,
    RememberResult,
    RenewResult,
    ReopenResult,
    WatchEvent,
    WatchProgress,
)
from fencemark.v1 import claims_pb2, node_pb2, record_pb2, records_pb2

# --- input checks ---------------------------------------------------------


def check_str(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be str, got {type(value).__name__}")
    return value


def check_token(name: str, value: object) -> int:
    # bool is an int subclass, but True is never a meaningful fencing token.
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be int, got {type(value).__name__}")
    return value


def check_seconds(name: str, value: object) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    return float(value)


def check_strings(name: str, values: Iterable[str]) -> list[str]:
    # A bare string is iterable too; tags="backlog" would silently become
    # seven one-letter tags.
    if isinstance(values, str | bytes):
        raise TypeError(f"{name} must be a collection of str, not a single {type(values).__name__}")
    return [check_str(f"{name}[{index}]", value) for index, value in enumerate(values)]


def check_fields(fields: Mapping[str, str] | None) -> dict[str, str]:
    if fields is None:
        return {}
    if not isinstance(fields, Mapping):
        raise TypeError(f"fields must be a mapping of str to str, got {type(fields).__name__}")
    checked: dict[str, str] = {}
    for name, value in fields.items():
        check_str("fields key", name)
        checked[name] = check_str(f"fields[{name!r}]", value)
    return checked


def check_regions(regions: Mapping[str, str] | None) -> dict[str, str]:
    """The region name -> ``host:port`` map a client routes home-only calls by."""
    if regions is None:
        return {}
    if not isinstance(regions, Mapping):
        raise TypeError(f"regions must be a mapping of str to str, got {type(regions).__name__}")
    checked: dict[str, str] = {}
    for name, address in regions.items():
        check_str("regions key", name)
        checked[name] = check_str(f"regions[{name!r}]", address)
    return checked


# --- messages to dataclasses ----------------------------------------------


def to_datetime(timestamp: Timestamp, is_set: bool) -> datetime | None:
    return timestamp.ToDatetime(tzinfo=UTC) if is_set else None


def record_from_proto(message: record_pb2.Record) -> Record:
    return Record(
        key=message.key,
        repo=message.repo,
        topic=message.topic,
        id=message.id,
        fields=dict(message.fields),
        tags=tuple(message.tags),
        home_region=message.home_region,
        fence=message.fence,
        deleted=message.deleted,
        digest=message.digest,
        updated_at=to_datetime(message.updated_at, message.HasField("updated_at")),
        status=message.status or "open",
        attempts=message.attempts,
        not_before=to_datetime(message.not_before, message.HasField("not_before")),
        last_outcome=message.last_outcome,
    )


def remember_result_from_proto(message: records_pb2.RememberResponse) -> RememberResult:
    return RememberResult(record=record_from_proto(message.record), created=message.created)


def record_page_from_proto(message: records_pb2.ListResponse) -> RecordPage:
    return RecordPage(
        records=tuple(record_from_proto(record) for record in message.records),
        next_page_token=message.next_page_token,
    )


def claim_result_from_proto(message: claims_pb2.ClaimResponse) -> ClaimResult:
    return ClaimResult(
        granted=message.granted,
        fencing_token=message.fencing_token,
        lease_expires_at=to_datetime(
            message.lease_expires_at, message.HasField("lease_expires_at")
        ),
        reason=message.reason,
        home_region=message.home_region,
    )


def renew_result_from_proto(message: claims_pb2.RenewClaimResponse) -> RenewResult:
    return RenewResult(
        renewed=message.renewed,
        fencing_token=message.fencing_token,
        lease_expires_at=to_datetime(
            message.lease_expires_at, message.HasField("lease_expires_at")
        ),
        reason=message.reason,
        home_region=message.home_region,
    )


def release_result_from_proto(message: claims_pb2.ReleaseClaimResponse) -> ReleaseResult:
    return ReleaseResult(
        released=message.released,
        reason=message.reason,
        home_region=message.home_region,
        fence=message.fence,
    )


def claim_next_result_from_proto(message: claims_pb2.ClaimNextResponse) -> ClaimNextResult:
    return ClaimNextResult(
        granted=message.granted,
        fencing_token=message.fencing_token,
        lease_expires_at=to_datetime(
            message.lease_expires_at, message.HasField("lease_expires_at")
        ),
        reason=message.reason,
        home_region=message.home_region,
        record=record_from_proto(message.record) if message.HasField("record") else None,
    )


def reopen_result_from_proto(message: claims_pb2.ReopenResponse) -> ReopenResult:
    return ReopenResult(
        reopened=message.reopened,
        reason=message.reason,
        home_region=message.home_region,
        record=record_from_proto(message.record) if message.HasField("record") else None,
    )


def force_release_result_from_proto(
    message: claims_pb2.ForceReleaseResponse,
) -> ForceReleaseResult:
    return ForceReleaseResult(
        released=message.released,
        reason=message.reason,
        home_region=message.home_region,
        fence=message.fence,
        superseded_token=message.superseded_token,
    )


PROGRESS = "progress"  # a Watch event that is no change: the feed moved on (records.proto)


def watch_event_from_proto(message: records_pb2.WatchEvent) -> WatchEvent | WatchProgress:
    if message.kind == PROGRESS:
        return WatchProgress(
            message.cursor, to_datetime(message.committed_at, message.HasField("committed_at"))
        )
    return WatchEvent(
        cursor=message.cursor,
        kind=message.kind,
        key=message.key,
        record=record_from_proto(message.record),
        committed_at=to_datetime(message.committed_at, message.HasField("committed_at")),
    )


def history_from_proto(message: records_pb2.HistoryResponse) -> History:
    return History(
        events=tuple(
            ClaimEvent(
                at=to_datetime(event.at, event.HasField("at")),
                kind=event.kind,
                fencing_token=event.fencing_token,
                owner=event.owner,
                identity=event.identity,
                detail=event.detail,
                actor=event.actor,
            )
            for event in message.events
        ),
        home_region=message.home_region,
    )


def claim_status_from_proto(message: claims_pb2.ClaimStatusResponse) -> ClaimStatus:
    claim = None
    if message.HasField("claim"):
        claim = LiveClaim(
            owner=message.claim.owner,
            fencing_token=message.claim.fencing_token,
            lease_expires_at=to_datetime(
                message.claim.lease_expires_at, message.claim.HasField("lease_expires_at")
            ),
        )
    return ClaimStatus(
        claim=claim,
        fence=message.fence,
        queue_depth=message.queue_depth,
        authoritative=message.authoritative,
        home_region=message.home_region,
    )


def peer_info_from_proto(message: node_pb2.PeerInfo) -> PeerInfo:
    return PeerInfo(
        region=message.region,
        address=message.address,
        last_sync=to_datetime(message.last_sync, message.HasField("last_sync")),
        lag_ms=message.lag_ms,
        records_sent=message.records_sent,
        records_received=message.records_received,
        bytes_sent=message.bytes_sent,
        bytes_received=message.bytes_received,
        divergence=message.divergence,
        skew_alarms=message.skew_alarms,
        reachable=message.reachable,
        last_error=message.last_error,
        push_backlog=message.push_backlog,
        merges_refused=message.merges_refused,
        last_refusal=message.last_refusal,
        member=message.member,
    )


def node_info_from_proto(message: node_pb2.InfoResponse) -> NodeInfo:
    return NodeInfo(
        region=message.region,
        node_id=message.node_id,
        writes_enabled=message.writes_enabled,
        peers=tuple(peer_info_from_proto(peer) for peer in message.peers),
        record_count=message.record_count,
        claims_serving=message.claims_serving,
        max_clock_offset_ms=message.max_clock_offset_ms,
        version=message.version,
        now=to_datetime(message.now, message.HasField("now")),
        member=message.member,
        members=tuple(message.members),
        owes_catch_up=message.owes_catch_up,
        cut_off=message.cut_off,
        decider=(
            DeciderInfo(message.decider.member, message.decider.address, message.decider.term)
            if message.HasField("decider")
            else None
        ),
    )

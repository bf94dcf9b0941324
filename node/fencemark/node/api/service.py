"""gRPC servicers: translate between the wire (fencemark.v1) and the rules.

Transport only: every decision is made by ``replica``, ``claims`` or
``admission``; this module converts messages and maps each refusal to exactly
one gRPC status carrying ``google.rpc`` details (SPEC §7).

The Records and Node servicers, and the one mapping of refusals that every
servicer shares; the Claims servicer is ``claims_service``.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import grpc
from google.protobuf import any_pb2, duration_pb2, timestamp_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from fencemark.node import __version__
from fencemark.node.api.telemetry import note_refusal
from fencemark.node.core import history, watch
from fencemark.node.core.claims import Claims
from fencemark.node.core.replica import Replica
from fencemark.node.crdt import hlc
from fencemark.node.replication.intake import claim_event
from fencemark.node.replication.lives import TWIN_NODE
from fencemark.node.replication.peers import PeerStats
from fencemark.node.rules import validation
from fencemark.node.rules.admission import ANYONE, Caller
from fencemark.node.rules.errors import (
    ClaimConflict,
    ClockSkewed,
    CursorExpired,
    Exhausted,
    FencemarkError,
    InvalidInput,
    NoMajority,
    NotDecider,
    NotFound,
    NotServing,
    PermissionDenied,
    TooSlow,
    TwinNode,
)
from fencemark.node.store.feed import cursor as cursor_of
from fencemark.node.store.storage import Stored
from fencemark.v1 import node_pb2, record_pb2, records_pb2

if TYPE_CHECKING:
    from fencemark.node.coordination.member import Member
    from fencemark.node.replication.replicator import Replicator

DOMAIN = "fencemark"
# The ErrorInfo reason of a deciding call made to a member that is not its region's
# decider (SPEC §10): ``address`` names where the decider serves.
NOT_DECIDER = "NOT_DECIDER"
CURSOR_HEADER = "fencemark-cursor"  # a Watch stream's initial metadata: where it starts
Req = TypeVar("Req")
Resp = TypeVar("Resp")
Handler = Callable[[Any, Req, grpc.aio.ServicerContext[Req, Resp]], Awaitable[Resp]]
# Who calls, for the claim rules: ``authz.caller_of`` on a node serving TLS, ``anyone``
# without (docs/security.md, *Claims are bound to identities*).
CallerOf = Callable[[grpc.aio.ServicerContext[Any, Any]], Caller]


def anyone(context: grpc.aio.ServicerContext[Any, Any]) -> Caller:
    """Without TLS (``--insecure``) there are no identities: every caller acts for
    every claim, and a fencing token is a bearer credential."""
    return ANYONE


PUSHBACK = "grpc-retry-pushback-ms"  # gRPC retries: when the server says to try again


@dataclass(frozen=True)
class _Refused(grpc.Status):
    """A status with trailing metadata beside the rich details."""

    code: grpc.StatusCode
    details: str
    trailing_metadata: tuple[tuple[str, str | bytes], ...]


def _status(
    code: int, message: str, reason: str, metadata: dict[str, str], *extra: Any
) -> grpc.Status:
    info = error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN, metadata=metadata)
    details = []
    for detail in (info, *extra):
        packed = any_pb2.Any()
        packed.Pack(detail)
        details.append(packed)
    return rpc_status.to_status(status_pb2.Status(code=code, message=message, details=details))


def _not_serving(error: NotServing) -> grpc.Status:
    """UNAVAILABLE (NOT_SERVING); with a known wait, ``RetryInfo`` and gRPC's retry
    pushback (``grpc-retry-pushback-ms``): a client retrying UNAVAILABLE by its
    service config asks again then, not after its own shorter back-off."""
    wait = error.retry_after_ms
    reason, metadata = "NOT_SERVING", {}
    if isinstance(error, NoMajority):
        reason = NoMajority.reason
        metadata = {"region": error.region, "acked": str(error.acked), "needed": str(error.needed)}
    if wait <= 0:
        return _status(code_pb2.UNAVAILABLE, str(error), reason, metadata)
    delay = duration_pb2.Duration()
    delay.FromMilliseconds(wait)
    info = error_details_pb2.RetryInfo(retry_delay=delay)
    status = _status(code_pb2.UNAVAILABLE, str(error), reason, metadata, info)
    pushback = (PUSHBACK, str(wait))
    return _Refused(status.code, status.details, (*status.trailing_metadata, pushback))


def to_status(error: FencemarkError) -> grpc.Status:
    """The one gRPC status of each refusal."""
    if isinstance(error, InvalidInput):
        bad = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=name, description=why)
                for name, why in error.violations
            ]
        )
        fields = ",".join(name for name, _ in error.violations)
        return _status(
            code_pb2.INVALID_ARGUMENT, str(error), "INVALID_ARGUMENT", {"fields": fields}, bad
        )
    if isinstance(error, ClaimConflict):
        metadata = {
            "conflict": error.conflict.value,
            "fence": str(error.fence),
            "home_region": error.home_region,
        }
        return _status(code_pb2.FAILED_PRECONDITION, str(error), "CLAIM_CONFLICT", metadata)
    if isinstance(error, NotFound):
        return _status(code_pb2.NOT_FOUND, str(error), "NOT_FOUND", {"key": error.key})
    if isinstance(error, ClockSkewed):
        metadata = {
            "region": error.region,
            "ahead_ms": str(error.ahead_ms),
            "max_offset_ms": str(error.max_offset_ms),
        }
        return _status(code_pb2.FAILED_PRECONDITION, str(error), "CLOCK_SKEW", metadata)
    if isinstance(error, TwinNode):
        metadata = {"node_id": error.node_id, "region": error.region}
        return _status(code_pb2.FAILED_PRECONDITION, str(error), TWIN_NODE, metadata)
    if isinstance(error, NotDecider):
        metadata = {
            "region": error.region,
            "decider": error.decider,
            "address": error.address,
            "term": str(error.term),
        }
        return _status(code_pb2.FAILED_PRECONDITION, str(error), NOT_DECIDER, metadata)
    if isinstance(error, NotServing):
        return _not_serving(error)
    if isinstance(error, Exhausted):
        metadata = {"resource": error.what, "limit": str(error.limit)}
        return _status(code_pb2.RESOURCE_EXHAUSTED, str(error), "RESOURCE_EXHAUSTED", metadata)
    if isinstance(error, PermissionDenied):
        metadata = {"denial": error.denial.value, "identity": error.identity, "right": error.right}
        return _status(code_pb2.PERMISSION_DENIED, str(error), "PERMISSION_DENIED", metadata)
    if isinstance(error, CursorExpired):
        return _status(
            code_pb2.OUT_OF_RANGE, str(error), "CURSOR_EXPIRED", {"cursor": error.cursor}
        )
    if isinstance(error, TooSlow):
        metadata = {"cursor": error.cursor}
        return _status(code_pb2.RESOURCE_EXHAUSTED, str(error), "WATCHER_TOO_SLOW", metadata)
    return _status(code_pb2.INTERNAL, str(error), "INTERNAL", {})


def refusal_reason(error: FencemarkError) -> str:
    """A refusal's machine-readable reason, lower case: the claim conflict
    (``superseded``, ``wrong_region``, ...) or the ErrorInfo reason (``not_found``, ...)."""
    if isinstance(error, ClaimConflict):
        return error.conflict.value
    if isinstance(error, PermissionDenied):
        return error.denial.value
    kinds: tuple[tuple[type[FencemarkError], str], ...] = (
        (InvalidInput, "invalid_argument"), (NotFound, "not_found"),
        (ClockSkewed, "clock_skew"), (NoMajority, "no_majority"), (NotServing, "not_serving"),
        (Exhausted, "resource_exhausted"), (CursorExpired, "cursor_expired"),
        (TooSlow, "watcher_too_slow"), (TwinNode, "twin_node"),
        (NotDecider, "not_decider"),
    )  # fmt: skip
    return next((reason for kind, reason in kinds if isinstance(error, kind)), "internal")


async def refuse(context: grpc.aio.ServicerContext[Any, Any], error: FencemarkError) -> NoReturn:
    """End the call with ``error``'s gRPC status, noting its reason for the metrics."""
    note_refusal(refusal_reason(error))
    status = to_status(error)
    await context.abort(status.code, status.details, status.trailing_metadata)
    raise AssertionError("unreachable: abort raises") from error


def refusals(method: Handler[Req, Resp]) -> Handler[Req, Resp]:
    """Turn a refusal raised by the rules into its gRPC status."""

    @functools.wraps(method)
    async def wrapper(
        self: Any, request: Req, context: grpc.aio.ServicerContext[Req, Resp]
    ) -> Resp:
        try:
            return await method(self, request, context)
        except FencemarkError as error:
            await refuse(context, error)

    return wrapper


def timestamp(ms: int) -> timestamp_pb2.Timestamp | None:
    if ms <= 0:
        return None
    stamp = timestamp_pb2.Timestamp()
    stamp.FromMilliseconds(ms)
    return stamp


def record_message(stored: Stored) -> record_pb2.Record:
    record = stored.record
    repo, topic, id_ = validation.key(record.key)
    outcome = record.outcome
    return record_pb2.Record(
        key=record.key,
        repo=repo,
        topic=topic,
        id=id_,
        fields=record.field_values(),
        tags=record.tag_values(),
        home_region=record.home_region,
        fence=record.fence.fence,
        deleted=record.is_deleted,
        digest=stored.digest,
        updated_at=timestamp(hlc.physical_ms(record.max_hlc())),
        status=record.status,
        attempts=record.attempts,
        not_before=timestamp(record.not_before_ms),
        last_outcome=outcome.value if outcome is not None else "",
    )


class RecordsService:
    def __init__(
        self, replica: Replica, *, caller_of: CallerOf, watch_send_timeout: float = 10.0
    ) -> None:
        self.replica = replica
        self.caller_of = caller_of
        self.watch_send_timeout = watch_send_timeout
        # Each change decoded, and each event's message built, once for all watchers.
        self._decode = watch.shared_decode(watch.Recent())
        self._messages: watch.Recent[str, records_pb2.WatchEvent] = watch.Recent()

    @refusals
    async def Remember(
        self, request: records_pb2.RememberRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> records_pb2.RememberResponse:
        well_known = {
            "kind": request.kind,
            "author": request.author,
            "title": request.title,
            "body": request.body,
        }
        for name, value in well_known.items():
            validation.value_field(value, name)
        fields = {name: value for name, value in well_known.items() if value}
        for name, value in request.fields.items():
            if name in fields and fields[name] != value:
                raise InvalidInput.field(f"fields[{name!r}]", f"conflicts with the {name} argument")
            fields[name] = value  # an empty value clears the field, as in Update
        result = await self.replica.remember(
            request.repo,
            request.topic,
            request.id,
            fields=fields,
            tags=list(request.tags),
            fencing_token=request.fencing_token,
            caller=self.caller_of(context),
        )
        return records_pb2.RememberResponse(
            record=record_message(result.stored), created=result.created
        )

    @refusals
    async def Get(
        self, request: records_pb2.GetRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> records_pb2.GetResponse:
        return records_pb2.GetResponse(record=record_message(await self.replica.get(request.key)))

    @refusals
    async def Update(
        self, request: records_pb2.UpdateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> records_pb2.UpdateResponse:
        stored = await self.replica.update(
            request.key,
            fields=dict(request.fields),
            add_tags=list(request.add_tags),
            remove_tags=list(request.remove_tags),
            fencing_token=request.fencing_token,
            caller=self.caller_of(context),
        )
        return records_pb2.UpdateResponse(record=record_message(stored))

    @refusals
    async def Delete(
        self, request: records_pb2.DeleteRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> records_pb2.DeleteResponse:
        stored = await self.replica.delete(
            request.key, fencing_token=request.fencing_token, caller=self.caller_of(context)
        )
        return records_pb2.DeleteResponse(record=record_message(stored))

    @refusals
    async def List(
        self, request: records_pb2.ListRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> records_pb2.ListResponse:
        page, next_token = await self.replica.list(
            request.repo,
            topic=request.topic,
            tag=request.tag,
            page_size=request.page_size,
            page_token=request.page_token,
            include_deleted=request.include_deleted,
        )
        return records_pb2.ListResponse(
            records=[record_message(s) for s in page], next_page_token=next_token
        )

    @refusals
    async def History(
        self, request: records_pb2.HistoryRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> records_pb2.HistoryResponse:
        kept = await self.replica.history(request.key)
        found = await self.replica.find(request.key)
        if found is None or not found.record.exists:
            raise NotFound(request.key)
        events = history.shown_to(
            self.caller_of(context), kept, found.record, self.replica.wall_ms()
        )
        return records_pb2.HistoryResponse(
            events=[claim_event(event) for event in events],
            home_region=found.record.home_region,
        )

    @refusals
    async def Watch(
        self, request: records_pb2.WatchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        wanted = watch.Watch(request.repo, request.topic, list(request.tags), request.cursor)
        after = await watch.start(self.replica, wanted)
        taken = request.cursor or cursor_of(self.replica.feed_id, after)
        # Where it starts, so a client that loses the stream before any event resumes
        # from there, not from a later "now".
        await context.send_initial_metadata(((CURSOR_HEADER, taken),))
        caller = self.caller_of(context)
        async for event in watch.follow(self.replica, wanted, after, decode=self._decode):
            caller.still_allowed()  # a certificate revoked since the stream began ends it
            if event.stored is None:  # a progress event: no change, no record
                message = records_pb2.WatchEvent(
                    cursor=event.cursor, kind=event.kind, committed_at=timestamp(event.at_ms)
                )
            else:
                message = self._messages.get(event.cursor, functools.partial(_watch_event, event))
            try:
                async with asyncio.timeout(self.watch_send_timeout):
                    await context.write(message)
            except TimeoutError:
                raise TooSlow(taken, self.watch_send_timeout) from None
            taken = event.cursor


def _watch_event(event: watch.Event) -> records_pb2.WatchEvent:
    assert event.stored is not None
    return records_pb2.WatchEvent(
        cursor=event.cursor,
        kind=event.kind,
        key=event.stored.record.key,
        record=record_message(event.stored),
        committed_at=timestamp(event.at_ms),
    )


class NodeService:
    def __init__(
        self,
        replica: Replica,
        claims: Claims,
        replicator: Replicator,
        peers: Mapping[str, PeerStats],
        *,
        writes_enabled: bool,
        member: Member | None = None,
    ) -> None:
        self.replica = replica
        self.claims = claims
        self.replicator = replicator
        self.peers = peers
        self.writes_enabled = writes_enabled
        self.member = member  # at a member of a region of several

    def _peer(self, stats: PeerStats) -> node_pb2.PeerInfo:
        return node_pb2.PeerInfo(
            region=stats.region,
            member=stats.member,
            address=stats.address,
            last_sync=timestamp(round(stats.last_sync * 1000)) if stats.last_sync else None,
            lag_ms=stats.lag_ms(),
            records_sent=stats.records_sent,
            records_received=stats.records_received,
            bytes_sent=stats.bytes_sent,
            bytes_received=stats.bytes_received,
            divergence=stats.divergence,
            skew_alarms=stats.skew_alarms,
            reachable=stats.reachable,
            last_error=stats.last_error,
            push_backlog=self.replicator.backlog(stats.name),
            merges_refused=stats.merges_refused,
            last_refusal=stats.last_refusal,
        )

    @refusals
    async def Info(
        self, request: node_pb2.InfoRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> node_pb2.InfoResponse:
        return node_pb2.InfoResponse(
            region=self.replica.region,
            node_id=self.replica.node_id,
            writes_enabled=self.writes_enabled,
            peers=[self._peer(stats) for _, stats in sorted(self.peers.items())],
            record_count=self.replica.record_count,
            claims_serving=self.claims.deciding,
            max_clock_offset_ms=self.replica.max_clock_offset_ms,
            version=__version__,
            now=timestamp(self.replica.wall_ms()),
            member=self.member.name if self.member is not None else "",
            decider=self._decider(),
            members=self.member.configured() if self.member is not None else (),
            owes_catch_up=self.replica.gate.owed,
            cut_off=self.member.cut_off() if self.member is not None else False,
        )

    def _decider(self) -> node_pb2.DeciderInfo | None:
        known = self.member.decider() if self.member is not None else None
        if known is None:
            return None
        return node_pb2.DeciderInfo(member=known.member, address=known.address, term=known.term)

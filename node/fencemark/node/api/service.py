"""gRPC servicers: translate between the wire (fencemark.v1) and the rules.

Transport only: every decision is made by ``replica``, ``claims`` or
``admission``; this module converts messages and maps each refusal to exactly
one gRPC status carrying ``google.rpc`` details (SPEC §7).

About 420 lines: three servicers and the one mapping of refusals they share.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import grpc
from google.protobuf import any_pb2, timestamp_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from fencemark.node import __version__
from fencemark.node.api.telemetry import note_refusal
from fencemark.node.core.claims import Claims
from fencemark.node.core.replica import Replica
from fencemark.node.crdt import hlc
from fencemark.node.replication.peers import PeerStats
from fencemark.node.rules import validation
from fencemark.node.rules.admission import ANYONE, Caller, Outcome
from fencemark.node.rules.errors import (
    ClaimConflict,
    ClockSkewed,
    Exhausted,
    FencemarkError,
    InvalidInput,
    NotFound,
    NotServing,
    PermissionDenied,
)
from fencemark.node.security.tls import peer_identity
from fencemark.node.store.storage import Stored
from fencemark.v1 import claims_pb2, node_pb2, record_pb2, records_pb2

if TYPE_CHECKING:
    from fencemark.node.replication.replicator import Replicator

DOMAIN = "fencemark"
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
    if isinstance(error, NotServing):
        return _status(code_pb2.UNAVAILABLE, str(error), "NOT_SERVING", {})
    if isinstance(error, Exhausted):
        metadata = {"resource": error.what, "limit": str(error.limit)}
        return _status(code_pb2.RESOURCE_EXHAUSTED, str(error), "RESOURCE_EXHAUSTED", metadata)
    if isinstance(error, PermissionDenied):
        metadata = {"denial": error.denial.value, "identity": error.identity, "right": error.right}
        return _status(code_pb2.PERMISSION_DENIED, str(error), "PERMISSION_DENIED", metadata)
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
        (ClockSkewed, "clock_skew"), (NotServing, "not_serving"),
        (Exhausted, "resource_exhausted"),
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
    )


class RecordsService:
    def __init__(self, replica: Replica, *, caller_of: CallerOf) -> None:
        self.replica = replica
        self.caller_of = caller_of

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


def _reason(outcome: Outcome) -> str:
    """An outcome's reason, noted as the call's refusal when it was not granted."""
    reason = outcome.reason.value if outcome.reason is not None else ""
    if not outcome.ok:
        note_refusal(reason)
    return reason


def client_of(context: grpc.aio.ServicerContext[Any, Any]) -> str:
    """Who is calling, for per-client limits (``--max-waiters-per-client``).

    Over TLS, the identity of the caller's verified certificate
    (``identity:client/alice``): every connection and every address of that
    certificate's holder counts as one client. Without TLS (``--insecure``), the
    peer's address without its port ("ipv4:10.0.0.7:53211" -> "ipv4:10.0.0.7"),
    so more connections are no way around the limit either.
    """
    identity = peer_identity(context)
    if identity is not None:
        return f"identity:{identity}"
    peer = context.peer() or ""
    scheme, _, rest = peer.partition(":")
    if scheme in ("ipv4", "ipv6"):
        return f"{scheme}:{rest.rsplit(':', 1)[0]}"
    return peer


class ClaimsService:
    def __init__(
        self, claims: Claims, *, caller_of: CallerOf, on_wait: Callable[[], None] | None = None
    ) -> None:
        self.claims = claims
        self.caller_of = caller_of
        # Called as a claim joins the line: its call leaves the call budget
        # (fencemark.node.api.budgets.give_back).
        self.on_wait = on_wait

    @refusals
    async def Claim(
        self, request: claims_pb2.ClaimRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> claims_pb2.ClaimResponse:
        outcome = await self.claims.claim(
            request.key,
            request.owner,
            caller=self.caller_of(context),
            lease_seconds=request.lease_seconds,
            wait_seconds=request.wait_seconds,
            client=client_of(context),
            on_wait=self.on_wait,
        )
        return claims_pb2.ClaimResponse(
            granted=outcome.ok,
            fencing_token=outcome.token,
            lease_expires_at=timestamp(outcome.expiry_ms),
            reason=_reason(outcome),
            home_region=outcome.home_region,
        )

    @refusals
    async def RenewClaim(
        self, request: claims_pb2.RenewClaimRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> claims_pb2.RenewClaimResponse:
        outcome = await self.claims.renew(
            request.key,
            request.fencing_token,
            caller=self.caller_of(context),
            lease_seconds=request.lease_seconds,
        )
        return claims_pb2.RenewClaimResponse(
            renewed=outcome.ok,
            fencing_token=outcome.token,
            lease_expires_at=timestamp(outcome.expiry_ms),
            reason=_reason(outcome),
            home_region=outcome.home_region,
        )

    @refusals
    async def ReleaseClaim(
        self, request: claims_pb2.ReleaseClaimRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> claims_pb2.ReleaseClaimResponse:
        outcome = await self.claims.release(
            request.key, request.fencing_token, caller=self.caller_of(context)
        )
        return claims_pb2.ReleaseClaimResponse(
            released=outcome.ok,
            reason=_reason(outcome),
            home_region=outcome.home_region,
            fence=outcome.fence,
        )

    @refusals
    async def ClaimStatus(
        self, request: claims_pb2.ClaimStatusRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> claims_pb2.ClaimStatusResponse:
        status = await self.claims.status(request.key, caller=self.caller_of(context))
        live = None
        if status.holder is not None:
            live = claims_pb2.ClaimStatusResponse.LiveClaim(
                owner=status.holder.owner,
                fencing_token=status.token,
                lease_expires_at=timestamp(status.expiry_ms),
            )
        return claims_pb2.ClaimStatusResponse(
            claim=live,
            fence=status.fence,
            queue_depth=status.queue_depth,
            authoritative=False,
            home_region=status.home_region,
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
    ) -> None:
        self.replica = replica
        self.claims = claims
        self.replicator = replicator
        self.peers = peers
        self.writes_enabled = writes_enabled

    def _peer(self, stats: PeerStats) -> node_pb2.PeerInfo:
        return node_pb2.PeerInfo(
            region=stats.region,
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
            push_backlog=self.replicator.backlog(stats.region),
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
        )

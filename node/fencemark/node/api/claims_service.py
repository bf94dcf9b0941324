"""The Claims servicer: claims, and the work queue built on them (SPEC §4, §8).

Transport only, like ``service``: ``claims`` and ``work_queue`` decide, this
module converts messages. Outcomes are values on the wire (``granted=false`` with
a ``reason``); refusals are ``service.to_status``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from fencemark.node.api.service import CallerOf, record_message, refusals, timestamp
from fencemark.node.api.telemetry import note_refusal
from fencemark.node.core.claims import Claims
from fencemark.node.core.work_queue import WorkQueue
from fencemark.node.rules.admission import Outcome
from fencemark.node.security.tls import peer_identity
from fencemark.v1 import claims_pb2


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
        self,
        claims: Claims,
        work: WorkQueue,
        *,
        caller_of: CallerOf,
        on_wait: Callable[[], None] | None = None,
    ) -> None:
        self.claims = claims
        self.work = work
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
            request.key,
            request.fencing_token,
            caller=self.caller_of(context),
            outcome=request.outcome,
            fields=dict(request.fields),
            retry_after_seconds=request.retry_after_seconds,
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

    @refusals
    async def ClaimNext(
        self, request: claims_pb2.ClaimNextRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> claims_pb2.ClaimNextResponse:
        picked = await self.work.claim_next(
            request.repo,
            request.topic,
            request.owner,
            caller=self.caller_of(context),
            lease_seconds=request.lease_seconds,
            wait_seconds=request.wait_seconds,
            tags=list(request.tags),
            client=client_of(context),
            on_wait=self.on_wait,
            hint_elsewhere=request.hint_elsewhere,
        )
        outcome = picked.outcome
        return claims_pb2.ClaimNextResponse(
            granted=outcome.ok,
            fencing_token=outcome.token,
            lease_expires_at=timestamp(outcome.expiry_ms),
            reason=_reason(outcome),
            home_region=outcome.home_region,
            record=record_message(picked.stored) if picked.stored is not None else None,
        )

    @refusals
    async def Reopen(
        self, request: claims_pb2.ReopenRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> claims_pb2.ReopenResponse:
        picked = await self.work.reopen(request.key, request.reason, caller=self.caller_of(context))
        return claims_pb2.ReopenResponse(
            reopened=picked.outcome.ok,
            reason=_reason(picked.outcome),
            home_region=picked.outcome.home_region,
            record=record_message(picked.stored) if picked.stored is not None else None,
        )

    @refusals
    async def ForceRelease(
        self, request: claims_pb2.ForceReleaseRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> claims_pb2.ForceReleaseResponse:
        picked = await self.work.force_release(
            request.key, request.reason, caller=self.caller_of(context)
        )
        return claims_pb2.ForceReleaseResponse(
            released=picked.outcome.ok,
            reason=_reason(picked.outcome),
            home_region=picked.outcome.home_region,
            fence=picked.outcome.fence,
            superseded_token=picked.superseded,
        )

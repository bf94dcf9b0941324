"""The asyncio client: the one implementation behind both client faces.

Every call carries a deadline; retry-safe calls are retried by gRPC itself
within that deadline (see ``fencemark.client.retry``). What each operation
guarantees is written down once, in docs/consistency.md.
"""

from __future__ import annotations

import math
from collections.abc import AsyncGenerator, Iterable, Mapping
from types import TracebackType
from typing import Any, Self, TypeVar

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2

from fencemark.client import _convert as convert
from fencemark.client.errors import from_rpc_error
from fencemark.client.retry import channel_options
from fencemark.client.types import (
    ClaimResult,
    ClaimStatus,
    NodeInfo,
    Record,
    RecordPage,
    ReleaseResult,
    RememberResult,
    RenewResult,
)
from fencemark.v1 import (
    claims_pb2,
    claims_pb2_grpc,
    node_pb2,
    node_pb2_grpc,
    records_pb2,
    records_pb2_grpc,
)

__all__ = ["AsyncClient"]

_Request = TypeVar("_Request")
_Response = TypeVar("_Response")

_HEALTH_CHECK = "/grpc.health.v1.Health/Check"


MAX_WAIT_SECONDS = 300.0  # SPEC §2: a claim waits at most 300 s


class AsyncClient:
    """A connection to one Fencemark node, for asyncio code.

    Create it inside the event loop that uses it (``async with
    AsyncClient("host:port") as client``): a grpc.aio channel belongs to the
    loop it was made in.
    """

    def __init__(self, target: str, *, timeout: float = 10.0, retries: int = 4) -> None:
        self.target = convert.check_str("target", target)
        self.timeout = convert.check_seconds("timeout", timeout)
        self._channel = aio.insecure_channel(target, options=channel_options(retries))
        self._records = records_pb2_grpc.RecordsStub(self._channel)
        self._claims = claims_pb2_grpc.ClaimsStub(self._channel)
        self._node = node_pb2_grpc.NodeStub(self._channel)
        # The standard health service has no typed stub; call it by name.
        self._health_check: aio.UnaryUnaryMultiCallable[Any, Any] = self._channel.unary_unary(
            _HEALTH_CHECK,
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channel; calls still in flight are cancelled."""
        await self._channel.close(grace=None)

    async def _call(
        self,
        method: aio.UnaryUnaryMultiCallable[_Request, _Response],
        request: _Request,
        *,
        extra_seconds: float = 0.0,
    ) -> _Response:
        try:
            return await method(request, timeout=self.timeout + extra_seconds)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from error

    # --- records ----------------------------------------------------------

    async def remember(
        self,
        repo: str,
        topic: str,
        id: str,
        *,
        kind: str = "",
        author: str = "",
        title: str = "",
        body: str = "",
        tags: Iterable[str] = (),
        fields: Mapping[str, str] | None = None,
        fencing_token: int = 0,
    ) -> RememberResult:
        """Create ``repo/{repo}/mem/{topic}/{id}`` or merge into it (an upsert)."""
        request = records_pb2.RememberRequest(
            repo=convert.check_str("repo", repo),
            topic=convert.check_str("topic", topic),
            id=convert.check_str("id", id),
            kind=convert.check_str("kind", kind),
            author=convert.check_str("author", author),
            title=convert.check_str("title", title),
            body=convert.check_str("body", body),
            tags=convert.check_strings("tags", tags),
            fields=convert.check_fields(fields),
            fencing_token=convert.check_token("fencing_token", fencing_token),
        )
        response = await self._call(self._records.Remember, request)
        return convert.remember_result_from_proto(response)

    async def get(self, key: str) -> Record:
        """The record at ``key``; raises ``NotFound`` if unknown or deleted."""
        request = records_pb2.GetRequest(key=convert.check_str("key", key))
        response = await self._call(self._records.Get, request)
        return convert.record_from_proto(response.record)

    async def update(
        self,
        key: str,
        *,
        fields: Mapping[str, str] | None = None,
        add_tags: Iterable[str] = (),
        remove_tags: Iterable[str] = (),
        fencing_token: int = 0,
    ) -> Record:
        """Write fields (an empty value clears one) and change tags of a record.

        Not retried: raises ``ClaimConflict`` when the record's claim refuses it.
        """
        request = records_pb2.UpdateRequest(
            key=convert.check_str("key", key),
            fields=convert.check_fields(fields),
            add_tags=convert.check_strings("add_tags", add_tags),
            remove_tags=convert.check_strings("remove_tags", remove_tags),
            fencing_token=convert.check_token("fencing_token", fencing_token),
        )
        response = await self._call(self._records.Update, request)
        return convert.record_from_proto(response.record)

    async def delete(self, key: str, *, fencing_token: int = 0) -> Record:
        """Write a tombstone; the record keeps its fence. Not retried."""
        request = records_pb2.DeleteRequest(
            key=convert.check_str("key", key),
            fencing_token=convert.check_token("fencing_token", fencing_token),
        )
        response = await self._call(self._records.Delete, request)
        return convert.record_from_proto(response.record)

    async def list(
        self,
        repo: str,
        *,
        topic: str = "",
        tag: str = "",
        page_size: int = 0,
        page_token: str = "",
        include_deleted: bool = False,
    ) -> RecordPage:
        """One page of a repo's records in key order, optionally by topic and tag."""
        request = records_pb2.ListRequest(
            repo=convert.check_str("repo", repo),
            topic=convert.check_str("topic", topic),
            tag=convert.check_str("tag", tag),
            page_size=convert.check_token("page_size", page_size),
            page_token=convert.check_str("page_token", page_token),
            include_deleted=bool(include_deleted),
        )
        response = await self._call(self._records.List, request)
        return convert.record_page_from_proto(response)

    async def iter_records(
        self,
        repo: str,
        *,
        topic: str = "",
        tag: str = "",
        page_size: int = 0,
        include_deleted: bool = False,
    ) -> AsyncGenerator[Record, None]:
        """Every matching record, following ``next_page_token`` page by page."""
        page_token = ""
        while True:
            page = await self.list(
                repo,
                topic=topic,
                tag=tag,
                page_size=page_size,
                page_token=page_token,
                include_deleted=include_deleted,
            )
            for record in page.records:
                yield record
            if not page.next_page_token:
                return
            page_token = page.next_page_token

    # --- claims -------------------------------------------------------------

    async def claim(
        self, key: str, owner: str, *, lease_seconds: float = 0.0, wait_seconds: float = 0.0
    ) -> ClaimResult:
        """Ask for the record's lease; not granted is a value with a ``reason``.

        ``lease_seconds=0`` lets the node choose (60 s). With ``wait_seconds``
        the call may queue that long, so its deadline is extended by as much.
        """
        request = claims_pb2.ClaimRequest(
            key=convert.check_str("key", key),
            owner=convert.check_str("owner", owner),
            lease_seconds=convert.check_seconds("lease_seconds", lease_seconds),
            wait_seconds=convert.check_seconds("wait_seconds", wait_seconds),
        )
        # The deadline covers the wait; an out-of-range wait gets none extra, so
        # the node (not a local deadline) answers it with INVALID_ARGUMENT.
        wait = request.wait_seconds
        extra = wait if math.isfinite(wait) and 0 < wait <= MAX_WAIT_SECONDS else 0.0
        response = await self._call(self._claims.Claim, request, extra_seconds=extra)
        return convert.claim_result_from_proto(response)

    async def renew_claim(
        self, key: str, fencing_token: int, *, lease_seconds: float = 0.0
    ) -> RenewResult:
        """Extend the live claim of ``fencing_token``; ``superseded`` means it is lost."""
        request = claims_pb2.RenewClaimRequest(
            key=convert.check_str("key", key),
            fencing_token=convert.check_token("fencing_token", fencing_token),
            lease_seconds=convert.check_seconds("lease_seconds", lease_seconds),
        )
        response = await self._call(self._claims.RenewClaim, request)
        return convert.renew_result_from_proto(response)

    async def release_claim(self, key: str, fencing_token: int) -> ReleaseResult:
        """End the claim of ``fencing_token``; idempotent, never lowers the fence."""
        request = claims_pb2.ReleaseClaimRequest(
            key=convert.check_str("key", key),
            fencing_token=convert.check_token("fencing_token", fencing_token),
        )
        response = await self._call(self._claims.ReleaseClaim, request)
        return convert.release_result_from_proto(response)

    async def claim_status(self, key: str) -> ClaimStatus:
        """A snapshot of the record's claim (never authoritative)."""
        request = claims_pb2.ClaimStatusRequest(key=convert.check_str("key", key))
        response = await self._call(self._claims.ClaimStatus, request)
        return convert.claim_status_from_proto(response)

    # --- node ---------------------------------------------------------------

    async def info(self) -> NodeInfo:
        """The node's region, identity, configuration and replication state."""
        response = await self._call(self._node.Info, node_pb2.InfoRequest())
        return convert.node_info_from_proto(response)

    async def health(self) -> str:
        """The node's overall health status name, e.g. ``"SERVING"``."""
        response = await self._call(self._health_check, health_pb2.HealthCheckRequest(service=""))
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))

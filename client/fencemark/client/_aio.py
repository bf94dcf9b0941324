"""The asyncio client: the one implementation behind both client faces.

Every call carries a deadline; retry-safe calls are retried by gRPC itself
within that deadline (see ``fencemark.client.retry``). What each operation
guarantees is written down once, in docs/consistency.md.

Routing to a record's home region (SPEC §4) is described, and its state
kept, in ``fencemark.client._routing``; ``AsyncClient._route`` follows it.

About 620 lines on purpose: one short method per RPC (and ``watch`` and ``hold``
over them), so the whole surface a caller sees reads in one file; conversions,
routing and the keepalive live in their modules.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Mapping
from types import TracebackType
from typing import Literal, Protocol, Self, TypeVar, overload

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2

from fencemark.client import _convert as convert
from fencemark.client._routing import Router, Stubs, home_named, home_tag
from fencemark.client.errors import (
    ClaimConflict,
    NotDecider,
    Unavailable,
    WatcherTooSlow,
    from_rpc_error,
)
from fencemark.client.keepalive import Hold, holding
from fencemark.client.types import (
    ClaimNextResult,
    ClaimResult,
    ClaimStatus,
    ForceReleaseResult,
    History,
    NodeInfo,
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

__all__ = ["AsyncClient"]

_Request = TypeVar("_Request")
_Response = TypeVar("_Response")
_Result = TypeVar("_Result")

MAX_WAIT_SECONDS = 300.0  # SPEC §2: a claim waits at most 300 s
# Sends of one deciding call at most: the decider remembered, a redirect, and one more
# after a failover (a remembered decider unreachable, the member asked again).
MAX_HOPS = 4
EMPTY = "empty"  # ClaimNext found no eligible item
ELSEWHERE = "elsewhere"  # ... here, but one homed elsewhere (to a hint_elsewhere waiter)
# The initial metadata of a Watch stream: the cursor it starts from.
CURSOR_HEADER = "fencemark-cursor"
# A watch stream ending with one of these is the node going away: watch() resumes.
_WATCH_RECONNECTS = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
)


class _HasRecord(Protocol):
    @property
    def record(self) -> record_pb2.Record: ...


def _record_of(response: _HasRecord) -> Record:
    return convert.record_from_proto(response.record)


class AsyncClient:
    """A client of a Fencemark cluster through one node, for asyncio code.

    ``target`` is the node every read and unfenced write goes to (normally
    the local region's). ``regions`` maps region names to ``host:port`` so
    that home-only calls can reach a record's home region (see the module
    docstring); without it every call goes to ``target``.

    Create it inside the event loop that uses it (``async with
    AsyncClient("host:port") as client``): a grpc.aio channel belongs to the
    loop it was made in.

    ``credentials`` secure every channel: for a node serving mutual TLS, pass
    ``tls_credentials(DIR, NAME)`` (the CA and this client's certificate, as
    ``fencemark certs`` writes them). Without, calls are plaintext.

    ``own_connection``: this client's channels open connections of their own.
    By default gRPC lets every channel of a process to one address share one
    connection, which suits a process with many clients of one node; a process
    that stands in for many agents (a load generator) wants one each.
    """

    def __init__(
        self,
        target: str,
        *,
        regions: Mapping[str, str] | None = None,
        timeout: float = 10.0,
        retries: int = 4,
        credentials: grpc.ChannelCredentials | None = None,
        own_connection: bool = False,
    ) -> None:
        self.target = convert.check_str("target", target)
        self.timeout = convert.check_seconds("timeout", timeout)
        self._router = Router(
            target, convert.check_regions(regions), retries, credentials, own_connection
        )

    @property
    def regions(self) -> dict[str, str]:
        """A copy of the region name -> address map home-only calls are routed by."""
        return dict(self._router.regions)

    @property
    def deciders(self) -> dict[str, str]:
        """A copy of the ``NOT_DECIDER`` redirects followed: the address a deciding
        call was meant for -> the decider of its region that it named."""
        return self._router.deciders

    @property
    def home_regions(self) -> dict[str, str]:
        """A copy of the cache of record homes learnt from answers: key -> region."""
        return self._router.homes

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
        """Close every channel; calls still in flight are cancelled."""
        await self._router.close()

    async def _call(
        self,
        method: aio.UnaryUnaryMultiCallable[_Request, _Response],
        request: _Request,
        *,
        seconds: float | None = None,
    ) -> _Response:
        """Call ``method`` within ``seconds`` (default: the client's timeout)."""
        try:
            return await method(request, timeout=self.timeout if seconds is None else seconds)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from error

    async def _send(
        self,
        key: str,
        address: str,
        method_of: Callable[[Stubs], aio.UnaryUnaryMultiCallable[_Request, _Response]],
        request: _Request,
        result_of: Callable[[_Response], _Result],
        deadline: float,
    ) -> _Result:
        """One call about ``key`` to the node at ``address``; learns the key's home."""
        method = method_of(self._router.stubs(address))
        try:
            response = await self._call(
                method, request, seconds=max(deadline - time.monotonic(), 0.0)
            )
        except ClaimConflict as error:
            self._router.learn(key, error.home_region)
            raise
        result = result_of(response)
        self._router.learn(key, home_named(result)[0])
        return result

    async def _route(
        self,
        key: str,
        method_of: Callable[[Stubs], aio.UnaryUnaryMultiCallable[_Request, _Response]],
        request: _Request,
        result_of: Callable[[_Response], _Result],
        *,
        home_only: bool,
        home: str = "",
        extra_seconds: float = 0.0,
    ) -> _Result:
        """A call about ``key``, sent where the module docstring says.

        Not ``home_only``: to ``target``. Home-only: to the home (``home``, a
        ``homeRegion:`` tag, wins over the cache), following one
        ``wrong_region`` redirect, and at a region of several members its
        ``NOT_DECIDER`` redirects to the decider (``_decided``); every attempt
        shares one deadline.
        """
        deadline = time.monotonic() + self.timeout + extra_seconds
        if not home_only:
            return await self._send(key, self.target, method_of, request, result_of, deadline)
        address = self._router.address_for(key, home)

        async def send(to: str) -> _Result:
            return await self._send(key, to, method_of, request, result_of, deadline)

        try:
            result = await self._decided(address, send)
        except ClaimConflict as error:
            named, wrong = home_named(error)
            redirect = self._router.redirect(named, address) if wrong else None
            if redirect is None:
                raise
        else:
            named, wrong = home_named(result)
            redirect = self._router.redirect(named, address) if wrong else None
            if redirect is None:
                return result
        return await self._decided(redirect, send)

    async def _decided(self, address: str, send: Callable[[str], Awaitable[_Result]]) -> _Result:
        """``send`` a deciding call meant for ``address`` to its region's decider:
        the one ``address`` named last (``Router.via``), following each
        ``NOT_DECIDER`` to the decider it names, and asking ``address`` again when a
        remembered decider is unreachable or decides nothing (a failover). At most ``MAX_HOPS``
        sends; a refusal of ``NOT_DECIDER`` changed nothing, so re-sending is safe
        for every call, fenced writes included. A member that names again the decider
        which has just refused the call as unavailable gets no second send: that
        refusal is raised."""
        refused: tuple[str, Unavailable] | None = None  # the decider's, and its address
        for hop in range(MAX_HOPS):
            to = self._router.via(address)
            try:
                return await send(to)
            except NotDecider as moved:
                if refused is not None and refused[0] == moved.address:
                    raise refused[1] from None
                if hop == MAX_HOPS - 1 or (to == address and moved.address in ("", to)):
                    raise
                if moved.address in ("", to):
                    # A remembered decider that decides nothing and names no one (a
                    # member restarted after its failover): ask ``address``.
                    self._router.forget(address)
                    continue
                self._router.moved(address, moved.address)
            except Unavailable as unavailable:
                if to == address or hop == MAX_HOPS - 1:
                    raise
                refused = (to, unavailable)
                # A remembered decider down, or no longer deciding: ask ``address``.
                self._router.forget(address)
        raise AssertionError("unreachable: the last hop returns or raises")

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
        """Create ``repo/{repo}/mem/{topic}/{id}`` or merge into it (an upsert).

        Sent to the home region when it is fenced or a ``homeRegion:`` tag
        names the home (a new record is born there); otherwise to ``target``.
        """
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
        key = f"repo/{request.repo}/mem/{request.topic}/{request.id}"
        home = home_tag(request.tags)
        return await self._route(
            key,
            lambda stubs: stubs.records.Remember,
            request,
            convert.remember_result_from_proto,
            home_only=request.fencing_token > 0 or bool(home),
            home=home,
        )

    async def get(self, key: str) -> Record:
        """The record at ``key``; raises ``NotFound`` if unknown or deleted."""
        request = records_pb2.GetRequest(key=convert.check_str("key", key))
        return await self._route(
            request.key, lambda stubs: stubs.records.Get, request, _record_of, home_only=False
        )

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
        Fenced (``fencing_token > 0``), it is sent to the record's home region.
        """
        request = records_pb2.UpdateRequest(
            key=convert.check_str("key", key),
            fields=convert.check_fields(fields),
            add_tags=convert.check_strings("add_tags", add_tags),
            remove_tags=convert.check_strings("remove_tags", remove_tags),
            fencing_token=convert.check_token("fencing_token", fencing_token),
        )
        return await self._route(
            request.key,
            lambda stubs: stubs.records.Update,
            request,
            _record_of,
            home_only=request.fencing_token > 0,
        )

    async def delete(self, key: str, *, fencing_token: int = 0) -> Record:
        """Write a tombstone; the record keeps its fence. Not retried.

        Fenced (``fencing_token > 0``), it is sent to the record's home region.
        """
        request = records_pb2.DeleteRequest(
            key=convert.check_str("key", key),
            fencing_token=convert.check_token("fencing_token", fencing_token),
        )
        return await self._route(
            request.key,
            lambda stubs: stubs.records.Delete,
            request,
            _record_of,
            home_only=request.fencing_token > 0,
        )

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
        response = await self._call(self._router.default.records.List, request)
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

    @overload
    def watch(
        self,
        repo: str,
        *,
        topic: str = "",
        tags: Iterable[str] = (),
        cursor: str = "",
        reconnect_seconds: float = 0.5,
        progress: Literal[False] = False,
        on_start: Callable[[str], object] | None = None,
    ) -> AsyncGenerator[WatchEvent, None]: ...

    @overload
    def watch(
        self,
        repo: str,
        *,
        topic: str = "",
        tags: Iterable[str] = (),
        cursor: str = "",
        reconnect_seconds: float = 0.5,
        progress: Literal[True],
        on_start: Callable[[str], object] | None = None,
    ) -> AsyncGenerator[WatchEvent | WatchProgress, None]: ...

    async def watch(
        self,
        repo: str,
        *,
        topic: str = "",
        tags: Iterable[str] = (),
        cursor: str = "",
        reconnect_seconds: float = 0.5,
        progress: bool = False,
        on_start: Callable[[str], object] | None = None,
    ) -> AsyncGenerator[WatchEvent | WatchProgress, None]:
        """Every change ``target``'s replica commits to the matching records, in commit
        order, from after ``cursor`` (``""``: from now), without end.

        The node's progress events (the feed moved on past changes the filter does
        not want) move the cursor this resumes from; with ``progress=True`` they are
        yielded too, as :class:`WatchProgress`, for a caller that keeps its own
        cursor (else a rarely matching filter leaves it far behind the feed).

        ``on_start`` is called once, with the cursor the feed starts from, when the
        first stream is open: every change committed after that call is watched (so
        a caller that looks at the records then, and watches for what changes next,
        misses nothing).

        Resumes by itself after a disconnect, a restart of the node or being cut off
        as too slow, from the last event it yielded (or, before any, from where the
        node said it started): nothing is skipped, nothing repeated. Waits
        ``reconnect_seconds`` between tries while the node is away. Raises
        ``CursorExpired`` when the node no longer covers the cursor: list the
        records again and watch from now. Stop it by leaving the ``async for``.
        """
        request = records_pb2.WatchRequest(
            repo=convert.check_str("repo", repo),
            topic=convert.check_str("topic", topic),
            tags=convert.check_strings("tags", tags),
            cursor=convert.check_str("cursor", cursor),
        )
        while True:
            call = self._router.stubs(self.target).records.Watch(request)
            try:
                started = dict(await call.initial_metadata() or ())
                request.cursor = request.cursor or str(started.get(CURSOR_HEADER, ""))
                if on_start is not None and CURSOR_HEADER in started:  # else it failed
                    on_start(request.cursor)
                    on_start = None
                async for message in call:
                    event = convert.watch_event_from_proto(message)
                    request.cursor = event.cursor
                    if progress or isinstance(event, WatchEvent):
                        yield event
            except grpc.RpcError as error:
                failure = from_rpc_error(error)
                if isinstance(failure, WatcherTooSlow):
                    # Resume from the last event yielded, not from the node's cursor:
                    # that names the last event whose send completed, and the one
                    # whose send timed out may still have arrived before the error.
                    request.cursor = request.cursor or failure.cursor
                    continue
                if error.code() not in _WATCH_RECONNECTS:
                    raise failure from error
            finally:
                call.cancel()
            await asyncio.sleep(reconnect_seconds)

    async def history(self, key: str) -> History:
        """The record's recent claim events, oldest first, from its home (which
        keeps them) when ``regions`` maps it, else from ``target``."""
        request = records_pb2.HistoryRequest(key=convert.check_str("key", key))
        return await self._route(
            request.key,
            lambda stubs: stubs.records.History,
            request,
            convert.history_from_proto,
            home_only=True,
        )

    # --- claims -------------------------------------------------------------

    async def claim(
        self, key: str, owner: str, *, lease_seconds: float = 0.0, wait_seconds: float = 0.0
    ) -> ClaimResult:
        """Ask for the record's lease; not granted is a value with a ``reason``.

        ``lease_seconds=0`` lets the node choose (60 s). With ``wait_seconds``
        the call may queue that long, so its deadline is extended by as much.
        Sent to the record's home region (see the module docstring).
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
        return await self._route(
            request.key,
            lambda stubs: stubs.claims.Claim,
            request,
            convert.claim_result_from_proto,
            home_only=True,
            extra_seconds=extra,
        )

    async def renew_claim(
        self, key: str, fencing_token: int, *, lease_seconds: float = 0.0
    ) -> RenewResult:
        """Extend the live claim of ``fencing_token``; ``superseded`` means it is lost."""
        request = claims_pb2.RenewClaimRequest(
            key=convert.check_str("key", key),
            fencing_token=convert.check_token("fencing_token", fencing_token),
            lease_seconds=convert.check_seconds("lease_seconds", lease_seconds),
        )
        return await self._route(
            request.key,
            lambda stubs: stubs.claims.RenewClaim,
            request,
            convert.renew_result_from_proto,
            home_only=True,
        )

    def hold(
        self,
        claim: ClaimResult | ClaimNextResult,
        *,
        key: str = "",
        lease_seconds: float,
        cancel_on_loss: bool = False,
    ) -> contextlib.AbstractAsyncContextManager[Hold]:
        """Keep ``claim`` alive while the ``async with`` lasts: renew it every
        ``lease_seconds / 3`` and say at once when it is lost (``keepalive``). ``key``
        is the record's (a ``ClaimNextResult`` carries it); ``lease_seconds`` the lease
        each renewal asks for. With ``cancel_on_loss`` the task in the block is
        cancelled on a loss and the block raises ``ClaimLost``."""
        if not claim.granted:
            raise ValueError(f"nothing to hold: the claim was not granted ({claim.reason})")
        record = getattr(claim, "record", None)
        key = key or (record.key if record is not None else "")
        if not key:
            raise ValueError("hold() needs the record's key for a Claim's result: key=...")
        lease = convert.check_seconds("lease_seconds", lease_seconds)
        if not 1 <= lease <= 3600:
            raise ValueError(f"lease_seconds must be 1 to 3600 (SPEC §2), got {lease}")
        expires = claim.lease_expires_at
        return holding(
            self, key, claim.fencing_token, lease, expires_at=expires, cancel_on_loss=cancel_on_loss
        )

    async def release_claim(
        self,
        key: str,
        fencing_token: int,
        *,
        outcome: str = "",
        fields: Mapping[str, str] | None = None,
        retry_after_seconds: float = 0.0,
    ) -> ReleaseResult:
        """End the claim of ``fencing_token``; never lowers the fence.

        A plain release is idempotent for every token up to the fence. With an
        ``outcome`` (``done``, ``failed``, ``deferred`` with ``retry_after_seconds``)
        or ``fields``, it is the holder's last fenced write: the fields, the outcome
        and the release are one commit, made only for the live claim's token.
        """
        request = claims_pb2.ReleaseClaimRequest(
            key=convert.check_str("key", key),
            fencing_token=convert.check_token("fencing_token", fencing_token),
            outcome=convert.check_str("outcome", outcome),
            fields=convert.check_fields(fields),
            retry_after_seconds=convert.check_seconds("retry_after_seconds", retry_after_seconds),
        )
        return await self._route(
            request.key,
            lambda stubs: stubs.claims.ReleaseClaim,
            request,
            convert.release_result_from_proto,
            home_only=True,
        )

    async def claim_next(
        self,
        repo: str,
        topic: str,
        owner: str,
        *,
        lease_seconds: float = 0.0,
        wait_seconds: float = 0.0,
        tags: Iterable[str] = (),
        only_target: bool = False,
    ) -> ClaimNextResult:
        """Claim the next eligible item of ``repo``/``topic``: nothing eligible is a
        value (reason ``empty``).

        Each node hands out the items homed in its region. The client asks
        ``target`` first, then every other region of ``regions`` in name order,
        each without waiting, passing over a region it cannot reach (``Unavailable``
        only when none answered); only if none has an item does it wait up to
        ``wait_seconds`` at ``target`` — for an item of any region: the target tells
        the first waiter an item of another region suits, and only that waiter asks
        the item's home (``_wait_at_target``). A grant whose reply was lost on the
        way is not retried at another region: it lapses there and counts one attempt.
        ``only_target`` asks ``target`` alone, in one call that waits there: a
        caller that learns of other regions' items otherwise (their changes on the
        feed) may leave that wait early, and a caller that leaves ``target``'s line
        is handed nothing.
        """
        request = claims_pb2.ClaimNextRequest(
            repo=convert.check_str("repo", repo),
            topic=convert.check_str("topic", topic),
            owner=convert.check_str("owner", owner),
            lease_seconds=convert.check_seconds("lease_seconds", lease_seconds),
            wait_seconds=0.0,
            tags=convert.check_strings("tags", tags),
        )
        wait = convert.check_seconds("wait_seconds", wait_seconds)
        extra = wait if math.isfinite(wait) and 0 < wait <= MAX_WAIT_SECONDS else 0.0
        if only_target:
            request.wait_seconds = wait
            return await self._next_at(self.target, request, extra_seconds=extra)
        addresses = [self.target, *sorted(set(self._router.regions.values()) - {self.target})]
        result: ClaimNextResult | None = None
        unreachable: list[Unavailable] = []
        for address in addresses:
            try:
                result = await self._next_at(address, request)
            except Unavailable as away:  # cut off, down or catching up: ask the next one
                unreachable.append(away)
                continue
            if result.granted or result.reason != EMPTY:
                return result
        if result is None:
            raise unreachable[0]  # no region answered
        if wait == 0:
            return result
        return await self._wait_at_target(request, wait, result)

    async def _wait_at_target(
        self, request: claims_pb2.ClaimNextRequest, wait: float, empty: ClaimNextResult
    ) -> ClaimNextResult:
        """Wait in ``target``'s line up to ``wait`` seconds. With other regions, the
        target also tells this waiter of an eligible item homed elsewhere when it is
        the first waiter the item suits (``hint_elsewhere``: one waiter per item, not
        every waiter): ask that item's home for it — without waiting, so its own
        waiters keep their turn — then wait again for what is left of ``wait``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        others = {r: a for r, a in self._router.regions.items() if a != self.target}
        while (remaining := deadline - loop.time()) > 0:
            request.wait_seconds = remaining
            request.hint_elsewhere = bool(others)
            result = await self._next_at(self.target, request, extra_seconds=remaining)
            if result.reason != ELSEWHERE:
                return result
            address = others.get(result.home_region)
            if address is None:
                continue  # a region this client does not know: wait on
            there = claims_pb2.ClaimNextRequest()
            there.CopyFrom(request)
            there.wait_seconds, there.hint_elsewhere = 0.0, False
            with contextlib.suppress(Unavailable):  # cut off from it: wait on here
                answer = await self._next_at(address, there)
                if answer.granted or answer.reason != EMPTY:
                    return answer
        return empty

    async def _next_at(
        self, address: str, request: claims_pb2.ClaimNextRequest, *, extra_seconds: float = 0.0
    ) -> ClaimNextResult:
        async def send(to: str) -> claims_pb2.ClaimNextResponse:
            return await self._call(
                self._router.stubs(to).claims.ClaimNext,
                request,
                seconds=self.timeout + extra_seconds,
            )

        response = await self._decided(address, send)
        result = convert.claim_next_result_from_proto(response)
        if result.record is not None:
            self._router.learn(result.record.key, result.record.home_region)
        return result

    async def reopen(self, key: str, reason: str) -> ReopenResult:
        """Make a parked (or done) item ``open`` again, its attempts counted from
        zero (an operator's call; the ``operate`` right under TLS)."""
        request = claims_pb2.ReopenRequest(
            key=convert.check_str("key", key), reason=convert.check_str("reason", reason)
        )
        return await self._route(
            request.key,
            lambda stubs: stubs.claims.Reopen,
            request,
            convert.reopen_result_from_proto,
            home_only=True,
        )

    async def force_release(self, key: str, reason: str) -> ForceReleaseResult:
        """Take the live claim back: its holder is refused ``superseded`` from now on
        (an operator's call; the ``operate`` right under TLS)."""
        request = claims_pb2.ForceReleaseRequest(
            key=convert.check_str("key", key), reason=convert.check_str("reason", reason)
        )
        return await self._route(
            request.key,
            lambda stubs: stubs.claims.ForceRelease,
            request,
            convert.force_release_result_from_proto,
            home_only=True,
        )

    async def claim_status(self, key: str) -> ClaimStatus:
        """A snapshot of the record's claim at ``target`` (never authoritative)."""
        request = claims_pb2.ClaimStatusRequest(key=convert.check_str("key", key))
        return await self._route(
            request.key,
            lambda stubs: stubs.claims.ClaimStatus,
            request,
            convert.claim_status_from_proto,
            home_only=False,
        )

    # --- node ---------------------------------------------------------------

    async def info(self) -> NodeInfo:
        """``target``'s region, identity, configuration and replication state."""
        response = await self._call(self._router.default.node.Info, node_pb2.InfoRequest())
        return convert.node_info_from_proto(response)

    async def health(self, service: str = "") -> str:
        """``target``'s health status name, e.g. ``"SERVING"``: overall, or one
        service's (``fencemark.v1.Claims`` is NOT_SERVING while a node catches up)."""
        request = health_pb2.HealthCheckRequest(service=convert.check_str("service", service))
        response = await self._call(self._router.default.health_check, request)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))

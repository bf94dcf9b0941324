"""The few etcd v3 calls a region's members make, over mutual TLS.

etcd's API is gRPC: this module speaks it with the message and stub classes of the
``aetcd`` package (``aetcd.rpc``, generated from etcd's own ``.proto`` files) over a
``grpc.aio`` channel of our own. ``aetcd``'s client opens plaintext channels only, and
a region's members must reach etcd with client certificates (docs/spec.md §10;
docs/security.md): the stubs are what we need of it, gRPC does the rest —
TLS, deadlines, keepalives.

Several endpoints are tried in turn: a call that finds one unavailable goes to the
next, and the next call starts from the one that answered.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from aetcd import rpc

from fencemark.node.security.tls import TlsFiles

log = logging.getLogger(__name__)

T = TypeVar("T")
CALL_TIMEOUT_S = 2.0
CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 5_000),
    ("grpc.keepalive_timeout_ms", 2_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]
EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]  # the end of a stream's replies
# What tells that an endpoint, not the request, is the problem: the next one is tried.
ENDPOINT_FAULTS = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class EtcdError(RuntimeError):
    """etcd could not be reached, or refused the call (``code``: gRPC's)."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Entry:
    """A key's value as etcd holds it."""

    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


@dataclass(frozen=True)
class Created:
    """The outcome of ``create``: whether this call created the key, and the entry
    the key holds now (this call's, or the one that was there)."""

    created: bool
    entry: Entry | None


def parse_endpoints(spec: str) -> list[str]:
    """``HOST:PORT[,HOST:PORT...]``, each optionally ``https://``; ValueError naming
    the bad one."""
    endpoints = []
    for raw in (part.strip() for part in spec.split(",")):
        if not raw:
            continue
        address = raw.removeprefix("https://")
        if address.startswith("http://"):
            raise ValueError(f"--etcd: {raw}: etcd is reached over TLS (https://), never http://")
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--etcd: {raw!r} is not HOST:PORT")
        endpoints.append(address)
    if not endpoints:
        raise ValueError("--etcd: no endpoint given")
    return endpoints


class Etcd:
    """A client of one etcd cluster: ``endpoints`` (``HOST:PORT``), mutual TLS with
    ``tls`` (None: plaintext, for tests of what TLS adds only)."""

    def __init__(
        self,
        endpoints: Sequence[str],
        tls: TlsFiles | None,
        *,
        timeout_s: float = CALL_TIMEOUT_S,
    ) -> None:
        if not endpoints:
            raise ValueError("etcd: no endpoint")
        self.endpoints = list(endpoints)
        self.timeout_s = timeout_s
        credentials = tls.channel_credentials() if tls is not None else None
        self._channels = [
            grpc.aio.secure_channel(e, credentials, options=CHANNEL_OPTIONS)
            if credentials is not None
            else grpc.aio.insecure_channel(e, options=CHANNEL_OPTIONS)
            for e in self.endpoints
        ]
        self._current = 0

    async def close(self) -> None:
        await asyncio.gather(*(c.close(None) for c in self._channels))

    async def call(self, stub_of: Any, method: str, request: Any) -> Any:
        """``method`` of the stub ``stub_of`` makes, on each endpoint in turn from the
        one that last answered, until one does; EtcdError when none does."""
        last: grpc.aio.AioRpcError | None = None
        for step in range(len(self._channels)):
            index = (self._current + step) % len(self._channels)
            stub = stub_of(self._channels[index])
            try:
                reply = await getattr(stub, method)(request, timeout=self.timeout_s)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in ENDPOINT_FAULTS:
                    raise EtcdError(f"etcd refused {method}: {exc.details()}", exc.code()) from exc
                last = exc
                continue
            self._current = index
            return reply
        assert last is not None
        raise EtcdError(
            f"no etcd endpoint answered {method} ({', '.join(self.endpoints)}):"
            f" {last.code().name}: {last.details()}",
            last.code(),
        )

    # -- leases ---------------------------------------------------------------------

    async def grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease of ``ttl_s`` seconds: (its id, the TTL etcd gave it)."""
        reply = await self.call(rpc.LeaseStub, "LeaseGrant", rpc.LeaseGrantRequest(TTL=ttl_s))
        if reply.error:
            raise EtcdError(f"etcd granted no lease: {reply.error}")
        return int(reply.ID), int(reply.TTL)

    async def keep_alive(self, lease: int) -> int:
        """Renew ``lease`` once: the TTL it has now, 0 when it is gone (expired or
        revoked: it is never renewed again)."""
        last: grpc.aio.AioRpcError | None = None
        for step in range(len(self._channels)):
            index = (self._current + step) % len(self._channels)
            call = rpc.LeaseStub(self._channels[index]).LeaseKeepAlive(timeout=self.timeout_s)
            try:
                await call.write(rpc.LeaseKeepAliveRequest(ID=lease))
                reply = await call.read()
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in ENDPOINT_FAULTS:
                    refused = f"etcd refused the keepalive: {exc.details()}"
                    raise EtcdError(refused, exc.code()) from exc
                last = exc
                continue
            finally:
                call.cancel()
            if reply is EOF:
                continue
            self._current = index
            return int(reply.TTL)
        raise EtcdError(
            f"no etcd endpoint renewed the lease ({', '.join(self.endpoints)})",
            last.code() if last is not None else None,
        )

    async def revoke(self, lease: int) -> None:
        await self.call(rpc.LeaseStub, "LeaseRevoke", rpc.LeaseRevokeRequest(ID=lease))

    # -- keys -----------------------------------------------------------------------

    async def create(self, key: bytes, value: bytes, lease: int) -> Created:
        """Put ``key`` under ``lease`` unless it exists (one transaction): whether this
        call created it, and what it holds now."""
        absent = rpc.Compare(
            key=key,
            result=rpc.Compare.CompareResult.EQUAL,
            target=rpc.Compare.CompareTarget.CREATE,
            create_revision=0,
        )
        put = rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value, lease=lease))
        read = rpc.RequestOp(request_range=rpc.RangeRequest(key=key))
        request = rpc.TxnRequest(compare=[absent], success=[put, read], failure=[read])
        reply = await self.call(rpc.KVStub, "Txn", request)
        kvs = reply.responses[-1].response_range.kvs
        return Created(bool(reply.succeeded), entry_of(kvs[0]) if kvs else None)

    async def answering(self, key: bytes, within_s: float) -> None:
        """Return once an endpoint answers a read of ``key``, trying again for up to
        ``within_s`` seconds: an etcd just started listens before it has elected a
        leader, and answers nothing meanwhile. A refusal is an answer too (the call
        that follows reports it). EtcdError when none answered in time."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        while True:
            try:
                await self.get(key)
                return
            except EtcdError as exc:
                if exc.code not in ENDPOINT_FAULTS:
                    return
                if loop.time() >= deadline:
                    raise EtcdError(f"{exc} (tried for {within_s:g} s)", exc.code) from exc
            await asyncio.sleep(0.1)

    async def get(self, key: bytes) -> Entry | None:
        reply = await self.call(rpc.KVStub, "Range", rpc.RangeRequest(key=key))
        return entry_of(reply.kvs[0]) if reply.kvs else None

    async def get_prefix(self, prefix: bytes) -> list[Entry]:
        request = rpc.RangeRequest(key=prefix, range_end=_prefix_end(prefix))
        reply = await self.call(rpc.KVStub, "Range", request)
        return [entry_of(kv) for kv in reply.kvs]

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        await self.call(rpc.KVStub, "Put", rpc.PutRequest(key=key, value=value, lease=lease))

    async def put_if_unchanged(self, key: bytes, value: bytes, mod_revision: int) -> bool:
        """Put ``key`` only if it is still as last read: modified last at
        ``mod_revision`` (0: absent). Whether it was put."""
        same = rpc.Compare(
            key=key,
            result=rpc.Compare.CompareResult.EQUAL,
            target=rpc.Compare.CompareTarget.MOD,
            mod_revision=mod_revision,
        )
        put = rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value))
        reply = await self.call(rpc.KVStub, "Txn", rpc.TxnRequest(compare=[same], success=[put]))
        return bool(reply.succeeded)

    async def delete_if_created_at(self, key: bytes, create_revision: int) -> bool:
        """Delete ``key`` only if it is still the one created at ``create_revision``."""
        same = rpc.Compare(
            key=key,
            result=rpc.Compare.CompareResult.EQUAL,
            target=rpc.Compare.CompareTarget.CREATE,
            create_revision=create_revision,
        )
        delete = rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key))
        reply = await self.call(rpc.KVStub, "Txn", rpc.TxnRequest(compare=[same], success=[delete]))
        return bool(reply.succeeded)

    async def changes(self, key: bytes, after_revision: int) -> AsyncIterator[list[Any]]:
        """Batches of ``key``'s changes (``aetcd.rpc.Event``) after ``after_revision``,
        until the stream breaks (EtcdError) or the caller stops."""
        channel = self._channels[self._current]
        stream = rpc.WatchStub(channel).Watch()
        create = rpc.WatchCreateRequest(key=key, start_revision=after_revision + 1)
        try:
            await stream.write(rpc.WatchRequest(create_request=create))
            while True:
                reply = await stream.read()
                if reply is EOF:
                    raise EtcdError("etcd ended the watch")
                if reply.canceled:
                    raise EtcdError(f"etcd cancelled the watch: {reply.cancel_reason}")
                if reply.events:
                    yield list(reply.events)
        except grpc.aio.AioRpcError as exc:
            raise EtcdError(f"the watch of {key!r} broke: {exc.details()}", exc.code()) from exc
        finally:
            stream.cancel()


def entry_of(kv: Any) -> Entry:
    """An etcd ``KeyValue`` as an ``Entry``."""
    return Entry(
        bytes(kv.key), bytes(kv.value), int(kv.create_revision), int(kv.mod_revision),
        int(kv.lease),
    )  # fmt: skip


def _prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix`` (etcd's range end)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"

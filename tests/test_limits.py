"""Floods are bounded: waiting claims per client and in all, and calls in flight.

A caller beyond a bound is refused at once with RESOURCE_EXHAUSTED (and an
ErrorInfo naming the resource and its limit) instead of queueing without end.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from fencemark.client import AsyncClient, FencemarkError, tls_credentials
from fencemark.node.server import NodeServer
from fencemark.node.tls import TlsFiles, init_dir
from fencemark.v1 import claims_pb2, claims_pb2_grpc
from tests.conftest import StartNode

HOLD_S = 30.0


async def held_record(node: NodeServer, client: AsyncClient) -> str:
    made = await client.remember("limits", "t", "a", title="held")
    claim = await client.claim(made.record.key, "holder", lease_seconds=HOLD_S)
    assert claim.granted
    return made.record.key


@contextlib.asynccontextmanager
async def waiting(
    node: NodeServer, client: AsyncClient, key: str, count: int
) -> AsyncIterator[None]:
    """``count`` claims queued on ``key`` (bounded wait until they are); cancelled after."""
    waiters = [
        asyncio.create_task(client.claim(key, f"waiter-{i}", wait_seconds=HOLD_S))
        for i in range(count)
    ]
    try:
        for _ in range(100):
            if node.claims.waiting == count:
                break
            await asyncio.sleep(0.05)
        assert node.claims.waiting == count
        yield
    finally:
        for task in waiters:
            task.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)


@pytest.mark.slow
async def test_a_client_may_only_queue_so_many_waiters(start_node: StartNode) -> None:
    node = await start_node(max_waiters_per_client=3)
    async with AsyncClient(node.address, retries=0) as client:
        key = await held_record(node, client)
        waiters = [
            asyncio.create_task(client.claim(key, f"waiter-{i}", wait_seconds=HOLD_S))
            for i in range(3)
        ]
        for _ in range(100):  # bounded: until all three queue
            if (await client.claim_status(key)).queue_depth == 3:
                break
            await asyncio.sleep(0.05)
        with pytest.raises(FencemarkError) as refused:
            await client.claim(key, "one-too-many", wait_seconds=HOLD_S)
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "claim waiters from one client" in str(refused.value)
        # Not waiting is always allowed, and the queue is intact.
        assert (await client.claim(key, "no-wait")).reason == "contended"
        assert (await client.claim_status(key)).queue_depth == 3
        held = await client.claim_status(key)
        assert held.claim is not None
        released = await client.release_claim(key, held.claim.fencing_token)
        assert released.released
        first = await waiters[0]
        assert first.granted and first.fencing_token == held.claim.fencing_token + 1
        for task in waiters[1:]:
            task.cancel()
        await asyncio.gather(*waiters[1:], return_exceptions=True)


@pytest.mark.slow
async def test_waiters_are_bounded_in_all(start_node: StartNode) -> None:
    node = await start_node(max_waiters=2, max_waiters_per_client=10)
    async with AsyncClient(node.address, retries=0) as client:
        key = await held_record(node, client)
        async with waiting(node, client, key, 2):
            with pytest.raises(FencemarkError) as refused:
                await client.claim(key, "third", wait_seconds=HOLD_S)
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "at most 2" in str(refused.value)


@pytest.mark.slow
async def test_calls_in_flight_are_bounded(start_node: StartNode) -> None:
    node = await start_node(max_concurrent_rpcs=2, max_waiters_per_client=10)
    async with AsyncClient(node.address, retries=0) as client:
        key = await held_record(node, client)
        async with waiting(node, client, key, 2):
            with pytest.raises(FencemarkError) as refused:
                await client.get(key)
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        for _ in range(100):  # the node notices the cancellations: capacity comes back
            try:
                assert (await client.get(key)).key == key
                break
            except FencemarkError as exc:
                assert exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                await asyncio.sleep(0.05)
        else:
            raise AssertionError("calls in flight never went back under the bound")


# -- per client: one certificate identity is one client, whatever its connections -------------


def _claims_channel(node: NodeServer, certs: Path, name: str) -> grpc.aio.Channel:
    """A channel of its own (its own subchannel pool: its own TCP connection)."""
    return grpc.aio.secure_channel(
        node.address,
        TlsFiles.in_dir(certs, name).channel_credentials(),
        options=[("grpc.use_local_subchannel_pool", 1)],
    )


def _error_info(error: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo:
    trailers = cast(Iterable[tuple[str, str | bytes]], error.trailing_metadata() or ())
    (raw,) = [v for k, v in trailers if k == "grpc-status-details-bin"]
    assert isinstance(raw, bytes)
    info = error_details_pb2.ErrorInfo()
    assert status_pb2.Status.FromString(raw).details[0].Unpack(info)
    return info


@pytest.mark.slow
async def test_waiter_limit_is_per_certificate_identity_across_connections(
    start_node: StartNode, tmp_path: Path
) -> None:
    certs = tmp_path / "certs"
    init_dir(certs, regions=["us"], clients=["alice", "bob"])
    node = await start_node("us", tls=TlsFiles.in_dir(certs, "us"), max_waiters_per_client=2)
    async with AsyncClient(
        node.address, credentials=tls_credentials(certs, "alice"), retries=0
    ) as alice:
        key = await held_record(node, alice)

    def claim(channel: grpc.aio.Channel, owner: str) -> Any:
        request = claims_pb2.ClaimRequest(key=key, owner=owner, wait_seconds=HOLD_S)
        return claims_pb2_grpc.ClaimsStub(channel).Claim(request, timeout=HOLD_S + 5)

    channels = [_claims_channel(node, certs, n) for n in ("alice", "alice", "bob", "bob")]
    alice_1, alice_2, bob_1, bob_2 = channels
    waiters = [
        asyncio.ensure_future(claim(alice_1, "alice-1")),
        asyncio.ensure_future(claim(alice_2, "alice-2")),
    ]
    try:
        for _ in range(100):  # bounded: until both queue
            if node.claims.waiting == 2:
                break
            await asyncio.sleep(0.05)
        assert node.claims.waiting == 2
        # alice's two connections came from two ports, and count as one client.
        # A third waiter of alice's, on either connection, is refused ...
        for channel in (alice_1, alice_2):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await claim(channel, "alice-3")
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            info = _error_info(refused.value)
            assert info.reason == "RESOURCE_EXHAUSTED"
            assert info.metadata["resource"] == "claim waiters from one client"
            assert info.metadata["limit"] == "2"
        # ... while bob, from the same address, has a limit of his own.
        waiters.append(asyncio.ensure_future(claim(bob_1, "bob-1")))
        waiters.append(asyncio.ensure_future(claim(bob_2, "bob-2")))
        for _ in range(100):
            if node.claims.waiting == 4:
                break
            await asyncio.sleep(0.05)
        assert node.claims.waiting == 4
        with pytest.raises(grpc.aio.AioRpcError) as bob_refused:
            await claim(bob_1, "bob-3")
        assert bob_refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        for task in waiters:
            task.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        for channel in channels:
            await channel.close(None)

"""Floods are bounded: waiting claims per client and in all, and calls in flight.

A caller beyond a bound is refused at once with RESOURCE_EXHAUSTED (and an
ErrorInfo naming the resource and its limit) instead of queueing without end.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest

from fencemark.client import AsyncClient, FencemarkError
from fencemark.node.server import NodeServer
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

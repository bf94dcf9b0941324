"""Floods are bounded: waiting claims per client and in all, and calls in flight per class.

A caller beyond a bound is refused at once with RESOURCE_EXHAUSTED (and an
ErrorInfo naming the resource and its limit) instead of queueing without end. No
class of call can take the slots of another (fencemark.node.api.budgets): waiting
claims hold none, so health checks, reads and the peers' replication keep answering.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fencemark.client import AsyncClient, FencemarkError, tls_credentials
from fencemark.node.api.server import NodeServer
from fencemark.node.security.tls import TlsFiles, init_dir
from fencemark.v1 import (
    claims_pb2,
    claims_pb2_grpc,
    records_pb2,
    records_pb2_grpc,
    replication_pb2,
    replication_pb2_grpc,
)
from tests.cluster import Cluster, eventually, synced_since
from tests.conftest import StartNode
from tests.metrics import counters, gauges, refused_once
from tests.ports import free_port

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


def _error_info(error: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo:
    trailers = cast(Iterable[tuple[str, str | bytes]], error.trailing_metadata() or ())
    (raw,) = [v for k, v in trailers if k == "grpc-status-details-bin"]
    assert isinstance(raw, bytes)
    info = error_details_pb2.ErrorInfo()
    assert status_pb2.Status.FromString(raw).details[0].Unpack(info)
    return info


@contextlib.asynccontextmanager
async def watching(channel: grpc.aio.Channel, count: int) -> AsyncIterator[None]:
    """``count`` health Watch streams open on ``channel`` (each holds a read slot)."""
    stub = health_pb2_grpc.HealthStub(channel)
    streams = [stub.Watch(health_pb2.HealthCheckRequest()) for _ in range(count)]
    try:
        for stream in streams:  # each has started once it sent its first status
            first = await stream.read()
            assert first.status == health_pb2.HealthCheckResponse.SERVING
        yield
    finally:
        for stream in streams:
            stream.cancel()


@pytest.mark.slow
async def test_each_class_of_call_has_a_budget_of_its_own(
    start_node: StartNode, tmp_path: Path
) -> None:
    """Regression: gRPC's one pool of calls let any class of call starve the others.
    Two identities' streams fill the read budget (one client alone may not: below)."""
    certs = tmp_path / "certs"
    init_dir(certs, regions=["us", "eu"], clients=["alice", "bob"])
    node = await start_node(
        "us",
        tls=TlsFiles.in_dir(certs, "us"),
        peers={"eu": f"127.0.0.1:{free_port()}"},  # a peer that may call replication
        max_concurrent_reads=2,
        max_concurrent_writes=2,
        max_streams_per_client=1,
    )
    alice_credentials = tls_credentials(certs, "alice")
    async with AsyncClient(node.address, credentials=alice_credentials, retries=0) as client:
        key = (await client.remember("limits", "t", "budget", title="x")).record.key
        async with (
            grpc.aio.secure_channel(node.address, alice_credentials) as channel,
            grpc.aio.secure_channel(node.address, tls_credentials(certs, "bob")) as bobs,
            watching(channel, 1),
            watching(bobs, 1),  # the read budget is full ...
        ):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await records_pb2_grpc.RecordsStub(channel).Get(
                    records_pb2.GetRequest(key=key), timeout=5
                )
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            info = _error_info(refused.value)
            assert info.metadata["resource"] == "concurrent read calls"
            assert info.metadata["limit"] == "2"
            one_more = health_pb2_grpc.HealthStub(bobs).Watch(health_pb2.HealthCheckRequest())
            with pytest.raises(grpc.aio.AioRpcError) as streams_refused:
                await one_more.read()  # streams count too
            assert streams_refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            # ... and writes, health checks and replication have budgets of their own.
            assert (await client.update(key, fields={"body": "b"})).fields["body"] == "b"
            assert await client.health() == "SERVING"
            eu = TlsFiles.in_dir(certs, "eu").channel_credentials()
            async with grpc.aio.secure_channel(node.address, eu) as peer:
                tree = replication_pb2.TreeRequest(origin=replication_pb2.Origin(region="eu"))
                await replication_pb2_grpc.ReplicationStub(peer).Tree(tree, timeout=5)

        # The slots come back once the node hears of each stream's cancellation (its
        # own message, after the client's cancel() returned: wait for it, bounded).
        async def read_slots_free() -> bool:
            return gauges(node, "fencemark_rpcs_in_flight", "class")[("read",)] == 0

        await eventually(read_slots_free, "the cancelled streams giving their read slots back")
        assert (await client.get(key)).key == key  # the slots came back
    budget_refusals = counters(node, "fencemark_rpc_budget_refusals", "class")
    assert budget_refusals == {("read",): 2, ("write",): 0, ("replication",): 0, ("health",): 0}
    await refused_once(node, "Get", "resource_exhausted")


async def test_one_clients_streams_may_not_reach_the_read_budget(
    start_node: StartNode, tmp_path: Path
) -> None:
    """Issue 43: ``--max-streams-per-client`` at or above the read budget let one
    identity hold every read slot with its streams (10 Watch streams filled a budget
    of 10). Such a pair of limits is refused at start, naming both flags."""
    with pytest.raises(ValueError, match=r"--max-streams-per-client \(10\) must be below"):
        await start_node(max_concurrent_reads=10, max_streams_per_client=10)
    node = await start_node(max_concurrent_reads=10, max_streams_per_client=9)
    assert node.config.call_limits.problem() == ""


@pytest.mark.slow
async def test_claims_waiting_in_line_hold_no_call_slot(start_node: StartNode) -> None:
    node = await start_node(
        max_concurrent_reads=2,
        max_concurrent_writes=2,
        max_streams_per_client=1,
        max_waiters_per_client=10,
    )
    async with AsyncClient(node.address, retries=0) as client:
        key = await held_record(node, client)
        async with waiting(node, client, key, 5):  # more than any budget
            assert (await client.get(key)).key == key
            assert (await client.claim(key, "no-wait")).reason == "contended"
            assert (await client.claim_status(key)).queue_depth == 5
            in_flight = gauges(node, "fencemark_rpcs_in_flight", "class")
            assert in_flight[("write",)] == 0

        # A caller that gave up is CANCELLED, not UNKNOWN. (Waited for with the
        # connection open: each cancellation reaches the node on its own.)
        async def all_gave_up() -> bool:
            codes = counters(node, "fencemark_requests", "method", "code")
            return node.claims.waiting == 0 and codes.get(("Claim", "CANCELLED"), 0) == 5

        async def codes() -> str:
            return str(counters(node, "fencemark_requests", "method", "code"))

        await eventually(all_gave_up, "the node counting every waiter that gave up", explain=codes)
    assert ("Claim", "UNKNOWN") not in counters(node, "fencemark_requests", "method", "code")


# -- per client: one certificate identity is one client, whatever its connections -------------


def _claims_channel(node: NodeServer, certs: Path, name: str) -> grpc.aio.Channel:
    """A channel of its own (its own subchannel pool: its own TCP connection)."""
    return grpc.aio.secure_channel(
        node.address,
        TlsFiles.in_dir(certs, name).channel_credentials(),
        options=[("grpc.use_local_subchannel_pool", 1)],
    )


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


@pytest.mark.slow
async def test_waiting_claims_of_several_identities_leave_health_reads_and_replication_alone(
    tmp_path: Path,
) -> None:
    """The report, scaled down: 10 calls per class, 100 waiters, 4 per identity. Three
    identities with 4 waiting claims each made Info, Health.Check and eu's
    Replication.Tree answer RESOURCE_EXHAUSTED, and eu marked us unreachable."""
    certs = tmp_path / "certs"
    agents = ["agent-0", "agent-1", "agent-2"]
    init_dir(certs, regions=["us", "eu"], clients=["alice", *agents])
    scaled = {f"max_concurrent_{kind}": 10 for kind in ("reads", "writes", "replication", "health")}
    async with Cluster(
        tmp_path / "nodes",
        ["us", "eu"],
        max_waiters=100,
        max_waiters_per_client=4,
        max_streams_per_client=4,
        **scaled,
    ) as cluster:
        us = await cluster.start("us", tls=TlsFiles.in_dir(certs, "us"))
        eu = await cluster.start("eu", tls=TlsFiles.in_dir(certs, "eu"))
        async with AsyncClient(
            us.address, credentials=tls_credentials(certs, "alice"), retries=0
        ) as alice:

            async def deciding() -> bool:
                return (await alice.info()).claims_serving

            await eventually(deciding, "us deciding claims once it has seen eu")
            key = await held_record(us, alice)
            clients = [
                AsyncClient(us.address, credentials=tls_credentials(certs, a), retries=0)
                for a in agents
            ]
            waiters = [
                asyncio.create_task(c.claim(key, f"{a}-{i}", wait_seconds=HOLD_S))
                for c, a in zip(clients, agents, strict=True)
                for i in range(4)
            ]
            try:
                for _ in range(200):  # bounded: until all twelve queue
                    if us.claims.waiting == 12:
                        break
                    await asyncio.sleep(0.05)
                assert us.claims.waiting == 12  # more than any class's 10 slots
                # Each identity's own bound still holds ...
                with pytest.raises(FencemarkError) as refused:
                    await clients[0].claim(key, "agent-0-more", wait_seconds=HOLD_S)
                assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "claim waiters from one client" in str(refused.value)
                # ... and nothing else is starved: Info, Health.Check, a peer's Tree.
                assert (await alice.info()).region == "us"
                assert await alice.health() == "SERVING"
                credentials = TlsFiles.in_dir(certs, "eu").channel_credentials()
                async with grpc.aio.secure_channel(us.address, credentials) as channel:
                    origin = replication_pb2.Origin(region="eu", hlc=eu.replica.clock.now())
                    tree = await replication_pb2_grpc.ReplicationStub(channel).Tree(
                        replication_pb2.TreeRequest(origin=origin), timeout=5
                    )
                    assert tree.hashes
                # eu completes a round with us while they wait: us stays reachable.
                since = time.time()
                await eventually(lambda: synced_since(eu, "us", since), "a round of eu's with us")
            finally:
                for task in waiters:
                    task.cancel()
                await asyncio.gather(*waiters, return_exceptions=True)
                for c in clients:
                    await c.close()
        assert not any(counters(us, "fencemark_rpc_budget_refusals", "class").values())


async def test_a_connection_beyond_the_limit_is_closed_at_once_and_the_others_serve(
    start_node: StartNode,
) -> None:
    """``--max-connections``: the third connection to a node that takes two is closed
    as it comes — its call fails ``UNAVAILABLE`` at once (retryable), not after its
    deadline — while the two it holds go on serving; once one closes, a new one is
    taken."""
    node = await start_node(max_connections=2)
    held = [AsyncClient(node.address, own_connection=True, retries=0) for _ in range(2)]
    extra = AsyncClient(node.address, own_connection=True, retries=0, timeout=30)
    try:
        for client in held:
            await client.info()
        began = time.monotonic()
        with pytest.raises(FencemarkError) as refused:
            await extra.info()
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - began < 10, "closed as it came, not left to its deadline"
        assert all([(await c.info()).region == "local" for c in held])
        await held.pop().close()

        async def taken() -> bool:
            with contextlib.suppress(FencemarkError):
                return (await extra.info()).region == "local"
            return False

        await eventually(taken, "a connection is taken once another closed")
    finally:
        await asyncio.gather(*(c.close() for c in [*held, extra]))


def test_the_connection_limit_fits_the_open_file_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The soft open-file limit is raised up to the hard one; what still does not
    fit lowers the connection limit rather than leave callers stalled on accept."""
    from fencemark.node.api import connections

    limits = {"soft": 1024, "hard": 4096}
    monkeypatch.setattr("resource.getrlimit", lambda _: (limits["soft"], limits["hard"]))

    def setrlimit(_: int, values: tuple[int, int]) -> None:
        limits["soft"] = values[0]

    monkeypatch.setattr("resource.setrlimit", setrlimit)
    assert connections.connection_limit(500) == 500 and limits["soft"] == 1024
    assert (
        connections.connection_limit(2000) == 2000
        and limits["soft"] == 2000 + connections.KEPT_FILES
    )
    assert connections.connection_limit(10_000) == 4096 - connections.KEPT_FILES
    assert limits["soft"] == 4096


@pytest.mark.slow
async def test_a_burst_of_one_call_per_connection_is_served_or_refused_never_cancelled(
    start_node: StartNode,
) -> None:
    """1,500 agents on connections of their own write at the same moment, more than
    gRPC's default queue of pending calls (1,000), which cancelled the oldest before the
    node saw them: every call is served, or refused by the node's own budget
    (``RESOURCE_EXHAUSTED``, retryable) — none ``CANCELLED``."""
    node = await start_node()
    agents = [AsyncClient(node.address, own_connection=True, retries=0, timeout=60)
              for _ in range(1_500)]  # fmt: skip
    try:
        for agent in agents:
            await agent.info()

        async def write(index: int, agent: AsyncClient) -> str:
            try:
                await agent.remember("burst", "backlog", f"item-{index:04d}")
            except FencemarkError as refused:
                return refused.code.name
            return "OK"

        codes = Counter(await asyncio.gather(*(write(i, a) for i, a in enumerate(agents))))
        assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, codes
        assert codes["OK"] > 0
    finally:
        await asyncio.gather(*(a.close() for a in agents))

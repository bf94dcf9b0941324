"""SPEC §6/§7: what every node serves besides the API: health, Info, shutdown.

Reflection is in tests/test_reflection.py."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fencemark.client import AsyncClient, ClaimResult, FencemarkError
from fencemark.node.api.server import NodeServer
from fencemark.node.tools.process import NodeProcess
from tests.conftest import StartNode

SERVING = health_pb2.HealthCheckResponse.SERVING


# -- health ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "service", ["", "fencemark.v1.Records", "fencemark.v1.Claims", "fencemark.v1.Node"]
)
async def test_standard_health_check_answers_serving(node: NodeServer, service: str) -> None:
    """SPEC §6: standard grpc.health.v1 health checking, overall and per service."""
    async with grpc.aio.insecure_channel(node.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
    assert response.status == SERVING


async def test_health_check_of_an_unknown_service_is_not_found(node: NodeServer) -> None:
    """grpc.health.v1: an unknown service name answers NOT_FOUND."""
    async with grpc.aio.insecure_channel(node.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_read_only_node_is_healthy_too(start_node: StartNode) -> None:
    """SPEC §6: health checking is on every node, writes enabled or not."""
    reader = await start_node(enable_writes=False)
    async with AsyncClient(reader.address) as client:
        assert await client.health() == "SERVING"


# -- Node.Info ---------------------------------------------------------------------------


async def test_info_reports_region_identity_and_record_count(start_node: StartNode) -> None:
    """SPEC §7: Info gives region, node id, writes enabled, record count (tombstones too)."""
    node = await start_node("eu-west")
    async with AsyncClient(node.address) as client:
        info = await client.info()
        assert info.region == "eu-west"
        assert info.node_id
        assert info.writes_enabled is True
        assert info.record_count == 0
        assert info.claims_serving is True
        assert info.version
        assert info.peers == ()
        assert info.now is not None
        assert abs(info.now - datetime.now(UTC)) < timedelta(seconds=5)
        await client.remember("r", "t", "a")
        await client.remember("r", "t", "b")
        await client.remember("r", "t", "a")  # merges, no new record
        await client.delete("repo/r/mem/t/b")
        await client.delete("repo/r/mem/t/never-seen")
        assert (await client.info()).record_count == 3


async def test_node_id_is_stable_across_a_restart_and_new_with_a_new_disk(
    start_node: StartNode, tmp_path: Path
) -> None:
    """node.proto: the node id is stable across restarts, new when the disk is lost."""
    data = tmp_path / "stable"
    first = await start_node(data_dir=data)
    async with AsyncClient(first.address) as client:
        node_id = (await client.info()).node_id
        await client.remember("r", "t", "kept")
    await first.stop()
    second = await start_node(data_dir=data)
    async with AsyncClient(second.address) as client:
        info = await client.info()
        assert info.node_id == node_id
        assert info.record_count == 1
        assert (await client.get("repo/r/mem/t/kept")).key == "repo/r/mem/t/kept"
    fresh = await start_node(data_dir=tmp_path / "other-disk")
    async with AsyncClient(fresh.address) as client:
        assert (await client.info()).node_id != node_id


# -- graceful shutdown -----------------------------------------------------------------------


@pytest.mark.slow
async def test_sigterm_lets_calls_in_flight_finish_and_exits_zero(tmp_path: Path) -> None:
    """SPEC §6: SIGTERM shuts the node down gracefully: in-flight calls complete, exit code 0."""
    proc = await NodeProcess.start(tmp_path / "d")
    try:
        async with AsyncClient(proc.address) as client:
            key = (await client.remember("r", "t", "busy")).record.key
            holder = await client.claim(key, "holder", lease_seconds=600)
            assert holder.granted
            waiter: asyncio.Task[ClaimResult] = asyncio.create_task(
                client.claim(key, "waiter", wait_seconds=1.5)
            )
            for _ in range(500):
                if (await client.claim_status(key)).queue_depth == 1:
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("the waiter never queued")
            code = await proc.stop()
            result = await waiter
            assert (result.granted, result.reason) == (False, "timeout")
            assert code == 0
        async with AsyncClient(proc.address, timeout=1, retries=1) as late:
            with pytest.raises(FencemarkError):
                await late.info()
    finally:
        if proc.proc.returncode is None:
            await proc.kill()


@pytest.mark.slow
async def test_an_idle_node_exits_zero_on_sigterm_and_keeps_its_data(tmp_path: Path) -> None:
    """SPEC §6: a SIGTERM'd node exits 0; what it acknowledged is there after a restart."""
    data = tmp_path / "d"
    proc = await NodeProcess.start(data)
    try:
        async with AsyncClient(proc.address) as client:
            await client.remember("r", "t", "durable", body="kept")
            node_id = (await client.info()).node_id
        assert await proc.stop() == 0
    finally:
        if proc.proc.returncode is None:
            await proc.kill()
    again = await NodeProcess.start(data, enable_writes=False)
    try:
        async with AsyncClient(again.address) as client:
            assert (await client.get("repo/r/mem/t/durable")).body == "kept"
            info = await client.info()
            assert (info.node_id, info.writes_enabled) == (node_id, False)
    finally:
        assert await again.stop() == 0


DOWN_S = 6.0  # long enough for gRPC's default reconnect back-off to grow past 4 s


@pytest.mark.slow
async def test_a_client_is_served_again_within_about_a_second_of_its_nodes_return(
    tmp_path: Path,
) -> None:
    """A client whose node was killed and comes back on the same address is served
    again promptly (``retry.MAX_RECONNECT_BACKOFF_MS``), not after a back-off that
    gRPC grows towards two minutes while the node is down: on the default, the next
    connection attempt after a 6 s outage is due seconds after the node's return."""
    data = tmp_path / "d"
    proc = await NodeProcess.start(data)
    address = proc.address
    try:
        async with AsyncClient(address, timeout=1, retries=0) as client:
            await client.info()
            await proc.kill()
            loop = asyncio.get_running_loop()
            down_until = loop.time() + DOWN_S
            while loop.time() < down_until:  # calls while it is down: the channel retries
                with contextlib.suppress(FencemarkError):
                    await client.info()
                await asyncio.sleep(0.2)
            proc = await NodeProcess.start(data, listen=address)
            back = loop.time()
            for _ in range(100):  # at most 100 tries, 0.05 s apart
                try:
                    await client.info()
                    break
                except FencemarkError:
                    await asyncio.sleep(0.05)
            served_after = loop.time() - back
            assert served_after < 2.5, f"served {served_after:.1f} s after the node was back"
    finally:
        if proc.proc.returncode is None:
            await proc.kill()

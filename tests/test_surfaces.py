"""Every surface passes the same authorization and limits (issue 33, finding 5).

A revoked or right-less certificate could hold 512 ``grpc.health.v1.Health/Watch``
or reflection streams, and everyone's ``Get``, ``ClaimStatus`` and ``Info`` then
failed ``RESOURCE_EXHAUSTED``: those paths skipped the access map and the CRL, and
nothing bounded one caller's share of the read budget. Now health and reflection
pass the same check as ``fencemark.v1`` (a health ``Check`` needs no right, never a
revoked certificate; the streams need ``read``), and every long-lived stream counts
against its client's cap (``--max-streams-per-client``).

Real nodes on loopback, real certificates, gRPC's own health and reflection stubs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from fencemark.client import AsyncClient, tls_credentials
from fencemark.node.api.authz import load_access
from fencemark.node.security.tls import TlsFiles, init_dir
from fencemark.node.tools.cli import main
from tests.cluster import eventually
from tests.conftest import StartNode
from tests.test_tls import error_info

ACCESS = '[clients]\nalice = ["read"]\nbob = ["read"]\nmallory = []\n'


async def first_health(channel: grpc.aio.Channel) -> health_pb2.HealthCheckResponse:
    calls = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
    async for answer in calls:
        calls.cancel()
        return answer
    raise AssertionError("the health stream ended without an answer")


async def services(channel: grpc.aio.Channel) -> list[str]:
    ask = reflection_pb2.ServerReflectionRequest(list_services="*")
    calls = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(iter([ask]))
    async for answer in calls:
        return [s.name for s in answer.list_services_response.service]
    raise AssertionError("reflection answered nothing")


async def denial(call: object) -> str:
    """The ``denial`` of the PERMISSION_DENIED the awaited ``call`` ends with."""
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call  # type: ignore[misc]
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, refused.value
    return str(error_info(refused.value).metadata["denial"])


async def test_health_and_reflection_follow_the_access_map_and_the_crl(
    start_node: StartNode, tmp_path: Path
) -> None:
    certs = tmp_path / "certs"
    init_dir(certs, regions=["us"], clients=["alice", "bob", "mallory"])
    (tmp_path / "access.toml").write_text(ACCESS)
    node = await start_node("us", tls=TlsFiles.in_dir(certs, "us"), tls_reload_interval=0.1,
                            access=load_access(tmp_path / "access.toml"))  # fmt: skip
    assert main(["certs", "revoke", "--dir", str(certs), "--client", "bob"]) == 0

    def channel(name: str) -> grpc.aio.Channel:
        return grpc.aio.secure_channel(node.address, tls_credentials(certs, name))

    async def bob_refused() -> bool:
        async with channel("bob") as bob:
            try:
                await health_pb2_grpc.HealthStub(bob).Check(health_pb2.HealthCheckRequest())
            except grpc.aio.AioRpcError as refused:
                return refused.code() == grpc.StatusCode.PERMISSION_DENIED
        return False

    await eventually(bob_refused, "bob's revoked certificate refused a health check")
    async with channel("alice") as alice, channel("mallory") as mallory, channel("bob") as bob:
        check = health_pb2.HealthCheckRequest()
        # A health Check needs no right (a load balancer's probe) ...
        answer = await health_pb2_grpc.HealthStub(mallory).Check(check)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        # ... the streams need read; a revoked certificate gets nothing at all.
        assert await denial(first_health(mallory)) == "missing_right"
        assert await denial(services(mallory)) == "missing_right"
        assert await denial(first_health(bob)) == "revoked_certificate"
        assert await denial(services(bob)) == "revoked_certificate"
        assert (await first_health(alice)).status == health_pb2.HealthCheckResponse.SERVING
        assert "fencemark.v1.Records" in await services(alice)


@pytest.fixture
async def capped(start_node: StartNode) -> AsyncIterator[tuple[str, list[object]]]:
    node = await start_node("local", max_streams_per_client=3)
    opened: list[object] = []
    yield node.address, opened
    for call in opened:
        call.cancel()  # type: ignore[attr-defined]


async def test_one_client_holds_at_most_its_cap_of_long_lived_streams(
    capped: tuple[str, list[object]],
) -> None:
    """Three open streams (health Watch, a Records.Watch) from one client: the next is
    refused RESOURCE_EXHAUSTED naming the limit; its unary reads still go through,
    and a stream closed gives its place back."""
    address, opened = capped
    async with grpc.aio.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for _ in range(3):
            call = health.Watch(health_pb2.HealthCheckRequest())
            opened.append(call)
            assert (await call.read()).status == health_pb2.HealthCheckResponse.SERVING
        over = health.Watch(health_pb2.HealthCheckRequest())
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await over.read()
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        info = error_info(refused.value)
        assert (info.metadata["resource"], info.metadata["limit"]) == (
            "open streams from one client",
            "3",
        )
        async with AsyncClient(address) as client:
            assert (await client.info()).region == "local"  # a unary read: not a stream
            opened.pop().cancel()  # type: ignore[attr-defined]

            async def a_place_again() -> bool:
                call = health.Watch(health_pb2.HealthCheckRequest())
                try:
                    await call.read()
                except grpc.aio.AioRpcError:
                    return False
                opened.append(call)
                return True

            await eventually(a_place_again, "a stream's place given back")

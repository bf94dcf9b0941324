"""SPEC §6/§7: server reflection, as ``grpc.reflection.v1`` (what current grpcurl and
``buf curl`` ask for first) and as ``grpc.reflection.v1alpha`` (older tools).

Each test runs against both services. v1alpha is asked through grpcio-reflection's
own stub; v1 through the same method path under v1's name, with v1alpha's message
classes: the two protos are wire-identical (the same fields under the same numbers),
and grpcio ships no v1 classes. grpcio's reflection client,
``ProtoReflectionDescriptorDatabase``, resolves descriptors over each, and so does
``buf curl``, a client of another implementation (Go), told which one to use
(.ci/ensure-buf installs it; without it those tests skip, except under CI, where
they fail).
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from fencemark.client import AsyncClient
from fencemark.node.api.server import NodeServer
from tests import components

ROOT = Path(__file__).resolve().parent.parent
BUF_INSTALLER = ROOT / ".ci" / "ensure-buf"
BUF = components.BUF
V1 = "grpc.reflection.v1.ServerReflection"
V1ALPHA = "grpc.reflection.v1alpha.ServerReflection"
VERSIONS = pytest.mark.parametrize("service", [V1, V1ALPHA])
FENCEMARK_SERVICES = {
    "fencemark.v1.Records",
    "fencemark.v1.Claims",
    "fencemark.v1.Node",
    "fencemark.v1.Replication",
}


class Stub:
    """A ServerReflection stub for ``service`` (v1 or v1alpha) on ``channel``."""

    ServerReflectionInfo: Callable[..., Any]

    def __init__(self, channel: Any, service: str) -> None:
        if service == V1ALPHA:
            self.ServerReflectionInfo = reflection_pb2_grpc.ServerReflectionStub(
                channel
            ).ServerReflectionInfo
            return
        self.ServerReflectionInfo = channel.stream_stream(
            f"/{service}/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )


async def reflect(
    address: str, service: str, request: reflection_pb2.ServerReflectionRequest
) -> reflection_pb2.ServerReflectionResponse:
    """One reflection request/response over the standard bidirectional stream."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = Stub(channel, service).ServerReflectionInfo(iter([request]), timeout=10)
        responses = [response async for response in call]
    assert len(responses) == 1
    response: reflection_pb2.ServerReflectionResponse = responses[0]
    assert not response.HasField("error_response"), response.error_response
    return response


def described(response: reflection_pb2.ServerReflectionResponse) -> dict[str, set[str]]:
    """The services of the files a response carries: full name -> method names."""
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(raw)
        for raw in response.file_descriptor_response.file_descriptor_proto
    ]
    return {
        f"{file.package}.{service.name}": {method.name for method in service.method}
        for file in files
        for service in file.service
    }


@VERSIONS
async def test_reflection_lists_the_fencemark_services_health_and_itself(
    node: NodeServer, service: str
) -> None:
    """SPEC §6: server reflection is served and lists every service, both reflections too."""
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    response = await reflect(node.address, service, request)
    names = {listed.name for listed in response.list_services_response.service}
    assert names == {*FENCEMARK_SERVICES, "grpc.health.v1.Health", V1, V1ALPHA}


@VERSIONS
async def test_reflection_describes_the_claims_service_methods(
    node: NodeServer, service: str
) -> None:
    """SPEC §7: the fixed method names are discoverable (e.g. by grpcurl) through reflection."""
    request = reflection_pb2.ServerReflectionRequest(file_containing_symbol="fencemark.v1.Claims")
    services = described(await reflect(node.address, service, request))
    assert services["fencemark.v1.Claims"] == {
        "Claim", "RenewClaim", "ReleaseClaim", "ClaimStatus", "ClaimNext", "Reopen", "ForceRelease"
    }  # fmt: skip


@VERSIONS
async def test_each_reflection_service_describes_both(node: NodeServer, service: str) -> None:
    """A client resolves every listed service, the reflection services among them: v1's
    file is ``grpc/reflection/v1/reflection.proto``, of package ``grpc.reflection.v1``
    (v1alpha's is named as grpcio-reflection names it)."""
    files = {
        V1: ("grpc/reflection/v1/reflection.proto", "grpc.reflection.v1"),
        V1ALPHA: ("grpc_reflection/v1alpha/reflection.proto", "grpc.reflection.v1alpha"),
    }
    for symbol, (name, package) in files.items():
        request = reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol)
        response = await reflect(node.address, service, request)
        assert described(response) == {symbol: {"ServerReflectionInfo"}}
        raw = response.file_descriptor_response.file_descriptor_proto[0]
        file = descriptor_pb2.FileDescriptorProto.FromString(raw)
        assert (file.name, file.package) == (name, package)
        method = file.service[0].method[0]
        assert method.input_type == f".{package}.ServerReflectionRequest"
        assert method.client_streaming and method.server_streaming


async def test_an_unknown_symbol_is_not_found_over_v1(node: NodeServer) -> None:
    request = reflection_pb2.ServerReflectionRequest(file_containing_symbol="no.such.Service")
    async with grpc.aio.insecure_channel(node.address) as channel:
        call = Stub(channel, V1).ServerReflectionInfo(iter([request]), timeout=10)
        responses = [response async for response in call]
    assert [r.error_response.error_code for r in responses] == [grpc.StatusCode.NOT_FOUND.value[0]]


def resolve_claim(address: str, service: str) -> tuple[set[str], Any, Any]:
    """With grpcio's reflection client over ``service``: the services it lists, and the
    descriptors of ``Claims.Claim`` and of the v1 reflection method, as it resolves them."""
    with grpc.insecure_channel(address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        # The client's one stub, asked under the service's name (v1alpha: its own).
        database._stub = Stub(channel, service)
        pool = descriptor_pool.DescriptorPool(database)
        services = set(database.get_services())
        claim = pool.FindServiceByName("fencemark.v1.Claims").methods_by_name["Claim"]
        reflection_method = pool.FindServiceByName(V1).methods_by_name["ServerReflectionInfo"]
        return services, claim, reflection_method


@VERSIONS
async def test_grpcio_reflection_client_resolves_a_method(node: NodeServer, service: str) -> None:
    services, claim, reflection_method = await asyncio.to_thread(
        resolve_claim, node.address, service
    )
    assert FENCEMARK_SERVICES | {V1, V1ALPHA} <= services
    assert claim.containing_service.full_name == "fencemark.v1.Claims"
    assert claim.input_type.full_name == "fencemark.v1.ClaimRequest"
    assert claim.output_type.full_name == "fencemark.v1.ClaimResponse"
    assert {"key", "owner", "lease_seconds"} <= set(claim.input_type.fields_by_name)
    assert reflection_method.input_type.full_name == "grpc.reflection.v1.ServerReflectionRequest"


# -- buf curl ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def buf() -> Path:
    """The pinned ``buf`` CLI (.ci/ensure-buf)."""
    components.require("buf")
    pinned = re.search(r"^BUF_VERSION=(\S+)", BUF_INSTALLER.read_text(), re.MULTILINE)
    assert pinned, f"{BUF_INSTALLER} pins no BUF_VERSION"
    version = subprocess.run([BUF, "--version"], capture_output=True, text=True, timeout=30)
    assert version.stdout.strip() == pinned.group(1)
    return BUF


async def buf_curl(buf: Path, protocol: str, *args: str) -> str:
    """``buf curl`` over plaintext gRPC, its reflection told to use ``protocol`` only."""
    command = [str(buf), "curl", "--protocol", "grpc", "--http2-prior-knowledge",
               "--reflect-protocol", protocol, *args]  # fmt: skip
    done = await asyncio.to_thread(
        subprocess.run, command, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["grpc-v1", "grpc-v1alpha"])
async def test_buf_curl_lists_and_calls_through_reflection(
    node: NodeServer, buf: Path, protocol: str
) -> None:
    """buf lists the services and methods, and calls ``Records.Get`` with no .proto
    file: it resolves the request and response types through reflection."""
    url = f"http://{node.address}"
    services = await buf_curl(buf, protocol, "--list-services", url)
    assert set(services.split()) == {*FENCEMARK_SERVICES, "grpc.health.v1.Health", V1, V1ALPHA}
    methods = set((await buf_curl(buf, protocol, "--list-methods", url)).split())
    assert {"fencemark.v1.Claims/Claim", f"{V1}/ServerReflectionInfo"} <= methods
    async with AsyncClient(node.address) as client:
        made = await client.remember("reflect", "t", "one", title="through buf")
    request = json.dumps({"key": made.record.key})
    answer = await buf_curl(buf, protocol, "-d", request, f"{url}/fencemark.v1.Records/Get")
    record = json.loads(answer)["record"]
    assert (record["key"], record["fields"]["title"]) == (made.record.key, "through buf")

"""A listener of their own for peers (``--peer-listen``): docs/operations.md,
*A listener for peers*; docs/security.md, *floods of connections*.

The attack it closes: clients that hold every connection the client port takes
(``--max-connections``) keep a peer from dialling in, and a new or restarted peer,
which decides claims only after a round with every peer, decides none until
clients let go. On a peer listener peers have a bound of their own, and nothing a
client calls is served there; every call passes the same interceptors (telemetry,
authorization with revocation, the node's budgets) as on the client port.

Real components only: nodes on loopback, certificates from ``fencemark certs``, the
published client, plain sockets for idle connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fencemark.client import AsyncClient, FencemarkError, Unimplemented, tls_credentials
from fencemark.node.api.authz import load_access
from fencemark.node.api.server import NodeConfig, NodeServer
from fencemark.node.security.tls import TlsFiles, init_dir
from fencemark.node.tools.cli import main
from fencemark.v1 import records_pb2, records_pb2_grpc
from tests.cluster import LOOPBACK, Cluster, all_deciding, eventually, synced_since
from tests.conftest import StartNode
from tests.ports import free_ports
from tests.test_tls import a_state, error_info, push
from tests.test_tls_reload import metric

FLOOD = 2  # the client port's --max-connections in these tests


@contextlib.asynccontextmanager
async def flooded(node: NodeServer) -> AsyncIterator[list[AsyncClient]]:
    """Clients holding every connection ``node``'s client port takes (``FLOOD``), each
    on a connection of its own; a further one is refused ``UNAVAILABLE`` (checked)."""
    held = [AsyncClient(node.address, own_connection=True, retries=0) for _ in range(FLOOD)]
    try:
        for client in held:
            await client.info()
        # Closed once refused: its channel would go on dialling in the background and
        # take a connection a held client gives back before a peer could.
        async with AsyncClient(node.address, own_connection=True, retries=0) as extra:
            with pytest.raises(FencemarkError) as refused:
                await extra.info()
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE
        yield held
    finally:
        await asyncio.gather(*(c.close() for c in held))


async def rounds_with(node: NodeServer, peer: str) -> bool:
    stats = node.replicator.peer_stats(peer)
    return stats.last_sync is not None and stats.reachable


async def test_without_a_peer_listener_a_flood_of_clients_keeps_a_new_peer_from_deciding(
    tmp_path: Path,
) -> None:
    """The limit as it stands when peers dial the client port: eu, new, cannot catch
    up with us while us's clients hold every connection, and decides no claims; once
    they let go, it does."""
    async with Cluster(tmp_path, ["us", "eu"]) as cluster:
        us = await cluster.start("us", max_connections=FLOOD)
        async with flooded(us):
            eu = await cluster.start("eu")
            await asyncio.sleep(3)  # fifteen rounds' worth (FAST_ANTI_ENTROPY)
            assert not eu.replica.deciding
            assert not await rounds_with(eu, "us")
        await all_deciding(eu, within=30)
        assert await rounds_with(eu, "us")


async def test_with_a_peer_listener_a_flood_of_clients_cannot_keep_a_peer_out(
    tmp_path: Path,
) -> None:
    """Every client connection of us held, and a new eu dialling us's peer listener:
    eu catches up and decides, and writes flow both ways while the flood lasts."""
    (peer_port,) = free_ports(1)
    peer_address = f"{LOOPBACK}:{peer_port}"
    async with Cluster(tmp_path, ["us", "eu"]) as cluster:
        us = await cluster.start("us", max_connections=FLOOD, peer_listen=peer_address)
        assert us.peer_address == peer_address != us.address
        async with flooded(us) as (writer, _):
            eu = await cluster.start("eu", peers={"us": peer_address})
            await all_deciding(eu)
            assert await rounds_with(eu, "us")
            at_us = (await writer.remember("lattice", "backlog", "from-us")).record.key
            async with AsyncClient(eu.address) as at_eu_client:
                at_eu = (await at_eu_client.remember("lattice", "backlog", "from-eu")).record.key

                async def both_everywhere() -> bool:
                    found = [await n.storage.get(k) for n in (us, eu) for k in (at_us, at_eu)]
                    return all(s is not None for s in found)

                await eventually(both_everywhere, "each write at both regions")


# -- the surface: what the peer listener serves, and to whom --------------------------------------


ACCESS = '[clients]\nalice = ["read", "write", "claim"]\nnobody = []\n'


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    directory = tmp_path / "certs"
    init_dir(directory, regions=["us", "eu"], clients=["alice", "nobody"])
    return directory


@pytest.fixture
async def us_and_eu(tmp_path: Path, certs: Path) -> AsyncIterator[tuple[NodeServer, NodeServer]]:
    """us with a peer listener, and eu replicating with it through that listener,
    over mutual TLS with an access map."""
    (peer_port,) = free_ports(1)
    access = tmp_path / "access.toml"
    access.write_text(ACCESS)
    async with Cluster(
        tmp_path, ["us", "eu"], access=load_access(access), tls_reload_interval=0
    ) as cluster:
        us = await cluster.start(
            "us", tls=TlsFiles.in_dir(certs, "us"), peer_listen=f"{LOOPBACK}:{peer_port}"
        )
        eu = await cluster.start(
            "eu", tls=TlsFiles.in_dir(certs, "eu"), peers={"us": us.peer_address}
        )
        await all_deciding(us, eu)
        yield us, eu


async def refusal(call: Awaitable[object]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call
    return refused.value


async def test_the_peer_listener_serves_replication_and_health_and_nothing_a_client_calls(
    us_and_eu: tuple[NodeServer, NodeServer], certs: Path
) -> None:
    us, _ = us_and_eu
    alice = tls_credentials(certs, "alice")
    async with AsyncClient(us.peer_address, credentials=alice, retries=0, timeout=5) as careless:
        # A client pointed at the peer port by mistake: told so, nothing written.
        with pytest.raises(Unimplemented):
            await careless.remember("lattice", "backlog", "wrong-port")
        with pytest.raises(Unimplemented):
            await careless.info()
    assert us.storage.record_count == 0
    async with grpc.aio.secure_channel(us.peer_address, alice) as channel:
        answer = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    # Without a certificate of the cluster: no connection at all.
    async with grpc.aio.insecure_channel(us.peer_address) as plain:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await health_pb2_grpc.HealthStub(plain).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=5
            )
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_the_peer_listener_refuses_whom_the_client_port_refuses(
    us_and_eu: tuple[NodeServer, NodeServer], certs: Path, start_node: StartNode
) -> None:
    """A client's certificate (with rights, or none) cannot replicate there, and a
    revoked peer is refused there, each with the client port's reason; nothing merges."""
    us, _ = us_and_eu
    key, state = await a_state(start_node, "pushed-to-the-peer-port")
    for name in ("alice", "nobody"):
        credentials = tls_credentials(certs, name)
        on_peer_port = await refusal(push(us, credentials, "eu", [state], address=us.peer_address))
        on_client_port = await refusal(push(us, credentials, "eu", [state]))
        assert on_peer_port.code() == grpc.StatusCode.PERMISSION_DENIED, name
        assert error_info(on_peer_port).metadata == error_info(on_client_port).metadata
    assert main(["certs", "revoke", "--dir", str(certs), "--region", "eu"]) == 0
    assert us.reload_tls()
    revoked = await refusal(
        push(
            us,
            TlsFiles.in_dir(certs, "eu").channel_credentials(),
            "eu",
            [state],
            address=us.peer_address,
        )
    )
    assert revoked.code() == grpc.StatusCode.PERMISSION_DENIED
    assert error_info(revoked).metadata["denial"] == "revoked_certificate"
    assert await us.storage.get(key) is None
    assert metric(us, "fencemark_tls_revoked_certificates") == 1


# -- a thousand idle connections --------------------------------------------------------------


async def test_a_thousand_silent_connections_never_reach_the_peer_listener(
    tmp_path: Path,
) -> None:
    """Sockets that connect and say nothing stay with the kernel until they speak
    (``TCP_DEFER_ACCEPT``, fencemark.node.api.handshakes): none takes a slot of
    ``--max-peer-connections`` (16 here) or is closed by the node, the client port
    serves, and a peer started meanwhile dials in and decides (issue 43: the listener
    kept 16 of them, and a new peer waited for gRPC's 120 s handshake deadline)."""
    bound = 16
    (peer_port,) = free_ports(1)
    peer_address = f"{LOOPBACK}:{peer_port}"
    async with Cluster(tmp_path, ["us", "eu"]) as cluster:
        us = await cluster.start("us", peer_listen=peer_address, max_peer_connections=bound)
        idle = await asyncio.to_thread(
            lambda: [socket.create_connection(("127.0.0.1", peer_port)) for _ in range(1_000)]
        )
        try:
            eu = await cluster.start("eu", peers={"us": peer_address})
            await all_deciding(us, eu)
            since = time.time()
            await eventually(lambda: synced_since(eu, "us", since), "eu's rounds with us")
            closed = 0
            for sock in idle:
                sock.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    closed += sock.recv(1, socket.MSG_PEEK) == b""
            assert closed == 0, "the node never met them, so closed none"
            async with AsyncClient(us.address, retries=0, timeout=5) as client:
                assert (await client.info()).region == "us"
        finally:
            for sock in idle:
                sock.close()


# -- the command ------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_node_command_takes_its_peer_listener_from_the_environment_and_says_where(
    tmp_path: Path,
) -> None:
    """``FENCEMARK_PEER_LISTEN`` (``--peer-listen``): the banner names both ports; the
    peer port answers health and nothing a client calls."""
    env = {**os.environ, "FENCEMARK_PEER_LISTEN": "127.0.0.1:0"}
    process = subprocess.Popen(
        [sys.executable, "-m", "fencemark.node", "--log-format", "json", "node",
         "--listen", "127.0.0.1:0", "--enable-writes", "--insecure", "--data", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        banner = json.loads(process.stdout.readline())
        peers_on = banner["peer_address"]
        assert peers_on != banner["address"] and not peers_on.endswith(":0")
        assert f"peers on {peers_on}" in banner["message"]
        with grpc.insecure_channel(peers_on) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as refused:
                records_pb2_grpc.RecordsStub(channel).Remember(
                    records_pb2.RememberRequest(repo="m", topic="t", id="a"), timeout=10
                )
            assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
    assert process.returncode == 0, stderr


@pytest.mark.slow  # spawns a process (the CLI, a node or a browser)
@pytest.mark.parametrize("flag", ["--max-peer-connections", "--max-connections"])
def test_a_connection_bound_below_one_refuses_the_start_naming_it(
    tmp_path: Path, flag: str
) -> None:
    """Before anything opens (a start that failed after opening its data file once
    hung on the store's thread instead of exiting)."""
    done = subprocess.run(
        [sys.executable, "-m", "fencemark.node", "node", "--insecure", "--listen",
         "127.0.0.1:0", "--peer-listen", "127.0.0.1:0", flag, "0", "--data", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done
    assert f"{flag} takes 1 or more, got 0" in done.stderr
    assert not list(tmp_path.iterdir()), "refused before the data file was made"


async def test_a_node_refuses_a_bound_below_one_before_it_opens_its_data(
    tmp_path: Path,
) -> None:
    refused: list[dict[str, Any]] = [
        {"max_connections": 0},
        {"peer_listen": "127.0.0.1:0", "max_peer_connections": 0},
    ]
    for bounds in refused:
        config = NodeConfig(data_dir=tmp_path / "data", **bounds)
        with pytest.raises(ValueError, match="at least 1, got 0"):
            await NodeServer.start(config)
        assert not (tmp_path / "data").exists()

"""The fault proxy, over real loopback sockets: what each fault does to a connection.

Upstreams are small asyncio echo servers (and, once, a real node): the proxy is
judged by what a caller on the other side of it observes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest

from fencemark.client import AsyncClient, Unavailable
from fencemark.node.tools.proxy import FaultProxy, ProxyMesh
from tests.conftest import StartNode

# Generous bounds: they tell "fails fast" from "hangs", not fast from slow.
FAST = 1.0
QUIET = 0.3  # how long a blackholed request is watched for a reply

StartEcho = Callable[[str], Awaitable[str]]


@pytest.fixture
async def start_echo() -> AsyncIterator[StartEcho]:
    """Start echo servers on loopback: ``await start_echo(tag)`` -> "127.0.0.1:PORT".

    On each connection a server first sends ``tag:`` (so a test can tell
    servers apart), then echoes every byte back and closes on EOF.
    """
    servers: list[asyncio.Server] = []
    writers: list[asyncio.StreamWriter] = []

    async def start(tag: str) -> str:
        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writers.append(writer)
            try:
                writer.write(f"{tag}:".encode())
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            except OSError:
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(echo, "127.0.0.1", 0)
        servers.append(server)
        host, port = server.sockets[0].getsockname()[:2]
        return f"{host}:{port}"

    yield start
    for server in servers:
        server.close()
    for writer in writers:
        writer.transport.abort()
    for server in servers:
        await server.wait_closed()


@pytest.fixture
async def echo(start_echo: StartEcho) -> str:
    return await start_echo("echo")


@pytest.fixture
async def proxy(echo: str) -> AsyncIterator[FaultProxy]:
    async with await FaultProxy.start(echo, name="test") as proxy:
        yield proxy


class Conn:
    """A test client connection that has already read the server's greeting."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def round_trip(self, data: bytes) -> bytes:
        self.writer.write(data)
        await self.writer.drain()
        return await asyncio.wait_for(self.reader.readexactly(len(data)), FAST)

    async def is_closed(self) -> bool:
        """Whether the proxy closed this connection (EOF or reset) rather than hung."""
        try:
            data = await asyncio.wait_for(self.reader.read(1), FAST)
        except ConnectionError:
            return True
        return data == b""

    def close(self) -> None:
        self.writer.transport.abort()


async def connect(address: str, tag: str = "echo") -> Conn:
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    greeting = await asyncio.wait_for(reader.readexactly(len(tag) + 1), FAST)
    assert greeting == f"{tag}:".encode()
    return Conn(reader, writer)


async def refuses(address: str) -> bool:
    """Whether a new connection is closed at once (a cut link), not served or held."""
    host, port = address.rsplit(":", 1)
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
    except ConnectionError:
        return True
    try:
        return await Conn(reader, writer).is_closed()
    finally:
        writer.transport.abort()


async def serves(address: str, tag: str = "echo") -> bool:
    conn = await connect(address, tag)
    try:
        return await conn.round_trip(b"ping") == b"ping"
    finally:
        conn.close()


# --- forwarding ---------------------------------------------------------------


async def test_bytes_round_trip_in_both_directions(proxy: FaultProxy) -> None:
    assert proxy.address.startswith("127.0.0.1:")
    conn = await connect(proxy.address)  # the greeting travelled upstream -> client
    assert await conn.round_trip(b"hello") == b"hello"
    assert await conn.round_trip(b"again") == b"again"
    conn.close()


async def test_a_large_payload_arrives_intact_and_eof_passes_through(proxy: FaultProxy) -> None:
    payload = bytes(range(256)) * 4096  # 1 MiB
    conn = await connect(proxy.address)

    async def send() -> None:
        conn.writer.write(payload)
        await conn.writer.drain()
        conn.writer.write_eof()  # the echo server closes on EOF, so EOF comes back

    sender = asyncio.create_task(send())
    echoed = await asyncio.wait_for(conn.reader.read(), 5)
    await sender
    assert echoed == payload
    conn.close()


async def test_stats_count_connections_and_bytes(proxy: FaultProxy) -> None:
    conn = await connect(proxy.address)
    await conn.round_trip(b"12345")
    conn.close()
    stats = proxy.stats
    assert stats.connections_accepted == 1
    assert stats.connections_refused == 0
    assert stats.bytes_to_upstream == 5
    assert stats.bytes_to_client == len(b"echo:") + 5
    proxy.cut()
    assert await refuses(proxy.address)
    assert proxy.stats.connections_refused == 1


async def test_an_unreachable_upstream_closes_the_connection() -> None:
    async with await FaultProxy.start("127.0.0.1:1") as proxy:
        assert await refuses(proxy.address)
        assert proxy.stats.upstream_failures == 1


# --- cut ------------------------------------------------------------------------


async def test_cut_closes_open_connections_and_refuses_new_ones(proxy: FaultProxy) -> None:
    conn = await connect(proxy.address)
    assert await conn.round_trip(b"before") == b"before"
    proxy.cut()
    assert await conn.is_closed()
    assert proxy.open_connections == 0
    assert await refuses(proxy.address)
    proxy.heal()
    assert await serves(proxy.address)
    conn.close()


# --- blackhole ------------------------------------------------------------------


async def test_blackhole_holds_requests_without_reply(proxy: FaultProxy) -> None:
    conn = await connect(proxy.address)
    proxy.blackhole()
    conn.writer.write(b"anyone?")
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(conn.reader.read(1), QUIET)
    assert not conn.reader.at_eof()  # held open, not closed: only a deadline helps
    proxy.heal()
    assert await asyncio.wait_for(conn.reader.readexactly(7), FAST) == b"anyone?"
    conn.close()


async def test_blackhole_holds_new_connections_until_heal(proxy: FaultProxy) -> None:
    proxy.blackhole()
    host, port = proxy.address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))  # accepted, then held
    writer.write(b"held")
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(reader.read(1), QUIET)
    proxy.heal()
    # The held stream resumes in order, like TCP once a lossy link recovers.
    assert await asyncio.wait_for(reader.readexactly(9), FAST) == b"echo:held"
    assert await serves(proxy.address)
    writer.transport.abort()


# --- slow links -----------------------------------------------------------------


async def test_latency_delays_each_direction(proxy: FaultProxy) -> None:
    conn = await connect(proxy.address)
    proxy.set_latency(0.2)
    started = time.monotonic()
    assert await conn.round_trip(b"slow") == b"slow"
    assert time.monotonic() - started >= 0.38  # 0.2 s there and 0.2 s back
    proxy.set_latency(0)
    started = time.monotonic()
    assert await conn.round_trip(b"quick") == b"quick"
    assert time.monotonic() - started < 0.2
    conn.close()


async def test_latency_delays_chunks_without_serializing_them(proxy: FaultProxy) -> None:
    conn = await connect(proxy.address)
    proxy.set_latency(0.2)
    started = time.monotonic()
    for i in range(10):
        conn.writer.write(b"%d;" % i)
        await asyncio.sleep(0.01)  # separate chunks, each delayed on its own
    echoed = await asyncio.wait_for(conn.reader.readexactly(20), 2)
    assert echoed == b"".join(b"%d;" % i for i in range(10))  # order kept
    assert time.monotonic() - started < 1.0  # not 10 x 0.4 s
    conn.close()


async def test_bandwidth_limit_slows_a_transfer(proxy: FaultProxy) -> None:
    conn = await connect(proxy.address)
    proxy.set_bandwidth(100_000)
    started = time.monotonic()
    assert await asyncio.wait_for(conn.round_trip(b"x" * 50_000), 3) == b"x" * 50_000
    assert time.monotonic() - started >= 0.45  # 50 kB at 100 kB/s
    proxy.set_bandwidth(None)
    started = time.monotonic()
    assert await conn.round_trip(b"y" * 50_000) == b"y" * 50_000
    assert time.monotonic() - started < 0.2
    conn.close()


async def test_fault_settings_are_validated(proxy: FaultProxy) -> None:
    with pytest.raises(ValueError):
        proxy.set_latency(-1)
    with pytest.raises(ValueError):
        proxy.set_bandwidth(0)
    with pytest.raises(ValueError):
        await FaultProxy.start("no-port")


async def test_close_ends_every_connection(echo: str) -> None:
    proxy = await FaultProxy.start(echo)
    conn = await connect(proxy.address)
    await proxy.close()
    assert await conn.is_closed()
    assert await refuses(proxy.address)  # nothing listens any more
    conn.close()


# --- mesh -----------------------------------------------------------------------


@pytest.fixture
async def mesh(start_echo: StartEcho) -> AsyncIterator[ProxyMesh]:
    nodes = {region: await start_echo(region) for region in ("a", "b", "c")}
    async with await ProxyMesh.start(nodes) as mesh:
        yield mesh


async def link_serves(mesh: ProxyMesh, src: str, dst: str) -> bool:
    return await serves(mesh.peer_address(src, dst), tag=dst)


async def test_mesh_routes_each_pair_to_its_destination(mesh: ProxyMesh) -> None:
    pairs = [(src, dst) for src in mesh.regions for dst in mesh.regions if src != dst]
    assert len({mesh.peer_address(src, dst) for src, dst in pairs}) == 6
    for src, dst in pairs:
        assert await link_serves(mesh, src, dst)
    assert mesh.peers("a") == {"b": mesh.peer_address("a", "b"), "c": mesh.peer_address("a", "c")}


async def test_isolate_cuts_links_into_and_out_of_one_region(mesh: ProxyMesh) -> None:
    mesh.isolate("c")
    for src, dst in [("a", "c"), ("c", "a"), ("b", "c"), ("c", "b")]:
        assert await refuses(mesh.peer_address(src, dst)), f"{src}->{dst}"
    assert await link_serves(mesh, "a", "b")
    assert await link_serves(mesh, "b", "a")
    mesh.heal()
    assert await link_serves(mesh, "a", "c")
    assert await link_serves(mesh, "c", "a")


async def test_partition_cuts_links_between_groups_only(mesh: ProxyMesh) -> None:
    mesh.partition([{"a"}, {"b", "c"}])
    assert await refuses(mesh.peer_address("a", "b"))
    assert await refuses(mesh.peer_address("c", "a"))
    assert await link_serves(mesh, "b", "c")
    assert await link_serves(mesh, "c", "b")
    mesh.heal()
    assert await link_serves(mesh, "a", "b")
    with pytest.raises(ValueError, match="no group"):
        mesh.partition([{"a"}, {"b"}])
    with pytest.raises(ValueError, match="more than one"):
        mesh.partition([{"a", "b"}, {"b", "c"}])
    with pytest.raises(ValueError, match="unknown region"):
        mesh.isolate("z")


async def test_slow_delays_one_link_only(mesh: ProxyMesh) -> None:
    mesh.slow("a", "b", 0.2)
    slow = await connect(mesh.peer_address("a", "b"), "b")
    fast = await connect(mesh.peer_address("b", "a"), "a")
    started = time.monotonic()
    await slow.round_trip(b"x")
    assert time.monotonic() - started >= 0.38
    started = time.monotonic()
    await fast.round_trip(b"x")
    assert time.monotonic() - started < 0.2
    slow.close()
    fast.close()


# --- a real node ----------------------------------------------------------------


async def test_grpc_caller_sees_unavailable_while_cut(start_node: StartNode) -> None:
    node = await start_node(region="west")
    async with (
        await FaultProxy.start(node.address, name="to-west") as proxy,
        AsyncClient(proxy.address, timeout=2) as client,
    ):
        assert (await client.info()).region == "west"
        proxy.cut()
        started = time.monotonic()
        with pytest.raises(Unavailable) as failure:
            await client.info()
        # UNAVAILABLE before the 2 s deadline, retries included: the caller was
        # told the link is down, not left to wait for DEADLINE_EXCEEDED.
        assert failure.value.code == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - started < 2.0
        proxy.heal()
        # The channel reconnects on gRPC's own backoff (~1 s after failures),
        # so the first call after heal may still fail; within a few it works.
        deadline = time.monotonic() + 5
        while True:
            try:
                assert (await client.info()).region == "west"
                break
            except Unavailable:
                assert time.monotonic() < deadline, "no recovery 5 s after heal"
                await asyncio.sleep(0.1)

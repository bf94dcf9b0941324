"""Connections that never authenticate hold none of a node's ports (issue 43).

A hostile process (``python -m tests.floods``) keeps 500 connections open to each of
a node's client port, peer listener and dashboard, from eight source addresses,
sends nothing on any of them, and opens a new one for each the node closes. The
node runs as a process with an open-file limit of 1,024, as a container's default,
over mutual TLS. Meanwhile:

- a peer whose data was wiped (a node replacing a lost one) starts, catches up with
  the flooded node through its peer listener and decides within 10 s of its start
  (it waited for gRPC's 120 s handshake deadline before);
- an established peer's copy stays under 5 s behind, and a channel that pings as
  the replicator's do (``replication.tuning.CHANNEL_OPTIONS``) stays READY: no
  GOAWAY, no reconnection;
- claims on the client port are every one answered;
- the node never comes near its open-file limit.

``FLOOD_SECONDS`` sets the flood's length (30 s here; docs/testing.md, *Floods*,
records a two-minute soak run of this test, with its latency and lag figures, which
are reported, not asserted).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fencemark.client import AsyncClient, NotFound, tls_credentials
from fencemark.node.replication.tuning import CHANNEL_OPTIONS
from fencemark.node.security.tls import init_dir
from fencemark.node.tools.ports import Ports
from fencemark.node.tools.process import NodeProcess
from tests.cluster import eventually

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
FLOOD_SECONDS = float(os.environ.get("FLOOD_SECONDS", "30"))
SOCKETS = 500  # per port
OPEN_FILES = 1024  # the flooded node's limit, as a container's default
REGIONS = ("us", "eu", "ap")
LAG_S = 5.0
DECIDE_S = 10.0


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def test_a_silent_flood_on_every_port_holds_none_of_them(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    init_dir(certs, regions=list(REGIONS), clients=["alice"])
    report: dict[str, object] = {"flood_seconds": FLOOD_SECONDS, "sockets_per_port": SOCKETS}
    with Ports() as ports:
        client = {region: ports.address() for region in REGIONS}
        us_peer, us_dashboard = ports.address(), ports.address()
        peers = {"us": us_peer, "eu": client["eu"], "ap": client["ap"]}
        nodes: dict[str, NodeProcess] = {}

        async def start(region: str) -> NodeProcess:
            extra = [f"--peer={r}={a}" for r, a in peers.items() if r != region]
            extra += ["--anti-entropy-interval=0.5", "--start-wait=5"]
            if region == "us":
                extra += [f"--peer-listen={us_peer}", f"--dashboard-listen={us_dashboard}"]
            nodes[region] = await NodeProcess.start(
                tmp_path / region, region=region, listen=client[region], tls_dir=certs,
                extra_args=tuple(extra), open_files=OPEN_FILES if region == "us" else None,
            )  # fmt: skip
            return nodes[region]

        try:
            await asyncio.gather(*(start(region) for region in REGIONS))
            async with (
                AsyncClient(client["us"], credentials=tls_credentials(certs, "alice")) as us,
                AsyncClient(client["eu"], credentials=tls_credentials(certs, "alice")) as eu,
            ):
                await _deciding(us, "us", 30)
                item = (await us.remember("flood", "t", "claimed", title="x")).record.key
                probe = await _peer_channel(certs, us_peer)
                flood = await _flood([client["us"], us_peer, us_dashboard])
                try:
                    # A replacement for a lost node: ap's data wiped, started anew.
                    await nodes["ap"].kill()
                    await asyncio.to_thread(shutil.rmtree, tmp_path / "ap")
                    started = time.monotonic()
                    await start("ap")
                    async with AsyncClient(
                        client["ap"], credentials=tls_credentials(certs, "alice")
                    ) as ap:
                        await _deciding(ap, "ap", DECIDE_S)
                    report["new_peer_deciding_s"] = round(time.monotonic() - started, 2)
                    results = await asyncio.gather(
                        _claims(us, item, FLOOD_SECONDS),
                        _lags(us, eu, FLOOD_SECONDS),
                        _watch_state(probe, FLOOD_SECONDS),
                        _most_files(nodes["us"].proc.pid, FLOOD_SECONDS),
                    )
                finally:
                    tallies = await _end(flood)
                    await probe.close(None)
        finally:
            await asyncio.gather(*(node.stop() for node in nodes.values()))
    latencies, lags, states, most_files = results
    report.update(
        claims=len(latencies),
        claim_p50_ms=round(statistics.median(latencies) * 1000, 1),
        claim_p99_ms=round(statistics.quantiles(latencies, n=100)[98] * 1000, 1),
        lag_max_s=round(max(lags), 2),
        probe_states=sorted(set(states)),
        most_open_files=most_files,
        flood=tallies,
    )
    print(json.dumps(report))  # the figures docs/testing.md records
    assert len(tallies) == 3 and all(t["opened"] >= SOCKETS for t in tallies), tallies
    assert states == ["READY"] * len(states), "the pinging peer's channel left READY (GOAWAY)"
    assert most_files < OPEN_FILES - 64, f"{most_files} of {OPEN_FILES} descriptors open"


async def _deciding(client: AsyncClient, region: str, within: float) -> None:
    async def deciding() -> bool:
        try:
            return (await client.info()).claims_serving
        except grpc.aio.AioRpcError:
            return False

    await eventually(deciding, f"{region} deciding claims", within=within, every=0.1)


async def _peer_channel(certs: Path, address: str) -> grpc.aio.Channel:
    """A connection to the peer listener as a peer's replicator keeps one: region eu's
    certificate, the replicator's keepalive pings; READY once a health check passed."""
    credentials = tls_credentials(certs, "eu")
    channel = grpc.aio.secure_channel(address, credentials, options=CHANNEL_OPTIONS)
    health = health_pb2_grpc.HealthStub(channel)
    await health.Check(health_pb2.HealthCheckRequest(), timeout=10)
    return channel


async def _flood(targets: list[str]) -> asyncio.subprocess.Process:
    flood = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.floods", *(f"--target={t}" for t in targets),
        f"--sockets={SOCKETS}", f"--seconds={FLOOD_SECONDS + 30}",
        stdout=asyncio.subprocess.PIPE, cwd=ROOT,
    )  # fmt: skip
    assert flood.stdout is not None
    async with asyncio.timeout(30):
        assert (await flood.stdout.readline()).strip() == b"flooding"
    return flood


async def _end(flood: asyncio.subprocess.Process) -> list[dict[str, int]]:
    """Stop the flood; what it says it did, per target."""
    assert flood.stdout is not None
    if flood.returncode is None:
        flood.terminate()
    out = await flood.stdout.read()
    await flood.wait()
    return [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]


async def _claims(client: AsyncClient, key: str, seconds: float) -> list[float]:
    """Claim and release ``key`` for ``seconds``: each cycle's claim latency; every
    claim must be granted (the call's own deadline, 5 s, bounds a stuck one)."""
    latencies = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        began = time.monotonic()
        claim = await client.claim(key, "alice", lease_seconds=10)
        latencies.append(time.monotonic() - began)
        assert claim.granted, claim
        await client.release_claim(key, claim.fencing_token)
    return latencies


async def _lags(us: AsyncClient, eu: AsyncClient, seconds: float) -> list[float]:
    """A write at us every half second: how long each took to be read at eu (< LAG_S)."""
    lags = []
    deadline = time.monotonic() + seconds
    n = 0
    while time.monotonic() < deadline:
        n += 1
        written = time.monotonic()
        key = (await us.remember("flood", "lag", f"w{n}", title="x")).record.key

        async def at_eu(key: str = key) -> bool:
            try:
                await eu.get(key)
            except NotFound:
                return False
            return True

        await eventually(at_eu, f"{key} at eu", within=LAG_S, every=0.05)
        lags.append(time.monotonic() - written)
        await asyncio.sleep(0.5)
    return lags


async def _watch_state(channel: grpc.aio.Channel, seconds: float) -> list[str]:
    """The channel's connectivity state, ten times a second."""
    seen = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        seen.append(channel.get_state(try_to_connect=False).name)
        await asyncio.sleep(0.1)
    return seen


async def _most_files(pid: int, seconds: float) -> int:
    most = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        most = max(most, open_files(pid))
        await asyncio.sleep(0.2)
    return most


async def test_pings_closer_together_than_the_policy_earn_no_goaway(tmp_path: Path) -> None:
    """A node that stood still (shedding a flood, a stall) reads the pings that waited
    in its socket all at once, closer together than its policy's 5 s: each counted as
    a strike, and gRPC's default of two strikes answered a GOAWAY ``too_many_pings``
    (issue 43: an established peer was cut off mid-flood). Pings come only over a
    connection that completed its handshake, so the node takes them all: a channel
    pinging every second stays READY for ten."""
    from fencemark.node.api.server import NodeConfig, NodeServer

    node = await NodeServer.start(
        NodeConfig(listen="127.0.0.1:0", data_dir=tmp_path / "node", grace_seconds=0.2)
    )
    try:
        eager = [(k, v) for k, v in CHANNEL_OPTIONS if k != "grpc.keepalive_time_ms"]
        eager.append(("grpc.keepalive_time_ms", 1_000))
        async with grpc.aio.insecure_channel(node.address, options=eager) as channel:
            await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
            states = await _watch_state(channel, 10.0)
        assert states == ["READY"] * len(states), sorted(set(states))
    finally:
        await node.stop()

"""SPEC §4 from the client's side: home-only calls reach the record's home region.

A real two-region cluster ("us" and "eu") on loopback, replicating to each
other. The client under test talks to "us" (its local region) and is given
the address of every region; records are homed in "eu". Claims, renewals,
releases, fenced writes and the creation of an eu-homed record must land at
eu; reads must stay at us.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

import psutil
import pytest

from fencemark.client import (
    AsyncClient,
    ClaimConflict,
    Client,
    FencemarkError,
    Unavailable,
    WrongRegion,
)
from fencemark.node.api.server import NodeConfig, NodeServer
from fencemark.node.replication.tuning import Tuning
from tests.cluster import all_deciding, shared_loop
from tests.conftest import StartNode
from tests.ports import free_port

REPO, TOPIC = "routing", "backlog"
LEASE = 30.0
PATIENCE_SECONDS = 10.0  # replication and catch-up are bounded by this in every test

_T = TypeVar("_T")


async def eventually(probe: Callable[[], Awaitable[_T]], what: str) -> _T:
    """The first result of ``probe`` that is not an error, polling for a bounded time."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + PATIENCE_SECONDS
    while True:
        try:
            return await probe()
        except (FencemarkError, AssertionError):
            if loop.time() > give_up:
                raise AssertionError(f"not within {PATIENCE_SECONDS} s: {what}") from None
        await asyncio.sleep(0.05)


@dataclass
class Cluster:
    us: NodeServer
    eu: NodeServer

    @property
    def regions(self) -> dict[str, str]:
        return {"us": self.us.address, "eu": self.eu.address}


async def seed(config: NodeConfig) -> None:
    """Give the node's store one record before it joins the cluster.

    A node that starts empty with peers grants nothing until it has caught up
    with them (SPEC §4); two empty nodes started side by side can take seconds
    to do that, whichever is first backing off from the other. A node that
    holds data only compares states with its peers first, which keeps these
    routing tests fast.
    """
    node = await NodeServer.start(replace(config, listen="127.0.0.1:0", peers={}))
    try:
        async with AsyncClient(node.address) as client:
            await client.remember("seed", "cluster", config.region)
    finally:
        await node.stop(grace=0)


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    """Regions "us" and "eu", peers of each other, both granting claims."""
    addresses = {region: f"127.0.0.1:{free_port()}" for region in ("us", "eu")}
    configs = [
        NodeConfig(
            region=region,
            listen=address,
            data_dir=tmp_path / region,
            enable_writes=True,
            grace_seconds=0.5,
            peers={peer: a for peer, a in addresses.items() if peer != region},
            anti_entropy_interval=0.2,
            # A twin's settle is no concern here: a short one (docs/replication.md);
            # it counts twice the clock offset, and both nodes read one clock.
            replication=shared_loop(Tuning(heartbeat_s=0.2, settle_slack_s=0.2)),
            max_clock_offset_ms=50,
        )
        for region, address in addresses.items()
    ]
    nodes: list[NodeServer] = []
    try:
        for config in configs:
            await seed(config)
            nodes.append(await NodeServer.start(config))
        us, eu = nodes
        # A restarted node decides once it had a round with its peer (grant_gate).
        await all_deciding(us, eu)
        yield Cluster(us=us, eu=eu)
    finally:
        for node in reversed(nodes):
            await node.stop()


@pytest.fixture
async def routed(cluster: Cluster) -> AsyncIterator[AsyncClient]:
    """A client local to "us" that knows where every region is."""
    async with AsyncClient(cluster.us.address, regions=cluster.regions, timeout=5.0) as client:
        yield client


async def eu_record(cluster: Cluster, id_: str) -> str:
    """A record created at eu (so homed there) and replicated to us; its key."""
    async with AsyncClient(cluster.eu.address) as eu:
        result = await eu.remember(REPO, TOPIC, id_, title=id_, body="new")
    assert result.created
    assert result.record.home_region == "eu"
    key = result.record.key
    async with AsyncClient(cluster.us.address) as us:
        await eventually(lambda: us.get(key), f"{key} replicated to us")
    return key


async def body_at(address: str, key: str, body: str) -> None:
    async with AsyncClient(address) as client:

        async def has_body() -> None:
            assert (await client.get(key)).body == body

        await eventually(has_body, f"{key} has body {body!r} at {address}")


# -- the cluster itself ------------------------------------------------------------------


async def test_a_record_created_in_eu_is_homed_there_and_replicated_to_us(
    cluster: Cluster,
) -> None:
    key = await eu_record(cluster, "replicated")
    async with AsyncClient(cluster.us.address) as us:
        record = await us.get(key)
    assert record.home_region == "eu"
    assert "homeRegion:eu" in record.tags


# -- home-only calls are routed ----------------------------------------------------------


async def test_claim_fenced_write_renew_and_release_from_us_all_land_at_eu(
    cluster: Cluster, routed: AsyncClient
) -> None:
    key = await eu_record(cluster, "routed")

    claim = await routed.claim(key, "worker-us", lease_seconds=LEASE)
    assert claim.granted, claim
    assert claim.home_region == "eu"
    assert routed.home_regions[key] == "eu"

    record = await routed.update(key, fields={"body": "started"}, fencing_token=claim.fencing_token)
    assert record.body == "started"
    assert record.fence == claim.fencing_token
    await body_at(cluster.us.address, key, "started")  # decided at eu, replicated back

    renewal = await routed.renew_claim(key, claim.fencing_token, lease_seconds=LEASE)
    assert renewal.renewed, renewal
    assert renewal.home_region == "eu"

    release = await routed.release_claim(key, claim.fencing_token)
    assert release.released, release
    assert release.fence == claim.fencing_token
    async with AsyncClient(cluster.eu.address) as eu:
        assert (await eu.claim_status(key)).claim is None


async def test_once_the_home_is_known_home_only_calls_go_straight_there(
    cluster: Cluster, routed: AsyncClient
) -> None:
    """After one redirect the local node is no longer on the path: it can even be down."""
    key = await eu_record(cluster, "direct")
    claim = await routed.claim(key, "worker-us", lease_seconds=LEASE)
    assert claim.granted, claim

    await cluster.us.stop(grace=0)

    token = claim.fencing_token
    assert (await routed.claim(key, "worker-us", lease_seconds=LEASE)).fencing_token == token
    assert (await routed.update(key, fields={"body": "done"}, fencing_token=token)).body == "done"
    assert (await routed.renew_claim(key, token)).renewed
    assert (await routed.delete(key, fencing_token=token)).deleted
    assert (await routed.release_claim(key, token)).released


@pytest.mark.parametrize("knows", ["no regions", "only us"])
async def test_without_the_home_in_the_regions_map_the_wrong_region_answer_is_returned(
    cluster: Cluster, knows: str
) -> None:
    key = await eu_record(cluster, f"unrouted-{knows.replace(' ', '-')}")
    regions = {} if knows == "no regions" else {"us": cluster.us.address}
    async with AsyncClient(cluster.eu.address) as eu:
        token = (await eu.claim(key, "worker-eu", lease_seconds=LEASE)).fencing_token
    async with AsyncClient(cluster.us.address, regions=regions) as us:
        claim = await us.claim(key, "worker-us")
        assert (claim.granted, claim.reason, claim.home_region) == (False, "wrong_region", "eu")
        renewal = await us.renew_claim(key, token)
        assert (renewal.renewed, renewal.reason, renewal.home_region) == (
            False,
            "wrong_region",
            "eu",
        )
        release = await us.release_claim(key, token)
        assert (release.released, release.reason) == (False, "wrong_region")
        with pytest.raises(ClaimConflict) as refused:
            await us.update(key, fields={"body": "x"}, fencing_token=token)
        assert (refused.value.reason, refused.value.home_region) == ("wrong_region", "eu")
        with pytest.raises(WrongRegion) as not_here:
            await us.remember(REPO, TOPIC, f"new-{knows[0]}", tags=["homeRegion:eu"])
        assert not_here.value.home_region == "eu"
        assert us.home_regions[key] == "eu"  # learnt, but there is nowhere to send it


async def test_a_new_record_tagged_for_eu_is_created_at_eu(
    cluster: Cluster, routed: AsyncClient
) -> None:
    result = await routed.remember(REPO, TOPIC, "born-in-eu", title="t", tags=["homeRegion:eu"])
    assert result.created
    assert result.record.home_region == "eu"
    async with AsyncClient(cluster.eu.address) as eu:  # us would have refused to create it
        assert (await eu.get(result.record.key)).title == "t"
    assert routed.home_regions[result.record.key] == "eu"


async def test_an_unfenced_write_stays_local(cluster: Cluster, routed: AsyncClient) -> None:
    key = await eu_record(cluster, "unfenced")
    assert (await routed.get(key)).home_region == "eu"  # the home is known now
    await cluster.eu.stop(grace=0)
    assert (await routed.update(key, fields={"body": "local"})).body == "local"


# -- reads stay local --------------------------------------------------------------------


async def test_reads_go_to_the_local_region_and_teach_the_client_the_home(
    cluster: Cluster,
) -> None:
    key = await eu_record(cluster, "reads")
    await cluster.eu.stop(grace=0)
    async with AsyncClient(cluster.us.address, regions=cluster.regions, retries=0) as routed:
        assert (await routed.info()).region == "us"
        assert await routed.health() == "SERVING"
        assert (await routed.get(key)).home_region == "eu"
        assert [r.key for r in (await routed.list(REPO)).records] == [key]
        status = await routed.claim_status(key)
        assert (status.home_region, status.authoritative) == ("eu", False)
        assert routed.home_regions == {key: "eu"}
        # The read taught the client the home, so a claim goes to eu, which is down.
        with pytest.raises(Unavailable):
            await routed.claim(key, "worker-us")


# -- the blocking face -------------------------------------------------------------------


async def test_the_blocking_client_routes_the_same_way(cluster: Cluster) -> None:
    key = await eu_record(cluster, "blocking")

    def work() -> tuple[bool, str, dict[str, str]]:
        with Client(cluster.us.address, regions=cluster.regions) as client:
            claim = client.claim(key, "worker-blocking", lease_seconds=LEASE)
            client.release_claim(key, claim.fencing_token)
            return claim.granted, claim.home_region, client.home_regions

    # The nodes run on this test's loop, so the blocking calls run in a thread.
    granted, home, homes = await asyncio.to_thread(work)
    assert (granted, home, homes) == (True, "eu", {key: "eu"})


def test_regions_must_map_names_to_addresses() -> None:
    with pytest.raises(TypeError, match="regions"):
        AsyncClient("127.0.0.1:1", regions=["eu"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"regions\['eu'\]"):
        AsyncClient("127.0.0.1:1", regions={"eu": 7400})  # type: ignore[dict-item]


def _connections_to(address: str) -> int:
    port = int(address.rsplit(":", 1)[1])
    return sum(
        1
        for c in psutil.Process().net_connections(kind="tcp")
        if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
    )


@pytest.mark.parametrize(("own", "expected"), [(False, 1), (True, 3)])
async def test_clients_share_one_connection_unless_each_asks_for_its_own(
    start_node: StartNode, own: bool, expected: int
) -> None:
    """gRPC lets a process's channels to one address share a connection; a client
    made with ``own_connection`` (a load generator's agents) opens its own."""
    node = await start_node()
    clients = [AsyncClient(node.address, own_connection=own) for _ in range(3)]
    try:
        for client in clients:
            await client.info()
        assert _connections_to(node.address) == expected
    finally:
        await asyncio.gather(*(c.close() for c in clients))

"""The work queue across regions (SPEC §8): three node processes with the fault proxy
mesh between them, agents talking to their own region's node.

- A routing client asks its own region for work first, then the others it knows.
- An ``after:`` link to an item homed in another region holds the item until that
  item's ``done`` has replicated.
- A region cut off from the others drains its own items; nothing is handed out twice,
  and after the heal every replica agrees that each item was done once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from fencemark.client import AsyncClient, Unavailable
from fencemark.node.tools.cluster import LocalCluster
from tests.cluster import eventually
from tests.test_partition import all_deciding, converged

pytestmark = pytest.mark.slow
REGIONS = ("us", "eu", "ap")
REPO, TOPIC = "part", "queue"


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[LocalCluster]:
    cluster = await LocalCluster.start(REGIONS, tmp_path, faults=True, anti_entropy_interval=0.2)
    try:
        yield cluster
    finally:
        await cluster.stop()


@pytest.fixture
async def clients(cluster: LocalCluster) -> AsyncIterator[dict[str, AsyncClient]]:
    made = {
        region: AsyncClient(address, regions=cluster.routes_from(region), timeout=5)
        for region, address in cluster.addresses.items()
    }
    try:
        await all_deciding(made)
        yield made
    finally:
        for client in made.values():
            await client.close()


async def test_a_client_takes_work_from_its_own_region_first_then_from_the_others(
    clients: dict[str, AsyncClient],
) -> None:
    await clients["eu"].remember(REPO, TOPIC, "eu-item", tags=["homeRegion:eu"])
    await clients["us"].remember(REPO, TOPIC, "us-item", tags=["homeRegion:us"])
    us = clients["us"]
    first = await us.claim_next(REPO, TOPIC, "us-worker", lease_seconds=60)
    assert first.record is not None and first.record.id == "us-item"
    # Another worker of us: us has nothing left, so eu's item is next.
    second = await us.claim_next(REPO, TOPIC, "us-worker-2", lease_seconds=60)
    assert second.record is not None and second.record.id == "eu-item"
    assert second.home_region == "eu"  # decided by eu's node, reached through routing
    # The token works like any: released done at its home, routed there.
    done = await us.release_claim(second.record.key, second.fencing_token, outcome="done")
    assert done.released
    assert (await us.claim_next(REPO, TOPIC, "us-worker-2")).reason == "empty"


async def test_a_region_out_of_reach_is_passed_over_for_the_next(
    cluster: LocalCluster, clients: dict[str, AsyncClient]
) -> None:
    """Regression (the chaos tier): ClaimNext gave up with UNAVAILABLE at the first
    region it could not reach, though another region had work. Here ``dead`` is a
    loopback port nobody listens on, named between us and the others."""
    await clients["eu"].remember(REPO, TOPIC, "far-item", tags=["homeRegion:eu"])
    routes = {**cluster.routes_from("us"), "dead": "127.0.0.1:1"}
    async with AsyncClient(cluster.addresses["us"], regions=routes, timeout=2) as client:
        picked = await client.claim_next(REPO, TOPIC, "w", lease_seconds=60)
        assert picked.record is not None and picked.record.id == "far-item"
    async with AsyncClient("127.0.0.1:1", regions={"dead": "127.0.0.1:1"}, timeout=1) as none:
        with pytest.raises(Unavailable):
            await none.claim_next(REPO, TOPIC, "w")  # no region answered at all


async def test_an_after_link_to_another_region_waits_for_the_done_to_replicate(
    clients: dict[str, AsyncClient],
) -> None:
    us, eu = clients["us"], clients["eu"]
    await eu.remember(REPO, TOPIC, "first", tags=["homeRegion:eu"])
    await us.remember(REPO, TOPIC, "then", tags=["homeRegion:us", "after:first"])
    local = AsyncClient(us.target, timeout=5)  # no routing: us's own items only
    try:
        assert (await local.claim_next(REPO, TOPIC, "w")).reason == "empty"
        first = await eu.claim_next(REPO, TOPIC, "w", lease_seconds=60)
        assert first.record is not None and first.record.id == "first"
        await eu.release_claim(first.record.key, first.fencing_token, outcome="done")

        async def then_is_handed_out() -> bool:
            picked = await local.claim_next(REPO, TOPIC, "w", lease_seconds=60)
            return picked.record is not None and picked.record.id == "then"

        await eventually(then_is_handed_out, "us seeing eu's done and handing out 'then'")
    finally:
        await local.close()


async def test_a_cut_off_region_drains_its_own_items_and_none_is_done_twice(
    cluster: LocalCluster, clients: dict[str, AsyncClient]
) -> None:
    for region in REGIONS:
        for i in range(4):
            await clients[region].remember(
                REPO, TOPIC, f"{region}-{i}", tags=[f"homeRegion:{region}"]
            )
    await converged(clients)
    assert cluster.mesh is not None
    cluster.mesh.isolate("ap")
    done: list[str] = []

    async def drain(region: str, worker: str) -> None:
        client = AsyncClient(cluster.addresses[region], timeout=5)  # its own region only
        try:
            while (
                picked := await client.claim_next(REPO, TOPIC, worker, lease_seconds=30)
            ).granted:
                assert picked.record is not None
                released = await client.release_claim(
                    picked.record.key, picked.fencing_token, outcome="done"
                )
                assert released.released
                done.append(picked.record.id)
        finally:
            await client.close()

    await asyncio.gather(*(drain(region, f"{region}-w{n}") for region in REGIONS for n in (1, 2)))
    assert sorted(done) == sorted(f"{r}-{i}" for r in REGIONS for i in range(4))
    cluster.mesh.heal()
    final = await converged(clients, limit=30)
    items = {record.id: record for record in final.values() if record.topic == TOPIC}
    assert all(record.status == "done" for record in items.values())
    for region in REGIONS:
        for i in range(4):
            history = await clients[region].history(f"repo/{REPO}/mem/{TOPIC}/{region}-{i}")
            releases = [e for e in history.events if e.kind == "released" and e.detail == "done"]
            assert len(releases) == 1, (region, i, history)

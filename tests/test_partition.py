"""A region cut off by the fault proxy mesh keeps serving, and converges after the heal.

Three node processes (``LocalCluster`` with ``faults=True``): node-to-node
traffic goes through per-link proxies, clients talk to their own region's node
directly, as agents in a cut-off region would.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from fencemark.client import AsyncClient, Record
from fencemark.node.tools.cluster import LocalCluster

pytestmark = pytest.mark.slow
REGIONS = ("us", "eu", "ap")


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[LocalCluster]:
    cluster = await LocalCluster.start(REGIONS, tmp_path, faults=True, anti_entropy_interval=0.2)
    try:
        yield cluster
    finally:
        await cluster.stop()


async def views(clients: dict[str, AsyncClient]) -> dict[str, dict[str, Record]]:
    return {
        region: {r.key: r async for r in client.iter_records("part", include_deleted=True)}
        for region, client in clients.items()
    }


async def all_deciding(clients: dict[str, AsyncClient], limit: float = 30.0) -> None:
    """Nodes that started empty catch up with their peers before they decide claims."""
    started = time.monotonic()
    while not all([(await c.info()).claims_serving for c in clients.values()]):
        assert time.monotonic() - started < limit, "nodes did not catch up"
        await asyncio.sleep(0.1)


async def converged(clients: dict[str, AsyncClient], limit: float = 20.0) -> dict[str, Record]:
    started = time.monotonic()
    while True:
        seen = await views(clients)
        digests = [{k: r.digest for k, r in view.items()} for view in seen.values()]
        if all(d == digests[0] for d in digests):
            return seen["us"]
        assert time.monotonic() - started < limit, f"not converged within {limit} s: {digests}"
        await asyncio.sleep(0.1)


async def test_a_cut_off_region_serves_reads_and_writes_and_converges_after_the_heal(
    cluster: LocalCluster,
) -> None:
    clients = {r: AsyncClient(a, timeout=5) for r, a in cluster.addresses.items()}
    try:
        await all_deciding(clients)
        for region in REGIONS:
            await clients[region].remember(
                "part", "t", f"home-{region}", title="before", tags=[f"homeRegion:{region}"]
            )
        await converged(clients)
        assert cluster.mesh is not None
        cluster.mesh.isolate("ap")

        # Cut off, ap still serves its clients: reads, unfenced writes, and claims
        # on the records homed there (decided at ap, with nobody else to ask).
        ap = clients["ap"]
        assert (await ap.get("repo/part/mem/t/home-us")).title == "before"
        await ap.update("repo/part/mem/t/home-us", fields={"from_ap": "written while cut"})
        claim = await ap.claim("repo/part/mem/t/home-ap", "ap-worker", lease_seconds=30)
        assert claim.granted
        await ap.update(
            "repo/part/mem/t/home-ap", fields={"body": "fenced at ap"},
            fencing_token=claim.fencing_token,
        )  # fmt: skip
        # ... and the others go on without it.
        await clients["us"].update("repo/part/mem/t/home-us", fields={"from_us": "also"})
        made = await clients["eu"].remember("part", "t", "new-eu", title="born during the cut")
        await asyncio.sleep(1.0)  # several anti-entropy rounds that cannot reach ap
        cut_view = await views(clients)
        assert "repo/part/mem/t/new-eu" not in cut_view["ap"]
        assert "from_ap" not in cut_view["us"]["repo/part/mem/t/home-us"].fields

        cluster.mesh.heal()
        final = await converged(clients)
        home_us = final["repo/part/mem/t/home-us"].fields
        assert home_us["from_ap"] == "written while cut" and home_us["from_us"] == "also"
        assert final["repo/part/mem/t/home-ap"].fields["body"] == "fenced at ap"
        assert final["repo/part/mem/t/home-ap"].fence == claim.fencing_token
        assert final[made.record.key].title == "born during the cut"
    finally:
        for client in clients.values():
            await client.close()


async def test_during_a_cut_home_only_calls_fail_fast_elsewhere_and_reads_still_work(
    cluster: LocalCluster,
) -> None:
    """A client in us routing to ap through the cut link gets a clear error, not a hang."""
    us = AsyncClient(cluster.addresses["us"], regions=cluster.routes_from("us"), timeout=3)
    ap = AsyncClient(cluster.addresses["ap"], timeout=5)
    try:
        await all_deciding({"us": us, "ap": ap})
        made = await ap.remember("part", "t", "homed-ap", title="x", tags=["homeRegion:ap"])
        await converged({"us": us, "ap": ap})
        assert cluster.mesh is not None
        cluster.mesh.isolate("ap")
        started = time.monotonic()
        with pytest.raises(Exception) as refused:
            await us.claim(made.record.key, "us-worker", lease_seconds=10)
        assert time.monotonic() - started < 10
        assert "UNAVAILABLE" in str(refused.value) or "DEADLINE" in str(refused.value)
        assert (await us.get(made.record.key)).title == "x"  # reads stay local
    finally:
        cluster.mesh.heal() if cluster.mesh is not None else None
        await us.close()
        await ap.close()

"""SPEC §4/§5 with real processes: a three-region cluster of ``fencemark node`` children.

Regions us, eu and ap, each a child process on its own SQLite file, wired with
``--peer`` to addresses picked before any of them started. Convergence is
judged from outside, over the public API only: every node must list the same
records with the same ``digest`` (the hash of the canonical state).
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import pytest

from fencemark.client import AsyncClient, ClaimConflict
from tests.cluster import ProcessCluster, eventually

pytestmark = pytest.mark.slow

REGIONS = ("us", "eu", "ap")
REPO = "cluster"
LONG_LEASE = 60.0


def key_of(topic: str, id_: str) -> str:
    return f"repo/{REPO}/mem/{topic}/{id_}"


@asynccontextmanager
async def connected(cluster: ProcessCluster) -> AsyncIterator[dict[str, AsyncClient]]:
    """A client per region, by the region's fixed address (valid across restarts)."""
    async with AsyncExitStack() as stack:
        yield {
            region: await stack.enter_async_context(AsyncClient(address))
            for region, address in cluster.addresses.items()
        }


async def listing(client: AsyncClient) -> dict[str, bytes]:
    """``key -> digest`` of every record the node lists, tombstones included."""
    return {
        record.key: record.digest
        async for record in client.iter_records(REPO, include_deleted=True, page_size=100)
    }


async def wait_converged(clients: dict[str, AsyncClient], regions: Sequence[str]) -> None:
    """Poll until every region lists the same records with the same digests."""
    latest: dict[str, dict[str, bytes]] = {}

    async def same() -> bool:
        for region in regions:
            latest[region] = await listing(clients[region])
        first = latest[regions[0]]
        return all(latest[r] == first for r in regions[1:])

    async def differences() -> str:
        first = latest[regions[0]]
        parts = []
        for region in regions[1:]:
            theirs = latest[region]
            keys = sorted(k for k in set(first) | set(theirs) if first.get(k) != theirs.get(k))
            parts.append(f"{region} differs from {regions[0]} on {len(keys)} keys {keys[:3]}")
        return "; ".join(parts)

    await eventually(
        same, f"convergence of {', '.join(regions)}", within=20, every=0.1, explain=differences
    )
    counts = {r: (await clients[r].info()).record_count for r in regions}
    assert len(set(counts.values())) == 1 and counts[regions[0]] == len(latest[regions[0]]), counts


async def wait_serving(clients: dict[str, AsyncClient], regions: Sequence[str]) -> None:
    async def serving() -> bool:
        for region in regions:
            if not (await clients[region].info()).claims_serving:
                return False
        return True

    await eventually(serving, f"{', '.join(regions)} serving claims", within=20, every=0.1)


async def test_writes_at_all_three_regions_converge_byte_identically(tmp_path: Path) -> None:
    """SPEC §5: own records everywhere, and the same record written in all regions at once."""
    async with ProcessCluster(tmp_path, REGIONS) as cluster:
        await cluster.start_all()
        async with connected(cluster) as c:
            await wait_serving(c, REGIONS)

            async def own(region: str) -> None:
                for i in range(5):
                    made = await c[region].remember(
                        REPO, "own", f"{region}-{i}", title=f"{region} {i}", tags=["fresh"]
                    )
                    await c[region].update(
                        made.record.key, fields={"body": f"by {region}"}, remove_tags=["fresh"]
                    )
                await c[region].delete(key_of("own", f"{region}-4"))

            await asyncio.gather(*(own(r) for r in REGIONS))
            shared = (await c["eu"].remember(REPO, "shared", "s", title="shared")).record

            async def everywhere() -> bool:
                for region in REGIONS:
                    if shared.key not in await listing(c[region]):
                        return False
                return True

            await eventually(everywhere, "the shared record at every region")

            async def contend(region: str) -> None:
                for i in range(5):
                    await c[region].update(
                        shared.key, fields={"body": f"{region}-{i}", region: str(i)}
                    )

            await asyncio.gather(*(contend(r) for r in REGIONS))
            await wait_converged(c, REGIONS)
            got = {r: await c[r].get(shared.key) for r in REGIONS}
            assert len({(g.body, tuple(sorted(g.fields.items()))) for g in got.values()}) == 1
            assert {got["us"].fields[r] for r in REGIONS} == {"4"}
            assert got["us"].body in {f"{r}-4" for r in REGIONS}
            assert got["ap"].home_region == "eu"
            assert len(await listing(c["ap"])) == 3 * 5 + 1


async def test_a_node_killed_with_sigkill_comes_back_converges_and_keeps_its_tokens(
    tmp_path: Path,
) -> None:
    """SPEC §4/§5: kill -9 us; the others write on; us restarts, catches up, never reissues."""
    async with ProcessCluster(tmp_path, REGIONS) as cluster:
        await cluster.start_all()
        async with connected(cluster) as c:
            await wait_serving(c, REGIONS)
            item = (await c["us"].remember(REPO, "work", "item", title="t")).record
            tokens = []
            for owner in ("a", "b"):
                claim = await c["us"].claim(item.key, owner, lease_seconds=LONG_LEASE)
                assert claim.granted
                tokens.append(claim.fencing_token)
                assert (await c["us"].release_claim(item.key, claim.fencing_token)).released
            held = await c["us"].claim(item.key, "holder", lease_seconds=LONG_LEASE)
            assert held.granted
            await wait_converged(c, REGIONS)

            assert await cluster.kill("us") == -signal.SIGKILL
            await c["eu"].remember(REPO, "work", "while-us-dead", body="from eu")
            await c["ap"].remember(REPO, "work", "also-while-us-dead", body="from ap")
            with pytest.raises(ClaimConflict) as refused:  # eu sees the live claim
                await c["eu"].update(item.key, fields={"body": "no token"})
            assert refused.value.reason == "claimed"

            await cluster.start("us")
            await wait_converged(c, REGIONS)
            assert (await c["us"].get(key_of("work", "while-us-dead"))).body == "from eu"
            retry = await c["us"].claim(item.key, "holder", lease_seconds=LONG_LEASE)
            assert (retry.granted, retry.fencing_token) == (True, held.fencing_token)
            assert (await c["us"].release_claim(item.key, held.fencing_token)).released
            after = await c["us"].claim(item.key, "newcomer", lease_seconds=LONG_LEASE)
            assert after.granted and after.fencing_token > max(*tokens, held.fencing_token)


async def test_a_stopped_region_does_not_stop_the_others_and_catches_up(tmp_path: Path) -> None:
    """SPEC §5: with eu stopped, us and ap serve reads and unfenced writes; eu then converges."""
    async with ProcessCluster(tmp_path, REGIONS) as cluster:
        await cluster.start_all()
        async with connected(cluster) as c:
            await wait_serving(c, REGIONS)
            from_eu = (await c["eu"].remember(REPO, "region", "from-eu", body="v1")).record
            from_us = (await c["us"].remember(REPO, "region", "from-us", body="v1")).record
            work = (await c["us"].remember(REPO, "region", "work", body="to claim")).record
            await wait_converged(c, REGIONS)

            assert await cluster.stop("eu") == 0
            for region in ("us", "ap"):
                assert (await c[region].get(from_eu.key)).body == "v1"
            await c["us"].update(from_eu.key, fields={"body": "v2 at us"})
            await c["ap"].remember(REPO, "region", "from-ap", body="while eu is down")
            await c["ap"].delete(from_us.key)
            claim = await c["us"].claim(work.key, "worker", lease_seconds=LONG_LEASE)
            assert claim.granted, "us keeps granting claims on its own records"
            await wait_converged(c, ("us", "ap"))

            await cluster.start("eu")
            await wait_converged(c, REGIONS)
            assert (await c["eu"].get(from_eu.key)).body == "v2 at us"
            assert (await c["eu"].get(key_of("region", "from-ap"))).body == "while eu is down"
            page = await c["eu"].list(REPO, topic="region", include_deleted=True)
            assert {r.key: r.deleted for r in page.records}[from_us.key]
            status = await c["eu"].claim_status(work.key)
            assert status.claim is not None and status.claim.fencing_token == claim.fencing_token

"""Only the home decides that a lease lapsed; a write admitted under an older epoch
never overrides a newer claim (issue 13, hole 3; SPEC §4).

(a) Before the fix, a region that had seen B's claim but not its renewals took the
lease for lapsed and admitted an unfenced update, stamped with the same epoch and
a later clock: after the heal every replica held the intruder's body over the
work of a claim that was live the whole time. (b) A region that never saw B's
claim deleted the record unfenced, and after the heal the claimed record was
gone everywhere.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fencemark.client import AsyncClient, ClaimConflict
from fencemark.client.errors import NotFound
from fencemark.node.api.server import NodeServer
from tests.cluster import Cluster, all_deciding, eventually, wait_converged

pytestmark = pytest.mark.slow


async def body_at(node: NodeServer, key: str) -> str:
    async with AsyncClient(node.address) as client:
        return (await client.get(key)).fields.get("body", "")


async def test_a_region_that_missed_the_renewals_refuses_unfenced_writes(tmp_path: Path) -> None:
    """(a): eu saw B's claim, then was cut off while B renewed and worked at us."""
    async with Cluster(tmp_path, ["us", "eu"]) as cluster:
        us, eu = await cluster.start_all()
        await all_deciding(us, eu)
        async with AsyncClient(us.address) as at_us:
            made = await at_us.remember("lattice", "backlog", "held", title="x",
                                        tags=["homeRegion:us"])  # fmt: skip
            key = made.record.key
            held = await at_us.claim(key, "worker-b", lease_seconds=2)
        await wait_converged([us, eu])
        await cluster.stop("eu")
        eu = await cluster.start_isolated("eu")
        async with AsyncClient(us.address) as at_us, AsyncClient(eu.address) as at_eu:
            token = held.fencing_token
            # B renews at home (eu never hears of it) and works; eu's copy of the
            # lease runs out.
            assert (await at_us.renew_claim(key, token, lease_seconds=60)).renewed
            await at_us.update(key, fields={"body": "B: halfway"}, fencing_token=token)
            await eventually(lambda: _past(eu, key), "eu's copy of the lease running out")
            with pytest.raises(ClaimConflict) as refused:
                await at_eu.update(key, fields={"body": "intruder"})
            assert refused.value.reason == "claimed"
            assert refused.value.home_region == "us"
            with pytest.raises(ClaimConflict):
                await at_eu.delete(key)
        await cluster.stop("eu")
        eu = await cluster.start("eu")
        await wait_converged([us, eu])
        assert await body_at(eu, key) == "B: halfway"
        async with AsyncClient(us.address) as at_us:
            renewal = await at_us.renew_claim(key, token, lease_seconds=60)
            assert renewal.renewed
            # Released at home, the record takes unfenced writes everywhere again.
            await at_us.release_claim(key, token)
        await wait_converged([us, eu])
        async with AsyncClient(eu.address) as at_eu:
            await at_eu.update(key, fields={"body": "after the release"})


async def _past(node: NodeServer, key: str) -> bool:
    stored = await node.storage.get(key)
    assert stored is not None
    fence = stored.record.fence
    return node.replica.clock.wall_ms() >= fence.expiry(fence.fence)


async def test_a_delete_from_a_region_that_never_saw_the_claim_erases_nothing(
    tmp_path: Path,
) -> None:
    """(b): the claim is granted while eu is cut off; eu deletes the record."""
    async with Cluster(tmp_path, ["us", "eu"]) as cluster:
        us, eu = await cluster.start_all()
        await all_deciding(us, eu)
        async with AsyncClient(us.address) as at_us:
            made = await at_us.remember("lattice", "backlog", "gone", title="x",
                                        tags=["homeRegion:us"])  # fmt: skip
            key = made.record.key
        await wait_converged([us, eu])
        await cluster.stop("eu")
        eu = await cluster.start_isolated("eu")
        async with AsyncClient(us.address) as at_us, AsyncClient(eu.address) as at_eu:
            held = await at_us.claim(key, "worker-b", lease_seconds=60)
            await at_us.update(key, fields={"body": "B: started"}, fencing_token=held.fencing_token)
            await at_eu.delete(key)  # eu sees no grant: admitted, under the old epoch
        await cluster.stop("eu")
        eu = await cluster.start("eu")
        await wait_converged([us, eu])
        for node in (us, eu):
            assert await body_at(node, key) == "B: started"  # still there, B's work kept
        async with AsyncClient(us.address) as at_us:
            token = held.fencing_token
            await at_us.update(key, fields={"body": "B: done"}, fencing_token=token)
            renewal = await at_us.renew_claim(key, token, lease_seconds=60)
            assert renewal.renewed
            # A delete by the holder, under its claim, does delete.
            await at_us.delete(key, fencing_token=token)
            with pytest.raises(NotFound):
                await at_us.get(key)


async def test_the_home_records_a_lapse_and_every_region_readmits_unfenced_writes(
    tmp_path: Path,
) -> None:
    async with Cluster(tmp_path, ["us", "eu"]) as cluster:
        us, eu = await cluster.start_all()
        await all_deciding(us, eu)
        async with AsyncClient(us.address) as at_us, AsyncClient(eu.address) as at_eu:
            made = await at_us.remember("lattice", "backlog", "lapse", title="x",
                                        tags=["homeRegion:us"])  # fmt: skip
            key = made.record.key
            held = await at_us.claim(key, "worker-b", lease_seconds=1)

            async def lapsed_at_eu() -> bool:
                stored = await eu.storage.get(key)
                return stored is not None and held.fencing_token in stored.record.fence.lapsed

            await eventually(lapsed_at_eu, "the home's lapse replicated to eu")
            await at_eu.update(key, fields={"body": "anyone may write now"})
            renewal = await at_us.renew_claim(key, held.fencing_token, lease_seconds=60)
            assert not renewal.renewed and renewal.reason == "expired"
            with pytest.raises(ClaimConflict) as refused:
                await at_us.update(key, fields={"body": "B"}, fencing_token=held.fencing_token)
            assert refused.value.reason == "expired"
        assert us.lapses.recorded >= 1

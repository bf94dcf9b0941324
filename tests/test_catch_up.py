"""A node that lost its disk owes a catch-up until it completes one, however often it
restarts (issue 13, hole 1; SPEC §4).

Real node processes, ``kill -9`` and ``SIGTERM``, a wiped data directory and
``SIGSTOP``ped peers: the sequences an attacker arranged. Before the fix, whether
catch-up was still owed was inferred from an empty store at start-up, so a
restart after one client write — or after part of a catch-up — granted again a
token a worker still held.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fencemark.client import AsyncClient, ClaimConflict
from fencemark.client.errors import NotFound, Unavailable
from fencemark.node.rules.admission import RECOVERY_GAP
from tests.cluster import (
    Cluster,
    ProcessCluster,
    all_deciding,
    eventually,
    paused,
    wait_converged,
)

pytestmark = pytest.mark.slow

TAGS = ["backlog", "homeRegion:us"]


async def deciding(address: str) -> bool:
    async with AsyncClient(address) as client:
        return (await client.info()).claims_serving


async def assert_not_deciding(address: str, key: str) -> None:
    """Health says catching up, and a claim is refused as not serving."""
    async with AsyncClient(address, timeout=5) as client:
        assert not (await client.info()).claims_serving
        with pytest.raises(Unavailable, match="catching up"):
            await client.claim(key, "worker-b", lease_seconds=60)


async def test_catch_up_stays_owed_across_restarts_after_a_client_write(tmp_path: Path) -> None:
    """us grants token 1 (eu sees it), loses its disk, restarts while eu is paused,
    takes an unfenced write, and restarts again (kill -9, then SIGTERM): it must
    still refuse to grant. Before the fix the second restart found a non-empty
    store, served claims, and granted token 1 to worker-b."""
    async with ProcessCluster(tmp_path, ["us", "eu"]) as cluster:
        us, eu = await cluster.start_all()
        await eventually(lambda: deciding(us.address), "us deciding claims")
        async with AsyncClient(us.address) as client:
            made = await client.remember("lattice", "backlog", "item-1", title="x", tags=TAGS)
            key = made.record.key
            first = await client.claim(key, "worker-a", lease_seconds=1)
        assert first.fencing_token == 1

        async def eu_has_the_grant() -> bool:
            async with AsyncClient(eu.address) as client:
                try:
                    return (await client.claim_status(key)).fence == 1
                except NotFound:
                    return False

        await eventually(eu_has_the_grant, "the grant replicated to eu")
        await cluster.kill("us")
        cluster.wipe("us")
        with paused(eu):
            us = await cluster.start("us")
            await assert_not_deciding(us.address, key)
            async with AsyncClient(us.address, timeout=5) as client:
                # Unfenced writes are taken meanwhile (by a non-home node's rule).
                await client.remember("lattice", "backlog", "item-1", title="again", tags=TAGS)
            await cluster.kill("us")
            us = await cluster.start("us")
            await assert_not_deciding(us.address, key)
            await cluster.stop("us")
            us = await cluster.start("us")
            await assert_not_deciding(us.address, key)

        await eventually(lambda: deciding(us.address), "us deciding after catching up", within=30)
        async with AsyncClient(us.address) as client:
            second = await client.claim(key, "worker-b", lease_seconds=60)
            assert second.granted
            # Past the gap: no token the lost disk may have granted comes again.
            assert second.fencing_token > 1 + RECOVERY_GAP
            with pytest.raises(ClaimConflict) as refused:
                await client.update(key, fields={"body": "a"}, fencing_token=1)
            assert refused.value.reason == "superseded"


async def test_a_restart_in_the_middle_of_catch_up_leaves_it_owed(tmp_path: Path) -> None:
    """Three regions: us grants token 2 while eu and ap are paused (it never
    replicates), loses its disk, catches up from eu while ap hangs, is killed in
    that window and restarted. Before the fix it then granted token 2 again and
    admitted the old holder's write.

    Token 2's lease is short: us's eager push of it may already sit in the paused
    peers' sockets, to be merged when they wake (the kernel takes it while they
    sleep). Either way its lease is over when us decides again, and the new grant
    is above it."""
    async with ProcessCluster(tmp_path, ["us", "eu", "ap"]) as cluster:
        us, eu, ap = await cluster.start_all()
        await eventually(lambda: deciding(us.address), "us deciding claims")
        async with AsyncClient(us.address) as client:
            made = await client.remember("lattice", "backlog", "item-2", title="x", tags=TAGS)
            key = made.record.key
            first = await client.claim(key, "worker-a", lease_seconds=60)
            await client.release_claim(key, first.fencing_token)

        async def replicated(address: str) -> bool:
            # The grant and its release: a release on us's disk alone is lost with
            # it, and token 1's 60 s lease would then be live when us decides again.
            async with AsyncClient(address) as client:
                try:
                    status = await client.claim_status(key)
                except NotFound:
                    return False
                return status.fence == 1 and status.claim is None

        await eventually(lambda: replicated(eu.address), "token 1 and its release at eu")
        await eventually(lambda: replicated(ap.address), "token 1 and its release at ap")
        with paused(eu, ap):
            async with AsyncClient(us.address) as client:
                lost = await client.claim(key, "worker-b", lease_seconds=2)
            assert lost.fencing_token == 2  # on us's disk (and maybe in the peers' sockets)
            await cluster.kill("us")
        cluster.wipe("us")

        with paused(ap):
            us = await cluster.start("us")
            await eventually(lambda: replicated(us.address), "us pulled token 1 from eu")
            await assert_not_deciding(us.address, key)
            await cluster.kill("us")
            us = await cluster.start("us")
            await assert_not_deciding(us.address, key)

        await eventually(lambda: deciding(us.address), "us deciding after catching up", within=30)
        async with AsyncClient(us.address) as client:
            again = await client.claim(key, "worker-c", lease_seconds=60)
            assert again.granted and again.fencing_token > 2
            with pytest.raises(ClaimConflict) as refused:
                await client.update(key, fields={"body": "b"}, fencing_token=2)
            assert refused.value.reason == "superseded"


async def test_a_node_that_loses_its_disk_twice_never_grants_its_first_recoverys_token_again(
    tmp_path: Path,
) -> None:
    """Found by the 30-minute chaos run: eu recovered from a disk loss, granted token
    1048577 (the fence it learnt, 0, plus the recovery gap), lost its disk again
    before that grant left it, recovered, and granted 1048577 again to another
    worker: a gap counted from what the peers know lands on the same token every
    time. The floor now also rises with the recovery's time."""
    async with Cluster(tmp_path, ["us", "eu"]) as cluster:
        us, eu = await cluster.start_all()
        await all_deciding(us, eu)
        async with AsyncClient(us.address) as client:
            made = await client.remember("lattice", "backlog", "twice", title="x", tags=TAGS)
            key = made.record.key
            first = await client.claim(key, "worker-a", lease_seconds=60)
            await client.release_claim(key, first.fencing_token)
        await wait_converged([us, eu])

        for loss in range(2):  # lose us's disk, catch up from eu
            await cluster.stop("us")
            cluster.wipe("us")
            us = await cluster.start("us")
            await all_deciding(us)
            if loss == 0:
                await cluster.stop("eu")  # the next grant never leaves us's disk
                async with AsyncClient(us.address) as client:
                    lost = await client.claim(key, "worker-b", lease_seconds=60)
                assert lost.fencing_token > first.fencing_token + RECOVERY_GAP
                eu = await cluster.start("eu")
        async with AsyncClient(us.address) as client:
            again = await client.claim(key, "worker-c", lease_seconds=60)
            assert again.granted and again.fencing_token > lost.fencing_token
            with pytest.raises(ClaimConflict) as refused:
                await client.update(key, fields={"body": "b"}, fencing_token=lost.fencing_token)
            assert refused.value.reason == "superseded"

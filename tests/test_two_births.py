"""One id created in two regions during a partition (issue 13, hole 2; SPEC §2).

Before the fix the replicas kept two homes forever, both regions granted token 1
to different owners and admitted both owners' fenced writes, and replication
re-fetched the refused state about 40 times a second. Now the earliest birth is
the home on every replica, the surviving home moves its fence past every token
either side issued, and nothing is fetched in a loop.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from fencemark.client import AsyncClient, ClaimConflict, tls_credentials
from fencemark.node.api.server import NodeServer
from fencemark.node.crdt import Grant
from fencemark.node.rules.admission import token_ceiling
from fencemark.node.security.tls import TlsFiles, init_dir
from tests.cluster import Cluster, all_deciding, eventually, wait_converged

pytestmark = pytest.mark.slow


async def rounds_pass(node: NodeServer, count: int) -> None:
    """Wait until ``node`` has run ``count`` more anti-entropy rounds."""
    target = node.replicator.rounds + count

    async def done() -> bool:
        return node.replicator.rounds >= target

    await eventually(done, f"{count} anti-entropy rounds at {node.config.region}", within=30)


@pytest.mark.parametrize("first", ["us", "eu"], ids=["home-claims-first", "home-claims-last"])
async def test_an_id_born_on_both_sides_of_a_split_gets_one_home_and_no_two_holders(
    tmp_path: Path, first: str
) -> None:
    """Both sides grant token 1; the two grants merge into one entry, the later one
    (regression, found by the chaos tier: when that was the home's own grant, made
    after the other birth by the clock, the fence did not move, and the home took
    token 1 from both owners)."""
    async with Cluster(tmp_path, ["us", "eu", "ap"]) as cluster:
        await all_deciding(*await cluster.start_all())
        await cluster.stop("us")
        await cluster.stop("eu")
        # The split: us and eu each alone (ap reaches neither).
        us = await cluster.start_isolated("us")
        eu = await cluster.start_isolated("eu")
        async with AsyncClient(us.address) as at_us, AsyncClient(eu.address) as at_eu:
            made = await at_us.remember("lattice", "backlog", "split-1", title="from us")
            key = made.record.key
            await at_eu.remember("lattice", "backlog", "split-1", title="from eu")
            if first == "us":
                held_us = await at_us.claim(key, "worker-us", lease_seconds=60)
                held_eu = await at_eu.claim(key, "worker-eu", lease_seconds=60)
            else:
                held_eu = await at_eu.claim(key, "worker-eu", lease_seconds=60)
                held_us = await at_us.claim(key, "worker-us", lease_seconds=60)
            assert held_us.fencing_token == held_eu.fencing_token == 1  # two homes, apart
            await at_us.update(key, fields={"body": "us work"}, fencing_token=1)
            await at_eu.update(key, fields={"body": "eu work"}, fencing_token=1)

        await cluster.stop("us")
        await cluster.stop("eu")
        us, eu = await cluster.start_all(["us", "eu"])  # the heal
        nodes = [us, eu, cluster["ap"]]
        await wait_converged(nodes, within=30)
        await all_deciding(us, eu)  # restarted: each compared states with its peers

        for node in nodes:
            stored = await node.storage.get(key)
            assert stored is not None
            assert stored.record.home_region == "us"  # the earlier birth, everywhere
            assert set(stored.record.births) == {"us", "eu"}
            # The surviving home moved its fence past both sides' token 1.
            assert stored.record.fence.fence == 2 and stored.record.fence.holder() is None

        async with AsyncClient(us.address) as at_us, AsyncClient(eu.address) as at_eu:
            status = await at_us.claim_status(key)
            assert status.claim is None and status.fence == 2
            with pytest.raises(ClaimConflict) as refused:
                await at_us.update(key, fields={"body": "late us"}, fencing_token=1)
            assert refused.value.reason == "superseded"
            with pytest.raises(ClaimConflict) as elsewhere:
                await at_eu.update(key, fields={"body": "late eu"}, fencing_token=1)
            assert elsewhere.value.reason == "wrong_region"
            renewal = await at_eu.renew_claim(key, 1)
            assert not renewal.renewed and renewal.reason == "wrong_region"
            # The home says what it did, and when, in the record's history.
            moved = [e for e in (await at_us.history(key)).events if e.kind == "moved"]
            assert [(e.fencing_token, e.detail) for e in moved] == [(2, "births eu us")]
            again = await at_us.claim(key, "worker-next", lease_seconds=60)
            # The heal restarted us: its grant starts this life's era of tokens.
            assert again.granted and again.fencing_token == token_ceiling(us.replica.gate.life_hlc)

        # Nothing refused, so nothing to fetch again and again.
        await rounds_pass(us, 5)
        for node in nodes:
            for region in node.config.peers:
                stats = node.replicator.peer_stats(region)
                assert stats.merges_refused == 0, stats.last_refusal


async def test_a_claim_the_home_grants_after_the_births_met_through_a_third_region_lives(
    tmp_path: Path,
) -> None:
    """A bridge: us and ap cannot reach each other, eu reaches both. The births meet
    at us through eu before the bridge heals; us's claim granted after that is an
    ordinary claim, above the moved fence, and its history shows the move first
    (regression: the chaos tier's checker took it for a split-time claim that must
    end, as it had nothing on the wire to tell the two apart)."""
    async with Cluster(tmp_path, ["us", "eu", "ap"]) as cluster:
        await all_deciding(*await cluster.start_all())
        for region in cluster.regions:
            await cluster.stop(region)
        us = await cluster.start_isolated("us")
        ap = await cluster.start_isolated("ap")
        async with AsyncClient(us.address) as at_us, AsyncClient(ap.address) as at_ap:
            made = await at_us.remember("lattice", "backlog", "bridged", title="from us")
            key = made.record.key
            await at_ap.remember("lattice", "backlog", "bridged", title="from ap")
            held_ap = await at_ap.claim(key, "worker-ap", lease_seconds=60)
            assert held_ap.granted
        await cluster.stop("us")
        await cluster.stop("ap")
        eu_only = {"eu": cluster.addresses["eu"]}
        us, ap, eu = await asyncio.gather(
            cluster.start("us", peers=eu_only),
            cluster.start("ap", peers=eu_only),
            cluster.start("eu"),
        )
        await all_deciding(us, ap, eu)

        async def met_at_us() -> bool:
            stored = await us.storage.get(key)
            return stored is not None and stored.record.fence.moved > held_ap.fencing_token

        await eventually(met_at_us, "the births met at us, through eu")
        async with AsyncClient(us.address) as at_us, AsyncClient(ap.address) as at_ap:
            held_us = await at_us.claim(key, "worker-us", lease_seconds=60)
            assert held_us.granted and held_us.fencing_token > held_ap.fencing_token
            events = [(e.kind, e.fencing_token) for e in (await at_us.history(key)).events]
            moved = next(token for kind, token in events if kind == "moved")
            assert events.index(("moved", moved)) < events.index(("granted", held_us.fencing_token))
            assert moved > held_ap.fencing_token and held_us.fencing_token > moved

            async def refused_at_ap() -> bool:
                renewal = await at_ap.renew_claim(key, held_ap.fencing_token)
                assert not renewal.renewed, "ap's split-time claim outlived the meeting"
                return renewal.reason == "wrong_region"

            await eventually(refused_at_ap, "ap's holder refused once ap merged us's birth")
            with pytest.raises(ClaimConflict) as refused:
                await at_us.update(key, fields={"body": "ap"}, fencing_token=held_ap.fencing_token)
            assert refused.value.reason == "superseded"
            # us's holder is not superseded by anything: it writes, renews and releases.
            await at_us.update(key, fields={"body": "us"}, fencing_token=held_us.fencing_token)
            assert (await at_us.renew_claim(key, held_us.fencing_token, lease_seconds=60)).renewed
            status = await at_us.claim_status(key)
            assert status.claim is not None and status.fence == held_us.fencing_token
            assert (await at_us.release_claim(key, held_us.fencing_token)).released


async def test_a_refused_state_is_not_fetched_again_and_again(tmp_path: Path) -> None:
    """A state a peer holds and this node refuses is fetched, counted by reason, and
    then left alone while the peer still holds it — before the fix it was fetched
    again in every round, and a round that fetched anything was followed at once by
    the next (about 40 a second). Here eu accepts token jumps that us refuses;
    ap keeps us's rounds going."""
    async with Cluster(tmp_path, ["us", "eu", "ap"]) as cluster:
        us, eu, ap = await asyncio.gather(
            cluster.start("us"), cluster.start("eu", max_token_jump=1 << 40), cluster.start("ap")
        )
        await all_deciding(us, eu, ap)
        async with AsyncClient(eu.address) as client:
            made = await client.remember("lattice", "backlog", "jumpy", title="x")
            key = made.record.key
        await wait_converged([us, eu, ap])
        stored = await eu.storage.get(key)
        assert stored is not None
        record, clock = stored.record, eu.replica.clock
        hlc = clock.now()
        beyond = token_ceiling(hlc) + (1 << 30)  # past the ceiling of its own time
        jump = record.fence.grant(beyond, Grant(hlc, "w", "eu"), clock.wall_ms() + 60_000)
        await eu.replica.merge(record.with_fence(jump))  # as a hostile eu could hold it
        stats = us.replicator.peer_stats("eu")

        async def refused_once() -> bool:
            return stats.merge_refusals["token_jump"] >= 1

        await eventually(refused_once, "us refusing eu's state")
        await rounds_pass(us, 12)
        assert stats.merge_refusals["token_jump"] <= 2, stats.merge_refusals
        assert stats.refused[key][0] == "token_jump"
        assert stats.merges_refused == sum(stats.merge_refusals.values())


async def test_a_merge_that_leaves_the_sender_behind_is_pushed_like_a_write(
    tmp_path: Path,
) -> None:
    """Regression (30-minute chaos run, seed 3838938735): a home whose split-time holder
    kept writing never pulled the other birth — anti-entropy fetches a state only when
    its largest HLC is not below ours, and the holder's writes kept ours ahead — so
    the fence never moved and the split-time token stayed live. A node that merges a
    state and holds more than it now pushes the join, as it pushes a write; one that
    merely takes the sender's state pushes nothing."""
    async with Cluster(tmp_path, ["us", "eu"], anti_entropy_interval=3600) as cluster:
        us, eu = await cluster.start_all()
        await all_deciding(us, eu)
        async with AsyncClient(us.address) as client:
            key = (await client.remember("lattice", "backlog", "behind", title="x")).record.key
        await wait_converged([us, eu])
        stored = await eu.storage.get(key)
        assert stored is not None
        older = stored.record
        async with AsyncClient(us.address) as client:
            await client.update(key, fields={"body": "only us has this"})
        pushed: list[str] = []
        us.replica.on_local_write(pushed.append)
        await us.replica.merge(older)  # eu's copy: behind ours
        assert pushed == [key]
        latest = await us.storage.get(key)
        assert latest is not None
        pushed.clear()
        await us.replica.merge(latest.record)  # ours already: nothing to share
        assert pushed == []


@pytest.mark.parametrize(
    "first",
    [
        "us",
        "eu",
    ],
    ids=["home-claims-first", "home-claims-last"],
)
async def test_an_id_born_on_both_sides_of_a_split_meets_under_tls(
    tmp_path: Path, first: str
) -> None:
    """Regression, found by the chaos tier once it ran mutual TLS (seed 424242,
    split-000-0): both sides grant token 1 and write under it, each write signed by
    its own node. The join keeps one grant of token 1, the later one; when that was
    the home's, the home held the other side's writes at epoch 1 to the signers
    allowed for that epoch — the home and the region of the grant kept, both itself
    — and refused the whole state ``signer_not_home``. So the home never learnt the
    other birth, never moved its fence, and kept admitting its split-time holder
    under token 1 until that claim ended (SPEC §2: the surviving home moves its
    fence past every token either side issued). While the fence is such a claim,
    every birth region may have written under it (``integrity.check``)."""
    certs = tmp_path / "certs"
    regions = ["us", "eu", "ap"]
    init_dir(certs, regions=regions, clients=["alice"])
    tls = {region: TlsFiles.in_dir(certs, region) for region in regions}
    alice = tls_credentials(certs, "alice")
    async with Cluster(tmp_path / "cluster", regions) as cluster:
        await all_deciding(*[await cluster.start(r, tls=tls[r]) for r in regions])
        await cluster.stop("us")
        await cluster.stop("eu")
        us = await cluster.start_isolated("us", tls=tls["us"])  # the split, as above
        eu = await cluster.start_isolated("eu", tls=tls["eu"])
        async with (
            AsyncClient(us.address, credentials=alice) as at_us,
            AsyncClient(eu.address, credentials=alice) as at_eu,
        ):
            made = await at_us.remember("lattice", "backlog", "split-1", title="from us")
            key = made.record.key
            await at_eu.remember("lattice", "backlog", "split-1", title="from eu")
            sides = [(at_us, "worker-us"), (at_eu, "worker-eu")]
            for client, owner in sides if first == "us" else sides[::-1]:
                held = await client.claim(key, owner, lease_seconds=60)
                assert held.fencing_token == 1
                await client.update(key, fields={owner: "work"}, fencing_token=1)

        await cluster.stop("us")
        await cluster.stop("eu")
        us = await cluster.start("us", tls=tls["us"])  # the heal
        eu = await cluster.start("eu", tls=tls["eu"])
        nodes = [us, eu, cluster["ap"]]
        await wait_converged(nodes, within=20)
        for node in nodes:
            stored = await node.storage.get(key)
            assert stored is not None
            assert stored.record.home_region == "us" and set(stored.record.births) == {"us", "eu"}
            assert stored.record.fence.fence == 2 and stored.record.fence.holder() is None
            for region in node.config.peers:
                stats = node.replicator.peer_stats(region)
                assert stats.merges_refused == 0, stats.last_refusal

"""SPEC §3-§5 across regions: replicas converge, repair, stay cheap in sync, and keep the rules.

In-process nodes (``tests.cluster.Cluster``) wired to each other on loopback;
the tests look inside a node only to compare what it stores (canonical bytes,
digest tree) and to drive one anti-entropy round by hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fencemark.client import AsyncClient, ClaimConflict, NotFound, Unavailable, WrongRegion
from fencemark.node.api.server import CLAIMS_SERVICE, NodeServer
from fencemark.node.crdt import Record, Stamp, codec
from fencemark.node.crdt.hlc import pack, wall_clock_ms
from fencemark.node.replication.peers import PeerStats
from fencemark.node.replication.replicator import Replicator
from fencemark.node.replication.rounds import RoundResult
from fencemark.node.replication.tuning import Tuning
from fencemark.node.rules.admission import RECOVERY_GAP
from fencemark.node.rules.errors import ClockSkewed
from fencemark.node.store.digest_tree import bucket_of
from fencemark.node.tools.proxy import FaultProxy, ProxyMesh
from fencemark.v1 import node_pb2, node_pb2_grpc, replication_pb2, replication_pb2_grpc
from tests.cluster import Cluster, assert_identical, digests_of, eventually, wait_converged

REPO = "repl"
LONG_LEASE = 60.0


def key_of(topic: str, id_: str) -> str:
    return f"repo/{REPO}/mem/{topic}/{id_}"


async def all_serving(cluster: Cluster) -> None:
    """Wait until every running node has finished its start-up pass and grants claims."""

    async def serving() -> bool:
        return all(node.claims.deciding for node in cluster.running())

    await eventually(serving, "every node serving claims", within=20)


async def info(node: NodeServer) -> node_pb2.InfoResponse:
    """Node.Info over the wire, with a raw stub (every PeerInfo field, whatever the client has)."""
    async with grpc.aio.insecure_channel(node.address) as channel:
        response = await node_pb2_grpc.NodeStub(channel).Info(node_pb2.InfoRequest(), timeout=10)
    assert isinstance(response, node_pb2.InfoResponse)
    return response


async def peer_info(node: NodeServer, region: str) -> node_pb2.PeerInfo:
    peers = {p.region: p for p in (await info(node)).peers}
    return peers[region]


async def visible_everywhere(nodes: Iterable[NodeServer], key: str, digest: bytes) -> bool:
    for node in nodes:
        stored = await node.storage.get(key)
        if stored is None or stored.digest != digest:
            return False
    return True


def error_info(error: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo:
    """The ``google.rpc.ErrorInfo`` a refusal carries in its status details."""
    trailers = cast(Iterable[tuple[str, str | bytes]], error.trailing_metadata() or ())
    details = [value for name, value in trailers if name == "grpc-status-details-bin"]
    assert len(details) == 1 and isinstance(details[0], bytes), trailers
    status = status_pb2.Status.FromString(details[0])
    infos = [d for d in status.details if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR)]
    assert len(infos) == 1, status
    found = error_details_pb2.ErrorInfo()
    infos[0].Unpack(found)
    return found


async def one_round(node: NodeServer, region: str) -> tuple[RoundResult, int, int]:
    """Run one anti-entropy round from ``node`` with ``region``; returns it and its bytes.

    Retried while the peer's channel is still reconnecting (a round that fails
    at its first call transfers nothing).
    """
    replicator: Replicator = node.replicator
    stats = replicator.peer_stats(region)
    deadline = time.monotonic() + 15
    while True:
        sent, received = stats.bytes_sent, stats.bytes_received
        try:
            result = await replicator.sync_with(region)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)
            continue
        return result, stats.bytes_sent - sent, stats.bytes_received - received


async def cheapest_round(node: NodeServer, region: str) -> tuple[RoundResult, int, int]:
    """The fewest bytes of three rounds in a row, each way: a peer's counters also
    count the calls that peer makes to this node meanwhile (api/replication.py counts
    each request it receives), which can only add (a make test run once saw an
    in-sync round 'receive' 18 bytes more at 100 records than at 2,000)."""
    rounds = [await one_round(node, region) for _ in range(3)]
    return rounds[-1][0], min(r[1] for r in rounds), min(r[2] for r in rounds)


async def update_unless_gone(client: AsyncClient, key: str, fields: dict[str, str]) -> None:
    """An update racing a delete made elsewhere: NotFound if the tombstone won the race."""
    with contextlib.suppress(NotFound):
        await client.update(key, fields=fields)


# -- convergence -------------------------------------------------------------------------


async def test_writes_in_every_region_converge_to_byte_identical_records(tmp_path: Path) -> None:
    """SPEC §3/§5: whatever is written where, and concurrently, every replica ends identical.

    Each region creates, updates, retags and deletes its own records; then all
    three write the SAME record at once (fields, tags, a delete racing an
    update), create the same new key at once, and tombstone a key nobody has.
    """
    regions = ["us", "eu", "ap"]
    async with Cluster(tmp_path, regions) as cluster:
        await cluster.start_all()
        await all_serving(cluster)
        async with contextlib.AsyncExitStack() as stack:
            c = {
                r: await stack.enter_async_context(AsyncClient(cluster[r].address)) for r in regions
            }

            async def own_records(region: str) -> None:
                for i in range(6):
                    made = await c[region].remember(
                        REPO, "own", f"{region}-{i}", title=f"{region} {i}", tags=["new", "own"]
                    )
                    await c[region].update(
                        made.record.key,
                        fields={"body": f"body {i}", "extra": region},
                        add_tags=["seen"],
                        remove_tags=["new"],
                    )
                await c[region].delete(key_of("own", f"{region}-0"))

            await asyncio.gather(*(own_records(r) for r in regions))

            shared = (await c["us"].remember(REPO, "shared", "s", title="s", tags=["t0"])).record
            doomed = (await c["eu"].remember(REPO, "shared", "doomed", title="d")).record
            for record in (shared, doomed):
                arrived = functools.partial(
                    visible_everywhere, cluster.running(), record.key, record.digest
                )
                await eventually(arrived, f"{record.key} pushed everywhere")

            async def contend(region: str) -> None:
                for i in range(8):
                    await c[region].update(
                        shared.key,
                        fields={"body": f"{region}-{i}", f"by-{region}": str(i)},
                        add_tags=[f"{region}-{i}"],
                        remove_tags=["t0"],
                    )

            await asyncio.gather(
                *(contend(r) for r in regions),
                c["us"].delete(doomed.key),
                update_unless_gone(c["ap"], doomed.key, {"body": "updated meanwhile"}),
                *(c[r].remember(REPO, "born", "twin", body=f"born in {r}") for r in regions),
                c["ap"].delete(key_of("ghost", "never-seen")),
            )
            await wait_converged(cluster.running())

            # Same bytes everywhere, and the value the CRDT rules say.
            for region in regions:
                got = await c[region].get(shared.key)
                assert {got.fields[f"by-{r}"] for r in regions} == {"7"}
                assert got.body in {f"{r}-7" for r in regions}  # the last write of someone
                expected_tags = {f"{r}-{i}" for r in regions for i in range(8)} | {"homeRegion:us"}
                assert set(got.tags) == expected_tags, "t0 was removed after it was added"
                twin = await c[region].get(key_of("born", "twin"))
                assert twin.home_region in regions
                assert twin.body in {f"born in {r}" for r in regions}
            for node in cluster.running():
                gone = await node.storage.get(doomed.key)
                assert gone is not None and gone.record.is_deleted, "an update never undeletes"
            ghost = await cluster["us"].storage.get(key_of("ghost", "never-seen"))
            assert ghost is not None and ghost.record.is_deleted, "a tombstone replicates too"
            assert cluster["eu"].storage.record_count == 3 * 6 + 2 + 1 + 1


async def push_only_cluster(cluster: Cluster) -> dict[str, int]:
    """Start every node and let the start-up anti-entropy finish; returns the round counts.

    With an anti-entropy interval of an hour, nothing but eager push moves a
    later write while the test runs.
    """
    await cluster.start_all()
    await all_serving(cluster)
    # The start-up pass is followed by one more round; wait until rounds stop.
    rounds: dict[str, int] = {}
    while True:
        now = {node.config.region: node.replicator.rounds for node in cluster.running()}
        if now == rounds:
            return rounds
        rounds = now
        await asyncio.sleep(0.3)


def assert_no_round_since(cluster: Cluster, rounds: dict[str, int]) -> None:
    assert {n.config.region: n.replicator.rounds for n in cluster.running()} == rounds, (
        "an anti-entropy round ran: the push path was not tested alone"
    )


async def test_eager_push_alone_makes_a_write_visible_everywhere(tmp_path: Path) -> None:
    """SPEC §5: a write is pushed right after it is acknowledged, no anti-entropy needed."""
    async with Cluster(tmp_path, ["us", "eu", "ap"], anti_entropy_interval=3600) as cluster:
        rounds = await push_only_cluster(cluster)
        async with AsyncClient(cluster["us"].address) as us:
            made = (await us.remember(REPO, "push", "p1", title="pushed", tags=["x"])).record
            await eventually(
                lambda: visible_everywhere(cluster.running(), made.key, made.digest),
                "the new record pushed to eu and ap",
                within=10,
            )
            await asyncio.sleep(0.2)  # the push loop is idle again
            updated = await us.update(made.key, fields={"body": "and updated"})
            await eventually(
                lambda: visible_everywhere(cluster.running(), updated.key, updated.digest),
                "the update pushed to eu and ap",
                within=10,
            )
        assert_no_round_since(cluster, rounds)
        await assert_identical(cluster.running())
        for region in ("eu", "ap"):
            peer = await peer_info(cluster["us"], region)
            assert peer.records_sent >= 2 and peer.push_backlog == 0, peer


async def test_a_write_made_while_its_key_is_being_pushed_is_pushed_too(tmp_path: Path) -> None:
    """SPEC §5 regression: a key re-written while its previous state is in flight to a
    peer must be pushed again; the push worker used to drop it from the queue when
    the earlier push completed, leaving the peer stale until anti-entropy.

    Each record is updated right after it is created, while the creation is
    being pushed; every update must arrive by push alone.
    """
    async with Cluster(tmp_path, ["us", "eu"], anti_entropy_interval=3600) as cluster:
        rounds = await push_only_cluster(cluster)
        latest = []
        async with AsyncClient(cluster["us"].address) as us:
            for i in range(5):
                made = (await us.remember(REPO, "push", f"hot-{i}", title="hot")).record
                latest.append(await us.update(made.key, fields={"body": "updated at once"}))

        async def all_arrived() -> bool:
            for record in latest:
                if not await visible_everywhere(cluster.running(), record.key, record.digest):
                    return False
            return True

        async def stale() -> str:
            eu = cluster["eu"]
            missing = [r.key for r in latest if not await visible_everywhere([eu], r.key, r.digest)]
            backlog = cluster["us"].replicator.backlog("eu")
            return f"eu is stale on {missing}; us's push backlog for eu: {backlog}"

        await eventually(all_arrived, "every update pushed to eu", within=5, explain=stale)
        assert_no_round_since(cluster, rounds)


@pytest.mark.slow  # waits through settles and repairs (seconds)
async def test_anti_entropy_alone_repairs_a_node_that_was_down(tmp_path: Path) -> None:
    """SPEC §5: what a push missed, anti-entropy repairs.

    eu is down while us writes; us's calls to eu fail, and once they have for
    UNREACHABLE_AFTER_S seconds us drops its push queue for eu and queues
    nothing more for it; then us stops too. Restarted on their data, eu can only
    learn those writes from its own anti-entropy rounds.
    """
    async with Cluster(tmp_path, ["us", "eu", "ap"]) as cluster:
        await cluster.start_all()
        await all_serving(cluster)
        async with AsyncClient(cluster["us"].address) as us:
            before = await us.remember(REPO, "ae", "before", title="before")
        await eventually(
            lambda: visible_everywhere(cluster.running(), before.record.key, before.record.digest),
            "the first write everywhere",
        )
        await cluster.stop("eu")
        async with AsyncClient(cluster["us"].address) as us:
            for i in range(20):
                await us.remember(REPO, "ae", f"while-down-{i}", body=str(i), tags=["down"])
            await us.update(before.record.key, fields={"body": "changed while eu was down"})
            await us.delete(key_of("ae", "while-down-0"))

        async def given_up() -> bool:
            replicator = cluster["us"].replicator
            return replicator.unreachable("eu") and replicator.backlog("eu") == 0

        await eventually(given_up, "us dropping its push queue for eu", within=30)
        async with AsyncClient(cluster["us"].address) as us:
            await us.remember(REPO, "ae", "after-giving-up", body="queued for nobody")
        assert cluster["us"].replicator.backlog("eu") == 0
        await wait_converged([cluster["us"], cluster["ap"]])  # ap, which was up, has it all
        await cluster.stop("us")

        eu = await cluster.start("eu")
        await cluster.start("us")
        await wait_converged(cluster.running())
        stored = await eu.storage.get(before.record.key)
        assert stored is not None
        assert stored.record.field_values()["body"] == "changed while eu was down"
        assert eu.storage.record_count == 22
        assert eu.replicator.rounds > 0


async def test_a_peer_found_behind_is_left_to_pull_instead_of_compared_again(
    tmp_path: Path,
) -> None:
    """A round that differs but pulls nothing found a peer that is behind: every
    difference is the peer's to pull. This node leaves it alone for BEHIND_PAUSE_S
    instead of descending into it and listing the same differences every round.
    (Its heartbeat, a root-only call each second, still reaches it; switched off
    here, so that any byte sent is a round's.)"""
    quiet = Tuning(heartbeat_s=3600)
    async with Cluster(tmp_path, ["us", "eu"], replication=quiet) as cluster:
        us = await cluster.start("us", peers={})
        async with AsyncClient(us.address) as client:
            for i in range(20):
                await client.remember(REPO, "behind", f"b{i}", body="only at us")
        await cluster.stop("us")
        # eu knows no peer, so it never pulls: it stays behind for the whole test.
        await cluster.start("eu", peers={})
        us = await cluster.start("us")  # a fresh push queue: only rounds reach eu

        async def compared_once() -> bool:
            return us.replicator.peer_stats("eu").last_sync is not None

        await eventually(compared_once, "a first round with eu")
        sent = us.replicator.peer_stats("eu").bytes_sent
        await asyncio.sleep(2.0)  # ten intervals of 0.2 s
        stats = us.replicator.peer_stats("eu")
        assert stats.divergence == 20 and stats.reachable
        assert us.replicator.rounds == 1, "rounds with a peer that is behind went on"
        assert stats.bytes_sent == sent


async def test_a_round_stops_listing_once_the_differences_are_all_the_peers_to_pull(
    tmp_path: Path,
) -> None:
    """A large difference is listed a chunk at a time (the first chunk lowered to
    50 records here). When the first chunk's differences are all older at the peer,
    the round lists no more: nothing there is for this node, and the peer that is
    behind pulls in its own rounds."""
    async with Cluster(tmp_path, ["us", "eu"], anti_entropy_interval=3600) as cluster:
        us, eu = await cluster.start_all()
        # Both done with their catch-up: a node stopped before it has caught up is
        # still catching up when it restarts, and then pulls everything.
        await all_serving(cluster)
        keys = []
        async with AsyncClient(us.address) as client:
            for i in range(200):
                keys.append((await client.remember(REPO, "chunks", f"c{i}", body="v1")).record.key)
        await wait_converged([us, eu])
        await cluster.stop("eu")
        async with AsyncClient(us.address) as client:
            for key in keys:
                await client.update(key, fields={"body": "v2"})
        await cluster.stop("us")
        await cluster.start("eu", peers={})  # eu stays behind: it never pulls

        async def restart_us(**tuning: int) -> NodeServer:
            """us on its data with ``tuning`` (no push queue for eu), once the round
            its loop runs at start (the next in an hour) is done."""
            await cluster.stop("us")
            # Deciding at once: its rounds are a deciding node's, not a restart's
            # comparison with every peer (which takes everything that differs).
            us = await cluster.start(
                "us", replication=Tuning(**tuning, heartbeat_s=3600), start_wait_s=0
            )

            async def first_round_done() -> bool:
                return us.replicator.peer_stats("eu").last_sync is not None

            await eventually(first_round_done, "us's first round with eu")
            return us

        us = await restart_us(first_listing=50)
        result, _, received = await one_round(us, "eu")
        assert (result.pulled, result.truncated) == (0, True), result
        assert Tuning().behind_after <= result.divergence < 200, result
        us = await restart_us()  # the first listing of 1024 records holds all 200
        everything, _, received_all = await one_round(us, "eu")
        assert (everything.pulled, everything.divergence) == (0, 200), everything
        # The records it did not list are bytes it did not receive (~60 each).
        unlisted = everything.divergence - result.divergence
        assert received_all - received >= unlisted * 40, (received, received_all, result)


async def test_states_a_peer_fetched_are_not_pushed_to_it_again(tmp_path: Path) -> None:
    """After an outage a node's kept push queue and the peer's own round reach for
    the same states; what the peer fetched leaves the queue, so it travels once."""
    async with Cluster(tmp_path, ["us", "eu"], anti_entropy_interval=3600) as cluster:
        us = await cluster.start("us")  # eu is down: pushes to it fail and are kept
        async with AsyncClient(us.address) as client:
            keys = [
                (await client.remember(REPO, "queued", f"q{i}", body="b")).record.key
                for i in range(6)
            ]
        assert us.replicator.backlog("eu") == 6
        origin = replication_pb2.Origin(region="eu", node_id="n", hlc=pack(wall_clock_ms()))
        async with grpc.aio.insecure_channel(us.address) as channel:
            stub = replication_pb2_grpc.ReplicationStub(channel)
            found = await stub.Fetch(
                replication_pb2.FetchRequest(origin=origin, keys=keys[:4]), timeout=10
            )
        assert len(found.states) == 4

        async def two_left() -> bool:  # once a push attempt woken by the call has failed
            return us.replicator.backlog("eu") == 2

        await eventually(two_left, "only the two keys eu did not fetch queued for it")


async def test_a_peer_that_missed_many_writes_pulls_them_instead_of_a_kept_queue(
    tmp_path: Path,
) -> None:
    """A failed push keeps a short blip's few keys queued for the peer; more than
    ``kept_push_limit`` are dropped, and the peer pulls them in its own rounds once
    back — pushing them as well would deliver them twice."""
    small = Tuning(kept_push_limit=4)
    async with Cluster(tmp_path, ["us", "eu"], replication=small) as cluster:
        us = await cluster.start("us")  # eu is down: pushes to it fail
        async with AsyncClient(us.address) as client:
            first = (await client.remember(REPO, "missed", "m0", body="b")).record.key
            stats = us.replicator.peer_stats("eu")

            async def kept() -> bool:  # a blip's write, put back after the failed push
                return stats.failures >= 1 and us.replicator.backlog("eu") == 1

            await eventually(kept, "a push to eu failing and its key kept")
            keys = [first]
            for i in range(1, 8):
                keys.append((await client.remember(REPO, "missed", f"m{i}", body="b")).record.key)

        link = us.replicator._peers["eu"]

        async def dropped() -> bool:  # at the next failed push: more than 4 queued
            return us.replicator.backlog("eu") == 0 and not link.pushing  # none in flight

        await eventually(dropped, "the queue for eu dropped", every=0.01)
        # ... for its length, not because eu counts as gone (5 s of failures).
        assert not us.replicator.unreachable("eu")
        eu = await cluster.start("eu")
        for key in keys:

            async def pulled(key: str = key) -> bool:
                return await eu.storage.get(key) is not None

            await eventually(pulled, f"eu pulling {key}")


async def test_a_stale_state_is_answered_to_its_sender_alone(tmp_path: Path) -> None:
    """A node merging a state older than its own changes nothing: the sender lacks
    what it holds and gets it pushed back at once — the peers it was in step with
    get nothing (after a partition they would receive every repaired state again)."""
    async with Cluster(tmp_path, ["us", "eu", "ap"], anti_entropy_interval=3600) as cluster:
        us, eu, ap = await cluster.start_all()
        await all_serving(cluster)
        async with AsyncClient(us.address) as client:
            key = (await client.remember(REPO, "stale", "s", body="v1")).record.key
            await wait_converged([us, eu, ap])
            old = await us.storage.states([key])
            await client.remember(REPO, "stale", "s", body="v2")
        await wait_converged([us, eu, ap])
        to_us, to_ap = eu.replicator.peer_stats("us"), eu.replicator.peer_stats("ap")
        sent_to_us, sent_to_ap = to_us.records_sent, to_ap.records_sent
        origin = replication_pb2.Origin(region="ap", node_id="n", hlc=pack(wall_clock_ms()))
        async with grpc.aio.insecure_channel(eu.address) as channel:
            stub = replication_pb2_grpc.ReplicationStub(channel)
            pushed = await stub.Push(
                replication_pb2.PushRequest(origin=origin, states=[old[key]]), timeout=10
            )
        assert (pushed.merged, pushed.unchanged) == (0, 1)

        async def answered() -> bool:
            return to_ap.records_sent == sent_to_ap + 1

        await eventually(answered, "eu pushing its newer state back to the sender")
        await asyncio.sleep(0.3)  # a push to us would have gone out with it
        assert to_us.records_sent == sent_to_us
        assert eu.replicator.backlog("us") == 0


@pytest.mark.slow  # waits through settles and repairs (seconds)
async def test_in_sync_rounds_cost_constant_bytes_and_repairs_move_only_the_differences(
    tmp_path: Path,
) -> None:
    """SPEC §5: agreeing replicas exchange one root hash; differing ones only what differs.

    The bytes of an in-sync round are the same at 100 and at 2000 records. Then
    us, cut off from eu (restarted without peers, so it pushes nothing), writes
    K records; one round started by eu pulls exactly those K. A difference of
    more records than a round may list (lowered to 200 here) takes several
    bounded rounds.
    """
    async with Cluster(
        tmp_path, ["us", "eu"], anti_entropy_interval=3600, replication=Tuning(heartbeat_s=3600)
    ) as cluster:
        us, eu = await cluster.start_all()
        await all_serving(cluster)

        async def fill(client: AsyncClient, start: int, stop: int) -> None:
            async def one(i: int) -> None:
                await client.remember(REPO, "bulk", f"r{i:05d}", body=f"record {i}", tags=["b"])

            for batch in range(start, stop, 100):
                await asyncio.gather(*(one(i) for i in range(batch, min(batch + 100, stop))))

        async with AsyncClient(us.address) as client:
            await fill(client, 0, 100)
            await wait_converged([us, eu])
            small, small_sent, small_received = await cheapest_round(eu, "us")
            await fill(client, 100, 2000)
            await wait_converged([us, eu], within=30)
            large, large_sent, large_received = await cheapest_round(eu, "us")
        assert small.in_sync and large.in_sync
        assert eu.storage.record_count == 2000
        assert (small_sent, small_received) == (large_sent, large_received), (
            f"an in-sync round cost {small_sent}+{small_received} bytes at 100 records"
            f" and {large_sent}+{large_received} at 2000"
        )
        assert small_sent + small_received < 200

        # Divergence: us writes K records (3 new, 4 updates) while cut off from eu.
        await cluster.stop("us")
        us = await cluster.start("us", peers={})
        async with AsyncClient(us.address) as client:
            for i in range(3):
                await client.remember(REPO, "bulk", f"new{i}", body="written while cut off")
            for i in range(4):
                await client.update(key_of("bulk", f"r{i * 300:05d}"), fields={"body": "changed"})
        k = 7
        states = await us.storage.states(list(await digests_of(us)))
        store_bytes = sum(len(state) for state in states.values())
        received_before = eu.replicator.peer_stats("us").records_received

        repair, sent, received = await one_round(eu, "us")
        assert not repair.in_sync
        assert (repair.pulled, repair.divergence) == (k, k), repair
        assert eu.replicator.peer_stats("us").records_received - received_before == k
        assert sent + received < store_bytes / 20, (
            f"repairing {k} records moved {sent + received} bytes of a {store_bytes}-byte store"
        )
        again, _, _ = await one_round(eu, "us")
        assert again.in_sync
        await assert_identical([us, eu])

        # A large difference is repaired by several bounded rounds, not one huge one.
        big, bound = 600, 200
        await cluster.stop("eu")
        bounded = Tuning(max_round_records=bound, heartbeat_s=3600)
        eu = await cluster.start("eu", replication=bounded, start_wait_s=0)

        async def eu_compared() -> bool:  # its loop's round at start; the next in an hour
            return eu.replicator.peer_stats("us").last_sync is not None

        await eventually(eu_compared, "eu's first round with us")
        async with AsyncClient(us.address) as client:
            await fill(client, 2000, 2000 + big)
        pulled = []
        while True:
            result, _, _ = await one_round(eu, "us")
            if result.in_sync:
                break
            assert result.pulled <= bound, f"one round pulled {result.pulled} of {big}"
            pulled.append(result.pulled)
            assert len(pulled) < 50, f"no convergence after rounds pulling {pulled}"
        assert sum(pulled) == big and len(pulled) >= 3, pulled
        await assert_identical([us, eu])

        # Rounds only pull, and not what is behind: us, ahead again, fetches none of
        # eu's older states; eu's round takes us's newer ones, each exactly once.
        await cluster.stop("us")
        us = await cluster.start("us", peers={})
        async with AsyncClient(us.address) as client:
            for i in range(5):
                await client.update(key_of("bulk", f"r{i * 7:05d}"), fields={"body": "ahead"})
        await cluster.stop("us")
        us = await cluster.start("us", start_wait_s=0)  # a deciding node's round, as above
        ahead, _, _ = await one_round(us, "eu")
        assert (ahead.in_sync, ahead.pulled, ahead.divergence) == (False, 0, 5), ahead
        behind, _, _ = await one_round(eu, "us")
        assert (behind.pulled, behind.divergence) == (5, 5), behind
        assert (await one_round(us, "eu"))[0].in_sync
        await assert_identical([us, eu])


# -- clock safety ---------------------------------------------------------------------------


def push_request(region: str, hlc: int, *states: bytes) -> replication_pb2.PushRequest:
    origin = replication_pb2.Origin(region=region, node_id="test-node", hlc=hlc)
    return replication_pb2.PushRequest(origin=origin, states=list(states))


async def test_tree_and_buckets_answer_by_subtree_and_refuse_what_they_cannot(
    tmp_path: Path,
) -> None:
    """The wire contract of a descent: Tree answers for the children of the parents
    asked about (4-byte check values salted by the request, and record counts; the
    root alone: its 16-byte hash, no count); Buckets lists every record below
    inner nodes as well as leaf buckets. Requests beyond the limits are
    INVALID_ARGUMENT naming the field."""
    async with Cluster(tmp_path, ["us", "eu"]) as cluster:
        us = await cluster.start("us", peers={})
        async with AsyncClient(us.address) as client:
            for i in range(30):
                await client.remember(REPO, "tree", f"t{i:02d}", body="b")
        tree = us.storage.tree
        origin = replication_pb2.Origin(region="eu", node_id="n", hlc=pack(wall_clock_ms()))
        async with grpc.aio.insecure_channel(us.address) as channel:
            stub = replication_pb2_grpc.ReplicationStub(channel)
            root = await stub.Tree(replication_pb2.TreeRequest(origin=origin), timeout=10)
            assert (root.hashes, list(root.counts)) == (tree.root, [])

            salt = b"per-round"
            level2 = await stub.Tree(
                replication_pb2.TreeRequest(origin=origin, level=2, parents=[0, 15], salt=salt),
                timeout=10,
            )
            nodes = [*range(0, 16), *range(240, 256)]
            assert level2.hashes == tree.checks(2, nodes, salt) and len(level2.hashes) == 4 * 32
            assert list(level2.counts) == tree.counts(2, nodes)

            # Every record, listed through the 16 level-1 nodes, then one leaf bucket.
            listed = await stub.Buckets(
                replication_pb2.BucketsRequest(origin=origin, level=1, nodes=list(range(16))),
                timeout=10,
            )
            assert [e.key for e in listed.entries] == sorted(await digests_of(us))
            first = listed.entries[0]
            leaf = await stub.Buckets(
                replication_pb2.BucketsRequest(
                    origin=origin, level=4, nodes=[bucket_of(first.key)]
                ),
                timeout=10,
            )
            assert first in leaf.entries

            bad_trees = [
                (replication_pb2.TreeRequest(origin=origin, level=5, parents=[0]), "level"),
                (replication_pb2.TreeRequest(origin=origin, level=0, parents=[0]), "parents"),
                (replication_pb2.TreeRequest(origin=origin, level=2, parents=[16]), "parents"),
                (replication_pb2.TreeRequest(origin=origin, level=4, parents=[0] * 257), "parents"),
                (replication_pb2.TreeRequest(origin=origin, level=1, parents=[0]), "salt"),
                (
                    replication_pb2.TreeRequest(
                        origin=origin, level=1, parents=[0], salt=b"x" * 33
                    ),
                    "salt",
                ),
            ]
            bad_listings = [
                (replication_pb2.BucketsRequest(origin=origin, level=1, nodes=[16]), "nodes"),
                (replication_pb2.BucketsRequest(origin=origin, level=9, nodes=[0]), "level"),
                (replication_pb2.BucketsRequest(origin=origin, level=4, nodes=[0] * 1025), "nodes"),
            ]
            refusals = []
            for tree_request, field in bad_trees:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Tree(tree_request, timeout=10)
                refusals.append((refused.value, field))
            for listing, field in bad_listings:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Buckets(listing, timeout=10)
                refusals.append((refused.value, field))
            for error, field in refusals:
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
                assert field in (error.details() or ""), (field, error)


class MalformedPeer(replication_pb2_grpc.ReplicationServicer):
    """A peer whose every Tree reply is malformed: a root that differs from any
    real one, then hashes of the wrong length for the level below."""

    def __init__(self) -> None:
        self.calls = 0

    async def Tree(
        self, request: replication_pb2.TreeRequest, context: Any
    ) -> replication_pb2.TreeResponse:
        self.calls += 1
        width = 16 if request.level == 0 else 3
        return replication_pb2.TreeResponse(hashes=b"\xff" * width, counts=[1])


async def test_a_round_that_fails_unexpectedly_backs_off_and_rounds_go_on(tmp_path: Path) -> None:
    """An error no gRPC status describes (here a peer's malformed reply) ends that
    round, counts as the peer's failure with the reason, and later rounds still run."""
    server = grpc.aio.server()
    peer = MalformedPeer()  # type: ignore[abstract]  # a round calls only Tree here
    replication_pb2_grpc.add_ReplicationServicer_to_server(peer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with Cluster(tmp_path, ["us", "eu"]) as cluster:
            us = await cluster.start("us", peers={"eu": f"127.0.0.1:{port}"})

            async def failed_twice() -> bool:
                return peer.calls >= 4 and us.replicator.rounds >= 2

            await eventually(failed_twice, "two failed rounds", within=20)
            stats = us.replicator.peer_stats("eu")
            assert "malformed" in stats.last_error, stats.last_error
            assert not stats.reachable
    finally:
        await server.stop(None)


async def test_a_listing_of_more_records_than_allowed_is_refused(tmp_path: Path) -> None:
    """A Buckets request whose nodes hold more records than one reply may carry
    (16384; lowered to 10 here) is refused naming ``nodes``: a peer lists only
    small subtrees, and in requests its counts keep under half that."""
    async with Cluster(tmp_path, ["us", "eu"]) as cluster:
        us = await cluster.start("us", peers={}, max_list_records=10)
        async with AsyncClient(us.address) as client:
            for i in range(11):
                await client.remember(REPO, "many", f"m{i:02d}", body="b")
        origin = replication_pb2.Origin(region="eu", node_id="n", hlc=pack(wall_clock_ms()))
        async with grpc.aio.insecure_channel(us.address) as channel:
            stub = replication_pb2_grpc.ReplicationStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Buckets(
                    replication_pb2.BucketsRequest(origin=origin, level=0, nodes=[0]), timeout=10
                )
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "nodes" in (refused.value.details() or "")
            assert "11 records" in (refused.value.details() or "")


async def test_a_peer_clock_beyond_max_offset_is_refused_counted_and_nothing_merged(
    tmp_path: Path,
) -> None:
    """SPEC §3: a remote stamp > max_clock_offset ahead is not merged; the exchange is refused.

    Posing as the configured peer eu with a raw Replication stub: a Push whose
    origin clock is 10 s ahead, then one whose state's stamps are, then a Tree
    call from the future. Each is FAILED_PRECONDITION / CLOCK_SKEW, changes
    nothing, and counts in us's Info for eu.
    """
    async with Cluster(tmp_path, ["us", "eu"]) as cluster:
        us = await cluster.start("us")  # eu never starts: this test speaks for it
        async with AsyncClient(us.address) as client:
            made = await client.remember(REPO, "clock", "c", title="t", body="original")
        key = made.record.key
        stored = await us.storage.get(key)
        assert stored is not None
        ahead = pack(wall_clock_ms() + 10_000)
        future_state = codec.encode(
            stored.record.set_fields({"body": "from the future"}, Stamp(0, ahead, "future-node"))
        )
        fresh_key = key_of("clock", "fresh")
        fresh_state = codec.encode(
            Record(fresh_key)
            .create("eu", Stamp(0, pack(wall_clock_ms()), "test-node"))
            .set_fields({"body": "fine"}, Stamp(0, pack(wall_clock_ms()), "test-node"))
        )
        count = us.storage.record_count

        async with grpc.aio.insecure_channel(us.address) as channel:
            stub = replication_pb2_grpc.ReplicationStub(channel)
            refusals: list[grpc.aio.AioRpcError] = []
            calls: list[Any] = [
                lambda: stub.Push(push_request("eu", ahead, fresh_state), timeout=10),
                lambda: stub.Push(
                    push_request("eu", pack(wall_clock_ms()), future_state), timeout=10
                ),
                lambda: stub.Tree(
                    replication_pb2.TreeRequest(
                        origin=replication_pb2.Origin(region="eu", node_id="n", hlc=ahead),
                        level=0,
                    ),
                    timeout=10,
                ),
            ]
            for number, call in enumerate(calls, start=1):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call()
                refusals.append(refused.value)
                assert (await peer_info(us, "eu")).skew_alarms == number
            for refusal in refusals:
                assert refusal.code() == grpc.StatusCode.FAILED_PRECONDITION, refusal
                details = error_info(refusal)
                assert (details.reason, details.domain) == ("CLOCK_SKEW", "fencemark")
                assert details.metadata["region"] == "eu"
                assert int(details.metadata["ahead_ms"]) > 9_000
                assert details.metadata["max_offset_ms"] == "500"
            # Nothing of a refused exchange was merged, and the clock did not jump.
            assert us.storage.record_count == count
            after = await us.storage.get(key)
            assert after is not None and after.digest == stored.digest
            assert await us.storage.get(fresh_key) is None
            assert us.replica.clock.last < ahead

            # An unknown origin from the future is refused as well (and counted nowhere).
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await stub.Push(push_request("mars", ahead, fresh_state), timeout=10)
            assert error_info(unknown.value).reason == "CLOCK_SKEW"
            assert (await peer_info(us, "eu")).skew_alarms == len(calls)

            # The same states from a clock in range are merged.
            fine = await stub.Push(
                push_request("eu", pack(wall_clock_ms()), fresh_state), timeout=10
            )
            assert (fine.merged, fine.unchanged) == (1, 0)


async def test_merging_a_state_slightly_ahead_advances_the_local_clock(tmp_path: Path) -> None:
    """SPEC §3: receiving a state advances the HLC past its stamps: a later local write wins."""
    async with Cluster(tmp_path, ["us", "eu"]) as cluster:
        us = await cluster.start("us")
        async with AsyncClient(us.address) as client:
            made = await client.remember(REPO, "clock", "ahead", body="original")
            stored = await us.storage.get(made.record.key)
            assert stored is not None
            ahead = pack(wall_clock_ms() + 300)  # within max_clock_offset (500 ms)
            remote = stored.record.set_fields({"body": "remote"}, Stamp(0, ahead, "zz-remote"))
            async with grpc.aio.insecure_channel(us.address) as channel:
                stub = replication_pb2_grpc.ReplicationStub(channel)
                pushed = await stub.Push(
                    push_request("eu", pack(wall_clock_ms()), codec.encode(remote)), timeout=10
                )
            assert pushed.merged == 1
            assert us.replica.clock.last >= ahead
            assert (await client.get(made.record.key)).body == "remote"
            # At once, while the wall clock is still behind the merged stamp:
            local = await client.update(made.record.key, fields={"body": "local, later"})
        assert local.body == "local, later"
        after = await us.storage.get(made.record.key)
        assert after is not None
        assert after.record.fields["body"].stamp.hlc > ahead


async def test_a_node_with_a_fast_clock_is_refused_by_its_peers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SPEC §3 end to end: ap's wall clock runs 10 s fast; us merges nothing of ap's.

    us counts ap's refused pushes and rounds (skew_alarms in Info), ap counts
    the rounds us refused, a round us starts refuses ap's states, and us still
    replicates its own writes to ap.
    """
    from fencemark.node.api import assembly
    from fencemark.node.crdt import HybridClock

    def fast_clock(**kwargs: Any) -> HybridClock:
        return HybridClock(wall_ms=lambda: wall_clock_ms() + 10_000, **kwargs)

    async with Cluster(tmp_path, ["us", "ap"], anti_entropy_interval=0.1) as cluster:
        us = await cluster.start("us")
        with monkeypatch.context() as patch:
            patch.setattr(assembly, "HybridClock", fast_clock)
            ap = await cluster.start("ap")
        async with AsyncClient(ap.address) as at_ap, AsyncClient(us.address) as at_us:
            from_ap = (await at_ap.remember(REPO, "skew", "from-ap", body="ahead")).record
            from_us = (await at_us.remember(REPO, "skew", "from-us", body="behind")).record

            await eventually(
                lambda: visible_everywhere([ap], from_us.key, from_us.digest),
                "us's write reaching ap",
            )

            async def alarmed() -> bool:
                at_us_side = await peer_info(us, "ap")
                at_ap_side = await peer_info(ap, "us")
                return at_us_side.skew_alarms >= 2 and at_ap_side.skew_alarms >= 1

            await eventually(alarmed, "skew alarms on both sides")
        # us pulling from ap: the fetched state is from the future, the round is refused.
        with pytest.raises(ClockSkewed) as skewed:
            await one_round(us, "ap")
        assert (skewed.value.region, skewed.value.max_offset_ms) == ("ap", 500)
        assert skewed.value.ahead_ms > 5_000  # written 10 s ahead, a moment ago
        assert await us.storage.get(from_ap.key) is None, "us merged a state from the future"
        assert us.replica.clock.last < pack(wall_clock_ms() + 1_000), "us's clock jumped ahead"
        assert "FAILED_PRECONDITION" in (await peer_info(ap, "us")).last_error


# -- region scoping (SPEC §4) ---------------------------------------------------------------


async def test_claims_and_fenced_writes_are_decided_only_by_the_home_region(
    tmp_path: Path,
) -> None:
    """SPEC §4: at us, a record homed in eu answers wrong_region, naming eu."""
    async with Cluster(tmp_path, ["us", "eu"]) as cluster:
        us, eu = await cluster.start_all()
        await all_serving(cluster)
        async with AsyncClient(us.address) as at_us, AsyncClient(eu.address) as at_eu:
            made = (await at_eu.remember(REPO, "home", "h", title="homed in eu")).record
            assert made.home_region == "eu"
            await eventually(
                lambda: visible_everywhere([us], made.key, made.digest), "the record at us"
            )
            token = (
                await at_eu.claim(made.key, "worker-a", lease_seconds=LONG_LEASE)
            ).fencing_token
            await eventually(lambda: fence_seen(us, made.key, token), "the grant replicated to us")

            claim = await at_us.claim(made.key, "worker-b", lease_seconds=LONG_LEASE)
            assert (claim.granted, claim.reason, claim.home_region) == (False, "wrong_region", "eu")
            renew = await at_us.renew_claim(made.key, token)
            assert (renew.renewed, renew.reason, renew.home_region) == (False, "wrong_region", "eu")
            release = await at_us.release_claim(made.key, token)
            assert (release.released, release.reason, release.home_region) == (
                False,
                "wrong_region",
                "eu",
            )
            for fenced in (
                at_us.update(made.key, fields={"body": "x"}, fencing_token=token),
                at_us.delete(made.key, fencing_token=token),
                at_us.remember(REPO, "home", "h", body="x", fencing_token=token),
            ):
                with pytest.raises(ClaimConflict) as conflict:
                    await fenced
                assert (conflict.value.reason, conflict.value.home_region) == ("wrong_region", "eu")
            with pytest.raises(WrongRegion) as wrong:
                await at_us.remember(REPO, "home", "new", title="n", tags=["homeRegion:eu"])
            assert wrong.value.home_region == "eu"
            assert await us.storage.get(key_of("home", "new")) is None
            # The live claim is still eu's, untouched by all this.
            status = await at_eu.claim_status(made.key)
            assert status.claim is not None and status.claim.fencing_token == token


async def fence_seen(node: NodeServer, key: str, token: int, *, released: bool = False) -> bool:
    stored = await node.storage.get(key)
    if stored is None:
        return False
    fence = stored.record.fence
    return fence.fence == token and (token in fence.released) == released


async def test_unfenced_writes_elsewhere_respect_the_fence_they_know(tmp_path: Path) -> None:
    """SPEC §3/§4: an unfenced write at us is refused while us sees eu's live claim,
    admitted under the fence it knows once released, and loses to any write made
    under a newer token, whatever the clocks say.
    """
    async with Cluster(tmp_path, ["us", "eu"]) as cluster:
        us, eu = await cluster.start_all()
        await all_serving(cluster)
        async with AsyncClient(eu.address) as at_eu:
            made = (await at_eu.remember(REPO, "fence", "f", body="initial")).record
            t1 = (await at_eu.claim(made.key, "worker-a", lease_seconds=LONG_LEASE)).fencing_token
            await eventually(lambda: fence_seen(us, made.key, t1), "eu's claim seen at us")
            async with AsyncClient(us.address) as at_us:
                with pytest.raises(ClaimConflict) as conflict:
                    await at_us.update(made.key, fields={"body": "unfenced at us"})
                assert (conflict.value.reason, conflict.value.fence) == ("claimed", t1)
                assert (await at_eu.release_claim(made.key, t1)).released
                await eventually(
                    lambda: fence_seen(us, made.key, t1, released=True), "the release seen at us"
                )
                await at_us.update(made.key, fields={"body": "unfenced at us"})
            admitted = await us.storage.get(made.key)
            assert admitted is not None
            assert admitted.record.fields["body"].stamp.epoch == t1, "stamped with us's fence"

            # Partition: us is cut off (new port, no peers); eu grants t2 and writes under it.
            await cluster.stop("us")
            us = await cluster.start_isolated("us")
            t2 = (await at_eu.claim(made.key, "worker-b", lease_seconds=LONG_LEASE)).fencing_token
            assert t2 > t1
            await at_eu.update(made.key, fields={"body": "fenced at eu"}, fencing_token=t2)
            await asyncio.sleep(0.01)
            async with AsyncClient(us.address) as at_us:  # later in time: a larger clock
                await at_us.update(made.key, fields={"body": "unfenced at us, later"})
        late = await us.storage.get(made.key)
        fenced = await eu.storage.get(made.key)
        assert late is not None and fenced is not None
        late_stamp = late.record.fields["body"].stamp
        fenced_stamp = fenced.record.fields["body"].stamp
        assert (late_stamp.epoch, fenced_stamp.epoch) == (t1, t2)
        assert late_stamp.hlc > fenced_stamp.hlc, "the older fence's write is the later one"

        await cluster.stop("us")
        us = await cluster.start("us")
        await wait_converged([us, eu])
        for node in (us, eu):
            async with AsyncClient(node.address) as client:
                assert (await client.get(made.key)).body == "fenced at eu", node.config.region


async def test_a_blind_delete_elsewhere_neither_rehomes_nor_deletes_a_later_creation(
    tmp_path: Path,
) -> None:
    """SPEC §2/§3 regression: us, cut off, deletes a key it has never seen (a tombstone is
    always written); later, eu creates that key, is told ``created`` and homed in eu,
    and grants a claim on it. After the partition heals, the record must still be
    eu's (``homeRegion`` never changes after creation) and, being written after the
    delete, visible (LWW on the ``deleted`` flag) with eu's claim live.

    Found: the tombstone's home (us, earlier stamp) wins the first-writer-wins
    merge of ``home``, and the creation never wrote ``deleted=False``, so the
    record ends homed in us, deleted, and eu's claim holder is refused
    ``wrong_region``.
    """
    async with Cluster(tmp_path, ["us", "eu"]) as cluster:
        us, eu = await cluster.start_all()
        await all_serving(cluster)
        await cluster.stop("us")
        us = await cluster.start_isolated("us")
        key = key_of("blind", "b")
        async with AsyncClient(us.address) as at_us:
            tombstone = await at_us.delete(key)
        assert tombstone.deleted
        await asyncio.sleep(0.01)  # the creation comes later, by any clock
        async with AsyncClient(eu.address) as at_eu:
            made = await at_eu.remember(REPO, "blind", "b", body="created after the delete")
            assert (made.created, made.record.home_region) == (True, "eu")
            token = (await at_eu.claim(key, "worker", lease_seconds=LONG_LEASE)).fencing_token

            await cluster.stop("us")
            us = await cluster.start("us")
            await wait_converged([us, eu])
            got = (await at_eu.list(REPO, topic="blind", include_deleted=True)).records
            assert [(r.home_region, r.deleted) for r in got] == [("eu", False)], got
            await at_eu.update(key, fields={"body": "still mine"}, fencing_token=token)


# -- catch-up after disk loss -----------------------------------------------------------------


async def claims_health(node: NodeServer) -> int:
    async with grpc.aio.insecure_channel(node.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service=CLAIMS_SERVICE)
        response = await stub.Check(request, timeout=10)
    return int(response.status)


async def test_an_empty_node_grants_no_claims_until_it_has_synced(tmp_path: Path) -> None:
    """SPEC §4: an empty node with peers reports NOT_SERVING for claims until it caught up."""
    async with Cluster(tmp_path, ["us", "eu"]) as cluster:
        eu = await cluster.start("eu")  # its only peer, us, is not up yet
        async with AsyncClient(eu.address, retries=0) as at_eu:
            await asyncio.sleep(0.3)
            assert not (await at_eu.info()).claims_serving
            assert await claims_health(eu) == health_pb2.HealthCheckResponse.NOT_SERVING
            assert await at_eu.health() == "SERVING"  # reads and writes are served
            made = (await at_eu.remember(REPO, "catch", "c", title="t")).record
            for call in (
                at_eu.claim(made.key, "worker-a", lease_seconds=LONG_LEASE),
                at_eu.renew_claim(made.key, 1),
                at_eu.release_claim(made.key, 1),
                # a fenced write needs the fence this node has not learned yet
                at_eu.update(made.key, fields={"body": "x"}, fencing_token=1),
            ):
                with pytest.raises(Unavailable):
                    await call
            assert (await peer_info(eu, "us")).reachable is False

            await cluster.start("us")

            async def serving() -> bool:
                return (await at_eu.info()).claims_serving and (
                    await claims_health(eu) == health_pb2.HealthCheckResponse.SERVING
                )

            await eventually(serving, "eu serving claims once synced with us", within=20)
            granted = await at_eu.claim(made.key, "worker-a", lease_seconds=LONG_LEASE)
            assert granted.granted and granted.fencing_token == 1


async def test_a_node_that_is_not_deciding_still_names_the_home_of_records_homed_elsewhere(
    tmp_path: Path,
) -> None:
    """SPEC §4: a node that decides nothing yet (here: settling after a restart)
    answers ``wrong_region`` for a record it holds whose home is another region —
    that answer decides nothing — so a routing client goes to the home at once
    rather than waiting out the settle; its own records, and records it does not
    hold, stay ``NOT_SERVING``. Before, the gate came before the record was read,
    and every home-only call at such a node was NOT_SERVING."""
    async with Cluster(tmp_path, ["us", "eu"]) as cluster:
        us, eu = await cluster.start_all()
        await all_serving(cluster)
        async with AsyncClient(us.address) as at_us, AsyncClient(eu.address) as at_eu:
            theirs = (await at_eu.remember(REPO, "gate", "theirs", title="t")).record
            ours = (await at_us.remember(REPO, "gate", "ours", title="t")).record
        await wait_converged([us, eu])

        await cluster.stop("us")
        # Restarted, it settles with eu before deciding; here for far longer than
        # the test takes, so every call below meets a node that is not deciding.
        slow = Tuning(settle_slack_s=120.0)
        us = await cluster.start("us", replication=slow, start_wait_s=300.0)
        async with AsyncClient(us.address, retries=0) as at_us:
            claimed = await at_us.claim(theirs.key, "worker-a", lease_seconds=LONG_LEASE)
            assert (claimed.granted, claimed.reason, claimed.home_region) == (
                False,
                "wrong_region",
                "eu",
            )
            renewed = await at_us.renew_claim(theirs.key, 1)
            assert (renewed.reason, renewed.home_region) == ("wrong_region", "eu")
            released = await at_us.release_claim(theirs.key, 1, outcome="done")
            assert (released.reason, released.home_region) == ("wrong_region", "eu")
            reopened = await at_us.reopen(theirs.key, "an operator's retry")
            assert (reopened.reason, reopened.home_region) == ("wrong_region", "eu")
            taken = await at_us.force_release(theirs.key, "an operator's take-back")
            assert (taken.reason, taken.home_region) == ("wrong_region", "eu")
            with pytest.raises(WrongRegion) as refused:
                await at_us.update(theirs.key, fields={"body": "x"}, fencing_token=1)
            assert refused.value.home_region == "eu"
            for call in (
                at_us.claim(ours.key, "worker-a", lease_seconds=LONG_LEASE),
                at_us.claim(f"repo/{REPO}/mem/gate/unknown", "worker-a"),
                at_us.release_claim(ours.key, 1),
                at_us.reopen(ours.key, "an operator's retry"),
                at_us.force_release(ours.key, "an operator's take-back"),
                at_us.update(ours.key, fields={"body": "x"}, fencing_token=1),
            ):
                with pytest.raises(Unavailable):
                    await call
        regions = {"us": us.address, "eu": eu.address}
        async with AsyncClient(us.address, regions=regions, retries=0) as routed:
            granted = await routed.claim(theirs.key, "worker-a", lease_seconds=LONG_LEASE)
            assert granted.granted, granted
            await routed.update(
                theirs.key, fields={"body": "x"}, fencing_token=granted.fencing_token
            )
        assert not us.replica.deciding, "the answers above did not wait for the settle"


async def test_a_node_that_lost_its_disk_never_reissues_a_token(tmp_path: Path) -> None:
    """SPEC §4: after disk loss, the first new token is above every token granted before."""
    async with Cluster(tmp_path, ["us", "eu"]) as cluster:
        us, eu = await cluster.start_all()
        await all_serving(cluster)
        old_id = us.storage.node_id
        async with AsyncClient(us.address) as at_us:
            churned = (await at_us.remember(REPO, "disk", "churned", title="t")).record
            held = (await at_us.remember(REPO, "disk", "held", title="t")).record
            tokens = []
            for owner in ("a", "b", "c"):
                token = (
                    await at_us.claim(churned.key, owner, lease_seconds=LONG_LEASE)
                ).fencing_token
                assert (await at_us.release_claim(churned.key, token)).released
                tokens.append(token)
            held_token = (
                await at_us.claim(held.key, "holder", lease_seconds=LONG_LEASE)
            ).fencing_token
        assert tokens == [1, 2, 3]
        await wait_converged([us, eu])

        await cluster.stop("us")
        cluster.wipe("us")
        us = await cluster.start("us")
        assert us.storage.node_id != old_id, "a lost disk comes back as a new node"
        async with AsyncClient(us.address) as at_us:

            async def serving() -> bool:
                return (await at_us.info()).claims_serving

            await eventually(serving, "the fresh us serving claims after catching up")
            again = await at_us.claim(churned.key, "d", lease_seconds=LONG_LEASE)
            assert again.granted and again.fencing_token > max(tokens), again
            other = await at_us.claim(held.key, "intruder", lease_seconds=LONG_LEASE)
            assert (other.granted, other.reason) == (False, "contended"), "the live claim survived"
            retry = await at_us.claim(held.key, "holder", lease_seconds=LONG_LEASE)
            assert (retry.granted, retry.fencing_token) == (True, held_token)
        await wait_converged([us, eu])


async def test_a_grant_that_never_replicated_is_not_reissued_after_disk_loss(
    tmp_path: Path,
) -> None:
    """Regression: catch-up alone cannot learn a grant that never left the lost disk.

    us grants while its only peer is down, then loses its disk. After catching up,
    its first grant on that record jumps above ``RECOVERY_GAP``, so the worker
    holding the lost token is refused ``superseded``, never readmitted.
    """
    async with Cluster(tmp_path, ["us", "eu"]) as cluster:
        us, eu = await cluster.start_all()
        await all_serving(cluster)
        async with AsyncClient(us.address) as at_us:
            item = (await at_us.remember(REPO, "gap", "item", title="t")).record
            first = await at_us.claim(item.key, "a", lease_seconds=LONG_LEASE)
            await at_us.release_claim(item.key, first.fencing_token)
            await wait_converged([us, eu])
            await cluster.stop("eu")
            lost = await at_us.claim(item.key, "lost-worker", lease_seconds=1)
            assert lost.fencing_token == first.fencing_token + 1  # exists only on us's disk
        await cluster.stop("us")
        cluster.wipe("us")
        await cluster.start("eu")
        us = await cluster.start("us")
        async with AsyncClient(us.address) as at_us:

            async def serving() -> bool:
                return (await at_us.info()).claims_serving

            await eventually(serving, "the fresh us serving claims after catching up")
            assert (await at_us.claim_status(item.key)).fence == first.fencing_token
            fresh = await at_us.claim(item.key, "b", lease_seconds=LONG_LEASE)
            assert fresh.granted
            assert fresh.fencing_token >= first.fencing_token + 1 + RECOVERY_GAP
            with pytest.raises(ClaimConflict) as refused:
                await at_us.update(
                    item.key, fields={"body": "late"}, fencing_token=lost.fencing_token
                )
            assert refused.value.reason == "superseded"
            # The gap is taken once: the next grant follows on.
            await at_us.release_claim(item.key, fresh.fencing_token)
            after = await at_us.claim(item.key, "c", lease_seconds=LONG_LEASE)
            assert after.fencing_token == fresh.fencing_token + 1


async def test_a_read_only_region_replicates_by_pulling(tmp_path: Path) -> None:
    """SPEC §5/§6: a node without writes has no Push; it converges by anti-entropy, and
    its peers do not report pushes to it as pending forever (``push_backlog``).
    """
    async with Cluster(tmp_path, ["us", "eu"]) as cluster:
        us = await cluster.start("us")
        eu = await cluster.start("eu", enable_writes=False)
        await all_serving(cluster)
        async with AsyncClient(us.address) as at_us:
            for i in range(5):
                await at_us.remember(REPO, "ro", f"r{i}", body=str(i))
        await wait_converged([us, eu])

        async def nothing_pending() -> bool:
            return (await peer_info(us, "eu")).push_backlog == 0

        async def backlog() -> str:
            return f"push_backlog {(await peer_info(us, 'eu')).push_backlog} for a read-only peer"

        await eventually(nothing_pending, "no pushes pending", within=3, explain=backlog)


# -- Node.Info per peer, and back-off ----------------------------------------------------------


async def test_a_peer_that_calls_in_is_retried_at_once_not_after_its_back_off(
    tmp_path: Path,
) -> None:
    """A node backed off from a peer that was down takes the peer's own call as proof
    it is up: its writes reach the peer within a round, not a back-off. The back-off
    here is 15-45 s from the first failure, longer than the test waits. (A write made
    while the peer was unreachable is not queued for it: the peer pulls it in its
    own round, so the test waits for the record there, not for an empty queue.)"""
    long_back_off = Tuning(first_backoff_s=30.0, max_backoff_s=30.0)
    async with Cluster(
        tmp_path, ["us", "eu"], anti_entropy_interval=0.05, replication=long_back_off
    ) as cluster:
        us, _ = await cluster.start_all()
        await all_serving(cluster)
        await cluster.stop("eu")
        async with AsyncClient(us.address) as at_us:
            await at_us.remember(REPO, "heard", "while-down", body="x")

            async def backed_off() -> bool:
                return (await peer_info(us, "eu")).last_error != ""

            await eventually(backed_off, "us failing to reach eu")
            eu = await cluster.start("eu")

            async def delivered() -> bool:
                info = await peer_info(us, "eu")
                held = await eu.storage.get(key_of("heard", "while-down"))
                return info.reachable and info.push_backlog == 0 and held is not None

            await eventually(delivered, "the write at eu right after eu called", within=10)


@contextlib.asynccontextmanager
async def linked_by_proxies(
    tmp_path: Path, tunings: dict[str, Tuning]
) -> AsyncIterator[tuple[Cluster, dict[str, FaultProxy]]]:
    """us and eu, each calling the other through its own proxy (``to["eu"]`` carries
    us's calls to eu), with rounds an interval of 30 s apart (15-45 s, jittered)."""
    cluster = Cluster(tmp_path, ["us", "eu"], anti_entropy_interval=30.0)
    to = {r: await FaultProxy.start(cluster.addresses[r], name=f"to-{r}") for r in ("us", "eu")}
    try:
        async with cluster:
            await asyncio.gather(
                *(
                    cluster.start(r, peers={o: to[o].address}, replication=tunings[r])
                    for r, o in (("us", "eu"), ("eu", "us"))
                )
            )
            await all_serving(cluster)
            yield cluster, to
    finally:
        for proxy in to.values():
            await proxy.close()


async def backed_off_after_a_partition(
    cluster: Cluster, to: dict[str, FaultProxy]
) -> tuple[str, float]:
    """Cut both ways, write at us (its push to eu fails: us backs eu off), and return
    the written key and when us last completed a round with eu."""
    us = cluster["us"]
    synced = us.replicator.peer_stats("eu").last_sync or 0.0
    to["eu"].cut()
    to["us"].cut()
    async with AsyncClient(us.address) as at_us:
        await at_us.remember(REPO, "heal", "while-cut", body="x")

    async def backed_off() -> bool:
        return us.replicator.peer_stats("eu").failures > 0

    await eventually(backed_off, "us failing to reach eu")
    return key_of("heal", "while-cut"), synced


async def test_a_round_follows_at_once_when_a_backed_off_peer_calls_in(tmp_path: Path) -> None:
    """After a partition, the node that was cut off runs no round until a back-off
    ends; the first call across the healed link ends it (docs/replication.md), and
    the round it allows goes at once — not when the round loop's pause ends (up to
    1.5 intervals: 45 s here) — so a repair starts with the first contact. us makes
    no heartbeats and eu's back-off is long: only eu's heartbeat calls across."""
    long_back_off = Tuning(first_backoff_s=30.0, max_backoff_s=30.0)
    tunings = {"us": dataclasses.replace(long_back_off, heartbeat_s=3600.0), "eu": long_back_off}
    async with linked_by_proxies(tmp_path, tunings) as (cluster, to):
        us = cluster["us"]
        _, synced = await backed_off_after_a_partition(cluster, to)
        to["us"].heal()
        to["eu"].heal()

        async def round_with_eu() -> bool:
            return (us.replicator.peer_stats("eu").last_sync or 0.0) > synced

        await eventually(round_with_eu, "us's round with eu after eu called in", within=8)


async def test_a_heartbeat_that_gets_through_ends_the_back_off(tmp_path: Path) -> None:
    """A peer that earlier calls did not reach, and that this node's heartbeat reaches
    again, is up: its back-off ends, and the push and round it held back go now. eu's
    own calls to us stay cut here, so only us's heartbeat can tell it."""
    long_back_off = Tuning(first_backoff_s=30.0, max_backoff_s=30.0)
    async with linked_by_proxies(tmp_path, {"us": long_back_off, "eu": long_back_off}) as (
        cluster,
        to,
    ):
        us, eu = cluster["us"], cluster["eu"]
        key, synced = await backed_off_after_a_partition(cluster, to)
        to["eu"].heal()

        async def repaired() -> bool:
            stats = us.replicator.peer_stats("eu")
            synced_again = (stats.last_sync or 0.0) > synced
            return synced_again and await eu.storage.get(key) is not None

        await eventually(repaired, "us pushing to eu and syncing with it", within=8)


async def test_after_a_heal_the_regions_that_kept_a_peer_leave_the_returning_one_to_pull(
    tmp_path: Path,
) -> None:
    """ap is cut off from both; us and eu keep each other. Once the mesh heals, us and
    eu give ap an interval's head start (30 s here) before their own rounds with it:
    ap pulls what it missed at once, and their rounds meanwhile would only find it
    behind and list the differences for nothing (docs/performance.md)."""
    quick = Tuning(unreachable_after=1, unreachable_after_s=0.2)
    cluster = Cluster(tmp_path, ["us", "eu", "ap"], anti_entropy_interval=30.0, replication=quick)
    mesh = await ProxyMesh.start(cluster.addresses)
    try:
        async with cluster:
            await asyncio.gather(*(cluster.start(r, peers=mesh.peers(r)) for r in cluster.regions))
            await all_serving(cluster)
            us, eu, ap = cluster["us"], cluster["eu"], cluster["ap"]
            mesh.isolate("ap")
            # A write at each: every push across the cut fails, and every node finds
            # the peers across it unreachable.
            for node in (us, eu, ap):
                async with AsyncClient(node.address) as client:
                    await client.remember(REPO, "head-start", node.replicator.replica.region)

            async def cut_off() -> bool:
                return (
                    us.replicator.unreachable("ap")
                    and eu.replicator.unreachable("ap")
                    and ap.replicator.unreachable("us")
                    and ap.replicator.unreachable("eu")
                )

            await eventually(cut_off, "every node finding the peers across the cut unreachable")
            # A call in flight as the cut began may still have come back after the
            # node found ap unreachable, and given ap a head start already (seen once
            # on a loaded machine): what counts is the one the heal gives.
            before = {n: n.replicator._peers["ap"].behind_until for n in (us, eu)}
            mesh.heal()
            healed_at = time.monotonic()

            async def head_start() -> bool:
                return all(
                    n.replicator.leaves_to_pull("ap")
                    and n.replicator._peers["ap"].behind_until > max(before[n], healed_at)
                    for n in (us, eu)
                )

            async def why() -> str:
                return ", ".join(
                    f"{n.replicator.replica.region}: leaves ap to pull"
                    f" {n.replicator.leaves_to_pull('ap')}"
                    for n in (us, eu)
                )

            await eventually(head_start, "us and eu leaving ap to pull", within=8, explain=why)
            written_at_us = key_of("head-start", "us")

            async def pulled() -> bool:
                return await ap.storage.get(written_at_us) is not None

            await eventually(pulled, "ap pulling what us wrote meanwhile", within=8)
    finally:
        await mesh.close()


async def test_a_round_that_gets_across_after_unanswered_calls_gives_the_head_start_too(
    tmp_path: Path,
) -> None:
    """The first call to get across after a partition heals may be a round (one in
    flight as it healed), not a push, a heartbeat or the peer's own call: it gives
    the returning peer its head start too, before it clears the count of calls that
    did not get across. (A round that cleared it first left ``us`` running its own
    rounds with ``ap`` in the test above, once, on a loaded machine.)"""
    quick = Tuning(unreachable_after=1, unreachable_after_s=0.2)
    cluster = Cluster(tmp_path, ["us", "eu", "ap"], anti_entropy_interval=30.0, replication=quick)
    async with cluster:
        us, _, _ = await cluster.start_all()
        await all_serving(cluster)
        link = us.replicator._peers["ap"]
        # As after a second of calls to ap that did not get across: a partition (and
        # no head start from before it: a slow start can have given one already).
        link.unanswered, link.unanswered_since = 3, time.monotonic() - 1.0
        link.behind_until = 0.0
        assert us.replicator.unreachable("ap") and not us.replicator.leaves_to_pull("ap")
        result = await us.replicator._guarded_round(link)
        assert result is not None and result.complete  # the round got across
        assert us.replicator.leaves_to_pull("ap")
        assert not us.replicator.unreachable("ap")


@pytest.mark.slow  # waits out a back-off
async def test_info_reports_each_peer_and_a_down_peer_is_backed_off(tmp_path: Path) -> None:
    """SPEC §5: per-peer last sync, counters and reachability; a failing peer is backed off."""
    async with Cluster(tmp_path, ["us", "eu"], anti_entropy_interval=0.05) as cluster:
        us, eu = await cluster.start_all()
        await all_serving(cluster)
        async with AsyncClient(us.address) as at_us:
            await at_us.remember(REPO, "info", "first", body="1")

            async def synced() -> bool:
                peer = await peer_info(us, "eu")
                return peer.HasField("last_sync") and peer.records_sent >= 1

            await eventually(synced, "a completed round and a push from us to eu")
            before = await peer_info(us, "eu")
            assert before.reachable and not before.last_error
            assert before.address == cluster.addresses["eu"]
            assert before.bytes_sent > 0 and before.bytes_received > 0

            async def received() -> bool:
                # us counts a push as sent when it goes out; eu, once it is merged.
                at_eu_side = await peer_info(eu, "us")
                return at_eu_side.records_received >= 1 and at_eu_side.HasField("last_sync")

            async def eu_side() -> str:
                return str(await peer_info(eu, "us"))

            await eventually(received, "eu counting the state it merged from us", explain=eu_side)

            for i in range(3):
                await at_us.remember(REPO, "info", f"more-{i}", body=str(i))

            async def grew() -> bool:
                now = await peer_info(us, "eu")
                return (
                    now.records_sent >= before.records_sent + 3
                    and now.bytes_sent > before.bytes_sent
                    and now.bytes_received > before.bytes_received
                    and now.last_sync.ToNanoseconds() > before.last_sync.ToNanoseconds()
                )

            await eventually(grew, "counters and last_sync moving on")

            await cluster.stop("eu")
            await at_us.remember(REPO, "info", "while-down", body="x")

            async def down() -> bool:
                peer = await peer_info(us, "eu")
                return not peer.reachable and bool(peer.last_error) and peer.push_backlog >= 1

            await eventually(down, "eu reported unreachable with a reason")
            await asyncio.sleep(1.0)  # let the back-off grow past its first steps
            stats = us.replicator.peer_stats("eu")
            failures, rounds = stats.failures, us.replicator.rounds
            await asyncio.sleep(2.0)
            attempts = stats.failures - failures
            # Without back-off: a round every ~50 ms and a push retry loop = hundreds.
            assert attempts <= 6, f"{attempts} attempts to reach a down peer in 2 s"
            assert us.replicator.rounds - rounds <= 4
            lagging = await peer_info(us, "eu")
            assert lagging.lag_ms >= 2000 and not lagging.reachable


async def test_each_state_merged_is_counted_once_when_a_push_and_a_pull_race(
    tmp_path: Path,
) -> None:
    """eu pulls in its rounds (every 10 ms) what us pushes at once: for many of these
    keys both arrive together. Each key is new to eu, so exactly one of the two merges
    changes it — and eu counts exactly that one, however the two interleave (a count
    read before a merge and written after it lost the push's, CI saw)."""
    keys = 240
    async with Cluster(tmp_path, ["us", "eu"], anti_entropy_interval=0.01) as cluster:
        us, eu = await cluster.start_all()
        await all_serving(cluster)
        async with AsyncClient(us.address) as at_us:
            for start in range(0, keys, 8):
                batch = range(start, start + 8)
                await asyncio.gather(*(at_us.remember(REPO, "race", f"k{i}") for i in batch))
        await wait_converged([us, eu])
        stats = eu.replicator.peer_stats("us")

        async def all_counted() -> bool:
            return stats.records_received >= keys

        async def count() -> str:
            return f"{stats.records_received} of {keys} counted"

        await eventually(
            all_counted, "eu counting every state it merged from us", within=10, explain=count
        )
        assert stats.records_received == keys  # and none twice


def test_a_whole_round_is_complete_once_every_state_it_pulled_is_merged_or_judged() -> None:
    """A whole round (a catch-up: every differing state pulled, whatever its HLC)
    holds everything the peer held once nothing was left unlisted — unless a state
    it pulled was refused for a reason that may lift (an unknown signer): that
    merge is still owed, and the round counts for no catch-up. A refusal for good
    (over the limits, a forged grant) is judged: it counts as seen. A routine round
    that pulled anything is not complete (it skipped states older than ours)."""
    assert RoundResult(False, pulled=3, whole=True).complete
    assert RoundResult(True, whole=True, unsettled=1).complete  # the digests agreed
    assert not RoundResult(False, pulled=3).complete
    assert not RoundResult(False, pulled=3, whole=True, truncated=True).complete
    assert not RoundResult(False, pulled=3, whole=True, unsettled=1).complete
    stats = PeerStats("eu", "127.0.0.1:1")
    began = time.monotonic()
    stats.refused_state("k1", "unknown_signer", "who signed it?", (b"theirs", b"ours"))
    stats.refused_state("k2", "over_limit", "too large", (b"theirs", b"ours"))
    assert stats.refused_to_retry(["k1", "k2", "k3"], began) == 1
    assert stats.refused_to_retry(["k1"], time.monotonic() + 1) == 0  # refused before it

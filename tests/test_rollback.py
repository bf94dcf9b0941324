"""A data file that goes back in time: no token handed out twice, no item done twice.

What it models: a home whose file loses its latest writes without being lost — a
virtual machine reverted to a snapshot, a disk that acknowledged an fsync and lost
the write on power loss, an old copy put back by hand. The file then holds no sign
of what it forgot. Each test copies a node's data directory while the node is
stopped (what a snapshot holds), lets the node work on, then puts the copy back and
starts the node again on the same address (docs/replication.md, *A disk that goes
back in time*).

Regression: before every life of a file started a new era of tokens, a home
restarted on such a copy granted the token it had granted after the copy again, to
another owner: two workers held token 2 of one record.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncGenerator
from pathlib import Path

import pytest

from fencemark.client import AsyncClient, WatchEvent
from fencemark.node.api.server import NodeServer
from fencemark.node.store import feed
from tests.cluster import Cluster, all_deciding, eventually, wait_converged
from tests.metrics import counters

# Every test stops, reverts and restarts nodes, waiting out their settles: seconds each.
pytestmark = pytest.mark.slow

REPO, TOPIC = "lattice", "backlog"


def snapshot(cluster: Cluster, region: str, to: Path) -> None:
    """Copy ``region``'s stopped node's data directory to ``to``."""
    shutil.copytree(cluster.data_dirs[region], to)


def revert(cluster: Cluster, region: str, snapshot_dir: Path) -> None:
    """Put ``snapshot_dir`` back as ``region``'s data directory (the node is stopped)."""
    shutil.rmtree(cluster.data_dirs[region])
    shutil.copytree(snapshot_dir, cluster.data_dirs[region])


async def test_a_home_on_a_reverted_file_never_grants_a_token_again(tmp_path: Path) -> None:
    """Cut off from every peer after the revert, the home cannot learn the grant its
    file forgot: its first grant of the new life is above it anyway (the life's
    token floor), so worker-a's token is superseded, not shared."""
    async with Cluster(tmp_path, ["us", "eu"]) as cluster:
        us, eu = await cluster.start_all()
        await all_deciding(us, eu)
        async with AsyncClient(us.address) as client:
            item = (await client.remember(REPO, TOPIC, "item-1", tags=["homeRegion:us"])).record
        await cluster.stop("us")
        snapshot(cluster, "us", tmp_path / "snapshot")
        us = await cluster.start("us")
        await all_deciding(us)
        async with AsyncClient(us.address) as client:
            lost = await client.claim(item.key, "worker-a", lease_seconds=60)
        assert lost.granted
        await wait_converged([us, eu])  # eu holds worker-a's grant; us is about to forget it

        await cluster.stop("us")
        revert(cluster, "us", tmp_path / "snapshot")
        us = await cluster.start_isolated("us")
        assert us.replica.deciding, "no peer to wait for"
        async with AsyncClient(us.address) as client:
            again = await client.claim(item.key, "worker-b", lease_seconds=60)
            assert again.granted and again.fencing_token > lost.fencing_token
            await client.update(item.key, fields={"body": "b"}, fencing_token=again.fencing_token)

        # Back with its peer, the home's fence is worker-b's: worker-a is superseded.
        await cluster.stop("us")
        us = await cluster.start("us")
        await wait_converged([us, eu])
        async with AsyncClient(eu.address) as client:
            status = await client.claim_status(item.key)
        assert status.claim is not None
        assert (status.claim.owner, status.fence) == ("worker-b", again.fencing_token)


async def test_a_reverted_home_learns_what_it_forgot_before_it_hands_out_work(
    tmp_path: Path,
) -> None:
    """With its peer up, the restarted home compares states with it before it
    decides: the item it marked done after the snapshot is done again before
    ``ClaimNext`` could hand it out, and the peer's state — which holds writes this
    node made and its file forgot — tells it its file went back in time: it owes a
    full catch-up and the recovery gap, and counts it (``fencemark_data_rollbacks``)."""
    async with Cluster(tmp_path, ["us", "eu"]) as cluster:
        us, eu = await cluster.start_all()
        await all_deciding(us, eu)
        async with AsyncClient(us.address) as client:
            for index in range(2):
                await client.remember(REPO, TOPIC, f"job-{index}", tags=["homeRegion:us"])
        await cluster.stop("us")
        snapshot(cluster, "us", tmp_path / "snapshot")
        us = await cluster.start("us")
        await all_deciding(us)
        async with AsyncClient(us.address) as client:
            first = await client.claim_next(REPO, TOPIC, "worker-a", lease_seconds=60)
            assert first.granted and first.record is not None
            done = first.record.key
            await client.release_claim(done, first.fencing_token, outcome="done")
        await wait_converged([us, eu])

        await cluster.stop("us")
        revert(cluster, "us", tmp_path / "snapshot")
        us = await cluster.start("us")
        await all_deciding(us)
        async with AsyncClient(us.address) as client:
            handed = []
            while (next_item := await client.claim_next(REPO, TOPIC, "worker-b")).granted:
                assert next_item.record is not None
                handed.append(next_item.record.key)
                await client.release_claim(
                    next_item.record.key, next_item.fencing_token, outcome="done"
                )
            assert done not in handed and len(handed) == 1, handed
            assert next_item.reason == "empty"
        assert us.replica.gate.rollbacks >= 1
        assert counters(us, "fencemark_data_rollbacks") == {(): us.replica.gate.rollbacks}
        assert us.replica.recovered_hlc > us.replica.gate.life_hlc, "caught up again, with the gap"


async def test_a_restart_with_a_peer_down_decides_after_its_bounded_wait(tmp_path: Path) -> None:
    """A restarted node waits for a round with each peer before it decides, but no
    longer than ``start_wait_s``: a peer that is down costs that, not its absence.
    Nothing is owed durably: its next restart waits the same way."""
    async with Cluster(tmp_path, ["us", "eu"], start_wait_s=1.0) as cluster:
        us, eu = await cluster.start_all()
        await all_deciding(us, eu)
        async with AsyncClient(us.address) as client:
            item = (await client.remember(REPO, TOPIC, "item-1", tags=["homeRegion:us"])).record
            before = await client.claim(item.key, "worker-a", lease_seconds=60)
            await client.release_claim(item.key, before.fencing_token)
        await cluster.stop("eu")
        await cluster.stop("us")
        us = await cluster.start("us")
        assert not us.replica.deciding and not us.replica.gate.owed
        await eventually(lambda: _deciding(us), "us deciding without eu", within=10)
        async with AsyncClient(us.address) as client:
            after = await client.claim(item.key, "worker-b", lease_seconds=60)
        assert after.granted and after.fencing_token > before.fencing_token
        assert us.replica.gate.rollbacks == 0


async def _deciding(node: NodeServer) -> bool:
    return node.replica.deciding


async def test_a_watcher_of_a_reverted_feed_skips_none_of_its_new_changes(tmp_path: Path) -> None:
    """The change feed forgets with its file: a watcher may hold a cursor of a change
    the file no longer has. Each life of a feed starts a new era of ``seq``s, so the
    changes made after the revert are above that cursor, and resuming from it
    delivers every one of them (regression: the new changes took the forgotten
    ``seq``s, and a watcher resuming from one skipped them silently)."""
    async with Cluster(tmp_path, ["us"]) as cluster:
        us = await cluster.start("us")
        async with AsyncClient(us.address) as client:
            for index in range(3):
                await client.remember(REPO, TOPIC, f"before-{index}")
        await cluster.stop("us")
        snapshot(cluster, "us", tmp_path / "snapshot")
        us = await cluster.start("us")
        start = feed.cursor(us.replica.feed_id, us.replica.feed_last)
        async with AsyncClient(us.address) as client:
            for index in range(3):
                await client.remember(REPO, TOPIC, f"forgotten-{index}")
            seen = await take(client.watch(REPO, topic=TOPIC, cursor=start), 3)
        cursor = seen[-1].cursor

        await cluster.stop("us")
        revert(cluster, "us", tmp_path / "snapshot")
        us = await cluster.start("us")
        async with AsyncClient(us.address) as client:
            for index in range(2):
                await client.remember(REPO, TOPIC, f"after-{index}")
            resumed = await take(client.watch(REPO, topic=TOPIC, cursor=cursor), 2)
        assert [e.key.rpartition("/")[2] for e in resumed] == ["after-0", "after-1"]
        assert all(seq_of(e.cursor) > seq_of(cursor) for e in resumed)


def seq_of(cursor: str) -> int:
    return int(cursor.rpartition(".")[2])


async def take(events: AsyncGenerator[WatchEvent, None], count: int) -> list[WatchEvent]:
    """The next ``count`` events of ``events``, within 10 s."""
    got: list[WatchEvent] = []
    async with asyncio.timeout(10):
        async for event in events:
            got.append(event)
            if len(got) == count:
                break
    await events.aclose()
    return got

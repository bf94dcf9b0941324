"""Twins: two live processes serving one node's data never both go on deciding.

What it models: a copy of a *live* home's data directory started as a second
process — an operator moving a node to a new host without stopping the old one,
a failed-over virtual machine whose original comes back, a restore onto the wrong
host. Both processes have the same node id and region, so both decide claims for
the region's records, each from its own fence (docs/replication.md, *Twins*).

Regression: before peers told lives apart, both processes went on deciding: the
copy's grants reached the original through their peer, each then granted the
next token of the same fence to its own workers, and one token could be handed
out twice. Now a peer that hears both refuses both, both stop deciding, and once
the copy is stopped the original catches up and grants above everything the copy
could have granted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from pathlib import Path
from typing import cast

import grpc
import pytest

from fencemark.client import AsyncClient
from fencemark.client.errors import Unavailable
from fencemark.node.api.server import NodeServer
from fencemark.node.replication.tuning import Tuning
from tests.cluster import (
    FAST_ANTI_ENTROPY,
    Cluster,
    all_deciding,
    backup,
    eventually,
    wait_converged,
)
from tests.metrics import counters, gauges

REPO, TOPIC = "lattice", "backlog"
FORGET_S = 3.0  # how long a peer remembers a silent life (30 s in a deployment)


def copy_live(node: NodeServer, target: Path) -> None:
    """A consistent copy of ``node``'s data directory while it runs."""
    target.mkdir()
    backup(node, target / node.config.db_path.name)


async def test_twins_are_refused_and_the_original_grants_above_the_copy(tmp_path: Path) -> None:
    async with Cluster(tmp_path, ["us", "eu"], replication=Tuning(twin_forget_s=FORGET_S)) as c:
        us, eu = await c.start_all()
        await all_deciding(us, eu)
        async with AsyncClient(us.address) as client:
            item = (await client.remember(REPO, TOPIC, "item-1", tags=["homeRegion:us"])).record
            first = await client.claim(item.key, "worker-a", lease_seconds=60)
            assert first.granted
            await client.release_claim(item.key, first.fencing_token)
        await wait_converged([us, eu])
        copy_live(us, tmp_path / "twin")

        # The copy, started cut off, decides at once and grants a token nobody sees.
        twin_config = c.config("us", data_dir=tmp_path / "twin", listen="127.0.0.1:0")
        twin = await NodeServer.start(twin_config.__class__(**{**vars(twin_config), "peers": {}}))
        try:
            assert twin.replica.node_id == us.replica.node_id
            async with AsyncClient(twin.address) as client:
                hidden = await client.claim(item.key, "worker-b", lease_seconds=2)
            assert hidden.granted and hidden.fencing_token > first.fencing_token
            await twin.stop(0)

            # Started again with its peer, while the original still runs: eu hears two
            # lives of one node id calling at once and refuses both.
            twin = await NodeServer.start(twin_config)

            async def neither_deciding() -> bool:
                return not us.replica.deciding and not twin.replica.deciding

            await eventually(neither_deciding, "both twins refused and not deciding", within=20)
            assert gauges(eu, "fencemark_twin_nodes") == {(): 1.0}
            assert counters(us, "fencemark_twin_refusals")[()] >= 1
            for node in (us, twin):
                async with AsyncClient(node.address) as client:
                    with pytest.raises(Unavailable):
                        await client.claim(item.key, "worker-c", lease_seconds=60)
            # From now on nothing either twin sends is taken.
            async with AsyncClient(twin.address) as client:
                lost = (await client.remember(REPO, TOPIC, "twin-only")).record
            await asyncio.sleep(4 * FAST_ANTI_ENTROPY)
            assert await eu.storage.get(lost.key) is None
        finally:
            await twin.stop(0)

        # The copy stopped: once eu has forgotten its life, the original catches up and
        # its next token is above every token the copy granted, seen or not.
        await all_deciding(us, within=FORGET_S + 20)
        assert gauges(eu, "fencemark_twin_nodes") == {(): 0.0}
        async with AsyncClient(us.address) as client:
            after = await client.claim(item.key, "worker-c", lease_seconds=60)
        assert after.granted and after.fencing_token > hidden.fencing_token


async def test_a_copy_started_beside_its_live_original_never_decides(tmp_path: Path) -> None:
    """The copy of a live node's directory, started with its peers, is refused before
    it decides anything: a restarted node decides only after a round with each peer
    that began ``settle_s`` after the peer first answered it, and by then the
    original's heartbeat has reached that peer since the copy's life began there."""
    async with Cluster(tmp_path, ["us", "eu"], replication=Tuning(twin_forget_s=FORGET_S)) as c:
        us, eu = await c.start_all()
        await all_deciding(us, eu)
        async with AsyncClient(us.address) as client:
            await client.remember(REPO, TOPIC, "item-1", tags=["homeRegion:us"])
        await wait_converged([us, eu])
        copy_live(us, tmp_path / "twin")
        twin = await NodeServer.start(
            c.config("us", data_dir=tmp_path / "twin", listen="127.0.0.1:0")
        )
        try:
            assert twin.replica.node_id == us.replica.node_id
            assert twin.replica.gate.starting  # a written file: a restart, or a copy
            decided = False

            async def refused() -> bool:
                nonlocal decided
                decided = decided or twin.replica.deciding
                return twin.replica.gate.twins >= 1 and us.replica.gate.twins >= 1

            await eventually(refused, "eu refusing both lives of the node id", every=0.01)
            assert not decided, "the copy decided claims beside its live original"

            async def neither_deciding() -> bool:  # each owes, durably, as it hears it
                nonlocal decided
                decided = decided or twin.replica.deciding
                return not twin.replica.deciding and not us.replica.deciding

            await eventually(neither_deciding, "both twins not deciding")
            assert not decided, "the copy decided claims beside its live original"
        finally:
            await twin.stop(0)


async def test_a_restart_decides_once_its_peers_had_time_to_hear_a_twin(tmp_path: Path) -> None:
    """A plain restart (the old life gone) is not a twin: it decides, ``settle_s``
    after its peer first answered it, not at its first round."""
    async with Cluster(tmp_path, ["us", "eu"]) as c:
        us, eu = await c.start_all()
        await all_deciding(us, eu)
        async with AsyncClient(us.address) as client:
            item = (await client.remember(REPO, TOPIC, "item-1", tags=["homeRegion:us"])).record
        await wait_converged([us, eu])
        await c.stop("us")
        began = asyncio.get_running_loop().time()
        us = await c.start("us")
        assert us.replica.gate.starting

        async def settling() -> bool:  # eu answered; its rounds count from settled_at
            return us.replica.gate.settled_at > 0

        await eventually(settling, "us settling with eu", every=0.01)
        # Meanwhile a claim is refused NOT_SERVING with when to ask again ...
        async with AsyncClient(us.address, retries=0) as client:
            with pytest.raises(Unavailable) as refused:
                await client.claim(item.key, "worker-a", lease_seconds=60)
        cause = refused.value.__cause__
        assert isinstance(cause, grpc.aio.AioRpcError)
        metadata = cast(Iterable[tuple[str, str | bytes]], cause.trailing_metadata() or ())
        trailing = list(metadata)
        pushback = [v for k, v in trailing if k == "grpc-retry-pushback-ms"]
        assert len(pushback) == 1 and isinstance(pushback[0], str)
        assert 0 < int(pushback[0]) <= us.replicator.settle_s * 1000 + 50
        # ... which a retrying client waits for: the caller sees the grant.
        async with AsyncClient(us.address) as client:
            claim = await client.claim(item.key, "worker-a", lease_seconds=60)
        assert claim.granted
        took = asyncio.get_running_loop().time() - began
        assert took >= us.replicator.settle_s
        assert us.replica.deciding
        assert us.replica.gate.twins == 0 and eu.replica.gate.twins == 0


async def test_a_peer_that_restarts_while_a_node_settles_gives_it_the_whole_settle(
    tmp_path: Path,
) -> None:
    """A peer that went down while a restarted node settled may have forgotten the
    node's life: the settle starts again from its next answer."""
    async with Cluster(tmp_path, ["us", "eu"]) as c:
        us, eu = await c.start_all()
        await all_deciding(us, eu)
        async with AsyncClient(us.address) as client:
            await client.remember(REPO, TOPIC, "item-1", tags=["homeRegion:us"])
        await wait_converged([us, eu])
        await c.stop("us")
        us = await c.start("us")
        link = us.replicator._peers["eu"]

        async def answered() -> bool:
            return link.first_answered is not None

        await eventually(answered, "eu answering the restarted us", every=0.01)
        await c.stop("eu")

        async def forgotten() -> bool:
            return link.first_answered is None

        await eventually(forgotten, "us seeing eu gone (UNAVAILABLE)", every=0.01)
        assert not us.replica.deciding
        eu = await c.start("eu")
        back = asyncio.get_running_loop().time()
        await all_deciding(us)
        assert asyncio.get_running_loop().time() - back >= us.replicator.settle_s

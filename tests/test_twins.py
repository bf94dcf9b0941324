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
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, cast

import grpc
import pytest

from fencemark.client import AsyncClient
from fencemark.client.errors import NotFound, Unavailable
from fencemark.node.api.config import DB_FILE
from fencemark.node.api.server import NodeServer
from fencemark.node.replication.link import PeerLink
from fencemark.node.replication.tuning import HEARTBEAT_S, SETTLE_SLACK_S, Tuning
from fencemark.node.rules.errors import NotServing
from fencemark.node.tools.process import NodeProcess
from fencemark.node.tools.proxy import FaultProxy
from tests.cluster import (
    FAST_ANTI_ENTROPY,
    Cluster,
    ProcessCluster,
    all_deciding,
    backup,
    copy_file,
    eventually,
    paused,
    wait_converged,
)
from tests.metrics import counters, gauges

# Every test waits out settles, naps or real node processes (ProcessCluster): seconds each.
pytestmark = pytest.mark.slow

REPO, TOPIC = "lattice", "backlog"
FORGET_S = 3.0  # how long a peer remembers a silent life (30 s in a deployment)
SETTLE_S = HEARTBEAT_S + 2 * 0.5 + SETTLE_SLACK_S  # a restart's settle, default clock offset


async def decides_within(client: AsyncClient, seconds: float, every: float = 0.02) -> bool:
    """Whether the node says it decides claims at any poll within ``seconds``."""
    for _ in range(int(seconds / every)):
        if (await client.info()).claims_serving:
            return True
        await asyncio.sleep(every)
    return False


async def restarted_us(c: Cluster, **overrides: Any) -> NodeServer:
    """``us`` restarted (with ``overrides``) once ``eu`` holds a record it made: a
    plain restart, settling with its peer."""
    us, eu = await c.start_all()
    await all_deciding(us, eu)
    async with AsyncClient(us.address) as client:
        await client.remember(REPO, TOPIC, "item-1", tags=["homeRegion:us"])
    await wait_converged([us, eu])
    await c.stop("us")
    return await c.start("us", **overrides)


async def first_answer(link: PeerLink, known: bool, what: str) -> None:
    """Wait until the settle of ``link`` has a first answer from the peer (``known``)
    or has started over without one."""

    async def holds() -> bool:
        return (link.first_answered is not None) == known

    await eventually(holds, what, every=0.01)


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
        # The client reads the refusal's reason and its RetryInfo (the same wait).
        assert refused.value.reason == "NOT_SERVING"
        assert refused.value.retry_after == int(pushback[0]) / 1000
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
        us = await restarted_us(c)
        link = us.replicator._peers["eu"]
        await first_answer(link, True, "eu answering the restarted us")
        await c.stop("eu")
        await first_answer(link, False, "us seeing eu gone (UNAVAILABLE)")
        assert not us.replica.deciding
        await c.start("eu")
        back = asyncio.get_running_loop().time()
        await all_deciding(us)
        assert asyncio.get_running_loop().time() - back >= us.replicator.settle_s


async def test_a_peer_that_stops_answering_while_a_node_settles_gives_it_the_whole_settle(
    tmp_path: Path,
) -> None:
    """A peer that did not answer a call within its deadline — paused, or behind a
    hung link — may, once it runs again, answer that call and the later ones in an
    order gRPC does not promise, before it hears a twin of this life (a witness
    paused longer than the deadline, which the paused-peer test below, at five
    seconds, does not reach).
    So a timed-out call starts the settle over, as UNAVAILABLE does: the node
    decides ``settle_s`` after the peer's next answer. Regression: the settle kept
    the peer's first answer from before the silence, and counted a round made
    right after it."""
    async with (
        Cluster(tmp_path, ["us", "eu"]) as c,
        await FaultProxy.start(c.addresses["eu"]) as to_eu,
    ):
        us = await restarted_us(c, peers={"eu": to_eu.address})
        us.replicator.timeout = 1.0  # every call's deadline: a silence ends in 1 s
        link = us.replicator._peers["eu"]
        await first_answer(link, True, "eu answering the restarted us")
        to_eu.blackhole()  # connections stay open; nothing gets through
        await first_answer(link, False, "a call to eu timing out")
        assert not us.replica.deciding
        back = asyncio.get_running_loop().time()
        to_eu.heal()
        await all_deciding(us)
        # The settle counts from the start of the first call eu answers after the
        # silence (the peer tells lives apart by the clocks calls carry, not by when
        # they arrive); a call already on its way at the heal, started up to one
        # deadline before it, may be that one. The regression decided at once.
        took = asyncio.get_running_loop().time() - back
        assert took >= us.replicator.settle_s - us.replicator.timeout, took


async def test_an_original_paused_while_its_copy_settled_grants_nothing_when_it_wakes(
    tmp_path: Path,
) -> None:
    """The order that dodges the heartbeat: the original is paused (SIGSTOP: a
    suspended VM, a frozen container) before its copy starts, so their peer hears
    the copy alone, and the copy settles and decides. When the original wakes, a
    claim already waiting in its socket must not be granted: the copy may have
    granted the same token. A node that finds its event loop stood still
    (``grant_gate``, *naps*) settles again, as after a restart, before it decides;
    by then its peer has heard both and refuses both."""
    async with ProcessCluster(tmp_path, ["us", "eu"]) as cluster:
        original, eu = await cluster.start_all()
        async with AsyncClient(original.address) as client:
            item = (await client.remember(REPO, TOPIC, "item-1", tags=["homeRegion:us"])).record
            first = await client.claim(item.key, "worker-a", lease_seconds=60)
            assert first.granted
            await client.release_claim(item.key, first.fencing_token)
        async with AsyncClient(eu.address) as client:

            async def eu_holds_the_release() -> bool:
                try:  # the record itself may not have reached eu yet
                    status = await client.claim_status(item.key)
                except NotFound:
                    return False
                return status.fence == first.fencing_token and status.claim is None

            await eventually(eu_holds_the_release, "eu holding the release")
        (tmp_path / "copy").mkdir()
        copy_file(original.data_dir / DB_FILE, tmp_path / "copy" / DB_FILE)

        async with AsyncClient(original.address, retries=0, timeout=30) as at_original:
            await at_original.info()  # a connection open before the pause
            with paused(original):
                copy = await NodeProcess.start(
                    tmp_path / "copy", region="us", extra_args=cluster.args_of("us")
                )
                try:
                    async with AsyncClient(copy.address, timeout=30) as at_copy:
                        # Retried through NOT_SERVING (pushback) until the copy decides.
                        hidden = await at_copy.claim(item.key, "worker-b", lease_seconds=60)
                    assert hidden.granted and hidden.fencing_token > first.fencing_token
                    # Sent while the original sleeps: in its socket when it wakes.
                    late = asyncio.create_task(
                        at_original.claim(item.key, "worker-c", lease_seconds=60)
                    )
                    await asyncio.sleep(0.2)
                    assert not late.done()
                except BaseException:
                    await copy.kill()
                    raise
            try:
                # Refused as napping, or, had eu's refusal come first, as a twin.
                with pytest.raises(Unavailable, match=r"stood still|catching up"):
                    answered = await late
                    # (Failed once in 28 make test runs; what it said, and why:)
                    print("the late claim was answered", answered, *original.output, sep="\n")
                # Settling again, it calls eu, which has heard the copy: both are
                # refused, and the original does not decide when its settle is over.
                await asyncio.sleep(SETTLE_S + 1)
                with pytest.raises(Unavailable, match="catching up"):
                    await at_original.claim(item.key, "worker-c", lease_seconds=60)
                assert not (await at_original.info()).claims_serving
            finally:
                await copy.kill()


async def test_a_node_whose_event_loop_stood_still_settles_again_before_it_decides(
    tmp_path: Path,
) -> None:
    """A nap (the loop blocked longer than ``nap_s``) counts like a restart: the
    next claim is refused NOT_SERVING, and the node decides again once a round
    with its peer began ``settle_s`` after the peer first answered it after the
    nap — no twin here, so it does. (``us`` is restarted first: a node whose
    process drew its node id needs no settle, as no copy of it can run.)"""
    async with Cluster(tmp_path, ["us", "eu"], nap_s=Tuning().nap_s) as c:
        us = await restarted_us(c)
        eu = c["eu"]
        await all_deciding(us, eu, within=SETTLE_S * 4)
        key = f"repo/{REPO}/mem/{TOPIC}/item-1"
        gate = us.replica.gate
        assert not gate.fresh
        naps = gate.naps  # a loaded machine may have stalled the process already
        time.sleep(gate.nap_s * 2)  # noqa: ASYNC251 - the event loop stands still: a nap
        async with AsyncClient(us.address, retries=0) as client:
            with pytest.raises(Unavailable, match="stood still"):
                await client.claim(key, "worker-a", lease_seconds=60)
        assert gate.naps > naps and not us.replica.deciding
        assert gauges(us, "fencemark_claims_serving") == {(): 0.0}
        async with AsyncClient(us.address) as client:  # retried through the pushback
            claim = await client.claim(key, "worker-a", lease_seconds=60)
        assert claim.granted
        # Its peer answered after the nap at the earliest, and the round that
        # counted began settle_s after that.
        assert time.monotonic() - gate.woke_at >= us.replicator.settle_s
        assert counters(us, "fencemark_naps")[()] == 1
        assert gate.twins == 0 and eu.replica.gate.twins == 0


async def test_a_round_begun_before_a_nap_does_not_settle_a_fresh_node_after_it(
    tmp_path: Path,
) -> None:
    """A node whose process drew its node id waits no ``settle_s`` after a nap (no copy
    of it can run), but only a round begun after the nap counts: one begun before and
    answered after (in flight across a SIGSTOP) says nothing of whether the peer has
    heard a copy meanwhile. Counted, it let a paused original that woke grant the
    claim waiting in its socket while its copy decided, for the milliseconds before
    the peer's twin refusal arrived (``test_an_original_paused_...``, once)."""
    async with Cluster(tmp_path, ["us", "eu"], nap_s=Tuning().nap_s) as c:
        us, eu = await c.start_all()
        await all_deciding(us, eu)
        gate = us.replica.gate
        assert gate.fresh
        link = us.replicator._peers["eu"]
        before = time.monotonic()  # a round that begins now ...
        time.sleep(gate.nap_s * 2)  # noqa: ASYNC251 - the event loop stands still: a nap
        gate.tick()  # ... and is answered once the nap is found
        assert gate.starting and not us.replica.deciding
        assert not us.replicator._settled(link, before)
        assert us.replicator._settled(link, time.monotonic())
        await all_deciding(us, eu)  # rounds begun since settle it


async def test_a_fresh_node_that_napped_asks_for_no_settle_long_wait(tmp_path: Path) -> None:
    """A node whose process drew its node id decides again after one round begun
    since its nap: its refusals meanwhile name no wait of ``settle_s`` (they did,
    and a retrying client waited seconds for a node that decided within one
    round)."""
    async with Cluster(tmp_path, ["us", "eu"], nap_s=Tuning().nap_s) as c:
        us, eu = await c.start_all()
        await all_deciding(us, eu)
        gate = us.replica.gate
        assert gate.fresh
        time.sleep(gate.nap_s * 2)  # noqa: ASYNC251 - the event loop stands still: a nap
        gate.tick()
        assert gate.starting and not us.replica.deciding
        # Refused, as the event loop has run no round since: with no wait named.
        with pytest.raises(NotServing, match="stood still") as refused:
            gate.check()
        assert refused.value.retry_after_ms == 0
        await all_deciding(us, eu)


async def test_a_round_begun_before_a_twin_refusal_does_not_end_the_catch_up_it_owes(
    tmp_path: Path,
) -> None:
    """The same for a catch-up owed anew (a peer refused this node as a twin, or its
    file went back in time): a round begun before the obligation and answered after
    it may have been served before the peer heard the twin, so only rounds begun
    since count."""
    async with Cluster(tmp_path, ["us", "eu"]) as c:
        us, eu = await c.start_all()
        await all_deciding(us, eu)
        gate = us.replica.gate
        link = us.replicator._peers["eu"]
        before = time.monotonic()  # a round that begins now ...
        await gate.twinned()  # ... and a refusal as a twin meanwhile
        assert gate.owed and not us.replica.deciding
        assert not us.replicator._settled(link, before)
        assert us.replicator._settled(link, time.monotonic())


async def test_a_claim_waiting_in_line_is_not_granted_while_its_home_settles_after_a_nap(
    tmp_path: Path,
) -> None:
    """Regression: the gate was checked once, as a claim arrived, and not when a
    waiter reached the head of the line; a node that napped (or came to owe a
    catch-up: a twin, a rollback) while a claim waited granted it when the lease
    before it lapsed, though it decided nothing else — a copy may have granted the
    same item meanwhile. Now every decision reads the gate under the record's lock:
    the waiter is refused NOT_SERVING (a retrying client queues again).

    ``us`` is restarted first: a node whose process drew its node id (a new file)
    settles after a nap with one round once its peer's quiet second is over, about
    when the lease would lapse; a restarted one settles for ``SETTLE_S`` after its
    peer first answers, so the lapse falls well inside the settle, however slowly
    a loaded machine queues the waiter (up to 4 s here)."""
    async with Cluster(tmp_path, ["us", "eu"], nap_s=Tuning().nap_s) as c:
        us = await restarted_us(c)
        await all_deciding(us, c["eu"], within=SETTLE_S * 4)
        gate = us.replica.gate
        assert not gate.fresh
        async with AsyncClient(us.address, retries=0) as client:
            item = await client.get(f"repo/{REPO}/mem/{TOPIC}/item-1")
            held = await client.claim(item.key, "worker-a", lease_seconds=gate.nap_s * 6)
            assert held.granted
            waiting = asyncio.create_task(
                client.claim(item.key, "worker-b", lease_seconds=60, wait_seconds=30)
            )
            await eventually(_queued(us, item.key), "worker-b waiting in line")
            naps = gate.naps
            time.sleep(gate.nap_s * 2)  # noqa: ASYNC251 - the event loop stands still: a nap
            # worker-a's lease lapses within 4 naps; us settles for 1 + SETTLE_S (5 s).
            with pytest.raises(Unavailable, match="stood still"):
                await waiting
        assert gate.naps > naps
        stored = await us.storage.get(item.key)
        assert stored is not None and stored.record.fence.fence == held.fencing_token


async def test_a_claim_next_waiting_for_work_is_not_granted_while_its_node_settles_after_a_nap(
    tmp_path: Path,
) -> None:
    """The same for ``ClaimNext``'s line: an item that turns up while the node
    settles after a nap wakes the waiter, which is refused NOT_SERVING, not handed
    the item by a node that decides nothing."""
    async with Cluster(tmp_path, ["us", "eu"], nap_s=Tuning().nap_s) as c:
        us, eu = await c.start_all()
        await all_deciding(us, eu)
        gate = us.replica.gate
        async with AsyncClient(us.address, retries=0) as client:
            waiting = asyncio.create_task(
                client.claim_next(REPO, TOPIC, "worker-b", lease_seconds=60, wait_seconds=30)
            )
            await asyncio.sleep(0.5)  # in the topic's line: nothing to take yet
            assert not waiting.done()
            time.sleep(gate.nap_s * 2)  # noqa: ASYNC251 - the event loop stands still: a nap
            await eventually(_settling(us), "us settling after its nap")
            # An unfenced creation is admitted while the node settles; it wakes the line.
            item = await client.remember(REPO, TOPIC, "item-1", tags=["homeRegion:us"])
            with pytest.raises(Unavailable, match="stood still"):
                await waiting
        stored = await us.storage.get(item.record.key)
        assert stored is not None and stored.record.fence.fence == 0


async def test_nodes_that_nap_together_wait_as_asked_instead_of_calling_each_other(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two nodes whose processes stood still together (one host, one suspended VM)
    each refuse replication calls for ``nap_quiet_s`` after waking, asking the caller
    to wait that long, while each one's own calls show the other it is up. Were such
    a call to end the wait its refusal asked for, the two would answer each other's
    refusals with calls as fast as they came (about 800 in that second, here): a
    peer's call ends a back-off, never the wait the peer asked for."""
    caplog.set_level(logging.INFO, logger="fencemark.node.access")
    async with Cluster(tmp_path, ["us", "eu"], nap_s=Tuning().nap_s) as c:
        us, eu = await c.start_all()
        await all_deciding(us, eu)
        caplog.clear()
        naps = us.replica.gate.naps, eu.replica.gate.naps
        time.sleep(Tuning().nap_s * 2)  # noqa: ASYNC251 - both event loops stand still
        await eventually(_settling(us), "us settling after its nap")
        await all_deciding(us, eu, within=SETTLE_S * 2)
        refused = [r for r in caplog.records if getattr(r, "code", "") == "UNAVAILABLE"]
        # A round, a heartbeat and a push refused, each way, at most twice in the second.
        assert 0 < len(refused) <= 12, [r.getMessage() for r in refused]
        assert us.replica.gate.naps > naps[0] and eu.replica.gate.naps > naps[1]


def _queued(node: NodeServer, key: str) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return node.claims.queue_depth(key) == 1

    return check


def _settling(node: NodeServer) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return not node.replica.deciding

    return check


async def test_a_grant_decided_before_a_nap_is_not_handed_out_after_it(tmp_path: Path) -> None:
    """The process stands still after the grant was decided and before its reply:
    a copy may have granted the same claim meanwhile, so the caller is refused
    (NOT_SERVING) instead; the grant stays in the file and its lease lapses."""
    async with Cluster(tmp_path, ["us", "eu"], nap_s=Tuning().nap_s) as c:
        us, eu = await c.start_all()
        await all_deciding(us, eu)
        async with AsyncClient(us.address) as client:
            item = (await client.remember(REPO, TOPIC, "item-1", tags=["homeRegion:us"])).record

        naps = us.replica.gate.naps  # a loaded machine may have stalled the process already

        def nap_once(key: str) -> None:  # called as the grant is committed
            if key == item.key and us.replica.gate.naps == naps:
                time.sleep(us.replica.gate.nap_s * 2)

        us.replica.on_change(nap_once)
        async with AsyncClient(us.address, retries=0) as client:
            with pytest.raises(Unavailable, match="stood still"):
                await client.claim(item.key, "worker-a", lease_seconds=2)
        stored = await us.storage.get(item.key)
        assert stored is not None and stored.record.fence.fence >= 1  # decided, not given
        assert us.replica.gate.naps > naps


async def test_a_copy_does_not_settle_on_a_peer_that_was_paused_while_it_settled(
    tmp_path: Path,
) -> None:
    """The other order that dodges the heartbeat: the *peer* is paused just after
    it first answered the copy, and wakes after the copy sent the round that
    would count. Its sockets then hold the original's heartbeat and the copy's
    round, in no order gRPC promises: answered first, the round would let the
    copy decide beside its original (in the runs here gRPC served them in arrival
    order, the original's first, so this shape passes without the rule too; a
    copy of a file that still owed its catch-up failed it, see the next test). A
    node that napped refuses the replication calls it is handed for a moment
    after waking (``grant_gate.quiet``), so the copy's settle starts again, and
    every live node keeps calling each peer every heartbeat whatever its earlier
    calls met, so the peer hears the original before the copy's settle ends."""
    async with ProcessCluster(tmp_path, ["us", "eu"]) as cluster:
        original, eu = await cluster.start_all()
        async with AsyncClient(original.address) as client:
            await client.remember(REPO, TOPIC, "item-1", tags=["homeRegion:us"])

            async def original_deciding() -> bool:  # its file says: caught up
                return (await client.info()).claims_serving

            await eventually(original_deciding, "the original deciding")
        (tmp_path / "copy").mkdir()
        copy_file(original.data_dir / DB_FILE, tmp_path / "copy" / DB_FILE)
        # --start-wait well above the test: the copy, its peer silent, would decide
        # after it whatever the peer would have said (the documented bound).
        copy = await NodeProcess.start(
            tmp_path / "copy",
            region="us",
            extra_args=(*cluster.args_of("us"), "--start-wait", "60"),
        )
        try:
            async with AsyncClient(copy.address, retries=0) as at_copy:

                async def eu_answered_the_copy() -> bool:
                    (peer,) = (await at_copy.info()).peers
                    return peer.last_sync is not None

                await eventually(eu_answered_the_copy, "eu answering the copy", every=0.005)
                with paused(eu):
                    await asyncio.sleep(SETTLE_S + 1)  # the copy's round waits in eu
                decided = await decides_within(at_copy, SETTLE_S + 2)
                assert not decided, "the copy decided claims beside its live original"
                async with AsyncClient(original.address) as at_original:
                    assert not (await at_original.info()).claims_serving
        finally:
            await copy.kill()


async def test_a_copy_of_a_file_that_still_owes_its_catch_up_settles_too(
    tmp_path: Path,
) -> None:
    """A node id drawn by a process that has not yet caught up (its peer down) is
    copied, and both start catching up once the peer is up. Only the process that
    drew the id may count every complete round (no other can have it); a file that
    was opened, not created, settles like a restart — so the copy is refused as a
    twin instead of deciding beside the original. Before, every node owing a
    catch-up counted every round, and both decided until the peer told."""
    async with ProcessCluster(tmp_path, ["us", "eu"]) as cluster:
        original = await cluster.start("us")  # eu not up: us owes its catch-up
        async with AsyncClient(original.address) as client:
            assert not (await client.info()).claims_serving
            await client.remember(REPO, TOPIC, "item-1", tags=["homeRegion:us"])
        (tmp_path / "copy").mkdir()
        copy_file(original.data_dir / DB_FILE, tmp_path / "copy" / DB_FILE)
        await cluster.start("eu")
        copy = await NodeProcess.start(
            tmp_path / "copy", region="us", extra_args=cluster.args_of("us")
        )
        try:
            async with (
                AsyncClient(copy.address, retries=0) as at_copy,
                AsyncClient(original.address, retries=0) as at_original,
            ):
                decided = await decides_within(at_copy, SETTLE_S + 3)
                assert not decided, "the copy decided claims beside its original"
                assert not (await at_original.info()).claims_serving
        finally:
            await copy.kill()

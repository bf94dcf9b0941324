"""SPEC §4 claims: outcomes as values, FIFO waiting, renewals, releases and status.

All over gRPC against a real node; leases that must lapse are 1 s long.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest

from fencemark.client import (
    AsyncClient,
    ClaimConflict,
    ClaimResult,
    FencemarkError,
    InvalidArgument,
)
from fencemark.node.api.server import NodeServer
from fencemark.node.core.claims import LOOK_AGAIN_S, Claims, until_lapse
from fencemark.node.core.replica import Replica
from fencemark.node.crdt import Grant, HybridClock, Record, Stamp, codec
from fencemark.node.crdt.fence import HISTORY
from fencemark.node.crdt.hlc import wall_clock_ms
from fencemark.node.rules.admission import ANYONE, Caller, Outcome
from fencemark.node.rules.errors import Exhausted, InvalidInput, NoMajority, NotServing, Reason
from fencemark.node.store.storage import DB_FILE, Storage
from tests.conftest import StartNode

REPO, TOPIC = "claims", "backlog"
LONG_LEASE = 60.0


def key_of(id_: str) -> str:
    return f"repo/{REPO}/mem/{TOPIC}/{id_}"


async def make(client: AsyncClient, id_: str) -> str:
    result = await client.remember(REPO, TOPIC, id_, title=id_)
    assert result.created
    return result.record.key


async def claim(client: AsyncClient, key: str, owner: str, lease: float = LONG_LEASE) -> int:
    result = await client.claim(key, owner, lease_seconds=lease)
    assert result.granted, result
    return result.fencing_token


async def server_now(client: AsyncClient) -> datetime:
    now = (await client.info()).now
    assert now is not None
    return now


async def sleep_past(client: AsyncClient, moment: datetime | None) -> None:
    """Sleep until the node's own clock is past ``moment``."""
    assert moment is not None
    remaining = (moment - await server_now(client)).total_seconds()
    await asyncio.sleep(max(remaining, 0.0) + 0.15)


async def wait_for_queue_depth(client: AsyncClient, key: str, depth: int) -> None:
    """Poll claim_status until ``depth`` claimers wait (the arrival is observable)."""
    for _ in range(500):
        if (await client.claim_status(key)).queue_depth == depth:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"queue depth of {key} never reached {depth}")


# -- claim outcomes ----------------------------------------------------------------------


async def test_a_free_record_is_granted_with_a_token_and_a_server_clock_expiry(
    client: AsyncClient,
) -> None:
    """SPEC §1 step 2: granted, a fencing token, an absolute UTC expiry from the node's clock."""
    key = await make(client, "grant")
    before = await server_now(client)
    result = await client.claim(key, "worker-a", lease_seconds=30)
    after = await server_now(client)
    assert result.granted
    assert result.reason == ""
    assert result.fencing_token == 1
    assert result.home_region == "local"
    assert result.lease_expires_at is not None
    assert result.lease_expires_at.utcoffset() == timedelta(0)
    lease = timedelta(seconds=30)
    assert before + lease <= result.lease_expires_at <= after + lease


async def test_a_claim_without_lease_seconds_gets_a_60_second_lease(client: AsyncClient) -> None:
    """claims.proto: lease_seconds 0 means 60."""
    key = await make(client, "default-lease")
    before = await server_now(client)
    result = await client.claim(key, "worker-a")
    after = await server_now(client)
    assert result.granted and result.lease_expires_at is not None
    lease = timedelta(seconds=60)
    assert before + lease <= result.lease_expires_at <= after + lease


async def test_a_held_record_answers_contended_at_once_without_wait(client: AsyncClient) -> None:
    """SPEC §4: ``contended`` when held and the caller did not wait (wait_seconds 0)."""
    key = await make(client, "contended")
    token = await claim(client, key, "worker-a")
    loop = asyncio.get_running_loop()
    started = loop.time()
    result = await client.claim(key, "worker-b")
    elapsed = loop.time() - started
    assert (result.granted, result.reason, result.home_region) == (False, "contended", "local")
    assert result.fencing_token == 0
    assert elapsed < 1.0, "wait_seconds=0 must not queue"
    assert (await client.claim_status(key)).fence == token


async def test_a_waiter_that_never_gets_the_claim_answers_timeout_after_wait_seconds(
    client: AsyncClient,
) -> None:
    """SPEC §4: ``timeout`` after waiting ``wait_seconds`` in the FIFO queue."""
    key = await make(client, "timeout")
    token = await claim(client, key, "worker-a")
    loop = asyncio.get_running_loop()
    started = loop.time()
    result = await client.claim(key, "worker-b", wait_seconds=1.0)
    elapsed = loop.time() - started
    assert (result.granted, result.reason) == (False, "timeout")
    assert elapsed >= 0.95, f"answered after {elapsed:.2f} s, before wait_seconds"
    assert elapsed < 5.0, f"answered after {elapsed:.2f} s, far beyond wait_seconds"
    status = await client.claim_status(key)
    assert status.queue_depth == 0
    assert status.claim is not None and status.claim.fencing_token == token


async def test_a_claim_on_an_unknown_record_answers_missing(client: AsyncClient) -> None:
    """SPEC §4: ``missing`` when there is no such record."""
    result = await client.claim(key_of("nowhere"), "worker-a")
    assert (result.granted, result.reason, result.fencing_token) == (False, "missing", 0)


async def test_a_claim_on_an_unknown_record_does_not_wait(client: AsyncClient) -> None:
    """SPEC §4: only ``contended`` queues; ``missing`` is answered at once even with a wait."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    result = await client.claim(key_of("nowhere"), "worker-a", wait_seconds=5)
    assert (result.granted, result.reason) == (False, "missing")
    assert loop.time() - started < 2.5


async def test_concurrent_claimers_of_a_free_record_get_exactly_one_grant(
    client: AsyncClient,
) -> None:
    """SPEC §4: a token is granted once; racing claimers see one grant, the rest contended."""
    key = await make(client, "race")
    results = await asyncio.gather(*(client.claim(key, f"w{i}") for i in range(10)))
    granted = [r for r in results if r.granted]
    assert len(granted) == 1
    assert granted[0].fencing_token == 1
    assert sorted(r.reason for r in results if not r.granted) == ["contended"] * 9
    assert (await client.claim_status(key)).fence == 1


async def test_concurrent_retries_by_one_owner_share_one_token(client: AsyncClient) -> None:
    """SPEC §4: a claim retried by the same owner is answered from the state, never re-granted."""
    key = await make(client, "retry-race")
    results = await asyncio.gather(*(client.claim(key, "worker-a") for _ in range(10)))
    assert all(r.granted for r in results)
    assert {r.fencing_token for r in results} == {1}
    assert (await client.claim_status(key)).fence == 1


async def test_a_claim_on_a_deleted_record_answers_missing(client: AsyncClient) -> None:
    """SPEC §4: a deleted record is missing for claims."""
    key = await make(client, "deleted")
    await client.delete(key)
    result = await client.claim(key, "worker-a")
    assert (result.granted, result.reason) == (False, "missing")


async def test_waiting_claimers_are_granted_in_order_of_arrival(client: AsyncClient) -> None:
    """SPEC §4: waiters queue FIFO; each release hands the claim to the next in line."""
    key = await make(client, "fifo")
    holder = await claim(client, key, "holder")
    waiters: dict[str, asyncio.Task[ClaimResult]] = {}
    for depth, owner in enumerate(("first", "second", "third"), start=1):
        waiters[owner] = asyncio.create_task(
            client.claim(key, owner, lease_seconds=LONG_LEASE, wait_seconds=20)
        )
        await wait_for_queue_depth(client, key, depth)

    order: list[tuple[str, int]] = []
    token = holder
    pending = set(waiters.values())
    while pending:
        released = await client.release_claim(key, token)
        assert released.released
        async with asyncio.timeout(10):
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1, "one release must grant exactly one waiter"
        owner = next(name for name, task in waiters.items() if task in done)
        result = done.pop().result()
        assert result.granted, result
        token = result.fencing_token
        order.append((owner, token))
        assert (await client.claim_status(key)).queue_depth == len(pending)

    assert [owner for owner, _ in order] == ["first", "second", "third"]
    tokens = [holder] + [t for _, t in order]
    assert tokens == sorted(set(tokens)), f"tokens must strictly increase: {tokens}"


async def test_a_newcomer_does_not_jump_the_queue(client: AsyncClient) -> None:
    """SPEC §4: FIFO; a claim that arrives while others wait goes behind them."""
    key = await make(client, "no-jumping")
    holder = await claim(client, key, "holder")
    waiter = asyncio.create_task(client.claim(key, "waiter", wait_seconds=20))
    await wait_for_queue_depth(client, key, 1)
    assert (await client.release_claim(key, holder)).released
    newcomer = await client.claim(key, "newcomer")
    assert (newcomer.granted, newcomer.reason) == (False, "contended")
    async with asyncio.timeout(10):
        result = await waiter
    assert result.granted and result.fencing_token == holder + 1


async def test_a_waiter_that_gives_up_leaves_the_queue(client: AsyncClient) -> None:
    """SPEC §4: the queue only holds callers still waiting (a cancelled call leaves it)."""
    key = await make(client, "give-up")
    holder = await claim(client, key, "holder")
    quitter = asyncio.create_task(client.claim(key, "quitter", wait_seconds=20))
    await wait_for_queue_depth(client, key, 1)
    quitter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await quitter
    await wait_for_queue_depth(client, key, 0)
    assert (await client.release_claim(key, holder)).released
    result = await client.claim(key, "next")
    assert result.granted and result.fencing_token == holder + 1


async def test_a_waiter_is_granted_when_the_lease_lapses_without_release(
    client: AsyncClient,
) -> None:
    """SPEC §4: the head of the queue gets the claim once the holder's lease lapses."""
    key = await make(client, "lapse")
    holder = await client.claim(key, "holder", lease_seconds=1)
    assert holder.granted and holder.lease_expires_at is not None
    result = await client.claim(key, "waiter", lease_seconds=LONG_LEASE, wait_seconds=10)
    granted_at = await server_now(client)
    assert result.granted, result
    assert result.fencing_token > holder.fencing_token
    assert granted_at >= holder.lease_expires_at


# -- FIFO hand-over and waiter accounting (issue 15) ---------------------------------------
#
# Some of these drive the node's ``Claims`` in-process, where a test can act between
# two steps of the node without racing a network round trip.

WAIT = 120.0  # a waiter's wait_seconds, when the test must tell "soon" from "at its deadline"
SOON = 20.0  # a bounded wait for an event that is due within a lease of 1-2 s


async def queued(claims: Claims, key: str, depth: int) -> None:
    """Bounded wait until ``depth`` claimers wait in line for ``key``."""
    for _ in range(500):
        if claims.queue_depth(key) == depth:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"queue depth of {key} never reached {depth}")


async def test_one_waiter_is_a_line_a_newcomer_may_not_jump(
    client: AsyncClient, node: NodeServer
) -> None:
    """SPEC §4 FIFO: the moment the holder releases, the record is free, and the one
    waiter it woke has not taken it yet; a claim arriving then is still ``contended``
    (a line of one is a line), and the waiter gets the next token."""
    key = await make(client, "line-of-one")
    claims = node.claims
    holder = await claims.claim(key, "holder", lease_seconds=LONG_LEASE, caller=ANYONE)
    waiter = asyncio.create_task(claims.claim(key, "waiter", wait_seconds=WAIT, caller=ANYONE))
    await queued(claims, key, 1)
    assert (await claims.release(key, holder.token, caller=ANYONE)).ok
    # No await between the release and this claim: the waiter has not run yet.
    newcomer = await claims.claim(key, "newcomer", lease_seconds=LONG_LEASE, caller=ANYONE)
    assert newcomer == Outcome(False, Reason.CONTENDED, home_region="local", fence=holder.token)
    async with asyncio.timeout(SOON):
        took = await waiter
    assert (took.ok, took.token) == (True, holder.token + 1)


async def test_when_the_head_of_the_line_leaves_the_next_one_becomes_head(
    client: AsyncClient, node: NodeServer
) -> None:
    """SPEC §4 FIFO: only the head of the line watches the holder's lease; the others
    sleep until woken. So when the head gives up, the waiter behind it must be woken to
    take over the watch, and it gets the claim as the lease lapses, long before its own
    deadline; the one behind it keeps waiting."""
    key = await make(client, "head-leaves")
    claims = node.claims
    holder = await claims.claim(key, "holder", lease_seconds=2, caller=ANYONE)
    lines = [
        asyncio.create_task(
            claims.claim(key, owner, lease_seconds=LONG_LEASE, wait_seconds=WAIT, caller=ANYONE)
        )
        for owner in ("first", "second", "third")
    ]
    first, second, third = lines
    await queued(claims, key, 3)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first  # (premise: it left before the 2 s lease lapsed, without the claim)
    assert claims.queue_depth(key) == 2
    async with asyncio.timeout(SOON):
        took = await second
    assert (took.ok, took.token) == (True, holder.token + 1)
    assert not third.done() and claims.queue_depth(key) == 1
    third.cancel()
    with pytest.raises(asyncio.CancelledError):
        await third


async def test_a_waiter_cancelled_as_it_is_woken_leaves_the_line_without_the_claim(
    client: AsyncClient, node: NodeServer
) -> None:
    """Regression (issue 15): a waiter whose caller gave up in the moment the release
    woke it (its wake-up and its cancellation both pending) swallowed the cancellation
    (``asyncio.wait_for`` on Python 3.11 returns the awaited result if it is done when
    the cancellation arrives), stayed in line and was granted the claim for a caller
    that had left: the claim sat with nobody for a whole lease while the line behind
    it starved. Now the cancellation wins, and the next in line takes the claim."""
    key = await make(client, "cancelled-as-woken")
    claims = node.claims
    holder = await claims.claim(key, "holder", lease_seconds=LONG_LEASE, caller=ANYONE)
    first = asyncio.create_task(claims.claim(key, "first", wait_seconds=WAIT, caller=ANYONE))
    await queued(claims, key, 1)
    second = asyncio.create_task(claims.claim(key, "second", wait_seconds=WAIT, caller=ANYONE))
    await queued(claims, key, 2)
    assert (await claims.release(key, holder.token, caller=ANYONE)).ok  # wakes the head ...
    first.cancel()  # ... whose caller leaves before it has run
    with pytest.raises(asyncio.CancelledError):
        await first
    async with asyncio.timeout(SOON):
        took = await second
    assert (took.ok, took.token) == (True, holder.token + 1)
    status = await claims.status(key, caller=ANYONE)
    assert status.holder is not None and status.holder.owner == "second"


async def test_a_waiter_whose_record_was_deleted_answers_missing(client: AsyncClient) -> None:
    """SPEC §4: outcomes are re-checked at the head of the line against the state; a
    record deleted while its claimers wait answers ``missing`` at once, never a
    ``timeout`` after the whole wait."""
    key = await make(client, "deleted-while-waiting")
    holder = await claim(client, key, "holder")
    waiter = asyncio.create_task(client.claim(key, "waiter", wait_seconds=WAIT))
    await wait_for_queue_depth(client, key, 1)
    assert (await client.delete(key, fencing_token=holder)).deleted  # the holder is done
    assert (await client.release_claim(key, holder)).released  # ... and lets go
    async with asyncio.timeout(SOON):
        result = await waiter
    assert (result.granted, result.reason, result.fencing_token) == (False, "missing", 0)


async def test_a_waiter_whose_record_moved_home_answers_wrong_region(
    client: AsyncClient, node: NodeServer
) -> None:
    """SPEC §2: the same id created earlier in another region while cut off becomes the
    home when the births meet, and this node decides claims on it no more. A waiter in
    line here is told ``wrong_region`` with the new home named (where a routing client
    goes next) when it looks again at the lapse, never a ``timeout`` after the whole wait."""
    key = await make(client, "rehomed-while-waiting")
    holder = await client.claim(key, "holder", lease_seconds=2)
    assert holder.granted
    waiter = asyncio.create_task(client.claim(key, "waiter", wait_seconds=WAIT))
    await wait_for_queue_depth(client, key, 1)
    stored = await node.storage.get(key)
    assert stored is not None
    born_here = stored.record.births["local"].stamp
    earlier = Record(key).create("us-east", Stamp(0, born_here.hlc - 1, "us-east-node"))
    assert await node.replica.merge(earlier)
    async with asyncio.timeout(SOON):
        result = await waiter
    assert (result.granted, result.reason, result.home_region) == (False, "wrong_region", "us-east")


async def test_every_wait_gives_its_place_back_so_a_client_may_wait_any_number_of_times(
    start_node: StartNode,
) -> None:
    """The per-client waiter limit bounds waits at once, not in total: each wait that
    ends gives its place back exactly once. More waits in a row than the limit all get
    to wait (and time out), and after them the limit still binds: two wait, a third is
    refused RESOURCE_EXHAUSTED."""
    node = await start_node(max_waiters_per_client=2)
    async with AsyncClient(node.address, retries=0) as client:
        key = await make(client, "waiter-accounting")
        await claim(client, key, "holder")
        for i in range(5):
            result = await client.claim(key, f"patient-{i}", wait_seconds=0.2)
            assert (result.granted, result.reason) == (False, "timeout"), i
        waiting = [
            asyncio.create_task(client.claim(key, owner, wait_seconds=WAIT))
            for owner in ("w1", "w2")
        ]
        await wait_for_queue_depth(client, key, 2)
        with pytest.raises(FencemarkError) as refused:
            await client.claim(key, "w3", wait_seconds=1.0)
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
    await queued(node.claims, key, 0)
    assert node.claims.waiting == 0


class CountingWall:
    """This machine's wall clock, counting how often it is read: every look a waiter
    takes at the claim reads it (the grant decision and the time to the lapse)."""

    def __init__(self) -> None:
        self.reads = 0

    def __call__(self) -> int:
        self.reads += 1
        return wall_clock_ms()


@contextlib.asynccontextmanager
async def claims_on_file(
    path: Path, wall: Callable[[], int] = wall_clock_ms, **limits: int
) -> AsyncIterator[Claims]:
    """The node's claims over its replica and a real SQLite file, on ``wall`` (nothing
    else of a node, so nothing else reads that clock), with the waiter ``limits``."""
    storage = await Storage.open(path / DB_FILE)
    replica = Replica(storage, HybridClock(wall_ms=wall), "local")
    await replica.gate.caught_up()  # one node on a new file: nobody to learn from
    try:
        yield Claims(replica, **limits)
    finally:
        await storage.close()


@pytest.fixture
async def counted(tmp_path: Path) -> AsyncIterator[tuple[Claims, CountingWall]]:
    """Claims on a wall clock that counts its reads."""
    wall = CountingWall()
    async with claims_on_file(tmp_path, wall) as claims:
        yield claims, wall


async def made(claims: Claims, id_: str) -> str:
    remembered = await claims.replica.remember(
        REPO, TOPIC, id_, fields={"title": id_}, tags=(), caller=ANYONE
    )
    return remembered.stored.record.key


LOOKS = 30  # clock reads a wait may take: a few looks at ~3 reads each, not a poll


async def test_a_waiter_takes_over_at_the_lapse_without_polling(
    counted: tuple[Claims, CountingWall],
) -> None:
    """SPEC §4: the head of the line sleeps until the holder's lease lapses, then gets
    the claim: soon after the lapse, not at its own deadline; and it looks at the claim
    a handful of times meanwhile, not in a busy loop."""
    claims, wall = counted
    key = await made(claims, "hand-over")
    holder = await claims.claim(key, "holder", lease_seconds=1, caller=ANYONE)
    wall.reads = 0
    async with asyncio.timeout(SOON):
        took = await claims.claim(
            key, "waiter", lease_seconds=LONG_LEASE, wait_seconds=WAIT, caller=ANYONE
        )
    assert (took.ok, took.token) == (True, holder.token + 1)
    assert wall.reads <= LOOKS, f"{wall.reads} clock reads while waiting: it polled"


async def test_a_waiter_that_times_out_does_not_poll(
    counted: tuple[Claims, CountingWall],
) -> None:
    """SPEC §4: a waiter that never gets the claim sleeps towards its deadline (the
    lease outlasts it) and answers ``timeout`` then, without a busy loop before or
    after it."""
    claims, wall = counted
    key = await made(claims, "no-poll")
    await claims.claim(key, "holder", lease_seconds=LONG_LEASE, caller=ANYONE)
    wall.reads = 0
    result = await claims.claim(key, "waiter", wait_seconds=0.5, caller=ANYONE)
    assert (result.ok, result.reason) == (False, Reason.TIMEOUT)
    assert wall.reads <= LOOKS, f"{wall.reads} clock reads while waiting: it polled"


# -- a record the decider does not hold yet (a region of several members) --------------------


async def test_a_deciding_node_looks_up_only_a_record_it_does_not_hold(tmp_path: Path) -> None:
    """At a member of a region of several, ``Claims.look_up`` fetches a record from
    the fellow members (``Majority.look_up``; over the wire in
    ``test_member_faults.py``). Here the fellow is another replica on its own file,
    and the lookup merges its state. A claim on a record the deciding node lacks
    looks it up first and is granted; one on a record it holds looks nothing up; a
    lookup that cannot tell refuses the claim and writes nothing."""
    (tmp_path / "fellow").mkdir()
    (tmp_path / "decider").mkdir()
    async with (
        claims_on_file(tmp_path / "fellow") as fellow,
        claims_on_file(tmp_path / "decider") as claims,
    ):
        asked: list[str] = []

        async def from_the_fellow(key: str) -> None:
            asked.append(key)
            stored = await fellow.replica.find(key)
            if stored is not None:
                await claims.replica.merge(stored.record)

        claims.look_up = from_the_fellow
        elsewhere = await made(fellow, "written-at-the-fellow")
        granted = await claims.claim(elsewhere, "worker", caller=ANYONE)
        assert (granted.ok, asked) == (True, [elsewhere])
        here = await made(claims, "written-here")
        assert (await claims.claim(here, "worker", caller=ANYONE)).ok
        assert asked == [elsewhere]
        nobody = await claims.claim(key_of("nobodys"), "worker", caller=ANYONE)
        assert (nobody.ok, nobody.reason) == (False, Reason.MISSING)

        async def cannot_tell(key: str) -> None:
            raise NotServing("too few fellow members answered", retry_after_ms=1000)

        claims.look_up = cannot_tell
        unknown = await made(fellow, "not-here-yet")
        with pytest.raises(NotServing):
            await claims.claim(unknown, "worker", caller=ANYONE)
        assert await claims.replica.find(unknown) is None


@dataclass
class Acknowledging:
    """A member's ``Storage.acknowledge`` as the tests see it: what it was asked to
    have a majority hold (key, state), and whether a majority answers."""

    majority: bool = True
    asked: list[tuple[str, bytes]] = field(default_factory=list)

    @classmethod
    def on(cls, claims: Claims, *, majority: bool) -> Acknowledging:
        hook = cls(majority)
        claims.replica.storage.acknowledge = hook
        return hook

    async def __call__(self, keys: list[str], states: list[bytes], events: object) -> None:
        self.asked.extend(zip(keys, states, strict=True))
        if not self.majority:
            raise NoMajority("local", 1, 2, 3, "too few members answered")

    def keys(self) -> list[str]:
        return [key for key, _ in self.asked]


@pytest.mark.parametrize("outcome", ["done", ""], ids=["done", "plain"])
async def test_a_release_answered_from_the_state_as_it_is_is_acknowledged_again(
    tmp_path: Path, outcome: str
) -> None:
    """At a member of a region of several, a commit is answered once a majority holds
    it (``Storage.acknowledge``; over the wire in ``test_member_faults.py``). A
    retried release changes nothing — it is in the file already — and is answered
    from the state as it is: a state that may be in this file alone (the first
    attempt answered ``NO_MAJORITY``). So that state is acknowledged again first,
    and without a majority the retry is refused too. A release that changes the
    record is acknowledged once, as its commit; a refused one asserts nothing."""
    async with claims_on_file(tmp_path) as claims:
        key = await made(claims, "item-1")
        token = (await claims.claim(key, "worker", caller=ANYONE)).fence
        hook = Acknowledging.on(claims, majority=True)
        first = await claims.release(key, token, caller=ANYONE, outcome=outcome)
        assert first.ok and hook.keys() == [key]  # its commit
        stored = await claims.replica.storage.get(key)
        assert stored is not None
        hook.majority = False
        with pytest.raises(NoMajority):
            await claims.release(key, token, caller=ANYONE, outcome=outcome)
        assert hook.asked[-1] == (key, codec.encode(stored.record)), "the state as it is"
        hook.majority = True
        retried = await claims.release(key, token, caller=ANYONE, outcome=outcome)
        assert retried.ok and hook.keys() == [key] * 3
        refused = await claims.release(key, token + 1, caller=ANYONE, outcome=outcome)
        assert not refused.ok and hook.keys() == [key] * 3


async def test_grants_and_renewals_answered_from_the_state_as_it_is_are_acknowledged_again(
    tmp_path: Path,
) -> None:
    """The same for the other answers a retry may draw from an unchanged state: on a
    clock that stands still, a claim retried by its owner and a renewal asked again
    each leave the lease as it was; each is acknowledged again before its yes, and
    refused without a majority (``ClaimNext``'s retry: ``test_work_queue.py``)."""
    async with claims_on_file(tmp_path, wall=lambda: NOW) as claims:
        key = await made(claims, "item-1")
        granted = await claims.claim(key, "worker", caller=ANYONE, lease_seconds=30)
        assert granted.ok
        hook = Acknowledging.on(claims, majority=False)
        calls: list[Callable[[], Awaitable[object]]] = [
            lambda: claims.claim(key, "worker", caller=ANYONE, lease_seconds=30),
            lambda: claims.renew(key, granted.fence, caller=ANYONE, lease_seconds=30),
        ]
        for call in calls:
            before = await claims.replica.storage.get(key)
            with pytest.raises(NoMajority):
                await call()
            assert await claims.replica.storage.get(key) == before, "nothing changed"
        assert hook.keys() == [key] * 2
        hook.majority = True
        assert (await claims.claim(key, "worker", caller=ANYONE, lease_seconds=30)).ok
        assert (await claims.renew(key, granted.fence, caller=ANYONE, lease_seconds=30)).ok
        assert hook.keys() == [key] * 4


# -- the rules of waiting, in-process (issue 15) ------------------------------------------

NOW = 1_767_225_600_000  # a wall-clock moment, in ms


def leased_until(expiry_ms: int) -> Record:
    """A record born here, claimed by its home with a lease to ``expiry_ms``."""
    record = Record(key_of("leased")).create("local", Stamp(0, NOW << 16, "local-node"))
    grant = Grant(granted_hlc=NOW << 16, owner="holder", region="local")
    return record.with_fence(record.fence.grant(1, grant, expiry_ms))


def test_the_head_of_the_line_looks_again_a_millisecond_after_the_lapse() -> None:
    """The head of the line sleeps until the holder's lease lapses, then a millisecond
    (``LOOK_AGAIN_S``: timers fire at or after their time, never before), and looks
    again; in seconds, from the node's clock in milliseconds."""
    assert until_lapse(leased_until(NOW + 1_500), NOW) == pytest.approx(1.501, abs=1e-9)
    assert until_lapse(leased_until(NOW + 1), NOW) == pytest.approx(0.002, abs=1e-9)
    assert LOOK_AGAIN_S == 0.001


def test_with_no_live_lease_the_head_of_the_line_looks_again_at_once() -> None:
    """A lease that lapsed (or a record gone) since the claim was refused: look again
    after ``LOOK_AGAIN_S``, never a negative or a long sleep."""
    assert until_lapse(None, NOW) == LOOK_AGAIN_S
    assert until_lapse(leased_until(NOW), NOW) == LOOK_AGAIN_S  # lapses at its expiry
    assert until_lapse(leased_until(NOW - 5_000), NOW) == LOOK_AGAIN_S
    released = leased_until(NOW + 60_000)
    released = released.with_fence(released.fence.release(1))
    assert until_lapse(released, NOW) == LOOK_AGAIN_S


async def test_claims_and_renewals_without_a_lease_get_the_60_second_default(
    tmp_path: Path,
) -> None:
    """claims.proto: lease_seconds 0 (the default) means 60 s, from the node's clock."""
    async with claims_on_file(tmp_path) as claims:
        key = await made(claims, "default-lease")
        before = wall_clock_ms()
        granted = await claims.claim(key, "holder", caller=ANYONE)
        assert granted.ok and before + 60_000 <= granted.expiry_ms <= wall_clock_ms() + 60_000
        await asyncio.sleep(0.05)
        before = wall_clock_ms()
        renewed = await claims.renew(key, granted.token, caller=ANYONE)
        assert renewed.ok and before + 60_000 <= renewed.expiry_ms <= wall_clock_ms() + 60_000


@pytest.mark.parametrize("token", [0, -1])
async def test_a_token_below_one_is_invalid_input_naming_fencing_token(
    tmp_path: Path, token: int
) -> None:
    """SPEC §4: fencing tokens start at 1; 0 or less is bad input, refused before any
    decision (the claim is left as it was)."""
    async with claims_on_file(tmp_path) as claims:
        key = await made(claims, "token-zero")
        granted = await claims.claim(key, "holder", lease_seconds=LONG_LEASE, caller=ANYONE)
        for call in (claims.renew, claims.release):
            with pytest.raises(InvalidInput) as refused:
                await call(key, token, caller=ANYONE)
            assert [name for name, _ in refused.value.violations] == ["fencing_token"]
        status = await claims.status(key, caller=ANYONE)
        assert (status.token, status.expiry_ms) == (granted.token, granted.expiry_ms)
        assert (await claims.release(key, 1, caller=ANYONE)).ok  # 1 is a token


async def test_every_claim_decided_is_counted_by_outcome_and_only_queued_ones_as_waits(
    tmp_path: Path,
) -> None:
    """The metrics' ``fencemark_claims_total{outcome}`` and ``fencemark_claim_waits_total``:
    each claim counts once under ``granted`` or its reason; only a claim that stood in
    line counts as a wait (``missing`` answers at once even with a wait)."""
    async with claims_on_file(tmp_path) as claims:
        assert (claims.outcomes, claims.waits) == (Counter(), 0)
        key = await made(claims, "counted")
        await claims.claim(key, "holder", lease_seconds=LONG_LEASE, caller=ANYONE)
        await claims.claim(key, "rival", caller=ANYONE)
        await claims.claim(key_of("nowhere"), "rival", wait_seconds=WAIT, caller=ANYONE)
        assert claims.waits == 0
        await claims.claim(key, "patient", wait_seconds=0.1, caller=ANYONE)
        assert claims.waits == 1
        assert claims.outcomes == Counter(granted=1, contended=1, missing=1, timeout=1)


async def wait_in_line(claims: Claims, key: str, owner: str, client: str) -> asyncio.Task[Outcome]:
    """A claimer from ``client`` that waits in line for ``key`` (until cancelled)."""
    depth = claims.queue_depth(key)
    task = asyncio.create_task(
        claims.claim(key, owner, wait_seconds=WAIT, caller=ANYONE, client=client)
    )
    await queued(claims, key, depth + 1)
    return task


async def leave(*tasks: asyncio.Task[Outcome]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_the_waiter_bound_over_all_clients_binds_at_its_limit(tmp_path: Path) -> None:
    """``--max-waiters``: with the limit waiting, the next caller that would wait is
    refused ``Exhausted`` (RESOURCE_EXHAUSTED) whichever client it comes from; one that
    need not wait is still answered."""
    async with claims_on_file(tmp_path, max_waiters=2) as claims:
        key = await made(claims, "all-clients")
        await claims.claim(key, "holder", lease_seconds=LONG_LEASE, caller=ANYONE)
        line = [await wait_in_line(claims, key, f"w{i}", f"client-{i}") for i in range(2)]
        with pytest.raises(Exhausted) as refused:
            await claims.claim(key, "w2", wait_seconds=1.0, caller=ANYONE, client="client-2")
        assert (refused.value.what, refused.value.limit) == ("claim waiters", 2)
        assert (await claims.claim(key, "w2", caller=ANYONE)).reason is Reason.CONTENDED
        await leave(*line)
        assert claims.waiting == 0


async def test_the_waiter_bound_per_client_binds_at_its_limit_and_only_that_client(
    tmp_path: Path,
) -> None:
    """``--max-waiters-per-client``: a client with the limit waiting is refused another
    wait; another client still waits; a wait that ends gives its place back, once."""
    async with claims_on_file(tmp_path, max_waiters_per_client=2) as claims:
        key = await made(claims, "per-client")
        await claims.claim(key, "holder", lease_seconds=LONG_LEASE, caller=ANYONE)
        first = await wait_in_line(claims, key, "a1", "alice")
        second = await wait_in_line(claims, key, "a2", "alice")
        with pytest.raises(Exhausted) as refused:
            await claims.claim(key, "a3", wait_seconds=1.0, caller=ANYONE, client="alice")
        assert (refused.value.what, refused.value.limit) == ("claim waiters from one client", 2)
        bob = await wait_in_line(claims, key, "b1", "bob")
        assert claims.clients_waiting == 2
        await leave(first)  # alice has one waiting now: room for exactly one more
        third = await wait_in_line(claims, key, "a3", "alice")
        with pytest.raises(Exhausted):
            await claims.claim(key, "a4", wait_seconds=1.0, caller=ANYONE, client="alice")
        await leave(second, third, bob)
        assert (claims.waiting, claims.clients_waiting) == (0, 0)  # nobody remembered


async def test_claim_status_shows_the_token_only_to_callers_acting_for_its_holder(
    tmp_path: Path,
) -> None:
    """docs/security.md, *Claims are bound to identities*: status names the holder to
    anyone, its token only to its own identity (or one with ``act-for-others``); with no
    live claim, no holder, token 0 and expiry 0 to everyone."""
    alice, bob = Caller("client/alice"), Caller("client/bob")
    async with claims_on_file(tmp_path) as claims:
        key = await made(claims, "status-identities")
        granted = await claims.claim(key, "worker", lease_seconds=LONG_LEASE, caller=alice)
        for caller, token in ((alice, granted.token), (bob, 0), (ANYONE, granted.token)):
            status = await claims.status(key, caller=caller)
            assert status.holder is not None and status.holder.owner == "worker"
            assert (status.token, status.expiry_ms, status.fence) == (
                token,
                granted.expiry_ms,
                granted.token,
            )
        assert (await claims.release(key, granted.token, caller=alice)).ok
        for caller in (alice, bob, ANYONE):
            status = await claims.status(key, caller=caller)
            assert (status.holder, status.token, status.expiry_ms) == (None, 0, 0)
            assert status.fence == granted.token


class CancellingWall:
    """This machine's wall clock, which cancels ``victim`` at the next read made by
    another task than the one that armed it (the test's own calls, e.g. the release
    that lets the waiter in, do not count): a caller leaving exactly while its claim
    is being decided."""

    def __init__(self) -> None:
        self.victim: asyncio.Task[Any] | None = None
        self.armer: asyncio.Task[Any] | None = None

    def arm(self, victim: asyncio.Task[Any]) -> None:
        self.victim = victim
        self.armer = asyncio.current_task()

    @property
    def armed(self) -> bool:
        return self.victim is not None

    def __call__(self) -> int:
        if self.victim is not None and asyncio.current_task() is not self.armer:
            self.victim.cancel()
            self.victim = None
        return wall_clock_ms()


async def test_a_grant_made_for_a_waiter_that_left_meanwhile_is_released(
    tmp_path: Path,
) -> None:
    """docs/consistency.md, *Claims*: the head of the line whose caller leaves while
    its grant is being made durable never hears of the token; the attempt runs to its
    end and the token it newly granted is withdrawn: released, so the next claimer
    gets the record at once instead of after a whole lease held by nobody, with its
    attempt given back (nobody worked the item)."""
    wall = CancellingWall()
    async with claims_on_file(tmp_path, wall) as claims:
        key = await made(claims, "left-while-granted")
        holder = await claims.claim(key, "holder", lease_seconds=LONG_LEASE, caller=ANYONE)
        waiter = await wait_in_line(claims, key, "waiter", "")
        wall.arm(waiter)  # cancelled by the clock read of its grant decision
        assert (await claims.release(key, holder.token, caller=ANYONE)).ok
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert not wall.armed, "premise: cancelled while its claim was decided"
        status = await claims.status(key, caller=ANYONE)
        assert (status.holder, status.fence) == (None, holder.token + 1)
        found = await claims.replica.find(key)
        assert found is not None and found.record.attempts == 1, "its attempt given back"
        after = await claims.claim(key, "next", lease_seconds=LONG_LEASE, caller=ANYONE)
        assert (after.ok, after.token) == (True, holder.token + 2)


async def test_the_waiter_behind_one_that_left_while_granted_gets_the_claim_at_once(
    tmp_path: Path,
) -> None:
    """The grant withdrawn from a head of the line that left wakes the line: the next
    waiter is granted then, not when its own wait runs out."""
    wall = CancellingWall()
    async with claims_on_file(tmp_path, wall) as claims:
        key = await made(claims, "left-then-next")
        holder = await claims.claim(key, "holder", lease_seconds=LONG_LEASE, caller=ANYONE)
        gone = await wait_in_line(claims, key, "gone", "")
        behind = await wait_in_line(claims, key, "behind", "")
        wall.arm(gone)
        assert (await claims.release(key, holder.token, caller=ANYONE)).ok
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert not wall.armed, "premise: cancelled while its claim was decided"
        async with asyncio.timeout(SOON):
            granted = await behind
        assert (granted.ok, granted.token) == (True, holder.token + 2)


async def test_a_waiter_that_left_while_its_owners_claim_was_extended_leaves_it_held(
    tmp_path: Path,
) -> None:
    """Two calls of one owner in line: the first is granted; the second, reaching the
    head, only extends that live claim, and leaves just then. Nothing was granted for
    it, so nothing is withdrawn: the owner's claim stays, with its attempt."""
    wall = CancellingWall()
    async with claims_on_file(tmp_path, wall) as claims:
        key = await made(claims, "extended-then-left")
        holder = await claims.claim(key, "holder", lease_seconds=LONG_LEASE, caller=ANYONE)
        first = await wait_in_line(claims, key, "w", "")
        second = await wait_in_line(claims, key, "w", "")
        assert (await claims.release(key, holder.token, caller=ANYONE)).ok
        async with asyncio.timeout(SOON):
            granted = await first
        assert granted.ok
        wall.arm(second)
        claims.wake(key)  # the second call looks again: the owner holds the live claim
        with pytest.raises(asyncio.CancelledError):
            await second
        assert not wall.armed, "premise: cancelled while its claim was decided"
        status = await claims.status(key, caller=ANYONE)
        assert status.holder is not None and status.holder.owner == "w"
        assert status.fence == granted.token
        found = await claims.replica.find(key)
        assert found is not None and found.record.attempts == 2


async def test_queue_depth_counts_the_claimers_waiting(client: AsyncClient) -> None:
    """SPEC §1 step 7: claim_status reports the queue depth while waiters wait."""
    key = await make(client, "depth")
    await claim(client, key, "holder")
    assert (await client.claim_status(key)).queue_depth == 0
    first = asyncio.create_task(client.claim(key, "w1", wait_seconds=1.0))
    await wait_for_queue_depth(client, key, 1)
    second = asyncio.create_task(client.claim(key, "w2", wait_seconds=1.0))
    await wait_for_queue_depth(client, key, 2)
    assert (await client.claim_status(key)).queue_depth == 2
    results = await asyncio.gather(first, second)
    assert [r.reason for r in results] == ["timeout", "timeout"]
    assert (await client.claim_status(key)).queue_depth == 0


async def test_a_claim_retried_by_the_holder_returns_the_same_token_and_extends_the_lease(
    client: AsyncClient,
) -> None:
    """SPEC §4: a retry by the owner of the live claim is idempotent, never a second grant."""
    key = await make(client, "retry")
    first = await client.claim(key, "worker-a", lease_seconds=10)
    second = await client.claim(key, "worker-a", lease_seconds=60)
    assert first.granted and second.granted
    assert second.fencing_token == first.fencing_token
    assert first.lease_expires_at is not None and second.lease_expires_at is not None
    assert second.lease_expires_at > first.lease_expires_at
    third = await client.claim(key, "worker-a", lease_seconds=5)
    assert third.granted and third.fencing_token == first.fencing_token
    assert third.lease_expires_at is not None
    assert third.lease_expires_at >= second.lease_expires_at, "a retry never shortens the lease"
    status = await client.claim_status(key)
    assert status.fence == first.fencing_token
    assert status.claim is not None and status.claim.owner == "worker-a"


async def test_tokens_strictly_increase_across_claims_and_restarts(
    start_node: StartNode, tmp_path: Path
) -> None:
    """SPEC §4: tokens per record strictly increase and are never reused, across restarts."""
    data = tmp_path / "restart"
    tokens: list[int] = []
    node = await start_node(data_dir=data)
    async with AsyncClient(node.address) as client:
        key = await make(client, "monotone")
        for owner in ("a", "b", "c"):
            token = await claim(client, key, owner)
            tokens.append(token)
            assert (await client.release_claim(key, token)).released
        tokens.append(await claim(client, key, "d"))  # left live across the restart
    await node.stop()
    node = await start_node(data_dir=data)
    async with AsyncClient(node.address) as client:
        assert (await client.claim(key, "e")).reason == "contended"
        assert (await client.release_claim(key, tokens[-1])).released
        tokens.append(await claim(client, key, "e"))
    assert tokens == sorted(set(tokens)), f"tokens must strictly increase: {tokens}"
    assert tokens[0] >= 1


# -- renewals ------------------------------------------------------------------------------


async def test_renewing_the_live_claim_extends_its_lease(client: AsyncClient) -> None:
    """SPEC §4: ``renewed=true`` with the same token and a later expiry."""
    key = await make(client, "renew")
    granted = await client.claim(key, "worker-a", lease_seconds=10)
    assert granted.lease_expires_at is not None
    before = await server_now(client)
    renewed = await client.renew_claim(key, granted.fencing_token, lease_seconds=60)
    after = await server_now(client)
    assert (renewed.renewed, renewed.reason) == (True, "")
    assert renewed.fencing_token == granted.fencing_token
    assert renewed.home_region == "local"
    assert renewed.lease_expires_at is not None
    lease = timedelta(seconds=60)
    assert before + lease <= renewed.lease_expires_at <= after + lease
    status = await client.claim_status(key)
    assert status.claim is not None
    assert status.claim.lease_expires_at == renewed.lease_expires_at


async def test_renewing_never_shortens_a_lease(client: AsyncClient) -> None:
    """claims.proto: a renewal never shortens a lease."""
    key = await make(client, "no-shorten")
    granted = await client.claim(key, "worker-a", lease_seconds=120)
    renewed = await client.renew_claim(key, granted.fencing_token, lease_seconds=5)
    assert renewed.renewed
    assert renewed.lease_expires_at == granted.lease_expires_at
    status = await client.claim_status(key)
    assert status.claim is not None
    assert status.claim.lease_expires_at == granted.lease_expires_at


async def test_renewing_a_superseded_token_answers_superseded(client: AsyncClient) -> None:
    """SPEC §1 step 5: the authoritative "you lost this item" signal."""
    key = await make(client, "renew-superseded")
    old = await claim(client, key, "worker-a")
    assert (await client.release_claim(key, old)).released
    await claim(client, key, "worker-b")
    result = await client.renew_claim(key, old)
    assert (result.renewed, result.reason, result.home_region) == (False, "superseded", "local")


async def test_renewing_a_lapsed_lease_answers_expired(client: AsyncClient) -> None:
    """SPEC §4: renew outcome ``expired`` once the lease lapsed."""
    key = await make(client, "renew-expired")
    granted = await client.claim(key, "worker-a", lease_seconds=1)
    await sleep_past(client, granted.lease_expires_at)
    result = await client.renew_claim(key, granted.fencing_token)
    assert (result.renewed, result.reason) == (False, "expired")
    assert (await client.claim_status(key)).claim is None


async def test_renewing_a_released_token_answers_released(client: AsyncClient) -> None:
    """SPEC §4: renew outcome ``released``; the release is not undone."""
    key = await make(client, "renew-released")
    token = await claim(client, key, "worker-a")
    assert (await client.release_claim(key, token)).released
    result = await client.renew_claim(key, token)
    assert (result.renewed, result.reason) == (False, "released")
    assert (await client.claim_status(key)).claim is None


async def test_renewing_a_token_above_the_fence_answers_unknown_token(client: AsyncClient) -> None:
    """claims.proto: ``unknown_token`` when the token is higher than any granted."""
    key = await make(client, "renew-unknown")
    token = await claim(client, key, "worker-a")
    result = await client.renew_claim(key, token + 1)
    assert (result.renewed, result.reason) == (False, "unknown_token")


async def test_renewing_on_a_missing_record_answers_missing(client: AsyncClient) -> None:
    """SPEC §4: renew outcome ``missing`` (never created, or deleted)."""
    result = await client.renew_claim(key_of("nowhere"), 1)
    assert (result.renewed, result.reason) == (False, "missing")
    key = await make(client, "renew-deleted")
    token = await claim(client, key, "worker-a")
    await client.delete(key, fencing_token=token)
    result = await client.renew_claim(key, token)
    assert (result.renewed, result.reason) == (False, "missing")


# -- releases ------------------------------------------------------------------------------


async def test_release_is_idempotent_for_every_token_up_to_the_fence(client: AsyncClient) -> None:
    """SPEC §4: release is idempotent for any token <= fence and never lowers the fence."""
    key = await make(client, "release")
    old = await claim(client, key, "worker-a")
    assert (await client.release_claim(key, old)).released
    token = await claim(client, key, "worker-b")
    for attempt in range(2):
        result = await client.release_claim(key, token)
        assert (result.released, result.reason, result.fence) == (True, "", token), attempt
    older = await client.release_claim(key, old)
    assert (older.released, older.fence) == (True, token)
    status = await client.claim_status(key)
    assert status.claim is None
    assert status.fence == token


async def test_releasing_an_older_token_leaves_the_live_claim_alone(client: AsyncClient) -> None:
    """SPEC §4: only the live token's release ends the claim; an older one is a no-op."""
    key = await make(client, "release-old")
    old = await claim(client, key, "worker-a")
    assert (await client.release_claim(key, old)).released
    token = await claim(client, key, "worker-b")
    assert (await client.release_claim(key, old)).released
    status = await client.claim_status(key)
    assert status.claim is not None and status.claim.fencing_token == token
    with pytest.raises(ClaimConflict) as refused:
        await client.update(key, fields={"body": "x"})
    assert refused.value.reason == "claimed"


async def test_releasing_a_token_above_the_fence_answers_unknown_token(
    client: AsyncClient,
) -> None:
    """SPEC §4: release answers ``unknown_token`` above the fence, and changes nothing."""
    key = await make(client, "release-unknown")
    never = await client.release_claim(key, 1)
    assert (never.released, never.reason, never.fence) == (False, "unknown_token", 0)
    token = await claim(client, key, "worker-a")
    digest = (await client.get(key)).digest
    above = await client.release_claim(key, token + 1)
    assert (above.released, above.reason, above.fence) == (False, "unknown_token", token)
    assert (await client.get(key)).digest == digest
    status = await client.claim_status(key)
    assert status.claim is not None and status.claim.fencing_token == token


async def test_the_holder_can_release_after_deleting_the_record(client: AsyncClient) -> None:
    """SPEC §3/§4: a tombstone keeps its grants, and release is idempotent for any token <= fence.

    Claim, finish the item by deleting it (fenced), release: the release must
    end the claim, so the key is free to be recreated without waiting out the lease.
    """
    key = await make(client, "done-and-deleted")
    token = await claim(client, key, "worker-a")
    tombstone = await client.delete(key, fencing_token=token)
    assert tombstone.deleted and tombstone.fence == token
    released = await client.release_claim(key, token)
    assert (released.released, released.reason, released.fence) == (True, "", token)
    recreated = await client.remember(REPO, TOPIC, "done-and-deleted", title="again")
    assert recreated.created
    granted = await client.claim(key, "worker-b")
    assert granted.granted and granted.fencing_token == token + 1


async def test_releasing_on_a_missing_record_answers_missing(client: AsyncClient) -> None:
    """claims.proto: release reason ``missing``."""
    result = await client.release_claim(key_of("nowhere"), 1)
    assert (result.released, result.reason) == (False, "missing")


async def test_release_readmits_unfenced_writes_but_a_superseded_token_stays_refused(
    client: AsyncClient,
) -> None:
    """SPEC §1 step 6: release never lowers the fence, so an old token is refused forever."""
    key = await make(client, "forever")
    old = await claim(client, key, "worker-a")
    assert (await client.release_claim(key, old)).released
    token = await claim(client, key, "worker-b")
    assert (await client.release_claim(key, token)).released
    assert (await client.update(key, fields={"body": "unfenced"})).body == "unfenced"
    for _ in range(2):
        with pytest.raises(ClaimConflict) as refused:
            await client.update(key, fields={"body": "late"}, fencing_token=old)
        assert (refused.value.reason, refused.value.fence) == ("superseded", token)
    renewal = await client.renew_claim(key, old)
    assert (renewal.renewed, renewal.reason) == (False, "superseded")
    assert (await client.get(key)).body == "unfenced"


async def test_an_item_claimed_many_times_stays_small_and_its_first_token_stays_refused(
    client: AsyncClient, node: NodeServer
) -> None:
    """An item worked on again and again keeps the latest HISTORY grants
    (fence.HISTORY), not all of them: its state stops growing, and a token folded
    out of the history is still superseded, still releasable (a no-op), never renewed."""
    key = await make(client, "busy")
    first = await claim(client, key, "worker-0")
    await client.release_claim(key, first)
    sizes = []
    grants = 0
    for i in range(1, 3 * HISTORY):
        token = await claim(client, key, f"worker-{i}")
        await client.update(key, fields={"body": f"pass {i}"}, fencing_token=token)
        assert (await client.release_claim(key, token)).released
        stored = await node.storage.get(key)
        assert stored is not None
        sizes.append(stored.size)
        grants = len(stored.record.fence.grants)
    assert grants == HISTORY
    assert sizes[-1] == sizes[-HISTORY], f"the state kept growing: {sizes}"
    with pytest.raises(ClaimConflict) as refused:
        await client.update(key, fields={"body": "late"}, fencing_token=first)
    assert (refused.value.reason, refused.value.fence) == ("superseded", token)
    again = await client.release_claim(key, first)
    assert (again.released, again.fence) == (True, token)
    assert (await client.renew_claim(key, first)).reason == "superseded"
    assert (await client.get(key)).body == f"pass {3 * HISTORY - 1}"


# -- status --------------------------------------------------------------------------------


async def test_claim_status_reports_the_live_claim_and_is_never_authoritative(
    client: AsyncClient,
) -> None:
    """SPEC §1 step 7: owner, token, expiry, queue depth, fence, authoritative=false."""
    key = await make(client, "status")
    empty = await client.claim_status(key)
    assert empty.claim is None
    assert (empty.fence, empty.queue_depth, empty.authoritative) == (0, 0, False)
    assert empty.home_region == "local"
    granted = await client.claim(key, "worker-a", lease_seconds=30)
    status = await client.claim_status(key)
    assert status.claim is not None
    assert status.claim.owner == "worker-a"
    assert status.claim.fencing_token == granted.fencing_token
    assert status.claim.lease_expires_at == granted.lease_expires_at
    assert (status.fence, status.queue_depth, status.authoritative) == (
        granted.fencing_token,
        0,
        False,
    )
    assert (await client.release_claim(key, granted.fencing_token)).released
    after = await client.claim_status(key)
    assert after.claim is None
    assert (after.fence, after.authoritative) == (granted.fencing_token, False)


async def test_claim_status_drops_a_lapsed_claim(client: AsyncClient) -> None:
    """SPEC §3: a claim is live only while now < expiry."""
    key = await make(client, "status-lapse")
    granted = await client.claim(key, "worker-a", lease_seconds=1)
    assert (await client.claim_status(key)).claim is not None
    await sleep_past(client, granted.lease_expires_at)
    status = await client.claim_status(key)
    assert status.claim is None
    assert (status.fence, status.authoritative) == (granted.fencing_token, False)


# -- limits ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("owner", "lease", "wait", "field"),
    [
        ("w", 0.5, 0.0, "lease_seconds"),
        ("w", 3601.0, 0.0, "lease_seconds"),
        ("w", -1.0, 0.0, "lease_seconds"),
        ("w", 10.0, 301.0, "wait_seconds"),
        ("w", 10.0, -1.0, "wait_seconds"),
        ("", 10.0, 0.0, "owner"),
        ("x" * 129, 10.0, 0.0, "owner"),
        ("bad\nowner", 10.0, 0.0, "owner"),
        ("w", float("inf"), 0.0, "lease_seconds"),
        ("w", float("nan"), 0.0, "lease_seconds"),
        ("w", 10.0, float("inf"), "wait_seconds"),
        ("w", 10.0, float("nan"), "wait_seconds"),
    ],
)
async def test_claim_limits_are_refused_as_invalid_input_naming_the_field(
    client: AsyncClient, owner: str, lease: float, wait: float, field: str
) -> None:
    """SPEC §2: lease 1 s - 1 h, wait <= 300 s, owner 1-128 printable characters."""
    key = await make(client, "limits")
    with pytest.raises(InvalidArgument) as refused:
        await client.claim(key, owner, lease_seconds=lease, wait_seconds=wait)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert field in [name for name, _ in refused.value.violations]
    status = await client.claim_status(key)
    assert (status.claim, status.fence) == (None, 0)


async def test_the_limits_themselves_are_accepted(client: AsyncClient, node: NodeServer) -> None:
    """SPEC §2: lease of exactly 1 s and 3600 s, wait of 300 s and a 128-character owner."""
    key = await make(client, "bounds")
    owner = "o" * 128
    long = await client.claim(key, owner, lease_seconds=3600)
    assert long.granted
    short = await client.claim(key, owner, lease_seconds=1)
    assert short.granted and short.fencing_token == long.fencing_token
    assert (await client.release_claim(key, long.fencing_token)).released
    waited = await client.claim(key, "other", lease_seconds=1, wait_seconds=300)
    assert waited.granted
    assert node.claims.queue_depth(key) == 0


async def test_claims_on_a_malformed_key_are_invalid_naming_key(client: AsyncClient) -> None:
    """SPEC §6: INVALID_ARGUMENT with the offending field named; nothing is written."""
    calls: list[Callable[[], Awaitable[object]]] = [
        lambda: client.claim("repo/x/mem/y", "w"),
        lambda: client.renew_claim("not a key", 1),
        lambda: client.release_claim("repo//mem/t/i", 1),
        lambda: client.claim_status("repo/x/mem/y/z/extra"),
    ]
    for call in calls:
        with pytest.raises(InvalidArgument) as refused:
            await call()
        assert [name for name, _ in refused.value.violations] == ["key"]
    assert (await client.info()).record_count == 0


async def test_renewals_outside_the_lease_limits_are_invalid(client: AsyncClient) -> None:
    """SPEC §2: a renewal's lease is 1 s - 1 h too; the claim is left as it was."""
    key = await make(client, "renew-limits")
    granted = await client.claim(key, "worker-a", lease_seconds=30)
    for lease in (0.5, 3601.0):
        with pytest.raises(InvalidArgument) as refused:
            await client.renew_claim(key, granted.fencing_token, lease_seconds=lease)
        assert "lease_seconds" in [name for name, _ in refused.value.violations]
    status = await client.claim_status(key)
    assert status.claim is not None
    assert status.claim.lease_expires_at == granted.lease_expires_at


async def test_a_grant_for_a_waiter_that_left_stays_to_lapse_if_its_release_fails(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When withdrawing the grant made for a waiter that left fails too (a storage fault),
    the caller still only sees its own cancellation; the failure is logged, and the
    lease lapses on its own."""
    wall = CancellingWall()
    async with claims_on_file(tmp_path, wall) as claims:
        key = await made(claims, "release-fails")
        holder = await claims.claim(key, "holder", lease_seconds=LONG_LEASE, caller=ANYONE)
        waiter = await wait_in_line(claims, key, "waiter", "")
        assert (await claims.release(key, holder.token, caller=ANYONE)).ok

        async def failing_withdraw(*args: object, **kwargs: object) -> Outcome:
            raise OSError("the disk is gone")

        monkeypatch.setattr(claims, "withdraw", failing_withdraw)  # the fault, on this node only
        wall.arm(waiter)
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert not wall.armed, "premise: cancelled while its claim was decided"
        assert f"withdrawing {key}, granted to a caller that left, failed" in caplog.text
        status = await claims.status(key, caller=ANYONE)
        assert status.holder is not None and status.holder.owner == "waiter"


async def test_a_waiter_that_leaves_during_a_refused_look_releases_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Only a token the head's attempt newly granted is released when its caller
    leaves: an attempt refused (the holder still holds it) leaves the holder's claim
    alone and nothing to release, so no error either."""
    wall = CancellingWall()
    async with claims_on_file(tmp_path, wall) as claims:
        key = await made(claims, "still-held")
        holder = await claims.claim(key, "holder", lease_seconds=LONG_LEASE, caller=ANYONE)
        waiter = await wait_in_line(claims, key, "waiter", "")
        await asyncio.sleep(0.05)  # its first look is over: it sleeps towards the lapse
        wall.arm(waiter)
        claims.wake(key)  # it looks again while the holder holds: refused, contended
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert not wall.armed, "premise: cancelled during its look"
        status = await claims.status(key, caller=ANYONE)
        assert status.holder is not None and status.holder.owner == "holder"
        assert status.token == holder.token
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]

"""Failure modes other lock services have shipped, pinned against a real node.

Each test is named after the failure it rules out, and its docstring says which
kind of system had it. All run over gRPC against a real node (in-process on
loopback, or a ``fencemark node`` child process where only a real process
restart will do) with its real SQLite file; no component is mocked. Waits are
bounded, but nothing asserts how long anything took.
"""

from __future__ import annotations

import asyncio
import contextlib
from asyncio import Task
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from fencemark.client import AsyncClient, ClaimConflict, ClaimResult, FencemarkError
from fencemark.node.api.server import NodeServer
from fencemark.node.core.lapses import LapseWatcher
from fencemark.node.rules.admission import ANYONE
from fencemark.node.store.storage import Storage
from fencemark.node.tools.process import NodeProcess
from fencemark.v1 import claims_pb2, claims_pb2_grpc
from tests.cluster import eventually
from tests.conftest import StartNode
from tests.test_claims import claims_on_file, made, sleep_past, wait_for_queue_depth

REPO, TOPIC = "regressions", "backlog"
HOLD_S = 60.0  # a holder's lease: longer than any wait below, so only a release ends it
WAIT_S = 30.0  # a waiter's wait_seconds: generous, so a grant is never a timeout's luck
# Bound on waiting for an event the test caused (a grant, a departure): generous, yet
# short of WAIT_S, so a waiter that slept through its wake-up cannot pass as granted.
SETTLE_S = 20.0


async def make(client: AsyncClient, id_: str) -> str:
    result = await client.remember(REPO, TOPIC, id_, title=id_)
    assert result.created
    return result.record.key


async def claim(client: AsyncClient, key: str, owner: str, lease: float = HOLD_S) -> ClaimResult:
    result = await client.claim(key, owner, lease_seconds=lease)
    assert result.granted, result
    return result


async def owners_granted(node: NodeServer, key: str) -> dict[int, str]:
    """Every token the record's durable state holds a grant for, and its owner."""
    stored = await node.storage.get(key)
    assert stored is not None
    return {token: grant.owner for token, grant in stored.record.fence.grants.items()}


async def released_tokens(node: NodeServer, key: str) -> frozenset[int]:
    stored = await node.storage.get(key)
    assert stored is not None
    return stored.record.fence.released


# -- a caller that gave up ----------------------------------------------------------------


@pytest.mark.parametrize("gives_up_by", ["deadline", "cancellation"])
async def test_waiter_whose_caller_gave_up_is_never_granted(
    client: AsyncClient, node: NodeServer, gives_up_by: str
) -> None:
    """Lock queues that keep a waiter after its caller left, then hand it the lock
    (queue-based lock recipes on coordination services, where a cancelled acquire
    left its entry in line): the lock then sits with a ghost for a whole lease while
    live waiters starve.

    The ghost is at the head of the line, a live waiter behind it; the ghost's
    caller gives up by a client-side deadline shorter than its wait (what a client
    in another language may set) or by cancelling the call.
    """
    key = await make(client, f"gave-up-{gives_up_by}")
    holder = await claim(client, key, "holder")
    async with grpc.aio.insecure_channel(node.address) as channel:
        stub = claims_pb2_grpc.ClaimsStub(channel)
        request = claims_pb2.ClaimRequest(
            key=key, owner="gone", lease_seconds=HOLD_S, wait_seconds=WAIT_S
        )
        deadline = 3.0 if gives_up_by == "deadline" else None  # room to queue "live" behind
        gone = stub.Claim(request, timeout=deadline)
        await wait_for_queue_depth(client, key, 1)
        live = asyncio.create_task(
            client.claim(key, "live", lease_seconds=HOLD_S, wait_seconds=WAIT_S)
        )
        await wait_for_queue_depth(client, key, 2)

        if gives_up_by == "cancellation":
            gone.cancel()
        with pytest.raises((grpc.aio.AioRpcError, asyncio.CancelledError)) as gave_up:
            await gone
        if isinstance(gave_up.value, grpc.aio.AioRpcError):
            assert gave_up.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # The node has seen the caller leave: only the live waiter is still in line.
    await wait_for_queue_depth(client, key, 1)

    assert (await client.release_claim(key, holder.fencing_token)).released
    async with asyncio.timeout(SETTLE_S):
        granted = await live
    assert granted.granted, granted
    assert granted.fencing_token == holder.fencing_token + 1, "a token went to someone else"
    status = await client.claim_status(key)
    assert status.claim is not None and status.claim.owner == "live"
    assert (status.fence, status.queue_depth) == (granted.fencing_token, 0)
    assert "gone" not in (await owners_granted(node, key)).values()


async def test_waiter_whose_caller_gave_up_while_being_granted_leaves_no_live_claim(
    start_node: StartNode,
) -> None:
    """The same ghost one step later: the holder releases, the head waiter's grant is
    being made durable, and just then its caller gives up. The grant cannot be
    undone (it is on disk), but the caller never hears of the token, so nobody
    would ever release it: lock services that commit an acquire whose caller has
    just left leave the lock held by nobody until its lease runs out.

    The race is repeated with the cancellation shifted by a few event-loop turns
    against the release (the node runs in this test's loop), so that some rounds
    land inside the commit.
    After each, the live waiter behind gets the claim, from the release or from
    the node releasing the ghost's grant, and any grant the gone caller got is
    released. (A cancellation that lands after the node answered is a lost reply,
    not a ghost: the grant is the caller's, and the test releases it as the
    caller would after retrying.)
    """
    node = await start_node()
    async with AsyncClient(node.address) as client, AsyncClient(node.address) as other:
        key = await make(client, "gave-up-while-granted")
        token = (await claim(client, key, "holder-0")).fencing_token
        for round_ in range(40):
            gone = asyncio.create_task(
                client.claim(key, f"gone-{round_}", lease_seconds=HOLD_S, wait_seconds=WAIT_S)
            )
            await wait_for_queue_depth(client, key, 1)
            live = asyncio.create_task(
                other.claim(key, f"live-{round_}", lease_seconds=HOLD_S, wait_seconds=WAIT_S)
            )
            await wait_for_queue_depth(client, key, 2)

            answered = node.claims.outcomes["granted"]
            releasing = asyncio.create_task(client.release_claim(key, token))
            if round_ % 2:  # else the cancellation may even overtake the release
                await releasing
            for _ in range(round_ // 2 % 20):
                await asyncio.sleep(0)
            gone.cancel()
            assert (await releasing).released
            with contextlib.suppress(asyncio.CancelledError):
                await gone
            heard = gone.result().fencing_token if not gone.cancelled() else 0
            if gone.cancelled():

                async def settled(answered: int = answered, live: Task[ClaimResult] = live) -> bool:
                    return live.done() or node.claims.outcomes["granted"] != answered

                async def holder_now() -> str:
                    return f"the claim is {(await client.claim_status(key)).claim}"

                await eventually(
                    settled,
                    f"round {round_}: a grant to the live waiter",
                    within=SETTLE_S,
                    every=0.01,
                    explain=holder_now,
                )
                holder = (await client.claim_status(key)).claim
                if holder is not None and holder.owner == f"gone-{round_}":
                    # The node answered before it saw the cancellation, and the reply was
                    # dropped on arrival: a lost reply, which no server can tell from a
                    # delivered one (SPEC §4 leaves it to the owner's retry).
                    heard = holder.fencing_token
            if heard:  # it heard of its token (or would on retrying): a holder, who releases
                assert (await client.release_claim(key, heard)).released

            async with asyncio.timeout(SETTLE_S):
                granted = await live
            assert granted.granted, f"round {round_}: the live waiter got {granted}"
            status = await client.claim_status(key)
            assert status.claim is not None, round_
            assert status.claim.owner == f"live-{round_}", round_
            owners = await owners_granted(node, key)
            ghost = {t for t, owner in owners.items() if owner == f"gone-{round_}"}
            assert ghost <= await released_tokens(node, key), (
                f"round {round_}: the gone caller's grant {ghost} was left live"
            )
            token = granted.fencing_token


# -- lost wake-ups --------------------------------------------------------------------------


async def test_release_racing_a_new_waiter_loses_no_wakeup(start_node: StartNode) -> None:
    """A release that lands between a claimer's look at the lock ("held") and its
    going to sleep must still wake it: the classic lost wake-up of lock queues built
    as check-then-wait (pub/sub-based distributed locks that subscribe to the unlock
    notice only after finding the lock held miss an unlock published in between, and
    the waiter sleeps for its whole timeout).

    The holder's lease (60 s) outlasts the waiter's wait (30 s), so only the release
    can explain a grant. A lost wake-up leaves the waiter asleep until its wait runs
    out (where the node looks once more and may grant after all), so the grant is
    awaited for a bounded 20 s, well short of that. The race is run many times with
    the release sent a few event-loop turns after the claim (the node runs in this
    test's loop), over two connections.
    """
    node = await start_node()
    async with AsyncClient(node.address) as waiters, AsyncClient(node.address) as holders:
        key = await make(waiters, "no-lost-wakeup")
        token = (await claim(holders, key, "holder-0")).fencing_token
        for round_ in range(60):
            owner = f"waiter-{round_}"
            turns = round_ % 20  # event-loop turns the claim gets before the release is sent

            async def release(token: int = token, turns: int = turns) -> None:
                for _ in range(turns):
                    await asyncio.sleep(0)
                assert (await holders.release_claim(key, token)).released

            waiter = asyncio.create_task(
                waiters.claim(key, owner, lease_seconds=HOLD_S, wait_seconds=WAIT_S)
            )
            async with asyncio.timeout(SETTLE_S):  # short of WAIT_S: see the docstring
                granted, _ = await asyncio.gather(waiter, release())
            assert granted.granted, f"round {round_} ({turns} turns): {granted}"
            assert granted.fencing_token == token + 1
            status = await waiters.claim_status(key)
            assert status.claim is not None and status.claim.owner == owner
            assert status.queue_depth == 0
            token = granted.fencing_token


# -- restarts -------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def node_process(data: Path) -> AsyncIterator[list[NodeProcess]]:
    """A ``fencemark node`` child process on ``data``; the list holds the current one
    last (a restart appends), and whatever still runs is killed at the end."""
    procs = [await NodeProcess.start(data, region="local")]
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.proc.returncode is None:
                await proc.kill()


@pytest.mark.slow
@pytest.mark.parametrize("restart", ["graceful", "hard"])
async def test_home_restart_never_moves_a_lease_expiry(tmp_path: Path, restart: str) -> None:
    """A lease's expiry is part of the record, decided once by the home's clock: lease
    services that rebuild leases when they come back (re-arming every lease to a
    full TTL when a new leader or process takes over, or losing an in-memory lock
    table) let a dead holder keep a lock longer than it was granted, or drop a live
    holder's lock early.

    Restart the home gracefully (SIGTERM) or hard (SIGKILL) and check both
    directions: a 60 s lease is reported with the very expiry it was granted and
    its token still writes (not shortened, not dropped); a 1 s lease granted
    before the restart is over at its own expiry afterwards (not revived or
    extended by the restart).
    """
    async with node_process(tmp_path / "home") as procs:
        async with AsyncClient(procs[-1].address) as client:
            long_key = await make(client, "long-lease")
            short_key = await make(client, "short-lease")
            long = await claim(client, long_key, "long-holder")
            short = await claim(client, short_key, "short-holder", lease=1.0)
            await client.update(
                long_key, fields={"body": "before"}, fencing_token=long.fencing_token
            )

        if restart == "graceful":
            assert await procs[-1].stop() == 0
        else:
            await procs[-1].kill()
        procs.append(await NodeProcess.start(procs[-1].data_dir, region="local"))

        async with AsyncClient(procs[-1].address) as client:
            status = await client.claim_status(long_key)
            assert status.claim is not None
            assert (status.claim.owner, status.claim.fencing_token) == (
                "long-holder",
                long.fencing_token,
            )
            assert status.claim.lease_expires_at == long.lease_expires_at
            assert status.fence == long.fencing_token
            written = await client.update(
                long_key, fields={"body": "after"}, fencing_token=long.fencing_token
            )
            assert written.body == "after"
            assert (await client.claim(long_key, "someone-else")).reason == "contended"
            with pytest.raises(ClaimConflict) as refused:
                await client.update(long_key, fields={"body": "unfenced"})
            assert refused.value.reason == "claimed"
            after = await client.claim_status(long_key)
            assert after.claim is not None
            assert after.claim.lease_expires_at == long.lease_expires_at, "a write moved it"

            await sleep_past(client, short.lease_expires_at)
            lapsed = await client.claim_status(short_key)
            assert (lapsed.claim, lapsed.fence) == (None, short.fencing_token)
            with pytest.raises(ClaimConflict) as refused:
                await client.update(
                    short_key, fields={"body": "late"}, fencing_token=short.fencing_token
                )
            assert refused.value.reason == "expired"
            next_ = await claim(client, short_key, "next")
            # A new life of the file starts a new era of tokens (grant_gate): above.
            assert next_.fencing_token > short.fencing_token


# -- late renewals --------------------------------------------------------------------------


async def test_renewal_after_the_lapse_answers_expired(client: AsyncClient) -> None:
    """A renewal that arrives after the lease lapsed must neither revive the lease (lock
    "extend" operations that re-set the TTL of whatever is there) nor blur why it
    failed: a holder told ``released`` or ``superseded`` cannot tell "you were too
    slow" from "someone let go / took over", which is what services that record a
    lapse as a release end up answering.

    Nobody claims after the lapse; the node is shown the lapse first (a status read
    and an unfenced write, which it now readmits), then the holder renews and
    writes with its token: both ``expired``, again on a second try, and the claim
    stays lapsed.
    """
    key = await make(client, "late-renewal")
    granted = await claim(client, key, "worker-a", lease=1.0)
    await sleep_past(client, granted.lease_expires_at)
    assert (await client.claim_status(key)).claim is None
    readmitted = await client.update(key, fields={"note": "readmitted"})
    assert readmitted.fields["note"] == "readmitted"

    for attempt in range(2):
        renewal = await client.renew_claim(key, granted.fencing_token, lease_seconds=HOLD_S)
        assert (renewal.renewed, renewal.reason) == (False, "expired"), attempt
        assert renewal.fencing_token == 0
        with pytest.raises(ClaimConflict) as refused:
            await client.update(key, fields={"body": "late"}, fencing_token=granted.fencing_token)
        assert (refused.value.reason, refused.value.fence) == ("expired", granted.fencing_token)
    status = await client.claim_status(key)
    assert (status.claim, status.fence) == (None, granted.fencing_token)
    assert (await client.get(key)).body != "late"


# -- timed-out waiters ----------------------------------------------------------------------


async def test_claim_that_times_out_leaves_no_waiter_behind(start_node: StartNode) -> None:
    """A wait that times out must take everything it queued with it: lock services
    whose timed-out acquirers stayed in the wait queue (or kept their slot in a
    per-client quota) later granted the lock to a caller long gone, or refused new
    waiters for a quota that only ghosts were using.

    The node allows two waiters per client; six waits time out, two at a time,
    one at the head of the line and one behind it. Each pair is allowed to
    wait, the queue is empty after each, and once the holder releases, a
    newcomer that does not wait gets the claim at once: nobody is left in line
    before it.
    """
    node = await start_node(max_waiters_per_client=2)
    async with AsyncClient(node.address, retries=0) as client:
        key = await make(client, "timed-out")
        holder = await claim(client, key, "holder")
        for round_ in range(3):
            first = asyncio.create_task(client.claim(key, f"first-{round_}", wait_seconds=0.3))
            await wait_for_queue_depth(client, key, 1)
            second = asyncio.create_task(client.claim(key, f"second-{round_}", wait_seconds=0.3))
            try:
                results = await asyncio.gather(first, second)
            except FencemarkError as exc:
                raise AssertionError(f"round {round_}: a timed-out wait kept its slot") from exc
            assert [r.reason for r in results] == ["timeout", "timeout"], round_
            assert (await client.claim_status(key)).queue_depth == 0, round_

        assert (await client.release_claim(key, holder.fencing_token)).released
        newcomer = await client.claim(key, "newcomer")
        assert (newcomer.granted, newcomer.reason) == (True, "")
        assert newcomer.fencing_token == holder.fencing_token + 1
        status = await client.claim_status(key)
        assert status.claim is not None and status.claim.owner == "newcomer"
        assert status.queue_depth == 0


class LeavesMidCommit:
    """Cancels ``victim`` the moment its write is queued for the group commit (through
    the storage's own ``enqueue``): a caller leaving while its commit is in flight."""

    def __init__(self, storage: Storage, monkeypatch: pytest.MonkeyPatch) -> None:
        self.victim: Task[Any] | None = None
        self.left = False
        enqueue = storage.enqueue

        def leaving(*args: Any, **kwargs: Any) -> Any:
            queued = enqueue(*args, **kwargs)
            if self.victim is not None and asyncio.current_task() is self.victim:
                self.victim.cancel()
                self.victim, self.left = None, True
            return queued

        monkeypatch.setattr(storage, "enqueue", leaving)


async def test_a_write_whose_caller_left_mid_commit_keeps_the_key_until_it_is_on_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: a change whose caller was cancelled (a client gone, a deadline
    passed) while its commit was queued let go of the record's lock at once; the commit
    still happened, but the next change of the record read the state before it and
    wrote over it (here: a field lost). Found with a kept claim whose renewal was
    cancelled mid-commit: the renewal landed, yet nothing heard of it, so its lapse
    was never recorded. The lock is held until the commit is on disk, and the
    listeners hear of it, before the cancellation goes on."""
    async with claims_on_file(tmp_path) as claims:
        replica = claims.replica
        key = await made(claims, "cancelled-mid-commit")
        heard: list[str] = []
        replica.on_change(heard.append)
        leaves = LeavesMidCommit(replica.storage, monkeypatch)
        first = asyncio.create_task(replica.update(key, fields={"a": "1"}, caller=ANYONE))
        leaves.victim = first
        second = asyncio.create_task(replica.update(key, fields={"b": "2"}, caller=ANYONE))
        with pytest.raises(asyncio.CancelledError):
            await first
        assert leaves.left, "premise: cancelled while its commit was queued"
        await second
        found = await replica.find(key)
        assert found is not None
        fields = found.record.fields
        assert {name: fields[name].value for name in ("a", "b") if name in fields} == {
            "a": "1",
            "b": "2",
        }
        assert heard.count(key) == 2  # the cancelled write was heard of too


async def test_a_renewal_whose_caller_left_mid_commit_still_lapses_on_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lapse watcher hears of a renewal that was committed for a caller that left,
    and records the lapse of the renewed lease (before: never, until a restart)."""
    async with claims_on_file(tmp_path) as claims:
        watcher = LapseWatcher(claims.replica)
        watcher.start()
        try:
            key = await made(claims, "renewed-for-nobody")
            claim = await claims.claim(key, "holder", lease_seconds=1, caller=ANYONE)
            leaves = LeavesMidCommit(claims.replica.storage, monkeypatch)
            renewal = asyncio.create_task(
                claims.renew(key, claim.token, lease_seconds=2, caller=ANYONE)
            )
            leaves.victim = renewal
            with pytest.raises(asyncio.CancelledError):
                await renewal
            assert leaves.left, "premise: cancelled while its commit was queued"

            async def lapse_recorded() -> bool:
                events = await claims.replica.history(key)
                return [e.kind for e in events][-2:] == ["renewed", "lapsed"]

            async def history() -> str:
                return str([e.kind for e in await claims.replica.history(key)])

            await eventually(lapse_recorded, "the renewed lease's lapse recorded",
                             within=SETTLE_S, explain=history)  # fmt: skip
        finally:
            await watcher.stop()

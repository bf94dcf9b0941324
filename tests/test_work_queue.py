"""SPEC §8, the work queue: ClaimNext, release with an outcome, attempts and parking,
reopen and force-release — over gRPC against a real node and its SQLite file.

Leases that must lapse are 1 s long; nothing here waits on a wall-clock sleep
longer than that, every wait is bounded by ``eventually`` or ``wait_seconds``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from fencemark.client import AsyncClient, ClaimNextResult, InvalidArgument, Record
from fencemark.node.api.server import NodeServer
from fencemark.node.core.claims import Claims
from fencemark.node.core.work_queue import HINT_HOLD_S, PICK_PAGE, WorkQueue
from fencemark.node.crdt import Record as StateRecord
from fencemark.node.crdt import Stamp
from fencemark.node.crdt.fence import Grant
from fencemark.node.crdt.record import DONE, FAILED, FORCED, LAPSED, OPEN, PARKED
from fencemark.node.rules import queue
from fencemark.node.rules.admission import ANYONE, Caller, Outcome
from fencemark.node.rules.errors import Denial, NoMajority, PermissionDenied, Reason
from fencemark.node.rules.validation import DEFAULT_LEASE_S
from fencemark.node.store.storage import DB_FILE, Storage
from tests.cluster import Cluster, all_deciding, eventually
from tests.conftest import StartNode
from tests.test_claims import (
    LOOKS,
    NOW,
    SOON,
    WAIT,
    Acknowledging,
    CancellingWall,
    CountingWall,
    claims_on_file,
    made,
)

REPO, TOPIC = "work", "backlog"
LONG = 60.0
RETRY = "retry_after_seconds"


def key_of(id_: str, topic: str = TOPIC) -> str:
    return f"repo/{REPO}/mem/{topic}/{id_}"


async def item(client: AsyncClient, id_: str, *tags: str, topic: str = TOPIC) -> Record:
    made = await client.remember(REPO, topic, id_, title=id_, tags=list(tags))
    assert made.created
    return made.record


# -- ClaimNext: order, eligibility, empty ---------------------------------------------


async def test_claim_next_hands_out_items_by_priority_then_age_then_key(
    client: AsyncClient,
) -> None:
    """SPEC §8: priority:P0 first, untagged last; then oldest creation; then key."""
    await item(client, "untagged-old")
    await item(client, "p2", "priority:P2")
    await item(client, "p0-b", "priority:P0")
    await item(client, "p0-a", "priority:P0")  # same priority, created later
    await item(client, "odd", "priority:high")  # not a priority: untagged
    order = []
    for worker in range(5):
        picked = await client.claim_next(REPO, TOPIC, f"w{worker}", lease_seconds=LONG)
        assert picked.granted and picked.record is not None, picked
        order.append(picked.record.id)
    assert order == ["p0-b", "p0-a", "p2", "untagged-old", "odd"]
    empty = await client.claim_next(REPO, TOPIC, "late")
    assert (empty.granted, empty.reason, empty.record) == (False, "empty", None)


async def test_a_picked_item_is_the_claim_itself(client: AsyncClient) -> None:
    """The response is a claim like Claim's: its token fences writes, and the record
    comes back as it is with the grant (one attempt counted)."""
    await item(client, "one")
    picked = await client.claim_next(REPO, TOPIC, "worker-a", lease_seconds=LONG)
    assert picked.granted and picked.record is not None
    assert picked.record.fence == picked.fencing_token == 1
    assert (picked.record.attempts, picked.record.status) == (1, OPEN)
    status = await client.claim_status(picked.record.key)
    assert status.claim is not None and status.claim.owner == "worker-a"
    again = await client.claim_next(REPO, TOPIC, "worker-b")
    assert again.reason == "empty"  # claimed: not eligible


async def test_a_claim_next_retried_by_its_holder_answers_the_same_claim_again(
    client: AsyncClient, node: NodeServer
) -> None:
    """SPEC §4: a claim retried after a lost reply is answered from the durable state,
    never with a second grant. The retry gets the item it was granted, with the same
    token and a lease extended from now; no attempt is counted, no other item is taken."""
    await item(client, "first")
    await item(client, "second")
    picked = await client.claim_next(REPO, TOPIC, "worker-a", lease_seconds=30)
    assert picked.record is not None and picked.record.id == "first"
    retried = await client.claim_next(REPO, TOPIC, "worker-a", lease_seconds=LONG)
    assert retried.granted and retried.record is not None
    assert (retried.record.id, retried.fencing_token) == ("first", picked.fencing_token)
    assert retried.lease_expires_at is not None and picked.lease_expires_at is not None
    assert retried.lease_expires_at > picked.lease_expires_at  # 60 s from now, not 30
    assert retried.record.attempts == 1
    assert (await client.claim_status(key_of("second"))).claim is None
    grants = [e for e in (await client.history(key_of("first"))).events if e.kind == "granted"]
    assert len(grants) == 1
    other = await client.claim_next(REPO, TOPIC, "worker-b", lease_seconds=LONG)
    assert other.record is not None and other.record.id == "second"
    # Once the holder released it, the same owner's next call is a new pick.
    await client.release_claim(key_of("first"), picked.fencing_token, outcome="done")
    assert (await client.claim_next(REPO, TOPIC, "worker-a")).reason == "empty"


async def test_a_retry_while_others_wait_in_line_answers_the_held_item_and_takes_no_other(
    client: AsyncClient, node: NodeServer
) -> None:
    """The retry of a lost reply is answered from the durable state even while callers
    wait in the topic's line: not a second item, however many are open (pinned by the
    mutation run: a newcomer's look behind the waiters must not follow a retry)."""
    await item(client, "first")
    await item(client, "second")
    picked = await client.claim_next(REPO, TOPIC, "worker-a", lease_seconds=LONG)
    assert picked.record is not None and picked.record.id == "first"
    [picky] = await _in_line(client, node, [("picky", ["needs:gpu"])])
    retried = await client.claim_next(REPO, TOPIC, "worker-a", lease_seconds=LONG)
    assert retried.record is not None
    assert (retried.record.id, retried.fencing_token) == ("first", picked.fencing_token)
    assert (await client.claim_status(key_of("second"))).claim is None
    picky.cancel()


async def test_a_retry_with_other_tags_does_not_answer_an_item_without_them(
    client: AsyncClient,
) -> None:
    """The held item answers a retry only if it has every tag the call asks for."""
    await item(client, "plain")
    await item(client, "gpu", "needs:gpu")
    held = await client.claim_next(REPO, TOPIC, "w", lease_seconds=LONG)
    assert held.record is not None and held.record.id == "plain"
    gpu = await client.claim_next(REPO, TOPIC, "w", tags=["needs:gpu"], lease_seconds=LONG)
    assert gpu.record is not None and gpu.record.id == "gpu"
    assert gpu.fencing_token == 1 and (await client.claim_status(held.record.key)).claim
    again = await client.claim_next(REPO, TOPIC, "w", lease_seconds=LONG)
    assert again.record is not None and again.record.id == "plain"  # in pick order


async def test_claim_next_takes_only_items_with_every_requested_tag(client: AsyncClient) -> None:
    await item(client, "plain")
    await item(client, "gpu", "needs:gpu", "big")
    picked = await client.claim_next(REPO, TOPIC, "w", tags=["needs:gpu"], lease_seconds=LONG)
    assert picked.record is not None and picked.record.id == "gpu"
    none = await client.claim_next(REPO, TOPIC, "w2", tags=["needs:gpu"])
    assert none.reason == "empty"


async def test_an_item_waits_until_every_after_item_is_done(client: AsyncClient) -> None:
    """after:<id> holds an item back until item <id> of its topic is done; a
    missing one holds it back too."""
    await item(client, "second", "after:first", "priority:P0")
    await item(client, "first")
    await item(client, "orphan", "after:never-made", "priority:P0")
    picked = await client.claim_next(REPO, TOPIC, "w", lease_seconds=LONG)
    assert picked.record is not None and picked.record.id == "first"
    assert (await client.claim_next(REPO, TOPIC, "w2")).reason == "empty"
    done = await client.release_claim(picked.record.key, picked.fencing_token, outcome="done")
    assert done.released
    after = await client.claim_next(REPO, TOPIC, "w", lease_seconds=LONG)
    assert after.record is not None and after.record.id == "second"


async def test_items_of_other_topics_and_deleted_items_are_never_picked(
    client: AsyncClient,
) -> None:
    await item(client, "elsewhere", topic="other")
    gone = await item(client, "gone")
    await client.delete(gone.key)
    assert (await client.claim_next(REPO, TOPIC, "w")).reason == "empty"
    picked = await client.claim_next(REPO, "other", "w", lease_seconds=LONG)
    assert picked.record is not None and picked.record.id == "elsewhere"


# -- waiting for an item ---------------------------------------------------------------


async def test_waiters_for_an_item_are_served_first_come_first_served(
    client: AsyncClient, node: NodeServer
) -> None:
    first = asyncio.create_task(client.claim_next(REPO, TOPIC, "first", wait_seconds=10))
    await eventually(lambda: _waiting(node, 1), "the first waiter in line")
    second = asyncio.create_task(client.claim_next(REPO, TOPIC, "second", wait_seconds=10))
    await eventually(lambda: _waiting(node, 2), "the second waiter in line")
    await item(client, "only")
    got = await asyncio.wait_for(first, 5)
    assert got.granted and got.record is not None and got.record.id == "only"
    await item(client, "next")
    also = await asyncio.wait_for(second, 5)
    assert also.granted and also.record is not None and also.record.id == "next"
    assert node.claims.waiting == 0


async def _waiting(node: NodeServer, count: int) -> bool:
    return node.claims.waiting == count


async def _in_line(
    client: AsyncClient, node: NodeServer, owners_and_tags: list[tuple[str, list[str]]]
) -> list[asyncio.Task[ClaimNextResult]]:
    """Callers waiting in the topic's line in this order, each with its own tags."""
    waiters = []
    for owner, tags in owners_and_tags:
        waiters.append(asyncio.create_task(client.claim_next(
            REPO, TOPIC, owner, wait_seconds=WAIT, lease_seconds=LONG, tags=tags
        )))  # fmt: skip
        await eventually(functools.partial(_waiting, node, len(waiters)), f"{owner} in line")
    return waiters


async def test_a_waiter_whose_tags_match_nothing_blocks_nobody(
    client: AsyncClient, node: NodeServer
) -> None:
    """Issue 33, finding 6: a ClaimNext waiting for a tag no item has made every other
    ClaimNext of the topic answer ``empty`` (at once, or at its deadline) while
    eligible items were open. Fairness is among the waiters an item suits (SPEC §8)."""
    for id_ in ("a", "b", "c", "d"):
        await item(client, id_)
    [picky] = await _in_line(client, node, [("picky", ["needs:gpu"])])
    at_once = await client.claim_next(REPO, TOPIC, "w0", lease_seconds=LONG)
    assert at_once.granted and at_once.record is not None and at_once.record.id == "a"
    async with asyncio.timeout(SOON):  # not its deadline: at once too
        waited = await client.claim_next(REPO, TOPIC, "w8", wait_seconds=8, lease_seconds=LONG)
    assert waited.granted and waited.record is not None and waited.record.id == "b"
    assert not picky.done()
    await item(client, "gpu-job", "needs:gpu")
    got = await asyncio.wait_for(picky, SOON)
    assert got.granted and got.record is not None and got.record.id == "gpu-job"


async def test_an_item_that_suits_only_the_third_waiter_goes_to_the_third(
    client: AsyncClient, node: NodeServer
) -> None:
    first, second, third = await _in_line(
        client, node, [("first", ["x"]), ("second", ["y"]), ("third", ["z"])]
    )
    await item(client, "for-z", "z")
    got = await asyncio.wait_for(third, SOON)
    assert got.granted and got.record is not None and got.record.id == "for-z"
    assert not first.done() and not second.done()
    await item(client, "for-x-and-y", "x", "y")  # suits both: the first in line has it
    got = await asyncio.wait_for(first, SOON)
    assert got.record is not None and got.record.id == "for-x-and-y"
    assert not second.done()
    await item(client, "for-y", "y")
    got = await asyncio.wait_for(second, SOON)
    assert got.record is not None and got.record.id == "for-y"


async def test_waiters_with_mixed_tags_are_served_in_line_order_among_those_an_item_suits(
    client: AsyncClient, node: NodeServer
) -> None:
    """No tags suit every item; an item goes to the earliest waiter it suits, and a
    newcomer that does not wait takes only what suits nobody ahead of it."""
    line = [("a1", ["a"]), ("any1", []), ("b1", ["b"]), ("a2", ["a"]), ("any2", [])]
    waiters = dict(zip([owner for owner, _ in line], await _in_line(client, node, line),
                       strict=True))  # fmt: skip
    served: list[tuple[str, str]] = []

    async def make_and_see(id_: str, *tags: str) -> None:
        await item(client, id_, *tags)
        await eventually(lambda: _served(len(served) + 1), f"{id_} handed out")

    async def _served(count: int) -> bool:
        for owner, task in waiters.items():
            if task.done() and all(owner != o for o, _ in served):
                result = task.result()
                assert result.record is not None
                served.append((owner, result.record.id))
        return len(served) >= count

    await make_and_see("i1", "a")  # a1 first
    await make_and_see("i2", "a")  # then any1: it takes anything
    await make_and_see("i3", "b")  # b1
    nobody_ahead = await client.claim_next(REPO, TOPIC, "newcomer", lease_seconds=LONG)
    assert nobody_ahead.reason == "empty"
    await make_and_see("i4")  # untagged: only any2 takes it, a2 is ahead but wants "a"
    await make_and_see("i5", "a")  # a2
    assert served == [("a1", "i1"), ("any1", "i2"), ("b1", "i3"), ("any2", "i4"), ("a2", "i5")]
    assert node.claims.waiting == 0


async def test_a_waiter_gets_an_item_when_its_deferral_ends(client: AsyncClient) -> None:
    """No write wakes it: the head of the line looks again when a deferral ends."""
    made = await item(client, "later")
    picked = await client.claim_next(REPO, TOPIC, "w", lease_seconds=LONG)
    assert picked.granted
    deferred = await client.release_claim(
        made.key, picked.fencing_token, outcome="deferred", retry_after_seconds=1.0
    )
    assert deferred.released
    record = await client.get(made.key)
    assert record.not_before is not None and record.last_outcome == "deferred"
    assert (await client.claim_next(REPO, TOPIC, "w")).reason == "empty"
    started = time.monotonic()
    again = await client.claim_next(REPO, TOPIC, "w", wait_seconds=10, lease_seconds=LONG)
    assert again.granted and again.record is not None and again.record.attempts == 2
    assert time.monotonic() - started < 5


async def test_a_waiter_that_finds_nothing_answers_empty_at_its_deadline(
    client: AsyncClient, node: NodeServer
) -> None:
    empty = await client.claim_next(REPO, TOPIC, "w", wait_seconds=0.3)
    assert (empty.granted, empty.reason) == (False, "empty")
    assert node.claims.waiting == 0


# -- release with an outcome -----------------------------------------------------------


async def test_release_done_writes_fields_and_outcome_with_the_release_in_one_commit(
    client: AsyncClient, node: NodeServer
) -> None:
    made = await item(client, "finish")
    picked = await client.claim_next(REPO, TOPIC, "w", lease_seconds=LONG)
    token = picked.fencing_token
    released = await client.release_claim(made.key, token, outcome="done", fields={"result": "42"})
    assert released.released
    stored = await node.storage.get(made.key)
    assert stored is not None
    record = stored.record
    assert record.fence.ended(token) and record.status == DONE
    assert record.fields["result"].stamp.epoch == token  # written under the token
    assert record.queue["status"].stamp == record.fields["result"].stamp  # one commit
    # The reply may be lost: the same release again is answered from the state.
    retried = await client.release_claim(made.key, token, outcome="done", fields={"result": "42"})
    assert retried.released
    assert (await node.storage.get(made.key)) == stored
    # Done is final for ClaimNext.
    assert (await client.claim_next(REPO, TOPIC, "w")).reason == "empty"
    # A different ending for that token now is not a retry: the claim is over.
    other = await client.release_claim(made.key, token, outcome="failed")
    assert (other.released, other.reason) == (False, "released")


async def test_a_superseded_worker_can_never_record_an_outcome(client: AsyncClient) -> None:
    """The safety rule: a release with an outcome is the holder's last fenced write."""
    made = await item(client, "stolen")
    old = await client.claim_next(REPO, TOPIC, "paused", lease_seconds=LONG)
    taken = await client.force_release(made.key, "worker hung")
    assert taken.released and taken.superseded_token == old.fencing_token
    late = await client.release_claim(made.key, old.fencing_token, outcome="done")
    assert (late.released, late.reason) == (False, "superseded")
    record = await client.get(made.key)
    assert (record.status, record.last_outcome) == (OPEN, FORCED)
    renewed = await client.renew_claim(made.key, old.fencing_token)
    assert (renewed.renewed, renewed.reason) == (False, "superseded")
    fresh = await client.claim_next(REPO, TOPIC, "fresh", lease_seconds=LONG)
    assert fresh.fencing_token > taken.fence > old.fencing_token


async def test_failed_releases_park_an_item_at_max_attempts_until_reopen(
    client: AsyncClient,
) -> None:
    made = await item(client, "poison", "maxAttempts:2")
    for attempt in (1, 2):
        picked = await client.claim_next(REPO, TOPIC, "w", lease_seconds=LONG)
        assert picked.record is not None and picked.record.attempts == attempt
        failed = await client.release_claim(made.key, picked.fencing_token, outcome="failed")
        assert failed.released
    record = await client.get(made.key)
    assert (record.status, record.attempts, record.last_outcome) == (PARKED, 2, FAILED)
    assert (await client.claim_next(REPO, TOPIC, "w")).reason == "empty"
    reopened = await client.reopen(made.key, "fixed the input")
    assert reopened.reopened and reopened.record is not None
    assert (reopened.record.status, reopened.record.attempts) == (OPEN, 0)
    assert (await client.claim_next(REPO, TOPIC, "w", lease_seconds=LONG)).granted


async def test_a_lapsed_lease_counts_and_parks_at_max_attempts(client: AsyncClient) -> None:
    made = await item(client, "crashy", "maxAttempts:1")
    picked = await client.claim_next(REPO, TOPIC, "w", lease_seconds=1)
    assert picked.granted

    async def parked() -> bool:
        return (await client.get(made.key)).status == PARKED

    await eventually(parked, "the lapse watcher parking the item")
    record = await client.get(made.key)
    assert record.last_outcome == LAPSED
    assert (await client.claim_next(REPO, TOPIC, "w")).reason == "empty"


async def test_a_plain_release_hands_the_item_back_as_it_was(client: AsyncClient) -> None:
    made = await item(client, "handback")
    picked = await client.claim_next(REPO, TOPIC, "w", lease_seconds=LONG)
    assert (await client.release_claim(made.key, picked.fencing_token)).released
    record = await client.get(made.key)
    assert (record.status, record.last_outcome) == (OPEN, "")
    assert (await client.claim_next(REPO, TOPIC, "w2", lease_seconds=LONG)).granted


# -- force-release -----------------------------------------------------------------------


async def test_force_release_without_a_live_claim_changes_nothing(client: AsyncClient) -> None:
    made = await item(client, "idle")
    before = await client.get(made.key)
    result = await client.force_release(made.key, "just in case")
    assert (result.released, result.reason, result.superseded_token) == (False, "no_claim", 0)
    assert (await client.get(made.key)).digest == before.digest
    missing = await client.force_release(key_of("nope"), "x")
    assert (missing.released, missing.reason) == (False, "missing")


# -- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda c, k, t: c.release_claim(k, t, outcome="finished"), "outcome"),
        (lambda c, k, t: c.release_claim(k, t, outcome="done", retry_after_seconds=5), RETRY),
        (lambda c, k, t: c.release_claim(k, t, outcome="deferred", retry_after_seconds=-1), RETRY),
        (lambda c, k, t: c.release_claim(k, t, fields={"a b": ""}), "fields['a b']"),
        (lambda c, k, t: c.reopen(k, ""), "reason"),
        (lambda c, k, t: c.force_release(k, "x" * 257), "reason"),
        (lambda c, k, t: c.claim_next(REPO, "bad topic!", "w"), "topic"),
        (lambda c, k, t: c.update(k, add_tags=["maxAttempts:0"], fencing_token=t), "add_tags[0]"),
        (lambda c, k, t: c.update(k, add_tags=["after:not/an/id"], fencing_token=t), "add_tags[0]"),
    ],
)  # fmt: skip
async def test_bad_input_is_refused_naming_the_field_and_changes_nothing(
    client: AsyncClient, call: Callable[..., Awaitable[object]], field: str
) -> None:
    made = await item(client, "guarded")
    picked = await client.claim_next(REPO, TOPIC, "w", lease_seconds=LONG)
    before = await client.get(made.key)
    with pytest.raises(InvalidArgument) as refused:
        await call(client, made.key, picked.fencing_token)
    assert field in [name for name, _ in refused.value.violations]
    assert (await client.get(made.key)).digest == before.digest


# -- the pick index ----------------------------------------------------------------------


async def test_the_pick_index_holds_exactly_the_open_items(
    client: AsyncClient, node: NodeServer
) -> None:
    """ClaimNext reads candidates from an index kept in the same commit as the state:
    an item is in it while it is visible and open, and nothing else is."""
    await item(client, "open-1")
    done = await item(client, "done-1")
    gone = await item(client, "gone-1")
    picked = await client.claim(done.key, "w", lease_seconds=LONG)
    await client.release_claim(done.key, picked.fencing_token, outcome="done")
    await client.delete(gone.key)
    rows = await node.storage._reader.execute_fetchall("SELECT key FROM picks ORDER BY key")
    assert [row[0] for row in rows] == [key_of("open-1")]


@pytest.mark.parametrize("before", ["no index", "an index without holders"])
async def test_a_data_file_from_before_gets_its_pick_index_rebuilt(
    start_node: StartNode, tmp_path: Path, before: str
) -> None:
    """Opening a file without the index, or with the first version of it (no lease
    holders), builds it from the stored states: picks and holders."""
    data = tmp_path / "old"
    node = await start_node("local", data_dir=data)
    async with AsyncClient(node.address) as client:
        await item(client, "kept")
        await item(client, "held")
        await client.claim(key_of("held"), "w", lease_seconds=LONG)
    await node.stop()
    import sqlite3

    with sqlite3.connect(data / DB_FILE) as db:
        db.execute("DROP TABLE picks")
        if before == "an index without holders":
            db.execute(
                "CREATE TABLE picks (key TEXT PRIMARY KEY, scope TEXT NOT NULL,"
                " home TEXT NOT NULL, priority INTEGER NOT NULL, born INTEGER NOT NULL,"
                " not_before INTEGER NOT NULL, busy_until INTEGER NOT NULL) WITHOUT ROWID"
            )
    storage = await Storage.open(data / DB_FILE)
    try:
        scope = f"repo/{REPO}/mem/{TOPIC}/"
        picks = await storage.picks(scope, "local", 0, after=None, limit=5)
        assert [p.key for p in picks] == [key_of("kept")]
        assert await storage.held_by(scope, "local", "w", int(time.time() * 1000)) == [
            key_of("held")
        ]
    finally:
        await storage.close()


def test_default_max_attempts_is_five() -> None:
    """SPEC §8: default 5 per node."""
    assert queue.DEFAULT_MAX_ATTEMPTS == 5


# -- history -------------------------------------------------------------------------


async def test_history_lists_each_claim_event_with_its_token_owner_and_outcome(
    client: AsyncClient,
) -> None:
    """Records.History: grants, renewals, releases with outcome, parking, take-backs
    and reopens, oldest first, each as its home decided it."""
    made = await item(client, "story", "maxAttempts:2")
    key = made.key
    first = await client.claim_next(REPO, TOPIC, "ann", lease_seconds=LONG)
    await client.renew_claim(key, first.fencing_token, lease_seconds=120)
    await client.release_claim(key, first.fencing_token, outcome="failed")
    second = await client.claim(key, "bob", lease_seconds=LONG)
    await client.force_release(key, "bob is stuck")
    third = await client.claim(key, "cy", lease_seconds=LONG)
    await client.release_claim(key, third.fencing_token, outcome="failed")
    await client.reopen(key, "input fixed")
    history = await client.history(key)
    assert history.home_region == "local"
    seen = [(e.kind, e.fencing_token, e.owner, e.detail) for e in history.events]
    assert seen == [
        ("granted", 1, "ann", ""),
        ("renewed", 1, "ann", ""),
        ("released", 1, "ann", "failed"),
        ("granted", 2, "bob", ""),
        ("forced", 2, "bob", "bob is stuck"),
        ("granted", 4, "cy", ""),
        ("released", 4, "cy", "failed parked"),
        ("reopened", 5 - 1, "", "input fixed"),
    ]
    assert second.fencing_token == 2 and third.fencing_token == 4
    assert all(e.at is not None for e in history.events)


async def test_history_keeps_the_newest_64_events(client: AsyncClient) -> None:
    made = await item(client, "busy")
    for _ in range(40):
        picked = await client.claim(made.key, "w", lease_seconds=LONG)
        await client.release_claim(made.key, picked.fencing_token)
    events = (await client.history(made.key)).events
    assert len(events) == 64
    assert (events[0].kind, events[0].fencing_token) == ("granted", 9)
    assert (events[-1].kind, events[-1].fencing_token) == ("released", 40)


async def test_the_work_queue_limits_hold_at_their_bounds(client: AsyncClient) -> None:
    """A deferral of 30 days and 16 after: tags are taken; one second or one tag more
    is refused naming the field (docs/api.md, *Work queue*)."""
    made = await item(client, "bounds")
    picked = await client.claim_next(REPO, TOPIC, "w", lease_seconds=LONG)
    month = queue.MAX_RETRY_AFTER_S
    with pytest.raises(InvalidArgument) as refused:
        await client.release_claim(
            made.key, picked.fencing_token, outcome="deferred", retry_after_seconds=month + 1
        )
    assert [name for name, _ in refused.value.violations] == [RETRY]
    deferred = await client.release_claim(
        made.key, picked.fencing_token, outcome="deferred", retry_after_seconds=month
    )
    assert deferred.released
    waits = [f"after:w{i}" for i in range(queue.MAX_AFTER_TAGS)]
    await client.remember(REPO, TOPIC, "waits", tags=waits)
    with pytest.raises(InvalidArgument) as too_many:
        await client.remember(REPO, TOPIC, "waits-more", tags=[*waits, "after:one-more"])
    assert [name for name, _ in too_many.value.violations] == ["tags"]
    assert (queue.MAX_RETRY_AFTER_S, queue.MAX_AFTER_TAGS) == (30 * 24 * 3600, 16)


async def test_a_short_wait_still_waits_and_takes_an_item_made_meanwhile(
    client: AsyncClient, node: NodeServer
) -> None:
    """Any wait above 0 queues (under a second too), and answers as soon as an item
    comes; a call without a wait never queues (nor counts as a wait)."""
    waits = node.claims.waits
    assert (await client.claim_next(REPO, TOPIC, "w")).reason == "empty"
    assert node.claims.waits == waits
    waiting = asyncio.create_task(client.claim_next(REPO, TOPIC, "w", wait_seconds=0.9))
    await eventually(lambda: _waiting(node, 1), "the waiter in line")
    await item(client, "meanwhile")
    got = await asyncio.wait_for(waiting, 5)
    assert got.granted and got.record is not None and got.record.id == "meanwhile"
    assert node.claims.waits == waits + 1


async def test_a_reason_of_one_character_is_enough(client: AsyncClient) -> None:
    made = await item(client, "terse")
    await client.claim_next(REPO, TOPIC, "w", lease_seconds=LONG)
    assert (await client.force_release(made.key, "x")).released
    assert (await client.reopen(made.key, "y")).reopened


async def test_a_claim_next_retry_answered_from_the_state_as_it_is_is_acknowledged_again(
    tmp_path: Path,
) -> None:
    """At a member of a region of several (``Storage.acknowledge``), an owner's
    ``ClaimNext`` retried on a clock that stands still gets its item back with the
    lease as it was: an answer drawn from a state that may be in this file alone,
    so it is acknowledged again first — refused without a majority, its yes with
    one (as for claims and releases: ``test_claims.py``)."""
    async with claims_on_file(tmp_path, wall=lambda: NOW) as claims:
        work = WorkQueue(claims)
        key = await made(claims, "item-1")
        first = await work.claim_next(
            "claims", "backlog", "worker", caller=ANYONE, lease_seconds=30
        )
        assert first.outcome.ok
        hook = Acknowledging.on(claims, majority=False)
        with pytest.raises(NoMajority):
            await work.claim_next("claims", "backlog", "worker", caller=ANYONE, lease_seconds=30)
        hook.majority = True
        again = await work.claim_next(
            "claims", "backlog", "worker", caller=ANYONE, lease_seconds=30
        )
        assert again.outcome.ok and again.outcome.token == first.outcome.token
        assert hook.keys() == [key, key]


async def test_an_item_picked_for_a_waiter_that_left_meanwhile_is_released(
    tmp_path: Path,
) -> None:
    """As for a claim (docs/consistency.md, *Claims*): the head of a topic's line whose
    caller leaves while its pick is being granted never hears of the token; the pick
    runs to its end and the item it claimed is released at once, not held by nobody
    for a whole lease."""
    wall = CancellingWall()
    async with claims_on_file(tmp_path, wall) as claims:
        work = WorkQueue(claims)
        waiter = await asleep_at_the_head(work)
        wall.arm(waiter)  # cancelled by the clock read of its next pick
        key = await made(claims, "picked-for-nobody")  # wakes the head: it picks this
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert not wall.armed, "premise: cancelled while its pick was made"
        found = await claims.replica.find(key)
        assert found is not None
        fence = found.record.fence
        assert (fence.fence, fence.ended(1)) == (1, True), "granted, then released"
        assert found.record.attempts == 0, "handed back as it was: no attempt counted"
        again = await work.claim_next("claims", "backlog", "next", lease_seconds=LONG,
                                      caller=ANYONE)  # fmt: skip
        assert again.stored is not None and again.stored.record.key == key
        assert (again.outcome.token, again.stored.record.attempts) == (2, 1)


async def _idle(claims: Claims) -> bool:
    return claims.waiting == 1


async def asleep_at_the_head(work: WorkQueue) -> asyncio.Task[object]:
    """A ``ClaimNext`` that waits at the head of the empty topic's line, its first look
    (nothing there) over: it sleeps until a change of the topic wakes it."""
    waiter = asyncio.create_task(
        work.claim_next("claims", "backlog", "waiter", wait_seconds=WAIT, caller=ANYONE)
    )
    await eventually(lambda: _idle(work.claims), "the waiter in line")
    await asyncio.sleep(0.05)
    return waiter


async def test_a_waiter_refused_at_its_turn_lets_the_next_one_be_served(tmp_path: Path) -> None:
    """A waiter whose turn ends in a refusal (its certificate revoked meanwhile,
    ``Caller.still_allowed``) hears it, and the same look goes on to the waiter
    behind, which takes the item (pinned by the mutation run of core/lines)."""

    revocations: list[str] = []

    def still_allowed() -> None:
        if revocations:
            raise PermissionDenied(Denial.REVOKED_CERTIFICATE, "revoked while it waited")

    async with claims_on_file(tmp_path) as claims:
        work = WorkQueue(claims)
        first = asyncio.create_task(work.claim_next(
            "claims", "backlog", "first", wait_seconds=WAIT,
            caller=Caller("client/first", still_allowed=still_allowed),
        ))  # fmt: skip
        await eventually(lambda: _idle(claims), "the first waiter in line")
        second = asyncio.create_task(
            work.claim_next("claims", "backlog", "second", wait_seconds=WAIT, caller=ANYONE)
        )
        await eventually(functools.partial(_waiting_here, claims, 2), "the second behind it")
        revocations.append("client/first")
        key = await made(claims, "one")
        with pytest.raises(PermissionDenied):
            await asyncio.wait_for(first, SOON)
        got = await asyncio.wait_for(second, SOON)
        assert got.stored is not None and got.stored.record.key == key


async def test_a_change_during_a_look_makes_the_line_look_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An item made while a look is under way (its pick already read the index) is
    not missed: the wake-up during the look makes the line look once more (pinned by
    the mutation run of core/lines)."""
    async with claims_on_file(tmp_path) as claims:
        work = WorkQueue(claims)
        real_pick = work._pick
        picks: list[int] = []
        made_meanwhile: list[str] = []

        async def pick_then_an_item_appears(*args: Any) -> Any:
            found = await real_pick(*args)
            picks.append(1)
            if len(picks) == 2:  # the line's first look (after the call's own pick)
                made_meanwhile.append(await made(claims, "meanwhile"))
            return found

        monkeypatch.setattr(work, "_pick", pick_then_an_item_appears)
        got = await asyncio.wait_for(
            work.claim_next("claims", "backlog", "w", wait_seconds=WAIT, caller=ANYONE), SOON
        )
        assert got.stored is not None and got.stored.record.key == made_meanwhile[0]


async def _waiting_here(claims: Claims, count: int) -> bool:
    return claims.waiting == count


async def test_a_look_that_fails_still_answers_a_caller_that_asked_for_one_look(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A newcomer that does not wait takes one look behind those waiting; should that
    look fail (a storage fault), it is answered ``empty`` rather than left hanging,
    and the failure is logged."""
    async with claims_on_file(tmp_path) as claims:
        work = WorkQueue(claims)
        waiter = await asleep_at_the_head(work)

        async def failing_pass(*args: object) -> bool:
            raise OSError("the disk is gone")

        monkeypatch.setattr(work._lines, "_pass", failing_pass)  # the fault, here only
        newcomer = await asyncio.wait_for(
            work.claim_next("claims", "backlog", "newcomer", caller=ANYONE), SOON
        )
        assert newcomer.outcome.reason is Reason.EMPTY
        assert "looking for the waiters of" in caplog.text
        waiter.cancel()


async def test_a_picked_lease_is_exactly_the_lease_asked_for(tmp_path: Path) -> None:
    """On a clock that stands still: the grant ends lease_seconds after the pick."""
    now = 1_767_225_600_000
    async with claims_on_file(tmp_path, lambda: now) as claims:
        work = WorkQueue(claims)
        await made(claims, "timed")
        picked = await work.claim_next("claims", "backlog", "w", lease_seconds=61.5,
                                       caller=ANYONE)  # fmt: skip
        assert picked.outcome.expiry_ms == now + 61_500


async def test_a_waiting_claim_next_that_finds_an_item_takes_just_that_one(
    client: AsyncClient,
) -> None:
    await item(client, "one")
    await item(client, "two")
    first = await client.claim_next(REPO, TOPIC, "w", wait_seconds=5, lease_seconds=LONG)
    assert first.record is not None and first.record.id == "one"
    assert (await client.claim_status(key_of("two"))).claim is None
    second = await client.claim_next(REPO, TOPIC, "w2", lease_seconds=LONG)
    assert second.record is not None and second.record.id == "two"


async def test_a_take_back_writes_its_outcome_at_the_moved_fence(
    client: AsyncClient, node: NodeServer
) -> None:
    made_ = await item(client, "moved")
    await client.claim_next(REPO, TOPIC, "w", lease_seconds=LONG)
    taken = await client.force_release(made_.key, "stuck")
    stored = await node.storage.get(made_.key)
    assert stored is not None
    outcome = stored.record.outcome
    assert outcome is not None and outcome.stamp.epoch == stored.record.fence.fence == taken.fence
    missing = await client.force_release(key_of("no-such"), "x")
    assert (missing.released, missing.superseded_token, missing.fence) == (False, 0, 0)


async def test_a_pick_passes_over_an_item_being_changed_and_comes_back_to_it(
    tmp_path: Path,
) -> None:
    """Regression (the drain benchmark): callers that all read the same first page
    queued on its first item's lock, each waiting out the grant before it, so grants
    went one fsync at a time. An item whose lock is taken is passed over for the next
    one; and when nothing else can be had it is tried after all, never answered empty.
    (The lock is taken directly here: the only way to hold it still for a test.)"""
    async with claims_on_file(tmp_path) as claims:
        work, replica = WorkQueue(claims), claims.replica
        first, second = await made(claims, "first"), await made(claims, "second")
        async with replica._locks.hold(first), asyncio.timeout(5):  # not wait for it
            assert replica.busy(first)
            picked = await work.claim_next("claims", "backlog", "w1", caller=ANYONE,
                                           lease_seconds=LONG)  # fmt: skip
            assert picked.stored is not None and picked.stored.record.key == second
        lock_held = asyncio.Event()

        async def hold_a_moment() -> None:
            async with replica._locks.hold(first):
                lock_held.set()
                await asyncio.sleep(0.2)

        holder = asyncio.create_task(hold_a_moment())
        await lock_held.wait()
        late = await work.claim_next("claims", "backlog", "w2", caller=ANYONE, lease_seconds=LONG)
        assert late.stored is not None and late.stored.record.key == first
        assert holder.done()  # it waited for the lock rather than answer empty
        await holder


# -- pinned by the mutation run of core/work_queue ------------------------------------------


async def test_a_pick_reads_past_whole_pages_of_items_it_cannot_take(client: AsyncClient) -> None:
    """The index is read a page at a time (PICK_PAGE): an eligible item behind more than
    a page of older items without the asked tag is still found, and exactly it."""
    from fencemark.node.core.work_queue import PICK_PAGE

    for i in range(2 * PICK_PAGE + 1):
        await item(client, f"plain-{i:03d}")
    await item(client, "tagged", "needs:gpu")
    picked = await client.claim_next(REPO, TOPIC, "w", tags=["needs:gpu"], lease_seconds=LONG)
    assert picked.record is not None and picked.record.id == "tagged"
    assert PICK_PAGE == 32


async def test_an_operators_reason_takes_1_to_256_printable_characters(
    client: AsyncClient,
) -> None:
    made = await item(client, "reasons")
    assert (await client.reopen(made.key, "r" * 256)).record is not None
    for bad in ("r" * 257, "", "tab\\there".replace("\\t", "\t")):
        with pytest.raises(InvalidArgument) as refused:
            await client.reopen(made.key, bad)
        assert [name for name, _ in refused.value.violations] == ["reason"]


async def test_reopen_and_force_release_answer_no_record_when_they_change_nothing(
    start_node: StartNode,
) -> None:
    """A refusal (here: another region's item) comes back without the record, and a
    take-back without a live claim names no superseded token."""
    node = await start_node("us")
    async with AsyncClient(node.address) as client:
        await client.remember(REPO, TOPIC, "here")
        await node.replica.merge(
            StateRecord(key_of("elsewhere")).create("eu", Stamp(0, node.replica.now_hlc(), "n-eu"))
        )
        reopened = await client.reopen(key_of("elsewhere"), "not mine")
        assert (reopened.reopened, reopened.record) == (False, None)
        taken = await client.force_release(key_of("elsewhere"), "not mine")
        assert (taken.released, taken.superseded_token) == (False, 0)
        free = await client.force_release(key_of("here"), "no claim")
        assert (free.released, free.superseded_token) == (False, 0)


async def test_each_claim_next_counts_one_outcome(node: NodeServer) -> None:
    async with AsyncClient(node.address) as client:
        await item(client, "counted")
        before = dict(node.claims.outcomes)
        await client.claim_next(REPO, TOPIC, "w", lease_seconds=LONG)
        await client.claim_next(REPO, TOPIC, "w2")
    assert node.claims.outcomes["granted"] - before.get("granted", 0) == 1
    assert node.claims.outcomes["empty"] - before.get("empty", 0) == 1


async def test_a_deferral_ends_exactly_retry_after_seconds_after_the_release(
    tmp_path: Path,
) -> None:
    """On a clock that stands still: not_before is the release's moment plus the
    deferral to the millisecond; 0 s defers to that very moment (allowed)."""
    now = 1_767_225_600_000
    async with claims_on_file(tmp_path, lambda: now) as claims:
        work = WorkQueue(claims)
        key = await made(claims, "deferred")
        for seconds in (61.5, 0.0):
            expected = now + round(seconds * 1000)
            picked = await work.claim_next("claims", "backlog", f"w{seconds}", lease_seconds=60,
                                           caller=ANYONE)  # fmt: skip
            assert picked.outcome.ok, picked.outcome
            ended = await claims.release(
                key, picked.outcome.token, caller=ANYONE, outcome="deferred",
                retry_after_seconds=seconds,
            )  # fmt: skip
            assert ended.ok
            stored = await claims.replica.find(key)
            assert stored is not None and stored.record.not_before_ms == expected
            if seconds:
                now += 61_500  # the deferral is over


async def test_a_waiter_gets_a_deferred_item_soon_after_its_deferral_ends_without_polling(
    tmp_path: Path,
) -> None:
    """The head of a topic's line whose only item is deferred sleeps until the deferral
    ends (``next_pickable_ms``), then takes it: soon after, not at its own deadline, and
    with a handful of looks meanwhile, not a busy loop."""
    wall = CountingWall()
    async with claims_on_file(tmp_path, wall) as claims:
        work = WorkQueue(claims)
        key = await made(claims, "deferred")
        picked = await work.claim_next("claims", "backlog", "w1", lease_seconds=LONG,
                                       caller=ANYONE)  # fmt: skip
        ended = await claims.release(key, picked.outcome.token, caller=ANYONE,
                                     outcome="deferred", retry_after_seconds=1.0)  # fmt: skip
        assert ended.ok
        wall.reads = 0
        async with asyncio.timeout(SOON):
            took = await work.claim_next("claims", "backlog", "w2", lease_seconds=LONG,
                                         wait_seconds=WAIT, caller=ANYONE)  # fmt: skip
        assert took.stored is not None and took.stored.record.key == key
        assert took.outcome.token == picked.outcome.token + 1
        assert wall.reads <= LOOKS, f"{wall.reads} clock reads while waiting: it polled"


async def test_claim_next_does_not_overtake_a_records_own_line_of_claim_waiters(
    tmp_path: Path,
) -> None:
    """A caller waiting in ``Claim``'s line for one item is first in line for it: a
    ``ClaimNext`` that finds the item free (here: its lease lapsed, on a clock moved
    past it, while the waiter still sleeps towards the lapse) passes over it."""
    now = time.time_ns() // 1_000_000
    async with claims_on_file(tmp_path, lambda: now) as claims:
        work = WorkQueue(claims)
        key = await made(claims, "queued-for")
        holder = await claims.claim(key, "holder", lease_seconds=1, caller=ANYONE)
        waiter = asyncio.create_task(
            claims.claim(key, "waiter", lease_seconds=LONG, wait_seconds=WAIT, caller=ANYONE)
        )
        await eventually(lambda: _queued(claims, key), "the waiter in the item's line")
        now += 2_000  # the lease is over; the waiter sleeps on for about a second
        picked = await work.claim_next("claims", "backlog", "next", lease_seconds=LONG,
                                       caller=ANYONE)  # fmt: skip
        assert (picked.outcome.ok, picked.outcome.reason) == (False, Reason.EMPTY)
        async with asyncio.timeout(SOON):
            took = await waiter
        assert (took.ok, took.token) == (True, holder.token + 1)


async def _queued(claims: Claims, key: str) -> bool:
    return claims.queue_depth(key) == 1


async def test_an_after_link_added_while_a_pick_waits_for_the_lock_is_honoured(
    tmp_path: Path,
) -> None:
    """A pick reads an item's ``after:`` items before it takes the item's lock; a link
    added in between (by the write the pick queued behind) is to an item it never
    looked at, which counts as not done: the item is not handed out. (The lock is
    taken directly, as in the test above: the only way to hold a write still; the
    other item is claimed, so not done.)"""
    async with claims_on_file(tmp_path) as claims:
        work, replica = WorkQueue(claims), claims.replica
        first = await made(claims, "first-step")
        assert (await claims.claim(first, "busy", lease_seconds=LONG, caller=ANYONE)).ok
        key = await made(claims, "second-step")
        async with replica._locks.hold(key):
            link = asyncio.create_task(
                replica.update(key, fields={}, add_tags=["after:first-step"], caller=ANYONE)
            )
            pick = asyncio.create_task(
                work.claim_next("claims", "backlog", "w", lease_seconds=LONG, caller=ANYONE)
            )
            # The link and then the pick queue for the lock (the pick has read the item
            # without the link by then).
            await eventually(lambda: _lock_users(claims, key, 3), "both queued for the lock")
        async with asyncio.timeout(SOON):
            await link
            picked = await pick
        assert (picked.outcome.ok, picked.outcome.reason) == (False, Reason.EMPTY)
        found = await replica.find(key)
        assert found is not None and "after:first-step" in found.record.tag_values()
        assert found.record.fence.fence == 0, "never granted"


async def _lock_users(claims: Claims, key: str, users: int) -> bool:
    held = claims.replica._locks._locks.get(key)
    return held is not None and held[1] == users


async def test_a_claim_waiting_on_an_item_picked_for_a_caller_that_left_gets_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The item a ``ClaimNext`` picked for a caller that left is withdrawn and wakes the
    line of the item itself: a ``Claim`` that found it claimed meanwhile, and sleeps
    in line until that lease would lapse (``DEFAULT_LEASE_S``), is granted at once."""
    assert DEFAULT_LEASE_S > SOON
    wall = CancellingWall()
    async with claims_on_file(tmp_path, wall) as claims:
        work = WorkQueue(claims)
        waiter = await asleep_at_the_head(work)
        key = "repo/claims/mem/backlog/picked-then-left"
        by_key: list[asyncio.Task[Outcome]] = []
        withdraw = claims.withdraw

        async def once_a_claim_sleeps_in_line(*args: Any, **kwargs: Any) -> Outcome:
            # The pick is durable, its caller gone: a claim by key finds it claimed.
            claim = claims.claim(key, "by-key", wait_seconds=WAIT, caller=ANYONE)
            by_key.append(asyncio.create_task(claim))
            await eventually(lambda: _queued(claims, key), "the claim by key in line")
            await asyncio.sleep(0.05)  # its look at the head over: asleep until the lapse
            return await withdraw(*args, **kwargs)

        monkeypatch.setattr(claims, "withdraw", once_a_claim_sleeps_in_line)
        wall.arm(waiter)  # cancelled by the clock read of its next pick
        assert await made(claims, "picked-then-left") == key  # the head picks it
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert not wall.armed and by_key, "premise: cancelled while its pick was made"
        async with asyncio.timeout(SOON):
            granted = await by_key[0]
        assert (granted.ok, granted.token) == (True, 2), "after the withdrawn token 1"


async def test_withdrawing_a_token_that_is_no_longer_the_live_claim_gives_nothing_back(
    tmp_path: Path,
) -> None:
    """Only the live claim's grant is withdrawn: a token the fence has moved past (an
    operator's force-release) answers as a plain release does and leaves the count
    as it is, as does one already released."""
    async with claims_on_file(tmp_path) as claims:
        work = WorkQueue(claims)
        key = await made(claims, "superseded")
        first = await claims.claim(key, "w", lease_seconds=LONG, caller=ANYONE)
        await work.force_release(key, "stopped by hand", caller=ANYONE)
        assert (await claims.withdraw(key, first.token, caller=ANYONE)).ok
        found = await claims.replica.find(key)
        assert found is not None and found.record.attempts == 1
        second = await claims.claim(key, "w", lease_seconds=LONG, caller=ANYONE)
        assert (await claims.release(key, second.token, caller=ANYONE)).ok
        assert (await claims.withdraw(key, second.token, caller=ANYONE)).ok
        found = await claims.replica.find(key)
        assert found is not None and found.record.attempts == 2


async def test_an_item_picked_for_a_waiter_that_left_stays_to_lapse_if_its_release_fails(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When withdrawing the item picked for a caller that left fails too (a storage
    fault), the caller still only sees its own cancellation; the failure is logged,
    and the lease lapses on its own."""
    wall = CancellingWall()
    async with claims_on_file(tmp_path, wall) as claims:
        work = WorkQueue(claims)
        waiter = await asleep_at_the_head(work)

        async def failing_withdraw(*args: object, **kwargs: object) -> object:
            raise OSError("the disk is gone")

        monkeypatch.setattr(claims, "withdraw", failing_withdraw)  # the fault, here only
        wall.arm(waiter)
        key = await made(claims, "picked-for-nobody")
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert not wall.armed, "premise: cancelled while its pick was made"
        assert "giving back what was picked for a caller that left failed" in caplog.text
        status = await claims.status(key, caller=ANYONE)
        assert status.holder is not None and status.holder.owner == "waiter"


async def test_a_pick_reads_each_page_of_the_index_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pick walks the index forwards, from the last candidate of each page: behind
    two full pages of items it cannot take, it reads three pages, not the same ones
    again. (The replica's own ``picks``, counted.)"""
    from fencemark.node.core.work_queue import PICK_PAGE

    async with claims_on_file(tmp_path) as claims:
        work, replica = WorkQueue(claims), claims.replica
        for i in range(2 * PICK_PAGE):
            await made(claims, f"plain-{i:03d}")
        tagged = await replica.remember(
            "claims", "backlog", "tagged", fields={"title": "t"}, tags=("needs:gpu",),
            caller=ANYONE,
        )  # fmt: skip
        pages: list[int] = []
        read = replica.picks

        async def counted(*args: object, **kwargs: object) -> list[object]:
            page = await read(*args, **kwargs)  # type: ignore[arg-type]
            pages.append(len(page))
            return page  # type: ignore[return-value]

        monkeypatch.setattr(replica, "picks", counted)
        picked = await work.claim_next("claims", "backlog", "w", tags=["needs:gpu"],
                                       lease_seconds=LONG, caller=ANYONE)  # fmt: skip
        assert picked.stored is not None
        assert picked.stored.record.key == tagged.stored.record.key
        assert pages == [PICK_PAGE, PICK_PAGE, 1]


async def test_a_take_back_hands_the_item_at_once_to_the_next_in_its_claim_line(
    tmp_path: Path,
) -> None:
    """A caller waiting in ``Claim``'s line behind a long lease gets the item as soon as
    an operator takes the claim back, not when the lease would have run out; and the
    take-back answers the record as it left it, the fence moved past the old token."""
    async with claims_on_file(tmp_path) as claims:
        work = WorkQueue(claims)
        key = await made(claims, "taken-back")
        holder = await claims.claim(key, "holder", lease_seconds=LONG, caller=ANYONE)
        waiter = asyncio.create_task(
            claims.claim(key, "waiter", lease_seconds=LONG, wait_seconds=WAIT, caller=ANYONE)
        )
        await eventually(lambda: _queued(claims, key), "the waiter in the item's line")
        taken = await work.force_release(key, "stuck", caller=ANYONE)
        assert taken.outcome.ok and taken.superseded == holder.token
        assert taken.stored is not None
        assert taken.stored.record.fence.fence == holder.token + 1
        async with asyncio.timeout(SOON):
            took = await waiter
        assert (took.ok, took.token) == (True, holder.token + 2)


async def test_take_backs_and_reopens_are_logged_with_who_and_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The operator's calls leave an audit line: the key, the identity (or "a caller"
    on a node without identities) and the reason; a refused call leaves none."""
    caplog.set_level(logging.INFO, logger="fencemark.node.core.work_queue")
    async with claims_on_file(tmp_path) as claims:
        work = WorkQueue(claims)
        key = await made(claims, "audited")
        claim = await claims.claim(key, "holder", lease_seconds=LONG, caller=ANYONE)
        ops = Caller("client/ops")
        assert (await work.force_release(key, "stuck for an hour", caller=ops)).outcome.ok
        assert (await work.reopen(key, "try again", caller=ANYONE)).outcome.ok
        refused = await work.force_release(key, "nothing to take", caller=ops)
        assert not refused.outcome.ok
    lines = [r.getMessage() for r in caplog.records if r.name.endswith("work_queue")]
    assert lines == [
        f"took claim {claim.token} of {key} back for client/ops: stuck for an hour",
        f"reopened {key} for a caller: try again",
    ]


async def test_take_backs_and_reopens_name_their_operator_in_the_history(tmp_path: Path) -> None:
    """Issue 33, finding 8: history's ``forced`` and ``reopened`` events did not say
    which operator acted; they keep the caller's identity beside the reason."""
    async with claims_on_file(tmp_path) as claims:
        work = WorkQueue(claims)
        key = await made(claims, "audited")
        await claims.claim(key, "holder", lease_seconds=LONG, caller=ANYONE)
        taken = await work.force_release(key, "stuck", caller=Caller("client/ops"))
        assert taken.outcome.ok
        assert (await work.reopen(key, "again", caller=Caller("client/lead"))).outcome.ok
        events = await claims.replica.history(key)
    assert [(e.kind, e.detail, e.actor) for e in events if e.actor or e.detail] == [
        ("forced", "stuck", "client/ops"),
        ("reopened", "again", "client/lead"),
    ]


async def test_a_data_file_from_before_operators_were_named_keeps_its_history(
    start_node: StartNode, tmp_path: Path
) -> None:
    """Opening a file whose history table has no ``actor`` column adds it; the events
    it holds stay, with no operator named."""
    data = tmp_path / "old"
    node = await start_node("local", data_dir=data)
    async with AsyncClient(node.address) as client:
        made = await item(client, "kept")
        await client.claim(made.key, "w", lease_seconds=LONG)
    await node.stop()
    import sqlite3

    with sqlite3.connect(data / DB_FILE) as db:
        db.execute("ALTER TABLE events DROP COLUMN actor")
    node = await start_node("local", data_dir=data)
    async with AsyncClient(node.address) as client:
        await client.force_release(made.key, "moved on")
        events = (await client.history(made.key)).events
    assert [(e.kind, e.actor) for e in events] == [("granted", ""), ("forced", "")]


async def test_a_claim_next_retry_gets_its_item_again_with_claim_waiters_queued_for_it(
    tmp_path: Path,
) -> None:
    """The holder's retry of a lost ``ClaimNext`` reply is the same claim, extended, even
    while other callers wait in the item's ``Claim`` line: they wait for its end, not
    for the holder to be handed another item."""
    async with claims_on_file(tmp_path) as claims:
        work = WorkQueue(claims)
        key = await made(claims, "retried")
        await made(claims, "another")
        first = await work.claim_next("claims", "backlog", "w", lease_seconds=LONG,
                                      caller=ANYONE)  # fmt: skip
        assert first.stored is not None and first.stored.record.key == key
        waiter = asyncio.create_task(
            claims.claim(key, "waiter", lease_seconds=LONG, wait_seconds=WAIT, caller=ANYONE)
        )
        await eventually(lambda: _queued(claims, key), "a waiter in the item's line")
        again = await work.claim_next("claims", "backlog", "w", lease_seconds=LONG,
                                      caller=ANYONE)  # fmt: skip
        waiter.cancel()
        assert again.stored is not None and again.stored.record.key == key
        assert again.outcome.token == first.outcome.token


async def test_a_caller_that_leaves_while_its_look_finds_nothing_leaves_no_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Only a pick that claimed an item has something to release when its caller
    leaves: one that found nothing just goes."""
    wall = CancellingWall()
    async with claims_on_file(tmp_path, wall) as claims:
        work = WorkQueue(claims)
        waiter = await asleep_at_the_head(work)
        wall.arm(waiter)
        # A change in the topic wakes the head; nothing in it can be had.
        await claims.replica.remember("claims", "backlog", "blocked", fields={"title": "b"},
                                      tags=("after:never-done",), caller=ANYONE)  # fmt: skip
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert not wall.armed, "premise: cancelled while it looked"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_claim_next_defaults_to_the_nodes_lease_and_to_not_waiting(tmp_path: Path) -> None:
    now = 1_767_225_600_000
    async with claims_on_file(tmp_path, lambda: now) as claims:
        work = WorkQueue(claims)
        empty = await work.claim_next("claims", "backlog", "w", caller=ANYONE)
        assert empty.outcome.reason == Reason.EMPTY and claims.waits == 0
        await made(claims, "defaults")
        picked = await work.claim_next("claims", "backlog", "w", caller=ANYONE)
        assert picked.outcome.expiry_ms == now + round(DEFAULT_LEASE_S * 1000)


async def test_claim_next_only_at_target_leaves_the_other_regions_alone(tmp_path: Path) -> None:
    """``only_target``: eu's item is not asked for (nor picked) from us."""
    async with Cluster(tmp_path, ["us", "eu"]) as cluster:
        await all_deciding(*await cluster.start_all())
        regions = dict(cluster.addresses)
        async with AsyncClient(regions["us"], regions=regions) as us:
            await us.remember(REPO, TOPIC, "eu-item", tags=["homeRegion:eu"])
            alone = await us.claim_next(REPO, TOPIC, "w", lease_seconds=LONG, only_target=True)
            routed = await us.claim_next(REPO, TOPIC, "w", lease_seconds=LONG)
    assert (alone.granted, alone.reason) == (False, "empty")
    assert routed.granted and routed.record is not None and routed.record.id == "eu-item"


@pytest.mark.slow
async def test_one_new_item_elsewhere_goes_to_one_of_two_hundred_waiters_with_a_few_looks(
    tmp_path: Path,
) -> None:
    """Issue 36: agents in ``us`` waiting for work across regions each made ``eu``
    serve a ``ClaimNext`` for one new ``eu`` item — at 1,000 agents, 1,000 calls for
    one item. Now ``us`` tells one waiter, the first, of the item (``elsewhere``) and
    only that waiter asks ``eu``: one grant, one call at ``eu``, and the other 199
    wait on in ``us``'s line."""
    waiters = 200
    async with Cluster(tmp_path, ["us", "eu"]) as cluster:
        limits = {"max_waiters": 2 * waiters, "max_waiters_per_client": 2 * waiters}
        us, eu = await asyncio.gather(*(cluster.start(r, **limits) for r in ("us", "eu")))
        await all_deciding(us, eu)
        regions = dict(cluster.addresses)
        agents = [AsyncClient(regions["us"], regions=regions) for _ in range(waiters)]
        try:
            tasks = []
            for index, agent in enumerate(agents):  # in line in this order
                tasks.append(asyncio.create_task(agent.claim_next(
                    REPO, TOPIC, f"agent-{index:03d}", wait_seconds=WAIT, lease_seconds=LONG,
                )))  # fmt: skip
                await eventually(functools.partial(_waiting, us, index + 1), "in line")
            calls_at_eu = sum(eu.claims.outcomes.values())
            async with AsyncClient(regions["eu"]) as pm:
                await pm.remember(REPO, TOPIC, "new", tags=["homeRegion:eu"])

            async def granted() -> bool:
                return any(t.done() for t in tasks)

            await eventually(granted, "one waiter granted the eu item")
            done = [t for t in tasks if t.done()]
            assert len(done) == 1 and tasks[0] in done  # the first in line
            first = done[0].result()
            assert first.granted and first.record is not None and first.record.id == "new"
            assert first.home_region == "eu"
            await asyncio.sleep(1.0)  # the grant replicates back: nobody else is sent
            assert sum(t.done() for t in tasks) == 1
            assert sum(eu.claims.outcomes.values()) - calls_at_eu == 1  # one call at eu
            assert us.work.hints == 1 and us.claims.waiting == waiters - 1
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.gather(*(a.close() for a in agents))


def _homed_elsewhere(id_: str, region: str, *tags: str) -> StateRecord:
    """An item of the claims topic homed in ``region``, as a merge brings it."""
    key = f"repo/claims/mem/backlog/{id_}"
    stamp = Stamp(0, int(time.time() * 1000) << 16, f"n-{region}")
    return StateRecord(key).create(region, stamp).add_tags(tags, stamp)


async def test_a_waiter_that_asks_is_told_of_an_item_elsewhere_and_only_the_first(
    tmp_path: Path,
) -> None:
    """``hint_elsewhere`` (issue 36): nothing here, an eligible item homed in eu —
    the first waiter that asked is told (``elsewhere``, with the item); the one
    behind it, and one that did not ask, wait on; an item whose tags a waiter lacks
    is not told to it, nor is a claimed one."""
    async with claims_on_file(tmp_path) as claims:
        work = WorkQueue(claims)

        def waiting(owner: str, *, hint: bool, tags: tuple[str, ...] = ()) -> asyncio.Task[Any]:
            return asyncio.create_task(work.claim_next(
                "claims", "backlog", owner, wait_seconds=WAIT, caller=ANYONE,
                hint_elsewhere=hint, tags=tags,
            ))  # fmt: skip

        plain = asyncio.create_task(  # one that does not ask (the default)
            work.claim_next("claims", "backlog", "plain", wait_seconds=WAIT, caller=ANYONE)
        )
        await eventually(functools.partial(_waiting_in, claims, 1), "plain in line")
        picky = waiting("picky", hint=True, tags=("gpu",))
        await eventually(functools.partial(_waiting_in, claims, 2), "picky in line")
        first, second = waiting("first", hint=True), waiting("second", hint=True)
        await eventually(functools.partial(_waiting_in, claims, 4), "all in line")
        held = _homed_elsewhere("held", "eu")
        grant = Grant(held.max_hlc(), "someone", "eu")
        held = held.with_fence(held.fence.grant(1, grant, int(time.time() * 1000) + 60_000))
        await claims.replica.merge(held)  # claimed at eu: nobody is told of it
        await asyncio.sleep(0.2)
        assert work.hints == 0
        await claims.replica.merge(_homed_elsewhere("free", "eu"))
        told = await asyncio.wait_for(first, 5)
        assert (told.outcome.ok, told.outcome.reason, told.outcome.home_region) == (
            False, Reason.ELSEWHERE, "eu"
        )  # fmt: skip
        assert told.stored is not None and told.stored.record.key.endswith("/free")
        await asyncio.sleep(0.2)
        assert not (plain.done() or picky.done() or second.done()) and work.hints == 1
        for task in (plain, picky, second):
            task.cancel()
        await asyncio.gather(plain, picky, second, return_exceptions=True)
        await work.stop()


async def _waiting_in(claims: Claims, count: int) -> bool:
    return claims.waiting == count


async def test_each_waiter_that_asks_is_told_of_another_item_elsewhere_in_pick_order(
    tmp_path: Path,
) -> None:
    """Several items homed in eu: each waiter in line is told of the next one not yet
    told of, in pick order, passing over one whose ``after:`` item is not done."""
    async with claims_on_file(tmp_path) as claims:
        work = WorkQueue(claims)
        tasks = []
        for index in range(3):
            tasks.append(asyncio.create_task(work.claim_next(
                "claims", "backlog", f"w{index}", wait_seconds=WAIT, caller=ANYONE,
                hint_elsewhere=True,
            )))  # fmt: skip
            await eventually(functools.partial(_waiting_in, claims, index + 1), "in line")
        began = time.monotonic()
        for state in (
            _homed_elsewhere("a-first", "eu"),
            _homed_elsewhere("b-blocked", "eu", "after:never-done"),
            _homed_elsewhere("never-done", "eu", "priority:P9"),
            _homed_elsewhere("c-third", "eu"),
        ):
            await claims.replica.merge(state)
        told = [await asyncio.wait_for(t, 5) for t in tasks]
        assert time.monotonic() - began < HINT_HOLD_S  # no item told of twice meanwhile
        keys = [t.stored.record.key.rsplit("/", 1)[1] for t in told if t.stored is not None]
        # Each told of its own item; the one whose after: item is not done, to nobody.
        assert sorted(keys) == ["a-first", "c-third", "never-done"]
        assert work.hints == 3
        await work.stop()


async def test_a_waiter_is_told_of_an_item_elsewhere_past_a_page_of_ineligible_ones(
    tmp_path: Path,
) -> None:
    """The pick index of another home is read a page at a time: an eligible item
    behind more ineligible ones than a page holds (each waits on an item never done)
    is still told of."""
    async with claims_on_file(tmp_path) as claims:
        work = WorkQueue(claims)
        for index in range(PICK_PAGE + 3):  # ahead of the free one in pick order
            waiting_on = _homed_elsewhere(f"a-{index:03d}", "eu", "priority:P0", "after:nope")
            await claims.replica.merge(waiting_on)
        await claims.replica.merge(_homed_elsewhere("z-free", "eu"))
        told = await asyncio.wait_for(work.claim_next(
            "claims", "backlog", "w", wait_seconds=WAIT, caller=ANYONE, hint_elsewhere=True,
        ), 5)  # fmt: skip
        assert told.outcome.reason == Reason.ELSEWHERE and told.stored is not None
        assert told.stored.record.key.endswith("/z-free")
        await work.stop()


async def test_an_item_elsewhere_told_to_a_waiter_that_left_is_told_to_the_next_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first waiter leaves exactly while its look tells it of an item homed in
    eu: the item is not held back for the hold (here a minute) for nobody — the
    waiter behind it is told of it at once."""
    monkeypatch.setattr("fencemark.node.core.work_queue.HINT_HOLD_S", 60.0)
    wall = CancellingWall()
    async with claims_on_file(tmp_path, wall) as claims:
        work = WorkQueue(claims)
        tasks = []
        for owner in ("leaves", "next"):
            tasks.append(asyncio.create_task(work.claim_next(
                "claims", "backlog", owner, wait_seconds=WAIT, caller=ANYONE,
                hint_elsewhere=True,
            )))  # fmt: skip
            await eventually(functools.partial(_waiting_in, claims, len(tasks)), "in line")
        await asyncio.sleep(0.05)  # both asleep, their first looks over
        leaves, after = tasks
        wall.arm(leaves)  # cancelled by the clock read of its next look
        await claims.replica.merge(_homed_elsewhere("free", "eu"))
        with pytest.raises(asyncio.CancelledError):
            await leaves
        assert not wall.armed, "premise: cancelled while it looked"
        told = await asyncio.wait_for(after, 5)
        assert told.outcome.reason == Reason.ELSEWHERE and told.stored is not None
        assert told.stored.record.key.endswith("/free")
        assert work.hints == 2  # told twice: to the one that left, then to the next
        await work.stop()


async def test_a_waiter_is_told_of_an_item_elsewhere_when_its_lease_there_runs_out(
    tmp_path: Path,
) -> None:
    """No write says that a lease at eu ran out: the line of a waiter that asks for
    items elsewhere times its next look by the leases and deferrals of the other
    homes too — for as long as one such waiter is left in it (one of two left), and
    the count of them goes with the last."""
    async with claims_on_file(tmp_path) as claims:
        work = WorkQueue(claims)

        def hinting(owner: str) -> asyncio.Task[Any]:
            return asyncio.create_task(work.claim_next(
                "claims", "backlog", owner, wait_seconds=WAIT, caller=ANYONE,
                hint_elsewhere=True,
            ))  # fmt: skip

        leaves = hinting("leaves")
        await eventually(functools.partial(_waiting_in, claims, 1), "in line")
        stays = hinting("stays")
        await eventually(functools.partial(_waiting_in, claims, 2), "both in line")
        leaves.cancel()
        await asyncio.gather(leaves, return_exceptions=True)
        held = _homed_elsewhere("lapsing", "eu")
        grant = Grant(held.max_hlc(), "someone", "eu")
        expiry = int(time.time() * 1000) + 1_000
        await claims.replica.merge(held.with_fence(held.fence.grant(1, grant, expiry)))
        await asyncio.sleep(0.2)
        assert not stays.done(), "premise: held at eu, nobody is told of it yet"
        told = await asyncio.wait_for(stays, 10)  # its wait is far longer
        assert told.outcome.reason == Reason.ELSEWHERE and told.stored is not None
        assert told.stored.record.key.endswith("/lapsing")
        assert not work._hinting, "no count left behind for a topic nobody waits in"
        await work.stop()


async def test_a_look_behind_waiters_that_did_not_ask_is_not_told_of_an_item_elsewhere(
    tmp_path: Path,
) -> None:
    """A ``ClaimNext`` that does not wait takes one look behind the waiters in line;
    it did not ask to hear of items elsewhere, so an eligible one homed in eu leaves
    it ``empty`` (the waiter in line, which asked, is told of it)."""
    async with claims_on_file(tmp_path) as claims:
        work = WorkQueue(claims)
        waiting = asyncio.create_task(work.claim_next(
            "claims", "backlog", "waits", wait_seconds=WAIT, caller=ANYONE, hint_elsewhere=True,
            tags=("gpu",),  # suits no item here: it stays in line
        ))  # fmt: skip
        await eventually(functools.partial(_waiting_in, claims, 1), "in line")
        await claims.replica.merge(_homed_elsewhere("abroad", "eu"))
        looked = await work.claim_next("claims", "backlog", "looks", caller=ANYONE)
        assert (looked.outcome.ok, looked.outcome.reason) == (False, Reason.EMPTY)
        assert work.hints == 0 and not waiting.done()
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        await work.stop()


async def test_a_look_behind_one_waiter_takes_what_suits_the_newcomer_only(
    tmp_path: Path,
) -> None:
    """Behind a single waiter (it wants ``gpu``), a ``ClaimNext`` that does not wait
    takes its one look in line: the item there, which the waiter ahead does not want,
    is the newcomer's."""
    async with claims_on_file(tmp_path) as claims:
        work = WorkQueue(claims)
        waiting = asyncio.create_task(work.claim_next(
            "claims", "backlog", "gpu-only", wait_seconds=WAIT, caller=ANYONE, tags=("gpu",),
        ))  # fmt: skip
        await eventually(functools.partial(_waiting_in, claims, 1), "in line")
        key = await made(claims, "plain")
        looked = await work.claim_next("claims", "backlog", "newcomer", caller=ANYONE)
        assert looked.outcome.ok and looked.stored is not None
        assert looked.stored.record.key == key and not waiting.done()
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        await work.stop()

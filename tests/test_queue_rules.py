"""The work queue's rules as pure functions (``fencemark.node.rules.queue``, SPEC §8):
each condition of eligibility on its own, the parking threshold, what a claim's end
writes, and what counts as the retry of a release that took effect.

The gRPC-level behaviour is tests/test_work_queue.py; here each rule is pinned where
the node's pick index would otherwise hide it (an item the index leaves out never
reaches ``eligible``).
"""

from __future__ import annotations

import pytest

from fencemark.node.crdt import Grant, Record, Stamp
from fencemark.node.crdt.hlc import pack
from fencemark.node.crdt.record import (
    ATTEMPTS,
    DEFERRED,
    DONE,
    FAILED,
    FORCED,
    LAPSED,
    OPEN,
    PARKED,
)
from fencemark.node.rules import queue

KEY = "repo/r/mem/t/item"
NOW = 1_767_225_600_000


def stamp(epoch: int = 0, ms: int = NOW) -> Stamp:
    return Stamp(epoch, pack(ms), "n-us")


def item(*tags: str, home: str = "us") -> Record:
    return Record(KEY).create(home, stamp(ms=NOW - 10)).add_tags(tags, stamp(ms=NOW - 10))


def claimed(record: Record, token: int = 1, lease_ms: int = 60_000) -> Record:
    fence = record.fence.grant(token, Grant(pack(NOW - 5), "w", "us"), NOW + lease_ms)
    return record.with_fence(fence)


def eligible(
    record: Record, *, tags: tuple[str, ...] = (), done: frozenset[str] = frozenset()
) -> bool:
    return queue.eligible(record, region="us", now_ms=NOW, tags=tags, done=done.__contains__)


def test_an_open_visible_unclaimed_item_of_this_home_is_eligible() -> None:
    assert eligible(item())


@pytest.mark.parametrize(
    "why",
    ["never created", "deleted", "homed elsewhere", "done", "parked", "claimed", "deferred",
     "missing tag", "waiting on an item not done"],
)  # fmt: skip
def test_each_condition_alone_makes_an_item_ineligible(why: str) -> None:
    base = item("gpu", "after:first")
    record = {
        "never created": Record(KEY),
        "deleted": base.set_deleted(True, stamp(ms=NOW - 1)),
        "homed elsewhere": item("gpu", "after:first", home="eu"),
        "done": base.set_queue({"status": DONE}, stamp(ms=NOW - 1)),
        "parked": base.set_queue({"status": PARKED}, stamp(ms=NOW - 1)),
        "claimed": claimed(base),
        "deferred": base.set_queue({"not_before": str(NOW + 1)}, stamp(ms=NOW - 1)),
        "missing tag": base,
        "waiting on an item not done": base,
    }[why]
    tags = ("gpu", "fast") if why == "missing tag" else ("gpu",)
    done = frozenset() if why == "waiting on an item not done" else frozenset({"first"})
    assert not eligible(record, tags=tags, done=done)
    assert eligible(base, tags=("gpu",), done=frozenset({"first"}))


def held(record: Record, *, tags: tuple[str, ...] = ()) -> bool:
    return queue.held_for_retry(record, region="us", now_ms=NOW, tags=tags)


@pytest.mark.parametrize(
    "why",
    ["never created", "deleted", "homed elsewhere", "done", "parked", "not claimed",
     "lease over", "missing tag"],
)  # fmt: skip
def test_a_claim_answers_a_retry_only_while_live_open_here_and_tagged(why: str) -> None:
    """``ClaimNext``'s retry (SPEC §4): the held item is answered again only while its
    claim is live and it is still an open item of this home with the asked tags; a
    deferral or an ``after:`` item no longer matters once it was granted."""
    base = claimed(item("gpu", "after:first").set_queue({"not_before": str(NOW + 1)}, stamp()))
    record = {
        "never created": Record(KEY),
        "deleted": base.set_deleted(True, stamp(1, NOW - 1)),
        "homed elsewhere": claimed(item("gpu", home="eu")),
        "done": base.set_queue({"status": DONE}, stamp(1, NOW - 1)),
        "parked": base.set_queue({"status": PARKED}, stamp(1, NOW - 1)),
        "not claimed": item("gpu"),
        "lease over": claimed(item("gpu"), lease_ms=0),
        "missing tag": base,
    }[why]
    tags = ("gpu", "fast") if why == "missing tag" else ("gpu",)
    assert not held(record, tags=tags)
    assert held(base, tags=("gpu",))


def test_a_deferral_ends_at_its_millisecond_and_a_lapsed_lease_holds_nothing() -> None:
    at = item().set_queue({"not_before": str(NOW)}, stamp(ms=NOW - 1))
    assert eligible(at)
    assert eligible(claimed(item(), lease_ms=-1))  # expired: not live, lapse not yet recorded


@pytest.mark.parametrize(
    ("tags", "expected"),
    [((), 5), (("maxAttempts:1",), 1), (("maxAttempts:1000",), 1000), (("maxAttempts:0",), 5),
     (("maxAttempts:1001",), 5), (("maxAttempts:x",), 5), (("maxAttempts:-2",), 5),
     (("maxAttempts:3", "maxAttempts:0"), 3)],
)  # fmt: skip
def test_max_attempts_comes_from_a_valid_tag_else_the_nodes_default(
    tags: tuple[str, ...], expected: int
) -> None:
    assert queue.max_attempts(item(*tags), 5) == expected


def test_each_ending_writes_its_outcome_and_only_failures_park_at_the_threshold() -> None:
    counted = queue.granted(queue.granted(item("maxAttempts:2"), stamp(1)), stamp(1, NOW + 1))
    assert counted.attempts == 2
    at = stamp(1, NOW + 2)
    for ending, status in ((DONE, DONE), (FAILED, PARKED), (LAPSED, PARKED), (FORCED, OPEN),
                           (DEFERRED, OPEN)):  # fmt: skip
        ended = queue.ended(counted, ending, at, default_max_attempts=5, not_before_ms=NOW + 9)
        assert ended.outcome is not None and (ended.outcome.value, ended.status) == (
            ending,
            status,
        ), ending
        assert ended.not_before_ms == (NOW + 9 if ending == DEFERRED else 0), ending
    once = queue.granted(item("maxAttempts:2"), stamp(1))
    assert queue.ended(once, FAILED, at, default_max_attempts=5).status == OPEN


def test_a_withdrawn_grant_gives_its_attempt_back_and_never_counts_below_zero() -> None:
    """A grant its caller never received leaves the count as before the grant, at
    the grant's epoch: a later failure then parks a ``maxAttempts:2`` item at 2."""
    once = queue.granted(item("maxAttempts:2"), stamp(1))
    again = queue.granted(once, stamp(2))
    back = queue.withdrawn(again, stamp(2, NOW + 1))
    assert back.attempts == 1
    assert back.queue[ATTEMPTS].stamp == stamp(2, NOW + 1)
    assert back.merge(again).attempts == 1, "the withdrawal wins over the grant it undoes"
    third = queue.granted(back, stamp(3))
    assert queue.ended(third, FAILED, stamp(3, NOW + 2), default_max_attempts=5).status == PARKED
    assert queue.withdrawn(item(), stamp(1)).attempts == 0


def test_a_reopen_opens_and_counts_from_zero_with_no_deferral() -> None:
    parked = item().set_queue({"status": PARKED, "attempts": "7", "not_before": "9"}, stamp(1))
    again = queue.reopened(parked, stamp(1, NOW + 1))
    assert (again.status, again.attempts, again.not_before_ms) == (OPEN, 0, 0)


def test_only_the_same_release_of_a_released_token_counts_as_its_retry() -> None:
    held = claimed(item())
    at = stamp(1, NOW + 1)
    released = queue.ended(held.set_fields({"result": "ok"}, at), DONE, at,
                           default_max_attempts=5)  # fmt: skip
    released = released.with_fence(released.fence.release(1))
    fields = {"result": "ok"}
    assert queue.already_ended(released, 1, DONE, fields)
    assert queue.already_ended(released, 1, DONE, {})
    assert not queue.already_ended(held, 1, DONE, fields)  # not released yet
    assert not queue.already_ended(released, 1, FAILED, fields)  # another ending
    assert not queue.already_ended(released, 1, DONE, {"result": "other"})
    assert not queue.already_ended(released, 1, DONE, {"missing": "ok"})
    older = released.set_fields({"note": "x"}, stamp(0, NOW + 2))
    assert not queue.already_ended(older, 1, DONE, {"note": "x"})  # not at the token's epoch
    plain = held.with_fence(held.fence.release(1))
    assert queue.already_ended(plain, 1, "", {})
    assert not queue.already_ended(plain, 1, DONE, {})  # no outcome recorded


@pytest.mark.parametrize(
    ("tags", "level"),
    [((), 10), (("priority:P0",), 0), (("priority:P7",), 7), (("priority:P9", "priority:P2"), 2),
     (("priority:high",), 10), (("priority:P10",), 10), (("Priority:P1",), 10)],
)  # fmt: skip
def test_an_items_priority_is_its_most_urgent_p0_to_p9_tag_else_last(
    tags: tuple[str, ...], level: int
) -> None:
    assert item(*tags).priority == level


def test_an_item_waits_on_the_ids_its_after_tags_name_sorted() -> None:
    assert item("after:b", "after:a", "later:c").waits_on == ["a", "b"]
    assert item().waits_on == []


def test_the_queue_accessors_read_their_registers_and_default_to_a_fresh_item() -> None:
    fresh = item()
    assert (fresh.status, fresh.attempts, fresh.not_before_ms, fresh.outcome) == (OPEN, 0, 0, None)
    written = fresh.set_queue(
        {"status": DONE, "attempts": "3", "not_before": "42", "outcome": DONE}, stamp(1)
    )
    assert (written.status, written.attempts, written.not_before_ms) == (DONE, 3, 42)
    assert written.outcome is not None and written.outcome.value == DONE

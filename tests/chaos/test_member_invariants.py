"""The member chaos tier's invariants judge histories rightly: each rule condemns the
history that breaks it, and none condemns what an ordering of effects explains."""

from __future__ import annotations

from datetime import UTC, datetime

from fencemark.client import Record
from tests.chaos.member_invariants import (
    Grant,
    Release,
    acknowledged_kept,
    claims_exclusive,
    decider_after_each,
    done_once,
    holders_kept,
    replaced_while_cut,
)

LEASE_S = 10.0


def grant(key: str, token: int, sent: float, owner: str = "w1") -> Grant:
    return Grant(key, token, owner, sent, sent + 0.1)


def release(key: str, token: int, sent: float, released: bool = True) -> Release:
    return Release(key, token, sent, sent + 0.1, released)


def test_a_claim_granted_again_after_its_release_or_lease_is_allowed() -> None:
    released = [grant("a", 5, 0.0), grant("a", 9, 3.0, "w2")]
    assert claims_exclusive(released, [release("a", 5, 2.0, released=False)], LEASE_S).ok
    lapsed = [grant("b", 5, 0.0), grant("b", 9, 11.0, "w2")]
    assert claims_exclusive(lapsed, [], LEASE_S).ok


def test_a_live_claim_granted_again_is_condemned() -> None:
    verdict = claims_exclusive([grant("a", 5, 0.0), grant("a", 9, 3.0, "w2")], [], LEASE_S)
    assert not verdict.ok and "while w1's claim (token 5) was live" in verdict.detail


def test_overlapping_calls_condemn_nothing() -> None:
    # The second grant was sent before the first was answered: either took effect first.
    overlapping = [Grant("a", 9, "w2", 0.0, 0.5), Grant("a", 5, "w1", 0.1, 0.2)]
    assert claims_exclusive(overlapping, [], LEASE_S).ok


def test_tokens_that_fall_or_repeat_are_condemned() -> None:
    fell = claims_exclusive([grant("a", 9, 0.0), grant("a", 5, 20.0, "w2")], [], LEASE_S)
    assert not fell.ok and "token 5 granted after token 9" in fell.detail
    again = claims_exclusive([Grant("a", 5, "w1", 0.0, 1.0), Grant("a", 5, "w2", 0.5, 0.6)],
                             [], LEASE_S)  # fmt: skip
    assert not again.ok and "a token granted twice" in again.detail


def test_a_grant_after_the_item_was_done_is_condemned() -> None:
    grants = [grant("a", 5, 0.0), grant("a", 9, 30.0, "w2")]
    verdict = claims_exclusive(grants, [release("a", 5, 1.0)], LEASE_S)
    assert not verdict.ok and "after it was done" in verdict.detail


def test_an_item_done_twice_is_condemned_and_once_is_not() -> None:
    assert done_once([release("a", 5, 1.0), release("a", 5, 2.0, released=False)]).ok
    twice = done_once([release("a", 5, 1.0), release("a", 9, 2.0)])
    assert not twice.ok and "a" in twice.detail


def record(key: str, **fields: str) -> Record:
    return Record(key, "chaos", "queue", key, fields=fields, updated_at=datetime.now(UTC))


def test_an_acknowledged_write_missing_anywhere_is_lost() -> None:
    full = {"a": record("a"), "h": record("h", n="7")}
    assert acknowledged_kept(["a"], {"us-a": full, "eu": full}, "h", 7, "n").ok
    lost = acknowledged_kept(["a", "b"], {"us-a": full}, "h", 7, "n")
    assert not lost.ok and "us-a lacks 1 acknowledged: b" in lost.detail
    behind = acknowledged_kept(["a"], {"us-a": full}, "h", 8, "n")
    assert not behind.ok and "n=7, acknowledged 8" in behind.detail
    silent = acknowledged_kept(["a"], {"us-a": None}, "h", 0, "n")
    assert not silent.ok and "us-a did not answer" in silent.detail


def test_a_holder_refused_for_its_claim_and_a_late_decider_are_condemned() -> None:
    assert holders_kept([], 40).ok
    assert not holders_kept(["renewal at 12.0 s: not renewed"], 40).ok
    assert decider_after_each({"kill-decider": 3.0}, 30.0).ok
    late = decider_after_each({"kill-decider": 3.0, "etcd-quorum-lost": None}, 30.0)
    assert not late.ok and "etcd-quorum-lost: none" in late.detail


def test_a_cut_off_decider_not_replaced_in_time_is_condemned() -> None:
    assert replaced_while_cut({"3 cut-decider-from-members": 5.2}, 15.0).ok
    never = replaced_while_cut({"3 cut-decider-from-members": None}, 15.0)
    assert not never.ok and "3 cut-decider-from-members: none" in never.detail
    late = replaced_while_cut({"1 cut-decider-from-members": 16.0}, 15.0)
    assert not late.ok and "16.0 s" in late.detail

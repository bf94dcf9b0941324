"""Majorities of a region's members (fencemark.node.rules.quorum, SPEC §10).

The safety of a region of several members rests on these counts: every set of
states a new decider (or a member back on a lost disk) must hold meets every set of
members that acknowledged a write. Proven here over every configured set of up to
seven members, every acknowledging majority and every choice of the members whose
rounds are counted; and pinned as tight for odd sets (one fewer would leave a
majority unseen), so that the rule asks for no more than it needs.
"""

from __future__ import annotations

import itertools

from hypothesis import assume, given
from hypothesis import strategies as st

from fencemark.node.rules.quorum import acknowledged, fellows_needed, holds_majority, majority

NAMES = tuple(f"m{i}" for i in range(7))
LEARNER = "learner"


def subsets(names: tuple[str, ...], size: int) -> list[set[str]]:
    return [set(c) for c in itertools.combinations(names, size)] if size >= 0 else []


def test_a_majority_is_more_than_half_and_no_more() -> None:
    for n in range(1, 12):
        assert 2 * majority(n) > n  # any two majorities share a member
        assert 2 * (majority(n) - 1) <= n  # two disjoint sets one smaller do exist
    assert majority(0) == 1  # nobody configured: no set of holders is a majority


@st.composite
def regions(draw: st.DrawFn) -> tuple[tuple[str, ...], str, bool]:
    """A configured member set, a member (configured or a learner), and whether that
    member holds all it acknowledged."""
    configured = NAMES[: draw(st.integers(1, len(NAMES)))]
    me = draw(st.sampled_from([*configured, LEARNER]))
    return configured, me, draw(st.booleans())


def still_held(acked: set[str], me: str, intact: bool) -> set[str]:
    """The acknowledging members that still hold the write: all but ``me`` when
    its disk was lost."""
    return acked if intact else acked - {me}


@given(regions())
def test_the_states_a_member_must_hold_meet_every_acknowledging_majority(
    region: tuple[tuple[str, ...], str, bool],
) -> None:
    configured, me, intact = region
    needed = fellows_needed(configured, me, intact=intact)
    itself = {me} if me in configured and intact else set()
    fellows = tuple(n for n in configured if n != me)
    for counted in subsets(fellows, needed):
        assert holds_majority(configured, me, intact=intact, rounds_with=counted)
        for acked in subsets(configured, majority(len(configured))):
            assert acknowledged(configured, acked)
            held = still_held(acked, me, intact)
            # Held by nobody any more: only a lost disk had it (a region of one).
            assert (counted | itself) & held or not held, (counted, itself, acked)


@given(regions())
def test_one_fellow_fewer_leaves_a_write_unseen_in_an_odd_set(
    region: tuple[tuple[str, ...], str, bool],
) -> None:
    """The rule asks for no more than it needs (in an even set, half the members
    would meet every majority already: it asks one more, as etcd does)."""
    configured, me, intact = region
    assume(len(configured) % 2 == 1)
    needed = fellows_needed(configured, me, intact=intact)
    itself = {me} if me in configured and intact else set()
    fellows = tuple(n for n in configured if n != me)
    for counted in subsets(fellows, needed - 1):
        assert not holds_majority(configured, me, intact=intact, rounds_with=counted)
        unseen = [
            acked
            for acked in subsets(configured, majority(len(configured)))
            if still_held(acked, me, intact) and not (counted | itself) & acked
        ]
        assert unseen, (counted, itself)


def test_a_member_owing_a_catch_up_counts_itself_for_nothing() -> None:
    three = ("a", "b", "c")
    assert fellows_needed(three, "a", intact=True) == 1
    assert fellows_needed(three, "a", intact=False) == 2
    assert fellows_needed(three, LEARNER, intact=True) == 2  # a learner is no member
    assert not holds_majority(three, "a", intact=False, rounds_with={"b"})
    assert holds_majority(three, "a", intact=False, rounds_with={"b", "c"})
    assert holds_majority(three, "a", intact=True, rounds_with={"b"})


def test_only_configured_fellows_count_and_an_unknown_set_holds_nothing() -> None:
    three = ("a", "b", "c")
    assert not holds_majority(three, "a", intact=True, rounds_with={"a", LEARNER})
    assert not holds_majority((), "a", intact=True, rounds_with={"b", "c"})
    assert holds_majority(("a",), "a", intact=True, rounds_with=())  # a region of one


def test_a_lost_disk_in_a_set_of_one_or_two_needs_every_other_member() -> None:
    """What only the lost disk held is gone; the rest is on the others, all of them."""
    assert fellows_needed(("a",), "a", intact=False) == 0
    assert holds_majority(("a",), "a", intact=False, rounds_with=())
    assert fellows_needed(("a", "b"), "a", intact=False) == 1
    assert not holds_majority(("a", "b"), "a", intact=False, rounds_with=())
    assert holds_majority(("a", "b"), "a", intact=False, rounds_with={"b"})


def test_acknowledgements_count_configured_holders_only() -> None:
    three = ("a", "b", "c")
    assert not acknowledged(three, {"a"})
    assert not acknowledged(three, {"a", LEARNER})  # a learner's copy is no vote
    assert acknowledged(three, {"a", "c"})
    assert acknowledged(("a", "b", "c", "d"), {"a", "b", "c"})
    assert not acknowledged(("a", "b", "c", "d"), {"a", "b"})
    assert not acknowledged((), {"a"})

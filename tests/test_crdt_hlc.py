"""The hybrid logical clock (SPEC §3), driven by an injected wall clock.

A ``FakeWall`` stands in for ``time``: tests set it, step it back, or freeze it,
and the clock must still hand out strictly increasing timestamps.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fencemark.node.crdt import ClockSkew, HybridClock
from fencemark.node.crdt.hlc import (
    DEFAULT_MAX_CLOCK_OFFSET_MS,
    LOGICAL_BITS,
    MAX_HLC,
    PHYSICAL_BITS,
    ZERO_STAMP,
    Stamp,
    pack,
    physical_ms,
    wall_clock_ms,
)

NOW_MS = 1_767_225_600_000  # 2026-01-01T00:00:00Z


class FakeWall:
    """A wall clock the test moves by hand."""

    def __init__(self, ms: int = NOW_MS) -> None:
        self.ms = ms

    def __call__(self) -> int:
        return self.ms


def clock_at(
    ms: int = NOW_MS, max_offset_ms: int = DEFAULT_MAX_CLOCK_OFFSET_MS
) -> tuple[HybridClock, FakeWall]:
    wall = FakeWall(ms)
    return HybridClock(wall_ms=wall, max_offset_ms=max_offset_ms), wall


# -- packing -----------------------------------------------------------------------


def test_hlc_is_48_bits_of_milliseconds_then_16_bits_of_counter() -> None:
    assert (PHYSICAL_BITS, LOGICAL_BITS) == (48, 16)
    assert MAX_HLC == 2**64 - 1
    assert pack(1) == 0x1_0000
    assert pack(1, 2) == 0x1_0002
    assert pack(NOW_MS, 7) == NOW_MS * 65_536 + 7
    assert physical_ms(pack(NOW_MS, 0xFFFF)) == NOW_MS
    assert pack(2**48 - 1, 0xFFFF) == MAX_HLC
    # A counter overflow carries into the milliseconds: ahead, never backwards.
    assert pack(NOW_MS, 0x1_0000) == pack(NOW_MS + 1, 0)


@given(st.integers(0, 2**48 - 1), st.integers(0, 0xFFFF), st.integers(0, 2**48 - 1))
def test_pack_round_trips_and_orders_by_milliseconds_first(
    ms: int, logical: int, other: int
) -> None:
    hlc = pack(ms, logical)
    assert physical_ms(hlc) == ms
    assert hlc & 0xFFFF == logical
    assert 0 <= hlc <= MAX_HLC
    if other != ms:
        assert (pack(other, 0xFFFF) < hlc) == (other < ms)
        assert (pack(other, 0) < hlc) == (other < ms)


def test_the_zero_stamp_is_the_least_stamp_and_all_zeros() -> None:
    """``ZERO_STAMP`` stamps a register never written (``lww.FALSE``: a record's
    initial ``deleted=False``). It must lose to every write, even one admitted under
    epoch 0 with the smallest HLC, or a first delete would not win over "never
    deleted"; and every node encodes it alike, as zeros (codec: uint64 varints)."""
    assert Stamp(0, 0, "") == ZERO_STAMP
    assert Stamp(0, 1, "") > ZERO_STAMP
    assert Stamp(0, 0, "a") > ZERO_STAMP


def test_clock_exposes_the_wall_clock_it_follows() -> None:
    clock, wall = clock_at()
    assert clock.wall_ms() == NOW_MS
    wall.ms -= 3
    assert clock.wall_ms() == NOW_MS - 3, "the raw wall clock, not the HLC"
    assert clock.last == 0, "reading the wall clock is not an event"


def test_default_clock_reads_the_real_wall_clock() -> None:
    before = wall_clock_ms()
    stamp = HybridClock().now()
    after = wall_clock_ms()
    assert before <= physical_ms(stamp) <= after
    assert HybridClock().max_offset_ms == DEFAULT_MAX_CLOCK_OFFSET_MS == 500


def test_the_physical_part_is_milliseconds_since_the_unix_epoch() -> None:
    """Regression (issue 15): the test above compares the clock with itself, so a wall
    clock off by half an hour (nanoseconds divided by 999_999) passed. The max-offset
    guard (500 ms) compares this node's wall clock with the physical part of a peer's
    stamps, which only works if every node reads Unix-epoch milliseconds: checked
    against ``time.time()``, within a second."""
    before_ms = time.time() * 1000
    physical = physical_ms(HybridClock().now())
    wall = wall_clock_ms()
    after_ms = time.time() * 1000
    assert before_ms - 1000 <= physical <= after_ms + 1000
    assert before_ms - 1000 <= wall <= after_ms + 1000


# -- now() -------------------------------------------------------------------------


def test_now_follows_the_wall_clock_when_it_moves_forward() -> None:
    clock, wall = clock_at()
    assert clock.now() == pack(NOW_MS)
    wall.ms += 10
    assert clock.now() == pack(NOW_MS + 10)
    assert clock.last == pack(NOW_MS + 10)


def test_now_counts_up_while_the_wall_clock_stands_still() -> None:
    clock, _ = clock_at()
    stamps = [clock.now() for _ in range(5)]
    assert stamps == [pack(NOW_MS, i) for i in range(5)]


def test_now_keeps_increasing_when_the_wall_clock_goes_backwards() -> None:
    clock, wall = clock_at()
    first = clock.now()
    wall.ms -= 5_000
    second = clock.now()
    assert second == first + 1
    assert physical_ms(second) == NOW_MS, "the clock holds its ground rather than follow"
    wall.ms = NOW_MS + 1
    assert clock.now() == pack(NOW_MS + 1), "and rejoins the wall clock once it passes"


def test_now_carries_a_full_counter_into_the_milliseconds() -> None:
    clock = HybridClock(wall_ms=FakeWall(NOW_MS), last=pack(NOW_MS, 0xFFFF))
    assert clock.now() == pack(NOW_MS + 1, 0)
    assert clock.now() > pack(NOW_MS, 0xFFFF)


@given(st.lists(st.integers(-1_000, 1_000), max_size=50))
def test_now_strictly_increases_whatever_the_wall_clock_does(moves: list[int]) -> None:
    clock, wall = clock_at()
    previous = clock.now()
    for move in moves:
        wall.ms += move
        stamp = clock.now()
        assert stamp > previous
        assert physical_ms(stamp) >= wall.ms, "never behind the wall clock"
        assert clock.last == stamp
        previous = stamp


def test_clock_resumes_above_a_restored_last_stamp() -> None:
    """A node restarting with its last persisted stamp never reissues a stamp."""
    persisted = pack(NOW_MS + 60_000, 3)
    clock = HybridClock(wall_ms=FakeWall(NOW_MS), last=persisted)
    assert clock.last == persisted
    assert clock.now() == persisted + 1


# -- observe() and check() ------------------------------------------------------------


def test_observe_makes_the_next_local_stamp_greater_than_the_remote_one() -> None:
    clock, _ = clock_at()
    clock.now()
    remote = pack(NOW_MS + 300, 42)  # another node's clock, 300 ms ahead
    clock.observe(remote)
    assert clock.last == remote
    assert clock.now() == remote + 1


def test_observe_of_an_older_stamp_does_not_move_the_clock_back() -> None:
    clock, _ = clock_at()
    mine = clock.now()
    clock.observe(pack(NOW_MS - 10_000))
    assert clock.last == mine
    assert clock.now() == mine + 1


@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("tick"), st.integers(-50, 50)),
            st.tuples(st.just("observe"), st.integers(-10_000, DEFAULT_MAX_CLOCK_OFFSET_MS)),
        ),
        max_size=40,
    )
)
def test_every_stamp_exceeds_everything_issued_or_observed_before(
    events: list[tuple[str, int]],
) -> None:
    clock, wall = clock_at()
    highest = 0
    for kind, amount in events:
        if kind == "tick":
            wall.ms += amount
        else:
            remote = pack(wall.ms + amount, amount % 0x1_0000)
            clock.observe(remote)
            highest = max(highest, remote)
        stamp = clock.now()
        assert stamp > highest
        highest = stamp


def test_a_stamp_exactly_max_offset_ahead_is_accepted() -> None:
    clock, _ = clock_at(max_offset_ms=500)
    at_limit = pack(NOW_MS + 500, 0xFFFF)  # any counter within that millisecond
    clock.check(at_limit)
    clock.observe(at_limit)
    assert clock.now() > at_limit


def test_a_stamp_more_than_max_offset_ahead_is_refused_as_clock_skew() -> None:
    clock, _ = clock_at(max_offset_ms=500)
    mine = clock.now()
    too_far = pack(NOW_MS + 501)
    with pytest.raises(ClockSkew) as refused:
        clock.check(too_far)
    assert (refused.value.remote_ms, refused.value.local_ms) == (NOW_MS + 501, NOW_MS)
    assert refused.value.max_offset_ms == 500
    # The sentence an operator acts on: how far ahead, exactly ("3534451200501 ms
    # ahead" also contains "501 ms ahead").
    assert str(refused.value).startswith("remote clock is 501 ms ahead of this node's")
    assert "500 ms" in str(refused.value)

    with pytest.raises(ClockSkew):
        clock.observe(too_far)
    assert clock.last == mine, "a refused stamp must not move the clock"
    assert clock.now() == mine + 1


def test_skew_is_measured_against_the_wall_clock_not_the_last_stamp() -> None:
    """A clock pushed ahead by earlier observations still judges skew by real time."""
    clock, wall = clock_at(max_offset_ms=500)
    clock.observe(pack(NOW_MS + 500))
    with pytest.raises(ClockSkew):
        clock.observe(pack(NOW_MS + 900))
    wall.ms += 400
    clock.observe(pack(NOW_MS + 900))
    assert clock.now() == pack(NOW_MS + 900) + 1


@pytest.mark.parametrize("max_offset_ms", [0, 1, 250, 5_000])
def test_max_clock_offset_is_configurable(max_offset_ms: int) -> None:
    clock, _ = clock_at(max_offset_ms=max_offset_ms)
    clock.observe(pack(NOW_MS + max_offset_ms, 0xFFFF))
    with pytest.raises(ClockSkew):
        clock.observe(pack(NOW_MS + max_offset_ms + 1))


def test_stamps_behind_the_wall_clock_are_never_skew() -> None:
    clock, _ = clock_at(max_offset_ms=0)
    for remote in (0, pack(NOW_MS - 1), pack(NOW_MS, 0xFFFF)):
        clock.check(remote)

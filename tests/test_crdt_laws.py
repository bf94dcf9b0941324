"""The laws of the record CRDT (SPEC §3), checked on states built from real operations.

Every law is checked twice: with ``==`` on the Python values and on the canonical
bytes (``codec.encode``), because replicas compare digests of bytes, not objects.
States come from ``tests/strategies.py``: simulated nodes with their own clocks
writing, claiming and gossiping one key.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, Phase, example, find, given, settings
from hypothesis import strategies as st

from fencemark.node.crdt import (
    LWW,
    Birth,
    DecodeError,
    FenceState,
    Grant,
    Record,
    Stamp,
    codec,
    decode,
    digest,
    encode,
    lww,
)
from fencemark.node.crdt.codec import FORMAT, upgrade
from fencemark.node.crdt.fence import HISTORY
from fencemark.node.crdt.hlc import pack
from fencemark.node.rules.admission import token_problem
from fencemark.node.rules.errors import Reason
from tests.strategies import (
    EPOCH_MS,
    FIELD_NAMES,
    KEY,
    REGIONS,
    SIGNERS,
    TAGS,
    Act,
    Create,
    Gossip,
    GrantNext,
    History,
    Lapse,
    Operation,
    Release,
    Scenario,
    SimNode,
    Step,
    keyring,
    operations,
    records,
    replicas,
    scenarios,
    sim_nodes,
)

# The number of examples comes from the profile loaded in tests/conftest.py (50 by
# default, 100 in CI, HYPOTHESIS_PROFILE=thorough for 2000 when changing the core):
# generating a multi-replica history costs more than checking a law on it.
LAWS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])

# A record whose oldest kept token (the floor of the bounded history: HISTORY + 1
# grants) was released and lapsed. Compaction keeps every entry of that token — its
# grant, lease, release and lapse; a merge that dropped one (``t > floor`` in
# fence._compact) changes the record it merges with itself. Random histories reach
# this only now and then (the idempotence law caught that mutant in 3 of 6 runs with
# a fresh example database), so the laws take it as an explicit example.
FLOOR_ENDED = (
    History(
        skew=0,
        ops=(
            *((1, GrantNext("w", 1_000)) for _ in range(HISTORY + 1)),
            (1, Release(pick=1)),  # token 2: the floor
            (1, Lapse(pick=1)),
        ),
    )
    .node()
    .record
)


def assert_same_state(a: Record, b: Record) -> None:
    """Equal as values and as canonical bytes (what replicas actually compare)."""
    assert a == b
    assert encode(a) == encode(b)


# -- the join-semilattice laws --------------------------------------------------


@LAWS
@given(replicas(2))
def test_merge_is_commutative(states: tuple[Record, ...]) -> None:
    a, b = states
    assert_same_state(a.merge(b), b.merge(a))


@LAWS
@given(replicas(3))
def test_merge_is_associative(states: tuple[Record, ...]) -> None:
    a, b, c = states
    assert_same_state(a.merge(b).merge(c), a.merge(b.merge(c)))


@LAWS
@given(records())
@example(FLOOR_ENDED)
def test_merge_is_idempotent(a: Record) -> None:
    assert_same_state(a.merge(a), a)


@LAWS
@given(replicas(3))
def test_merge_is_idempotent_on_merged_states(states: tuple[Record, ...]) -> None:
    for a in states:
        assert_same_state(a.merge(a), a)
    joined = states[0].merge(states[1]).merge(states[2])
    assert_same_state(joined.merge(joined), joined)


@LAWS
@given(replicas(2))
def test_merge_is_monotone(states: tuple[Record, ...]) -> None:
    """a ⊔ b is above both a and b: merging either back in changes nothing."""
    a, b = states
    joined = a.merge(b)
    assert_same_state(joined.merge(a), joined)
    assert_same_state(a.merge(joined), joined)
    assert_same_state(joined.merge(b), joined)


@LAWS
@given(sim_nodes(), operations(home=True))
def test_merge_is_monotone_under_every_operation(node: SimNode, op: Operation) -> None:
    """Every update is an inflation: op(s) ⊔ s == op(s), so no merge can undo it."""
    before = node.record
    op.apply(node)
    after = node.record
    assert_same_state(after.merge(before), after)
    assert_same_state(before.merge(after), after)


# -- the fence ------------------------------------------------------------------


@LAWS
@given(scenarios(3, max_steps=40))
def test_fence_never_decreases(scenario: Scenario) -> None:
    """Across every operation and merge, at every replica, the claim state only grows."""
    first = scenario.nodes()
    seen = [node.record.fence for node in first]

    def observe(index: int, step: Step, nodes: Sequence[SimNode]) -> None:
        for i, node in enumerate(nodes):
            old, new = seen[i], node.record.fence
            assert new.fence >= old.fence, f"fence of node {i} went down at step {index}: {step}"
            assert new.floor() >= old.floor()
            # Only what falls below the (rising) floor of the bounded history is folded.
            kept = new.floor()
            assert {t for t in old.grants if t >= kept} <= new.grants.keys()
            assert {t for t in old.released if t >= kept} <= new.released
            for token, expiry in old.lease_expiry.items():
                if token >= kept:
                    assert new.expiry(token) >= expiry
            seen[i] = new

    scenario.run(observe)


def test_fence_is_the_largest_granted_token_and_zero_without_grants() -> None:
    fence = FenceState()
    assert fence.fence == 0
    assert fence.holder() is None
    assert not fence.is_live(EPOCH_MS)
    fence = fence.grant(1, Grant(pack(EPOCH_MS), "worker-a", "local"), EPOCH_MS + 60_000)
    fence = fence.grant(5, Grant(pack(EPOCH_MS + 1), "worker-b", "local"), EPOCH_MS + 60_000)
    assert fence.fence == 5
    assert fence.holder() == Grant(pack(EPOCH_MS + 1), "worker-b", "local")
    with pytest.raises(ValueError, match="not above the fence"):
        fence.grant(5, Grant(pack(EPOCH_MS + 2), "worker-c", "local"), EPOCH_MS)
    with pytest.raises(ValueError, match="not above the fence"):
        fence.grant(3, Grant(pack(EPOCH_MS + 2), "worker-c", "local"), EPOCH_MS)


def test_claim_is_live_only_for_an_unreleased_unexpired_fence() -> None:
    expiry = EPOCH_MS + 60_000
    fence = FenceState().grant(1, Grant(pack(EPOCH_MS), "worker-a", "local"), expiry)
    assert fence.is_live(EPOCH_MS)
    assert fence.is_live(expiry - 1)
    assert not fence.is_live(expiry)
    assert fence.extend(1, expiry + 1).is_live(expiry)
    assert fence.extend(1, expiry - 1) == fence, "a renewal never shortens a lease"
    assert not fence.release(1).is_live(EPOCH_MS)
    assert fence.release(1).release(1) == fence.release(1), "release is idempotent"
    # A newer grant supersedes: the old token being unreleased does not make it live.
    newer = fence.release(1).grant(2, Grant(pack(EPOCH_MS + 1), "worker-b", "local"), expiry)
    assert newer.is_live(EPOCH_MS)
    assert newer.holder() == Grant(pack(EPOCH_MS + 1), "worker-b", "local")


def test_a_token_has_ended_when_released_or_seen_to_lapse_and_only_then() -> None:
    """``ended`` is what a seal needs (docs/security.md, *Signed writes*): a release or a
    lapse alone ends a claim; a grant that is neither has not ended, nor has a token
    never granted."""
    fence = FenceState().grant(1, Grant(pack(EPOCH_MS), "worker-a", "local"), EPOCH_MS + 1)
    assert not fence.ended(1) and not fence.ended(2)
    assert fence.release(1).ended(1)
    assert fence.lapse(1).ended(1)
    with pytest.raises(ValueError, match="has not ended"):
        fence.sealed(b"\x01")


def test_a_token_without_a_lease_expires_at_zero() -> None:
    """``expiry`` of a token that never had a lease is 0 ("none"), never a time."""
    assert FenceState().expiry(1) == 0
    fence = FenceState().grant(2, Grant(pack(EPOCH_MS), "worker-a", "local"), EPOCH_MS + 9)
    assert (fence.expiry(1), fence.expiry(2)) == (0, EPOCH_MS + 9)


def test_a_seal_or_a_move_signature_is_replaced_only_by_a_larger_one() -> None:
    """Two nodes may sign one end (or move): the join keeps the larger signature, so
    storing one is an inflation — the same or a smaller one changes nothing."""
    ended = FenceState().grant(1, Grant(pack(EPOCH_MS), "w", "local"), EPOCH_MS + 9).release(1)
    sealed = ended.sealed(b"\x05")
    assert sealed.seals == {1: b"\x05"}
    assert sealed.sealed(b"\x05") == sealed == sealed.sealed(b"\x04")
    assert sealed.sealed(b"\x06").seals == {1: b"\x06"}
    moved = FenceState().move(3)
    signed = moved.move_signed(b"\x05")
    assert signed.moved_signature == b"\x05"
    assert signed.move_signed(b"\x05") == signed == signed.move_signed(b"\x04")
    assert signed.move_signed(b"\x06").moved_signature == b"\x06"


def test_a_seal_goes_when_a_newer_grant_becomes_the_fence() -> None:
    """Only the fence's end is sealed (``_compact``; decode refuses a seal of any other
    token): the seal of an ended claim is dropped by the next grant, even when nothing
    else is to be compacted."""
    ended = FenceState().grant(1, Grant(pack(EPOCH_MS), "w", "local"), EPOCH_MS + 9).release(1)
    sealed = ended.sealed(b"\x05")
    regranted = sealed.grant(2, Grant(pack(EPOCH_MS + 1), "w", "local"), EPOCH_MS + 9)
    assert regranted.seals == {}
    record = Record(KEY).with_fence(regranted)
    assert decode(encode(record)) == record


def test_a_lease_seal_holds_for_its_expiry_only_and_only_for_the_fence() -> None:
    """``lease_seals`` (docs/security.md, *Signed writes*): a seal is over one expiry of
    the fence token's lease; a renewal leaves the lease unsealed until the home seals
    it again; storing a seal is an inflation (the later expiry, then the larger
    signature); a newer grant drops the old token's seal."""
    grant = Grant(pack(EPOCH_MS), "w", "local")
    fence = FenceState().grant(1, grant, EPOCH_MS + 9)
    assert fence.lease_seal() == b""
    sealed = fence.lease_sealed(b"\x05")
    assert sealed.lease_seals == {1: (EPOCH_MS + 9, b"\x05")} and sealed.lease_seal() == b"\x05"
    assert sealed.lease_sealed(b"\x04") == sealed == sealed.lease_sealed(b"\x05")
    assert sealed.lease_sealed(b"\x06").lease_seal() == b"\x06"
    renewed = sealed.extend(1, EPOCH_MS + 20)
    assert renewed.lease_seal() == b""  # the seal is of the old expiry
    resealed = renewed.lease_sealed(b"\x01")  # a later expiry wins, whatever its signature
    assert resealed.lease_seals == {1: (EPOCH_MS + 20, b"\x01")} and resealed.lease_seal()
    with pytest.raises(ValueError, match="never granted"):
        FenceState().lease_sealed(b"\x01")
    regranted = sealed.grant(2, grant._replace(granted_hlc=pack(EPOCH_MS + 1)), EPOCH_MS + 9)
    assert regranted.lease_seals == {}
    # A lease seal below the fence, alone (no signature to strip beside it): dropped.
    below = FenceState(grants={1: grant, 2: grant}, lease_seals={1: (EPOCH_MS + 9, b"\x05")})
    assert below.merge(FenceState()).lease_seals == {}
    record = Record(KEY).with_fence(regranted)
    assert decode(encode(record)) == record


def test_moving_the_fence_to_where_it_already_is_keeps_the_moves_signature() -> None:
    """Only a move further on starts unsigned: the home's signature of this move stays."""
    signed = FenceState().move(3).move_signed(b"\x05")
    assert signed.move(3) == signed == signed.move(2)
    assert signed.move(4).moved_signature == b""


def test_a_claim_is_live_only_when_the_home_granted_it_and_its_lease_runs() -> None:
    """``claim_live``: a grant of another birth region (made while the births were
    apart) is no live claim once they met; nor is an expired or missing one."""
    now = EPOCH_MS
    record = Record(KEY).create("us", Stamp(0, pack(now), "us-n"))
    assert not record.claim_live(now)
    home_grant = record.fence.grant(1, Grant(pack(now), "w", "us"), now + 1000)
    assert record.with_fence(home_grant).claim_live(now)
    assert not record.with_fence(home_grant).claim_live(now + 1000)
    abroad = record.fence.grant(1, Grant(pack(now), "w", "eu"), now + 1000)
    assert not record.with_fence(abroad).claim_live(now)


def test_a_record_is_visible_when_created_and_not_deleted() -> None:
    never = Record(KEY)
    assert never.visible is False
    made = never.create("us", Stamp(0, pack(EPOCH_MS), "us-n"))
    assert made.visible is True
    gone = made.set_deleted(True, Stamp(0, pack(EPOCH_MS + 1), "us-n"))
    assert gone.visible is False
    tombstone_of_nothing = never.set_deleted(True, Stamp(0, pack(EPOCH_MS), "us-n"))
    assert tombstone_of_nothing.visible is False


def test_births_at_the_same_stamp_home_the_record_in_the_first_region_by_name() -> None:
    """Two regions can stamp their births alike (same HLC and node id string): the
    home is then the region first by name, whatever the births' signatures say."""
    stamp = Stamp(0, pack(EPOCH_MS), "n")
    record = Record(KEY, births={"us": Birth(stamp, b"\x01"), "eu": Birth(stamp, b"\xff")})
    assert record.home_region == "eu"
    flipped = Record(KEY, births={"us": Birth(stamp, b"\xff"), "eu": Birth(stamp, b"\x01")})
    assert flipped.home_region == "eu"


def test_signing_writes_signs_only_the_unsigned_registers_of_that_stamp() -> None:
    """``with_signed_writes``: registers of other stamps, and ones already signed,
    keep what they carry."""
    first, second = Stamp(1, pack(EPOCH_MS), "n"), Stamp(1, pack(EPOCH_MS + 1), "n")
    record = Record(KEY).set_fields({"a": "x"}, first).set_fields({"b": "y"}, second)
    record = record.set_queue({"status": "done"}, second)
    record = record.set_fields({"c": "z"}, second)
    record = replace_field(record, "c", b"\x09")  # already signed
    signed = record.with_signed_writes(second, lambda kind, name, reg: f"{kind}:{name}".encode())
    assert signed.fields["a"].signature == b""
    assert signed.fields["b"].signature == b"field:b"
    assert signed.fields["c"].signature == b"\x09"
    assert signed.queue["status"].signature == b"queue:status"


def replace_field(record: Record, name: str, signature: bytes) -> Record:
    fields = dict(record.fields)
    fields[name] = fields[name]._replace(signature=signature)
    return Record(record.key, record.births, fields, record.tags, record.deleted,
                  record.fence, record.queue)  # fmt: skip


def test_a_record_claimed_thousands_of_times_keeps_a_bounded_history() -> None:
    """Regression: every claim added a grant, an expiry and a release for good, so a
    busy item's state (and the cost of encoding it on every write) grew without
    bound. The fence keeps the latest HISTORY grants; older tokens stay refused."""
    record = Record(KEY).create("local", Stamp(0, pack(EPOCH_MS), "n"))
    sizes = []
    for token in range(1, 5001):
        grant = Grant(pack(EPOCH_MS + token), f"worker-{token % 7}", "local")
        fence = record.fence.grant(token, grant, EPOCH_MS + 60_000).release(token)
        record = record.with_fence(fence)
        sizes.append(len(encode(record)))
    fence = record.fence
    assert fence.fence == 5000
    assert sorted(fence.grants) == list(range(5001 - HISTORY, 5001))
    assert (
        fence.released == frozenset(fence.grants)
        and fence.lease_expiry.keys() == fence.grants.keys()
    )
    assert sizes[-1] == sizes[1000], "the encoding stopped growing once the history was full"
    assert decode(encode(record)) == record
    # Folded tokens: still below the fence, so still superseded; releasing or
    # renewing one changes nothing, and an old state merged in brings nothing back.
    assert token_problem(fence, 7, EPOCH_MS) == Reason.SUPERSEDED
    assert fence.release(7) == fence and fence.extend(7, EPOCH_MS + 90_000) == fence
    old = FenceState().grant(7, Grant(pack(EPOCH_MS + 7), "worker-0", "local"), EPOCH_MS + 90_000)
    assert fence.merge(old) == fence == old.merge(fence)


def test_history_is_16_grants_on_every_node() -> None:
    """fence.HISTORY is part of the CRDT, not a tuning knob: a node keeping 15 or 17
    grants compacts the same join to other bytes, so replicas of different versions
    would never agree on a digest and anti-entropy would resend the record forever.
    Changing it needs a format change (codec.FORMAT) that every node takes at once."""
    assert HISTORY == 16
    fence = FenceState()
    for token in range(1, 21):
        fence = fence.grant(token, Grant(pack(EPOCH_MS + token), "w", "local"), EPOCH_MS)
    assert sorted(fence.grants) == list(range(5, 21))
    assert fence.floor() == 5


def test_the_strategies_reach_folded_histories() -> None:
    """The whole-record laws above cover folding only if their states get there. The
    first example found answers that: shrinking it (25 s) would add nothing."""
    states = find(
        replicas(3),
        lambda states: len({s.fence.floor() for s in states}) > 1,
        settings=settings(phases=[Phase.generate], database=None, max_examples=10_000),
    )
    assert max(s.fence.floor() for s in states) > 0


def test_grants_that_disagree_still_merge_as_a_join() -> None:
    """Two regions granting the same token is forbidden (SPEC §4); if it ever happened,
    every replica would still converge on one answer: the larger Grant (hlc first)."""
    early = Grant(pack(EPOCH_MS), "worker-z", "us-east")
    late = Grant(pack(EPOCH_MS + 1), "worker-a", "local")
    tie = Grant(pack(EPOCH_MS + 1), "worker-b", "local")  # same hlc: owner decides
    a = FenceState().grant(1, early, EPOCH_MS + 90_000)
    b = FenceState().grant(1, late, EPOCH_MS + 10_000)
    c = FenceState().grant(1, tie, EPOCH_MS + 20_000).release(1)

    assert a.merge(b) == b.merge(a)
    assert a.merge(b).grants[1] == late
    assert a.merge(b).expiry(1) == EPOCH_MS + 90_000, "expiries still merge by maximum"
    assert a.merge(b).merge(c) == a.merge(b.merge(c)) == c.merge(a).merge(b)
    assert a.merge(b).merge(c).grants[1] == tie
    for state in (a, b, c, a.merge(b)):
        assert state.merge(state) == state

    records = [Record(KEY).with_fence(state) for state in (a, b, c)]
    assert_same_state(records[0].merge(records[1]), records[1].merge(records[0]))
    assert_same_state(
        records[0].merge(records[1]).merge(records[2]),
        records[0].merge(records[1].merge(records[2])),
    )


# -- stamps: the epoch is the major key ------------------------------------------

epochs = st.integers(0, 6)
hlcs = st.integers(0, pack(EPOCH_MS + 1_000, 0xFFFF))
nodes = st.sampled_from(REGIONS)


@LAWS
@given(epochs, epochs, hlcs, hlcs, nodes, nodes)
def test_stamp_order_is_epoch_then_hlc_then_node(
    e1: int, e2: int, h1: int, h2: int, n1: str, n2: str
) -> None:
    a, b = Stamp(e1, h1, n1), Stamp(e2, h2, n2)
    if e1 != e2:
        assert (a < b) == (e1 < e2), "a higher epoch wins whatever the hlc"
    elif h1 != h2:
        assert (a < b) == (h1 < h2)
    else:
        assert (a < b) == (n1 < n2)


@LAWS
@given(
    records(),
    st.integers(0, 3),
    st.integers(1, 3),
    hlcs,
    hlcs,
    nodes,
    nodes,
    st.sampled_from(FIELD_NAMES),
    st.sampled_from(TAGS),
)
def test_write_under_higher_epoch_wins_whatever_the_hlc(
    base: Record,
    above_fence: int,
    epoch_gap: int,
    old_hlc: int,
    new_hlc: int,
    old_node: str,
    new_node: str,
    name: str,
    tag: str,
) -> None:
    """A write admitted under a newer fence beats one admitted under an older fence,
    in fields, tags and the deleted flag, whichever replica merges first."""
    old_epoch = base.fence.fence + above_fence
    old = Stamp(old_epoch, old_hlc, old_node)
    new = Stamp(old_epoch + epoch_gap, new_hlc, new_node)
    stale = base.set_fields({name: "stale"}, old).add_tags([tag], old).set_deleted(True, old)
    fresh = base.set_fields({name: "fresh"}, new).remove_tags([tag], new).set_deleted(False, new)
    for merged in (stale.merge(fresh), fresh.merge(stale)):
        assert merged.fields[name] == LWW(new, "fresh")
        assert tag not in merged.tag_values()
        assert not merged.is_deleted
    assert_same_state(stale.merge(fresh), fresh)


def test_write_under_new_fence_beats_a_replica_with_a_fast_clock() -> None:
    """The walkthrough's race: a region whose clock runs 400 ms ahead writes unfenced just
    before the home grants a claim; the holder's fenced write still wins everywhere."""
    home = SimNode("local", home=True, wall_ms=EPOCH_MS, record=Record(KEY))
    home.record = home.record.create("local", home.stamp())
    fast = SimNode("us-east", home=False, wall_ms=EPOCH_MS + 400, record=home.record)

    fast.record = fast.record.set_fields({"body": "unfenced"}, fast.stamp())
    fence = home.record.fence
    grant = Grant(home.clock.now(), "worker-a", "local")
    home.record = home.record.with_fence(fence.grant(1, grant, EPOCH_MS + 60_000))
    home.record = home.record.set_fields({"body": "started"}, home.stamp())

    assert fast.record.fields["body"].stamp.hlc > home.record.fields["body"].stamp.hlc
    fast.receive(home.record)
    home.receive(fast.record)
    for node in (home, fast):
        assert node.record.field_values()["body"] == "started"
    assert_same_state(home.record, fast.record)


@LAWS
@given(scenarios(3))
def test_a_write_after_a_merge_beats_everything_merged(scenario: Scenario) -> None:
    """Receiving a state moves the clock past it, so the next local write wins (SPEC §3)."""
    nodes = scenario.run()
    for target in nodes:
        for source in nodes:
            target.receive(source.record)
        stamp = target.stamp()
        assert all(stamp > seen for seen in target.record.stamps())
        grants = target.record.fence.grants.values()
        assert all(stamp.hlc > grant.granted_hlc for grant in grants)
        written = target.record.set_fields(dict.fromkeys(FIELD_NAMES, "last"), stamp)
        assert written.field_values() == dict.fromkeys(FIELD_NAMES, "last")


@LAWS
@given(st.sampled_from(FIELD_NAMES), st.sampled_from(["", "a", "b"]), st.booleans())
def test_lww_merge_is_commutative_even_when_stamps_tie(name: str, value: str, flag: bool) -> None:
    """Real stamps are unique; merge must not depend on it (the value breaks the tie)."""
    stamp = Stamp(1, pack(EPOCH_MS), "local")
    a, b = LWW(stamp, name), LWW(stamp, value)
    assert lww.merge(a, b) == lww.merge(b, a) == max(a, b)
    x, y = LWW(stamp, flag), LWW(stamp, not flag)
    assert lww.merge(x, y) == lww.merge(y, x) == LWW(stamp, True)


# -- every update is a merge with a one-write delta ------------------------------------

stamps = st.builds(Stamp, epochs, hlcs, nodes)


@LAWS
@given(
    records(),
    stamps,
    st.sampled_from(FIELD_NAMES),
    st.sampled_from(["", "a", "b"]),
    st.sampled_from(TAGS),
    st.booleans(),
)
def test_every_write_is_a_merge_with_its_delta(
    base: Record, stamp: Stamp, name: str, value: str, tag: str, flag: bool
) -> None:
    """``op(s) == s ⊔ op(⊥)`` for any stamp, older ones included: a write that arrives
    late (or is replayed) loses to what is there exactly as a merge would decide."""
    empty = Record(KEY)
    assert_same_state(
        base.set_fields({name: value}, stamp), base.merge(empty.set_fields({name: value}, stamp))
    )
    assert_same_state(base.add_tags([tag], stamp), base.merge(empty.add_tags([tag], stamp)))
    assert_same_state(base.remove_tags([tag], stamp), base.merge(empty.remove_tags([tag], stamp)))
    assert_same_state(base.set_deleted(flag, stamp), base.merge(empty.set_deleted(flag, stamp)))


@LAWS
@given(records(), st.integers(1, 8), st.integers(1, EPOCH_MS * 2))
def test_every_claim_update_is_a_merge_with_its_delta(
    base: Record, token: int, expiry: int
) -> None:
    fence = base.fence
    if token in fence.grants:
        delta = FenceState(lease_expiry={token: expiry})
        assert fence.extend(token, expiry) == fence.merge(delta)
        assert fence.release(token) == fence.merge(FenceState(released=frozenset({token})))
        assert fence.lapse(token) == fence.merge(FenceState(lapsed=frozenset({token})))
    else:  # nothing to renew, release or lapse: an entry without a grant is an orphan
        assert fence.extend(token, expiry) == fence.release(token) == fence.lapse(token) == fence
    moved = fence.fence + token
    assert fence.move(moved) == fence.merge(FenceState(moved=moved))
    grant = Grant(pack(EPOCH_MS), "worker-a", "local")
    above = fence.fence + token
    assert fence.grant(above, grant, expiry) == fence.merge(
        FenceState({above: grant}, {above: expiry})
    )


@LAWS
@given(records())
def test_max_hlc_covers_every_stamp_and_every_grant(record: Record) -> None:
    """What a receiver's clock must move past (SPEC §3): stamps and grant times alike."""
    hlcs = [s.hlc for s in record.stamps()]
    hlcs += [grant.granted_hlc for grant in record.fence.grants.values()]
    assert record.max_hlc() == max(hlcs)
    late = Grant(record.max_hlc() + 1, "worker-a", "local")
    fence = record.fence.grant(record.fence.fence + 1, late, EPOCH_MS)
    assert record.with_fence(fence).max_hlc() == record.max_hlc() + 1


def test_grant_is_an_inflation_even_over_an_existing_lease_expiry() -> None:
    """Regression: ``FenceState.grant`` overwrote a lease expiry already known for the
    new token (from an ``extend`` or a merge) instead of keeping the later one, so
    ``grant(s) ⊔ s != grant(s)``; it now keeps the maximum."""
    before = FenceState().merge(FenceState(lease_expiry={1: EPOCH_MS + 90_000}))
    after = before.grant(1, Grant(pack(EPOCH_MS), "worker-a", "local"), EPOCH_MS + 60_000)
    assert after.merge(before) == after
    assert after.expiry(1) == EPOCH_MS + 90_000


def test_integers_in_a_state_are_uint64_on_both_sides_of_the_codec() -> None:
    """Regression: encode wrote any non-negative int while decode refused varints of
    more than 11 bytes, so decode(encode(r)) raised for values >= 2**77. Now both
    sides agree on uint64: encode refuses more, decode refuses more."""
    at_limit = Record(KEY).with_fence(FenceState(released=frozenset({2**64 - 1})))
    assert decode(encode(at_limit)) == at_limit
    # released: one token, 2**64 - 1 in ten bytes; then no lapsed token, no seal,
    # moved 0, no signature of it, no queue register, no sighting and no lease seal
    assert encode(at_limit).endswith(b"\x01" + b"\xff" * 9 + b"\x01" + b"\x00" * 7)
    for beyond in (2**64, 2**77):
        with pytest.raises(ValueError, match="uint64"):
            encode(Record(KEY).with_fence(FenceState(released=frozenset({beyond}))))
    for negative in (-1, -2, -(2**64)):
        with pytest.raises(ValueError, match="uint64"):
            encode(Record(KEY).set_fields({"title": "x"}, Stamp(negative, 0, "local")))


def test_a_grant_signs_its_identity_only_when_it_has_one() -> None:
    """codec.grant_message: a grant made before identities were recorded is signed
    without one (its old signature stays valid); a grant to an identity is signed over
    it, so the identity cannot be swapped under the signature."""
    bare = Grant(pack(EPOCH_MS), "worker-a", "local")
    bound = bare._replace(identity="client/alice")
    head = codec.GRANT_MESSAGE + b"\x01k\x07" + varint(bare.granted_hlc)
    head += b"\x08worker-a\x05local"
    assert codec.grant_message("k", 7, bare) == head
    assert codec.grant_message("k", 7, bound) == head + b"\x0cclient/alice"


@LAWS
@given(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1))
def test_decode_inverts_encode_for_every_64_bit_integer(epoch: int, value: int) -> None:
    stamp = Stamp(epoch, value, "local")
    grant = Grant(value, "worker-a", "local")
    record = (
        Record(KEY)
        .set_fields({"title": "x"}, stamp)
        .with_fence(FenceState({value: grant}, {value: epoch}, frozenset({epoch})))
    )
    assert decode(encode(record)) == record


# -- canonical bytes ----------------------------------------------------------------


@LAWS
@given(replicas(3))
def test_equal_states_encode_to_equal_bytes(states: tuple[Record, ...]) -> None:
    """However a state was reached (merge order, map insertion order), its bytes agree."""
    a, b, c = states
    orders = [a.merge(b).merge(c), c.merge(b).merge(a), b.merge(c.merge(a))]
    assert len({encode(state) for state in orders}) == 1
    assert len({digest(encode(state)) for state in orders}) == 1

    def reversed_maps(r: Record) -> Record:
        return Record(
            r.key,
            dict(reversed(list(r.births.items()))),
            dict(reversed(list(r.fields.items()))),
            dict(reversed(list(r.tags.items()))),
            r.deleted,
            FenceState(
                dict(reversed(list(r.fence.grants.items()))),
                dict(reversed(list(r.fence.lease_expiry.items()))),
                r.fence.released,
                r.fence.lapsed,
                r.fence.moved,
                dict(reversed(list(r.fence.seals.items()))),
                r.fence.moved_signature,
                dict(reversed(list(r.fence.lease_seals.items()))),
            ),
            dict(reversed(list(r.queue.items()))),
            dict(reversed(list(r.seen.items()))),
        )

    assert encode(reversed_maps(orders[0])) == encode(orders[0])


@LAWS
@given(replicas(2))
def test_different_states_encode_to_different_bytes(states: tuple[Record, ...]) -> None:
    a, b = states
    assert (a == b) == (encode(a) == encode(b))
    assert (a == b) == (digest(encode(a)) == digest(encode(b)))
    assert len(digest(encode(a))) == 16


@LAWS
@given(records())
def test_decode_inverts_encode(record: Record) -> None:
    data = encode(record)
    assert decode(data) == record
    assert encode(decode(data)) == data


@LAWS
@given(replicas(3))
def test_decode_inverts_encode_on_merged_states(states: tuple[Record, ...]) -> None:
    joined = states[0].merge(states[1]).merge(states[2])
    data = encode(joined)
    assert decode(data) == joined
    assert encode(decode(data)) == data


# A hand-written encoder that follows the layout in codec's docstring, so the
# rejection cases below differ from canonical input in exactly one respect.


def varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def text(s: str) -> bytes:
    raw = s.encode()
    return varint(len(raw)) + raw


def stamp(epoch: int = 0, hlc: int = 0, node: str = "") -> bytes:
    return varint(epoch) + varint(hlc) + text(node)


def section(*entries: bytes) -> bytes:
    return varint(len(entries)) + b"".join(entries)


S1 = stamp(1, pack(EPOCH_MS, 1), "local")


def field_entry(name: str, value: str = "v", signature: bytes | None = b"") -> bytes:
    """A field (or queue register) with its signature, or in format 3 (``None``: none)."""
    head = text(name) + S1 + text(value)
    return head if signature is None else head + varint(len(signature)) + signature


def tag_entry(name: str, present: int = 1, signature: bytes | None = b"") -> bytes:
    head = text(name) + S1 + bytes([present])
    return head if signature is None else head + varint(len(signature)) + signature


SIG = bytes(range(72))  # a signature's bytes: the codec does not look inside


def grant_entry(token: int, signature: bytes = b"", identity: str = "") -> bytes:
    head = varint(token) + varint(pack(EPOCH_MS)) + text("worker-a") + text("local")
    return head + text(identity) + varint(len(signature)) + signature


def legacy_grant_entry(token: int, signature: bytes | None = None) -> bytes:
    """A grant in format 1 (no signature: ``None``) or format 2 (no identity)."""
    head = varint(token) + varint(pack(EPOCH_MS)) + text("worker-a") + text("local")
    return head if signature is None else head + varint(len(signature)) + signature


def lease_entry(token: int) -> bytes:
    return varint(token) + varint(EPOCH_MS + 60_000)


def birth_entry(region: str, signature: bytes = b"") -> bytes:
    return text(region) + S1 + varint(len(signature)) + signature


def layout(
    *,
    fmt: bytes = b"\x06",
    key: bytes = text("k"),
    births: bytes = section(),
    fields: bytes = section(),
    tags: bytes = section(),
    deleted: bytes = stamp() + b"\x00\x00",
    grants: bytes = section(),
    leases: bytes = section(),
    released: bytes = section(),
    lapsed: bytes = section(),
    seals: bytes = section(),
    moved: bytes = varint(0),
    moved_signature: bytes = b"",
    queue: bytes = section(),
    seen: bytes = section(),
    lease_seals: bytes = section(),
) -> bytes:
    ended = released + lapsed + seals
    signed_move = varint(len(moved_signature)) + moved_signature
    content = fmt + key + births + fields + tags + deleted
    return content + grants + leases + ended + moved + signed_move + queue + seen + lease_seals


def legacy_layout(*, fmt: bytes, home: bytes, grants: bytes, leases: bytes) -> bytes:
    """A format-1 or format-2 state: one optional home, no lapsed tokens, no move."""
    rest = section() + section() + stamp() + b"\x00" + grants + leases + section()
    return fmt + text("k") + home + rest


FULL_QUEUE = section(field_entry("attempts", "2"), field_entry("status", "done", SIG))
FULL_SEEN = section(birth_entry("ap", SIG))
FULL_LEASES = section(varint(2) + varint(EPOCH_MS + 60_000) + varint(len(SIG)) + SIG)
FULL = layout(
    key=text(KEY),
    births=section(birth_entry("eu", SIG), birth_entry("local")),
    fields=section(field_entry("body", signature=SIG), field_entry("title")),
    tags=section(tag_entry("backlog"), tag_entry("done", 0, SIG)),
    deleted=S1 + b"\x01" + varint(len(SIG)) + SIG,
    grants=section(grant_entry(1), grant_entry(2, SIG, "client/alice")),
    leases=section(lease_entry(1), lease_entry(2)),
    released=section(varint(2)),
    lapsed=section(varint(1)),
    seals=section(varint(2) + varint(len(SIG)) + SIG),
    queue=FULL_QUEUE,
    seen=FULL_SEEN,
    lease_seals=FULL_LEASES,
)


def test_encoding_matches_documented_layout() -> None:
    """Pins format 6 byte for byte: a change here breaks every stored digest."""
    s1 = Stamp(1, pack(EPOCH_MS, 1), "local")
    grant = Grant(pack(EPOCH_MS), "worker-a", "local")
    signed = grant._replace(signature=SIG, identity="client/alice")
    record = Record(
        KEY,
        births={"local": Birth(s1), "eu": Birth(s1, SIG)},
        fields={"title": LWW(s1, "v"), "body": LWW(s1, "v", SIG)},
        tags={"done": LWW(s1, False, SIG), "backlog": LWW(s1, True)},
        deleted=LWW(s1, True, SIG),
        fence=FenceState(
            grants={2: signed, 1: grant},
            lease_expiry={2: EPOCH_MS + 60_000, 1: EPOCH_MS + 60_000},
            released=frozenset({2}),
            lapsed=frozenset({1}),
            seals={2: SIG},
            lease_seals={2: (EPOCH_MS + 60_000, SIG)},
        ),
        queue={"status": LWW(s1, "done", SIG), "attempts": LWW(s1, "2")},
        seen={"ap": Birth(s1, SIG)},
    )
    assert encode(record) == FULL
    assert decode(FULL) == record
    assert encode(Record("k")) == layout()
    assert decode(layout()) == Record("k")
    moved = Record("k").with_fence(FenceState(moved=7))
    assert encode(moved) == layout(moved=varint(7))
    signed_move = moved.with_fence(moved.fence.move_signed(SIG))
    assert encode(signed_move) == layout(moved=varint(7), moved_signature=SIG)
    assert decode(layout(moved=varint(7), moved_signature=SIG)) == signed_move


NON_CANONICAL = {
    "empty input": b"",
    "unknown format": layout(fmt=b"\x07"),
    "format 1 (before signatures)": layout(fmt=b"\x01"),
    "format 2 (before births)": layout(fmt=b"\x02"),
    "format 3 (before signed writes)": layout(fmt=b"\x03"),
    "format 4 (before the work queue)": layout(fmt=b"\x04")[:-1],
    "queue unsorted": layout(queue=section(field_entry("status"), field_entry("attempts"))),
    "duplicate queue register": layout(
        queue=section(field_entry("status", "open"), field_entry("status", "done"))
    ),
    "truncated write signature": layout(fields=section(field_entry("body", signature=SIG)[:-1])),
    "a seal of a token below the fence": layout(
        grants=section(grant_entry(1), grant_entry(2)),
        leases=section(lease_entry(1), lease_entry(2)),
        released=section(varint(1), varint(2)),
        seals=section(varint(1) + varint(len(SIG)) + SIG),
    ),
    "a signature of a move never made": layout(moved_signature=SIG),
    "seals unsorted": layout(seals=section(varint(2) + b"\x00", varint(1) + b"\x00")),
    "a signature below the fence": layout(
        grants=section(grant_entry(1, SIG), grant_entry(2, SIG)),
        leases=section(lease_entry(1), lease_entry(2)),
    ),
    "a signature on a grant the fence moved past": layout(
        grants=section(grant_entry(1, SIG)), moved=varint(2)
    ),
    "truncated signature": layout(grants=section(grant_entry(1, SIG)[:-1])),
    "births unsorted": layout(births=section(birth_entry("us"), birth_entry("eu"))),
    "duplicate birth": layout(births=section(birth_entry("eu"), birth_entry("eu"))),
    "fields unsorted": layout(fields=section(field_entry("title"), field_entry("body"))),
    "duplicate field": layout(fields=section(field_entry("body", "a"), field_entry("body", "b"))),
    "tags unsorted": layout(tags=section(tag_entry("done"), tag_entry("backlog"))),
    "duplicate tag": layout(tags=section(tag_entry("backlog", 0), tag_entry("backlog", 1))),
    "grants unsorted": layout(grants=section(grant_entry(2), grant_entry(1))),
    "duplicate grant": layout(grants=section(grant_entry(1), grant_entry(1))),
    "leases unsorted": layout(leases=section(lease_entry(2), lease_entry(1))),
    "duplicate lease": layout(leases=section(lease_entry(1), lease_entry(1))),
    "released unsorted": layout(released=section(varint(2), varint(1))),
    "duplicate released": layout(released=section(varint(1), varint(1))),
    "lapsed unsorted": layout(lapsed=section(varint(2), varint(1))),
    "non-minimal string length": layout(key=b"\x81\x00k"),
    "non-minimal zero count": layout(fields=b"\x80\x00"),
    "non-minimal epoch": layout(deleted=b"\x80\x00" + stamp()[1:] + b"\x00\x00"),
    "non-minimal token": layout(released=b"\x01\x81\x80\x00"),
    "non-minimal move": layout(moved=b"\x80\x00"),
    "varint too long": layout(fields=b"\xff" * 11 + b"\x01"),
    "varint of 2**64": layout(released=b"\x01" + b"\x80" * 9 + b"\x02"),
    "varint of 11 bytes": layout(released=b"\x01" + b"\x80" * 10 + b"\x01"),
    "trailing byte": layout() + b"\x00",
    "trailing bytes after full record": FULL + b"\x01\x02",
    "missing move": layout()[:-3],
    "missing move signature": layout()[:-2],
    "missing queue": layout()[:-1],
    "tag flag 2": layout(tags=section(tag_entry("backlog", 2))),
    "deleted flag 0xff": layout(deleted=stamp() + b"\xff\x00"),
    "truncated string": layout(key=b"\x05k"),
    "count beyond the data": layout(released=b"\x03\x01\x02"),
    "truncated in the middle of a varint": b"\x01\x81",
    "invalid UTF-8": layout(key=b"\x01\xff"),
    "overlong UTF-8": layout(key=b"\x02\xc0\x80"),
    "UTF-8 surrogate": layout(key=b"\x03\xed\xa0\x80"),
}


def test_format_1_and_2_states_are_upgraded_with_their_home_as_the_one_birth() -> None:
    """Storage re-encodes a file written before signed grants (format 1) or before
    births (format 2) (codec.upgrade); the wire and decode take format 3 only."""
    leases = section(lease_entry(1), lease_entry(2))
    home = b"\x01" + S1 + text("local")
    v1 = legacy_layout(fmt=b"\x01", home=home, leases=leases,
                       grants=section(legacy_grant_entry(1), legacy_grant_entry(2)))  # fmt: skip
    v2_grants = section(legacy_grant_entry(1, b""), legacy_grant_entry(2, SIG))
    v2 = legacy_layout(fmt=b"\x02", home=home, grants=v2_grants, leases=leases)
    unsigned = layout(births=section(birth_entry("local")),
                      grants=section(grant_entry(1), grant_entry(2)), leases=leases)  # fmt: skip
    signed = layout(births=section(birth_entry("local")),
                    grants=section(grant_entry(1), grant_entry(2, SIG)), leases=leases)  # fmt: skip
    assert upgrade(v1) == unsigned
    assert upgrade(v2) == signed
    assert upgrade(signed) == signed and upgrade(FULL) == FULL
    for old in (v1, v2):
        with pytest.raises(DecodeError):
            decode(old)
        with pytest.raises(DecodeError):
            upgrade(old[:-1])
    never = legacy_layout(fmt=b"\x02", home=b"\x00", grants=section(), leases=section())
    assert decode(upgrade(never)) == Record("k")


def test_format_3_states_are_upgraded_with_unsigned_writes() -> None:
    """Format 3 had no signatures on fields, tags or the deleted flag: storage
    re-encodes it with every register unsigned, and decode takes format 4 only."""
    births = section(birth_entry("local"))
    v3 = (
        b"\x03"
        + text("k")
        + births
        + section(field_entry("body", signature=None))
        + section(tag_entry("backlog", signature=None))
        + S1
        + b"\x01"
        + section() * 4
        + varint(0)
    )
    v4 = layout(
        births=births,
        fields=section(field_entry("body")),
        tags=section(tag_entry("backlog")),
        deleted=S1 + b"\x01\x00",
    )
    assert upgrade(v3) == v4
    with pytest.raises(DecodeError):
        decode(v3)
    with pytest.raises(DecodeError):
        upgrade(v3[:-1])
    upgraded = decode(v4)
    assert all(not reg.signature for _, _, reg in upgraded.registers())


def test_format_4_states_are_upgraded_with_no_queue_registers() -> None:
    """Format 4 ended at the move's signature: storage re-encodes it with an empty
    queue (every item ``open``, no attempts), and decode takes format 6 only."""
    v4 = b"\x04" + FULL[1 : -len(FULL_QUEUE) - len(FULL_SEEN) - len(FULL_LEASES)]
    v6 = b"\x06" + v4[1:] + section() * 3
    assert upgrade(v4) == v6
    with pytest.raises(DecodeError):
        decode(v4)
    upgraded = decode(v6)
    assert (upgraded.queue, upgraded.status, upgraded.attempts) == ({}, "open", 0)


def test_format_5_states_are_upgraded_with_no_sightings() -> None:
    """Format 5 ended at the queue registers: storage re-encodes it with no region
    having seen the record (``Record.seen``) and no lease sealed, and decode takes
    format 6 only."""
    v5 = b"\x05" + FULL[1 : -len(FULL_SEEN) - len(FULL_LEASES)]
    v6 = b"\x06" + v5[1:] + section() * 2
    assert upgrade(v5) == v6
    with pytest.raises(DecodeError):
        decode(v5)
    upgraded = decode(v6)
    assert upgraded.seen == {} and upgraded.creators == {"eu", "local"}


def test_layout_builder_is_canonical() -> None:
    """The rejection cases are rejected for their one defect, not the builder's."""
    for data in (layout(), FULL):
        assert encode(decode(data)) == data


@pytest.mark.parametrize("data", list(NON_CANONICAL.values()), ids=list(NON_CANONICAL))
def test_decode_rejects_non_canonical_input(data: bytes) -> None:
    with pytest.raises(DecodeError):
        decode(data)


# -- canonical integers ---------------------------------------------------------------
#
# Every integer of a state (counts, lengths, tokens, stamps) is one varint, so the
# varint is where "equal states have equal bytes" is decided. ``moved`` is the last
# field of the layout but its signature and the queue: a state whose only content is
# an unsigned move ends with its varint, an empty signature and no queue register.


def minimal_length(n: int) -> int:
    """Bytes of the shortest LEB128 form of ``n``: one per 7 bits, at least one."""
    return max(1, -(-n.bit_length() // 7))


def longer_form(n: int, extra: int) -> bytes:
    """``n`` in LEB128 with ``extra`` redundant zero groups: the same value, not minimal."""
    shortest = varint(n)
    return shortest[:-1] + bytes([shortest[-1] | 0x80]) + b"\x80" * (extra - 1) + b"\x00"


@LAWS
@given(st.integers(0, 2**64 - 1))
@example(0)
@example(127)  # the largest one-byte value
@example(128)  # the smallest two-byte value
@example(16383)  # the largest two-byte value
@example(16384)  # the smallest three-byte value
@example(2**63)
@example(2**64 - 1)
def test_an_integer_encodes_as_its_shortest_varint(n: int) -> None:
    """codec: 7 bits a byte, least significant first, the high bit set on every byte but
    the last, and no more bytes than the value needs."""
    encoded = encode(Record("k").with_fence(FenceState(moved=n)))
    assert encoded == layout(moved=varint(n))
    assert len(varint(n)) == minimal_length(n)
    assert decode(encoded).fence.moved == n


@LAWS
@given(st.integers(0, 2**49 - 1), st.integers(1, 3))
@example(0, 1)
@example(127, 1)
@example(128, 1)
@example(16383, 1)
@example(16384, 1)
def test_decode_refuses_an_integer_in_more_bytes_than_it_needs(n: int, extra: int) -> None:
    """A longer form of the same value would give one state two encodings (and two
    digests): decode takes the shortest form only. (Up to 2**49 - 1 and 3 extra bytes,
    the longer form still fits the 10 bytes of a uint64, so only minimality refuses it.)"""
    assert decode(layout(moved=varint(n))).fence.moved == n
    with pytest.raises(DecodeError, match="non-minimal"):
        decode(layout(moved=longer_form(n, extra)))


def test_the_encoding_is_format_6() -> None:
    """Every node must write and read the same format: a state's first byte says which,
    decode refuses any other, and storage upgrades files of formats 1 to 5 (codec
    docstring). A new format is a deliberate step with an upgrade path, never a drift."""
    assert FORMAT == 6
    assert encode(Record("k"))[0] == 6


@LAWS
@given(records())
@example(Record(KEY))
def test_decode_rejects_every_truncation(record: Record) -> None:
    data = encode(record)
    for end in range(len(data)):
        with pytest.raises(DecodeError):
            decode(data[:end])


def assert_rejected_or_canonical(data: bytes) -> None:
    """Whatever decode accepts is the canonical encoding of what it returns."""
    try:
        record = decode(data)
    except DecodeError:
        return
    assert encode(record) == data
    assert_same_state(record.merge(record), record)


mutations = st.lists(
    st.tuples(st.sampled_from(["set", "insert", "delete"]), st.integers(0), st.integers(0, 255)),
    min_size=1,
    max_size=3,
)


@LAWS
@given(records(max_ops=8), mutations)
def test_decode_rejects_mutated_bytes_or_reencodes_them_identically(
    record: Record, edits: list[tuple[str, int, int]]
) -> None:
    data = bytearray(encode(record))
    for kind, position, value in edits:
        at = position % (len(data) + 1)
        if kind == "insert":
            data.insert(at, value)
        elif at < len(data):
            if kind == "set":
                data[at] = value
            else:
                del data[at]
    assert_rejected_or_canonical(bytes(data))


@LAWS
@given(st.binary(max_size=200))
@example(FULL)
def test_decode_rejects_arbitrary_bytes_or_reencodes_them_identically(data: bytes) -> None:
    assert_rejected_or_canonical(data)


# -- signed grants ----------------------------------------------------------------


@LAWS
@given(replicas(3))
def test_only_the_fence_grant_carries_a_signature(states: tuple[Record, ...]) -> None:
    """A grant below the fence can never become the fence again: its signature is
    stripped, on every state and every join of states (fence.py)."""
    a, b, c = states
    for state in (a, b, c, a.merge(b), b.merge(c).merge(a)):
        fence = state.fence
        assert all(not g.signature for t, g in fence.grants.items() if t != fence.fence)


def test_a_signed_fence_superseded_by_a_signed_grant_loses_its_signature() -> None:
    """What the laws above exercise whenever the home grants twice with gossip between:
    the replica's signed fence meets the home's higher signed grant (with the second
    key, as after a re-issued certificate) and keeps only that signature."""
    scenario = Scenario(
        skews=(0, 3),
        ancestor=(Create(REGIONS[0]), GrantNext("worker-a", 60_000, 0)),
        steps=(Act(0, GrantNext("worker-b", 60_000, 1)), Gossip(0, 1)),
    )
    old = scenario.nodes()[1].record
    home, other = (node.record for node in scenario.run())
    assert old.fence.grants[1].signature[:8] == SIGNERS[0].key_id
    assert home.fence.grants[2].signature[:8] == SIGNERS[1].key_id
    assert_same_state(other, home)
    assert_same_state(old.merge(home), home.merge(old))
    assert home.fence.grants[1].signature == b""
    ring = keyring()
    assert ring.problem(KEY, 1, old.fence.grants[1]) is None
    assert ring.problem(KEY, 2, home.fence.grants[2]) is None


def test_signatures_of_one_grant_that_disagree_still_merge_as_a_join() -> None:
    """A home never signs one grant twice, but a peer could send another version
    (unsigned, a re-signed twin, another key): every replica still converges, on
    the larger Grant, and its signature goes when a higher grant arrives."""
    grant = Grant(pack(EPOCH_MS), "worker-a", "local")
    base = FenceState().grant(1, grant, EPOCH_MS + 60_000)
    versions = [base, base.signed(b"\x01" * 72), base.signed(b"\x02" * 72)]
    for x in versions:
        assert x.merge(x) == x
        for y in versions:
            assert x.merge(y) == y.merge(x)
            assert x.merge(y).holder() == max(x.holder(), y.holder())  # type: ignore[type-var]
            for z in versions:
                assert x.merge(y).merge(z) == x.merge(y.merge(z))
    later = base.grant(2, Grant(pack(EPOCH_MS + 1), "worker-b", "local"), EPOCH_MS + 60_000)
    later = later.signed(b"\x03" * 72)
    for x in versions:
        merged = x.merge(later)
        assert merged == later.merge(x)
        assert merged.grants[1].signature == b"" and merged.grants[2].signature == b"\x03" * 72
    with pytest.raises(ValueError):
        versions[2].signed(b"\x01" * 72)  # not an inflation: refused


def test_of_two_versions_of_one_birth_every_replica_keeps_the_same() -> None:
    """A region's birth signed (or signed twice, ECDSA being randomized) and unsigned:
    the join keeps the larger signature whatever the order, and an earlier birth of
    the same region wins over a later one."""
    stamp = Stamp(0, pack(EPOCH_MS), "n")
    base = Record(KEY).create("local", stamp)
    versions = [
        base,
        base.with_birth("local", Birth(stamp, b"\x01" * 72)),
        base.with_birth("local", Birth(stamp, b"\x02" * 72)),
    ]
    for a in versions:
        for b in versions:
            assert a.merge(b) == b.merge(a)
            assert a.merge(b).births["local"].signature == max(
                a.births["local"].signature, b.births["local"].signature
            )
    later = Record(KEY).create("local", Stamp(0, pack(EPOCH_MS + 5), "n2"))
    assert later.merge(versions[2]).births["local"] == versions[2].births["local"]

"""What a node refuses to merge (fencemark.node.rules.integrity), and that it refuses nothing real.

Two halves. Hypothesis runs realistic scenarios — replicas of a key, written and
gossiped the way nodes do it, with the home region the only one that creates and
grants — and checks that no state any replica ever held is refused by any other:
the rules cost no convergence. Then each forged state is refused with its reason,
first by the pure check, then by a real node receiving it from a peer over gRPC,
which merges nothing, counts it against that peer and keeps serving the truth.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fencemark.client import AsyncClient
from fencemark.node.crdt import Birth, Record, Stamp, codec
from fencemark.node.crdt.fence import HISTORY, Grant
from fencemark.node.crdt.hlc import pack
from fencemark.node.crdt.record import ATTEMPTS, DONE, OUTCOME, PARKED, STATUS
from fencemark.node.rules.admission import RECOVERY_GAP, token_ceiling
from fencemark.node.rules.integrity import Bounds, MergeRefused, check, voided_births
from fencemark.node.security.signing import Keyring
from fencemark.v1 import replication_pb2, replication_pb2_grpc
from tests.cluster import Cluster
from tests.strategies import (
    EPOCH_MS,
    KEY,
    OTHER_SIGNER,
    REGION_SIGNERS,
    REGIONS,
    SIGNERS,
    Act,
    Admitted,
    BackdatedBirth,
    BusyRun,
    Create,
    Extend,
    GrantNext,
    HomeQueue,
    Lapse,
    MoveFence,
    Operation,
    Release,
    Scenario,
    Sealed,
    Sees,
    SetQueue,
    Tombstone,
    WriteOp,
    keyring,
    scenarios,
)

HOME = REGIONS[0]
BOUNDS = Bounds(max_offset_ms=500)
NOW = EPOCH_MS + 10_000
KEYRING = keyring()  # the test CA's certificates of the home (both keys)


def realistic(scenario: Scenario) -> Scenario:
    """As nodes do it: the record exists before anyone claims it, only its home
    region creates it (a node creates a record only in its own region), and writes
    are admitted (and signed) as a TLS node admits them (``Admitted``; the queue's
    ``HomeQueue``; sightings). No region back-dates a birth (``BackdatedBirth``)."""

    def homed(op: Operation) -> Operation:
        if isinstance(op, Create | Tombstone):
            op = dataclasses.replace(op, home_region=HOME)
        if isinstance(op, GrantNext | BusyRun) and op.signer is None:
            return dataclasses.replace(op, signer=0)  # a TLS home signs every grant
        if isinstance(op, Release | Lapse | MoveFence | Extend):
            return Sealed(op, 0)  # a TLS home seals an end and a lease, signs a move
        if isinstance(op, Admitted):
            return homed(op.op)
        if isinstance(op, SetQueue):
            return HomeQueue(op.values, 0)  # only a TLS home writes the queue, signed
        if isinstance(op, Sees):
            return Sees(signed=True)  # a TLS node signs its sightings
        if isinstance(op, WriteOp):
            return Admitted(op, 0)
        return op

    steps = tuple(
        dataclasses.replace(s, op=homed(s.op)) if isinstance(s, Act) else s
        for s in scenario.steps
        if not (isinstance(s, Act) and isinstance(s.op, BackdatedBirth))  # hostile
    )
    ancestor = (Create(HOME), *(homed(op) for op in scenario.ancestor))
    return dataclasses.replace(scenario, steps=steps, ancestor=ancestor)


@given(scenarios(3, max_steps=25).map(realistic))
def test_no_state_a_replica_really_held_is_refused_by_another(scenario: Scenario) -> None:
    seen: list[Record] = []
    scenario.run(lambda _, __, nodes: seen.extend(node.record for node in nodes))
    for local in seen[-6:]:
        for remote in seen[::3]:
            check(local, remote, now_ms=NOW, bounds=BOUNDS, verifier=KEYRING)


# -- forged states --------------------------------------------------------------------------


def stamp(ms: int = EPOCH_MS, epoch: int = 0, node: str = "n-home") -> Stamp:
    return Stamp(epoch, pack(ms), node)


def granted(tokens: tuple[int, ...] = (1,), region: str = HOME) -> Record:
    record = Record(KEY).create(HOME, stamp())
    fence = record.fence
    for token in tokens:
        fence = fence.grant(token, Grant(pack(EPOCH_MS + token), "worker", region), NOW + 60_000)
    return record.with_fence(fence)


def made_now(token: int) -> Record:
    """``granted()`` with ``token`` granted too, at EPOCH_MS (so its time's ceiling,
    ``token_ceiling``, is that of EPOCH_MS whatever the token)."""
    record = granted()
    grant = Grant(pack(EPOCH_MS), "worker", HOME)
    return record.with_fence(record.fence.grant(token, grant, NOW + 60_000))


def refused(local: Record, remote: Record) -> str:
    with pytest.raises(MergeRefused) as caught:
        check(local, remote, now_ms=NOW, bounds=BOUNDS)
    return caught.value.reason


def test_a_write_stamped_with_an_epoch_above_its_states_fence_is_refused() -> None:
    forged = granted().set_fields({"body": "mine forever"}, stamp(epoch=1 << 40))
    assert refused(granted(), forged) == "epoch_beyond_fence"


def test_two_births_merge_to_the_earliest_whatever_either_side_granted() -> None:
    """Regression (issue 13, hole 2): two regions created one id while cut off, and
    both granted; the states were refused ``home_changed`` forever, re-fetched about
    40 times a second, and both homes kept admitting fenced writes. Two births are
    a state every replica must merge alike: the earliest is the home."""
    elsewhere = Record(KEY).create("eu", stamp(EPOCH_MS - 60_000, node="n-eu"))
    fence = elsewhere.fence.grant(1, Grant(pack(EPOCH_MS - 1), "worker-eu", "eu"), NOW + 60_000)
    elsewhere = elsewhere.with_fence(fence)
    merged = check(granted(), elsewhere, now_ms=NOW, bounds=BOUNDS)
    assert merged == check(elsewhere, granted(), now_ms=NOW, bounds=BOUNDS)
    assert merged.home_region == "eu" and set(merged.births) == {"eu", HOME}
    assert {grant.region for grant in merged.fence.grants.values()} <= {"eu", HOME}


def test_two_concurrent_creations_without_claims_are_not_a_conflict() -> None:
    here = Record(KEY).create(HOME, stamp())
    there = Record(KEY).create("eu", stamp(EPOCH_MS + 100, node="n-eu"))
    assert check(here, there, now_ms=NOW, bounds=BOUNDS).home_region == HOME  # the earlier


def test_a_fence_moved_further_than_a_grant_may_jump_is_refused() -> None:
    held = granted()
    assert check(held, held.with_fence(held.fence.move(2)), now_ms=NOW, bounds=BOUNDS)
    far = held.with_fence(held.fence.move(2 + BOUNDS.max_token_jump))
    assert refused(held, far) == "token_jump"


def test_a_lapse_of_a_token_no_grant_names_is_refused() -> None:
    held = granted()
    orphan = dataclasses.replace(held.fence, lapsed=frozenset({5}))
    assert refused(held, held.with_fence(orphan)) == "orphan_token"


def test_a_grant_by_a_region_that_is_not_home_is_refused() -> None:
    assert refused(granted(), granted((1, 2), region="eu")) == "grant_outside_home"


def test_a_token_far_above_the_grant_below_it_is_refused() -> None:
    beyond = token_ceiling(pack(EPOCH_MS)) + 1 + BOUNDS.max_token_jump
    assert refused(granted(), made_now(beyond)) == "token_jump"
    # The jumps a home makes after a disk loss are fine, even from nothing: the gap,
    # and the ceiling of the moment (a second recovery's floor).
    assert check(granted(), made_now(token_ceiling(pack(EPOCH_MS))), now_ms=NOW, bounds=BOUNDS)
    after_loss = granted((1 + RECOVERY_GAP,))
    assert check(Record(KEY), after_loss, now_ms=NOW, bounds=BOUNDS).fence.fence == 1 + RECOVERY_GAP


def test_a_lease_longer_than_any_lease_is_refused() -> None:
    held = granted()
    forever = held.with_fence(held.fence.extend(1, NOW + 10 * BOUNDS.max_lease_ms))
    assert refused(held, forever) == "lease_too_long"


def test_expiries_and_releases_of_tokens_nobody_granted_are_refused() -> None:
    held = granted()
    phantom_release = held.with_fence(dataclasses.replace(held.fence, released=frozenset({7})))
    assert refused(held, phantom_release) == "orphan_token"
    phantom_lease = held.with_fence(
        dataclasses.replace(held.fence, lease_expiry={**held.fence.lease_expiry, 7: NOW})
    )
    assert refused(held, phantom_lease) == "orphan_token"


def signed(tokens: tuple[int, ...] = (1,), signer: int = 0) -> Record:
    """``granted(tokens)`` as a TLS home holds it: its fence grant and lease signed."""
    record = granted(tokens)
    fence = SIGNERS[signer].sign_fence(KEY, record.fence)
    return record.with_fence(SIGNERS[signer].seal(KEY, fence, end=True, move=False))


def refused_signed(local: Record, remote: Record) -> str:
    with pytest.raises(MergeRefused) as caught:
        check(local, remote, now_ms=NOW, bounds=BOUNDS, verifier=KEYRING)
    return caught.value.reason


def test_a_new_fence_grant_needs_its_homes_signature() -> None:
    held = signed()
    # Signed by the home, with either of its keys (a re-issued certificate): merged.
    for signer in (0, 1):
        merged = check(held, signed((1, 2), signer), now_ms=NOW, bounds=BOUNDS, verifier=KEYRING)
        assert merged.fence.fence == 2
    assert refused_signed(held, granted((1, 2))) == "unsigned_grant"
    tampered = signed((1, 2))
    grant = tampered.fence.grants[2]
    for forged in (
        grant._replace(owner="mallory"),  # the grant changed under its signature
        grant._replace(signature=grant.signature[:-1] + bytes([grant.signature[-1] ^ 1])),
        grant._replace(signature=grant.signature[:20]),
    ):
        state = tampered.with_fence(
            dataclasses.replace(tampered.fence, grants={**tampered.fence.grants, 2: forged})
        )
        assert refused_signed(held, state) == "bad_signature"
    # The same grant in another version than the one held: checked like a new one.
    other = held.fence.grants[1]._replace(signature=b"\xff" * 72)
    twin = held.with_fence(dataclasses.replace(held.fence, grants={1: other}))
    assert refused_signed(held, twin) == "unknown_signer"
    # A grant below a verified fence raises nothing: it needs no signature.
    below = check(signed((1, 3)), granted((1, 2, 3)), now_ms=NOW, bounds=BOUNDS, verifier=KEYRING)
    assert below.fence.fence == 3 and below.fence.grants[2].signature == b""


def written_under_claim(record: Record, ms: int, **fields: str) -> Record:
    """The holder's fenced write at the home: at the fence's epoch, signed by the home."""
    at = stamp(ms, epoch=record.fence.fence)
    return SIGNERS[0].sign_writes(record.set_fields(fields, at), at)


def test_a_write_at_the_epoch_of_a_live_claim_needs_the_homes_signature() -> None:
    """Regression (issue 14, hole 8): a tombstone or a field write stamped at the
    live claim's epoch with a later clock, pushed by a peer, was merged; ``Get``,
    ``ClaimStatus`` and the holder's next fenced write then answered not found.
    Only the home admits a write at the epoch of an unreleased grant (SPEC §4), so
    one that its home did not sign is forged."""
    held = written_under_claim(signed(), EPOCH_MS + 5, body="halfway")
    assert held.fields["body"].signature  # the holder's write, signed by the home
    later = stamp(EPOCH_MS + 50, epoch=1, node="n-home")  # the home's node id: known
    overwrite = held.set_fields({"body": "mallory's"}, later)
    tombstone = held.clear(later).set_deleted(True, later)
    retag = held.add_tags(["done"], later)
    for forged in (overwrite, tombstone, retag):
        assert refused_signed(held, forged) == "unsigned_write"
    # The home's real signature of the holder's write, on another value: tampered.
    replayed = overwrite.fields["body"]._replace(signature=held.fields["body"].signature)
    moved_sig = dataclasses.replace(overwrite, fields={"body": replayed})
    assert refused_signed(held, moved_sig) == "bad_signature"
    # What the home signed is merged wherever it goes, with either of its keys.
    for signer in (0, 1):
        at = stamp(EPOCH_MS + 60, epoch=1)
        honest = SIGNERS[signer].sign_writes(held.set_fields({"body": "done"}, at), at)
        merged = check(held, honest, now_ms=NOW, bounds=BOUNDS, verifier=KEYRING)
        assert merged.field_values()["body"] == "done"
    # Nothing is asked of what this node already holds, nor below the fence.
    assert check(held, held, now_ms=NOW, bounds=BOUNDS, verifier=KEYRING) == held
    older = held.set_fields({"kind": "bug"}, stamp(EPOCH_MS + 70, epoch=0, node="n-eu"))
    assert check(held, older, now_ms=NOW, bounds=BOUNDS, verifier=KEYRING).fields["kind"]


def test_once_the_claim_is_released_or_lapsed_any_node_writes_at_its_epoch() -> None:
    """After a release or a recorded lapse, every node admits unfenced writes, stamped
    with the epoch of the fence it knows: unsigned, and merged everywhere."""
    held = signed()
    for ended in (held.fence.release(1), held.fence.lapse(1)):
        after = held.with_fence(SIGNERS[0].seal(KEY, ended, end=True, move=False))
        elsewhere = after.set_fields({"body": "next"}, stamp(EPOCH_MS + 80, epoch=1, node="n-eu"))
        merged = check(held, elsewhere, now_ms=NOW, bounds=BOUNDS, verifier=KEYRING)
        assert merged.field_values()["body"] == "next"


def test_the_end_of_a_claim_and_a_move_of_the_fence_need_the_homes_signature() -> None:
    """A release, a recorded lapse or a move of the fence readmits unfenced writes on
    every node: unsigned, a peer could forge one, and then a write at the claim's
    epoch (hole 8) as if the claim had ended. Only the node that decided it signs
    it (``unsigned_end``, ``unsigned_move``)."""
    held = written_under_claim(signed(), EPOCH_MS + 5, body="halfway")
    for end in (held.fence.release(1), held.fence.lapse(1)):
        assert refused_signed(held, held.with_fence(end)) == "unsigned_end"
        sealed = SIGNERS[1].seal(KEY, end, end=True, move=False)
        assert check(held, held.with_fence(sealed), now_ms=NOW, bounds=BOUNDS, verifier=KEYRING)
        # A seal of another token's end, or of another record's, seals nothing.
        other = SIGNERS[0].seal("repo/lattice/mem/backlog/other", end, end=True, move=False)
        assert refused_signed(held, held.with_fence(other)) == "bad_signature"
    moved = held.fence.move(2)
    assert refused_signed(held, held.with_fence(moved)) == "unsigned_move"
    signed_move = SIGNERS[0].seal(KEY, moved, end=False, move=True)
    merged = check(held, held.with_fence(signed_move), now_ms=NOW, bounds=BOUNDS, verifier=KEYRING)
    assert merged.fence.fence == 2 and not merged.fence.unreleased()
    # Once held, an end or a move is not asked for again (a later exchange with a
    # node that has the same state unsealed: from before signed ends, say).
    ended = check(held, held.with_fence(SIGNERS[0].seal(KEY, held.fence.release(1), end=True,
                                                        move=False)), now_ms=NOW, bounds=BOUNDS,
                  verifier=KEYRING)  # fmt: skip
    assert check(ended, held.with_fence(held.fence.release(1)), now_ms=NOW, bounds=BOUNDS,
                 verifier=KEYRING) == ended  # fmt: skip


def test_another_birth_region_writes_under_a_claim_only_while_it_is_a_split_time_one() -> None:
    """Two regions created the record apart and each granted token 1; the join keeps
    one grant of it, so the other side's writes at epoch 1 are signed by a region
    that is neither the home nor the kept grant's: while the fence is such a split-
    time claim, every birth region decides it (the chaos tier under TLS, seed
    424242). Once the home has moved past it, the other birth region signs nothing
    under the home's later claims."""
    other = REGIONS[1]
    split = signed().with_birth(other, Birth(stamp(EPOCH_MS + 1, node="n-eu")))
    at = stamp(EPOCH_MS + 20, epoch=1, node="n-eu")
    theirs = OTHER_SIGNER.sign_writes(split.set_fields({"body": "eu's"}, at), at)
    merged = check(split, theirs, now_ms=NOW, bounds=BOUNDS, verifier=KEYRING)
    assert merged.field_values()["body"] == "eu's"
    end = OTHER_SIGNER.seal(KEY, split.fence.release(1), end=True, move=False)
    assert check(split, split.with_fence(end), now_ms=NOW, bounds=BOUNDS, verifier=KEYRING)
    # The home moved past the split (2) and granted again (3), signed: its claim now.
    moved = SIGNERS[0].seal(KEY, split.fence.move(2), end=False, move=True)
    grant = Grant(pack(EPOCH_MS + 30), "worker", HOME)
    later = split.with_fence(SIGNERS[0].sign_fence(KEY, moved.grant(3, grant, NOW + 60_000)))
    at = stamp(EPOCH_MS + 40, epoch=3, node="n-eu")
    intrusion = OTHER_SIGNER.sign_writes(later.set_fields({"body": "eu's"}, at), at)
    assert refused_signed(later, intrusion) == "signer_not_home"
    end = OTHER_SIGNER.seal(KEY, later.fence.release(3), end=True, move=False)
    assert refused_signed(later, later.with_fence(end)) == "signer_not_home"


def test_queue_state_is_written_only_by_a_region_that_created_the_record() -> None:
    """SPEC §8: only a birth region writes an item's status, outcome, attempts and
    not_before, with or without a claim, and signs them: a peer cannot mark an item
    done, park it or reopen it (``unsigned_write``; another region's signature is not
    a birth's). What this node already holds is not asked for again."""
    for fence in (signed().fence, signed().fence.release(1)):
        held = signed().with_fence(SIGNERS[0].seal(KEY, fence, end=True, move=False))
        at = stamp(EPOCH_MS + 20, epoch=1)
        done = held.set_queue({STATUS: DONE, OUTCOME: DONE, ATTEMPTS: "1"}, at)
        assert refused_signed(held, done) == "unsigned_write"
        by_home = SIGNERS[0].sign_writes(done, at)
        merged = check(held, by_home, now_ms=NOW, bounds=BOUNDS, verifier=KEYRING)
        assert merged.queue[STATUS].value == DONE
        assert check(merged, by_home, now_ms=NOW, bounds=BOUNDS, verifier=KEYRING) == merged
        at_eu = stamp(EPOCH_MS + 30, epoch=1, node="n-eu")
        parked = OTHER_SIGNER.sign_writes(merged.set_queue({STATUS: PARKED}, at_eu), at_eu)
        assert refused_signed(merged, parked) == "signer_not_home"
        # Held unsigned (written before queue registers were signed): not asked again.
        assert check(done, done, now_ms=NOW, bounds=BOUNDS, verifier=KEYRING) == done


# -- the bounds, at their boundaries -----------------------------------------------------------

JUMP = BOUNDS.max_token_jump
EARLY = 0  # a grant time whose ceiling (token_ceiling: 0) bounds nothing here


def refusal(local: Record, remote: Record, verifier: Keyring | None = None) -> MergeRefused:
    with pytest.raises(MergeRefused) as caught:
        check(local, remote, now_ms=NOW, bounds=BOUNDS, verifier=verifier)
    return caught.value


def with_grants(record: Record, tokens: tuple[int, ...], hlc: int = EARLY) -> Record:
    fence = record.fence
    for token in tokens:
        fence = fence.grant(token, Grant(hlc, "worker", HOME), NOW + 60_000)
    return record.with_fence(fence)


def test_the_protocol_bounds_are_the_documented_ones() -> None:
    """Every node must agree on them, and docs/security.md quotes them: a token jump
    of 2**21 (twice the recovery gap), a lease of at most an hour."""
    assert JUMP == 2 * RECOVERY_GAP == 1 << 21
    assert Bounds(max_offset_ms=0).max_lease_ms == 3_600_000


def test_a_token_may_jump_exactly_the_bound_above_the_grant_below_it() -> None:
    """``token_jump`` counts from the grant below the new one: ``JUMP`` above it is a
    recovery floor at most, one more was never granted (with a grant time whose
    ceiling bounds nothing)."""
    held = with_grants(Record(KEY).create(HOME, stamp()), (5,))
    assert check(held, with_grants(held, (5 + JUMP,)), now_ms=NOW, bounds=BOUNDS)
    too_far = refusal(held, with_grants(held, (6 + JUMP,)))
    assert too_far.reason == "token_jump"
    ceiling = token_ceiling(EARLY)
    assert too_far.detail == (
        f"token {6 + JUMP} is {JUMP + 1} above token 5, {6 + JUMP - ceiling} above its"
        f" time's (at most {JUMP})"
    )


def test_a_token_is_refused_only_when_it_jumps_from_both_the_grant_below_and_its_time() -> None:
    """A recovery floor is far above the grant below it but within its grant time's
    ceiling (``token_ceiling``: the time's millisecond times 2**10); a token beyond
    both is refused, and the refusal says by how much above each."""
    held = with_grants(Record(KEY).create(HOME, stamp()), (5,))
    hlc = pack(3)  # a grant time of 3 ms: a ceiling of 3072
    ceiling = token_ceiling(hlc)
    assert ceiling == 3 << 10
    within = ceiling + JUMP  # 3072 + JUMP - 5 above token 5, JUMP above its time's
    assert check(held, with_grants(held, (within,), hlc), now_ms=NOW, bounds=BOUNDS)
    beyond = refusal(held, with_grants(held, (within + 1,), hlc))
    assert (beyond.reason, beyond.detail) == (
        "token_jump",
        f"token {within + 1} is {within - 4} above token 5, {JUMP + 1} above its time's"
        f" (at most {JUMP})",
    )


def test_a_first_grant_is_measured_from_nothing() -> None:
    """A node with no grant of a record measures a new one from 0 (or, for a history
    folded to its last ``HISTORY`` grants, not the lowest of them: nothing to measure
    it from), and goes on to measure every grant above it."""
    bare = Record(KEY).create(HOME, stamp())
    assert check(bare, with_grants(bare, (JUMP,)), now_ms=NOW, bounds=BOUNDS)
    assert refusal(bare, with_grants(bare, (JUMP + 1,))).reason == "token_jump"
    base = 10 * JUMP  # a folded history starting high: its lowest grant is not measured
    folded = with_grants(bare, tuple(range(base, base + HISTORY)))
    assert check(bare, folded, now_ms=NOW, bounds=BOUNDS).fence.fence == base + HISTORY - 1
    forged = with_grants(bare, (*range(base, base + HISTORY - 1), base + 3 * JUMP))
    assert refusal(bare, forged).reason == "token_jump"


def test_a_fence_may_move_exactly_the_bound_above_the_grant_below_it() -> None:
    held = with_grants(Record(KEY).create(HOME, stamp()), (5,))
    assert check(held, held.with_fence(held.fence.move(5 + JUMP)), now_ms=NOW, bounds=BOUNDS)
    too_far = refusal(held, held.with_fence(held.fence.move(6 + JUMP)))
    assert (too_far.reason, too_far.detail) == (
        "token_jump",
        f"the fence moved to {6 + JUMP}, {JUMP + 1} above token 5 (at most {JUMP})",
    )


def test_a_move_to_the_fence_this_node_holds_moves_nothing_and_is_not_measured() -> None:
    """A move at or below the local fence changes nothing, so it is not measured, even
    where the fence is a grant far above the one below it (within its time's ceiling)."""
    hlc = pack(3)
    far = token_ceiling(hlc) + JUMP  # more than JUMP above token 5: allowed by its time
    held = with_grants(with_grants(Record(KEY).create(HOME, stamp()), (5,)), (far,), hlc)
    assert check(held, held.with_fence(held.fence.move(far)), now_ms=NOW, bounds=BOUNDS)


def test_a_move_is_measured_from_the_grant_below_it_not_from_one_at_it() -> None:
    """No node moves a fence onto a granted token (the home moves one past them all);
    a state that does is measured from the grant below the move, like any move."""
    hlc = pack(3)
    far = token_ceiling(hlc) + JUMP
    held = with_grants(Record(KEY).create(HOME, stamp()), (5,))
    onto = with_grants(held, (far,), hlc)
    assert check(held, onto, now_ms=NOW, bounds=BOUNDS)  # the grant alone is within bounds
    refused_move = refusal(held, onto.with_fence(onto.fence.move(far)))
    assert refused_move.reason == "token_jump"
    assert refused_move.detail.startswith(f"the fence moved to {far}, {far - 5} above token 5")


def test_a_lease_may_end_exactly_the_longest_lease_and_the_clock_offset_from_now() -> None:
    held = granted()
    latest = NOW + BOUNDS.max_lease_ms + BOUNDS.max_offset_ms
    assert check(held, held.with_fence(held.fence.extend(1, latest)), now_ms=NOW, bounds=BOUNDS)
    beyond = refusal(held, held.with_fence(held.fence.extend(1, latest + 1)))
    assert (beyond.reason, beyond.detail) == (
        "lease_too_long",
        f"token 1's lease ends {latest + 1 - NOW} ms from now",
    )
    # An expiry this node already holds is not refused again, whatever the clock says.
    far = held.with_fence(held.fence.extend(1, latest + 1))
    assert check(far, far, now_ms=NOW, bounds=BOUNDS) == far


def test_what_a_node_already_holds_is_not_checked_again() -> None:
    """A grant, a write under a claim, a birth that this node holds as they are are
    not verified again: an unsigned one from before signatures (or an ``--insecure``
    run) stays mergeable with a peer that sends the same, until its home signs it."""
    legacy = granted()  # the grant is unsigned
    at = stamp(EPOCH_MS + 5, epoch=1)
    legacy = legacy.set_fields({"body": "x"}, at).add_tags(["done"], at)
    legacy = legacy.clear(at).set_deleted(True, at)
    legacy = legacy.with_birth(REGIONS[1], Birth(stamp(EPOCH_MS + 1, node="n-eu")))
    assert check(legacy, legacy, now_ms=NOW, bounds=BOUNDS, verifier=KEYRING) == legacy


def test_every_birth_a_node_did_not_hold_carries_its_regions_signature() -> None:
    held = signed()
    other = REGIONS[1]
    birth = Birth(stamp(EPOCH_MS + 1, node="n-eu"))
    unsigned = held.with_birth(other, birth)
    assert refusal(held, unsigned, KEYRING).reason == "unsigned_birth"
    by_them = OTHER_SIGNER.sign_birth(unsigned, other)
    merged = check(held, by_them, now_ms=NOW, bounds=BOUNDS, verifier=KEYRING)
    assert set(merged.births) == {HOME, other} and merged.home_region == HOME
    # The home's own birth, back-dated and signed by the other region: not theirs.
    earlier = held.with_birth(HOME, Birth(stamp(EPOCH_MS - 1)))
    forged = OTHER_SIGNER.sign_birth(earlier, HOME)
    assert refusal(held, forged, KEYRING).reason == "signer_not_home"


def test_a_birth_by_a_revoked_key_is_refused_only_where_it_would_take_the_home() -> None:
    """SPEC §2: a revoked key moves no record away from its home. Its birth of a
    record this node holds under another region's earlier birth is refused; a birth
    that would not take the home, or a record's only birth, is merged as before (a
    birth never changes: one signed before the revocation must still reach everyone)."""
    from cryptography import x509

    from fencemark.node.security.revocation import Revocations
    from tests.strategies import _OTHER_CERT

    other_cert = x509.load_pem_x509_certificate(_OTHER_CERT[0])
    ring = keyring()
    ring.revocations = Revocations(
        frozenset({(other_cert.issuer.rfc4514_string(), other_cert.serial_number)})
    )
    held, other = signed(), REGIONS[1]

    def born(record: Record, ms: int) -> Record:
        return OTHER_SIGNER.sign_birth(record.with_birth(other, Birth(stamp(ms, node="n-eu"))),
                                       other)  # fmt: skip

    earlier = born(held, EPOCH_MS - 1)
    assert refusal(held, earlier, ring).reason == "revoked_signer"
    assert check(held, earlier, now_ms=NOW, bounds=BOUNDS, verifier=KEYRING).home_region == other
    later = check(held, born(held, EPOCH_MS + 1), now_ms=NOW, bounds=BOUNDS, verifier=ring)
    assert later.home_region == HOME and set(later.births) == {HOME, other}
    only = born(Record(held.key), EPOCH_MS - 1)
    assert (
        check(Record(held.key), only, now_ms=NOW, bounds=BOUNDS, verifier=ring).home_region == other
    )


def test_a_lease_lengthened_within_the_hour_needs_the_seal_of_the_claims_decider() -> None:
    """docs/security.md's last *not yet* of leases: an expiry within ``lease_too_long``
    was merged from anyone, so a peer could keep a lapsed claim alive (or lengthen a
    live one) for up to an hour. The expiry of an unreleased fence claim carries the
    seal of a node that decides it (the home, or the region that granted), over
    exactly that expiry: ``unsigned_lease`` otherwise."""
    held = signed()
    longer = dataclasses.replace(held.fence, lease_expiry={1: NOW + 3_000_000})
    assert refused_signed(held, held.with_fence(longer)) == "unsigned_lease"
    by_peer = OTHER_SIGNER.seal(KEY, longer, end=True, move=False)
    assert refused_signed(held, held.with_fence(by_peer)) == "signer_not_home"
    renewed = SIGNERS[1].seal(KEY, longer, end=True, move=False)  # the home's other key
    merged = check(held, held.with_fence(renewed), now_ms=NOW, bounds=BOUNDS, verifier=KEYRING)
    assert merged.fence.expiry(1) == NOW + 3_000_000 and merged.fence.lease_seal()
    # A seal of another expiry than the lease's own seals nothing (and would block
    # the home's next renewal): refused too.
    stale = dataclasses.replace(held.fence, lease_seals={1: (NOW + 9_000_000, b"\x01" * 72)})
    assert refused_signed(held, held.with_fence(stale)) == "unsigned_lease"
    # Once the claim has ended, its lease decides nothing: not checked.
    ended = SIGNERS[0].seal(KEY, held.fence.release(1), end=True, move=False)
    done = held.with_fence(ended)
    later = dataclasses.replace(ended, lease_expiry={1: NOW + 3_000_000})
    assert check(done, done.with_fence(later), now_ms=NOW, bounds=BOUNDS, verifier=KEYRING)


def test_a_birth_of_a_region_that_had_seen_the_record_is_void_in_either_order() -> None:
    """Issue 33, finding 7: a region that held a claimed record born elsewhere says
    so, signed (``Record.seen``); a birth of its own, back-dated and signed with its
    own live key, is then void — never the home, never a granter — whichever of the
    two a node learns first, and the merge reports it (``seen_before_birth``). A
    sighting is its region's word alone: unsigned or signed by another, refused."""
    held, other = signed(), REGIONS[1]
    sighting = Birth(stamp(EPOCH_MS + 2, node="n-eu"))
    assert refusal(held, held.see(other, sighting), KEYRING).reason == "unsigned_seen"
    by_home = SIGNERS[0].sign_seen(held.see(other, sighting), other)
    assert refusal(held, by_home, KEYRING).reason == "signer_not_home"
    seen = check(held, OTHER_SIGNER.sign_seen(held.see(other, sighting), other),
                 now_ms=NOW, bounds=BOUNDS, verifier=KEYRING)  # fmt: skip
    assert seen.seen.keys() == {other} and seen.creators == {HOME}

    back_dated = Birth(stamp(EPOCH_MS - 1, node="n-eu"))
    forged = OTHER_SIGNER.sign_birth(held.with_birth(other, back_dated), other)
    after = check(seen, forged, now_ms=NOW, bounds=BOUNDS, verifier=KEYRING)
    assert after.home_region == HOME and after.creators == {HOME}
    assert after.births[other] == forged.births[other]  # kept, as evidence
    assert [(v.key, v.reason) for v in voided_births(seen, after)] == [(KEY, "seen_before_birth")]
    assert voided_births(after, after) == []  # reported once, where it is news
    # The other order: the birth first (it takes the home there, as at any meet),
    # then the sighting — the same state, the same home, reported when it voids.
    taken = check(held, forged, now_ms=NOW, bounds=BOUNDS, verifier=KEYRING)
    assert taken.home_region == other
    back = check(taken, seen, now_ms=NOW, bounds=BOUNDS, verifier=KEYRING)
    assert back == after and len(voided_births(taken, back)) == 1

    # Nor can the void region grant, nor write the queue, as a birth region could.
    grant = Grant(pack(EPOCH_MS + 3), "thief", other)
    granting = after.with_fence(after.fence.grant(2, grant, NOW + 60_000))
    signed_grant = granting.with_fence(OTHER_SIGNER.sign_fence(KEY, granting.fence))
    assert refusal(after, signed_grant, KEYRING).reason == "grant_outside_home"
    at = stamp(EPOCH_MS + 4, node="n-eu")
    done = OTHER_SIGNER.sign_writes(after.set_queue({STATUS: DONE}, at), at)
    assert refusal(after, done, KEYRING).reason == "signer_not_home"


def test_each_birth_a_merge_voids_is_reported_once_whatever_else_is_void() -> None:
    """``voided_births`` reports every birth that is void in the join and was not in
    this node's state — past one that was void here already."""
    held = granted()
    first, second = sorted(REGIONS[1:3])  # both sort before or after HOME alike
    early = Birth(stamp(EPOCH_MS - 5, node="n-x"))
    here = held.see(first, Birth(stamp(node="n-1"))).with_birth(first, early)
    assert voided_births(held, here)[0].detail.startswith(f"region {first!r}")
    there = here.see(second, Birth(stamp(node="n-2"))).with_birth(second, early)
    reported = voided_births(here, here.merge(there))
    assert [v.detail.split()[1] for v in reported] == [repr(second)]
    assert voided_births(here, here) == []


def test_two_births_without_a_sighting_still_meet_at_the_earliest() -> None:
    """The split SPEC §2 allows stays allowed: neither region had seen the other's
    record, and a third region's sighting voids neither birth."""
    here, eu, ap = signed(), REGIONS[1], REGIONS[2]
    there = OTHER_SIGNER.sign_birth(
        here.with_birth(eu, Birth(stamp(EPOCH_MS - 9, node="n-eu"))), eu
    )
    merged = check(here, there, now_ms=NOW, bounds=BOUNDS, verifier=KEYRING)
    assert merged.home_region == eu and merged.creators == {HOME, eu}
    assert voided_births(here, merged) == []
    third = REGION_SIGNERS[ap].sign_seen(merged.see(ap, Birth(stamp(node="n-ap"))), ap)
    assert check(merged, third, now_ms=NOW, bounds=BOUNDS, verifier=KEYRING).home_region == eu


# -- a hostile peer, against a real node -----------------------------------------------------


async def push_as_eu(address: str, *states: Record) -> replication_pb2.PushResponse:
    origin = replication_pb2.Origin(region="eu", node_id="hostile", hlc=0)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = replication_pb2_grpc.ReplicationStub(channel)
        request = replication_pb2.PushRequest(
            origin=origin, states=[codec.encode(s) for s in states]
        )
        response: replication_pb2.PushResponse = await stub.Push(request, timeout=10)
        return response


@pytest.mark.slow
async def test_a_hostile_peer_cannot_raise_a_fence_steal_a_grant_or_revive_a_release(
    tmp_path: Path,
) -> None:
    async with Cluster(tmp_path, ["us", "eu"]) as cluster:
        us, _ = await cluster.start_all()
        async with AsyncClient(us.address) as client:
            for _ in range(200):  # bounded: us decides claims once it has seen eu
                if (await client.info()).claims_serving:
                    break
                await asyncio.sleep(0.05)
            await cluster.stop("eu")  # from now on the test speaks for eu
            made = await client.remember("hostile", "t", "held", title="x", tags=["homeRegion:us"])
            key = made.record.key
            holder = await client.claim(key, "alice", lease_seconds=60)
            other = await client.remember("hostile", "t", "done", title="y",
                                          tags=["homeRegion:us"])  # fmt: skip
            done = await client.claim(other.record.key, "bob", lease_seconds=60)
            await client.release_claim(other.record.key, done.fencing_token)
            held_state = (await us.storage.get(key)).record  # type: ignore[union-attr]
            done_state = (await us.storage.get(other.record.key)).record  # type: ignore[union-attr]

            now = us.replica.clock.wall_ms()
            hlc = us.replica.clock.now()
            fence = held_state.fence
            raise_fence = held_state.with_fence(
                fence.grant(token_ceiling(hlc) + 2 * RECOVERY_GAP + 5,
                            Grant(hlc, "mallory", "us"), now + 60_000)
            )  # fmt: skip
            steal = held_state.with_fence(
                fence.grant(fence.fence + 1, Grant(hlc, "mallory", "eu"), now + 60_000)
            )
            # (An earlier birth is no longer refused: two regions may create one id while
            # cut off, SPEC §2. docs/security.md says what stops a forged one.)
            # Without the release, and with the lease pushed out an hour: a merge is a
            # union, so the release stays; the longer lease is refused as too long.
            revived_fence = dataclasses.replace(
                done_state.fence, released=frozenset(),
                lease_expiry={done.fencing_token: now + 7_200_000},
            )  # fmt: skip
            revive = done_state.with_fence(revived_fence)

            answer = await push_as_eu(us.address, raise_fence, steal, revive)
            assert answer.merged == 0

            status = await client.claim_status(key)
            assert status.fence == holder.fencing_token
            assert status.claim is not None and status.claim.owner == "alice"
            assert (await client.get(key)).home_region == "us"
            released = await client.claim_status(other.record.key)
            assert released.claim is None  # still released
            renew = await client.renew_claim(key, holder.fencing_token)
            assert renew.renewed  # alice still holds it

            info = await client.info()
            eu = next(p for p in info.peers if p.region == "eu")
            assert eu.merges_refused == 3
            assert "lease_too_long" in eu.last_refusal


@given(st.integers(min_value=1, max_value=5))
def test_bounds_follow_the_configured_token_jump(jump: int) -> None:
    bounds = Bounds(max_offset_ms=500, max_token_jump=jump)
    ceiling = token_ceiling(pack(EPOCH_MS))
    check(granted(), made_now(ceiling + jump), now_ms=NOW, bounds=bounds)
    with pytest.raises(MergeRefused):
        check(granted(), made_now(ceiling + jump + 1), now_ms=NOW, bounds=bounds)


async def test_a_record_new_here_is_not_pushed_back_and_a_sighting_is(tmp_path: Path) -> None:
    """A merge pushes on only what the sender lacks: a record merged as it came is not
    echoed to every peer (a regression of sightings: the join's creators differ from
    an empty record's), while this node's own sighting of a claimed record is news
    for everyone."""
    from fencemark.node.core.replica import Replica
    from fencemark.node.crdt import HybridClock
    from fencemark.node.store.storage import DB_FILE, Storage

    storage = await Storage.open(tmp_path / DB_FILE)
    try:
        replica = Replica(storage, HybridClock(), "eu")
        pushed: list[str] = []
        back: list[tuple[str, str]] = []
        replica.on_local_write(pushed.append)
        replica.on_sender_lacks(lambda key, region: back.append((key, region)))
        plain = Record(KEY).create(HOME, stamp())
        assert await replica.merge(plain, sender=HOME)
        assert (pushed, back) == ([], [])
        claimed = granted()
        assert await replica.merge(claimed, sender=HOME)
        assert pushed == [KEY]  # eu saw the claim: its sighting goes to every peer
    finally:
        await storage.close()

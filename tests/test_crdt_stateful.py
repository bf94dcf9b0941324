"""Three replicas of one record, compared against a simple sequential model.

The state machine plays three regions' nodes (``SimNode``: a wall clock, an HLC
and a replica). Node 0 is the home region: the only one that grants, renews and
releases claims. Every node writes fields and tags, deletes and undeletes, and
any node may merge any other's state at any time (``a.merge(b)`` stored at a).

The home also runs the work queue's transitions (SPEC §8): each grant counts an
attempt, a claim ends done, failed, deferred or by a lapse (parking the item at
``MAX_ATTEMPTS``), and a reopen counts from zero.

The model is what a single sequential observer would say, without any lattice:
it logs every write ever made, with its stamp. After a full sync every replica
must hold exactly what the model predicts — each field is the write with the
largest stamp ever made to it, the fence is the largest token ever granted, the
released set is every token ever released — and all replicas must have the same
canonical bytes and digest.
"""

from __future__ import annotations

from collections import defaultdict

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from fencemark.node.crdt import LWW, Grant, Record, Stamp, digest, encode, lww, tagset
from fencemark.node.crdt.fence import HISTORY
from fencemark.node.crdt.record import (
    DEFERRED,
    DONE,
    FAILED,
    HOME_TAG_PREFIX,
    LAPSED,
    OPEN,
    PARKED,
)
from fencemark.node.rules import queue
from tests.strategies import (
    EPOCH_MS,
    FIELD_NAMES,
    FIELD_VALUES,
    KEY,
    OWNERS,
    REGIONS,
    SIGNERS,
    TAGS,
    SimNode,
    keyring,
)

REPLICAS = 3
HOME = 0
MAX_ATTEMPTS = 2  # low, so that parking is reached in a short run

replica = st.integers(0, REPLICAS - 1)
field_writes = st.dictionaries(
    st.sampled_from(FIELD_NAMES), st.sampled_from(FIELD_VALUES), min_size=1, max_size=3
)
tag_names = st.lists(st.sampled_from(TAGS), min_size=1, max_size=2, unique=True)
lease_ms = st.integers(1_000, 3_600_000)
token_pick = st.integers(0, 10)


class ReplicatedRecord(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.nodes = [
            SimNode(REGIONS[i], home=i == HOME, wall_ms=EPOCH_MS + 7 * i, record=Record(KEY))
            for i in range(REPLICAS)
        ]
        # The sequential model: every write ever made, by kind.
        self.creates: list[LWW[str]] = []
        self.field_log: defaultdict[str, list[LWW[str]]] = defaultdict(list)
        self.tag_log: defaultdict[str, list[LWW[bool]]] = defaultdict(list)
        self.deleted_log: list[LWW[bool]] = [lww.FALSE]
        self.grants: dict[int, Grant] = {}
        self.expiries: dict[int, int] = {}
        self.released: set[int] = set()
        # The work queue (SPEC §8): every queue write, and what the home counted.
        self.queue_log: defaultdict[str, list[LWW[str]]] = defaultdict(list)
        self.attempts = 0  # grants since the last reopen
        # What each replica's fence was after the previous step.
        self.fences = [0] * REPLICAS
        self.keyring = keyring()

    @property
    def home(self) -> SimNode:
        return self.nodes[HOME]

    # -- writes: any replica --------------------------------------------------------

    @rule(i=replica)
    def create(self, i: int) -> None:
        """``remember`` of a new key; two regions racing to create is resolved by
        the earliest stamp (an already-created record ignores it)."""
        node = self.nodes[i]
        stamp = node.stamp()
        if node.record.home is None:
            # A creation writes deleted=False too: no older delete can undo it.
            self.deleted_log.append(LWW(stamp, False))
        node.record = node.record.create(node.region, stamp)
        self.creates.append(LWW(stamp, node.region))
        assert node.record.home is not None

    @rule(i=replica, values=field_writes)
    def set_fields(self, i: int, values: dict[str, str]) -> None:
        node = self.nodes[i]
        stamp = node.stamp()
        node.record = node.record.set_fields(values, stamp)
        for name, value in values.items():
            self.field_log[name].append(LWW(stamp, value))
            assert node.record.fields[name] == LWW(stamp, value), "a node reads its own write"

    @rule(i=replica, names=tag_names, present=st.booleans())
    def write_tags(self, i: int, names: list[str], present: bool) -> None:
        node = self.nodes[i]
        stamp = node.stamp()
        if present:
            node.record = node.record.add_tags(names, stamp)
        else:
            node.record = node.record.remove_tags(names, stamp)
        for name in names:
            self.tag_log[name].append(LWW(stamp, present))
            assert (name in node.record.tag_values()) == present

    @rule(i=replica, deleted=st.booleans())
    def set_deleted(self, i: int, deleted: bool) -> None:
        node = self.nodes[i]
        stamp = node.stamp()
        node.record = node.record.set_deleted(deleted, stamp)
        self.deleted_log.append(LWW(stamp, deleted))
        assert node.record.is_deleted == deleted

    @rule(i=replica)
    def delete(self, i: int) -> None:
        """The node's ``delete``: the tombstone erases every field and tag, keeping the
        home (none for a key never seen) and the fence, all under one stamp."""
        node = self.nodes[i]
        stamp = node.stamp()
        before = node.record
        node.record = before.clear(stamp).set_deleted(True, stamp)
        for name in before.field_values():
            self.field_log[name].append(LWW(stamp, ""))
        for name in tagset.value(before.tags):
            self.tag_log[name].append(LWW(stamp, False))
        self.deleted_log.append(LWW(stamp, True))
        assert node.record.field_values() == {}
        home_tags = [HOME_TAG_PREFIX + node.record.home_region] if node.record.exists else []
        assert node.record.tag_values() == home_tags
        assert node.record.fence == before.fence, "a tombstone keeps its grants"

    # -- claims: the home region only -------------------------------------------------

    @rule(owner=st.sampled_from(OWNERS), lease=lease_ms, signer=st.sampled_from([0, 1, None]))
    def grant(self, owner: str, lease: int, signer: int | None) -> None:
        """Signed with one of the home's two keys (``SIGNERS``), or unsigned (--insecure)."""
        node = self.home
        fence = node.record.fence
        token = fence.fence + 1
        grant = Grant(node.clock.now(), owner, node.region)
        fence = fence.grant(token, grant, node.wall_ms + lease)
        if signer is not None:
            fence = SIGNERS[signer].sign_fence(node.record.key, fence)
            grant = fence.grants[token]
            assert self.keyring.problem(node.record.key, token, grant) is None
        node.record = node.record.with_fence(fence)
        stamp = node.stamp()  # at the new token's epoch
        node.record = queue.granted(node.record, stamp)
        self.log_queue(node.record, stamp)
        self.attempts += 1
        assert token not in self.grants, "a token is never granted twice"
        self.grants[token] = grant
        self.expiries[token] = node.wall_ms + lease
        assert node.record.fence.is_live(node.wall_ms)
        assert node.record.fence.holder() == grant

    @precondition(lambda self: self.home.record.fence.fence > 0)
    @rule(pick=token_pick, lease=lease_ms)
    def extend(self, pick: int, lease: int) -> None:
        node = self.home
        token = 1 + pick % node.record.fence.fence
        expiry = node.wall_ms + lease
        node.record = node.record.with_fence(node.record.fence.extend(token, expiry))
        self.expiries[token] = max(self.expiries.get(token, 0), expiry)
        assert node.record.fence.expiry(token) >= expiry or token < node.record.fence.floor()

    @precondition(lambda self: self.home.record.fence.fence > 0)
    @rule(pick=token_pick)
    def release(self, pick: int) -> None:
        node = self.home
        token = 1 + pick % node.record.fence.fence
        node.record = node.record.with_fence(node.record.fence.release(token))
        self.released.add(token)
        assert token in node.record.fence.released or token < node.record.fence.floor()

    @precondition(lambda self: self.home.record.fence.unreleased())
    @rule(ending=st.sampled_from([DONE, FAILED, DEFERRED, LAPSED]), delay=st.integers(0, 5000))
    def end_claim(self, ending: str, delay: int) -> None:
        """The home ends the fence's claim as SPEC §8 says: a release with an outcome,
        or a lapse; its queue writes at the token's epoch, then the release."""
        node = self.home
        token = node.record.fence.fence
        stamp = node.stamp()  # at the token's epoch
        before = node.record
        ended = queue.ended(before, ending, stamp, default_max_attempts=MAX_ATTEMPTS,
                            not_before_ms=node.wall_ms + delay)  # fmt: skip
        fence = ended.fence.lapse(token) if ending == LAPSED else ended.fence.release(token)
        node.record = ended.with_fence(fence)
        self.log_queue(node.record, stamp)
        if ending != LAPSED:  # a lapse is in ``lapsed``, which the model does not follow
            self.released.add(token)
        parks = ending in (FAILED, LAPSED) and self.attempts >= MAX_ATTEMPTS
        if ending == DONE:  # whatever it was (a parked item may be claimed by key)
            assert node.record.status == DONE
        else:
            assert (node.record.status == PARKED) == (parks or before.status == PARKED), ending

    @rule()
    def reopen(self) -> None:
        node = self.home
        stamp = node.stamp()
        node.record = queue.reopened(node.record, stamp)
        self.log_queue(node.record, stamp)
        self.attempts = 0
        assert (node.record.status, node.record.attempts) == (OPEN, 0)

    def log_queue(self, record: Record, stamp: Stamp) -> None:
        for name, register in record.queue.items():
            if register.stamp == stamp:
                self.queue_log[name].append(register)

    # -- time and gossip -----------------------------------------------------------

    @rule(i=replica, ms=st.integers(-5, 40))
    def tick(self, i: int, ms: int) -> None:
        """Wall clocks drift apart, stand still and sometimes step back."""
        self.nodes[i].wall_ms += ms

    @rule(into=replica, source=replica)
    def gossip(self, into: int, source: int) -> None:
        before = self.nodes[into].record
        self.nodes[into].receive(self.nodes[source].record)
        after = self.nodes[into].record
        assert after.merge(before) == after, "a merge never loses what the target had"
        assert after.merge(self.nodes[source].record) == after

    @rule()
    def full_sync_converges_to_the_model(self) -> None:
        self.full_sync()
        self.check_against_model()

    # -- invariants ------------------------------------------------------------------

    @invariant()
    def fence_never_decreases(self) -> None:
        for i, node in enumerate(self.nodes):
            fence = node.record.fence.fence
            assert fence >= self.fences[i], f"fence of {node.region} went {self.fences[i]}→{fence}"
            self.fences[i] = fence

    @invariant()
    def the_home_counts_every_grant_since_the_last_reopen(self) -> None:
        assert self.home.record.attempts == self.attempts

    @invariant()
    def writes_carry_a_fence_their_replica_has_seen(self) -> None:
        for node in self.nodes:
            assert all(s.epoch <= node.record.fence.fence for s in node.record.stamps())

    @invariant()
    def replicas_hold_only_writes_that_were_really_made(self) -> None:
        for node in self.nodes:
            record = node.record
            for name, register in record.fields.items():
                assert register in self.field_log[name]
            for name, flag in record.tags.items():
                assert flag in self.tag_log[name]
            assert record.deleted in self.deleted_log
            assert record.home is None or record.home in self.creates
            # As granted; below the fence, its signature stripped (fence.py).
            assert all(
                self.grants[t] == g or self.grants[t]._replace(signature=b"") == g
                for t, g in record.fence.grants.items()
            )
            assert record.fence.released <= self.released
            for name, register in record.queue.items():
                assert register in self.queue_log[name]
            assert all(e <= self.expiries[t] for t, e in record.fence.lease_expiry.items())

    # -- convergence -------------------------------------------------------------------

    def full_sync(self) -> None:
        """Pairwise merges until everyone has seen everyone: twice round the ring."""
        for _ in range(2):
            for i in range(REPLICAS):
                self.nodes[(i + 1) % REPLICAS].receive(self.nodes[i].record)

    def check_against_model(self) -> None:
        records = [node.record for node in self.nodes]
        encodings = {encode(record) for record in records}
        assert len(encodings) == 1, "replicas disagree after a full sync"
        assert len({digest(encode(record)) for record in records}) == 1
        record = records[0]
        assert all(other == record for other in records)

        # Each register holds the write with the largest stamp ever made to it.
        assert dict(record.fields) == {name: max(log) for name, log in self.field_log.items()}
        assert dict(record.tags) == {name: max(log) for name, log in self.tag_log.items()}
        assert record.deleted == max(self.deleted_log)
        assert dict(record.queue) == {name: max(log) for name, log in self.queue_log.items()}
        assert record.home == (min(self.creates) if self.creates else None)

        assert record.field_values() == {
            name: max(log).value for name, log in sorted(self.field_log.items()) if max(log).value
        }
        expected_tags = {name for name, log in self.tag_log.items() if max(log).value}
        if self.creates:
            expected_tags.add(HOME_TAG_PREFIX + min(self.creates).value)
        assert record.tag_values() == sorted(expected_tags)

        # The claim state is the union of everything the home region ever did,
        # folded to the entries of its HISTORY latest grants (fence.py).
        assert record.fence.fence == max(self.grants, default=0)
        floor = sorted(self.grants)[-HISTORY] if len(self.grants) >= HISTORY else 0
        assert record.fence.floor() == floor
        # Only the fence's grant keeps the home's signature (fence.py).
        fence = record.fence.fence
        assert dict(record.fence.grants) == {
            t: g if t == fence else g._replace(signature=b"")
            for t, g in self.grants.items()
            if t >= floor
        }
        assert dict(record.fence.lease_expiry) == {
            t: e for t, e in self.expiries.items() if t >= floor
        }
        assert record.fence.released == {t for t in self.released if t >= floor}

        # The next write anywhere beats everything in the merged state (SPEC §3, HLC).
        for node in self.nodes:
            stamp: Stamp = node.stamp()
            assert all(stamp > seen for seen in node.record.stamps())

    def teardown(self) -> None:
        self.full_sync()
        self.check_against_model()


def test_replicas_converge_to_the_sequential_model() -> None:
    run_state_machine_as_test(
        ReplicatedRecord,
        settings=settings(stateful_step_count=50, deadline=None),
    )

"""Hypothesis strategies for whole record states, built only from real operations.

Nothing here invents a CRDT structure directly: every ``Record`` is the result of
``create``/``set_fields``/``add_tags``/``remove_tags``/``set_deleted``/``clear`` writes
(alone, or combined under one stamp as the node's ``delete`` does) and of
``grant``/``extend``/``release``/``lapse``/``move`` on its ``FenceState``, performed
by simulated nodes the way the node does them (SPEC §2, §3, §4):

- each node has its own wall clock (skewed, sometimes going backwards) and a real
  ``HybridClock`` over it, so stamps are unique per write and a node that merged a
  state stamps its next write above everything in it;
- a write's epoch is the fence the writing node knew at that moment;
- only the home node grants, extends, releases, records lapses and moves the fence;
  other replicas learn claims by merging — except that a replica that has not seen
  the key may create it too (as a region cut off from the home does), and while it
  believes itself the home it grants as well (``SplitCreate``, ``SplitGrant``): the
  two births every replica must resolve alike. A replica holding a claim born
  elsewhere says so (``Sees``), and a hostile one back-dates a birth of its own
  (``BackdatedBirth``): void once it had seen the record. A grant is signed the way
  a TLS home signs it (``signing.Signer``, with a real key of a test CA: ``SIGNERS``,
  two keys of the home as after a re-issued certificate) or left unsigned as an
  ``--insecure`` home leaves it.
  (Two regions granting the same token differently is impossible in the real
  system; ``tests/test_crdt_laws.py`` covers that case separately.)

Alphabets are tiny on purpose, so that replicas keep writing the same field, the
same tag, at the same millisecond: the collisions a merge has to get right.

Use ``records()`` for one replica's state, ``replicas(n)`` for ``n`` divergent
replicas of the same key, and ``scenarios(n)`` when a test needs to watch every
step (``Scenario.run`` takes a callback).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from hypothesis import strategies as st

from fencemark.node.crdt import HybridClock, Record, Stamp
from fencemark.node.crdt.fence import HISTORY, Grant
from fencemark.node.crdt.record import ATTEMPTS, NOT_BEFORE, STATUS, STATUSES, Birth
from fencemark.node.security.signing import Keyring, Signer
from fencemark.node.security.tls import Identity, create_ca, issue

T = TypeVar("T")

KEY = "repo/lattice/mem/backlog/issue-2101"
REGIONS = ("local", "us-east", "eu-west", "ap-south")
FIELD_NAMES = ("title", "body", "kind")
# "" is a real write: an empty value clears the field (Record.field_values).
FIELD_VALUES = ("", "started", "done", "é")
TAGS = ("backlog", "priority:P1", "phase:implementation")
OWNERS = ("worker-a", "worker-b")

# Nodes start around the same wall-clock time, a few milliseconds apart.
EPOCH_MS = 1_767_225_600_000  # 2026-01-01T00:00:00Z
# The simulation merges freely: clock-skew refusal is tested in test_crdt_hlc.py.
NO_SKEW_LIMIT_MS = 1 << 60


class SimNode:
    """One region's node as the CRDT layer sees it: a wall clock, an HLC, a replica."""

    def __init__(self, region: str, *, home: bool, wall_ms: int, record: Record) -> None:
        self.region = region
        self.home = home
        self.wall_ms = wall_ms
        self.clock = HybridClock(wall_ms=lambda: self.wall_ms, max_offset_ms=NO_SKEW_LIMIT_MS)
        self.record = record
        self.clock.observe(record.max_hlc())
        self.last_stamp: Stamp | None = None

    def stamp(self) -> Stamp:
        """The stamp of a write admitted now: epoch = the fence this node knows."""
        self.last_stamp = Stamp(self.record.fence.fence, self.clock.now(), self.region)
        return self.last_stamp

    def receive(self, state: Record) -> None:
        """Merge a state gossiped from a peer (the clock moves past every stamp in it)."""
        self.clock.observe(state.max_hlc())
        self.record = self.record.merge(state)

    def __repr__(self) -> str:
        return f"SimNode({self.region!r}, home={self.home}, fence={self.record.fence.fence})"


# A test CA and two node certificates of the home region (REGIONS[0]): a home
# whose certificate was re-issued signs with the second key from then on.
_CA_CERT, _CA_KEY = create_ca("Fencemark test CA")
_HOME_CERTS = [issue(_CA_CERT, _CA_KEY, Identity("region", REGIONS[0])) for _ in range(2)]
SIGNERS = tuple(Signer.from_pem(key) for _, key in _HOME_CERTS)


# A node certificate of the second region, for a birth region other than the home,
# and one of every region but the home's, for their sightings (``Sees``).
_OTHER_CERT = issue(_CA_CERT, _CA_KEY, Identity("region", REGIONS[1]))
OTHER_SIGNER = Signer.from_pem(_OTHER_CERT[1])
_THIRD_CERTS = [issue(_CA_CERT, _CA_KEY, Identity("region", r)) for r in REGIONS[2:]]
REGION_SIGNERS = {
    REGIONS[1]: OTHER_SIGNER,
    **{r: Signer.from_pem(key) for r, (_, key) in zip(REGIONS[2:], _THIRD_CERTS, strict=True)},
}


def keyring() -> Keyring:
    """A keyring of the test CA that knows both of the home's certificates, the
    second region's (``OTHER_SIGNER``) and every other region's (``REGION_SIGNERS``)."""
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import Encoding

    ring = Keyring([x509.load_pem_x509_certificate(_CA_CERT)])
    for cert, _ in (*_HOME_CERTS, _OTHER_CERT, *_THIRD_CERTS):
        ring.add(x509.load_pem_x509_certificate(cert).public_bytes(Encoding.DER))
    return ring


def grant_next(node: SimNode, owner: str, lease_ms: int, signer: int | None) -> None:
    """The home grants ``fence + 1``, signed with ``SIGNERS[signer]`` (None: unsigned)."""
    assert node.home, "only the home region grants"
    fence = node.record.fence
    grant = Grant(node.clock.now(), owner, node.region)
    fence = fence.grant(fence.fence + 1, grant, node.wall_ms + lease_ms)
    if signer is not None:
        fence = SIGNERS[signer].sign_fence(node.record.key, fence)
        fence = SIGNERS[signer].seal(node.record.key, fence, end=True, move=False)  # the lease
    node.record = node.record.with_fence(fence)


# -- operations ---------------------------------------------------------------
#
# Each operation is a small value (so failing examples print readably) whose
# ``apply`` performs the corresponding real update on a node's replica.


@dataclass(frozen=True)
class Create:
    home_region: str

    def apply(self, node: SimNode) -> None:
        node.record = node.record.create(self.home_region, node.stamp())


@dataclass(frozen=True)
class SetFields:
    values: Mapping[str, str]

    def apply(self, node: SimNode) -> None:
        node.record = node.record.set_fields(self.values, node.stamp())


@dataclass(frozen=True)
class AddTags:
    names: frozenset[str]

    def apply(self, node: SimNode) -> None:
        node.record = node.record.add_tags(sorted(self.names), node.stamp())


@dataclass(frozen=True)
class RemoveTags:
    names: frozenset[str]

    def apply(self, node: SimNode) -> None:
        node.record = node.record.remove_tags(sorted(self.names), node.stamp())


@dataclass(frozen=True)
class SetDeleted:
    deleted: bool

    def apply(self, node: SimNode) -> None:
        node.record = node.record.set_deleted(self.deleted, node.stamp())


@dataclass(frozen=True)
class Clear:
    """Empty every field and remove every present tag, under one stamp."""

    def apply(self, node: SimNode) -> None:
        node.record = node.record.clear(node.stamp())


@dataclass(frozen=True)
class Tombstone:
    """What a node's ``delete`` writes: erased content and the deleted flag, under a
    single stamp. A key the node never saw gets no home (replica.py explains why)."""

    home_region: str

    def apply(self, node: SimNode) -> None:
        stamp = node.stamp()
        node.record = node.record.clear(stamp).set_deleted(True, stamp)


@dataclass(frozen=True)
class GrantNext:
    """The home node grants token ``fence + 1`` (claims are decided only there)."""

    owner: str
    lease_ms: int
    signer: int | None = 0  # an index into SIGNERS; None: unsigned (--insecure)

    def apply(self, node: SimNode) -> None:
        grant_next(node, self.owner, self.lease_ms, self.signer)


@dataclass(frozen=True)
class Extend:
    """Renew the lease of a granted token (picked as ``1 + pick % fence``)."""

    pick: int
    lease_ms: int

    def apply(self, node: SimNode) -> None:
        assert node.home, "only the home region renews"
        fence = node.record.fence
        if fence.fence:
            token = 1 + self.pick % fence.fence
            node.record = node.record.with_fence(fence.extend(token, node.wall_ms + self.lease_ms))


@dataclass(frozen=True)
class Release:
    """Release a granted token (picked as ``1 + pick % fence``); idempotent."""

    pick: int

    def apply(self, node: SimNode) -> None:
        assert node.home, "only the home region releases"
        fence = node.record.fence
        if fence.fence:
            node.record = node.record.with_fence(fence.release(1 + self.pick % fence.fence))


@dataclass(frozen=True)
class Lapse:
    """The home records that a token's lease ran out (picked as ``1 + pick % fence``)."""

    pick: int

    def apply(self, node: SimNode) -> None:
        assert node.home, "only the home region records lapses"
        fence = node.record.fence
        if fence.fence:
            node.record = node.record.with_fence(fence.lapse(1 + self.pick % fence.fence))


@dataclass(frozen=True)
class MoveFence:
    """The home moves the fence one past every token (what it does when two births
    meet: ``Replica.merge``)."""

    def apply(self, node: SimNode) -> None:
        assert node.home, "only the home region moves the fence"
        fence = node.record.fence
        node.record = node.record.with_fence(fence.move(fence.fence + 1))


@dataclass(frozen=True)
class SplitCreate:
    """A replica cut off from the home creates the key in its own region (a no-op
    once it has the record)."""

    def apply(self, node: SimNode) -> None:
        node.record = node.record.create(node.region, node.stamp())


@dataclass(frozen=True)
class Sees:
    """A replica holding a claim on a record born elsewhere only says so, as the
    node does on merging it (``Replica._seen``; a no-op otherwise), signed by its
    region (``REGION_SIGNERS``) or, as an ``--insecure`` node does, not."""

    signed: bool = True

    def apply(self, node: SimNode) -> None:
        record, region = node.record, node.region
        if not record.fence.grants or region in record.births or region in record.seen:
            return
        seen = record.see(region, Birth(node.stamp()._replace(epoch=0)))
        signer = REGION_SIGNERS.get(region) if self.signed else None
        node.record = signer.sign_seen(seen, region) if signer is not None else seen


@dataclass(frozen=True)
class BackdatedBirth:
    """A hostile replica claims a birth of its own region 1 ms before the home's, as
    a region signing with its own key can (docs/security.md): void if it had seen
    the record (``Record.creators``), the home otherwise. A no-op on a record it has
    no birth to back-date from."""

    def apply(self, node: SimNode) -> None:
        home = node.record.home
        if home is None or node.region in node.record.births:
            return
        earlier = home.stamp._replace(hlc=max(0, home.stamp.hlc - (1 << 16)), node=node.region)
        node.record = node.record.with_birth(node.region, Birth(earlier))


@dataclass(frozen=True)
class SplitGrant:
    """A replica whose own birth is the earliest it knows grants, unsigned, as a
    home does (a no-op while it knows an earlier birth)."""

    owner: str
    lease_ms: int

    def apply(self, node: SimNode) -> None:
        if node.record.home_region != node.region:
            return
        fence = node.record.fence
        grant = Grant(node.clock.now(), self.owner, node.region)
        fence = fence.grant(fence.fence + 1, grant, node.wall_ms + self.lease_ms)
        node.record = node.record.with_fence(fence)


@dataclass(frozen=True)
class BusyRun:
    """The home grants and releases ``times`` claims in a row, as on an item worked
    on again and again: histories outgrow ``fence.HISTORY`` and get folded."""

    times: int
    owner: str
    signer: int | None = 0

    def apply(self, node: SimNode) -> None:
        assert node.home, "only the home region grants"
        for _ in range(self.times):
            grant_next(node, self.owner, 60_000, self.signer)
            fence = node.record.fence.release(node.record.fence.fence)
            if self.signer is not None:
                fence = SIGNERS[self.signer].seal(node.record.key, fence, end=True, move=True)
            node.record = node.record.with_fence(fence)
            node.wall_ms += 1


@dataclass(frozen=True)
class Sealed:
    """A release, a lapse, a move or a renewal as a TLS home makes it: the end of
    the fence's claim sealed, the move signed, the lease's expiry sealed
    (``SIGNERS[signer]``; ``Replica._sealed``)."""

    op: Release | Lapse | MoveFence | Extend
    signer: int = 0

    def apply(self, node: SimNode) -> None:
        self.op.apply(node)
        fence = SIGNERS[self.signer].seal(node.record.key, node.record.fence, end=True, move=True)
        node.record = node.record.with_fence(fence)


@dataclass(frozen=True)
class SetQueue:
    """Write work-queue registers (SPEC §8: status, attempts, not_before)."""

    values: Mapping[str, str]

    def apply(self, node: SimNode) -> None:
        node.record = node.record.set_queue(self.values, node.stamp())


WriteOp = Create | SetFields | AddTags | RemoveTags | SetDeleted | Clear | Tombstone | SetQueue


@dataclass(frozen=True)
class Admitted:
    """A write as a TLS node admits it (SPEC §4; docs/security.md, *Signed writes*):
    while the fence is an unreleased grant, a node other than the home refuses it
    (``claimed``); the home admits it and signs it (``SIGNERS[signer]``) when it is
    at the epoch of that grant."""

    op: WriteOp
    signer: int | None = 0

    def apply(self, node: SimNode) -> None:
        fence = node.record.fence
        if fence.unreleased() and not node.home:
            return
        self.op.apply(node)
        stamp = node.last_stamp
        at_claim = stamp is not None and stamp.epoch == fence.fence and fence.unreleased()
        if node.home and self.signer is not None and at_claim and stamp is not None:
            node.record = SIGNERS[self.signer].sign_writes(node.record, stamp)


@dataclass(frozen=True)
class SignOwnWrites:
    """The home signs the writes it made unsigned at the epoch of the unreleased
    fence grant (``Replica.sign_own``, after an upgrade or an ``--insecure`` run):
    the same register in a signed and an unsigned version."""

    signer: int

    def apply(self, node: SimNode) -> None:
        assert node.home, "only the home signs its own writes"
        fence = node.record.fence
        if not fence.unreleased():
            return
        unsigned = {
            reg.stamp
            for _, _, reg in node.record.registers()
            if reg.stamp.epoch == fence.fence and reg.stamp.node == node.region
            and not reg.signature
        }  # fmt: skip
        for stamp in sorted(unsigned):
            node.record = SIGNERS[self.signer].sign_writes(node.record, stamp)


@dataclass(frozen=True)
class HomeQueue:
    """A work-queue write as a TLS home makes it (SPEC §8: a grant's attempts, a
    claim's end, a reopen): only at the home, signed (``SIGNERS[signer]``;
    ``Replica.signed_queue``)."""

    values: Mapping[str, str]
    signer: int = 0

    def apply(self, node: SimNode) -> None:
        if not node.home:
            return
        stamp = node.stamp()
        node.record = SIGNERS[self.signer].sign_writes(
            node.record.set_queue(self.values, stamp), stamp
        )


ClaimOp = (
    GrantNext | Extend | Release | Lapse | MoveFence | BusyRun | SignOwnWrites | Sealed | HomeQueue
)
SplitOp = SplitCreate | SplitGrant | Sees | BackdatedBirth
Operation = WriteOp | Admitted | ClaimOp | SplitOp

tag_names = st.frozensets(st.sampled_from(TAGS), min_size=1, max_size=2)
lease_ms = st.integers(min_value=1_000, max_value=3_600_000)
signers = st.sampled_from([0, 1, None])


# What the home writes: a status (with the attempts of a grant, or alone), or a
# not_before (a deferred release).
_statuses = st.sampled_from(STATUSES)
queue_values: st.SearchStrategy[dict[str, str]] = st.one_of(
    st.fixed_dictionaries({STATUS: _statuses}),
    st.fixed_dictionaries({STATUS: _statuses, ATTEMPTS: st.sampled_from(["1", "2", "5"])}),
    st.fixed_dictionaries(
        {STATUS: _statuses, NOT_BEFORE: st.sampled_from([str(EPOCH_MS), str(EPOCH_MS + 5_000)])}
    ),
)


def write_ops(regions: Sequence[str] = REGIONS) -> st.SearchStrategy[WriteOp]:
    """Writes any replica may admit (``create`` names a home from ``regions``)."""
    return st.one_of(
        st.builds(Create, st.sampled_from(regions)),
        st.builds(
            SetFields,
            st.dictionaries(
                st.sampled_from(FIELD_NAMES), st.sampled_from(FIELD_VALUES), min_size=1, max_size=2
            ),
        ),
        st.builds(AddTags, tag_names),
        st.builds(RemoveTags, tag_names),
        st.builds(SetDeleted, st.booleans()),
        st.builds(Clear),
        st.builds(Tombstone, st.sampled_from(regions)),
        st.builds(SetQueue, queue_values),
    )


ends: st.SearchStrategy[Release | Lapse | MoveFence | Extend] = st.one_of(
    st.builds(Release, st.integers(0, 7)),
    st.builds(Lapse, st.integers(0, 7)),
    st.builds(MoveFence),
    st.builds(Extend, st.integers(0, 7), st.integers(1, 120_000)),
)


def claim_ops() -> st.SearchStrategy[ClaimOp]:
    """Claim operations, performed only by the home region's node."""
    return st.one_of(
        st.builds(GrantNext, st.sampled_from(OWNERS), lease_ms, signers),
        st.builds(Extend, st.integers(0, 7), lease_ms),
        st.builds(Release, st.integers(0, 7)),
        st.builds(Lapse, st.integers(0, 7)),
        st.builds(MoveFence),
        st.builds(BusyRun, st.integers(1, HISTORY + 2), st.sampled_from(OWNERS), signers),
        st.builds(SignOwnWrites, st.sampled_from([0, 1])),
        st.builds(Sealed, ends, st.sampled_from([0, 1])),
        st.builds(HomeQueue, queue_values, st.sampled_from([0, 1])),
    )


def operations(*, home: bool, regions: Sequence[str] = REGIONS) -> st.SearchStrategy[Operation]:
    """What a node may do: every write, plus claim operations if it is the home
    (whose writes are sometimes signed as a TLS home signs them: ``Admitted``)."""
    writes: st.SearchStrategy[Operation] = write_ops(regions)
    if not home:
        return writes
    signed = st.builds(Admitted, write_ops(regions), st.sampled_from([0, 1]))
    return st.one_of(writes, signed, claim_ops())


# -- scenarios: several replicas of one key -------------------------------------


@dataclass(frozen=True)
class Act:
    """Node ``node`` performs ``op`` on its replica."""

    node: int
    op: Operation


@dataclass(frozen=True)
class Gossip:
    """Node ``target`` merges the state of node ``source`` (``a.merge(b)`` stored at a)."""

    source: int
    target: int


@dataclass(frozen=True)
class Tick:
    """Node ``node``'s wall clock moves by ``ms`` (it may stand still or step back)."""

    node: int
    ms: int


Step = Act | Gossip | Tick

# Observes the nodes after every step (index, step, nodes).
StepObserver = Callable[[int, Step, Sequence[SimNode]], None]


@dataclass(frozen=True)
class Scenario:
    """Replicas of one key: node 0 is the home region, the only one that grants.

    ``ancestor`` runs at the home node and its result is copied to every replica
    before ``steps`` run; ``skews`` are the nodes' wall-clock offsets.
    """

    skews: tuple[int, ...]
    ancestor: tuple[Operation, ...]
    steps: tuple[Step, ...] = field(default=())

    def nodes(self) -> list[SimNode]:
        home = SimNode(REGIONS[0], home=True, wall_ms=EPOCH_MS + self.skews[0], record=Record(KEY))
        for op in self.ancestor:
            op.apply(home)
        others = [
            SimNode(REGIONS[i], home=False, wall_ms=EPOCH_MS + skew, record=home.record)
            for i, skew in enumerate(self.skews[1:], start=1)
        ]
        return [home, *others]

    def run(self, observe: StepObserver | None = None) -> list[SimNode]:
        nodes = self.nodes()
        for index, step in enumerate(self.steps):
            apply_step(step, nodes)
            if observe is not None:
                observe(index, step, nodes)
        return nodes


def apply_step(step: Step, nodes: Sequence[SimNode]) -> None:
    if isinstance(step, Act):
        step.op.apply(nodes[step.node])
    elif isinstance(step, Gossip):
        nodes[step.target].receive(nodes[step.source].record)
    else:
        nodes[step.node].wall_ms += step.ms


def sized_lists(elements: st.SearchStrategy[T], max_size: int) -> st.SearchStrategy[tuple[T, ...]]:
    """Lists of a length drawn uniformly first: plain ``st.lists`` favours short
    histories, and the interesting cases need several writes on several replicas."""
    return st.integers(0, max_size).flatmap(
        lambda size: st.lists(elements, min_size=size, max_size=size).map(tuple)
    )


def steps(n: int) -> st.SearchStrategy[Step]:
    """One step among ``n`` nodes; claim operations only at node 0, the home."""
    node = st.integers(0, n - 1)
    split: st.SearchStrategy[SplitOp] = st.one_of(
        st.builds(SplitCreate),
        st.builds(SplitGrant, st.sampled_from(OWNERS), lease_ms),
        st.builds(Sees, st.booleans()),
        st.builds(BackdatedBirth),
    )
    return st.one_of(
        st.builds(Act, st.just(0), operations(home=True, regions=[REGIONS[0]])),
        st.builds(Act, node, write_ops(regions=[REGIONS[0]])),
        st.builds(Act, st.integers(min(1, n - 1), n - 1), split),
        st.builds(Gossip, node, node),
        st.builds(Tick, node, st.integers(-5, 40)),
    )


def scenarios(n: int = 3, *, max_steps: int = 30) -> st.SearchStrategy[Scenario]:
    """``n`` replicas that share an (often empty) ancestor, then diverge and gossip."""
    if not 1 <= n <= len(REGIONS):
        raise ValueError(f"between 1 and {len(REGIONS)} replicas")
    return st.builds(
        Scenario,
        skews=st.tuples(*[st.integers(-20, 20)] * n),
        ancestor=st.lists(operations(home=True, regions=[REGIONS[0]]), max_size=6).map(tuple),
        steps=sized_lists(steps(n), max_steps),
    )


def replicas(n: int = 3, *, max_steps: int = 30) -> st.SearchStrategy[tuple[Record, ...]]:
    """The states of ``n`` replicas of the same key after a random scenario."""
    return scenarios(n, max_steps=max_steps).map(
        lambda scenario: tuple(node.record for node in scenario.run())
    )


# -- one replica ------------------------------------------------------------------


@dataclass(frozen=True)
class History:
    """One node's history: its wall clock ticks between operations."""

    skew: int
    ops: tuple[tuple[int, Operation], ...]

    def node(self) -> SimNode:
        node = SimNode(REGIONS[0], home=True, wall_ms=EPOCH_MS + self.skew, record=Record(KEY))
        for tick, op in self.ops:
            node.wall_ms += tick
            op.apply(node)
        return node


def histories(*, max_ops: int = 20) -> st.SearchStrategy[History]:
    return st.builds(
        History,
        skew=st.integers(-20, 20),
        ops=sized_lists(st.tuples(st.integers(-5, 40), operations(home=True)), max_ops),
    )


def sim_nodes(*, max_ops: int = 20) -> st.SearchStrategy[SimNode]:
    """A home node after a random history (fresh object per example: mutate freely)."""
    return histories(max_ops=max_ops).map(History.node)


def records(*, max_ops: int = 20) -> st.SearchStrategy[Record]:
    """One replica's state after a random history of real operations."""
    return histories(max_ops=max_ops).map(lambda history: history.node().record)

"""This node's peers and what it knows about each: the nodes of other regions
(``--peer``, static), and with members (SPEC §10) the other members of its own
region, as etcd registers them (``coordination.registry``), added and removed at
run time.

A peer is known by its *name*: another region's name (``eu``: any of that region's
nodes serves its replication), or ``REGION/MEMBER`` for a member of this node's own
region (``us/us-b``)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from fencemark.node.rules import validation
from fencemark.node.rules.errors import InvalidInput
from fencemark.v1 import replication_pb2

if TYPE_CHECKING:
    from fencemark.node.core.replica import Replica

# Refused states remembered per peer, by key (the oldest is forgotten first).
MAX_REFUSED_KEYS = 10_000
# Refusals that a later exchange may lift with the very same states: a signer's
# certificate not known yet (integrity.py). Such a state is fetched again, but not
# before this pause (the signer's certificate is asked for at most that often).
RETRIED_REFUSALS = frozenset({"unknown_signer"})
RETRY_REFUSED_S = 5.0


def parse_peers(specs: Iterable[str], *, own_region: str) -> dict[str, str]:
    """``["eu=host:port", ...]`` (also comma-separated) -> ``{"eu": "host:port"}``.

    A region of several members may be given several addresses, any of which serves
    its replication: ``eu=h1:p1,h2:p2`` (an item without ``=`` adds an address to the
    region before it) -> ``{"eu": "h1:p1,h2:p2"}``, tried in turn (``PeerLink``)."""
    peers: dict[str, str] = {}
    for spec in specs:
        region = ""
        given: dict[str, list[str]] = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            named, sep, address = item.partition("=")
            if not sep and region and ":" in item:
                given[region].append(item)  # another address of the region before it
                continue
            if not sep or not address or ":" not in address:
                raise InvalidInput.field("peer", f"expected REGION=HOST:PORT, got {item!r}")
            region = named
            validation.region(region, "peer")
            if region == own_region:
                raise InvalidInput.field("peer", f"{region!r} is this node's own region")
            given.setdefault(region, []).append(address)
        for region, addresses in given.items():
            joined = ",".join(dict.fromkeys(addresses))
            if region in peers and peers[region] != joined:
                raise InvalidInput.field("peer", f"region {region!r} given twice")
            peers[region] = joined
    return peers


def peer_name(region: str, member: str, own_region: str) -> str:
    """The name of the peer that sent an ``Origin`` of ``region`` and ``member``, at a
    node of ``own_region``: another region's name, or ``REGION/MEMBER`` for a fellow
    member."""
    return f"{region}/{member}" if region == own_region and member else region


@dataclass
class PeerStats:
    """Replication accounting for one peer, both directions, as this node sees it."""

    region: str  # whose certificate it presents, and whose states it speaks for
    address: str  # where it is reached now: one of ``addresses``
    member: str = ""  # a fellow member of this node's region: its name there
    # Every address that serves the peer (a region of several members), tried in turn.
    addresses: tuple[str, ...] = ()
    started: float = 0.0
    last_sync: float | None = None  # wall-clock seconds of the last completed round
    records_sent: int = 0
    records_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    divergence: int = 0
    skew_alarms: int = 0
    merges_refused: int = 0  # states from this peer refused (integrity.check, limits)
    last_refusal: str = ""
    merge_refusals: Counter[str] = field(default_factory=Counter)  # ... by reason
    # key -> (reason, the peer's digest, ours, monotonic time it was refused) of the
    # last state refused for that key.
    refused: dict[str, tuple[str, bytes, bytes, float]] = field(default_factory=dict)
    # This node's own states not sent to the peer: over the record size limit.
    states_too_large: int = 0
    too_large_keys: dict[str, None] = field(default_factory=dict)  # ... logged, by key
    reachable: bool = False
    last_error: str = ""
    failures: int = 0  # consecutive failed attempts
    # Checks of the certificate the peer's address presents that refused it, by
    # denial (revoked_certificate, region_mismatch, ...; replication.peer_check).
    certificate_refusals: dict[str, int] = field(default_factory=dict)
    # How this node reaches the peer: mutual TLS with its own certificate
    # (fencemark.node.security.tls), or None for plaintext (--insecure).
    credentials: grpc.ChannelCredentials | None = None

    def __post_init__(self) -> None:
        self.started = self.started or time.time()
        if "," in self.address:
            self.addresses = tuple(self.address.split(","))
        self.address = self.address.split(",")[0]
        self.addresses = self.addresses or (self.address,)

    def next_address(self) -> bool:
        """Reach the peer at its next address from now on; False if it has one only."""
        if len(self.addresses) < 2:
            return False
        at = self.addresses.index(self.address) if self.address in self.addresses else -1
        self.address = self.addresses[(at + 1) % len(self.addresses)]
        return True

    @property
    def name(self) -> str:
        """The peer's name: its region, or ``REGION/MEMBER`` for a fellow member."""
        return f"{self.region}/{self.member}" if self.member else self.region

    def lag_ms(self, now: float | None = None) -> int:
        since = self.last_sync if self.last_sync is not None else self.started
        return max(0, round(((now or time.time()) - since) * 1000))

    def refused_state(
        self, key: str, reason: str, message: str, digests: tuple[bytes, bytes]
    ) -> bool:
        """Count a state of the peer's that this node refused; ``digests`` are the
        peer's state's and this node's own. True when it is news: the first refusal
        of ``key`` for ``reason`` (log it), not a repeat."""
        self.merges_refused += 1
        self.merge_refusals[reason] += 1
        self.last_refusal = message[:500]
        before = self.refused.pop(key, None)
        self.refused[key] = (reason, *digests, time.monotonic())
        while len(self.refused) > MAX_REFUSED_KEYS:
            del self.refused[next(iter(self.refused))]
        return before is None or before[0] != reason

    def refused_to_retry(self, keys: Iterable[str], since: float) -> int:
        """How many of ``keys`` had a state refused since ``since`` (monotonic) for a
        reason that may lift (an unknown signer): its merge is still owed, so a
        whole round that met one has not merged everything the peer held."""
        return sum(
            1
            for key in keys
            if (before := self.refused.get(key)) is not None
            and before[0] in RETRIED_REFUSALS
            and before[3] >= since
        )

    def refused_before(
        self, key: str, theirs: bytes, ours: bytes, *, catching_up: bool = False
    ) -> bool:
        """Whether this node refused the peer's state ``theirs`` of ``key`` against its
        own state ``ours``: the same merge would be refused again, so it is not
        fetched again (SPEC §2) until either side changes. A refusal that may lift
        (an unknown signer) is retried after a pause, and at once while catching up."""
        before = self.refused.get(key)
        if before is None or before[1:3] != (theirs, ours):
            return False
        if before[0] not in RETRIED_REFUSALS:
            return True
        return not catching_up and time.monotonic() - before[3] < RETRY_REFUSED_S

    def succeeded(self) -> None:
        self.reachable = True
        self.last_error = ""
        self.failures = 0

    def failed(self, why: str) -> None:
        self.reachable = False
        self.last_error = why
        self.failures += 1


def stats_for(
    peers: Mapping[str, str], credentials: grpc.ChannelCredentials | None = None
) -> dict[str, PeerStats]:
    return {
        region: PeerStats(region, address, credentials=credentials)
        for region, address in peers.items()
    }


def origin(replica: Replica) -> replication_pb2.Origin:
    """Who makes a replication call: this node's region, id and life, its name among
    its region's members (a fellow member answers only a registered one), its clock."""
    return replication_pb2.Origin(
        region=replica.region,
        node_id=replica.node_id,
        hlc=replica.clock.now(),
        life=replica.life,
        member=replica.member,
    )

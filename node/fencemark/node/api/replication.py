"""The ``fencemark.v1.Replication`` servicer: answers other nodes' calls.

Reads (``Tree``, ``Buckets``, ``Fetch``) come from the digest tree and storage;
``Push`` merges states with the CRDT join, each record atomically, and replies
once every merged state is durable. Exchanges from a clock beyond
``max_clock_offset`` are refused whole (SPEC §3) and counted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from fencemark.node.api.service import refusals
from fencemark.node.core.replica import Replica
from fencemark.node.replication.intake import (
    MAX_BATCH_BYTES,
    MAX_LIST_NODES,
    MAX_LIST_RECORDS,
    MAX_STATES,
    MAX_TREE_PARENTS,
    check_clock,
    decode_states,
    learnt_events,
    merge_all,
    too_large,
)
from fencemark.node.replication.lives import Lives
from fencemark.node.replication.peers import PeerStats, peer_name
from fencemark.node.replication.signers import MAX_KEY_IDS
from fencemark.node.rules import validation
from fencemark.node.rules.errors import (
    ClockSkewed,
    Denial,
    InvalidInput,
    NotServing,
    PermissionDenied,
    TwinNode,
)
from fencemark.node.security.tls import peer_identity
from fencemark.node.store.digest_tree import (
    DEPTH,
    MAX_SALT_BYTES,
    MIN_SALT_BYTES,
    children,
    leaf_range,
    level_size,
)
from fencemark.node.store.storage import Storage
from fencemark.v1 import replication_pb2

log = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext[Any, Any]


def _check_nodes(field: str, level: int, nodes: Sequence[int]) -> None:
    size = level_size(level)
    if any(node >= size for node in nodes):
        raise InvalidInput.field(field, f"level {level} has nodes 0-{size - 1}")


class ReplicationService:
    def __init__(
        self,
        replica: Replica,
        storage: Storage,
        peers: dict[str, PeerStats],
        heard_from: Callable[[str], None] | None = None,
        pulled_by: Callable[[str, list[str]], None] | None = None,
        *,
        authenticate: bool = False,
        max_list_records: int = MAX_LIST_RECORDS,
        lives: Lives | None = None,
        lacks_acknowledged: Callable[[], bool] | None = None,
    ) -> None:
        self.replica = replica  # merges go through it (admission, integrity) ...
        self.storage = storage  # ... the digest tree and states are read straight
        self.peers = peers
        # Records one Buckets request may list (every node's replicator asks for half).
        self.max_list_records = max_list_records
        self.heard_from = heard_from  # Replicator.heard_from: a peer that calls is up
        # Replicator.pulled_by: a peer that fetched current states needs no push of them.
        self.pulled_by = pulled_by
        # With TLS: only a configured peer's node certificate, speaking for its own region.
        self.authenticate = authenticate
        # The recent lives of each calling node id: two at once are twins, refused.
        self.lives = lives
        # Replicator.lacks_acknowledged: said in Tree answers (a lost disk owes it all).
        self.lacks_acknowledged = lacks_acknowledged or (lambda: replica.gate.owed)

    def _sender(self, origin: replication_pb2.Origin) -> str:
        """The calling peer's name (``peers.peer_name``)."""
        return peer_name(origin.region, origin.member, self.replica.region)

    def _authenticate(self, origin: replication_pb2.Origin, context: Context) -> None:
        """Refuse (PERMISSION_DENIED) unless the caller's certificate is the node of a
        configured peer region and ``origin.region`` is that region — or, at a member
        of a region of several, this node's own region and ``origin.member`` one of
        its members registered in etcd (``coordination.registry``)."""
        identity = peer_identity(context)
        if identity is None or identity.kind != "region":
            raise PermissionDenied(
                Denial.UNAUTHENTICATED_PEER,
                f"replication is for nodes: {identity or 'this certificate'} is no"
                " fencemark://region/ identity",
                identity=str(identity or ""),
                right="replicate",
            )
        if identity.name == self.replica.region:
            fellow = self.peers.get(self._sender(origin))
            if origin.region == identity.name and fellow is not None and fellow.member:
                return
            raise PermissionDenied(
                Denial.UNKNOWN_MEMBER,
                f"{identity} is this node's own region; a call of it must come from a"
                f" member registered in etcd, not {origin.member or 'a node'!r}",
                identity=str(identity),
                right="replicate",
            )
        if identity.name not in self.peers:
            raise PermissionDenied(
                Denial.UNKNOWN_REGION,
                f"region {identity.name!r} is not a configured peer of this node",
                identity=str(identity),
                right="replicate",
            )
        if origin.region != identity.name:
            raise PermissionDenied(
                Denial.REGION_MISMATCH,
                f"the certificate of region {identity.name!r} may not speak for region"
                f" {origin.region!r}",
                identity=str(identity),
                right="replicate",
            )

    def _admit(
        self, origin: replication_pb2.Origin, request_bytes: int, context: Context
    ) -> PeerStats | None:
        if self.authenticate:
            self._authenticate(origin, context)
        sender = self._sender(origin)
        peer = self.peers.get(sender)
        if peer is not None:
            peer.bytes_received += request_bytes
            if self.heard_from is not None:
                self.heard_from(sender)
        try:
            check_clock(self.replica, origin.region, [origin.hlc])
        except ClockSkewed:
            if peer is not None:
                peer.skew_alarms += 1
            raise
        if self.lives is not None:
            self._check_twins(self.lives, origin)
        if self.replica.gate.quiet():
            # Heard (its life recorded above), but not served: it may have waited in
            # the socket while this process slept (grant_gate.quiet).
            raise NotServing(
                "this process just woke from a pause; it takes replication calls again in a moment",
                retry_after_ms=int(self.replica.gate.quiet_s * 1000),
            )
        return peer

    @staticmethod
    def _check_twins(lives: Lives, origin: replication_pb2.Origin) -> None:
        """Refuse (TWIN_NODE) a call of a node id that two live processes call with."""
        found = lives.twins_found
        if lives.heard(origin.node_id, origin.life, origin.hlc, time.monotonic()):
            if lives.twins_found != found:
                log.error(
                    "two live processes of region %s call as node %s (a copy of one data"
                    " directory started twice): refusing both until one of them stops",
                    origin.region,
                    origin.node_id,
                )
            raise TwinNode(origin.node_id, origin.region)

    @staticmethod
    def _sent(peer: PeerStats | None, response_bytes: int, records: int = 0) -> None:
        if peer is not None:
            peer.bytes_sent += response_bytes
            peer.records_sent += records

    @refusals
    async def Push(
        self, request: replication_pb2.PushRequest, context: Context
    ) -> replication_pb2.PushResponse:
        peer = self._admit(request.origin, request.ByteSize(), context)
        if len(request.states) > MAX_STATES:
            raise InvalidInput.field("states", f"at most {MAX_STATES} states per push")
        states = list(request.states)
        records = decode_states(states)
        # A fellow member's decisions come with their claim events (Records.History
        # answers alike at every member); anyone else's are not this node's to keep.
        fellow = request.origin.region == self.replica.region and bool(request.origin.member)
        events = learnt_events(request.events, len(states)) if fellow else []
        try:
            merged, refused = await merge_all(
                self.replica, self._sender(request.origin), records, peer, states=states,
                events=events,
            )  # fmt: skip
        except ClockSkewed:
            if peer is not None:
                peer.skew_alarms += 1
            raise
        if peer is not None:
            peer.records_received += merged
        response = replication_pb2.PushResponse(
            merged=merged, unchanged=len(records) - merged, refused=refused
        )
        self._sent(peer, response.ByteSize())
        return response

    @refusals
    async def Tree(
        self, request: replication_pb2.TreeRequest, context: Context
    ) -> replication_pb2.TreeResponse:
        peer = self._admit(request.origin, request.ByteSize(), context)
        if request.level > DEPTH:
            raise InvalidInput.field("level", f"levels are 0-{DEPTH}")
        tree = self.storage.tree
        if request.level == 0:
            if request.parents:
                raise InvalidInput.field("parents", "the root (level 0) has no parents")
            nodes: list[int] = [0]
        else:
            if len(request.parents) > MAX_TREE_PARENTS:
                raise InvalidInput.field(
                    "parents", f"at most {MAX_TREE_PARENTS} parents per request"
                )
            _check_nodes("parents", request.level - 1, request.parents)
            if not MIN_SALT_BYTES <= len(request.salt) <= MAX_SALT_BYTES:
                raise InvalidInput.field(
                    "salt", f"{MIN_SALT_BYTES} to {MAX_SALT_BYTES} bytes below the root"
                )
            nodes = [c for p in request.parents for c in children(request.level - 1, p)]
        if request.level == 0:  # the root's count would make in-sync rounds grow with it
            owed = self.lacks_acknowledged()  # a member counts no majority's states here
            response = replication_pb2.TreeResponse(hashes=tree.root, owed=owed)
        else:
            response = replication_pb2.TreeResponse(
                hashes=tree.checks(request.level, nodes, request.salt),
                counts=tree.counts(request.level, nodes),
            )
        self._sent(peer, response.ByteSize())
        return response

    @refusals
    async def Buckets(
        self, request: replication_pb2.BucketsRequest, context: Context
    ) -> replication_pb2.BucketsResponse:
        peer = self._admit(request.origin, request.ByteSize(), context)
        if request.level > DEPTH:
            raise InvalidInput.field("level", f"levels are 0-{DEPTH}")
        if len(request.nodes) > MAX_LIST_NODES:
            raise InvalidInput.field("nodes", f"at most {MAX_LIST_NODES} nodes per request")
        _check_nodes("nodes", request.level, request.nodes)
        tree = self.storage.tree
        records = sum(tree.counts(request.level, request.nodes))
        if records > self.max_list_records:
            raise InvalidInput.field(
                "nodes",
                f"these nodes hold {records} records, at most {self.max_list_records} per request",
            )
        spans = [leaf_range(request.level, node) for node in request.nodes]
        entries = await self.storage.bucket_entries(spans)
        response = replication_pb2.BucketsResponse(
            entries=[replication_pb2.BucketEntry(key=k, digest=d, max_hlc=h) for k, d, h in entries]
        )
        self._sent(peer, response.ByteSize())
        return response

    @refusals
    async def Fetch(
        self, request: replication_pb2.FetchRequest, context: Context
    ) -> replication_pb2.FetchResponse:
        peer = self._admit(request.origin, request.ByteSize(), context)
        if len(request.keys) > MAX_STATES:
            raise InvalidInput.field("keys", f"at most {MAX_STATES} keys per request")
        storage = self.storage
        commits = storage.commits
        found = await storage.states(list(request.keys))
        current = storage.commits == commits  # no commit raced the read
        response = replication_pb2.FetchResponse(owed=self.lacks_acknowledged())
        served: list[str] = []
        size = 0
        for key in request.keys:
            state = found.get(key)
            if state is None:
                continue
            if len(state) > validation.MAX_RECORD_BYTES:
                # Stored before merges were limited: the asker would refuse it, and it
                # may not fit a message at all. It must not fail the asker's round.
                response.oversized.append(key)
                too_large(peer, self._sender(request.origin), key, len(state))
                continue
            if response.states and size + len(state) > MAX_BATCH_BYTES:
                response.truncated.append(key)
                continue
            response.states.append(state)
            served.append(key)
            size += len(state)
        if current and peer is not None and self.pulled_by is not None:
            self.pulled_by(self._sender(request.origin), served)
        self._sent(peer, response.ByteSize(), len(response.states))
        return response

    @refusals
    async def Certificates(
        self, request: replication_pb2.CertificatesRequest, context: Context
    ) -> replication_pb2.CertificatesResponse:
        peer = self._admit(request.origin, request.ByteSize(), context)
        if len(request.key_ids) > MAX_KEY_IDS:
            raise InvalidInput.field("key_ids", f"at most {MAX_KEY_IDS} key ids per request")
        keyring = self.replica.keyring
        known = keyring.certificates(request.key_ids) if keyring is not None else []
        response = replication_pb2.CertificatesResponse(certificates=known)
        self._sent(peer, response.ByteSize())
        return response

"""This node's side of replication: eager push and anti-entropy rounds.

- Eager push: every local write enqueues its key for every peer (a bounded,
  de-duplicated queue per peer); a worker per peer pushes the latest states in
  batches. A slow or dead peer only fills its own queue, never blocks a client;
  what overflows is left to anti-entropy, and so is the whole queue of a peer
  that stays unreachable (``UNREACHABLE_AFTER_S``).
- Anti-entropy: every ``interval`` (jittered) a random peer that is not backed
  off gets one round: compare digest-tree roots; if they differ, descend level
  by level into differing nodes (salted check values; at most ``MAX_FRONTIER``
  per level) until listing a node's records costs less than its children, list
  those records (at most ``MAX_ROUND_RECORDS``, a chunk at a time), and pull
  what differs and merge it. A peer found behind is left to pull for a while.
  Rounds only pull: every node repairs itself, one round at a time, so no state
  is delivered twice by rounds of different nodes racing each other. A round is
  bounded; a round that pulled something is followed by another one soon.
- Catch-up: while this node owes a catch-up (a new or restored data directory,
  recorded durably by ``fencemark.node.core.grant_gate``) its rounds go first to
  the peers that have not yet given a complete one, and it decides claims only
  once every peer has (docs/replication.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc
from google.protobuf.message import Message

from fencemark.node.core.replica import Replica
from fencemark.node.replication.intake import (
    MAX_BATCH_BYTES,
    MAX_LIST_NODES,
    MAX_LIST_RECORDS,
    MAX_STATES,
    MAX_TREE_PARENTS,
    decode_states,
    merge_all,
    too_large,
)
from fencemark.node.replication.peer_check import PeerCheck
from fencemark.node.replication.peers import PeerStats
from fencemark.node.rules.errors import ClockSkewed
from fencemark.node.rules.integrity import MergeRefused
from fencemark.node.rules.validation import MAX_RECORD_BYTES, OVER_LIMIT
from fencemark.node.security.tls import peer_channel, retire_channel
from fencemark.node.security.tls_reload import LiveTls
from fencemark.node.store.digest_tree import CHECK_BYTES, DEPTH, FANOUT, children, leaf_range
from fencemark.node.store.storage import Storage
from fencemark.v1 import replication_pb2, replication_pb2_grpc

log = logging.getLogger(__name__)
R = TypeVar("R", bound=Message)

MAX_FRONTIER = 1024  # tree nodes descended into per level and round
# A differing node is listed rather than descended into when listing it costs
# less than asking for its 16 children: a listed record costs about ENTRY_BYTES, a
# child CHILD_BYTES, and only the records that differ are worth listing — their
# share is estimated from how many nodes differ at that level (after a partition
# most records do: listing wins; a few scattered changes: descending does).
ENTRY_BYTES = 60  # key, digest, max_hlc and framing of one BucketEntry
CHILD_BYTES = 6  # a 4-byte check value and a count
SALT_BYTES = 8  # of each round's salt for check values (digest_tree.CHECK_BYTES)
MAX_ROUND_RECORDS = 32768  # records listed per round; the rest waits for the next
# A round that differs but pulls nothing found a peer that is behind: it pulls what it
# lacks in its own rounds, and until then each round with it would list the same
# differences again (docs/performance.md, *Repair bytes*). Such a peer gets no round
# from this node for this long; should it hold something this node lacks after all
# (an older write concurrent with a newer one), that waits this much longer.
BEHIND_PAUSE_S = 5.0
# A round lists a large difference a chunk at a time, the first of FIRST_LISTING
# records; once BEHIND_AFTER differing records have turned out to be all the peer's
# to pull, the rest is not listed (a peer that is behind after a partition would
# otherwise cost its bystanders a listing of everything that differs).
FIRST_LISTING = 1024
BEHIND_AFTER = 32
PUSH_QUEUE_LIMIT = 100_000  # keys waiting per peer; beyond this anti-entropy repairs
# A peer that no call has reached (UNAVAILABLE, DEADLINE_EXCEEDED) for this many
# attempts in a row and this many seconds has its push queue dropped, and no keys
# are queued for it until it is reached again: once back, it pulls what it missed
# in its own rounds. Pushing the backlog as well would deliver every state twice
# (docs/performance.md, *Repair bytes*). Short blips, and peers still starting,
# keep their queue; a peer that answers but refuses (clock skew) keeps it too.
UNREACHABLE_AFTER = 3
UNREACHABLE_AFTER_S = 5.0
# A failing peer is retried after 0.5 s doubling up to this, jittered by 0.5x-1.5x.
# Kept short: after a symmetric partition neither side calls the other until a
# back-off ends, so this bounds how long a healed link lies idle (docs/performance.md).
# A call to a peer that is down costs one refused connection attempt.
MAX_BACKOFF_S = 2.0
# A partition that drops packets (rather than refusing connections) leaves a TCP
# connection that looks open while its retransmission timer backs off towards
# minutes; after the heal, calls on it would keep timing out. Keepalive pings
# find such a connection dead within KEEPALIVE_MS + KEEPALIVE_TIMEOUT_MS and the
# channel reconnects, with its reconnect backoff capped so a healed link is
# used again within seconds (the chaos tier's partitions are such drops).
KEEPALIVE_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000
MAX_RECONNECT_BACKOFF_MS = 2_000  # the channel's own retries: same reason
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 16 << 20),
    ("grpc.max_send_message_length", 16 << 20),
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
]


@dataclass(frozen=True)
class Tuning:
    """The replicator's tunables, each a constructor parameter (the defaults are the
    constants above, with why each is what it is): a test lowers one to reach a
    bound with a small store, a deployment could tune one without a patch."""

    max_frontier: int = MAX_FRONTIER
    max_round_records: int = MAX_ROUND_RECORDS
    first_listing: int = FIRST_LISTING
    behind_after: int = BEHIND_AFTER
    behind_pause_s: float = BEHIND_PAUSE_S
    push_queue_limit: int = PUSH_QUEUE_LIMIT
    unreachable_after: int = UNREACHABLE_AFTER
    unreachable_after_s: float = UNREACHABLE_AFTER_S
    max_backoff_s: float = MAX_BACKOFF_S


@dataclass
class RoundResult:
    in_sync: bool
    pulled: int = 0
    divergence: int = 0  # keys whose digests differed in the compared buckets
    truncated: bool = False

    @property
    def complete(self) -> bool:
        """This node now has everything the peer had when the round ran."""
        return self.in_sync or (not self.truncated and self.pulled == 0)


class _Peer:
    def __init__(self, stats: PeerStats, tuning: Tuning, check: PeerCheck | None = None) -> None:
        self.stats = stats
        self.tuning = tuning
        self.check = check  # the peer's certificate, with TLS (peer_check)
        self.refused = False  # the check refused it, and its channel was replaced
        self._connect()
        self.backlog: dict[str, None] = {}  # an ordered set of keys to push
        self.pushing = False  # a batch is in flight ...
        self.fetched: set[str] = set()  # ... and the peer fetched these meanwhile
        self.wake = asyncio.Event()
        self.retry_at = 0.0
        self.behind_until = 0.0  # no rounds with it before: it was behind, and pulls
        self.accepts_push = True
        self.push_probe_at = 0.0  # when to try pushing again to a peer that refused
        self.unanswered = 0  # calls in a row that did not reach the peer
        self.unanswered_since = 0.0  # ... since when

    def _connect(self) -> None:
        self.credentials = self.stats.credentials
        self.channel = peer_channel(self.stats.address, self.credentials, CHANNEL_OPTIONS)
        self._stub = replication_pb2_grpc.ReplicationStub(self.channel)

    @property
    def stub(self) -> replication_pb2_grpc.ReplicationStub:
        """The peer's stub, on a new channel once the node's certificate was renewed
        (``tls_reload``): an open connection would keep presenting the old one."""
        if self.stats.credentials is not self.credentials:
            self._reconnect()
        return self._stub

    def _reconnect(self) -> None:
        """A new channel; calls still running on the old one may finish."""
        old = self.channel
        self._connect()
        retire_channel(old)

    async def allowed(self) -> None:
        """Before every call: raise ``PeerRefused`` (nothing is sent) while the
        certificate the peer's address presents is revoked or not its region's
        (peer_check). A peer newly refused gets a new channel, so no connection made
        with its refused certificate is used again, and its push queue is dropped:
        it pulls what it missed once it is admitted again."""
        if self.check is None:
            return
        try:
            await self.check.admit()
        finally:
            if self.check.refused and not self.refused:
                self.backlog.clear()
                self._reconnect()
            self.refused = self.check.refused

    def pushes_allowed(self) -> bool:
        """False while the peer refuses pushes (writes disabled; retried every minute)
        or its certificate is refused (re-checked by anti-entropy rounds)."""
        if self.check is not None and self.check.refused:
            return False
        if not self.accepts_push and time.monotonic() >= self.push_probe_at:
            self.accepts_push = True
        return self.accepts_push

    def refuses_pushes(self) -> None:
        self.accepts_push = False
        self.push_probe_at = time.monotonic() + 60.0
        self.backlog.clear()  # it pulls by itself; nothing queued would be sent

    def requeue(self, keys: list[str]) -> None:
        """Put back the keys of a batch that did not get through (unless the peer
        fetched them meanwhile)."""
        for key in keys:
            if len(self.backlog) < self.tuning.push_queue_limit and key not in self.fetched:
                self.backlog.setdefault(key, None)

    def unreachable(self) -> bool:
        return (
            self.unanswered >= self.tuning.unreachable_after
            and time.monotonic() - self.unanswered_since >= self.tuning.unreachable_after_s
        )

    def back_off(self, why: str, code: grpc.StatusCode | None = None) -> None:
        self.stats.failed(why)
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            if not self.unanswered:
                self.unanswered_since = time.monotonic()
            self.unanswered += 1
            if self.unreachable():
                self.backlog.clear()  # it pulls what it missed once it is back
        delay = min(self.tuning.max_backoff_s, 0.25 * 2 ** min(self.stats.failures, 8))
        self.retry_at = time.monotonic() + delay * random.uniform(0.5, 1.5)

    def answered(self) -> None:
        self.stats.succeeded()
        self.unanswered = 0


class Replicator:
    def __init__(
        self,
        replica: Replica,
        storage: Storage,
        peers: dict[str, PeerStats],
        *,
        interval: float = 1.0,
        timeout: float = 10.0,
        catching_up: bool = False,
        on_caught_up: Callable[[], Awaitable[None]] | None = None,
        tls: LiveTls | None = None,
        tuning: Tuning = Tuning(),
    ) -> None:
        self.replica = replica  # what it pulls merges through it ...
        self.storage = storage  # ... what it compares and pushes is read straight
        self.tuning = tuning
        self.interval = interval
        self.timeout = timeout
        self.catching_up = catching_up
        self._on_caught_up = on_caught_up
        # With TLS, every call first checks the certificate the peer presents.
        self._peers = {
            region: _Peer(stats, tuning, PeerCheck(stats, tls) if tls is not None else None)
            for region, stats in peers.items()
        }
        self._tasks: list[asyncio.Task[None]] = []
        self.rounds = 0

    # -- lifecycle ---------------------------------------------------------------

    def start(self) -> None:
        self.replica.on_local_write(self._enqueue)
        for peer in self._peers.values():
            self._tasks.append(asyncio.create_task(self._push_loop(peer)))
        if self._peers:
            self._tasks.append(asyncio.create_task(self._anti_entropy_loop()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for peer in self._peers.values():
            await peer.channel.close(None)

    def backlog(self, region: str) -> int:
        return len(self._peers[region].backlog)

    def peer_stats(self, region: str) -> PeerStats:
        return self._peers[region].stats

    def peer_check(self, region: str) -> PeerCheck | None:
        """The check of the certificate ``region``'s address presents (None without TLS)."""
        return self._peers[region].check

    def unreachable(self, region: str) -> bool:
        """Whether no call has reached ``region``'s node for a while: its push queue is
        dropped and nothing is queued for it until it is reached again."""
        return self._peers[region].unreachable()

    async def sync_with(self, region: str) -> RoundResult:
        """One anti-entropy round with ``region``'s node now, outside the schedule
        (``fencemark bench`` measures what one round costs)."""
        return await self.sync_round(self._peers[region])

    # -- calls ---------------------------------------------------------------------

    def _origin(self) -> replication_pb2.Origin:
        r = self.replica
        return replication_pb2.Origin(region=r.region, node_id=r.node_id, hlc=r.clock.now())

    async def _call(self, peer: _Peer, method: str, request: Message, reply: type[R]) -> R:
        """One RPC with a deadline, counting the bytes both ways."""
        await peer.allowed()  # raises PeerRefused: nothing sent to a revoked peer
        peer.stats.bytes_sent += request.ByteSize()
        response = await getattr(peer.stub, method)(request, timeout=self.timeout)
        assert isinstance(response, reply)
        peer.stats.bytes_received += response.ByteSize()
        return response

    async def _push(self, peer: _Peer, states: Sequence[bytes]) -> None:
        """Push states in batches bounded by count and bytes."""
        batch: list[bytes] = []
        size = 0
        for state in [*states, None]:
            if batch and (
                state is None or len(batch) == MAX_STATES or size + len(state) > MAX_BATCH_BYTES
            ):
                request = replication_pb2.PushRequest(origin=self._origin(), states=batch)
                await self._call(peer, "Push", request, replication_pb2.PushResponse)
                peer.stats.records_sent += len(batch)
                batch, size = [], 0
            if state is not None:
                batch.append(state)
                size += len(state)

    # -- eager push ------------------------------------------------------------------

    def _enqueue(self, key: str) -> None:
        for peer in self._peers.values():
            if not peer.pushes_allowed() or peer.unreachable():
                continue
            if key in peer.backlog or len(peer.backlog) < self.tuning.push_queue_limit:
                peer.backlog[key] = None
                peer.wake.set()

    def heard_from(self, region: str) -> None:
        """``region``'s node just called this one: it is up, so a back-off from its
        earlier failures is over — push and sync with it now, not seconds later —
        and writes are queued for it again."""
        peer = self._peers.get(region)
        if peer is None:
            return
        if peer.unreachable():
            peer.unanswered = 0  # reachable again; its own call proved it
        if peer.retry_at > time.monotonic():
            peer.retry_at = 0.0
            peer.wake.set()

    def pulled_by(self, region: str, keys: list[str]) -> None:
        """``region``'s node just fetched the current states of ``keys`` from this one:
        pushing them too would deliver them twice (after a partition heals, the
        peer's own round and this node's kept queue both reach for them)."""
        peer = self._peers.get(region)
        if peer is not None:
            for key in keys:
                peer.backlog.pop(key, None)
            if peer.pushing:
                peer.fetched.update(keys)

    async def _push_loop(self, peer: _Peer) -> None:
        while True:
            await peer.wake.wait()
            peer.wake.clear()
            while peer.backlog and peer.pushes_allowed():
                pause = peer.retry_at - time.monotonic()
                if pause > 0:
                    # Backed off; heard_from() (the peer called in) ends it early.
                    peer.wake.clear()
                    # Not wait_for: on Python 3.11 it can swallow a cancellation that
                    # arrives with the wake-up, and stop() would wait for this loop forever.
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(pause):
                            await peer.wake.wait()
                    continue
                # Take the keys out before reading their states: a write landing
                # while this batch is in flight puts its key back for the next one.
                keys = list(itertools.islice(peer.backlog, MAX_STATES))
                for key in keys:
                    del peer.backlog[key]
                peer.pushing, peer.fetched = True, set()
                try:
                    states = await self.storage.states(keys)
                    fresh = [k for k in keys if k in states and k not in peer.fetched]
                    for key in fresh:
                        if len(states[key]) > MAX_RECORD_BYTES:
                            # The peer would refuse it, and it may not fit a message:
                            # left out, so it cannot hold up the others.
                            too_large(peer.stats, peer.stats.region, key, len(states[key]))
                    fresh = [k for k in fresh if len(states[k]) <= MAX_RECORD_BYTES]
                    if not fresh:
                        continue  # fetched meanwhile, or gone: no call, nothing learned
                    await self._push(peer, [states[k] for k in fresh])
                except grpc.aio.AioRpcError as exc:
                    peer.requeue(keys)
                    if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                        peer.refuses_pushes()  # a read-only peer: it pulls instead
                    elif exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                        peer.stats.skew_alarms += 1  # the peer refused our clock
                    peer.back_off(f"push: {exc.code().name}: {exc.details()}", exc.code())
                    continue
                except Exception as exc:  # a local fault: keep the keys, never end the loop
                    log.exception("push to %s failed", peer.stats.region)
                    peer.requeue(keys)
                    peer.back_off(f"push failed: {exc!r}")
                    continue
                finally:
                    peer.pushing = False
                peer.answered()

    # -- anti-entropy ----------------------------------------------------------------

    async def _anti_entropy_loop(self) -> None:
        synced: set[str] = set()  # while catching up: peers that gave a complete round
        while True:
            now = time.monotonic()
            ready = [p for p in self._peers.values() if max(p.retry_at, p.behind_until) <= now]
            owed = self.catching_up and len(synced) < len(self._peers)
            pending = [p for p in ready if p.stats.region not in synced]
            if owed and pending:
                ready = pending  # the peers still owed a complete round go first
            result = None
            if ready:
                peer = random.choice(ready)
                result = await self._guarded_round(peer)
                if self.catching_up and result is not None and result.complete:
                    synced.add(peer.stats.region)
                    if synced == set(self._peers):
                        await self._caught_up(synced)
            # Hurry only while pulling: a round that pulled nothing, even a truncated
            # one, found a peer that is behind, and that peer pulls in its own rounds.
            busy = result is not None and result.pulled > 0
            if owed:
                busy = True  # nothing is decided here until every peer gave a round
            await asyncio.sleep(0.02 if busy else self.interval * random.uniform(0.5, 1.5))

    async def _caught_up(self, synced: set[str]) -> None:
        """Every peer has given one complete round: this node has seen every grant its
        peers hold (fencemark.node.core.grant_gate). A peer that stays unreachable keeps
        the node from deciding; removing it from ``--peer`` is the operator's way to
        say it is gone for good (docs/operations.md, *A node that lost its disk*)."""
        self.catching_up = False
        log.info("caught up with %s; deciding claims", ", ".join(sorted(synced)))
        if self._on_caught_up is not None:
            await self._on_caught_up()

    async def _guarded_round(self, peer: _Peer) -> RoundResult | None:
        try:
            result = await self.sync_round(peer)
        except ClockSkewed as exc:
            peer.stats.skew_alarms += 1
            peer.back_off(str(exc))
            log.warning("anti-entropy with %s: %s", peer.stats.region, exc)
            return None
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                peer.stats.skew_alarms += 1  # the peer refused our clock
            peer.back_off(f"{exc.code().name}: {exc.details()}", exc.code())
            return None
        except Exception as exc:  # a malformed reply, a local fault: never end the loop
            log.exception("anti-entropy with %s failed", peer.stats.region)
            peer.back_off(f"round failed: {exc!r}")
            return None
        peer.answered()
        peer.stats.last_sync = time.time()
        peer.stats.divergence = result.divergence
        if not result.in_sync and result.pulled == 0:
            # Everything that differs is the peer's to pull: leave it to its own
            # rounds for a while instead of descending into it again and again.
            peer.behind_until = time.monotonic() + self.tuning.behind_pause_s
        return result

    async def sync_round(self, peer: _Peer) -> RoundResult:
        """One bounded anti-entropy round with ``peer``: this node pulls what differs."""
        self.rounds += 1
        tree = self.storage.tree
        listed: dict[int, list[tuple[int, int]]] = {}  # level -> [(node, peer's count)]
        records = only_mine = 0  # the peer's records below listed nodes; ours below
        truncated = False
        request = replication_pb2.TreeRequest(origin=self._origin(), level=0)
        response = await self._call(peer, "Tree", request, replication_pb2.TreeResponse)
        if response.hashes == tree.root:
            return RoundResult(in_sync=True)
        frontier = [0]  # differing nodes to descend into; the root has no count
        salt = os.urandom(SALT_BYTES)  # a check two nodes share by chance, once
        for level in range(1, DEPTH + 1):
            nodes, checks, counts = await self._tree(peer, level, frontier, salt)
            frontier = []
            differ = [
                i
                for i, node in enumerate(nodes)
                if checks[i * CHECK_BYTES : (i + 1) * CHECK_BYTES] != tree.check(level, node, salt)
            ]
            same = 1 - _differing_share(len(differ), len(nodes), sum(counts))
            for i in differ:
                node, theirs = nodes[i], counts[i]
                if theirs == 0:  # the peer has nothing here: it pulls ours
                    only_mine += tree.count(level, node)
                elif level < DEPTH and theirs * same * ENTRY_BYTES > FANOUT * CHILD_BYTES:
                    frontier.append(node)
                elif records + theirs <= self.tuning.max_round_records:
                    listed.setdefault(level, []).append((node, theirs))
                    records += theirs
                else:
                    truncated = True
            if len(frontier) > self.tuning.max_frontier:
                sample = random.sample(frontier, self.tuning.max_frontier)
                frontier, truncated = sorted(sample), True
            if not frontier:
                break
        result = await self._repair(peer, listed, truncated)
        result.divergence += only_mine
        return result

    async def _tree(
        self, peer: _Peer, level: int, parents: list[int], salt: bytes
    ) -> tuple[list[int], bytes, list[int]]:
        """The nodes at ``level`` (>= 1) below ``parents``, with the peer's check
        values for ``salt`` (concatenated) and record counts for them."""
        nodes: list[int] = []
        checks: list[bytes] = []
        counts: list[int] = []
        for start in range(0, len(parents), MAX_TREE_PARENTS):
            chunk = parents[start : start + MAX_TREE_PARENTS]
            request = replication_pb2.TreeRequest(
                origin=self._origin(), level=level, parents=chunk, salt=salt
            )
            response = await self._call(peer, "Tree", request, replication_pb2.TreeResponse)
            nodes.extend(c for p in chunk for c in children(level - 1, p))
            checks.append(response.hashes)
            counts.extend(response.counts)
        if len(counts) != len(nodes) or sum(map(len, checks)) != len(nodes) * CHECK_BYTES:
            raise ValueError(f"a Tree reply for {len(nodes)} nodes at level {level} is malformed")
        return nodes, b"".join(checks), counts

    async def _repair(
        self, peer: _Peer, listed: dict[int, list[tuple[int, int]]], truncated: bool
    ) -> RoundResult:
        """List the records below ``listed`` nodes on both sides, a chunk at a time,
        and pull what differs. Once ``Tuning.behind_after`` differences have turned out to
        be all the peer's to pull, the rest is not listed: the peer is behind."""
        pulled = differing = 0
        chunks = [(level, chunk) for level, nodes in listed.items()
                  for chunk in _listing_chunks(nodes, self.tuning.first_listing)]  # fmt: skip
        for n, (level, nodes) in enumerate(chunks):
            pull, found = await self._compare(peer, level, nodes)
            differing += found
            pulled += await self._pull(peer, pull)
            behind = not pulled and differing >= self.tuning.behind_after and not self.catching_up
            if behind and n + 1 < len(chunks):
                truncated = True
                break
        return RoundResult(False, pulled, differing, truncated)

    async def _compare(
        self, peer: _Peer, level: int, nodes: list[int]
    ) -> tuple[dict[str, tuple[bytes, bytes]], int]:
        """The keys to pull below ``nodes``, each with the peer's digest and ours (b""
        for a record this node lacks), and how many records differ there."""
        listing = replication_pb2.BucketsRequest(origin=self._origin(), level=level, nodes=nodes)
        entries = await self._call(peer, "Buckets", listing, replication_pb2.BucketsResponse)
        theirs = {e.key: (e.digest, e.max_hlc) for e in entries.entries}
        spans = [leaf_range(level, node) for node in nodes]
        mine = {key: (digest, hlc) for key, digest, hlc in await self.storage.bucket_entries(spans)}
        changed = [k for k, (digest, _) in theirs.items() if mine.get(k, (b"",))[0] != digest]
        only_mine = len(mine.keys() - theirs.keys())
        # Skip states whose largest HLC is below ours: typically an older version
        # of ours. Should one hold something ours lacks, the peer pulls ours (its
        # HLC is larger) and the next comparison fetches the join; a node catching
        # up after disk loss takes everything (docs/replication.md, step 4).
        pull = {
            k: (theirs[k][0], mine.get(k, (b"",))[0])
            for k in changed
            if self.catching_up or k not in mine or theirs[k][1] >= mine[k][1]
        }
        # A state refused against ours is not fetched again until either changes:
        # the merge would be refused again (SPEC §2), round after round. A node
        # catching up counts such a state as seen (it judged it), but asks again at
        # once for one whose signer it did not know: it may learn it now.
        catching_up = self.catching_up
        for key, (their_digest, our_digest) in list(pull.items()):
            if peer.stats.refused_before(key, their_digest, our_digest, catching_up=catching_up):
                del pull[key]
        return pull, len(changed) + only_mine

    async def _pull(self, peer: _Peer, wanted: Mapping[str, tuple[bytes, bytes]]) -> int:
        """Fetch and merge the states of ``wanted`` (key -> the peer's digest and ours);
        returns how many arrived."""
        pulled = 0
        pull = list(wanted)
        # The next batch is fetched while this one merges: the peer reads while we write.
        fetching = self._fetch(peer, pull[:MAX_STATES]) if pull else None
        try:
            while fetching is not None:
                found = await fetching
                pull = [*found.truncated, *pull[MAX_STATES:]]
                fetching = self._fetch(peer, pull[:MAX_STATES]) if pull else None
                for key in found.oversized:  # never sent: the round goes on without it
                    self._oversized(peer, key, wanted.get(key, (b"", b"")))
                states = list(found.states)
                records = decode_states(states)
                peer.stats.records_received += await merge_all(
                    self.replica, peer.stats.region, records, peer.stats, states=states
                )
                pulled += len(records)
        finally:
            if fetching is not None:  # the round failed: drop the fetch ahead, quietly
                fetching.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await fetching
        return pulled

    @staticmethod
    def _oversized(peer: _Peer, key: str, digests: tuple[bytes, bytes]) -> None:
        """The peer holds a state of ``key`` over the record size limit and did not send
        it: refused like a state over the limit, and not asked for again until it changes."""
        refusal = MergeRefused(
            key, OVER_LIMIT, f"the peer's state is over {MAX_RECORD_BYTES} bytes; not transferred"
        )
        if peer.stats.refused_state(key, OVER_LIMIT, str(refusal), digests):
            log.warning("refused a state from %s: %s", peer.stats.region, refusal)

    def _fetch(self, peer: _Peer, keys: list[str]) -> asyncio.Task[replication_pb2.FetchResponse]:
        request = replication_pb2.FetchRequest(origin=self._origin(), keys=keys)
        return asyncio.create_task(
            self._call(peer, "Fetch", request, replication_pb2.FetchResponse)
        )


def _listing_chunks(nodes: list[tuple[int, int]], first: int) -> list[list[int]]:
    """``(node, count)`` pairs split into Buckets requests the peer accepts: at
    most ``MAX_LIST_NODES`` nodes, and half ``MAX_LIST_RECORDS`` by the peer's
    counts (they may have grown since its Tree reply) — the first one smaller,
    ``first`` records, as it may be the only one (``Tuning.behind_after``)."""
    chunks: list[list[int]] = [[]]
    records, limit = 0, first
    for node, count in nodes:
        if chunks[-1] and (len(chunks[-1]) == MAX_LIST_NODES or records + count > limit):
            chunks.append([])
            records, limit = 0, MAX_LIST_RECORDS // 2
        chunks[-1].append(node)
        records += count
    return chunks


def _differing_share(differing: int, nodes: int, records: int) -> float:
    """The share of records that differ, estimated from ``differing`` of ``nodes``
    tree nodes holding ``records`` in all: were each record to differ with
    probability p, a node of n records would differ with probability 1 - (1-p)^n."""
    if not records:
        return 1.0
    seen = differing / (nodes + 1)  # +1: all nodes differing still bounds p
    return min(1.0, -math.log1p(-seen) / (records / nodes))

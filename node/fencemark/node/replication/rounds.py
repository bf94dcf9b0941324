"""Anti-entropy rounds: compare digest-tree roots with a peer, descend level by
level into differing nodes (salted check values, a bounded frontier) until listing
a node's records costs less than its children, list them a chunk at a time, and
pull and merge what differs (docs/replication.md, *Anti-entropy*)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

import grpc
from google.protobuf.message import Message

from fencemark.node.core.replica import Replica
from fencemark.node.replication.intake import (
    MAX_LIST_NODES,
    MAX_LIST_RECORDS,
    MAX_STATES,
    MAX_TREE_PARENTS,
    decode_states,
    merge_all,
)
from fencemark.node.replication.link import PeerLeft, PeerLink
from fencemark.node.replication.peers import origin
from fencemark.node.replication.tuning import CHILD_BYTES, ENTRY_BYTES, SALT_BYTES, Tuning
from fencemark.node.rules.integrity import MergeRefused
from fencemark.node.rules.validation import MAX_RECORD_BYTES, OVER_LIMIT
from fencemark.node.store.digest_tree import CHECK_BYTES, DEPTH, FANOUT, children, leaf_range
from fencemark.node.store.storage import Storage
from fencemark.v1 import replication_pb2

log = logging.getLogger(__name__)
R = TypeVar("R", bound=Message)


@dataclass
class RoundResult:
    in_sync: bool
    pulled: int = 0
    divergence: int = 0  # keys whose digests differed in the compared buckets
    truncated: bool = False
    peer_owed: bool = False  # the peer owed a catch-up: it may lack what it acknowledged
    whole: bool = False  # every differing state was pulled, whatever its HLC
    unsettled: int = 0  # pulled states refused for a reason that may lift (unknown signer)

    @property
    def complete(self) -> bool:
        """This node now has everything the peer had when the round ran: the digests
        agreed, or nothing was left unlisted and either every differing state was
        pulled and merged or judged for good (``whole``), or none needed to be."""
        if self.in_sync:
            return True
        return not self.truncated and not self.unsettled and (self.whole or self.pulled == 0)


class Rounds:
    """Rounds and the calls they make. The base of ``Replicator``, which owns the
    peers, the loops and the attributes declared here."""

    replica: Replica
    storage: Storage
    tuning: Tuning
    catching_up: bool
    rounds: int
    timeout: float  # seconds: the deadline of every call

    @property
    def member(self) -> str:
        """This node's name among its region's members; "" for its only node."""
        return self.replica.member

    def _origin(self) -> replication_pb2.Origin:
        return origin(self.replica)

    async def _call(self, peer: PeerLink, method: str, request: Message, reply: type[R]) -> R:
        """One RPC with a deadline, counting the bytes both ways."""
        started = peer.last_called = time.monotonic()
        await peer.allowed()  # raises PeerRefused: nothing sent to a revoked peer
        peer.stats.bytes_sent += request.ByteSize()
        try:
            response = await getattr(peer.stub, method)(request, timeout=self.timeout)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise  # this task was cancelled: a node stopping, a caller gone
            peer.first_answered = None  # as for a call unanswered
            raise PeerLeft(f"{peer.stats.name}: its channel was closed during {method}") from None
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                # Down or restarting: it may not remember hearing this life at all.
                # Unanswered within the deadline (paused, a hung link): it may answer
                # this call and later ones in any order once it runs again, before
                # it has heard a twin of this life — the settle starts over.
                peer.first_answered = None
            raise
        assert isinstance(response, reply)
        peer.answered_at = time.monotonic()
        peer.stats.bytes_received += response.ByteSize()
        if peer.first_answered is None and started >= peer.settle_after:
            peer.first_answered = started  # the peer has heard this life since then
        return response

    async def sync_round(self, peer: PeerLink, *, whole: bool = False) -> RoundResult:
        """One bounded anti-entropy round with ``peer``: this node pulls what differs.

        A routine round skips a state whose largest HLC is below ours (``_compare``)
        and stops listing a peer found behind (``_repair``). ``whole`` does neither:
        it pulls every state that differs, so that, once complete, this node holds
        everything the peer held when the round began — what a node catching up,
        or a new decider's catch-up with a majority, relies on. A state older by
        the clock may still hold what ours lacks: a grant acknowledged by the
        peer, while ours took a later unfenced write without it."""
        whole = whole or self.catching_up
        self.rounds += 1
        tree = self.storage.tree
        listed: dict[int, list[tuple[int, int]]] = {}  # level -> [(node, peer's count)]
        records = only_mine = 0  # the peer's records below listed nodes; ours below
        truncated = False
        request = replication_pb2.TreeRequest(origin=self._origin(), level=0)
        response = await self._call(peer, "Tree", request, replication_pb2.TreeResponse)
        owed = response.owed
        if response.hashes == tree.root:
            return RoundResult(in_sync=True, peer_owed=owed)
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
        result = await self._repair(peer, listed, truncated, whole=whole)
        result.divergence += only_mine
        result.peer_owed = owed
        return result

    async def _tree(
        self, peer: PeerLink, level: int, parents: list[int], salt: bytes
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
        self,
        peer: PeerLink,
        listed: dict[int, list[tuple[int, int]]],
        truncated: bool,
        *,
        whole: bool,
    ) -> RoundResult:
        """List the records below ``listed`` nodes on both sides, a chunk at a time,
        and pull what differs. Once ``Tuning.behind_after`` differences have turned out to
        be all the peer's to pull, the rest is not listed — the peer is behind —
        unless the round is ``whole``."""
        pulled = differing = unsettled = 0
        chunks = [(level, chunk) for level, nodes in listed.items()
                  for chunk in _listing_chunks(nodes, self.tuning.first_listing)]  # fmt: skip
        for n, (level, nodes) in enumerate(chunks):
            pull, found = await self._compare(peer, level, nodes, whole=whole)
            differing += found
            since = time.monotonic()
            pulled += await self._pull(peer, pull)
            unsettled += peer.stats.refused_to_retry(pull, since)
            behind = not pulled and differing >= self.tuning.behind_after and not whole
            if behind and n + 1 < len(chunks):
                truncated = True
                break
        return RoundResult(False, pulled, differing, truncated, whole=whole, unsettled=unsettled)

    async def _compare(
        self, peer: PeerLink, level: int, nodes: list[int], *, whole: bool
    ) -> tuple[dict[str, tuple[bytes, bytes]], int]:
        """The keys to pull below ``nodes``, each with the peer's digest and ours (b""
        for a record this node lacks), and how many records differ there; ``whole``:
        every key that differs (``sync_round``)."""
        listing = replication_pb2.BucketsRequest(origin=self._origin(), level=level, nodes=nodes)
        entries = await self._call(peer, "Buckets", listing, replication_pb2.BucketsResponse)
        theirs = {e.key: (e.digest, e.max_hlc) for e in entries.entries}
        spans = [leaf_range(level, node) for node in nodes]
        mine = {key: (digest, hlc) for key, digest, hlc in await self.storage.bucket_entries(spans)}
        changed = [k for k, (digest, _) in theirs.items() if mine.get(k, (b"",))[0] != digest]
        only_mine = len(mine.keys() - theirs.keys())
        # Skip states whose largest HLC is below ours: typically an older version
        # of ours. Should one hold something ours lacks, the peer pulls ours (its
        # HLC is larger) and the next comparison fetches the join; a whole round
        # (a catch-up) takes everything (docs/replication.md, step 4).
        pull = {
            k: (theirs[k][0], mine.get(k, (b"",))[0])
            for k in changed
            if whole or k not in mine or theirs[k][1] >= mine[k][1]
        }
        # A state refused against ours is not fetched again until either changes:
        # the merge would be refused again (SPEC §2), round after round. A whole
        # round counts such a state as seen (it judged it), but asks again at
        # once for one whose signer it did not know: it may learn it now.
        for key, (their_digest, our_digest) in list(pull.items()):
            if peer.stats.refused_before(key, their_digest, our_digest, catching_up=whole):
                del pull[key]
        return pull, len(changed) + only_mine

    async def _pull(self, peer: PeerLink, wanted: Mapping[str, tuple[bytes, bytes]]) -> int:
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
                pulled += await self.merge_fetched(peer, list(found.states))
        finally:
            if fetching is not None:  # the round failed: drop the fetch ahead, quietly
                fetching.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await fetching
        return pulled

    async def fetch_now(self, peer: PeerLink, keys: list[str]) -> replication_pb2.FetchResponse:
        """The states of ``keys`` (at most ``MAX_STATES``) that ``peer`` holds, fetched
        now; merge them with ``merge_fetched``."""
        request = replication_pb2.FetchRequest(origin=self._origin(), keys=keys)
        return await self._call(peer, "Fetch", request, replication_pb2.FetchResponse)

    async def merge_fetched(self, peer: PeerLink, states: list[bytes]) -> int:
        """Merge ``states`` that ``peer`` sent (``fetch_now``); returns how many arrived."""
        records = decode_states(states)
        # Merged first, counted after: ``count += await ...`` would read the count
        # before the merge and lose a push's counted meanwhile.
        merged, _ = await merge_all(
            self.replica, peer.stats.name, records, peer.stats, states=states
        )
        peer.stats.records_received += merged
        return len(records)

    @staticmethod
    def _oversized(peer: PeerLink, key: str, digests: tuple[bytes, bytes]) -> None:
        """The peer holds a state of ``key`` over the record size limit and did not send
        it: refused like a state over the limit, and not asked for again until it changes."""
        refusal = MergeRefused(
            key, OVER_LIMIT, f"the peer's state is over {MAX_RECORD_BYTES} bytes; not transferred"
        )
        if peer.stats.refused_state(key, OVER_LIMIT, str(refusal), digests):
            log.warning("refused a state from %s: %s", peer.stats.name, refusal)

    def _fetch(
        self, peer: PeerLink, keys: list[str]
    ) -> asyncio.Task[replication_pb2.FetchResponse]:
        return asyncio.create_task(self.fetch_now(peer, keys))


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

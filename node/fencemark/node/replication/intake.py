"""What a node does with the states a peer sends it, whoever received them (the
``Replication`` servicer for a push, the replicator for what it fetched): the clock
check, the limits of a client write, decoding, and the merge (SPEC §2, §3, §5).
Free of gRPC: refusals are the node's errors, which the servicer maps to statuses.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from fencemark.node.core import history
from fencemark.node.core.replica import Replica
from fencemark.node.crdt import ClockSkew, Record, codec
from fencemark.node.replication.peers import MAX_REFUSED_KEYS, PeerStats
from fencemark.node.replication.signers import learn_signers
from fencemark.node.rules import validation
from fencemark.node.rules.errors import ClockSkewed, InvalidInput
from fencemark.node.rules.integrity import MergeRefused
from fencemark.node.store.events import Event
from fencemark.v1 import records_pb2, replication_pb2

log = logging.getLogger(__name__)

MAX_STATES = 512
MAX_BATCH_BYTES = 6 << 20
MAX_TREE_PARENTS = 256  # a Tree reply covers 16 children of each: 4096 nodes
MAX_LIST_NODES = 1024  # tree nodes per Buckets request ...
MAX_LIST_RECORDS = 16384  # ... and records they may hold
MAX_EVENTS_PER_STATE = 16  # claim events one state's commit can carry (PushRequest.events)
MAX_EVENT_TEXT = 1024  # characters of an event's owner, identity, detail or actor
KINDS = frozenset(history.KINDS)


def check_clock(replica: Replica, region: str, hlcs: list[int]) -> None:
    """Refuse (``ClockSkewed``) if any timestamp is beyond max_clock_offset ahead."""
    try:
        for hlc in hlcs:
            replica.check_clock(hlc)
    except ClockSkew as skew:
        raise ClockSkewed(region, skew.remote_ms - skew.local_ms, skew.max_offset_ms) from skew


def decode_states(states: list[bytes], field: str = "states") -> list[Record]:
    records = []
    for index, state in enumerate(states):
        try:
            records.append(codec.decode(state))
        except codec.DecodeError as exc:
            raise InvalidInput.field(f"{field}[{index}]", f"not a record state: {exc}") from exc
    return records


def claim_event(event: Event) -> records_pb2.ClaimEvent:
    """``event`` as ``Records.History`` shows it, and as a push carries it."""
    message = records_pb2.ClaimEvent(
        kind=event.kind, fencing_token=event.token, owner=event.owner,
        identity=event.identity, detail=event.detail, actor=event.actor,
    )  # fmt: skip
    if event.at_ms > 0:
        message.at.FromMilliseconds(event.at_ms)
    return message


def decided_event(index: int, event: Event) -> replication_pb2.DecidedEvent:
    """``event``, decided with the state at ``index`` of a push, as it travels."""
    return replication_pb2.DecidedEvent(state=index, event=claim_event(event))


def learnt_events(sent: Sequence[replication_pb2.DecidedEvent], states: int) -> list[list[Event]]:
    """Each of a push's ``states`` claim events, as its sender decided them; refused
    (``InvalidInput`` naming the field) unless each names a state of the push, a known
    kind and short texts, at most ``MAX_EVENTS_PER_STATE`` a state."""
    learnt: list[list[Event]] = [[] for _ in range(states)]
    for n, decided in enumerate(sent):
        field, event = f"events[{n}]", decided.event
        if decided.state >= states:
            raise InvalidInput.field(f"{field}.state", f"names state {decided.state} of {states}")
        if event.kind not in KINDS:
            raise InvalidInput.field(
                f"{field}.event.kind", f"not a claim event: {event.kind[:40]!r}"
            )
        texts = (event.owner, event.identity, event.detail, event.actor)
        if any(len(text) > MAX_EVENT_TEXT for text in texts):
            raise InvalidInput.field(f"{field}.event", f"a text over {MAX_EVENT_TEXT} characters")
        own = learnt[decided.state]
        if len(own) == MAX_EVENTS_PER_STATE:
            raise InvalidInput.field(field, f"over {MAX_EVENTS_PER_STATE} events for one state")
        at_ms = event.at.ToMilliseconds() if event.HasField("at") else 0
        own.append(Event(at_ms, event.kind, event.fencing_token, *texts))
    return learnt


async def merge_all(
    replica: Replica,
    sender: str,
    records: list[Record],
    peer: PeerStats | None = None,
    *,
    states: Sequence[bytes] | None = None,
    events: Sequence[Sequence[Event]] = (),
) -> tuple[int, int]:
    """Merge states sent by peer ``sender`` (its name: ``peers.peer_name``), after
    the clock check; returns how many changed a record, and how many were refused.

    ``states`` are the records' canonical encodings, as received (a record that
    the merge leaves equal to the received one is stored as is, not encoded
    again). A state that breaks the limits of a client write, alone or merged
    with this node's (``over_limit``, ``validation.state``), or the integrity
    rules (``fencemark.node.rules.integrity``), is not merged; the others are. Each
    refusal is counted against the sending ``peer``, and logged once per key; so is
    a birth the merge holds void (``seen_before_birth``), though its state merged.
    """
    check_clock(replica, sender, [r.max_hlc() for r in records])
    encoded = list(states) if states is not None else [codec.encode(r) for r in records]
    refused: dict[int, MergeRefused] = {}
    for index, (record, state) in enumerate(zip(records, encoded, strict=True)):
        problem = validation.state_problem(record, len(state))
        if problem is not None:  # refused before it costs a lock, a read or a signer
            key = record.key[:400]  # a valid key is shorter; an invalid one is only named
            refused[index] = MergeRefused(key, validation.OVER_LIMIT, f"the state sent: {problem}")
    merging = [i for i in range(len(records)) if i not in refused]
    if peer is not None and replica.keyring is not None:
        await learn_signers(replica, peer, [records[i] for i in merging])
    await replica.preload([records[i].key for i in merging])  # one read, not one each
    # Concurrent merges of different records share group commits. A record sent more
    # than once (a member's batched push carries each commit's state) is merged in the
    # order sent, each state with its claim events: the later state holds the earlier,
    # and merged first it would leave the earlier one's events nothing to change.
    voided: list[MergeRefused] = []  # births void by a sighting: merged, and reported
    in_order: dict[str, list[int]] = {}
    for i in merging:
        in_order.setdefault(records[i].key, []).append(i)
    outcome: dict[int, bool | BaseException] = {}

    async def merge_in_order(indices: list[int]) -> None:
        for i in indices:
            try:
                outcome[i] = await replica.merge(
                    records[i], encoded[i], sender=sender, voided=voided,
                    learnt=events[i] if i < len(events) else (),
                )  # fmt: skip
            except Exception as exc:
                outcome[i] = exc

    await asyncio.gather(*(merge_in_order(indices) for indices in in_order.values()))
    results = [outcome[i] for i in merging]
    changed = 0
    for index, result in zip(merging, results, strict=True):
        if isinstance(result, MergeRefused):
            refused[index] = result
        elif isinstance(result, BaseException):
            raise result
        else:
            changed += result
    for index, refusal in sorted(refused.items()):
        await _refused(replica, sender, peer, refusal, encoded[index])
    by_key = {record.key: state for record, state in zip(records, encoded, strict=True)}
    for refusal in voided:
        await _refused(replica, sender, peer, refusal, by_key.get(refusal.key, b""))
    return changed, len(refused)


async def _refused(
    replica: Replica, region: str, peer: PeerStats | None, refusal: MergeRefused, state: bytes
) -> None:
    """Count and log a refused state; its key is logged once per peer and reason."""
    news = True
    if peer is not None:
        stored = await replica.find(refusal.key)
        ours = stored.digest if stored is not None else b""
        news = peer.refused_state(
            refusal.key, refusal.reason, str(refusal), (codec.digest(state), ours)
        )
    log.log(
        logging.WARNING if news else logging.DEBUG,
        "refused a state from %s: %s",
        region or "?",
        refusal,
    )


def too_large(peer: PeerStats | None, region: str, key: str, size: int) -> None:
    """Count (and log, once per key) a state of this node's not sent to ``region``:
    over the record size limit, which only a record stored before merges were
    limited can be. Deleting the record (or clearing fields) replicates again."""
    if peer is not None:
        peer.states_too_large += 1
        if key in peer.too_large_keys:
            return
        peer.too_large_keys[key] = None
        while len(peer.too_large_keys) > MAX_REFUSED_KEYS:
            del peer.too_large_keys[next(iter(peer.too_large_keys))]
    log.warning(
        "not sending %s to %s: its state is %d bytes, over the record size limit (%d);"
        " delete the record, or clear fields, to replicate it again",
        key, region or "?", size, validation.MAX_RECORD_BYTES,
    )  # fmt: skip

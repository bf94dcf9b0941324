"""The hostile peer: forged states pushed to a node during a run (issue 14).

A ``forge`` fault holds the node certificate and key of one region (a configured
peer's node gone bad, or its stolen key) and pushes, through ``Replication.Push``
with that region as ``origin.region``, to another region's node, forgeries of
records that node is the home of. Each forgery is named, and :data:`RULES` says
which refusal reason (docs/security.md, *State integrity*) must refuse it:

- what the integrity bounds refuse: a grant far above the fence (``token_jump``), a
  grant by a region that did not create the record (``grant_outside_home``), a
  release of a token nobody granted (``orphan_token``), a write at an epoch above
  the fence (``epoch_beyond_fence``), 300 fields (``over_limit``), a lease two hours
  out (``lease_too_long``);
- what only signatures refuse: a birth claimed for the third region, earlier than
  the home's, unsigned (``unsigned_birth``) and signed with the posing region's own
  key (``signer_not_home``); a grant naming the home within the token bound
  (``unsigned_grant``; signed with the posing key: ``signer_not_home``); issue 14's
  hole 8, a tombstone and a field write stamped at the live claim's epoch with a
  later clock and the home's node id (``unsigned_write``; signed with the posing
  key: ``signer_not_home``); a forged release or lapse of the live claim's token,
  then a write at its epoch (``unsigned_end``; a release sealed with the posing key:
  ``signer_not_home``); the live claim's lease lengthened within the hour bound
  (``unsigned_lease``; sealed with the posing key: ``signer_not_home``); a move of
  the fence past the live claim, then a write at the new epoch (``unsigned_move``;
  signed with the posing key: ``signer_not_home``);
  the work queue's state written by the peer — an item marked done, or reopened
  (``unsigned_write``; signed with the posing key: ``signer_not_home``).

The forgeries that need a live claim are pushed against a claim the fault holds
itself, through an honest holder (``forge-holder-<region>``, a client identity of
its own): it creates a record at the victim's home, claims it with a lease that
outlasts the pushes, writes under its token, lets the forger push, then writes
again and releases — each step in the history, so the other invariants judge it
(a forged tombstone or end that got through would show there too). No other
worker touches that record (its topic is apart from the backlog), so the claim is
unreleased for every push, and the rule applies: a forgery of an ended claim
would be a write anyone may make. The integrity and birth forgeries are pushed
against a few records the agents claimed as well.

One forgery is kept, not refused (:data:`KEPT`): a birth of the posing region's
own, back-dated before the home's and signed with its own key, of a record that
region had seen — its node held a claim on it and said so (``Record.seen``). The
node merges it as evidence and reports it ``seen_before_birth``; the forger then
reads the record back and checks that its home did not move. It is pushed only
against records the victim holds the posing region's sighting of (for the held
record the forger waits for it).

Each state is pushed on its own, so each answer says whether that one was merged,
and after each the node's ``Info`` says why it refused it (the refusal counted
against the posing region, ``last_refusal``). The invariant (checker.py, 11):
none is merged (but the kept kind, whose home must stay), each is refused by its
rule, and every kind is pushed at least once in a run — while the workload's
claims and writes go on around them, and every other invariant still holds. What
signatures cannot refuse (a back-dated birth of the posing region's own, of a
record it has not seen) is documented in docs/security.md and not pushed: it
would be merged.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import grpc

from fencemark.client import AsyncClient, ClaimResult, FencemarkError, NodeInfo
from fencemark.node.crdt import Birth, Grant, Record, Stamp, codec
from fencemark.node.crdt.hlc import wall_clock_ms
from fencemark.node.rules.admission import token_ceiling
from fencemark.node.rules.integrity import DEFAULT_MAX_TOKEN_JUMP
from fencemark.node.security.signing import Signer
from fencemark.node.security.tls import TlsFiles
from fencemark.node.tools.workload import REPO, TOPIC, Event, grant_of, recorded
from fencemark.v1 import replication_pb2, replication_pb2_grpc
from tests.chaos.workload import Workload, detail_of, outcome_of

PER_FAULT = 3  # records forged against per fault: the held one, and agents' claims
HOUR_MS = 3_600_000
FORGE_TOPIC = "forge"  # the holders' records: apart from the backlog, nobody else claims them
HOLD_LEASE_S = 30.0  # outlasts every push of a fault
CALL_TIMEOUT_S = 3.0

# Every forgery, and the refusal reason that must refuse it.
RULES: dict[str, str] = {
    "token-jump": "token_jump",
    "grant-by-another-region": "grant_outside_home",
    "orphan-release": "orphan_token",
    "epoch-beyond-fence": "epoch_beyond_fence",
    "over-limit": "over_limit",
    "lease-hours-out": "lease_too_long",
    "earlier-birth": "unsigned_birth",
    "earlier-birth-signed-by-peer": "signer_not_home",
    "home-grant": "unsigned_grant",
    "home-grant-signed-by-peer": "signer_not_home",
    "tombstone-at-claim-epoch": "unsigned_write",
    "overwrite-at-claim-epoch": "unsigned_write",
    "tombstone-at-claim-epoch-signed-by-peer": "signer_not_home",
    "overwrite-at-claim-epoch-signed-by-peer": "signer_not_home",
    "release-then-write": "unsigned_end",
    "lapse-then-write": "unsigned_end",
    "release-sealed-by-peer-then-write": "signer_not_home",
    "lease-extended-within-the-hour": "unsigned_lease",
    "lease-extended-sealed-by-peer": "signer_not_home",
    "fence-move-then-write": "unsigned_move",
    "fence-move-signed-by-peer-then-write": "signer_not_home",
    "queue-marked-done": "unsigned_write",
    "queue-reopened": "unsigned_write",
    "queue-marked-done-signed-by-peer": "signer_not_home",
    "back-dated-birth-of-its-own-region": "seen_before_birth",
}
# Forgeries the node merges as evidence, reporting them by their rule, with the
# record's home unchanged.
KEPT = frozenset({"back-dated-birth-of-its-own-region"})
SIGHTING_WAIT_S = 5.0  # for the posing region's sighting of the held record


@dataclasses.dataclass(frozen=True)
class Pushed:
    """One forged state pushed: which forgery, the rule that must refuse it, the
    record, how many states the node merged (0 or 1), the reason it refused it
    with ("": no refusal of it was seen), and for a kept one whether the record's
    home stayed."""

    forgery: str
    rule: str
    key: str
    merged: int
    refused: str = ""
    home_kept: bool = True  # a kept forgery: the record's home did not move


Forgeries = list[tuple[str, Record]]


def bound_forgeries(record: Record, now: int) -> Forgeries:
    """What the integrity bounds refuse, whatever the signatures say."""
    hlc = (now << 16) + 1
    fence = record.fence
    beyond = max(fence.fence, token_ceiling(hlc)) + 2 * DEFAULT_MAX_TOKEN_JUMP
    jump = fence.grant(beyond, Grant(hlc, "forger", record.home_region), now + 60_000)
    forged = [
        ("token-jump", record.with_fence(jump)),
        (
            "orphan-release",
            record.with_fence(
                dataclasses.replace(fence, released=fence.released | {fence.fence + 7})
            ),
        ),
        (
            "epoch-beyond-fence",
            record.set_fields({"body": "forged"}, Stamp(fence.fence + 100, hlc, "forger")),
        ),
        (
            "over-limit",
            record.set_fields(
                {f"forged-{i}": "x" for i in range(300)}, Stamp(fence.fence, hlc, "forger")
            ),
        ),
    ]
    if fence.holder() is not None:
        longer = {**fence.lease_expiry, fence.fence: now + 2 * HOUR_MS}
        forged.append(
            ("lease-hours-out", record.with_fence(dataclasses.replace(fence, lease_expiry=longer)))
        )
    return forged


def birth_forgeries(record: Record, third: str, signer: Signer) -> Forgeries:
    """A birth of ``third`` (neither the home nor the posing region) 1 ms before the
    home's: the home would move to ``third``. (The posing region signing a back-dated
    birth of its *own* region is accepted — docs/security.md — so it is not pushed.)"""
    home = record.home
    assert home is not None
    earlier = Birth(home.stamp._replace(hlc=home.stamp.hlc - (1 << 16), node="forger"))
    forged = record.with_birth(third, earlier)
    return [
        ("earlier-birth", forged),
        ("earlier-birth-signed-by-peer", signer.sign_birth(forged, third)),
    ]


def own_birth_forgery(record: Record, posing: str, signer: Signer) -> Forgeries:
    """A birth of ``posing``'s own region 1 ms before the home's, signed with its own
    key, of a record it had seen (:data:`KEPT`); none if it had not."""
    home = record.home
    if home is None or posing not in record.seen or posing in record.births:
        return []
    earlier = Birth(home.stamp._replace(hlc=home.stamp.hlc - (1 << 16), node="forger"))
    forged = signer.sign_birth(record.with_birth(posing, earlier), posing)
    return [("back-dated-birth-of-its-own-region", forged)]


def queue_forgeries(record: Record, now: int, signer: Signer) -> Forgeries:
    """The work queue's state written by a peer (SPEC §8): an item marked done (it
    would never be handed out), or reopened with no attempts (one done would be done
    twice). Only a region that created the record writes and signs these."""
    hlc = max(record.max_hlc(), now << 16) + (1 << 16)
    stamp = Stamp(record.fence.fence, hlc, "forger")
    done = record.set_queue({"status": "done", "outcome": "done"}, stamp)
    return [
        ("queue-marked-done", done),
        ("queue-reopened", record.set_queue({"status": "open", "attempts": "0"}, stamp)),
        ("queue-marked-done-signed-by-peer", signer.sign_writes(done, stamp)),
    ]


def claim_forgeries(
    record: Record, now: int, *, posing: str, signer: Signer, home_node: str, field: str
) -> Forgeries:
    """Against ``record``'s live claim (its fence an unreleased grant of the home):
    grants above it, writes at its epoch stamped by the home's node ``home_node``
    (hole 8), and forged ends and moves that would let such a write in. ``field``:
    the field the holder wrote under its token."""
    key, fence = record.key, record.fence
    token = fence.fence
    hlc = max(record.max_hlc(), now << 16) + (1 << 16)  # later than anything the home wrote
    later = Stamp(token, hlc, home_node)
    forged_value = {field: "forged"}

    outside = fence.grant(token + 1, Grant(hlc, "forger", posing), now + 60_000)
    home_grant = Grant(hlc, "forger", record.home_region)
    granted = fence.grant(token + 1, home_grant, now + 60_000)
    signed_grant = granted.signed(signer.signature(key, token + 1, home_grant))

    tombstone = record.clear(later).set_deleted(True, later)
    overwrite = record.set_fields(forged_value, later)

    released = record.with_fence(fence.release(token))
    sealed = released.with_fence(signer.seal(key, released.fence, end=True, move=False))
    lapsed = record.with_fence(fence.lapse(token))

    # The live claim's lease 50 minutes out: within the bound, so only the seal of
    # the node that decides the claim tells it from a renewal.
    longer_ms = now + 3_000_000
    longer = dataclasses.replace(fence, lease_expiry={**fence.lease_expiry, token: longer_ms})
    lease_sealed = signer.seal(key, longer, end=True, move=False)  # seals the lease

    moved = record.with_fence(fence.move(token + 1))
    moved_signed = moved.with_fence(signer.seal(key, moved.fence, end=False, move=True))
    after_move = later._replace(epoch=token + 1)
    return [
        ("grant-by-another-region", record.with_fence(outside)),
        ("home-grant", record.with_fence(granted)),
        ("home-grant-signed-by-peer", record.with_fence(signed_grant)),
        ("tombstone-at-claim-epoch", tombstone),
        ("overwrite-at-claim-epoch", overwrite),
        ("tombstone-at-claim-epoch-signed-by-peer", signer.sign_writes(tombstone, later)),
        ("overwrite-at-claim-epoch-signed-by-peer", signer.sign_writes(overwrite, later)),
        ("release-then-write", released.set_fields(forged_value, later)),
        ("lapse-then-write", lapsed.set_fields(forged_value, later)),
        ("release-sealed-by-peer-then-write", sealed.set_fields(forged_value, later)),
        ("lease-extended-within-the-hour", record.with_fence(longer)),
        ("lease-extended-sealed-by-peer", record.with_fence(lease_sealed)),
        ("fence-move-then-write", moved.set_fields(forged_value, after_move)),
        ("fence-move-signed-by-peer-then-write", moved_signed.set_fields(forged_value, after_move)),
    ]


class Forger:
    """The ``forge`` fault: an honest holder's claim at the victim's node, and the
    hostile peer pushing forgeries there as another region's node."""

    def __init__(self, workload: Workload, node_files: Callable[[str], TlsFiles]) -> None:
        self.workload = workload
        self.node_files = node_files  # a region's node certificate and key
        self._records = 0

    async def forge(
        self, victim: str, posing: str, log: Callable[[str], None]
    ) -> tuple[tuple[Pushed, ...], str]:
        """Push the forgeries to ``victim``'s node as ``posing``'s: each push, and a note."""
        who = f"forge-holder-{victim}"
        holder = self.workload.client(victim, timeout=CALL_TIMEOUT_S, identity=who)
        held = await self._hold(holder, who, victim)
        reader = self.workload.client(victim, timeout=CALL_TIMEOUT_S)
        keys = [held.key] if held else []
        try:
            async for listed in reader.iter_records(REPO, topic=TOPIC):
                if listed.home_region == victim and listed.fence:
                    keys.append(listed.key)
                if len(keys) >= 4 * PER_FAULT:
                    break
        except FencemarkError as exc:
            log(f"forger: listing at {victim} failed: {exc}")
        pushed = await self._push_all(reader, victim, posing, keys, held, log)
        merged = sum(1 for p in pushed if p.merged)
        note = f"{len(pushed)} forged states pushed to {victim} as {posing}, {merged} merged"
        if held is None:
            return tuple(pushed), f"{note}; {who} got no claim: no forgery of a live claim"
        return tuple(pushed), f"{note}; {await self._finish(holder, held)}"

    async def _hold(self, client: AsyncClient, who: str, victim: str) -> Held | None:
        """Create a record at ``victim``'s node, claim it and write under the token;
        None if it got no claim."""
        name = f"forge-{victim}-{self._records:03d}"
        self._records += 1
        workload, history = self.workload, self.workload.history
        invoked = time.monotonic()
        try:
            made = await client.remember(REPO, FORGE_TOPIC, name, kind="Task", author="chaos",
                                         title=f"Held while forged against: {name}",
                                         tags=[f"homeRegion:{victim}"])  # fmt: skip
        except FencemarkError as exc:
            workload.record(who, "create", name, outcome_of(exc), invoked, detail_of(exc), victim)
            return None
        key = made.record.key
        workload.homes[key] = victim
        workload.record(who, "create", key, "ok", invoked, victim)
        claiming = client.claim(key, who, lease_seconds=HOLD_LEASE_S)
        claim, called = await recorded(history, who, "claim", key, 0, claiming)
        if not isinstance(claim, ClaimResult) or not claim.granted:
            return None
        history.add(grant_of(called, claim))
        held = Held(who, key, claim.fencing_token)
        await self._write(client, held, 0)  # refused or not, the claim is live: forge on
        return held

    async def _write(self, client: AsyncClient, held: Held, step: int) -> Event:
        who, key, token = held
        field, value = held.field(step), f"{who}@{token}"
        write = client.update(key, fields={field: value}, fencing_token=token)
        history = self.workload.history
        _, wrote = await recorded(
            history, who, "write", key, token, write, detail=field, value=value
        )
        return wrote

    async def _finish(self, client: AsyncClient, held: Held) -> str:
        """After the forgeries: the holder writes under its token again, and releases."""
        wrote = await self._write(client, held, 1)
        release = client.release_claim(held.key, held.token)
        history = self.workload.history
        _, released = await recorded(history, held.who, "release", held.key, held.token, release)
        return (
            f"{held.who} then wrote under token {held.token} ({wrote.outcome}"
            f"{' ' + wrote.detail if wrote.outcome != 'ok' else ''}) and released it"
            f" ({released.outcome})"
        )

    async def _push_all(
        self,
        reader: AsyncClient,
        victim: str,
        posing: str,
        keys: list[str],
        held: Held | None,
        log: Callable[[str], None],
    ) -> list[Pushed]:
        files = self.node_files(posing)
        signer = Signer.from_files(files)
        thirds = [r for r in self.workload.regions if r not in (victim, posing)]
        origin = replication_pb2.Origin(region=posing, node_id="forger", hlc=0)
        pushed: list[Pushed] = []
        address = self.workload.addresses[victim]
        async with grpc.aio.secure_channel(address, files.channel_credentials()) as channel:
            stub = replication_pb2_grpc.ReplicationStub(channel)
            try:
                request = replication_pb2.FetchRequest(origin=origin, keys=keys)
                fetched = await stub.Fetch(request, timeout=CALL_TIMEOUT_S)
                refusals = await Refusals.at(reader, posing)
            except (grpc.aio.AioRpcError, FencemarkError) as exc:
                log(f"forger: fetching from {victim} as {posing} failed: {exc}")
                return pushed
            records = {r.key: r for r in map(codec.decode, fetched.states)}
            if held is not None and held.key in records:
                records[held.key] = await _sighted(stub, origin, records[held.key], posing)
            homed = [records[k] for k in keys if k in records]
            for record in [r for r in homed if r.home_region == victim][:PER_FAULT]:
                now = wall_clock_ms()
                forged = bound_forgeries(record, now) + queue_forgeries(record, now, signer)
                if thirds:
                    forged += birth_forgeries(record, thirds[0], signer)
                forged += own_birth_forgery(record, posing, signer)
                if held is not None and record.key == held.key and record.fence.unreleased():
                    field = held.field(0)
                    home_node = refusals.node_id
                    forged += claim_forgeries(record, now, posing=posing, signer=signer,
                                              home_node=home_node, field=field)  # fmt: skip
                for name, state in forged:
                    push = replication_pb2.PushRequest(origin=origin, states=[codec.encode(state)])
                    try:
                        answer = await stub.Push(push, timeout=CALL_TIMEOUT_S)
                    except grpc.aio.AioRpcError as exc:
                        log(f"forger: push of {name} for {record.key}: {exc.code().name}")
                        continue
                    kept = name in KEPT
                    reason = "" if answer.merged and not kept else await refusals.of(record.key)
                    home_kept = not kept or await _home_of(stub, origin, record.key) == victim
                    pushed.append(Pushed(name, RULES[name], record.key, answer.merged, reason,
                                         home_kept))  # fmt: skip
        return pushed


async def _fetch(stub: Any, origin: replication_pb2.Origin, key: str) -> Record | None:
    request = replication_pb2.FetchRequest(origin=origin, keys=[key])
    fetched = await stub.Fetch(request, timeout=CALL_TIMEOUT_S)
    return next(map(codec.decode, fetched.states), None)


async def _sighted(
    stub: Any,
    origin: replication_pb2.Origin,
    record: Record,
    posing: str,
) -> Record:
    """``record`` as the victim holds it once the posing region's sighting of it has
    arrived there (its node merged the claim and said so), or after
    ``SIGHTING_WAIT_S`` as it is."""
    deadline = time.monotonic() + SIGHTING_WAIT_S
    while posing not in record.seen and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        with contextlib.suppress(grpc.aio.AioRpcError):
            record = await _fetch(stub, origin, record.key) or record
    return record


async def _home_of(stub: Any, origin: replication_pb2.Origin, key: str) -> str:
    """The home region of ``key`` as the victim holds it now ("" if unreadable)."""
    try:
        record = await _fetch(stub, origin, key)
    except grpc.aio.AioRpcError:
        return ""
    return record.home_region if record is not None else ""


class Held(NamedTuple):
    """The honest holder's claim the forgeries of a live claim are pushed against."""

    who: str
    key: str
    token: int

    def field(self, step: int) -> str:
        return f"progress.{self.who}.{self.token}.{step}"


@dataclasses.dataclass
class Refusals:
    """What the victim's node says it refused from the posing region: how many
    states, and the last one (``Info.peers[].merges_refused``, ``last_refusal``:
    "KEY: REASON: DETAIL"); ``node_id``: the victim's node."""

    reader: AsyncClient
    posing: str
    node_id: str
    count: int

    @classmethod
    async def at(cls, reader: AsyncClient, posing: str) -> Refusals:
        info = await reader.info()
        return cls(reader, posing, info.node_id, _refused(info, posing)[0])

    async def of(self, key: str) -> str:
        """The reason the node gave for refusing a state of ``key`` just now; "" when
        it counted no new refusal of it."""
        try:
            count, last = _refused(await self.reader.info(), self.posing)
        except FencemarkError:
            return ""
        refused, self.count = count > self.count, count
        prefix = f"{key}: "
        if not refused or not last.startswith(prefix):
            return ""
        return last[len(prefix) :].split(":", 1)[0]


def _refused(info: NodeInfo, region: str) -> tuple[int, str]:
    for peer in info.peers:
        if peer.region == region:
            return peer.merges_refused, peer.last_refusal
    return 0, ""

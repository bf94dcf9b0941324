"""Claims as the history shows them (``claim_invariants.py`` judges them).

A *claim* is one token granted to one owner for one record (the same owner's
idempotent retries are the same claim). Its holder knows it live from the
grant's reply until the earliest of: the end of its lease as the grant or the
latest renewal said, its release, and the first refusal the holder saw (both
from when they were sent: the other side may act on them at once). The lease
ends the replies name are the nodes' clock, which is the host's
(``Event.expires``), read within ``CLOCK_SLACK_S``.

A claim's *end* is the earliest moment its home may have stopped holding it
unreleased: its release or first refusal, or its lease's end. A write that
overwrote a fenced write is excused only if it may have been admitted after
the end of the claim that wrote it (SPEC §4: only then, or under a newer token).

Split births (``shapes.py``): an id created on both sides of a partition. Its
claims granted during the split by a region that created it were granted *apart*:
two of them granted by different regions may overlap, hold the same token and
write past each other's tokens, until the births *met* (every region names one
home whose fence is past every split-time token, as the workload saw; at most
``SPLIT_MEET_LIMIT_S`` after the heal). Claims granted apart are *split-time*
but those the home granted after it moved its fence: a bridge partition lets the
births meet through the third region before the heal, and the home's ``History``
shows its move before such a grant (the workload records them, ``met-grant``).
From the meeting on a split-time token must be refused.

Disk loss (SPEC §6): a grant or renewal acknowledged by a home that lost its disk
before it had ``DISK_LOSS_GRACE_S`` healthy seconds to pass it on may be gone
with the disk; the claim's life through that reply is cut where the node died.
A disk that went back in time (``rollback``) is judged alike for what the node
acknowledged after the copy it was put back to: its file forgot it, and unless it
had those healthy seconds to pass it on, no peer may hold it either. What it
acknowledged before the copy is on the copy, and never excused.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from fencemark.node.tools.workload import Event, History
from tests.chaos.nemesis import DISK_FAULTS, PARTITIONS, ROLLBACK, Played
from tests.chaos.shapes import SPLIT_MEET_LIMIT_S, SPLIT_TOPIC

INF = math.inf
CLOCK_SLACK_S = 0.1
DISK_LOSS_GRACE_S = 5.0  # healthy seconds a node had to pass a write on before a wipe
LOST_WITH_DISK = "lost with a wiped or rolled-back disk before they could replicate"
# What a claim's holder does with its token; a queue agent's release ``done`` (with
# its ``result`` field, a fenced write too) or ``fail`` ends its claim like a release.
HOLDER_OPS = ("write", "renew", "finish", "release", "done", "fail", "stale-write", "stale-renew")
FENCED_WRITES = ("write", "finish", "done", "stale-write")
RENEWALS = ("renew", "stale-renew")
RELEASES = ("release", "done", "fail")

Span = tuple[float, float]


@dataclass
class Ack:
    """A reply that said the claim was live: the grant, or a renewal (run clock)."""

    at: float
    expires: float
    cut: float = INF  # its node lost its disk here, before it could pass the reply on


@dataclass
class Claim:
    key: str
    token: int
    owner: str
    region: str  # the node that granted it
    grants: list[Span] = field(default_factory=list)  # its grant calls: (invoked, completed)
    acks: list[Ack] = field(default_factory=list)
    stop: float = INF  # release or first refusal, as sent
    refused_or_released: float = INF  # a refusal or an acknowledged release had arrived
    unknown: list[Span] = field(default_factory=list)  # renewals and re-claims, outcome unknown
    apart: bool = False  # granted apart, during a split (module docstring)
    split: bool = False  # a split-time claim: granted apart, not after the home's move

    @property
    def granted(self) -> float:
        return self.grants[0][1]

    def live(self, until: float = INF) -> list[Span]:
        """When its holder knew it live (merged spans), up to ``until``."""
        spans = sorted((a.at, min(a.expires, a.cut, self.stop, until)) for a in self.acks)
        merged: list[Span] = []
        for start, end in spans:
            if end <= start:
                continue
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((start, end))
        return merged

    @property
    def end(self) -> float:
        """The earliest its home may have stopped holding it unreleased."""
        lease = max((min(a.expires, a.cut) for a in self.acks), default=self.granted)
        return min(self.stop, lease)

    def lease_bound(self, before: float, lease_seconds: float) -> float:
        """The latest its lease may run to, from the calls sent before ``before``: the
        ends replies named, and a full lease from each call whose outcome is unknown."""
        known = [a.expires for a in self.acks if a.at < before]
        guessed = [done + lease_seconds for sent, done in self.unknown if sent < before]
        return max(known + guessed, default=0.0)


@dataclass(frozen=True)
class Split:
    """An id the workload created on both sides of a partition."""

    born: frozenset[str]  # regions whose node said it created it
    maybe: frozenset[str]  # and those whose creation's outcome is unknown
    healed: float  # when the partition it was born in healed (run clock)
    met: float  # when the births met (module docstring)
    met_seen: bool
    after_move: frozenset[int] = frozenset()  # tokens the home granted after its move


def exempt(a: Claim | None, b: Claim | None) -> bool:
    """Claims of one split-born id granted apart by different regions."""
    return a is not None and b is not None and a.apart and b.apart and a.region != b.region


# -- reading the history ----------------------------------------------------------------


def disk_lost_at(acked_at: float, region: str, played: Sequence[Played]) -> float | None:
    """When ``region`` died with its disk after acknowledging something at ``acked_at``
    (seconds since the run started, like the faults' times) before it could pass it on:
    it never had DISK_LOSS_GRACE_S healthy seconds in a row between the ack and the
    wipe (healthy: no fault on it, no loss or slow link). A rollback counts as the
    loss of what was acknowledged after its copy was taken, and of nothing before."""
    for wipe in played:
        # The kill lands a moment after the fault starts: a write acknowledged in
        # between was acknowledged by the node whose disk is then lost.
        lost_at = wipe.down_at or wipe.started
        if wipe.kind not in DISK_FAULTS or wipe.targets[0] != region or lost_at < acked_at:
            continue
        if wipe.kind == ROLLBACK and (not wipe.copied_at or acked_at < wipe.copied_at):
            continue  # on the copy it was put back to (or no copy was ever taken)
        faulty = sorted(
            (f.started, f.ended)
            for f in played
            if f is not wipe and (region in f.targets or f.kind in ("loss", "slow"))
        )
        healthy_since = acked_at
        for started, ended in faulty:
            if ended <= healthy_since:
                continue
            if min(started, wipe.started) - healthy_since >= DISK_LOSS_GRACE_S:
                return None  # time enough to pass it on before this fault
            if started >= wipe.started:
                break
            healthy_since = ended
        return lost_at if lost_at - healthy_since < DISK_LOSS_GRACE_S else None
    return None


def lost_with_disk(acked_at: float, region: str, played: Sequence[Played]) -> bool:
    return disk_lost_at(acked_at, region, played) is not None


def splits_of(history: History, played: Sequence[Played]) -> dict[str, Split]:
    """The ids created on both sides of a partition, from their creations and the
    workload's watch for their births to meet (``split-met``)."""
    start = history.started
    born: dict[str, set[str]] = {}
    maybe: dict[str, set[str]] = {}
    first: dict[str, float] = {}
    met: dict[str, Event] = {}
    after_move: dict[str, set[int]] = {}
    for event in history.events:
        if f"/mem/{SPLIT_TOPIC}/" not in event.key:
            continue
        if event.op == "create":
            first.setdefault(event.key, event.invoked - start)
            if event.outcome == "ok" and event.value == "created":
                born.setdefault(event.key, set()).add(event.detail)
                maybe.setdefault(event.key, set()).add(event.detail)
            elif event.outcome == "unknown":
                maybe.setdefault(event.key, set()).add(event.value)
        elif event.op == "split-met":
            met[event.key] = event
        elif event.op == "met-grant":
            after_move.setdefault(event.key, set()).add(event.token)
    splits = {}
    for key, regions in born.items():
        if len(regions) < 2:
            continue
        watched = met.get(key)
        if watched is not None:
            healed = watched.invoked - start
        else:  # the run ended first: when the partition it was born in healed
            during = [f.ended for f in played if f.kind in PARTITIONS]
            healed = min((t for t in during if t >= first[key]), default=INF)
        seen = watched is not None and watched.outcome == "ok"
        meeting = watched.completed - start if seen and watched else healed + SPLIT_MEET_LIMIT_S
        moved = frozenset(after_move.get(key, ()))
        splits[key] = Split(frozenset(regions), frozenset(maybe[key]), healed, meeting, seen, moved)
    return splits


def claims_of(
    history: History,
    played: Sequence[Played],
    homes: Mapping[str, str],
    splits: Mapping[str, Split],
    lease_seconds: float,
) -> dict[tuple[str, int, str], Claim]:
    """Every claim, keyed by (key, token, owner)."""
    start = history.started
    claims: dict[tuple[str, int, str], Claim] = {}

    def ack(event: Event, region: str) -> Ack:
        at = event.completed - start
        expires = event.expires - start if event.expires else at + lease_seconds
        return Ack(at, expires, disk_lost_at(at, region, played) or INF)

    for event in history.events:
        if event.op != "grant":
            continue
        ident = (event.key, event.token, event.agent)
        if ident not in claims:
            region = event.detail or homes.get(event.key, "")
            claims[ident] = Claim(event.key, event.token, event.agent, region)
        claim = claims[ident]
        claim.grants.append((event.invoked - start, event.completed - start))
        claim.acks.append(ack(event, claim.region))
    for event in history.events:
        sent, done = event.invoked - start, event.completed - start
        if event.op == "claim" and event.outcome == "unknown":  # a retry may have renewed
            for claim in claims.values():
                if claim.key == event.key and claim.owner == event.agent:
                    claim.unknown.append((sent, done))
            continue
        holder = claims.get((event.key, event.token, event.agent))
        if holder is None or event.op not in HOLDER_OPS:
            continue
        if event.outcome == "fail":
            holder.stop = min(holder.stop, sent)
            holder.refused_or_released = min(holder.refused_or_released, done)
        elif event.op in RELEASES:
            holder.stop = min(holder.stop, sent)
            if event.outcome == "ok":
                holder.refused_or_released = min(holder.refused_or_released, done)
        elif event.op in RENEWALS:
            if event.outcome == "ok":
                holder.acks.append(ack(event, holder.region))
            else:
                holder.unknown.append((sent, done))
    for claim in claims.values():
        split = splits.get(claim.key)
        if split is not None:
            claim.apart = claim.region in split.born and claim.grants[0][0] < split.healed
            claim.split = claim.apart and claim.token not in split.after_move
    return claims


def by_key(claims: Mapping[tuple[str, int, str], Claim]) -> dict[str, list[Claim]]:
    grouped: dict[str, list[Claim]] = {}
    for claim in claims.values():
        grouped.setdefault(claim.key, []).append(claim)
    return grouped


@dataclass(frozen=True)
class Ending:
    """The latest claim event a record's home kept (``Records.History``), read at the
    end of the run; times on the run clock. ``kind`` is ``granted``, ``renewed``,
    ``released``, ``lapsed`` or ``forced`` (``""``: the home kept none)."""

    key: str
    home: str
    kind: str
    token: int
    owner: str
    at: float  # when the home decided it
    read_at: float  # when the run read it

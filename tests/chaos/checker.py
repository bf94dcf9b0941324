"""The chaos tier's checker: twelve invariants over the history and the final states
(the thirteenth, over what the watchers received, is ``watch_invariants.py``'s; the
fourteenth, over the homes' claim histories at the end, ``leases_recorded``).

Each invariant is judged on its own and reported separately (docs/chaos.md says
what each means and what it does not promise); those about claims are in
``claim_invariants.py`` (``claims.py`` reads the claims out of the history), the
work queue's in ``queue_invariants.py``:

1. fencing safety — no fenced write accepted with a token lower than one already
   granted for that record, none from a worker after it was told ``superseded``,
   none from a worker that stalled past its lease (refused ``superseded`` or
   ``expired``, nothing else), none under a split-time token once the births met;
2. tokens strictly increase — per record, across every grant, restarts and disk
   loss included;
3. no acknowledged write lost — every acknowledged unfenced write (each to a
   field of its own) and every acknowledged creation is in every region's final
   state. The one exception is SPEC's: a write acknowledged by a node that then
   lost its disk before it had been connected to its peers for
   ``DISK_LOSS_GRACE_S`` may be gone with that disk; such writes are counted and
   listed, never hidden;
4. convergence — after the final heal every region holds byte-identical records
   within ``CONVERGE_ROUNDS`` anti-entropy rounds; the time it took is reported;
5. availability — while the network is faulty (partitions, packet loss, a slow
   link) every region keeps serving reads and unfenced writes to unclaimed
   records; home-only calls that cannot be served fail fast, with a reason; a node
   refused as a twin decides again within a bound of its twin's end;
6. one home per record — every region's final state names the same one home,
   the region that created the record (for an id born on both sides of a split:
   one of those);
7. one live claim at a time;
8. a token is granted once;
9. fenced writes survive;
10. catching up before deciding — a node that lost its disk and was restarted
    before it had caught up, with a peer cut off, granted nothing and admitted no
    write until that peer was back (SPEC §4); a node frozen by a ``pause``
    granted and renewed nothing from its freeze until it could have settled with its
    peers after it woke (docs/replication.md, *Twins*) — not even to a claim that
    was already waiting in line; and a twin started beside its running original,
    its peers connected, decided nothing at all;
11. forgeries refused — no state the hostile peer of a ``forge`` fault pushed was
    merged (but the kept kind, ``forger.KEPT``, which must leave the record's home
    where it was), each was refused by the rule named for it (``forger.RULES``), and every
    kind was refused by its rule at least once;
12. no item done twice — no work-queue item is released ``done`` twice, nor handed
    out again after an acknowledged done, without an operator's reopen that could
    have come between; an item acknowledged done is done in every final state unless
    reopened after, and one done there was made so by a done; a poison item is never
    handed out while parked (``queue_invariants.py``);
13. watchers miss nothing — each region's watcher of the change feed, resumed across
    every fault, received every change its node committed, in commit order, once
    (``watch_invariants.watched_in_order``, judged beside ``check``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fencemark.client import Record
from fencemark.node.api.config import NodeConfig
from fencemark.node.replication.tuning import TWIN_FORGET_S
from fencemark.node.tools.workload import Event, History
from tests.chaos.claim_invariants import (
    Verdict,
    fenced_writes_survive,
    fencing_safety,
    granted_once,
    one_live_claim,
    token_order,
)
from tests.chaos.claims import (
    DISK_LOSS_GRACE_S,
    LOST_WITH_DISK,
    RENEWALS,
    Claim,
    Split,
    claims_of,
    lost_with_disk,
    splits_of,
)
from tests.chaos.forger import KEPT, RULES
from tests.chaos.nemesis import (
    DISK_LOSSES,
    PARTITIONS,
    TWIN,
    TWIN_CATCH_UP_S,
    Played,
)
from tests.chaos.queue_invariants import no_item_done_twice
from tests.chaos.queue_work import WAIT_S as QUEUE_WAIT_S
from tests.chaos.shapes import twin_presser
from tests.chaos.workload import CALL_TIMEOUT_S

__all__ = ["CONVERGE_ROUNDS", "DISK_LOSS_GRACE_S", "Convergence", "Verdict", "check"]

NETWORK_FAULTS = (*PARTITIONS, "loss", "slow")
CONVERGE_ROUNDS = 20  # anti-entropy rounds convergence may take after the final heal
# A home-only call at a node that is not the record's home is refused within this;
# generous because three nodes and the test share two cores: it separates an
# answer from a hang, it is not a latency target (bench/ measures latency).
WRONG_REGION_FAST_S = 2.0
# A failed home-only call of an agent returns within its deadline, plus this for
# the test process's own scheduling.
DEADLINE_SLACK_S = 1.0
HOME_ONLY_OPS = ("claim", "write", "renew", "finish", "release", "done", "fail", "reopen")
# A node paused, killed, wiped or put back decides nothing until it has settled with
# its peers again (docs/replication.md, *Twins*), for at most its --start-wait (the
# chaos nodes run the default) once it runs, or until it has caught up after a lost
# disk; meanwhile it still answers wrong_region for a record it holds whose home is
# elsewhere (docs/api.md, *NOT_SERVING*), and NOT_SERVING for one it does not hold.
# The probe's record homed elsewhere is created before the first fault, so only a
# node that lost its disk can lack it: a home-only probe there refused UNAVAILABLE
# is what the contract says, not a lost redirect. (Before the gate came after the
# home, every settling node answered so; ``pause``, ``kill`` and ``rollback`` were
# excused too.)
SETTLING_FAULTS = DISK_LOSSES
START_WAIT_S = NodeConfig.start_wait_s
# A node with a twin (a second process started from a copy of its data directory)
# is refused by its peers and decides nothing from the copy until its peers have
# forgotten the twin's life, TWIN_FORGET_S after they last heard it, and it has
# caught up with every one of them: at most TWIN_CATCH_UP_S more
# (docs/replication.md, *Twins*). Meanwhile it answers NOT_SERVING for every record
# it does not hold, homed elsewhere too (a record it holds that is homed elsewhere
# it still redirects, wrong_region: docs/api.md, *NOT_SERVING*). That cost is
# excused, within that bound, and the node must decide again within it.
TWIN_BOUND_S = TWIN_FORGET_S + TWIN_CATCH_UP_S
HOME_TAG = "homeRegion:"


@dataclass(frozen=True)
class Convergence:
    seconds: float  # from the final heal until every region was byte-identical
    interval: float  # the nodes' anti-entropy interval
    records: int


def check(
    history: History,
    played: Sequence[Played],
    finals: Mapping[str, Mapping[str, Record]],
    homes: Mapping[str, str],
    convergence: Convergence | None,
    *,
    lease_seconds: float = 2.0,
) -> list[Verdict]:
    splits = splits_of(history, played)
    claims = claims_of(history, played, homes, splits, lease_seconds)
    return [
        fencing_safety(history, claims, splits, played),
        token_order(claims, played, homes),
        acknowledged_writes(history, played, finals, homes),
        converged(convergence),
        availability(history, played, regions=len(finals)),
        one_home(finals, homes, splits),
        one_live_claim(claims, splits),
        granted_once(claims, lease_seconds),
        fenced_writes_survive(history, claims, finals, homes, played),
        caught_up_first(history, played, claims, homes, lease_seconds),
        forgeries_refused(played),
        no_item_done_twice(history, finals, homes, played),
    ]


# -- 3. acknowledged writes ------------------------------------------------------------


def acked_by(event: Event, homes: Mapping[str, str]) -> str:
    """The region whose node acknowledged ``event``: a creation names it (detail), a
    probe's note is its own region's, a fenced write its record's home."""
    if event.op == "create":
        return event.detail
    if event.op == "note" or event.agent.startswith("probe-"):
        return event.agent.removeprefix("probe-")
    return homes.get(event.key, "")


def acknowledged_writes(
    history: History,
    played: Sequence[Played],
    finals: Mapping[str, Mapping[str, Record]],
    homes: Mapping[str, str],
) -> Verdict:
    # Fenced writes are judged by invariant 9, which knows what may overwrite them.
    acked = [e for e in history.events if e.outcome == "ok" and e.op in ("note", "create")]
    missing, exempt = [], []
    for event in acked:
        absent = [region for region, records in finals.items() if not _holds(records, event)]
        if not absent:
            continue
        acked_at = event.completed - history.started
        if lost_with_disk(acked_at, acked_by(event, homes), played):
            exempt.append(event)
        else:
            missing.append(
                f"{event.op} {event.key} {event.detail}={event.value} missing at {','.join(absent)}"
            )
    detail = "; ".join(missing[:3]) or (
        f"{len(acked)} acknowledged unfenced writes and creations, in all {len(finals)} regions"
        + (f" ({len(exempt)} {LOST_WITH_DISK})" if exempt else "")
    )
    return Verdict(
        "3. no acknowledged write lost",
        not missing,
        detail,
        {"acknowledged": len(acked), "lost with a disk": len(exempt), "missing": len(missing)},
    )


def _holds(records: Mapping[str, Record], event: Event) -> bool:
    record = records.get(event.key)
    if record is None:
        return False
    return event.op == "create" or record.fields.get(event.detail) == event.value


# -- 4. convergence --------------------------------------------------------------------


def converged(convergence: Convergence | None) -> Verdict:
    if convergence is None:
        return Verdict(
            "4. convergence",
            False,
            f"regions still differ {CONVERGE_ROUNDS} anti-entropy rounds after the final heal",
        )
    rounds = convergence.seconds / convergence.interval
    return Verdict(
        "4. convergence",
        rounds <= CONVERGE_ROUNDS,
        f"{convergence.records} records byte-identical in every region"
        f" {convergence.seconds:.2f} s (~{rounds:.1f} anti-entropy rounds) after the final heal",
        {
            "seconds": round(convergence.seconds, 3),
            "rounds": round(rounds, 2),
            "records": convergence.records,
        },
    )


# -- 5. availability -------------------------------------------------------------------


def twin_window(fault: Played) -> tuple[float, float]:
    """When a twin fault's original may decide nothing: from the copy (it is frozen
    for it, and may settle again after) until it decided again — at most
    ``TWIN_BOUND_S`` after its twin was stopped (or the fault ended, if it never
    started), and once it decided again, ``DEADLINE_SLACK_S`` more for the calls
    already on their way."""
    bound = (fault.twin_stopped or fault.ended) + TWIN_BOUND_S
    end = min(fault.deciding_again, bound) if fault.deciding_again else bound
    return fault.started, end + DEADLINE_SLACK_S


def twin_recovery(played: Sequence[Played]) -> tuple[list[str], list[float]]:
    """Each injected twin fault's original must decide again within ``TWIN_BOUND_S``
    of its twin's stop: the problems, and how long each took."""
    problems, took = [], []
    for fault in played:
        if fault.kind != TWIN or not fault.injected or not fault.twin_stopped:
            continue
        region = fault.targets[0]
        after = fault.deciding_again - fault.twin_stopped
        if not fault.deciding_again or after > TWIN_BOUND_S:
            seen = f"at {fault.deciding_again:.1f} s" if fault.deciding_again else "never"
            problems.append(
                f"{region}, twinned at {fault.started:.1f} s, decided claims again {seen}:"
                f" not within {TWIN_BOUND_S:.0f} s of its twin's stop at"
                f" {fault.twin_stopped:.1f} s"
            )
        else:
            took.append(after)
    return problems, took


def availability(history: History, played: Sequence[Played], *, regions: int = 3) -> Verdict:
    windows = [(f.started, f.ended, f.kind) for f in played if f.kind in NETWORK_FAULTS]
    settles = [
        (f.ended, f.ended + START_WAIT_S + DEADLINE_SLACK_S, f.targets)
        for f in played
        if f.kind in SETTLING_FAULTS
    ]
    # A twin fault the engine broke off may have had its twin refused all the same.
    twinned = [(*twin_window(f), f.targets[:1]) for f in played if f.kind == TWIN]
    problems, recovered = twin_recovery(played)
    served = settling = while_twinned = 0
    slowest_refusal = 0.0

    def during(event: Event) -> str | None:
        at = event.invoked - history.started
        return next((kind for start, end, kind in windows if start <= at <= end), None)

    def settling_at(event: Event, spans: list[tuple[float, float, tuple[str, ...]]]) -> bool:
        """Whether the probe's node may still be settling after a fault of its own, or
        deciding nothing since it was twinned (``spans``)."""
        at, region = event.invoked - history.started, event.agent.removeprefix("probe-")
        return any(start <= at <= end and region in targets for start, end, targets in spans)

    for event in history.events:
        kind = during(event)
        if kind is None:
            continue
        took = event.completed - event.invoked
        if event.op in ("probe-read", "note"):
            if event.outcome == "ok":
                served += 1
            else:
                problems.append(
                    f"{event.agent} {event.op} {event.outcome} ({event.detail}) during {kind}"
                )
        elif event.op == "probe-home-only":
            slowest_refusal = max(slowest_refusal, took)
            refused_fast = event.detail == "UNAVAILABLE" and took <= WRONG_REGION_FAST_S
            if refused_fast and settling_at(event, settles):
                settling += 1
            elif refused_fast and settling_at(event, twinned):
                while_twinned += 1
            elif event.detail != "wrong_region" or took > WRONG_REGION_FAST_S:
                problems.append(
                    f"{event.agent} home-only call at a non-home node:"
                    f" {event.outcome} {event.detail!r} in {took:.2f} s"
                )
        elif event.op in (*HOME_ONLY_OPS, "claim-next") and event.outcome != "ok":
            bound = CALL_TIMEOUT_S
            if event.op == "claim-next":  # a deadline per region, and the wait at its own
                bound = regions * CALL_TIMEOUT_S + QUEUE_WAIT_S
            else:
                slowest_refusal = max(slowest_refusal, took)
            if took > bound + DEADLINE_SLACK_S or not event.detail:
                what = f"{event.op} {event.key}".strip()  # a ClaimNext names no key
                problems.append(
                    f"{event.agent} {what} took {took:.2f} s"
                    f" to {event.outcome} ({event.detail!r}) during {kind}"
                )
    if not windows:
        problems.append("no network fault was played: nothing to judge")
    elif not served:
        problems.append("no read or unfenced write was probed during a network fault")
    excused = [
        f"{settling} NOT_SERVING at a node that lost its disk" if settling else "",
        f"{while_twinned} at a node refused as a twin" if while_twinned else "",
    ]
    detail = "; ".join(problems[:3]) or (
        f"{served} reads and unfenced writes served during {len(windows)} network faults;"
        f" refused home-only calls answered within {slowest_refusal:.2f} s"
        + (f" ({', '.join(e for e in excused if e)})" if any(excused) else "")
        + (
            f"; {len(recovered)} nodes refused as twins decided again"
            f" {max(recovered):.1f} s or less after their twin stopped"
            if recovered
            else ""
        )
    )
    return Verdict(
        "5. availability",
        not problems,
        detail,
        {
            "served during faults": served,
            "refused while settling": settling,
            "refused while twinned": while_twinned,
            "twinned nodes deciding again": len(recovered),
            "slowest twin recovery s": round(max(recovered, default=0.0), 3),
            "problems": len(problems),
            "slowest refusal s": round(slowest_refusal, 3),
        },
    )


# -- 6. one home per record --------------------------------------------------------------


def one_home(
    finals: Mapping[str, Mapping[str, Record]],
    homes: Mapping[str, str],
    splits: Mapping[str, Split],
) -> Verdict:
    """Every region's final state of a record names one home, the same everywhere: the
    region that created it, or for an id born on both sides of a split one of those."""
    problems = []
    keys = sorted({key for records in finals.values() for key in records})
    for key in keys:
        named = {r: records[key] for r, records in finals.items() if key in records}
        seen = {record.home_region for record in named.values()}
        if seen == {""}:
            continue  # a tombstone of a key nobody created: no home to name
        if len(seen) != 1:
            where = ", ".join(f"{r}: {record.home_region or '-'}" for r, record in named.items())
            problems.append(f"{key} has different homes ({where})")
            continue
        home = seen.pop()
        tags = {
            r: {t for t in record.tags if t.startswith(HOME_TAG)} for r, record in named.items()
        }
        if any(found != {HOME_TAG + home} for found in tags.values()):
            names = ", ".join(f"{r}: {' '.join(sorted(found))}" for r, found in tags.items())
            problems.append(f"{key} is homed at {home} but its tags name {names}")
        elif key in homes and homes[key] != home:
            problems.append(f"{key} was created at {homes[key]} but is homed at {home}")
        elif key in splits and home not in splits[key].maybe:
            born = ",".join(sorted(splits[key].maybe))
            problems.append(f"{key} was created at {born} but is homed at {home}")
    met = sum(split.met_seen for split in splits.values())
    detail = "; ".join(problems[:3]) or (
        f"{len(keys)} records, one home each in every region; {len(splits)} ids born on both"
        f" sides of a split, {met} of which met within {CONVERGE_ROUNDS} rounds of the heal"
    )
    return Verdict(
        "6. one home per record",
        not problems,
        detail,
        {"records": len(keys), "born on both sides": len(splits), "births met": met},
    )


# -- 10. catching up before deciding -------------------------------------------------------

# What only a node that has caught up decides: claims, renewals, releases and fenced
# writes (SPEC §4). Unfenced writes and creations it admits meanwhile, by the rule of
# a node that is not the home (docs/consistency.md, *Catch-up*): "fenced writes
# survive" judges what those may not do.
DECIDED = ("grant", "renew", "release", "write", "finish", "done", "fail", "reopen")


def decided_at(
    event: Event, claims: Mapping[tuple[str, int, str], Claim], homes: Mapping[str, str]
) -> str:
    """The region whose node decided or admitted ``event``."""
    if event.op == "grant":
        return event.detail or homes.get(event.key, "")
    if event.op.startswith("meddle"):
        return event.agent.removeprefix("meddler-")
    claim = claims.get((event.key, event.token, event.agent))
    if claim is not None:
        return claim.region
    return acked_by(event, homes)


# A node woken from a pause settles with its peers before it decides (a nap:
# docs/replication.md, *Twins*); the nemesis asks it, after the wake, until it says it
# decides again, and keeps the last moment it said it did not (``settling_until``).
# No grant or renewal may be decided by it from its freeze until then: one that was
# came from a node that decided nothing else, typically a claim that waited in line
# across the pause and reached the head as the lease before it lapsed (what the gate,
# read only as a call arrived, once let through).


def decided_when(event: Event, lease_seconds: float) -> float:
    """When a grant's or renewal's home decided it, on the run's monotonic clock: the
    lease's end as the reply said, less the lease asked (every chaos client asks
    ``lease_seconds``, but the forge fault's holder). 0 when unknown."""
    if not event.expires or event.agent.startswith("forge-"):
        return 0.0
    return event.expires - lease_seconds


def settled_first(
    history: History,
    played: Sequence[Played],
    claims: Mapping[tuple[str, int, str], Claim],
    homes: Mapping[str, str],
    lease_seconds: float,
) -> tuple[int, list[str]]:
    """How many pauses were judged, and the grants and renewals their node decided
    while it was frozen or settling after it (until ``settling_until``). A pause whose
    node never said it was settling is not judged: the nemesis reports it."""
    judged = [f for f in played if f.kind == "pause" and f.injected and f.settling_until]
    problems = []
    for fault in judged:
        region = fault.targets[0]
        for event in history.events:
            if event.outcome != "ok" or event.op not in ("grant", *RENEWALS):
                continue
            at = decided_when(event, lease_seconds) - history.started
            if not fault.down_at < at < fault.settling_until:
                continue
            if decided_at(event, claims, homes) == region:
                problems.append(
                    f"{region} decided {event.agent}'s {event.op} of {event.key} at {at:.2f} s,"
                    f" frozen at {fault.down_at:.1f} s, woken at {fault.ended:.1f} s and still"
                    f" settling at {fault.settling_until:.1f} s"
                )
    return len(judged), problems


def caught_up_first(
    history: History,
    played: Sequence[Played],
    claims: Mapping[tuple[str, int, str], Claim],
    homes: Mapping[str, str],
    lease_seconds: float = 2.0,
) -> Verdict:
    """A node that lost its disk decides nothing before its catch-up pass with every
    peer (SPEC §4), however often it is restarted first: judged where a peer was cut
    off from it until ``cut_healed``, so that it could not have caught up before. A
    paused node decides nothing before it could have settled after the pause
    (``settled_first``). And a twin — a copy of a running node started beside it,
    its peers connected — never decides (docs/replication.md, *Twins*): it never
    says it serves claims, and nothing asked of it (``twin_presser``) that only a
    deciding node decides is acknowledged."""
    start = history.started
    judged = [f for f in played if f.kind == "wipe-restart" and f.cut_healed and f.injected]
    pauses, problems = settled_first(history, played, claims, homes, lease_seconds)
    twins = [f for f in played if f.kind == TWIN and f.injected]
    problems += twin_decisions(history, twins)
    refused = 0
    for fault in judged:
        region = fault.targets[0]
        if fault.serving_early:
            problems.append(
                f"{region} said it served claims at {fault.serving_early:.1f} s, cut off from"
                f" {fault.targets[1]} until {fault.cut_healed:.1f} s"
            )
        for event in history.events:
            sent, done = event.invoked - start, event.completed - start
            if event.op not in DECIDED or not fault.down_at <= sent <= done <= fault.cut_healed:
                continue
            if decided_at(event, claims, homes) != region:
                continue
            if event.outcome == "ok":
                problems.append(
                    f"{region} acknowledged {event.agent}'s {event.op} of {event.key} at"
                    f" {done:.1f} s, before it could have caught up (cut off from"
                    f" {fault.targets[1]} until {fault.cut_healed:.1f} s)"
                )
            else:
                refused += 1
    if not judged:
        problems.append("no node was restarted before catching up with a peer cut off")
    if not pauses:
        problems.append(
            "no pause judged: none played, or its node never said it was settling after it"
        )
    asked = sum(1 for f in twins for e in history.events if e.agent == twin_presser(f.targets[0]))
    detail = "; ".join(problems[:3]) or (
        f"{len(judged)} nodes restarted before catching up decided nothing until they could;"
        f" {refused} claims and writes at them refused or unanswered meanwhile;"
        f" {pauses} paused nodes granted nothing until they could have settled"
        + (f"; {len(twins)} twins decided nothing ({asked} calls refused)" if twins else "")
    )
    return Verdict(
        "10. catching up before deciding",
        not problems,
        detail,
        {
            "faults judged": len(judged),
            "refused or unanswered": refused,
            "pauses judged": pauses,
            "twins": len(twins),
        },
    )


def twin_decisions(history: History, twins: Sequence[Played]) -> list[str]:
    """What the twins of ``twins`` decided: each must have said it serves no claims, and
    acknowledged no grant, renewal, release or fenced write."""
    problems = []
    for fault in twins:
        region, who = fault.targets[0], twin_presser(fault.targets[0])
        if fault.serving_early:
            problems.append(
                f"the twin of {region} said it served claims at {fault.serving_early:.1f} s"
            )
        for event in history.events:
            if event.agent == who and event.op in DECIDED and event.outcome == "ok":
                problems.append(
                    f"the twin of {region} acknowledged {who}'s {event.op} of {event.key}"
                    f" (token {event.token}) at {event.completed - history.started:.1f} s"
                )
    return problems


def forgeries_refused(played: Sequence[Played]) -> Verdict:
    """11. Forgeries refused: no forged state pushed during a ``forge`` fault merged,
    none refused by another rule than the one named for it (it would not have tested
    that rule), and every kind of forgery refused by its rule at least once."""
    faults = [f for f in played if f.kind == "forge" and f.injected]
    pushed = [push for f in faults for push in f.forged]
    # A kept forgery (forger.KEPT) is merged as evidence: it must leave the home.
    merged = [p for p in pushed if p.merged and (p.forgery not in KEPT or not p.home_kept)]
    judged = [p for p in pushed if p not in merged]
    otherwise = [p for p in judged if p.refused and p.refused != p.rule]
    by_rule = [p for p in judged if p.refused == p.rule]
    unseen = len(pushed) - len(merged) - len(otherwise) - len(by_rule)
    problems = [
        f"a {p.forgery} forgery of {p.key} was merged"
        + (" and moved its home" if p.forgery in KEPT else "")
        for p in merged[:3]
    ]
    problems += [
        f"a {p.forgery} forgery of {p.key} was refused {p.refused}, not {p.rule}"
        for p in otherwise[:3]
    ]
    if not pushed:
        problems.append("no forged state was pushed: nothing to judge")
    else:
        never = sorted(set(RULES) - {p.forgery for p in by_rule})
        if never:
            problems.append(f"never refused by its rule: {', '.join(never)}")
    reasons = Counter(p.rule for p in by_rule)
    detail = "; ".join(problems) or (
        f"{len(pushed)} forged states pushed in {len(faults)} faults, none merged;"
        f" {len(by_rule)} refused by their rule ("
        + ", ".join(f"{rule} {n}" for rule, n in sorted(reasons.items()))
        + ")"
        + (f", {unseen} with no refusal seen" if unseen else "")
    )
    return Verdict(
        "11. forgeries refused",
        not problems,
        detail,
        {
            "pushed": len(pushed),
            "merged": len(merged),
            "refused by their rule": len(by_rule),
            "refused by another rule": len(otherwise),
            "no refusal seen": unseen,
        },
    )

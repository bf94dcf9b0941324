"""The chaos tier's checker: five invariants over the history and the final states.

Each invariant is judged on its own and reported separately (docs/chaos.md says
what each means and what it does not promise):

1. fencing safety — no fenced write accepted with a token lower than one already
   granted for that record, none from a worker after it was told ``superseded``,
   none from a worker that stalled past its lease;
2. tokens strictly increase — per record, across every grant, restarts and disk
   loss included; no token granted to two owners;
3. no acknowledged write lost — every acknowledged write (each to a field of its
   own) and every acknowledged creation is in every region's final state. The
   one exception is SPEC's: a write acknowledged by a node that then lost its
   disk before it had been connected to its peers for ``DISK_LOSS_GRACE_S`` may
   be gone with that disk; such writes are counted and listed, never hidden;
4. convergence — after the final heal every region holds byte-identical records
   within ``CONVERGE_ROUNDS`` anti-entropy rounds; the time it took is reported;
5. availability — while the network is faulty (partitions, packet loss, a slow
   link) every region keeps serving reads and unfenced writes to unclaimed
   records; home-only calls that cannot be served fail fast, with a reason.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from fencemark.client import Record
from fencemark.node.workload import Event, History, fencing_safety, grants_by_key, tokens_increase
from tests.chaos.nemesis import PARTITIONS, Played
from tests.chaos.workload import CALL_TIMEOUT_S

NETWORK_FAULTS = (*PARTITIONS, "loss", "slow")
DISK_LOSS_GRACE_S = 5.0  # healthy seconds a node had to pass a write on before a wipe
CONVERGE_ROUNDS = 20  # anti-entropy rounds convergence may take after the final heal
# A home-only call at a node that is not the record's home is refused within this;
# generous because three nodes and the test share two cores: it separates an
# answer from a hang, it is not a latency target (bench/ measures latency).
WRONG_REGION_FAST_S = 2.0
# A failed home-only call of an agent returns within its deadline, plus this for
# the test process's own scheduling.
DEADLINE_SLACK_S = 1.0
HOME_ONLY_OPS = ("claim", "write", "renew", "finish", "release")


@dataclass
class Verdict:
    name: str
    ok: bool
    detail: str
    numbers: dict[str, float] = field(default_factory=dict)


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
) -> list[Verdict]:
    grants = grants_by_key(history)
    fencing = fencing_safety(history, grants)
    tokens = tokens_increase(grants)
    return [
        Verdict(
            "1. fencing safety",
            fencing.ok,
            fencing.detail,
            {
                "fenced writes acknowledged": _count(history, ("write", "finish"), "ok"),
                "stale writes refused": _count(history, ("stale-write",), "fail"),
            },
        ),
        token_order(tokens.ok, tokens.detail, grants, played, homes, history.started),
        acknowledged_writes(history, played, finals, homes),
        converged(convergence),
        availability(history, played),
    ]


def _count(history: History, ops: Sequence[str], outcome: str) -> float:
    return float(sum(e.op in ops and e.outcome == outcome for e in history.events))


# -- 2. tokens --------------------------------------------------------------------------


def token_order(
    ok: bool,
    detail: str,
    grants: Mapping[str, Sequence[Event]],
    played: Sequence[Played],
    homes: Mapping[str, str],
    started: float,
) -> Verdict:
    """The token check, and how often it was put to the test: records granted both
    before and after their home region was killed or lost its disk."""
    crossed = {"kill": 0, "wipe": 0}
    for key, events in grants.items():
        times = [e.completed - started for e in events]
        for fault in played:
            if fault.kind in crossed and fault.targets[0] == homes.get(key):
                before = any(t < fault.started for t in times)
                after = any(t > fault.ended for t in times)
                crossed[fault.kind] += before and after
    if ok:
        detail += (
            f"; {crossed['kill']} records granted again after their home was"
            f" killed, {crossed['wipe']} after it lost its disk"
        )
    return Verdict(
        "2. tokens strictly increase",
        ok,
        detail,
        {
            "grants": sum(len(g) for g in grants.values()),
            "records granted across a kill -9": crossed["kill"],
            "records granted across a disk loss": crossed["wipe"],
        },
    )


# -- 3. acknowledged writes ------------------------------------------------------------


def acked_by(event: Event, homes: Mapping[str, str]) -> str:
    """The region whose node acknowledged ``event``: fenced writes and creations are
    decided at the record's home; a probe's note at the probe's own region."""
    if event.op == "note" or event.agent.startswith("probe-"):
        return event.agent.removeprefix("probe-")
    return homes.get(event.key, "")


def lost_with_disk(acked_at: float, region: str, played: Sequence[Played]) -> bool:
    """Whether ``region`` lost its disk after a write it acknowledged at ``acked_at``
    (seconds since the run started, like the faults' times) before it could pass it
    on: fewer than DISK_LOSS_GRACE_S healthy seconds between the ack and the wipe."""
    for wipe in played:
        # The kill lands a moment after the fault starts: a write acknowledged in
        # between was acknowledged by the node whose disk is then lost.
        lost_at = wipe.down_at or wipe.started
        if wipe.kind != "wipe" or wipe.targets[0] != region or lost_at < acked_at:
            continue
        healthy_since = acked_at
        for fault in played:
            touches = region in fault.targets or fault.kind in ("loss", "slow")
            if touches and fault is not wipe and healthy_since < fault.ended <= wipe.started:
                healthy_since = fault.ended
        return lost_at - healthy_since < DISK_LOSS_GRACE_S
    return False


def acknowledged_writes(
    history: History,
    played: Sequence[Played],
    finals: Mapping[str, Mapping[str, Record]],
    homes: Mapping[str, str],
) -> Verdict:
    acked = [e for e in history.events if e.outcome == "ok" and e.op in ("write", "note", "create")]
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
        f"{len(acked)} acknowledged writes and creations, in all {len(finals)} regions"
        + (f" ({len(exempt)} lost with a wiped disk before they could replicate)" if exempt else "")
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


def availability(history: History, played: Sequence[Played]) -> Verdict:
    windows = [(f.started, f.ended, f.kind) for f in played if f.kind in NETWORK_FAULTS]
    problems: list[str] = []
    served = 0
    slowest_refusal = 0.0

    def during(event: Event) -> str | None:
        at = event.invoked - history.started
        return next((kind for start, end, kind in windows if start <= at <= end), None)

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
            if event.detail != "wrong_region" or took > WRONG_REGION_FAST_S:
                problems.append(
                    f"{event.agent} home-only call at a non-home node:"
                    f" {event.outcome} {event.detail!r} in {took:.2f} s"
                )
        elif event.op in HOME_ONLY_OPS and event.outcome != "ok":
            slowest_refusal = max(slowest_refusal, took)
            if took > CALL_TIMEOUT_S + DEADLINE_SLACK_S or not event.detail:
                problems.append(
                    f"{event.agent} {event.op} {event.key} took {took:.2f} s"
                    f" to {event.outcome} ({event.detail!r}) during {kind}"
                )
    if not windows:
        problems.append("no network fault was played: nothing to judge")
    elif not served:
        problems.append("no read or unfenced write was probed during a network fault")
    detail = "; ".join(problems[:3]) or (
        f"{served} reads and unfenced writes served during {len(windows)} network faults;"
        f" refused home-only calls answered within {slowest_refusal:.2f} s"
    )
    return Verdict(
        "5. availability",
        not problems,
        detail,
        {
            "served during faults": served,
            "problems": len(problems),
            "slowest refusal s": round(slowest_refusal, 3),
        },
    )

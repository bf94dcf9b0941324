"""The invariants about claims: 1, 2, 7, 8, 9 and 14 (checker.py has the others).

``claims.py`` says what a claim, its life and its end are, and what a split-born
id is; docs/chaos.md says what each invariant means.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from fencemark.client import Record
from fencemark.node.tools.workload import Event, History
from tests.chaos.claims import (
    CLOCK_SLACK_S,
    FENCED_WRITES,
    INF,
    LOST_WITH_DISK,
    RENEWALS,
    Claim,
    Ending,
    Span,
    Split,
    by_key,
    exempt,
    lost_with_disk,
)
from tests.chaos.nemesis import DISK_LOSSES, ROLLBACK, TWIN, Played

# Fenced writes a holder made (a stalled worker's must be refused): a write, the
# ``status=done`` of a finish, and a queue agent's ``result`` written with its release.
ACKED_WRITES = ("write", "finish", "done")
# What a worker woken from a stall past its lease (``agent-pause``) writes and renews
# with its old token, and what it must be told (docs/chaos.md, invariant 1): its
# lease lapsed, or a newer claim was granted since.
STALE_OPS = ("stale-write", "stale-renew")
STALE_REFUSALS = ("superseded", "expired")
# How a write (the client's error) and a renewal (the outcome) of a deleted record
# are refused: no test of the fence, unless nothing deleted the record.
GONE = ("NotFound", "missing")


@dataclass
class Verdict:
    name: str
    ok: bool
    detail: str
    numbers: dict[str, float] = field(default_factory=dict)


# -- 1. fencing safety -----------------------------------------------------------------


@dataclass(frozen=True)
class Wake:
    """One ``agent-pause`` as its worker lived it: the item it stalled on, and how
    its write and renewal with the old token were answered once it woke (``accepted``,
    the refusal, ``unknown (<why>)``; ``""``: not made). ``problem``: what violates
    invariant 1 in them; ``untested``: why the pause tested no fencing (``""``: it
    did)."""

    agent: str
    at: float  # the fault's start, run clock
    key: str = ""
    token: int = 0
    write: str = ""
    renewal: str = ""
    problem: str = ""
    untested: str = ""

    @property
    def fenced(self) -> bool:
        """Its write was refused as promised, and nothing in its wake violated 1."""
        return not self.problem and not self.untested

    @property
    def verdict(self) -> str:
        if self.problem:
            return f"VIOLATED: {self.problem}"
        if self.untested:
            return f"did not test fencing: {self.untested}"
        return "fenced"


def answer(event: Event | None) -> str:
    if event is None:
        return ""
    if event.outcome == "ok":
        return "accepted"
    return event.detail if event.outcome == "fail" else f"unknown ({event.detail})"


def deleted_before(history: History, key: str, before: float) -> Event | None:
    """A delete of ``key`` sent before ``before`` (monotonic) that may have landed."""
    return next(
        (
            e
            for e in history.events
            if e.key == key
            and e.op == "meddle-delete"
            and e.outcome != "fail"
            and e.invoked < before
        ),
        None,
    )


def stale_problem(history: History, event: Event) -> str:
    """What is wrong with a woken stalled worker's write or renewal ``event`` (``""``:
    nothing): accepted, or refused for another reason than ``superseded`` or
    ``expired`` — but ``missing`` after a delete of its record that may have landed."""
    if event.outcome == "ok":
        what = "wrote" if event.op == "stale-write" else "renewed"
        return f"{event.agent} {what} {event.key} with a lapsed token {event.token}"
    if event.outcome != "fail" or event.detail in STALE_REFUSALS:
        return ""
    if event.detail in GONE and deleted_before(history, event.key, event.completed):
        return ""
    return (
        f"{event.agent}'s {event.op.removeprefix('stale-')} of {event.key} with a lapsed token"
        f" {event.token} refused {event.detail!r}, not superseded or expired"
    )


def stale_wakes(history: History, played: Sequence[Played]) -> list[Wake]:
    """Each ``agent-pause``: its agent's first stale write and renewal from the fault's
    start until that agent's next pause, and whether they tested fencing. They did
    not if the worker never woke, its write's outcome is unknown, or its record was
    deleted (a delete already on its way when the worker got its grant: the meddlers
    leave a stalled worker's item alone)."""
    start = history.started
    pauses = [f for f in played if f.kind == "agent-pause"]
    wakes = []
    for fault in pauses:
        agent = fault.targets[0]
        then = [f.started for f in pauses if f.targets[0] == agent and f.started > fault.started]
        until = min(then, default=INF)
        mine = [
            e
            for e in history.events
            if e.agent == agent and e.op in STALE_OPS and fault.started <= e.invoked - start < until
        ]
        write = next((e for e in mine if e.op == "stale-write"), None)
        renewal = next((e for e in mine if e.op == "stale-renew"), None)
        if write is None:
            wakes.append(Wake(agent, fault.started, untested="its worker did not stall and wake"))
            continue
        untested = ""
        if write.outcome == "unknown":
            untested = f"its write's outcome is unknown ({write.detail})"
        elif write.outcome == "fail" and write.detail in GONE:
            gone = deleted_before(history, write.key, write.completed)
            if gone is not None:
                untested = f"its item was deleted by {gone.agent} at {gone.invoked - start:.1f} s"
        problem = "; ".join(
            found
            for e in (write, renewal)
            if e is not None and (found := stale_problem(history, e))
        )
        wakes.append(Wake(agent, fault.started, write.key, write.token, answer(write),
                          answer(renewal), problem, untested))  # fmt: skip
    return wakes


def fencing_safety(
    history: History,
    claims: Mapping[tuple[str, int, str], Claim],
    splits: Mapping[str, Split],
    played: Sequence[Played] = (),
) -> Verdict:
    """No fenced write accepted with a token below one already granted; none after its
    writer was told ``superseded``; none from a worker stalled past its lease, whose
    write and renewal must be refused ``superseded`` or ``expired`` (an
    ``agent-pause`` that did not test that is counted apart, and a run whose pauses
    all did not fails); and no write or renewal under a split-time token once the
    births met."""
    start = history.started
    grouped = by_key(claims)
    violations = []
    told = {
        (e.agent, e.key, e.token): e.completed
        for e in history.events
        if e.outcome == "fail" and e.detail == "superseded"
    }
    for event in history.events:
        if event.outcome != "ok" or event.op not in (*FENCED_WRITES, *RENEWALS):
            continue
        mine = claims.get((event.key, event.token, event.agent))
        sent = event.invoked - start
        if event.op in FENCED_WRITES:
            for other in grouped.get(event.key, []):
                if other.token > event.token and other.granted < sent and not exempt(mine, other):
                    violations.append(
                        f"{event.agent} wrote {event.key} with token {event.token}"
                        f" after token {other.token} was granted"
                    )
                    break
            since = told.get((event.agent, event.key, event.token))
            if since is not None and event.invoked > since:
                violations.append(f"{event.agent} wrote {event.key} after being told superseded")
        split = splits.get(event.key)
        if mine is not None and mine.split and split is not None and sent > split.met:
            when = (
                f"{sent - split.met:.1f} s after the births met"
                if split.met_seen
                else f"{sent - split.healed:.1f} s after the heal (the births never met)"
            )
            violations.append(
                f"{event.agent}'s {event.op} of {event.key} under split-time token"
                f" {event.token} accepted {when}"
            )
    # Written or renewed after the worker stalled past its lease: superseded or expired.
    violations += [
        problem
        for event in history.events
        if event.op in STALE_OPS and (problem := stale_problem(history, event))
    ]
    wakes = stale_wakes(history, played)
    fenced = Counter(w.write for w in wakes if w.fenced)
    untested = [w for w in wakes if w.untested and not w.problem]
    if wakes and len(untested) == len(wakes):  # judged nothing: no pass either
        violations.append(
            f"no agent pause tested fencing ({len(wakes)} played: "
            + "; ".join(f"{w.agent}: {w.untested}" for w in wakes[:3])
            + ")"
        )
    writes = sum(e.op in ACKED_WRITES and e.outcome == "ok" for e in history.events)
    stale = sum(e.op == "stale-write" and e.outcome == "fail" for e in history.events)
    pauses = (
        f"; of {len(wakes)} agent pauses, {sum(fenced.values())} woken workers refused as"
        " promised ("
        + ", ".join(f"{reason} {n}" for reason, n in sorted(fenced.items()))
        + ")"
        + (
            f", {len(untested)} did not test fencing ("
            + "; ".join(f"{w.agent}: {w.untested}" for w in untested[:3])
            + ")"
            if untested
            else ""
        )
        if wakes
        else ""
    )
    return Verdict(
        "1. fencing safety",
        not violations,
        "; ".join(violations[:3]) or "no write got through with a stale token" + pauses,
        {
            "fenced writes acknowledged": writes,
            "stale writes refused": stale,
            "agent pauses": len(wakes),
            "agent pauses fenced": sum(fenced.values()),
            "agent pauses that did not test fencing": len(untested),
        },
    )


# -- 2. tokens strictly increase -------------------------------------------------------


def token_order(
    claims: Mapping[tuple[str, int, str], Claim],
    played: Sequence[Played],
    homes: Mapping[str, str],
) -> Verdict:
    """Per record, a grant that completed before another was sent has the smaller token
    (calls that overlapped may complete in either order); and how often that was put to
    the test: records granted both before and after their home was killed, lost its disk,
    had its disk put back to an older copy, or was twinned (granted before the copy, and
    after the original decided again: above whatever either process granted)."""
    violations = []
    crossed = {"kill": 0, "wipe": 0, ROLLBACK: 0, TWIN: 0}
    grouped = by_key(claims)
    for key, records in grouped.items():
        grants = [(claim, span) for claim in records for span in claim.grants]
        for (first, (_, done)), (then, (sent, _)) in itertools.product(grants, grants):
            if first is then or exempt(first, then):
                continue
            if done < sent and first.token >= then.token:
                violations.append(f"{key}: token {then.token} granted after {first.token}")
        times = [done for _, (_, done) in grants]
        for fault in played:
            kind = "wipe" if fault.kind in DISK_LOSSES else fault.kind
            if kind not in crossed or fault.targets[0] != homes.get(key):
                continue
            if kind == ROLLBACK:  # granted in what its file then forgot, and again after
                before = any(fault.copied_at <= t < fault.down_at for t in times)
                after = any(t > fault.down_at for t in times)
            elif kind == TWIN:  # before the copy, and once the original decided again
                before = any(t < fault.started for t in times)
                after = bool(fault.deciding_again) and any(t > fault.deciding_again for t in times)
            else:
                before = any(t < fault.started for t in times)
                after = any(t > fault.ended for t in times)
            crossed[kind] += before and after
    count = sum(len(c.grants) for c in claims.values())
    detail = "; ".join(violations[:3]) or (
        f"{count} grants, in order; {crossed['kill']} records granted again after their home"
        f" was killed, {crossed['wipe']} after it lost its disk"
        + (f", {crossed[ROLLBACK]} after its disk went back in time" if crossed[ROLLBACK] else "")
        + (f", {crossed[TWIN]} after it was twinned" if crossed[TWIN] else "")
    )
    return Verdict(
        "2. tokens strictly increase",
        not violations,
        detail,
        {
            "grants": count,
            "records granted across a kill -9": crossed["kill"],
            "records granted across a disk loss": crossed["wipe"],
            "records granted across a rollback": crossed[ROLLBACK],
            "records granted across a twin": crossed[TWIN],
        },
    )


# -- 7. one live claim at a time ---------------------------------------------------------


def overlap(a: Sequence[Span], b: Sequence[Span]) -> Span | None:
    """The first stretch of time in both span lists longer than the clocks' slack."""
    for (a0, a1), (b0, b1) in itertools.product(a, b):
        start, end = max(a0, b0), min(a1, b1)
        if end - start > CLOCK_SLACK_S:
            return start, end
    return None


def one_live_claim(
    claims: Mapping[tuple[str, int, str], Claim], splits: Mapping[str, Split]
) -> Verdict:
    """Never two live claims on one record, but for claims different regions granted
    apart, before their births met."""
    violations = []
    allowed = 0
    for key, records in by_key(claims).items():
        for a, b in itertools.combinations(records, 2):
            if exempt(a, b):
                met = splits[key].met
                allowed += overlap(a.live(met), b.live(met)) is not None
                continue
            both = overlap(a.live(), b.live())
            if both is not None:
                violations.append(
                    f"{key}: {a.owner} (token {a.token}, from {a.region}) and {b.owner} (token"
                    f" {b.token}, from {b.region}) live from {both[0]:.2f} s to {both[1]:.2f} s"
                )
    cut = sum(any(a.cut < min(a.expires, c.stop) for a in c.acks) for c in claims.values())
    detail = "; ".join(violations[:3]) or (
        f"{len(claims)} claims on {len(by_key(claims))} records, never two live at once"
        f" ({allowed} overlaps of claims granted on both sides of a split, before the births"
        f" met; {cut} claims cut short by their home's disk loss)"
    )
    return Verdict(
        "7. one live claim at a time",
        not violations,
        detail,
        {"claims": len(claims), "split overlaps before meeting": allowed, "cut by disk loss": cut},
    )


# -- 8. a token is granted once ----------------------------------------------------------


def granted_once(claims: Mapping[tuple[str, int, str], Claim], lease_seconds: float) -> Verdict:
    """No token granted to two owners (but on both sides of a split), nor to one owner
    again once its claim had been released, refused or had lapsed (a retry of a live
    claim gets its own token back: an idempotent retry, SPEC §4)."""
    violations = []
    retries = 0
    for key, records in by_key(claims).items():
        for a, b in itertools.combinations(records, 2):
            if a.token == b.token and not exempt(a, b):
                violations.append(f"{key}: token {a.token} granted to {a.owner} and {b.owner}")
        for claim in records:
            for sent, _ in claim.grants[1:]:
                retries += 1
                if claim.refused_or_released < sent:
                    why = "after it was released or refused"
                elif sent > claim.lease_bound(sent, lease_seconds) + CLOCK_SLACK_S:
                    why = "after its lease had lapsed"
                else:
                    continue
                violations.append(
                    f"{key}: token {claim.token} granted to {claim.owner} again at {sent:.2f} s,"
                    f" {why}"
                )
    detail = "; ".join(violations[:3]) or (
        f"{sum(len(c.grants) for c in claims.values())} grants, each token once"
        f" ({retries} idempotent retries of a live claim)"
    )
    return Verdict(
        "8. a token is granted once",
        not violations,
        detail,
        {"idempotent retries": retries, "violations": len(violations)},
    )


# -- 9. fenced writes survive --------------------------------------------------------------


def fenced_writes_survive(
    history: History,
    claims: Mapping[tuple[str, int, str], Claim],
    finals: Mapping[str, Mapping[str, Record]],
    homes: Mapping[str, str],
    played: Sequence[Played],
) -> Verdict:
    """Every acknowledged fenced write is in every region's final state, unless a write
    with a higher epoch overwrote its field: a later fenced write, or an unfenced write
    or delete that may have been admitted after its claim ended."""
    start = history.started
    written: dict[tuple[str, str], list[Event]] = {}  # (key, value) -> writes that wrote it
    deletes: dict[str, list[Event]] = {}
    for event in history.events:
        if event.outcome not in ("ok", "unknown"):
            continue
        if event.op in (*FENCED_WRITES, "meddle"):
            written.setdefault((event.key, event.value), []).append(event)
        elif event.op == "meddle-delete":
            deletes.setdefault(event.key, []).append(event)

    def excuse(write: Event, end: float, record: Record | None) -> tuple[bool, str]:
        """Whether ``write``'s absence from ``record`` is explained, and how."""
        if record is None:
            return False, "record missing"
        value = "" if record.deleted else record.fields.get(write.detail, "")
        if not value:  # erased: a delete clears every field
            after = [d for d in deletes.get(write.key, []) if d.completed > write.invoked]
            if any(d.completed - start > end for d in after):
                return True, "erased by a delete after its claim ended"
            for d in after:
                return False, (
                    f"erased by an unfenced delete at {_region(d)} ({d.outcome},"
                    f" {d.completed - start:.2f} s) while token {write.token} was unreleased"
                )
            return False, "deleted" if record.deleted else "missing"
        for other in written.get((write.key, value), []):
            if other.op != "meddle":
                if other.token > write.token:
                    return True, f"overwritten under token {other.token}"
                return False, f"overwritten by {other.agent}'s write under token {other.token}"
            if other.completed - start > end:
                return True, "overwritten by an unfenced write after its claim ended"
            return False, (
                f"overwritten by an unfenced write at {_region(other)} ({other.outcome},"
                f" {other.completed - start:.2f} s) while token {write.token} was unreleased"
            )
        return False, f"holds {value!r}, which no write in the history explains"

    acked = [e for e in history.events if e.op in ACKED_WRITES and e.outcome == "ok"]
    violations: list[str] = []
    overwritten = lost = 0
    for write in acked:
        claim = claims.get((write.key, write.token, write.agent))
        absent = [
            (region, records.get(write.key))
            for region, records in finals.items()
            if not _holds(records.get(write.key), write)
        ]
        if not absent:
            continue
        excused, why = excuse(write, claim.end if claim else INF, absent[0][1])
        if excused:
            overwritten += 1
            continue
        acked_at = write.completed - start
        if lost_with_disk(acked_at, claim.region if claim else homes.get(write.key, ""), played):
            lost += 1
            continue
        violations.append(
            f"{write.agent}'s {write.op} {write.key} {write.detail}={write.value}"
            f" (token {write.token}) {why}, at {','.join(r for r, _ in absent)}"
        )
    kept = len(acked) - overwritten - lost
    detail = "; ".join(violations[:3]) or (
        f"{len(acked)} acknowledged fenced writes: {kept} in every region's final state,"
        f" {overwritten} overwritten under a newer claim or after theirs ended"
        + (f", {lost} {LOST_WITH_DISK}" if lost else "")
    )
    return Verdict(
        "9. fenced writes survive",
        not violations,
        detail,
        {
            "acknowledged": len(acked),
            "overwritten legitimately": overwritten,
            "lost with a disk": lost,
            "violations": len(violations),
        },
    )


def _holds(record: Record | None, write: Event) -> bool:
    return (
        record is not None and not record.deleted and record.fields.get(write.detail) == write.value
    )


def _region(event: Event) -> str:
    return event.agent.removeprefix("meddler-")


# -- 14. every lapsed lease is recorded -------------------------------------------------

# After a lease's end, how long its home may take to record the lapse: its watcher
# looks within milliseconds, but a home that is down, frozen or catching up records
# it once it decides again, and the final states are read after every fault healed.
LAPSE_GRACE_S = 5.0
STANDING = ("granted", "renewed")  # claim events that leave a claim unreleased


def forgot_the_end(ending: Ending, ran_out: float, played: Sequence[Played]) -> bool:
    """Whether ``ending``'s home went back in time (``rollback``) to a copy that holds
    the event but not the end that followed it: the end came later than the copy, and
    the file, put back, forgot it; the end then comes back merged from the peers, and a
    merge is no decision of the home's, so its history never shows it."""
    return any(
        fault.kind == ROLLBACK
        and fault.targets[0] == ending.home
        and fault.copied_at
        and ending.at <= fault.copied_at + CLOCK_SLACK_S
        and ran_out + LAPSE_GRACE_S > fault.copied_at
        for fault in played
    )


def leases_recorded(
    history: History,
    endings: Sequence[Ending],
    unread: int,
    played: Sequence[Played],
    lease_seconds: float,
) -> Verdict:
    """Every claim whose lease ran out at its home ended there: a record whose home's
    latest claim event, read at the end, is a grant or renewal whose lease (the
    longest any reply of the record named, or ``lease_seconds``) ran out more than
    ``LAPSE_GRACE_S`` before was never lapsed nor released — a change that landed
    without the lapse watcher hearing of it (a caller cancelled mid-commit)."""
    leases: dict[str, float] = {}
    for event in history.events:
        if event.outcome == "ok" and event.expires and event.op in ("grant", *RENEWALS):
            asked = event.expires - event.completed
            leases[event.key] = max(leases.get(event.key, lease_seconds), asked)
    violations = []
    standing = ended = forgotten = 0
    for ending in endings:
        if ending.kind not in STANDING:
            ended += bool(ending.kind)
            continue
        ran_out = ending.at + leases.get(ending.key, lease_seconds)
        if ending.read_at - ran_out <= LAPSE_GRACE_S:
            standing += 1
            continue
        if forgot_the_end(ending, ran_out, played):
            forgotten += 1
            continue
        violations.append(
            f"{ending.key}: token {ending.token} of {ending.owner}, {ending.kind} by {ending.home}"
            f" at {ending.at:.2f} s, ran out by {ran_out:.2f} s, neither lapsed nor released"
            f" at {ending.read_at:.2f} s"
        )
    if not endings:
        violations.append("no record's claim history was read: nothing judged")
    detail = "; ".join(violations[:3]) or (
        f"{len(endings)} claimed records' histories read at their homes: {ended} claims ended"
        f" (released, lapsed or taken back), {standing} still within their lease and"
        f" {LAPSE_GRACE_S:.0f} s, none left standing past it"
        + (f"; {forgotten} ends forgotten by a rollback of the home" if forgotten else "")
        + (f"; {unread} histories unread" if unread else "")
    )
    return Verdict(
        "14. every lapsed lease is recorded",
        not violations,
        detail,
        {
            "histories": len(endings),
            "ended": ended,
            "within lease": standing,
            "forgotten by a rollback": forgotten,
            "unread": unread,
            "violations": len(violations),
        },
    )

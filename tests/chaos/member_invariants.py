"""The invariants of a region of several members under its nemesis (SPEC §10), judged
on what the clients lived (``test_member_chaos.py``): each a :class:`Verdict`.

Times are the test's monotonic seconds. A call took effect at the node somewhere
between its sending and its answer, so each rule below condemns only what no
ordering of those effects explains:

1. *no live claim granted again*: a grant of an item answered before another grant
   of it was sent, and within that grant's lease, while its holder had not yet asked
   to release it; or a grant sent after its item's ``done`` was answered;
2. *tokens rise*: of two grants of one item, the later (sent after the earlier was
   answered) carries the larger token, and no token is granted twice;
3. *no item done twice*: one ``released`` answer per item and outcome ``done``;
4. *no acknowledged write lost*: every write acknowledged to the writer is on every
   node at the end, and the holder's last acknowledged counter is there (or a later
   one);
5. *holders keep their claims*: no renewal or fenced write of a holder refused for
   its claim (only a failover's transient refusals, asked again);
6. *a decider after each fault*: one member decides within ``limit_s`` of every heal;
7. *a cut-off decider is replaced*: a decider cut off from its fellow members (while
   it still reaches etcd) is followed by another member deciding within ``limit_s``
   of the cut, before it heals.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from fencemark.client import Record
from tests.chaos.checker import Verdict

MAX_LISTED = 5


@dataclass(frozen=True)
class Grant:
    key: str
    token: int
    owner: str
    sent: float
    answered: float


@dataclass(frozen=True)
class Release:
    key: str
    token: int
    sent: float
    answered: float
    released: bool  # the node said so: the item is done


def _listed(items: Sequence[str]) -> str:
    more = f" and {len(items) - MAX_LISTED} more" if len(items) > MAX_LISTED else ""
    return ", ".join(items[:MAX_LISTED]) + more


def claims_exclusive(
    grants: Sequence[Grant], releases: Sequence[Release], lease_s: float
) -> Verdict:
    """Rules 1 and 2 (see the module's text)."""
    asked: dict[tuple[str, int], float] = {}  # a claim's first release sent
    done: dict[str, float] = {}  # an item's first done answered
    for r in releases:
        asked[(r.key, r.token)] = min(asked.get((r.key, r.token), r.sent), r.sent)
        if r.released:
            done[r.key] = min(done.get(r.key, r.answered), r.answered)
    by_key: dict[str, list[Grant]] = defaultdict(list)
    for g in grants:
        by_key[g.key].append(g)
    problems: list[str] = []
    for key, given in by_key.items():
        given.sort(key=lambda g: g.sent)
        tokens = [g.token for g in given]
        if len(set(tokens)) != len(tokens):
            problems.append(f"{key}: a token granted twice ({sorted(tokens)})")
        for g in given:
            if key in done and g.sent > done[key]:
                problems.append(f"{key}: granted to {g.owner} after it was done")
        for first in given:
            live_until = min(first.sent + lease_s, asked.get((key, first.token), float("inf")))
            for later in given:
                if later is first or later.sent <= first.answered:
                    continue
                if later.token <= first.token:
                    problems.append(f"{key}: token {later.token} granted after token {first.token}")
                if later.answered < live_until:
                    problems.append(
                        f"{key}: granted to {later.owner} (token {later.token}) while"
                        f" {first.owner}'s claim (token {first.token}) was live"
                    )
    return Verdict(
        "claims exclusive",
        not problems,
        f"{len(grants)} grants of {len(by_key)} items: no live claim granted again, tokens rise"
        if not problems
        else _listed(problems),
        {"grants": len(grants), "items": len(by_key)},
    )


def done_once(releases: Sequence[Release]) -> Verdict:
    """Rule 3."""
    count: dict[str, int] = defaultdict(int)
    for r in releases:
        if r.released:
            count[r.key] += 1
    twice = sorted(key for key, n in count.items() if n > 1)
    return Verdict(
        "no item done twice",
        not twice,
        f"{len(count)} items done, each once" if not twice else f"done twice: {_listed(twice)}",
        {"done": len(count)},
    )


def acknowledged_kept(
    acked: Sequence[str],
    finals: Mapping[str, Mapping[str, Record] | None],
    held_key: str,
    held_count: int,
    counter: str,
) -> Verdict:
    """Rule 4: ``acked`` keys, and ``held_key``'s field ``counter`` at least
    ``held_count``, on every node of ``finals`` (None: the node did not answer)."""
    problems: list[str] = []
    for node, records in finals.items():
        if records is None:
            problems.append(f"{node} did not answer")
            continue
        missing = [key for key in acked if key not in records]
        if missing:
            problems.append(f"{node} lacks {len(missing)} acknowledged: {_listed(missing)}")
        if held_count:
            held = records.get(held_key)
            value = held.fields.get(counter, "") if held is not None else ""
            if not value.isdigit() or int(value) < held_count:
                problems.append(
                    f"{node} holds {held_key} at {counter}={value or 'nothing'},"
                    f" acknowledged {held_count}"
                )
    return Verdict(
        "no acknowledged write lost",
        not problems,
        f"{len(acked)} acknowledged writes and the holder's {held_count} on {len(finals)} nodes"
        if not problems
        else "; ".join(problems),
        {"acknowledged": len(acked), "holder_writes": held_count},
    )


def holders_kept(refusals: Sequence[str], renewals: int) -> Verdict:
    """Rule 5: ``refusals`` are the holder's calls refused for its claim."""
    return Verdict(
        "holders keep their claims",
        not refusals,
        f"{renewals} renewals and writes across every fault, none refused for the claim"
        if not refusals
        else _listed(list(refusals)),
        {"renewals": renewals},
    )


def decider_after_each(windows: Mapping[str, float | None], limit_s: float) -> Verdict:
    """Rule 6: ``windows`` is, per fault played, the seconds from its heal until one
    member decided (None: not within the nemesis' wait)."""
    return _waits(
        "a decider after each fault", windows, limit_s,
        lambda worst: f"after each of {len(windows)} faults within {worst:.1f} s",
        "no decider",
    )  # fmt: skip


def replaced_while_cut(windows: Mapping[str, float | None], limit_s: float) -> Verdict:
    """Rule 7: ``windows`` is, per fault that cut the decider off from its fellow
    members, the seconds from the cut until another member decided (None: not while
    the cut lasted)."""
    return _waits(
        "a cut-off decider is replaced", windows, limit_s,
        lambda worst: f"{len(windows)} deciders cut off from their members, each replaced"
        f" within {worst:.1f} s",
        "not replaced",
    )  # fmt: skip


def _waits(
    name: str,
    windows: Mapping[str, float | None],
    limit_s: float,
    held: Callable[[float], str],
    missed: str,
) -> Verdict:
    """A verdict on waits, one per fault (None: never ended): each within ``limit_s``."""
    late = [f"{fault}: {'none' if s is None else f'{s:.1f} s'}" for fault, s in windows.items()
            if s is None or s > limit_s]  # fmt: skip
    worst = max((s for s in windows.values() if s is not None), default=0.0)
    return Verdict(
        name,
        not late,
        f"{held(worst)} (limit {limit_s:g} s)" if not late
        else f"{missed} within {limit_s:g} s: {_listed(late)}",
        {"faults": len(windows), "worst_s": worst},
    )  # fmt: skip

"""Invariant 12, no item done twice: the work queue (``queue_work.py``) as judged from
the history and every region's final state (docs/chaos.md says what it means).

A queue item's *dones* are its holders' releases with outcome ``done``: those
acknowledged, and those whose outcome is unknown but that surely took effect (the
item's final state holds the ``result`` written with the release, in one commit,
and no later done overwrote it). A done whose outcome is unknown and that left no
such trace may not have happened, and proves nothing. Dones take effect in token
order (a done needs its token to be the fence; a grant after it moves the fence).

A *reopen* could have come between two moments ``a`` and ``b`` (an operation that
took effect within ``a``'s call, one within ``b``'s) when it was sent before ``b``
completed and completed after ``a`` was sent; a refused reopen changed nothing,
one whose outcome is unknown may have taken effect.

What is judged, per item:

1. done twice — no two dones of different tokens without a reopen that could have
   come between them;
2. handed out after done — no grant sent after a done was acknowledged, without a
   reopen that could have come between;
3. done stays done — an item whose done was acknowledged is ``done`` in every
   region's final state, unless a reopen could have come after;
4. done for a reason — an item ``done`` in a final state has a done (acknowledged or
   not) that could have come after every acknowledged reopen; its last outcome is
   ``done`` and it counts at least one attempt;
5. parked stays parked — a poison item (``maxAttempts:N``: every claim of it ends
   failed or lapsed) is granted at most N times without a reopen between, and
   counts at most N attempts in every final state.

*Not promised* (SPEC §6, as for invariants 3 and 9): a done its home acknowledged
and then lost with its disk before it had ``DISK_LOSS_GRACE_S`` healthy seconds to
pass it on; such an item may be handed out and done again. Those are counted
("lost with a wiped disk"), not hidden; as is every wipe of a poison item's home
between the grants judged in 5, since the attempts counted may be gone with it.
A home whose disk went back in time (``rollback``) forgot what it did after the
copy it was put back to, but its peers hold what it had time to pass on: only a
done (or, for 5, a grant) it acknowledged after the copy and within that grace
before the kill is excused, counted the same way.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from fencemark.client import Record
from fencemark.node.tools.workload import POISON, Event, History
from tests.chaos.claim_invariants import Verdict
from tests.chaos.claims import LOST_WITH_DISK, lost_with_disk
from tests.chaos.nemesis import DISK_LOSSES, ROLLBACK, Played
from tests.chaos.queue_work import is_queued

DONE, PARKED = "done", "parked"
MAX_ATTEMPTS_TAG = "maxAttempts:"


@dataclass
class Item:
    """One queue item's events, as the history shows them."""

    key: str
    grants: list[Event] = field(default_factory=list)
    dones: list[Event] = field(default_factory=list)  # acknowledged or unknown
    reopens: list[Event] = field(default_factory=list)  # acknowledged or unknown

    def reopen_between(self, a: Event, b: Event) -> bool:
        """Whether a reopen could have taken effect after ``a`` did and before ``b``."""
        return any(r.completed > a.invoked and r.invoked < b.completed for r in self.reopens)

    def reopened_after(self, a: Event) -> bool:
        return any(r.completed > a.invoked for r in self.reopens)


def items_of(history: History) -> dict[str, Item]:
    items: dict[str, Item] = {}
    for event in history.events:
        if not is_queued(event.key) or event.outcome not in ("ok", "unknown"):
            continue
        item = items.setdefault(event.key, Item(event.key))
        if event.op == "grant":
            item.grants.append(event)
        elif event.op == "done":
            item.dones.append(event)
        elif event.op == "reopen":
            item.reopens.append(event)
    return items


def _max_attempts(records: Iterable[Record]) -> int | None:
    """N of a poison item's ``maxAttempts:N`` (None: not a poison item)."""
    record = next(iter(records), None)
    if record is None or POISON not in record.tags:
        return None
    for tag in record.tags:
        count = tag.removeprefix(MAX_ATTEMPTS_TAG)
        if tag.startswith(MAX_ATTEMPTS_TAG) and count.isdigit():
            return int(count)
    return None


def no_item_done_twice(
    history: History,
    finals: Mapping[str, Mapping[str, Record]],
    homes: Mapping[str, str],
    played: Sequence[Played],
) -> Verdict:
    judge = _Judge(history, finals, homes, played)
    items = items_of(history)
    keys = sorted(set(items) | {k for records in finals.values() for k in records if is_queued(k)})
    again = parked = 0
    for key in keys:
        item = items.get(key, Item(key))
        states = {r: records[key] for r, records in finals.items() if key in records}
        sure = judge.sure_dones(item, states)
        again += len({d.token for d in sure}) > 1
        judge.done_twice(item, sure)
        acked = [d for d in sure if d.outcome == "ok"]
        judge.handed_out_after_done(item, acked)
        judge.done_stays_done(item, acked, states)
        judge.done_for_a_reason(item, states)
        parked += judge.parked_stays_parked(item, states)
    problems = judge.problems
    reopened = sum(r.outcome == "ok" for item in items.values() for r in item.reopens)
    acked_dones = sum(d.outcome == "ok" for item in items.values() for d in item.dones)
    if not acked_dones:
        problems.append("no queue item was acknowledged done: nothing to judge")
    if not parked:
        problems.append("no parked item was reopened: parking was never put to the test")
    lost = len(judge.lost)
    detail = "; ".join(problems[:3]) or (
        f"{len(keys)} queue items, {acked_dones} releases done acknowledged, never twice"
        f" without a reopen between ({again} items done again after one of {reopened}"
        f" reopens; {parked} poison items parked and reopened)"
        + (f"; {lost} dones {LOST_WITH_DISK}" if lost else "")
    )
    return Verdict(
        "12. no item done twice",
        not problems,
        detail,
        {
            "queue items": len(keys),
            "dones acknowledged": acked_dones,
            "done again after a reopen": again,
            "reopens": reopened,
            "lost with a disk": lost,
            "problems": len(problems),
        },
    )


class _Judge:
    """The five checks of the module docstring, one item at a time, into ``problems``."""

    def __init__(
        self,
        history: History,
        finals: Mapping[str, Mapping[str, Record]],
        homes: Mapping[str, str],
        played: Sequence[Played],
    ) -> None:
        self.start = history.started
        self.regions = sorted(finals)
        self.homes = homes
        self.played = played
        self.problems: list[str] = []
        self.lost: set[tuple[str, int]] = set()  # dones excused: lost with their home's disk

    def _gone(self, event: Event) -> bool:
        """Whether acknowledged ``event`` may be gone with its home's disk."""
        home = self.homes.get(event.key, "")
        return event.outcome == "ok" and lost_with_disk(
            event.completed - self.start, home, self.played
        )

    def _excused(self, done: Event) -> bool:
        if self._gone(done):
            self.lost.add((done.key, done.token))
            return True
        return False

    def sure_dones(self, item: Item, states: Mapping[str, Record]) -> list[Event]:
        """The dones that took effect, in token order: acknowledged, or whose result an
        item's final state holds."""
        results = {state.fields.get("result") for state in states.values()}
        sure = (d for d in item.dones if d.outcome == "ok" or d.value in results)
        return sorted(sure, key=lambda d: (d.token, d.invoked))

    def done_twice(self, item: Item, sure: Sequence[Event]) -> None:
        for a, b in itertools.pairwise(sure):
            if a.token != b.token and not item.reopen_between(a, b) and not self._excused(a):
                self.problems.append(
                    f"{item.key} done twice with no reopen between: {a.agent} (token"
                    f" {a.token}, {a.outcome}) and {b.agent} (token {b.token}, {b.outcome})"
                )

    def handed_out_after_done(self, item: Item, acked: Sequence[Event]) -> None:
        for a in acked:
            grant = next(
                (g for g in item.grants
                 if g.invoked > a.completed and not item.reopen_between(a, g)),
                None,
            )  # fmt: skip
            if grant is not None and not self._excused(a):
                self.problems.append(
                    f"{item.key} handed out again to {grant.agent} (token {grant.token}) at"
                    f" {grant.invoked - self.start:.2f} s, after {a.agent}'s done (token"
                    f" {a.token}) was acknowledged at {a.completed - self.start:.2f} s, with"
                    " no reopen between"
                )

    def done_stays_done(
        self, item: Item, acked: Sequence[Event], states: Mapping[str, Record]
    ) -> None:
        wrong = [f"{r}: {s.status}" for r, s in states.items() if s.status != DONE]
        wrong += [f"{r}: missing" for r in self.regions if r not in states]
        if not wrong:
            return
        for a in acked:
            if not item.reopened_after(a) and not self._excused(a):
                self.problems.append(
                    f"{item.key}: {a.agent}'s done (token {a.token}) was acknowledged, but the"
                    f" item is {', '.join(wrong)} in the final state, with no reopen after"
                )

    def done_for_a_reason(self, item: Item, states: Mapping[str, Record]) -> None:
        # An acknowledged reopen its home may have lost with its disk may not count.
        reopened = [r.invoked for r in item.reopens if r.outcome == "ok" and not self._gone(r)]
        last_reopen = max(reopened, default=0.0)
        for region, state in states.items():
            if state.status != DONE:
                continue
            if not any(d.completed > last_reopen for d in item.dones):
                self.problems.append(
                    f"{item.key} is done at {region} with no done release that could have"
                    " made it so after its last reopen"
                )
            elif state.last_outcome != DONE or state.attempts < 1:
                self.problems.append(
                    f"{item.key} is done at {region} with {state.attempts} attempts and last"
                    f" outcome {state.last_outcome!r}"
                )

    def parked_stays_parked(self, item: Item, states: Mapping[str, Record]) -> bool:
        """Judge a poison item; whether it was parked and reopened (as the operator saw)."""
        limit = _max_attempts(states.values())
        if limit is None:
            return False
        home = self.homes.get(item.key, "")
        grants = sorted(item.grants, key=lambda g: (g.token, g.invoked))
        for first, last in zip(grants, grants[limit:], strict=False):
            if not item.reopen_between(first, last) and not self._forgot(item, home, first, last):
                self.problems.append(
                    f"{item.key} (maxAttempts:{limit}) granted {limit + 1} times with no"
                    f" reopen between, tokens {first.token} to {last.token}: handed out"
                    " while parked"
                )
                break
        over = [f"{r}: {s.attempts}" for r, s in states.items() if s.attempts > limit]
        if over:
            self.problems.append(
                f"{item.key} counts more than {limit} attempts ({', '.join(over)})"
            )
        return any(r.value == PARKED and r.outcome == "ok" for r in item.reopens)

    def _forgot(self, item: Item, home: str, first: Event, last: Event) -> bool:
        """Whether ``home`` may have forgotten attempts of ``item`` counted between
        ``first`` was sent and ``last`` completed: it lost its disk meanwhile, or its
        disk went back in time and a grant of the item it acknowledged after the copy
        may have been forgotten with it before it could pass it on."""
        between = [
            f
            for f in self.played
            if f.targets[0] == home
            and first.invoked - self.start <= f.ended
            and f.started <= last.completed - self.start
        ]
        if any(f.kind in DISK_LOSSES for f in between):
            return True
        return any(f.kind == ROLLBACK for f in between) and any(map(self._gone, item.grants))

"""The work queue's checks for ``fencemark demo`` (SPEC §8), judged from what the nodes
themselves recorded: each item's final state and its home's claim history.

The home stamps every claim event with its own clock in commit order, so these
checks are exact, not statistical: no tolerance for concurrency is needed where the
home's order is the order of its commits.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

from fencemark.client import History, Record
from fencemark.node.tools.workload import POISON, POISON_ATTEMPTS, Check

UNPRIORITIZED = 10


def queue_checks(records: Mapping[str, Record], histories: Mapping[str, History]) -> list[Check]:
    """``records`` and ``histories`` by key, every item of the demo's topic."""
    return [
        done_once(records, histories),
        priority_order(records, histories),
        poison_parked(records, histories),
    ]


def _endings(history: History, word: str) -> int:
    return sum(
        1
        for event in history.events
        if event.kind in ("released", "lapsed") and word in event.detail.split()
    )


def done_once(records: Mapping[str, Record], histories: Mapping[str, History]) -> Check:
    """Every item but the poison one was released ``done`` exactly once."""
    wrong = [
        f"{record.id} done {_endings(histories[key], 'done')} times"
        for key, record in records.items()
        if record.id != POISON and _endings(histories[key], "done") != 1
    ]
    detail = "; ".join(wrong[:3]) or f"{len(records) - 1} items, each released done once"
    return Check("no item done twice", not wrong, detail)


def _priority(record: Record) -> int:
    levels = [int(tag[-1]) for tag in record.tags if tag.startswith("priority:P")]
    return min(levels, default=UNPRIORITIZED)


def _first_grant(history: History) -> datetime | None:
    return next((e.at for e in history.events if e.kind == "granted"), None)


def priority_order(records: Mapping[str, Record], histories: Mapping[str, History]) -> Check:
    """At each home, an item was first handed out no later than any item of a lower
    priority (P0 first): ``ClaimNext`` picks in order, and an item handed out later
    was never eligible earlier. Items waiting on ``after:`` links are left out."""
    inversions = []
    ordered = [
        (record.home_region, _priority(record), first, record.id)
        for key, record in records.items()
        if not any(tag.startswith("after:") for tag in record.tags)
        and (first := _first_grant(histories[key])) is not None
    ]
    for home, level, first, item in ordered:
        for other_home, other_level, other_first, other in ordered:
            if other_home == home and level < other_level and first > other_first:
                inversions.append(f"{item} (P{level}) after {other} (P{other_level}) at {home}")
    detail = "; ".join(inversions[:3]) or f"{len(ordered)} items, by priority at every home"
    return Check("items handed out in priority order within each home", not inversions, detail)


def poison_parked(records: Mapping[str, Record], histories: Mapping[str, History]) -> Check:
    """The item that always fails was parked after ``POISON_ATTEMPTS`` attempts."""
    poison = next((key for key, record in records.items() if record.id == POISON), None)
    if poison is None:
        return Check("the poison item parked", False, "no poison item")
    record, history = records[poison], histories[poison]
    parked_by = [e for e in history.events if "parked" in e.detail.split()]
    ok = record.status == "parked" and record.attempts == POISON_ATTEMPTS and len(parked_by) == 1
    detail = (
        f"status {record.status} after {record.attempts} attempts"
        f" ({POISON_ATTEMPTS} allowed); ended by {parked_by[0].kind if parked_by else 'nothing'}"
    )
    return Check(f"the poison item parked after {POISON_ATTEMPTS} attempts", ok, detail)

"""The demo's work-queue checks (``fencemark.node.tools.queue_checks``) fail on the
histories they exist to catch, not only pass on good ones."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from fencemark.client import ClaimEvent, History, Record
from fencemark.node.tools.queue_checks import done_once, poison_parked, priority_order
from fencemark.node.tools.workload import POISON

T0 = datetime(2026, 12, 2, tzinfo=UTC)


def item(id_: str, *tags: str, home: str = "us", status: str = "done", attempts: int = 1) -> Record:
    return Record(key=f"repo/r/mem/t/{id_}", repo="r", topic="t", id=id_, tags=tags,
                  home_region=home, status=status, attempts=attempts)  # fmt: skip


def events(*kinds: tuple[str, int, str]) -> History:
    """(kind, seconds after T0, detail) each."""
    return History(
        tuple(ClaimEvent(T0 + timedelta(seconds=s), kind, 1, "w", "", d) for kind, s, d in kinds),
        "us",
    )


def test_an_item_done_twice_or_never_fails_the_check() -> None:
    records = {"a": item("a"), "b": item("b")}
    once = events(("granted", 0, ""), ("released", 1, "done"))
    assert done_once(records, {"a": once, "b": once}).ok
    twice = events(("granted", 0, ""), ("released", 1, "done"), ("released", 2, "done"))
    never = events(("granted", 0, ""), ("lapsed", 1, ""))
    assert not done_once(records, {"a": twice, "b": once}).ok
    assert not done_once(records, {"a": once, "b": never}).ok


def test_a_lower_priority_item_handed_out_first_at_one_home_fails_the_check() -> None:
    records = {"p0": item("p0", "priority:P0"), "p2": item("p2", "priority:P2"),
               "late": item("late", "after:p0"), "eu": item("eu", home="eu")}  # fmt: skip
    first, second = events(("granted", 0, "")), events(("granted", 5, ""))
    good = {"p0": first, "p2": second, "late": first, "eu": first}
    assert priority_order(records, good).ok  # after: items and other homes left out
    assert not priority_order(records, {**good, "p0": second, "p2": first}).ok


def test_the_poison_item_must_be_parked_after_exactly_its_attempts() -> None:
    parked = item(POISON, status="parked", attempts=2)
    history = events(("released", 1, "failed"), ("released", 2, "failed parked"))
    assert poison_parked({"x": parked}, {"x": history}).ok
    assert not poison_parked({"x": item(POISON, status="open", attempts=2)}, {"x": history}).ok
    assert not poison_parked({"x": item(POISON, status="parked", attempts=3)}, {"x": history}).ok
    assert not poison_parked({}, {}).ok

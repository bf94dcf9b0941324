"""Invariant 13, watchers miss nothing: what each region's watcher of the run's
repository received, resumed across every fault, judged against the node's own feed,
the history's acknowledged writes and the node's final states (docs/chaos.md).

A watcher (``watchers.py``) follows its own region's node for the whole run. What it
received is a list of *segments*: one ``watch()`` each, which the client resumes by
itself across disconnects, restarts, ``kill -9``, pauses and cut-offs. A segment
ends when the node refuses its cursor ``CURSOR_EXPIRED``: after a lost disk the node
starts a new feed under a new node id, and the watcher starts its next segment at
the first change of that feed (``<node id>.0``: a new feed starts with an empty
store, so from its beginning it shows everything the node holds). The nodes keep a
feed window larger than a run makes (``cluster.FEED_WINDOW``): no cursor of a
node's own feed may expire.

Judged, per watcher:

1. order — within a segment every cursor names the segment's feed, and the seqs
   strictly increase: nothing repeated, nothing out of order;
2. feeds — a new feed only after a disk loss of that region (or its disk going back in
   time, ``rollback``: its feed went back with it), and a segment ends only expired,
   and then the next one is of another feed. A watcher resumed on a feed that went
   back in time, over ``seq``s its node then used again for other changes, is caught
   by 3 (the re-read holds other events under those cursors) or by its refusal here;
3. no gap — the segments of the node's current feed equal, event for event (cursor,
   kind, key, the state's digest), a fresh read of that feed at the end of the run
   over the same cursors, up to the end mark;
4. acknowledged writes — every write of the work queue the watcher's node acknowledged
   while a segment went on (sent after the watcher had the segment's first event,
   answered before its last one was committed: its commit is between theirs) is
   shown by an event of that segment: for a feed lost with its disk, which cannot be
   read again, this is the gap check. A write its node may have lost with its disk
   before it fed it or passed it on (a wipe, or a rollback to a copy taken before
   it: invariant 3's excuse, ``claims.lost_with_disk``) may have none;
5. final states — the state of every record the node listed between
   the two end marks is the watcher's view of it at a moment between the marks (its
   latest event of the record by then), and the watcher saw no record the node lacks.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from fencemark.node.store.feed import cursor as feed_cursor
from fencemark.node.store.feed import parse_cursor
from fencemark.node.tools.workload import Event, History
from tests.chaos.claim_invariants import Verdict
from tests.chaos.claims import LOST_WITH_DISK, lost_with_disk
from tests.chaos.nemesis import DISK_FAULTS, Played
from tests.chaos.queue_work import is_queued

# A write's commit is before an event's when it was answered this long before the
# event's commit time (the node's wall clock, converted to the test's monotonic clock
# when the event came).
SLACK_S = 0.1
# What an event of an acknowledged write shows. A grant that takes over a lapsed
# lease ends that claim in the same commit, whose word says more (api.md); a reopen
# of an item already open (the operator listed it a moment before) only resets it.
GRANTED = ("claimed", "lapsed", "parked")
REOPENED = ("reopened", "updated")


@dataclass(frozen=True)
class Seen:
    """One event as a watcher received it, or as the final re-read returned it.
    Two are equal when their cursor, kind, key and state digest are."""

    cursor: str
    kind: str
    key: str
    digest: bytes
    fence: int = field(default=0, compare=False)
    fields: Mapping[str, str] = field(default_factory=dict, compare=False)
    # When the node committed it (its wall clock at the change, a moment before the
    # commit), and when the watcher had it (after the commit), on the test's monotonic
    # clock (the nodes' clock is the host's).
    committed: float = field(default=0.0, compare=False)
    received: float = field(default=0.0, compare=False)


@dataclass
class Segment:
    """One ``watch()`` from ``start`` (``<feed>.0``: the beginning of a feed; ``""``:
    from now), resumed by the client until the node refused it (``ended``)."""

    start: str
    events: list[Seen] = field(default_factory=list)
    ended: str = ""  # "": followed to the end of the run; "expired: ..."; "refused: ..."

    @property
    def feed(self) -> str:
        named = self.start or (self.events[0].cursor if self.events else "")
        parsed = parse_cursor(named)
        return parsed[0] if parsed else ""


@dataclass
class WatchLog:
    """A region's watcher: its segments, and what the end of the run read at its node."""

    region: str
    segments: list[Segment] = field(default_factory=list)
    reread: list[Seen] = field(default_factory=list)  # the current feed, read afresh
    ends: dict[str, bytes] = field(default_factory=dict)  # key -> digest, between the marks
    problems: list[str] = field(default_factory=list)  # what the watcher could not do

    def current(self) -> list[Segment]:
        """The segments of the node's feed at the end: the last segment's."""
        feed = self.segments[-1].feed if self.segments else ""
        return [s for s in self.segments if s.feed == feed and feed]


def seq_of(cursor: str) -> int:
    parsed = parse_cursor(cursor)
    return parsed[1] if parsed else -1


def reread_from(log: WatchLog) -> str:
    """The cursor the final re-read of ``log``'s node starts from: where the first
    segment of its current feed did (before its first event, if it began from now)."""
    current = log.current()
    if not current:
        return ""
    first = current[0]
    if first.start or not first.events:
        return first.start
    feed, seq = first.feed, seq_of(first.events[0].cursor)
    return feed_cursor(feed, seq - 1)


def to_mark(events: Sequence[Seen], mark: str) -> list[Seen]:
    """``events`` through the first one of ``mark`` (all of them if it is not there)."""
    index = next((i for i, e in enumerate(events) if e.key == mark), len(events) - 1)
    return list(events[: index + 1])


# -- 1. order and 2. feeds -------------------------------------------------------------


def order_problems(log: WatchLog) -> list[str]:
    problems = []
    for number, segment in enumerate(log.segments):
        feed, last = segment.feed, seq_of(segment.start) if segment.start else -1
        for event in segment.events:
            parsed = parse_cursor(event.cursor)
            if parsed is None or parsed[0] != feed:
                problems.append(f"{log.region}: segment {number} of feed {feed} got {event.cursor}")
                break
            if parsed[1] <= last:
                word = "repeated" if parsed[1] == last else "out of order"
                problems.append(f"{log.region}: {event.cursor} {word}, after seq {last}")
                break
            last = parsed[1]
    return problems


def feed_problems(log: WatchLog, played: Sequence[Played]) -> list[str]:
    # A disk loss the engine then failed to finish (not injected) may have wiped it. A
    # disk put back to an older copy takes the feed back with it: a new feed may follow.
    losses = sum(1 for f in played if f.kind in DISK_FAULTS and f.targets[0] == log.region)
    problems = [f"{log.region}: {p}" for p in log.problems]
    feeds = [s.feed for s in log.segments]
    changes = sum(1 for a, b in itertools.pairwise(feeds) if a != b)
    if changes > losses:
        problems.append(f"{log.region}: {changes} new feeds after {losses} disk losses")
    for segment, after in zip(log.segments, [*log.segments[1:], None], strict=True):
        if segment.ended and not segment.ended.startswith("expired"):
            problems.append(f"{log.region}: a watch of feed {segment.feed} {segment.ended}")
        elif segment.ended and after is not None and after.feed == segment.feed:
            problems.append(f"{log.region}: a cursor of feed {segment.feed} expired in it")
    if not log.segments or not log.segments[0].events:
        problems.append(f"{log.region}: its watcher received nothing")
    return problems


# -- 3. no gap -----------------------------------------------------------------------------


def difference(region: str, got: Sequence[Seen], kept: Sequence[Seen]) -> str:
    """What ``got`` (a watcher's) lacks or has more than ``kept`` (the node's feed)."""
    if list(got) == list(kept):
        return ""
    mine, theirs = {e.cursor: e for e in got}, {e.cursor: e for e in kept}
    skipped = [e for e in kept if e.cursor not in mine]
    if skipped:
        first = skipped[0]
        return (f"{region}: gap: {len(skipped)} changes of the node's feed never received,"
                f" first {first.cursor} ({first.kind} {first.key})")  # fmt: skip
    extra = [e for e in got if e.cursor not in theirs]
    if extra:
        return f"{region}: {len(extra)} events the node's feed does not hold, first {extra[0]}"
    changed = next((e for e in got if e != theirs[e.cursor]), None)
    if changed is not None:
        held = theirs[changed.cursor]
        return f"{region}: {changed.cursor} received as {changed}, the feed holds {held}"
    return f"{region}: {len(got)} events received, {len(kept)} in the node's feed, in another order"


def forgotten(got: Sequence[Seen], reread: Sequence[Seen]) -> set[str]:
    """The cursors of ``got`` that a feed which went back in time forgot: absent from
    the re-read, and inside a jump of its ``seq``s — the new era the feed began after
    the rollback (``store.feed.era_start``), above every ``seq`` it forgot."""
    seqs = sorted(seq_of(e.cursor) for e in reread)
    held = set(seqs)
    lost = set()
    for event in got:
        seq = seq_of(event.cursor)
        if seq in held:
            continue
        at = bisect.bisect(seqs, seq)
        if 0 < at < len(seqs) and seqs[at] - seqs[at - 1] > 1:
            lost.add(event.cursor)
    return lost


def reread_problems(
    log: WatchLog, mark: str, *, rolled_back: bool = False
) -> tuple[list[str], int]:
    """The current feed's segments against the re-read of it; how many events matched.
    After a ``rollback`` of the watcher's node, the events of changes the node's file
    forgot are not in the re-read: they are left out of the comparison (``forgotten``),
    and everything the feed holds must still have been received."""
    if not any(e.key == mark for e in log.reread):
        return [f"{log.region}: the final re-read of its node's feed never reached the end"], 0
    problems, matched = [], 0
    current = log.current()
    for segment in current:
        got = to_mark(segment.events, mark) if segment is current[-1] else segment.events
        if rolled_back:
            lost = forgotten(got, log.reread)
            got = [e for e in got if e.cursor not in lost]
        if not got:
            continue
        low = seq_of(segment.start) if segment.start else seq_of(got[0].cursor) - 1
        high = seq_of(got[-1].cursor)
        kept = [e for e in log.reread if low < seq_of(e.cursor) <= high]
        problem = difference(log.region, got, kept)
        if problem:
            problems.append(problem)
        else:
            matched += len(got)
    return problems, matched


# -- 4. acknowledged writes --------------------------------------------------------------


def acked_at(event: Event, homes: Mapping[str, str]) -> str:
    """The region whose node acknowledged a write of the work queue: a creation and a grant
    name it; fenced writes, releases and reopens are decided at the record's home."""
    if event.op in ("create", "grant") and event.detail:
        return event.detail
    return homes.get(event.key, "")


def shows(write: Event, seen: Seen) -> bool:
    """Whether ``seen`` is the event of the acknowledged ``write``."""
    if seen.key != write.key:
        return False
    if write.op == "create":
        return seen.kind == "created"
    if write.op == "grant":
        return seen.kind in GRANTED and seen.fence == write.token
    if write.op == "write":
        return seen.fields.get(write.detail) == write.value
    if write.op == "done":
        return seen.kind == "done" and seen.fields.get(write.detail) == write.value
    if write.op == "fail":
        return seen.kind in ("failed", "parked") and seen.fence == write.token
    return write.op == "reopen" and seen.kind in REOPENED


WRITES = ("create", "grant", "write", "done", "fail", "reopen")


def writes_of(history: History, region: str, homes: Mapping[str, str]) -> list[Event]:
    """The work queue's writes ``region``'s node acknowledged."""
    acked = (e for e in history.events if e.outcome == "ok" and e.op in WRITES)
    return [e for e in acked if is_queued(e.key) and acked_at(e, homes) == region]


def unshown_writes(
    log: WatchLog,
    writes: Iterable[Event],
    played: Sequence[Played] = (),
    *,
    started: float = 0.0,
    slack: float = SLACK_S,
) -> tuple[list[str], int, int]:
    """Writes committed between two events of a segment that no event of it shows;
    how many writes were judged so, and how many of those were excused. A write sent
    after the first event had come, and answered before the last one's commit, was
    committed between the two. One its node may have lost with its disk before it
    fed or passed it on (``lost_with_disk``, from ``started``: the run's start on
    the writes' clock) may have no event: the file that would have fed it was
    wiped, or put back to a copy from before it — invariant 3 counts the same write
    as lost with its disk."""
    problems, judged, excused = [], 0, 0
    spans = [(s, s.events[0].received, s.events[-1].committed) for s in log.segments if s.events]
    for write in writes:
        within = [s for s, first, last in spans
                  if first < write.invoked and write.completed < last - slack]  # fmt: skip
        for segment in within:
            judged += 1
            if any(shows(write, seen) for seen in segment.events):
                continue
            if lost_with_disk(write.completed - started, log.region, played):
                excused += 1
                continue
            problems.append(
                f"{log.region}: gap: {write.agent}'s {write.op} of {write.key}"
                f" (token {write.token}) acknowledged by its node while its watcher"
                f" followed feed {segment.feed}, but no event of it came"
            )
    return problems, judged, excused


# -- 5. final states -----------------------------------------------------------------------


def final_problems(
    log: WatchLog, marks: tuple[str, str], *, rolled_back: bool = False
) -> tuple[list[str], int]:
    """The node's listing (between the marks) against the watcher's views then. After a
    ``rollback`` of the watcher's node, the events of changes its file forgot are left
    out (``forgotten``): a record created a moment before the kill and pushed to no
    peer was received, and is held by no node at the end (invariant 3 counts it)."""
    events = [e for s in log.current() for e in s.events]
    if rolled_back:
        lost = forgotten(events, log.reread)
        events = [e for e in events if e.cursor not in lost]
    where = {mark: next((i for i, e in enumerate(events) if e.key == mark), -1) for mark in marks}
    first, second = where[marks[0]], where[marks[1]]
    if first < 0 or second < 0 or not log.ends:
        return [f"{log.region}: its watcher never saw both end marks, or the node never listed"], 0
    if any(not s.start for s in log.current()):
        return [], 0  # from now: records not changed since are in no event (reported by 2)
    view = {e.key: {e.digest} for e in events[: first + 1]}
    for event in events[first + 1 : second]:
        view.setdefault(event.key, set()).add(event.digest)
    problems = []
    for key in sorted(set(log.ends) - set(marks)):
        if log.ends[key] not in view.get(key, set()):
            seen = "never received" if key not in view else "received other states"
            problems.append(f"{log.region}: {key}: its state at the node was {seen}")
    problems += [f"{log.region}: {key} received, not held by the node"
                 for key in sorted(set(view) - set(log.ends) - set(marks))]  # fmt: skip
    return problems, len(set(log.ends) - set(marks))


# -- the verdict ---------------------------------------------------------------------------


def watched_in_order(
    logs: Sequence[WatchLog],
    history: History,
    played: Sequence[Played],
    homes: Mapping[str, str],
    marks: tuple[str, str],
) -> Verdict:
    """13. Watchers miss nothing: every check of the module docstring, per watcher."""
    problems: list[str] = []
    matched = judged = excused = records = 0
    for log in logs:
        problems += order_problems(log) + feed_problems(log, played)
        rolled_back = any(f.kind == "rollback" and f.targets[0] == log.region for f in played)
        found, count = reread_problems(log, marks[1], rolled_back=rolled_back)
        problems, matched = problems + found, matched + count
        writes = writes_of(history, log.region, homes)
        found, count, lost = unshown_writes(log, writes, played, started=history.started)
        problems, judged, excused = problems + found, judged + count, excused + lost
        found, count = final_problems(log, marks, rolled_back=rolled_back)
        problems, records = problems + found, records + count
    if not logs:
        problems.append("no watcher: nothing judged")
    received = sum(len(s.events) for log in logs for s in log.segments)
    segments = sum(len(log.segments) for log in logs)
    detail = "; ".join(problems[:3]) or (
        f"{len(logs)} watchers, {received} events in {segments} segments, each in commit"
        f" order; {matched} equal to a fresh read of their node's feed,"
        f" {judged - excused} acknowledged writes shown ({excused} more {LOST_WITH_DISK}),"
        f" {records} records' final states received"
    )
    numbers: dict[str, float] = {
        "watchers": len(logs),
        "events": received,
        "segments": segments,
        "re-read equal": matched,
        "writes shown": judged - excused,
        "writes lost with a disk": excused,
        "final states": records,
        "problems": len(problems),
    }
    return Verdict("13. watchers miss nothing", not problems, detail, numbers)

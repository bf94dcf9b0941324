"""Following the change feed (SPEC §9, ``Records.Watch``): every change this node's
replica commits to the records of a repo (a topic, with tags), in commit order,
from a cursor.

The feed is a table in the node's SQLite file (``store.feed``), written in the
same commit as each change and trimmed to a window. A watcher reads it a page at a
time and, once it has caught up, waits for the next commit that grows it; so
watchers cost the write path nothing but that row, and one that reads slowly only
falls behind in the file. Resuming from a cursor returns every change after it
and nothing before: nothing is skipped, nothing repeated. A cursor the feed no
longer covers (trimmed, or of another feed) is refused ``CursorExpired``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from fencemark.node.core.replica import Replica
from fencemark.node.crdt import Record, codec
from fencemark.node.rules import validation
from fencemark.node.rules.errors import CursorExpired, InvalidInput, NotServing
from fencemark.node.store import feed
from fencemark.node.store.feed import Change
from fencemark.node.store.storage import Stored

K = TypeVar("K")
T = TypeVar("T")

PAGE = 256  # feed rows read at a time
PROGRESS = "progress"  # the kind of an event that is no change: the cursor moved on
PROGRESS_S = 1.0  # at most one progress event a second per watcher
SHARED = 4096  # recent changes kept decoded for every watcher (Recent)


@dataclass(frozen=True)
class Event:
    """A change (``stored``: the record as it left it), or with kind ``progress`` and
    no record, word that every change up to ``cursor`` was passed over."""

    cursor: str
    kind: str
    stored: Stored | None
    at_ms: int


@dataclass(frozen=True)
class Watch:
    """What one watcher asked for: the keys of ``repo`` (and ``topic``), the
    records carrying every tag of ``tags``, from after ``cursor`` ("": from now)."""

    repo: str
    topic: str = ""
    tags: Sequence[str] = ()
    cursor: str = ""

    def bounds(self) -> tuple[str, str]:
        return validation.key_range(self.repo, self.topic)

    def wants(self, record: Record) -> bool:
        return not self.tags or set(record.tag_values()).issuperset(self.tags)


class Recent(Generic[K, T]):
    """The last ``size`` things made for a node's watchers, by what they were made
    for (a change's ``seq``, an event's cursor): what every watcher of one change
    would otherwise make again — decode its state, build its message. A node's
    watchers read the same recent rows, nearly at once."""

    def __init__(self, size: int = SHARED) -> None:
        self.size = size
        self._made: dict[K, T] = {}

    def get(self, key: K, make: Callable[[], T]) -> T:
        made = self._made.get(key)
        if made is None:
            made = self._made[key] = make()
            if len(self._made) > self.size:
                del self._made[next(iter(self._made))]  # the oldest made
        return made


def decoded(change: Change) -> Stored:
    return Stored(codec.decode(change.state), codec.digest(change.state), len(change.state))


def shared_decode(recent: Recent[int, Stored]) -> Callable[[Change], Stored]:
    """``decoded``, once per change for every watcher that uses ``recent``."""
    return lambda change: recent.get(change.seq, lambda: decoded(change))


async def start(replica: Replica, watch: Watch) -> int:
    """The ``seq`` the watcher follows from; refuses a cursor the feed cannot resume."""
    watch.bounds()  # validates repo and topic
    validation.tags(list(watch.tags), "tags")
    if not watch.cursor:
        return replica.feed_last
    parsed = feed.parse_cursor(watch.cursor)
    if parsed is None:
        raise InvalidInput.field("cursor", "a cursor this node's Watch returned, or empty")
    feed_id, seq = parsed
    if feed_id != replica.feed_id:
        raise CursorExpired(watch.cursor, "is of another feed (another node, or a lost disk)")
    if seq > replica.feed_last and seq >= replica.feed_era:
        raise InvalidInput.field("cursor", "names a change this node's feed has not made")
    # A seq above the last but below this life's era is one the file forgot (it went
    # back in time): every change the feed makes now comes after it, none is skipped.
    if seq + 1 < await replica.feed_first():
        raise CursorExpired(watch.cursor, "is older than the changes this node keeps")
    return seq


async def follow(
    replica: Replica,
    watch: Watch,
    after: int,
    *,
    progress_s: float = PROGRESS_S,
    decode: Callable[[Change], Stored] = decoded,
) -> AsyncIterator[Event]:
    """Every change after ``seq`` ``after`` that ``watch`` wants, without end.

    A watcher whose filter passes over changes (of other keys, or without its tags)
    also gets a ``progress`` event, at most every ``progress_s`` once it has caught
    up: the cursor of the last change passed over, so that the cursor it would
    resume from moves on with the feed rather than fall out of the window while
    nothing it wants happens (etcd's progress notifications). ``decode`` makes a
    change's record (a :class:`Recent` shares it between watchers)."""
    lower, upper = watch.bounds()
    told, told_at = after, 0.0  # the seq the watcher last heard of, and when
    loop = asyncio.get_running_loop()
    while True:
        if replica.feed_ended:
            # The node is stopping: a stream that never ends would hold up the stop
            # for its whole grace (and the node refuses every new call meanwhile).
            raise NotServing("this node is stopping: watch again from the last cursor taken")
        last = replica.feed_last  # read before the page: every change up to it is in the file
        page = await replica.feed_changes(after, lower, upper, limit=PAGE)
        if after + 1 < await replica.feed_first():
            # Trimmed while this watcher fell behind: it would skip changes.
            raise CursorExpired(feed.cursor(replica.feed_id, after), "fell out of the window")
        for change in page:
            after = change.seq
            stored = decode(change)
            if watch.wants(stored.record):
                yield Event(feed.cursor(replica.feed_id, change.seq), change.kind, stored,
                            change.at_ms)  # fmt: skip
                told, told_at = after, loop.time()
        if len(page) < PAGE:
            # The page had room: every change of these keys up to ``last`` was in it.
            after = max(after, last)
            due = told_at + progress_s - loop.time()
            if after > told and due <= 0:
                yield Event(feed.cursor(replica.feed_id, after), PROGRESS, None,
                            replica.wall_ms())  # fmt: skip
                told, told_at = after, loop.time()
            # Sleep until the feed grows (or a progress event owed falls due).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(due if after > told else None):
                    await replica.feed_grew(after)

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

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from fencemark.node.core.replica import Replica
from fencemark.node.crdt import Record, codec
from fencemark.node.rules import validation
from fencemark.node.rules.errors import CursorExpired, InvalidInput, NotServing
from fencemark.node.store import feed
from fencemark.node.store.storage import Stored

PAGE = 256  # feed rows read at a time


@dataclass(frozen=True)
class Event:
    cursor: str
    kind: str
    stored: Stored
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
    if seq > replica.feed_last:
        raise InvalidInput.field("cursor", "names a change this node's feed has not made")
    if seq + 1 < await replica.feed_first():
        raise CursorExpired(watch.cursor, "is older than the changes this node keeps")
    return seq


async def follow(replica: Replica, watch: Watch, after: int) -> AsyncIterator[Event]:
    """Every change after ``seq`` ``after`` that ``watch`` wants, without end."""
    lower, upper = watch.bounds()
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
            record = codec.decode(change.state)
            if watch.wants(record):
                stored = Stored(record, codec.digest(change.state), len(change.state))
                yield Event(feed.cursor(replica.feed_id, change.seq), change.kind, stored,
                            change.at_ms)  # fmt: skip
        if len(page) < PAGE:
            # The page had room: every change of these keys up to ``last`` was in it.
            after = max(after, last)
            await replica.feed_grew(after)

"""The change-feed table: every change this node's replica commits, in commit order
(SPEC §9, ``Records.Watch``).

Each commit appends one row per record it changed — a client's write here or a
state merged from a peer alike — with the kind of change (``rules.changes``) and
the record's state as that commit left it, and trims the table to the newest
``window`` rows in the same transaction. A row's ``seq`` is assigned by SQLite
(``AUTOINCREMENT``: never reused, even after the rows before it were trimmed), so
``seq`` order is commit order.

Every life of a file that fed before starts a new *era* of ``seq``s, as it does of
fencing tokens: its first row is ``era_start``, at least the start's wall-clock
millisecond times 2**10. A file that went back in time (a reverted snapshot, a lost
fsync) forgot rows whose ``seq``s a watcher may hold as its cursor; without the
era, its next rows would take those ``seq``s again and a watcher resuming from one
would skip them. With it, every ``seq`` the file forgot is below every ``seq`` it
makes now, and the window is counted in rows, not in ``seq`` arithmetic
(docs/replication.md, *A disk that goes back in time*).

A cursor names the feed as well as the position in it: ``<node id>.<seq>``. A node
that lost its disk starts a new feed under a new node id, and a cursor of the old
one is refused rather than resumed from a ``seq`` that now means something else.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

DEFAULT_WINDOW = 10_000  # rows kept (--feed-window): about 1 KiB each for typical records
TAIL = 2048  # the newest rows also kept in memory, for watchers that keep up (Tail)
ERA_BITS = 10  # an era starts at its millisecond times 2**10 (as a life's tokens do)


def era_start(last: int, wall_ms: int) -> int:
    """The first ``seq`` of a new life of a feed whose last ``seq`` is ``last``: 0
    (SQLite's next) for a feed that never made a row, else above ``last`` and at
    least ``wall_ms`` times 2**ERA_BITS — above every ``seq`` an earlier life made,
    remembered or not, unless a life made more than 2**10 rows a millisecond or the
    clock went back across the restart."""
    return max(last + 1, wall_ms << ERA_BITS) if last else 0


SCHEMA = """
CREATE TABLE IF NOT EXISTS feed (
    seq   INTEGER PRIMARY KEY AUTOINCREMENT,
    key   TEXT NOT NULL,
    kind  TEXT NOT NULL,     -- rules.changes.KINDS
    at_ms INTEGER NOT NULL,  -- UTC ms, this node's wall clock at the commit
    state BLOB NOT NULL      -- the record's canonical state after the change
);
"""


class Change(NamedTuple):
    """One row of the feed."""

    seq: int
    key: str
    kind: str
    at_ms: int
    state: bytes


class Tail:
    """The newest rows of the feed, in memory as well as in the file, and the oldest
    ``seq`` the file keeps: a watcher that keeps up reads what the last commits
    added without a query, and none asks the file where the window starts.

    ``extend`` is told each commit's rows in the order the commit inserted them:
    consecutive ``seq``s (one writer, ``AUTOINCREMENT``) ending at the feed's new
    last, and the oldest ``seq`` the file keeps after it. What it holds is what the
    file holds for those ``seq``s, since a row is never changed, only trimmed."""

    def __init__(self, first: int, last: int, window: int, size: int = TAIL) -> None:
        self.first = first  # the oldest seq the file keeps (last + 1: none)
        self.last = last
        self.window = window
        self.size = min(size, window)
        self._rows: list[Change] = []

    def extend(self, last: int, first: int, rows: Sequence[tuple[str, str, int, bytes]]) -> None:
        """A commit added ``rows`` (key, kind, at_ms, state); the feed ends at ``last``
        and its oldest row is ``first``."""
        if not rows:
            return
        start = last - len(rows) + 1
        self.first = first
        if self._rows and self._rows[-1].seq != start - 1:
            self._rows = []  # a new era (a new life of the file): hold only what follows
        self._rows.extend(Change(start + i, *row) for i, row in enumerate(rows))
        trimmed = 0  # rows the commit trimmed from the file
        while trimmed < len(self._rows) and self._rows[trimmed].seq < first:
            trimmed += 1
        if trimmed > 0 or len(self._rows) > 2 * self.size:
            del self._rows[: max(trimmed, len(self._rows) - self.size)]
        self.last = last

    def covers(self, after: int) -> bool:
        """Every row after ``after`` is here."""
        return bool(self._rows) and self._rows[0].seq <= after + 1

    def changes(self, after: int, lower: str, upper: str, limit: int) -> list[Change]:
        """As the file would answer, for an ``after`` this ``covers``."""
        found: list[Change] = []
        for row in self._rows[max(0, after + 1 - self._rows[0].seq) :]:
            if lower <= row.key < upper:
                found.append(row)
                if len(found) == limit:
                    break
        return found


def cursor(node_id: str, seq: int) -> str:
    return f"{node_id}.{seq}"


def parse_cursor(text: str) -> tuple[str, int] | None:
    """``(node id, seq)`` of a cursor, None when it is not one."""
    node_id, dot, seq = text.rpartition(".")
    if not dot or not node_id or not seq.isdigit() or len(seq) > 19:
        return None
    return node_id, int(seq)

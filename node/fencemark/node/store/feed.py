"""The change-feed table: every change this node's replica commits, in commit order
(SPEC §9, ``Records.Watch``).

Each commit appends one row per record it changed — a client's write here or a
state merged from a peer alike — with the kind of change (``rules.changes``) and
the record's state as that commit left it, and trims the table to the newest
``window`` rows in the same transaction. A row's ``seq`` is assigned by SQLite
(``AUTOINCREMENT``: never reused, even after the rows before it were trimmed), so
``seq`` order is commit order.

A cursor names the feed as well as the position in it: ``<node id>.<seq>``. A node
that lost its disk starts a new feed under a new node id, and a cursor of the old
one is refused rather than resumed from a ``seq`` that now means something else.
"""

from __future__ import annotations

from typing import NamedTuple

DEFAULT_WINDOW = 10_000  # rows kept (--feed-window): about 1 KiB each for typical records

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


def cursor(node_id: str, seq: int) -> str:
    return f"{node_id}.{seq}"


def parse_cursor(text: str) -> tuple[str, int] | None:
    """``(node id, seq)`` of a cursor, None when it is not one."""
    node_id, dot, seq = text.rpartition(".")
    if not dot or not node_id or not seq.isdigit() or len(seq) > 19:
        return None
    return node_id, int(seq)

"""The work queue's pick index: one row per item ``ClaimNext`` might hand out.

Kept by ``Storage`` in the same commit as the record's state, so it is never
behind the file: an item is in it while it is visible and ``open``, ordered as
``ClaimNext`` picks (SPEC §8: priority, then oldest creation, then key) within its
topic and home region, with what may still hold it back (a deferral, a lease) and
who holds that lease, so that a ``ClaimNext`` retried by the holder finds its item
again.
Picking reads the index in that order and checks each candidate's full state
under its lock (``Claims.claim_next``); the index only saves reading every record.
"""

from __future__ import annotations

from typing import NamedTuple

from fencemark.node.crdt import Record
from fencemark.node.crdt.record import OPEN

SCHEMA = """
CREATE TABLE IF NOT EXISTS picks (
    key        TEXT PRIMARY KEY,
    scope      TEXT NOT NULL,     -- repo/{repo}/mem/{topic}/
    home       TEXT NOT NULL,     -- the home region: who may hand it out
    priority   INTEGER NOT NULL,  -- 0 (priority:P0) .. 10 (untagged)
    born       INTEGER NOT NULL,  -- HLC of the home's birth: oldest first
    not_before INTEGER NOT NULL,  -- UTC ms, 0: not deferred
    busy_until INTEGER NOT NULL,  -- UTC ms a lease of the home holds it, 0: none
    holder     TEXT NOT NULL      -- the owner of that lease, '': none
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS picks_in_order ON picks (scope, home, priority, born, key);
CREATE INDEX IF NOT EXISTS picks_by_holder ON picks (holder, scope, home);
"""


class Pickable(NamedTuple):
    key: str
    scope: str
    home: str
    priority: int
    born: int
    not_before: int
    busy_until: int
    holder: str


def scope_of(repo: str, topic: str) -> str:
    return f"repo/{repo}/mem/{topic}/"


def pickable(record: Record) -> Pickable | None:
    """The index row of ``record``, or None when ``ClaimNext`` never hands it out
    as it is (deleted, done, parked, never created)."""
    home = record.home
    if home is None or record.is_deleted or record.status != OPEN:
        return None
    fence = record.fence
    holder = fence.holder()
    if not (fence.unreleased() and holder is not None and holder.region == home.value):
        holder = None  # no lease of the home holds it
    return Pickable(
        record.key,
        record.key.rsplit("/", 1)[0] + "/",
        home.value,
        record.priority,
        home.stamp.hlc,
        record.not_before_ms,
        0 if holder is None else fence.expiry(fence.fence),
        "" if holder is None else holder.owner,
    )

"""The claim-history table: each record's recent claim events, kept by its home.

Rows are written in the same commit as the state change they describe
(``fencemark.node.core.history`` reads them off the change) and trimmed to the
newest ``KEPT`` per record in that commit.
"""

from __future__ import annotations

from typing import NamedTuple

KEPT = 64  # events kept per record, the oldest dropped first

SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    key      TEXT NOT NULL,
    seq      INTEGER NOT NULL,  -- per record, increasing
    at_ms    INTEGER NOT NULL,  -- UTC ms, the home's wall clock
    kind     TEXT NOT NULL,     -- granted, renewed, released, lapsed, forced, reopened
    token    INTEGER NOT NULL,
    owner    TEXT NOT NULL,
    identity TEXT NOT NULL,
    detail   TEXT NOT NULL,     -- an outcome, parked, an operator's reason
    actor    TEXT NOT NULL DEFAULT '',  -- the operator's identity: forced, reopened
    PRIMARY KEY (key, seq)
) WITHOUT ROWID;
"""


class Event(NamedTuple):
    """One claim event: when, what, for which token, by or for whom, and what
    else: a release's outcome, ``parked``, an operator's reason; ``actor``, the
    identity of the operator who took the claim back or reopened the item."""

    at_ms: int
    kind: str
    token: int
    owner: str = ""
    identity: str = ""
    detail: str = ""
    actor: str = ""

"""The writer side of the node's SQLite file: the one connection that writes, the
schema and its migrations, and one group commit (records, pick index, claim events
and meta in one transaction). ``Storage`` drives it; nothing else imports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import secrets
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from fencemark.node.crdt import codec
from fencemark.node.store import events as events_table
from fencemark.node.store import feed as feed_table
from fencemark.node.store import picks as picks_index
from fencemark.node.store.digest_tree import bucket_of
from fencemark.node.store.events import Event
from fencemark.node.store.picks import Pickable

log = logging.getLogger(__name__)
T = TypeVar("T")

# Rows per upsert statement: one statement is one step however many rows it has,
# and 6 parameters a row stay far below SQLite's 32766-variable limit.
ROWS_PER_STATEMENT = 500

SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    key     TEXT PRIMARY KEY,
    state   BLOB NOT NULL,     -- canonical CRDT encoding (crdt/codec.py)
    digest  BLOB NOT NULL,     -- BLAKE2b-128 of state
    deleted INTEGER NOT NULL,
    bucket  INTEGER NOT NULL,  -- digest_tree.bucket_of(key)
    max_hlc INTEGER NOT NULL   -- Record.max_hlc(): what anti-entropy compares first
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS records_by_bucket ON records (bucket, key);
CREATE TABLE IF NOT EXISTS meta (
    name  TEXT PRIMARY KEY,
    value
) WITHOUT ROWID;
"""


class Writer:
    """The write connection and the one thread it is used on.

    Its calls take the stdlib ``sqlite3`` connection directly: a function given to
    :meth:`run` does all its statements in one trip from the event loop. The trip
    is a queue the thread reads and a result handed back with
    ``call_soon_threadsafe``: not an executor, whose futures, locks and
    semaphore cost the event loop more per commit than the hand-off itself
    (docs/performance.md, *Issue 19 levers*).
    """

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._serve, name="fencemark-sqlite-writer", daemon=True
        )
        self._thread.start()
        self._conn: sqlite3.Connection | None = None

    @property
    def conn(self) -> sqlite3.Connection:
        assert self._conn is not None, "the writer connection is not open"
        return self._conn

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()
        self._calls.put((fn, args, done, loop))
        return await done

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            fn, args, done, loop = call
            try:
                result = fn(*args)
            except BaseException as exc:  # handed to the caller, as an executor would
                _hand_back(loop, done, None, exc)
            else:
                _hand_back(loop, done, result, None)

    def connect(self, path: Path) -> sqlite3.Connection:
        # check_same_thread stays on: only this writer's thread ever uses it.
        self._conn = sqlite3.connect(path, isolation_level=None)
        return self._conn

    async def close(self) -> None:
        if self._conn is not None:
            await self.run(self._conn.close)
            self._conn = None
        self._calls.put(None)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)


# One call for the writer thread: the function, its arguments, and whose future to settle.
_Call = tuple[
    Callable[..., Any], tuple[object, ...], "asyncio.Future[Any]", asyncio.AbstractEventLoop
]


def _hand_back(
    loop: asyncio.AbstractEventLoop,
    done: asyncio.Future[Any],
    result: object,
    error: BaseException | None,
) -> None:
    """Settle ``done`` on its loop's thread (unless its caller gave up meanwhile)."""

    def settle() -> None:
        if done.cancelled():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
        loop.call_soon_threadsafe(settle)


def open_writer(writer: Writer, path: Path) -> tuple[dict[str, str], bool]:
    """Open the file for writing, bring it up to SCHEMA; returns the meta table, and
    whether this call drew the node id (no other process can have it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = writer.connect(path)
    conn.execute("PRAGMA journal_mode=WAL")
    # FULL: in WAL mode NORMAL does not fsync at commit; an ack means on disk.
    conn.execute("PRAGMA synchronous=FULL")
    _migrate(conn)
    conn.executescript(SCHEMA + picks_index.SCHEMA + events_table.SCHEMA + feed_table.SCHEMA)
    meta = {str(name): str(value) for name, value in conn.execute("SELECT name, value FROM meta")}
    if "state_format" not in meta:  # a new file: its states are all written in FORMAT
        meta["state_format"] = str(codec.FORMAT)
        conn.execute("INSERT INTO meta VALUES ('state_format', ?)", (meta["state_format"],))
    minted = "node_id" not in meta
    if minted:
        # A node that lost its disk comes back as a new node: the identity is
        # part of what is lost, so stamps from two lives never collide.
        meta["node_id"] = secrets.token_hex(6)
        conn.execute("INSERT INTO meta VALUES ('node_id', ?)", (meta["node_id"],))
    if "catch_up" not in meta:
        # A new (or emptied) file owes a catch-up with the peers before its node
        # decides anything (fencemark.node.core.grant_gate); a file of an earlier
        # version that holds records has decided before.
        empty = conn.execute("SELECT NOT EXISTS (SELECT 1 FROM records)").fetchone()[0]
        meta["catch_up"] = "owed" if empty else "done"
        conn.execute("INSERT INTO meta VALUES ('catch_up', ?)", (meta["catch_up"],))
    return meta, minted


_UPSERT_TAIL = (
    " ON CONFLICT (key) DO UPDATE SET"
    " state = excluded.state, digest = excluded.digest, deleted = excluded.deleted,"
    " max_hlc = excluded.max_hlc"
)


def commit_rows(
    conn: sqlite3.Connection,
    rows: list[tuple[str, bytes, bytes, int, int, int]],
    picks: list[tuple[str, Pickable | None]],
    events: list[tuple[str, Event]],
    meta: dict[str, str],
    feed: list[tuple[str, str, int, bytes]],
    excess: int,
    era: int = 0,
    *,
    known: dict[str, bytes],
) -> tuple[dict[str, bytes], tuple[int, int] | None]:
    """One group commit, on the writer's thread; returns the digests it replaced and
    the feed's last and oldest ``seq`` after it (``_feed``: None, unchanged).

    ``known`` holds the current digest of keys the caller knows it for (what its
    cache holds is exactly what committed): only the others are read.
    Rows go in as multi-row upserts (one statement, one step, per up to
    ROWS_PER_STATEMENT rows) rather than one step per row: each step gives up the
    GIL, and winning it back from a busy event loop can take a switch interval.
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        before: dict[str, bytes] = {}
        for start in range(0, len(rows), ROWS_PER_STATEMENT):
            chunk = rows[start : start + ROWS_PER_STATEMENT]
            keys = []
            for row in chunk:
                digest = known.get(row[0])
                if digest is None:
                    keys.append(row[0])
                else:
                    before[row[0]] = digest
            if keys:
                marks = ",".join("?" * len(keys))
                before.update(
                    (key, bytes(digest))
                    for key, digest in conn.execute(
                        f"SELECT key, digest FROM records WHERE key IN ({marks})", keys
                    )
                )
            values = ",".join(["(?, ?, ?, ?, ?, ?)"] * len(chunk))
            conn.execute(
                "INSERT INTO records (key, state, digest, deleted, bucket, max_hlc)"
                f" VALUES {values}{_UPSERT_TAIL}",
                [v for row in chunk for v in row],
            )
        _index_picks(conn, picks)
        _keep_events(conn, events)
        ends = _feed(conn, feed, excess, era)
        pairs = ",".join(["(?, ?)"] * len(meta))
        conn.execute(
            f"INSERT INTO meta VALUES {pairs}"
            " ON CONFLICT (name) DO UPDATE SET value = excluded.value",
            [v for item in meta.items() for v in item],
        )
        conn.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
        raise
    return before, ends


# The feed's oldest and last ``seq``, read in every commit that feeds: two scalar
# subqueries, each a search of the primary key. One SELECT of both min() and max()
# is not: SQLite's min/max optimization takes a lone aggregate only, and the
# query scanned the whole window (up to --feed-window rows of states) per commit.
FEED_ENDS = "SELECT (SELECT min(seq) FROM feed), (SELECT coalesce(max(seq), 0) FROM feed)"


def _feed(
    conn: sqlite3.Connection,
    feed: list[tuple[str, str, int, bytes]],
    excess: int,
    era: int = 0,
) -> tuple[int, int] | None:
    """Append the commit's changes to the feed (the first at ``seq`` ``era`` when a new
    era starts with it: ``feed.era_start``) and drop its ``excess`` oldest rows (the
    window is counted in rows: an era's first ``seq`` jumps, so ``seq`` arithmetic
    would trim every row of the lives before it); returns the last ``seq`` and the
    oldest kept (``last + 1``: none), or None when it changed nothing."""
    if feed:
        insert = "INSERT INTO feed (seq, key, kind, at_ms, state) VALUES (?, ?, ?, ?, ?)"
        conn.execute(insert, (era or None, *feed[0]))
        conn.executemany(insert, [(None, *row) for row in feed[1:]])
    if excess > 0:
        conn.execute(
            "DELETE FROM feed WHERE seq IN (SELECT seq FROM feed ORDER BY seq LIMIT ?)", (excess,)
        )
    elif not feed:
        return None  # the feed is as it was: no read in a commit that fed nothing
    first, last = conn.execute(FEED_ENDS).fetchone()
    last = int(last)
    return last, int(first) if first is not None else last + 1


def _index_picks(conn: sqlite3.Connection, picks: list[tuple[str, Pickable | None]]) -> None:
    """The pick index of the records of one commit: a row for each that ``ClaimNext``
    may hand out, none for the others (``picks.pickable``)."""
    gone = [key for key, pick in picks if pick is None]
    for start in range(0, len(gone), ROWS_PER_STATEMENT):
        keys = gone[start : start + ROWS_PER_STATEMENT]
        conn.execute(f"DELETE FROM picks WHERE key IN ({','.join('?' * len(keys))})", keys)
    kept = [pick for _, pick in picks if pick is not None]
    for start in range(0, len(kept), ROWS_PER_STATEMENT):
        rows = kept[start : start + ROWS_PER_STATEMENT]
        values = ",".join(["(?, ?, ?, ?, ?, ?, ?, ?)"] * len(rows))
        conn.execute(
            f"INSERT OR REPLACE INTO picks VALUES {values}", [v for row in rows for v in row]
        )


def _keep_events(conn: sqlite3.Connection, events: list[tuple[str, Event]]) -> None:
    """Append each record's new claim events and drop all but its newest KEPT."""
    last: dict[str, int] = {}
    for key, event in events:
        if key not in last:
            row = conn.execute("SELECT max(seq) FROM events WHERE key = ?", (key,)).fetchone()
            last[key] = int(row[0] or 0)
        last[key] += 1
        conn.execute(
            "INSERT INTO events VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", (key, last[key], *event)
        )
    for key, seq in last.items():
        conn.execute(
            "DELETE FROM events WHERE key = ? AND seq <= ?", (key, seq - events_table.KEPT)
        )


def _migrate(conn: sqlite3.Connection) -> None:
    """Bring a file written by an earlier version up to SCHEMA (idempotent)."""
    columns = {row[1] for row in conn.execute("PRAGMA table_info(records)")}
    if not columns:
        return  # a new file: SCHEMA creates everything
    conn.execute("BEGIN IMMEDIATE")
    marker = conn.execute("SELECT value FROM meta WHERE name = 'state_format'").fetchone()
    if marker is None or int(marker[0]) < codec.FORMAT:  # before signed grants: format 1
        # Re-encoded with new digests; the digest tree is loaded from them afterwards.
        rows = []
        for key, state in conn.execute("SELECT key, state FROM records").fetchall():
            new = codec.upgrade(bytes(state))
            if new != state:
                rows.append((new, codec.digest(new), key))
        log.info("re-encoding %d record states in format %d", len(rows), codec.FORMAT)
        conn.executemany("UPDATE records SET state = ?, digest = ? WHERE key = ?", rows)
        conn.execute("INSERT OR REPLACE INTO meta VALUES ('state_format', ?)", (str(codec.FORMAT),))
    if "bucket" not in columns:  # before replication: no digest-tree buckets
        log.info("adding digest-tree buckets to an existing data file")
        conn.execute("ALTER TABLE records ADD COLUMN bucket INTEGER NOT NULL DEFAULT -1")
        keys = [row[0] for row in conn.execute("SELECT key FROM records")]
        conn.executemany(
            "UPDATE records SET bucket = ? WHERE key = ?", [(bucket_of(k), k) for k in keys]
        )
    picks_columns = {row[1] for row in conn.execute("PRAGMA table_info(picks)")}
    if "holder" not in picks_columns:  # before the work queue, or before its holders
        log.info("indexing the work queue of an existing data file")
        conn.execute("DROP TABLE IF EXISTS picks")  # derived from the states: rebuilt whole
        for statement in filter(str.strip, picks_index.SCHEMA.split(";")):
            conn.execute(statement)  # not executescript: it would commit the migration
        states = conn.execute("SELECT key, state FROM records").fetchall()
        _index_picks(conn, [(k, picks_index.pickable(codec.decode(v))) for k, v in states])
    if "max_hlc" not in columns:  # before pull-only anti-entropy compared it
        log.info("adding each record's largest HLC to an existing data file")
        conn.execute("ALTER TABLE records ADD COLUMN max_hlc INTEGER NOT NULL DEFAULT 0")
        states = list(conn.execute("SELECT key, state FROM records"))
        conn.executemany(
            "UPDATE records SET max_hlc = ? WHERE key = ?",
            [(codec.decode(state).max_hlc(), key) for key, state in states],
        )
    event_columns = {row[1] for row in conn.execute("PRAGMA table_info(events)")}
    if event_columns and "actor" not in event_columns:  # before operators were named
        conn.execute("ALTER TABLE events ADD COLUMN actor TEXT NOT NULL DEFAULT ''")
    conn.execute("COMMIT")

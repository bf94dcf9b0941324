"""Durable record states in one SQLite file per node (WAL, fsync on commit).

Writes go through one writer task that commits whatever has queued up since its
last commit in a single transaction (group commit): a caller's ``put`` returns
only after the transaction holding its state is on disk, yet concurrent callers
share fsyncs instead of queueing behind one another. The whole commit — read the
digests it replaces, upsert the states and the settings, COMMIT — is one function
run on the writer connection's own thread: one hand-off from the event loop per
group, not one per statement (docs/performance.md, *Claim path*). Reads use a
second connection through aiosqlite (WAL lets it read while the writer commits)
and an LRU cache of decoded states that is updated only after a commit, so
nothing not yet durable is ever served.

One module of about 480 lines, on purpose: the schema, the writer's commit and the
cache it updates are one protocol (what is cached is exactly what committed), and
splitting them would put that invariant across files.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import sqlite3
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, TypeVar

import aiosqlite

from fencemark.node.crdt import Record, codec
from fencemark.node.store import events as events_table
from fencemark.node.store import picks as picks_index
from fencemark.node.store.digest_tree import DigestTree, bucket_of
from fencemark.node.store.events import Event
from fencemark.node.store.picks import Pickable

log = logging.getLogger(__name__)
T = TypeVar("T")

DB_FILE = "fencemark.sqlite3"  # the node's one file, in its data directory
# Rows per upsert statement: one statement is one step however many rows it has,
# and 6 parameters a row stay far below SQLite's 32766-variable limit.
ROWS_PER_STATEMENT = 500
RANGES_PER_STATEMENT = 250  # bucket ranges OR-ed together in one listing query

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


class Stored(NamedTuple):
    """A durable record state with its digest."""

    record: Record
    digest: bytes
    size: int = 0  # bytes of the canonical encoding


@dataclass
class _Pending:
    stored: Stored | None  # None: only meta changes ride on this commit
    state: bytes
    done: asyncio.Future[None]
    events: Sequence[Event] = ()  # claim events of this change (store.events)


@dataclass
class CommitStats:
    commits: int = 0
    writes: int = 0
    largest_batch: int = 0


class Storage:
    def __init__(
        self,
        path: Path,
        writer: _Writer,
        reader: aiosqlite.Connection,
        node_id: str,
        hlc_high: int,
        cache_size: int,
        tree: DigestTree,
        count: int,
    ) -> None:
        self.path = path
        self.tree = tree
        self.record_count = count
        self._writer = writer
        self._reader = reader
        self.node_id = node_id
        self.hlc_high = hlc_high
        self.stats = CommitStats()
        # Called after each successful group commit with (writes, seconds): metrics.
        self.on_commit: Callable[[int, float], None] | None = None
        self._cache: OrderedDict[str, Stored] = OrderedDict()
        self._cache_size = cache_size
        self._commit_seq = 0
        self._queue: asyncio.Queue[_Pending | None] = asyncio.Queue()
        self._hlc_pending = 0
        self._meta_pending: dict[str, str] = {}
        self.meta: dict[str, str] = {}
        self._writer_task = asyncio.create_task(self._write_loop(), name="storage-writer")

    @classmethod
    async def open(cls, path: Path, *, cache_size: int = 10_000) -> Storage:
        """Open (creating if needed) the node's database file."""
        writer = _Writer()
        reader: aiosqlite.Connection | None = None
        try:
            meta = await writer.run(_open_writer, writer, path)
            reader = await aiosqlite.connect(path, isolation_level=None)
            await reader.execute("PRAGMA query_only=ON")
            # The digest tree is loaded once; from then on every commit updates it.
            tree = DigestTree()
            rows = list(await reader.execute_fetchall("SELECT key, digest FROM records"))
            tree.load((key, bytes(digest)) for key, digest in rows)
        except BaseException:
            if reader is not None:
                await reader.close()
            await writer.close()
            raise
        hlc_high = int(meta.get("hlc_high", 0))
        storage = cls(path, writer, reader, meta["node_id"], hlc_high, cache_size, tree, len(rows))
        storage.meta = meta
        return storage

    async def close(self) -> None:
        await self._queue.put(None)
        with contextlib.suppress(asyncio.CancelledError):
            await self._writer_task
        await self._reader.close()
        await self._writer.close()

    async def pragma(self, name: str) -> object:
        """A setting of the writer's own connection (``synchronous`` is per connection)."""
        if not name.isidentifier():
            raise ValueError(f"not a pragma name: {name!r}")
        return await self._writer.run(
            lambda: self._writer.conn.execute(f"PRAGMA {name}").fetchone()[0]
        )

    # -- reads ----------------------------------------------------------------

    async def get(self, key: str) -> Stored | None:
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        seq = self._commit_seq
        cursor = await self._reader.execute(
            "SELECT state, digest FROM records WHERE key = ?", (key,)
        )
        row = await cursor.fetchone()
        await cursor.close()
        if row is None:
            return None
        stored = Stored(codec.decode(row[0]), bytes(row[1]), len(row[0]))
        if seq == self._commit_seq:  # no commit raced the read: safe to cache
            self._remember(key, stored)
        return stored

    @property
    def commits(self) -> int:
        """How many commits this storage has made: a read that saw the same count
        before and after read what is still current."""
        return self._commit_seq

    async def preload(self, keys: Sequence[str]) -> None:
        """Read the states of ``keys`` not in the cache with one query and cache
        them, so that the ``get`` of each that follows is a hit (a batch of merges
        reads every record it joins into)."""
        missing = [key for key in dict.fromkeys(keys) if key not in self._cache]
        if not missing:
            return
        seq = self._commit_seq
        rows = await self._reader.execute_fetchall(
            f"SELECT key, state, digest FROM records WHERE key IN ({','.join('?' * len(missing))})",
            missing,
        )
        if seq != self._commit_seq:
            return  # a commit raced the read: each get reads for itself
        for key, state, digest in rows:
            self._remember(key, Stored(codec.decode(state), bytes(digest), len(state)))

    async def scan(
        self, lower: str, upper: str, *, after: str = "", limit: int, include_deleted: bool
    ) -> list[Stored]:
        """States with ``lower <= key < upper`` and ``key > after``, in key order."""
        sql = "SELECT state, digest FROM records WHERE key >= ? AND key < ? AND key > ?"
        if not include_deleted:
            sql += " AND deleted = 0"
        sql += " ORDER BY key LIMIT ?"
        rows = await self._reader.execute_fetchall(sql, (lower, upper, after, limit))
        return [Stored(codec.decode(s), bytes(d), len(s)) for s, d in rows]

    async def picks(
        self, scope: str, home: str, now_ms: int, *, after: Pickable | None, limit: int
    ) -> list[Pickable]:
        """Items of ``scope`` homed at ``home`` that the pick index says may be handed
        out at ``now_ms``, in pick order, after ``after`` (``picks`` module)."""
        sql = (
            "SELECT * FROM picks WHERE scope = ? AND home = ?"
            " AND not_before <= ? AND busy_until <= ?"
        )
        args: list[object] = [scope, home, now_ms, now_ms]
        if after is not None:
            sql += " AND (priority, born, key) > (?, ?, ?)"
            args += [after.priority, after.born, after.key]
        sql += " ORDER BY priority, born, key LIMIT ?"
        rows = await self._reader.execute_fetchall(sql, [*args, limit])
        return [Pickable(*row) for row in rows]

    async def events(self, key: str) -> list[Event]:
        """``key``'s claim events kept here, oldest first."""
        rows = await self._reader.execute_fetchall(
            "SELECT at_ms, kind, token, owner, identity, detail FROM events"
            " WHERE key = ? ORDER BY seq",
            (key,),
        )
        return [Event(*row) for row in rows]

    async def next_pickable_ms(self, scope: str, home: str, now_ms: int) -> int | None:
        """The earliest moment after ``now_ms`` a deferral or a lease of ``scope``'s
        items at ``home`` ends: when an item may become pickable without a write."""
        rows = await self._reader.execute_fetchall(
            "SELECT min(max(not_before, busy_until)) FROM picks"
            " WHERE scope = ? AND home = ? AND max(not_before, busy_until) > ?",
            (scope, home, now_ms),
        )
        first = next(iter(rows), (None,))[0]
        return None if first is None else int(first)

    async def count(self) -> int:
        return self.record_count

    async def bucket_entries(self, spans: Sequence[range]) -> list[tuple[str, bytes, int]]:
        """``(key, digest, max_hlc)`` of every record whose leaf bucket lies in one of
        ``spans`` (ranges of bucket numbers), in key order."""
        merged: list[list[int]] = []
        for span in sorted((s for s in spans if s), key=lambda s: s.start):
            if merged and span.start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], span.stop)
            else:
                merged.append([span.start, span.stop])
        entries: list[tuple[str, bytes, int]] = []
        # SQLite parses a chain of ORs into an expression tree at most 1000 deep.
        for start in range(0, len(merged), RANGES_PER_STATEMENT):
            chunk = merged[start : start + RANGES_PER_STATEMENT]
            where = " OR ".join(["(bucket >= ? AND bucket < ?)"] * len(chunk))
            rows = await self._reader.execute_fetchall(
                f"SELECT key, digest, max_hlc FROM records WHERE {where}",
                [bound for pair in chunk for bound in pair],
            )
            entries.extend((key, bytes(digest), int(hlc)) for key, digest, hlc in rows)
        entries.sort()
        return entries

    async def states(self, keys: list[str]) -> dict[str, bytes]:
        """Canonical states of the given keys that exist (as stored, not decoded)."""
        if not keys:
            return {}
        marks = ",".join("?" * len(keys))
        rows = await self._reader.execute_fetchall(
            f"SELECT key, state FROM records WHERE key IN ({marks})", keys
        )
        return {key: bytes(state) for key, state in rows}

    # -- writes ---------------------------------------------------------------

    async def put(
        self,
        record: Record,
        *,
        hlc: int,
        state: bytes | None = None,
        events: Sequence[Event] = (),
    ) -> Stored:
        """Persist ``record``; returns once it is on disk.

        ``hlc`` is the node clock's high-water mark, persisted with the batch so a
        restarted clock never issues a timestamp it issued before. ``state`` is the
        record's canonical encoding when the caller already has it; ``events`` are
        the claim events of the change, kept in the same commit.
        """
        if state is None:
            state = codec.encode(record)
        stored = Stored(record, codec.digest(state), len(state))
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._hlc_pending = max(self._hlc_pending, hlc)
        await self._queue.put(_Pending(stored, state, done, events))
        await done
        return stored

    async def put_meta(self, name: str, value: str) -> None:
        """Persist a node setting (e.g. when it recovered); returns once on disk."""
        self._meta_pending[name] = value
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        await self._queue.put(_Pending(None, b"", done))
        await done

    async def _write_loop(self) -> None:
        while True:
            first = await self._queue.get()
            if first is None:
                return
            batch = [first]
            closing = False
            while not self._queue.empty():
                item = self._queue.get_nowait()
                if item is None:
                    closing = True
                    break
                batch.append(item)
            await self._commit(batch)
            if closing:
                return

    async def _commit(self, batch: list[_Pending]) -> None:
        picks = [
            (p.stored.record.key, picks_index.pickable(p.stored.record))
            for p in batch
            if p.stored is not None
        ]
        events = [(p.stored.record.key, e) for p in batch if p.stored is not None for e in p.events]
        rows = [
            (
                p.stored.record.key,
                p.state,
                p.stored.digest,
                int(p.stored.record.is_deleted),
                bucket_of(p.stored.record.key),
                p.stored.record.max_hlc(),
            )
            for p in batch
            if p.stored is not None
        ]
        hlc_high = max(self.hlc_high, self._hlc_pending)
        meta, self._meta_pending = {**self._meta_pending, "hlc_high": str(hlc_high)}, {}
        started = time.perf_counter()
        try:
            before = await self._writer.run(
                _commit_rows, self._writer.conn, rows, picks, events, meta
            )
        except Exception as exc:
            log.exception("commit of %d writes failed", len(batch))
            for p in batch:
                if not p.done.done():
                    p.done.set_exception(exc)
            return
        self.hlc_high = hlc_high
        self.meta.update(meta)
        for key, _, digest, _, _, _ in rows:
            if key not in before:
                self.record_count += 1
            self.tree.update(key, before.get(key), digest)
            before[key] = digest
        self._commit_seq += 1
        self.stats.commits += 1
        self.stats.writes += len(batch)
        self.stats.largest_batch = max(self.stats.largest_batch, len(batch))
        if self.on_commit is not None:
            self.on_commit(len(batch), time.perf_counter() - started)
        for p in batch:
            if p.stored is not None:
                self._remember(p.stored.record.key, p.stored)
            if not p.done.done():
                p.done.set_result(None)

    def _remember(self, key: str, stored: Stored) -> None:
        self._cache[key] = stored
        self._cache.move_to_end(key)
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)


class _Writer:
    """The write connection and the one thread it is used on.

    Its calls take the stdlib ``sqlite3`` connection directly: a function given to
    :meth:`run` does all its statements in one trip from the event loop.
    """

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="fencemark-sqlite-writer")
        self._conn: sqlite3.Connection | None = None

    @property
    def conn(self) -> sqlite3.Connection:
        assert self._conn is not None, "the writer connection is not open"
        return self._conn

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, functools.partial(fn, *args))

    def connect(self, path: Path) -> sqlite3.Connection:
        # check_same_thread stays on: only this writer's thread ever uses it.
        self._conn = sqlite3.connect(path, isolation_level=None)
        return self._conn

    async def close(self) -> None:
        if self._conn is not None:
            await self.run(self._conn.close)
            self._conn = None
        self._thread.shutdown(wait=True)


def _open_writer(writer: _Writer, path: Path) -> dict[str, str]:
    """Open the file for writing, bring it up to SCHEMA; returns the meta table."""
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = writer.connect(path)
    conn.execute("PRAGMA journal_mode=WAL")
    # FULL: in WAL mode NORMAL does not fsync at commit; an ack means on disk.
    conn.execute("PRAGMA synchronous=FULL")
    _migrate(conn)
    conn.executescript(SCHEMA + picks_index.SCHEMA + events_table.SCHEMA)
    meta = {str(name): str(value) for name, value in conn.execute("SELECT name, value FROM meta")}
    if "state_format" not in meta:  # a new file: its states are all written in FORMAT
        meta["state_format"] = str(codec.FORMAT)
        conn.execute("INSERT INTO meta VALUES ('state_format', ?)", (meta["state_format"],))
    if "node_id" not in meta:
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
    return meta


_UPSERT_TAIL = (
    " ON CONFLICT (key) DO UPDATE SET"
    " state = excluded.state, digest = excluded.digest, deleted = excluded.deleted,"
    " max_hlc = excluded.max_hlc"
)


def _commit_rows(
    conn: sqlite3.Connection,
    rows: list[tuple[str, bytes, bytes, int, int, int]],
    picks: list[tuple[str, Pickable | None]],
    events: list[tuple[str, Event]],
    meta: dict[str, str],
) -> dict[str, bytes]:
    """One group commit, on the writer's thread; returns the digests it replaced.

    Rows go in as multi-row upserts (one statement, one step, per up to
    ROWS_PER_STATEMENT rows) rather than one step per row: each step gives up the
    GIL, and winning it back from a busy event loop can take a switch interval.
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        before: dict[str, bytes] = {}
        for start in range(0, len(rows), ROWS_PER_STATEMENT):
            chunk = rows[start : start + ROWS_PER_STATEMENT]
            keys = [row[0] for row in chunk]
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
    return before


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
        values = ",".join(["(?, ?, ?, ?, ?, ?, ?)"] * len(rows))
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
        conn.execute("INSERT INTO events VALUES (?, ?, ?, ?, ?, ?, ?, ?)", (key, last[key], *event))
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
    has_picks = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'picks'"
    ).fetchone()
    if not has_picks:  # before the work queue: index every record ClaimNext may pick
        log.info("indexing the work queue of an existing data file")
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
    conn.execute("COMMIT")

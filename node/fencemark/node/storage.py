"""Durable record states in one SQLite file per node (WAL, fsync on commit).

Writes go through one writer task that commits whatever has queued up since its
last commit in a single transaction (group commit): a caller's ``put`` returns
only after the transaction holding its state is on disk, yet concurrent callers
share fsyncs instead of queueing behind one another. Reads use a second
connection (WAL lets it read while the writer commits) and an LRU cache of
decoded states that is updated only after a commit, so nothing not yet durable is
ever served.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import aiosqlite

from fencemark.node.crdt import Record, codec
from fencemark.node.digest_tree import DigestTree, bucket_of

log = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    key     TEXT PRIMARY KEY,
    state   BLOB NOT NULL,     -- canonical CRDT encoding (crdt/codec.py)
    digest  BLOB NOT NULL,     -- BLAKE2b-128 of state
    deleted INTEGER NOT NULL,
    bucket  INTEGER NOT NULL   -- digest_tree.bucket_of(key)
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


@dataclass
class CommitStats:
    commits: int = 0
    writes: int = 0
    largest_batch: int = 0


class Storage:
    def __init__(
        self,
        path: Path,
        writer: aiosqlite.Connection,
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
        await asyncio.to_thread(path.parent.mkdir, parents=True, exist_ok=True)
        writer = await aiosqlite.connect(path, isolation_level=None)
        reader: aiosqlite.Connection | None = None
        try:
            await writer.execute("PRAGMA journal_mode=WAL")
            # FULL: in WAL mode NORMAL does not fsync at commit; an ack means on disk.
            await writer.execute("PRAGMA synchronous=FULL")
            await _migrate(writer)
            await writer.executescript(SCHEMA)
            meta = {name: str(value) for name, value in await writer.execute_fetchall(
                "SELECT name, value FROM meta"
            )}  # fmt: skip
            if "node_id" not in meta:
                # A node that lost its disk comes back as a new node: the identity
                # is part of what is lost, so stamps from two lives never collide.
                meta["node_id"] = secrets.token_hex(6)
                await writer.execute("INSERT INTO meta VALUES ('node_id', ?)", (meta["node_id"],))
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

    async def count(self) -> int:
        return self.record_count

    async def bucket_entries(self, buckets: list[int]) -> list[tuple[str, bytes]]:
        """``(key, digest)`` of every record in the given leaf buckets, in key order."""
        if not buckets:
            return []
        marks = ",".join("?" * len(buckets))
        rows = await self._reader.execute_fetchall(
            f"SELECT key, digest FROM records WHERE bucket IN ({marks}) ORDER BY key", buckets
        )
        return [(key, bytes(digest)) for key, digest in rows]

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

    async def put(self, record: Record, *, hlc: int, state: bytes | None = None) -> Stored:
        """Persist ``record``; returns once it is on disk.

        ``hlc`` is the node clock's high-water mark, persisted with the batch so a
        restarted clock never issues a timestamp it issued before. ``state`` is the
        record's canonical encoding when the caller already has it.
        """
        if state is None:
            state = codec.encode(record)
        stored = Stored(record, codec.digest(state), len(state))
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._hlc_pending = max(self._hlc_pending, hlc)
        await self._queue.put(_Pending(stored, state, done))
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
        rows = [
            (
                p.stored.record.key,
                p.state,
                p.stored.digest,
                int(p.stored.record.is_deleted),
                bucket_of(p.stored.record.key),
            )
            for p in batch
            if p.stored is not None
        ]
        keys = [row[0] for row in rows]
        hlc_high = max(self.hlc_high, self._hlc_pending)
        meta, self._meta_pending = {**self._meta_pending, "hlc_high": str(hlc_high)}, {}
        started = time.perf_counter()
        try:
            await self._writer.execute("BEGIN IMMEDIATE")
            marks = ",".join("?" * len(keys))
            before = await self._writer.execute_fetchall(
                f"SELECT key, digest FROM records WHERE key IN ({marks})", keys
            )
            await self._writer.executemany(
                "INSERT INTO records (key, state, digest, deleted, bucket) VALUES (?, ?, ?, ?, ?)"
                " ON CONFLICT (key) DO UPDATE SET"
                " state = excluded.state, digest = excluded.digest, deleted = excluded.deleted",
                rows,
            )
            await self._writer.executemany(
                "INSERT INTO meta VALUES (?, ?)"
                " ON CONFLICT (name) DO UPDATE SET value = excluded.value",
                list(meta.items()),
            )
            await self._writer.execute("COMMIT")
        except Exception as exc:
            log.exception("commit of %d writes failed", len(batch))
            with contextlib.suppress(Exception):
                await self._writer.execute("ROLLBACK")
            for p in batch:
                if not p.done.done():
                    p.done.set_exception(exc)
            return
        self.hlc_high = hlc_high
        self.meta.update(meta)
        current = {key: bytes(digest) for key, digest in before}
        for key, _, digest, _, _ in rows:
            if key not in current:
                self.record_count += 1
            self.tree.update(key, current.get(key), digest)
            current[key] = digest
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


async def _migrate(conn: aiosqlite.Connection) -> None:
    """Bring a file written by an earlier version up to SCHEMA (idempotent)."""
    columns = {row[1] for row in await conn.execute_fetchall("PRAGMA table_info(records)")}
    if columns and "bucket" not in columns:  # before replication: no digest-tree buckets
        log.info("adding digest-tree buckets to an existing data file")
        await conn.execute("BEGIN IMMEDIATE")
        await conn.execute("ALTER TABLE records ADD COLUMN bucket INTEGER NOT NULL DEFAULT -1")
        keys = [row[0] for row in await conn.execute_fetchall("SELECT key FROM records")]
        await conn.executemany(
            "UPDATE records SET bucket = ? WHERE key = ?", [(bucket_of(k), k) for k in keys]
        )
        await conn.execute("COMMIT")

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
nothing not yet durable is ever served. Each read is one trip to that connection
(``execute_fetchall``): a statement left open across trips would hold its read
transaction, and every read run meanwhile would miss the commits made since.

The writer connection, the schema, its migrations and the body of one commit are
``writer``; this module keeps what is cached exactly what committed. About 430
lines on purpose: beside each table the commit writes (records, the pick index,
claim events, the change feed) sit the reads of it, so what is read is seen to be
what was written.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, TypeVar

import aiosqlite

from fencemark.node.crdt import Record, codec
from fencemark.node.store import feed as feed_table
from fencemark.node.store import picks as picks_index
from fencemark.node.store.digest_tree import DigestTree, bucket_of
from fencemark.node.store.events import Event
from fencemark.node.store.feed import Change
from fencemark.node.store.picks import Pickable
from fencemark.node.store.writer import Writer, commit_rows, open_writer

log = logging.getLogger(__name__)
T = TypeVar("T")

DB_FILE = "fencemark.sqlite3"  # the node's one file, in its data directory
RANGES_PER_STATEMENT = 250  # bucket ranges OR-ed together in one listing query


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
    change: str = ""  # its kind for the change feed (store.feed); "": not fed
    at_ms: int = 0
    acked: bool = False  # answered only once a majority of members hold it (acknowledge)


@dataclass
class CommitStats:
    commits: int = 0
    writes: int = 0
    largest_batch: int = 0


class Storage:
    def __init__(
        self,
        path: Path,
        writer: Writer,
        reader: aiosqlite.Connection,
        node_id: str,
        hlc_high: int,
        cache_size: int,
        tree: DigestTree,
        count: int,
        feed_window: int = feed_table.DEFAULT_WINDOW,
        feed_last: int = 0,
        feed_first: int = 1,
        feed_rows: int = 0,
        feed_era: int = 0,
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
        # At a member of a region of several: awaited after a commit with the keys and
        # states of its writes that need a majority's acknowledgement (``enqueue(acked=)``),
        # once per group commit; their callers hear of the commit only after it
        # returns (fencemark.node.replication.majority). Commits go on meanwhile.
        self.acknowledge: (
            Callable[[list[str], list[bytes], list[Sequence[Event]]], Awaitable[None]] | None
        ) = None
        self._acknowledging: set[asyncio.Task[None]] = set()
        self._cache: OrderedDict[str, Stored] = OrderedDict()
        self._cache_size = cache_size
        self._commit_seq = 0
        self._queue: asyncio.Queue[_Pending | None] = asyncio.Queue()
        self._hlc_pending = 0
        self._meta_pending: dict[str, str] = {}
        self.meta: dict[str, str] = {}
        # This process drew the node id (a new or emptied file): no copy of the file
        # can be running elsewhere (grant_gate: a fresh node need not settle).
        self.minted = False
        self.feed_window = feed_window
        self.feed_last = feed_last  # the feed's last committed seq
        self._feed_rows = feed_rows  # rows the feed keeps (at most feed_window after a commit)
        # This life's era of seqs (feed.era_start): its first row's seq, until it is
        # written; every seq below it that the file does not hold, it forgot.
        self.feed_era = feed_era
        self._era_pending = feed_era
        self._tail = feed_table.Tail(feed_first, feed_last, feed_window)
        self._fed = asyncio.Event()  # set (and replaced) by each commit that grew the feed
        self.feed_ended = False  # end_feed(): the node is stopping, watchers are let go
        self._writer_task = asyncio.create_task(self._write_loop(), name="storage-writer")

    @classmethod
    async def open(
        cls,
        path: Path,
        *,
        cache_size: int = 10_000,
        feed_window: int = feed_table.DEFAULT_WINDOW,
    ) -> Storage:
        """Open (creating if needed) the node's database file; the wall clock now starts
        the feed's new era (``feed.era_start``)."""
        writer = Writer()
        reader: aiosqlite.Connection | None = None
        try:
            meta, minted = await writer.run(open_writer, writer, path)
            reader = await aiosqlite.connect(path, isolation_level=None)
            await reader.execute("PRAGMA query_only=ON")
            # The digest tree is loaded once; from then on every commit updates it.
            tree = DigestTree()
            rows = list(await reader.execute_fetchall("SELECT key, digest FROM records"))
            tree.load((key, bytes(digest)) for key, digest in rows)
            ends = await reader.execute_fetchall("SELECT min(seq), max(seq), count(*) FROM feed")
            first, last, kept = next(iter(ends))
            # AUTOINCREMENT's own record: the last seq ever made, even if all trimmed.
            made = await reader.execute_fetchall(
                "SELECT seq FROM sqlite_sequence WHERE name = 'feed'"
            )
            last = max([last or 0, *(int(row[0]) for row in made)])
            first = first or last + 1
        except BaseException:
            if reader is not None:
                await reader.close()
            await writer.close()
            raise
        hlc_high = int(meta.get("hlc_high", 0))
        era = feed_table.era_start(int(last), time.time_ns() // 1_000_000)
        storage = cls(path, writer, reader, meta["node_id"], hlc_high, cache_size, tree, len(rows),
                      feed_window, int(last), int(first), int(kept), era)  # fmt: skip
        storage.meta = meta
        storage.minted = minted
        return storage

    async def close(self) -> None:
        await self._queue.put(None)
        with contextlib.suppress(asyncio.CancelledError):
            await self._writer_task
        for task in list(self._acknowledging):
            task.cancel()
        await asyncio.gather(*self._acknowledging, return_exceptions=True)
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
        # One trip (execute and fetch together): a statement left open between two
        # trips holds the reader's read transaction, and every read other tasks run
        # meanwhile would see the file as it was when this one began.
        rows = await self._reader.execute_fetchall(
            "SELECT state, digest FROM records WHERE key = ?", (key,)
        )
        row = next(iter(rows), None)
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

    async def homes(self, scope: str, *, exclude: str) -> list[str]:
        """The home regions of ``scope``'s items in the pick index, but ``exclude``;
        one index step per region (a skip-scan), not one per item."""
        homes: list[str] = []
        after = ""
        while True:
            rows = await self._reader.execute_fetchall(
                "SELECT home FROM picks WHERE scope = ? AND home > ? ORDER BY home LIMIT 1",
                (scope, after),
            )
            row = next(iter(rows), None)
            if row is None:
                return homes
            after = str(row[0])
            if after != exclude:
                homes.append(after)

    async def held_by(self, scope: str, home: str, owner: str, now_ms: int) -> list[str]:
        """Keys of ``scope``'s items at ``home`` that a live lease of ``owner`` holds,
        as the pick index says (the state under its lock decides)."""
        # Sorted here, not by ORDER BY: that made SQLite walk the pick order's index
        # over the whole topic to skip a sort of the one or two rows this finds (the
        # drain benchmark's pick at 100k records went from 3 to 19 ms).
        rows = await self._reader.execute_fetchall(
            "SELECT priority, born, key FROM picks WHERE holder = ? AND scope = ?"
            " AND home = ? AND busy_until > ?",
            (owner, scope, home, now_ms),
        )
        return [str(key) for _, _, key in sorted(rows)]

    async def changes(self, after: int, lower: str, upper: str, *, limit: int) -> list[Change]:
        """Feed rows after ``seq`` ``after`` of keys in ``[lower, upper)``, in commit order."""
        if self._tail.covers(after):
            return self._tail.changes(after, lower, upper, limit)
        rows = await self._reader.execute_fetchall(
            "SELECT seq, key, kind, at_ms, state FROM feed"
            " WHERE seq > ? AND key >= ? AND key < ? ORDER BY seq LIMIT ?",
            (after, lower, upper, limit),
        )
        return [Change(int(q), str(k), str(w), int(t), bytes(s)) for q, k, w, t, s in rows]

    async def feed_first(self) -> int:
        """The oldest ``seq`` the feed keeps (``feed_last + 1`` when it keeps none)."""
        return self._tail.first

    async def feed_grew(self, after: int) -> None:
        """Return once the feed holds a ``seq`` past ``after``, or has been ended."""
        while self.feed_last <= after and not self.feed_ended:
            await self._fed.wait()

    def end_feed(self) -> None:
        """Let every watcher go (the node is stopping): ``feed_grew`` returns at once."""
        self.feed_ended = True
        self._fed.set()

    async def events(self, key: str) -> list[Event]:
        """``key``'s claim events kept here, oldest first."""
        rows = await self._reader.execute_fetchall(
            "SELECT at_ms, kind, token, owner, identity, detail, actor FROM events"
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
        change: str = "",
        at_ms: int = 0,
    ) -> Stored:
        """Persist ``record``; returns once it is on disk.

        ``hlc`` is the node clock's high-water mark, persisted with the batch so a
        restarted clock never issues a timestamp it issued before. ``state`` is the
        record's canonical encoding when the caller already has it; ``events`` are
        the claim events of the change, kept in the same commit; ``change`` is its
        kind for the change feed (``rules.changes``; ``""``: not fed), ``at_ms`` when.
        """
        stored, done = self.enqueue(record, hlc=hlc, state=state, events=events,
                                    change=change, at_ms=at_ms)  # fmt: skip
        await done
        return stored

    def enqueue(
        self,
        record: Record,
        *,
        hlc: int,
        state: bytes | None = None,
        events: Sequence[Event] = (),
        change: str = "",
        at_ms: int = 0,
        acked: bool = False,
    ) -> tuple[Stored, asyncio.Future[None]]:
        """``put``'s first half: queue ``record`` for the next group commit, and return
        it with the future its commit resolves. The write is committed whether or not
        anyone awaits the future: a caller that may be cancelled awaits it shielded.
        ``acked``: the future resolves only once ``acknowledge`` (if set) says a
        majority of the region's members hold the commit."""
        if state is None:
            state = codec.encode(record)
        stored = Stored(record, codec.digest(state), len(state))
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._hlc_pending = max(self._hlc_pending, hlc)
        self._queue.put_nowait(_Pending(stored, state, done, events, change, at_ms, acked))
        return stored, done

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
            # One turn of the event loop first: calls already under way (their
            # requests read, their changes decided) queue their writes and share
            # this commit instead of each paying for one of their own
            # (docs/performance.md, *Issue 19 levers*).
            await asyncio.sleep(0)
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
        feed = [
            (p.stored.record.key, p.change, p.at_ms, p.state)
            for p in batch
            if p.stored is not None and p.change
        ]
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
            excess = self._feed_rows + len(feed) - self.feed_window
            era = self._era_pending if feed else 0
            # The digests a commit replaces, for the digest tree: the cache's, where
            # it has the key (it holds exactly what committed), else read.
            known = {row[0]: cached.digest for row in rows if (cached := self._cache.get(row[0]))}
            before, ends = await self._writer.run(
                functools.partial(commit_rows, known=known),
                self._writer.conn, rows, picks, events, meta, feed, excess, era,
            )  # fmt: skip
        except Exception as exc:
            log.exception("commit of %d writes failed", len(batch))
            for p in batch:
                if not p.done.done():
                    p.done.set_exception(exc)
            return
        self.hlc_high = hlc_high
        self.meta.update(meta)
        feed_last, feed_first = ends if ends is not None else (self.feed_last, self._tail.first)
        self._tail.extend(feed_last, feed_first, feed)
        if feed:
            self._era_pending = 0
            self._feed_rows = min(self._feed_rows + len(feed), self.feed_window)
        if feed_last != self.feed_last:
            self.feed_last = feed_last
            fed, self._fed = self._fed, asyncio.Event()
            fed.set()
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
        waiting = [p for p in batch if p.acked] if self.acknowledge is not None else []
        for p in batch:
            if p.stored is not None:
                self._remember(p.stored.record.key, p.stored)
            if not p.done.done() and not (p.acked and waiting):
                p.done.set_result(None)
        if waiting:
            task = asyncio.create_task(self._acknowledged(waiting))
            self._acknowledging.add(task)
            task.add_done_callback(self._acknowledging.discard)

    async def _acknowledged(self, batch: list[_Pending]) -> None:
        """One round of acknowledgements for a commit's writes that need them; each
        caller hears the outcome (a refusal: its write is durable here only)."""
        assert self.acknowledge is not None
        try:
            keys = [p.stored.record.key for p in batch if p.stored is not None]
            await self.acknowledge(keys, [p.state for p in batch], [p.events for p in batch])
        except asyncio.CancelledError:  # the store is closing
            for p in batch:
                p.done.cancel()
            raise
        except Exception as exc:
            for p in batch:
                if not p.done.done():
                    p.done.set_exception(exc)
        else:
            for p in batch:
                if not p.done.done():
                    p.done.set_result(None)

    def _remember(self, key: str, stored: Stored) -> None:
        self._cache[key] = stored
        self._cache.move_to_end(key)
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)

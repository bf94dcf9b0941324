"""The real Storage on a real SQLite file: durability settings, group commit, the cache.

Every test opens ``Storage`` on a file under ``tmp_path``; nothing is mocked. The
one outside actor is a plain ``sqlite3`` connection, used to look at the file the
way another process would (PRAGMAs, what is committed) and to hold the write lock
so that a commit can be observed while it is still pending.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from fencemark.node.crdt import FenceState, Grant, Record, Stamp, codec
from fencemark.node.crdt.hlc import pack
from fencemark.node.store.digest_tree import DigestTree, bucket_of
from fencemark.node.store.storage import Storage
from fencemark.node.store.writer import FEED_ENDS

NODE = "storage-test"
BASE_MS = 1_767_225_600_000  # 2026-01-01T00:00:00Z


def stamp(n: int, epoch: int = 0) -> Stamp:
    return Stamp(epoch, pack(BASE_MS, n), NODE)


def key(i: int, *, repo: str = "lattice", topic: str = "backlog") -> str:
    return f"repo/{repo}/mem/{topic}/issue-{i:04d}"


def record(k: str, n: int = 1, **fields: str) -> Record:
    """A record as a node would write it: created, then fields and tags written."""
    s = stamp(n)
    made = Record(k).create("local", s).set_fields({"title": f"title {n}", **fields}, s)
    return made.add_tags(["backlog"], s)


def deleted(k: str, n: int) -> Record:
    return record(k, n).set_deleted(True, stamp(n + 1))


def claimed(k: str, n: int, token: int) -> Record:
    fence = FenceState().grant(token, Grant(pack(BASE_MS, n), "worker-a", "local"), BASE_MS + 60)
    return record(k, n).with_fence(fence)


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "x.sqlite3"


@pytest.fixture
async def storage(db: Path) -> AsyncIterator[Storage]:
    opened = await Storage.open(db)
    yield opened
    with contextlib.suppress(Exception):  # a test may have closed it already
        await opened.close()


@contextlib.contextmanager
def outside(db: Path) -> Iterator[sqlite3.Connection]:
    """A connection to the file from outside Storage, as another process would have."""
    conn = sqlite3.connect(db, isolation_level=None, timeout=0.1)
    try:
        yield conn
    finally:
        conn.close()


def committed_state(db: Path, k: str) -> bytes | None:
    with outside(db) as conn:
        row = conn.execute("SELECT state FROM records WHERE key = ?", (k,)).fetchone()
    return None if row is None else bytes(row[0])


# -- the file ----------------------------------------------------------------


async def test_the_file_is_in_wal_mode(storage: Storage, db: Path) -> None:
    with outside(db) as conn:
        (mode,) = conn.execute("PRAGMA journal_mode").fetchone()
    assert mode == "wal"


async def test_the_writer_commits_with_synchronous_full(storage: Storage) -> None:
    # synchronous is a per-connection setting, invisible to any other connection:
    # ask the writer's own connection. FULL (2) fsyncs the WAL at every commit,
    # which is what "an acknowledged write is on disk" needs in WAL mode.
    assert await storage.pragma("synchronous") == 2


async def test_node_id_survives_reopen_and_a_new_file_gets_a_new_one(
    tmp_path: Path, db: Path
) -> None:
    first = await Storage.open(db)
    node_id = first.node_id
    await first.close()
    again = await Storage.open(db)
    assert again.node_id == node_id
    await again.close()
    other = await Storage.open(tmp_path / "other.sqlite3")
    assert other.node_id != node_id
    await other.close()


# -- round trips ---------------------------------------------------------------


async def test_put_then_get_round_trips_the_state_and_its_digest(
    storage: Storage, db: Path
) -> None:
    written = claimed(key(1), 3, token=7).set_fields({"body": "é" * 10}, stamp(4, epoch=7))
    stored = await storage.put(written, hlc=pack(BASE_MS, 4))
    assert (stored.record, stored.digest) == (written, codec.digest(codec.encode(written)))
    assert await storage.get(key(1)) == stored
    assert committed_state(db, key(1)) == codec.encode(written)
    await storage.close()

    reopened = await Storage.open(db)  # a cold cache: read back from the file
    try:
        got = await reopened.get(key(1))
        assert got is not None and (got.record, got.digest) == (written, stored.digest)
        assert got.record.fence.fence == 7
        assert await reopened.get(key(2)) is None
    finally:
        await reopened.close()


async def test_hlc_high_water_mark_is_persisted_with_the_writes(db: Path) -> None:
    storage = await Storage.open(db)
    await storage.put(record(key(1), 1), hlc=pack(BASE_MS, 50))
    await storage.put(record(key(2), 1), hlc=pack(BASE_MS, 9))  # lower: never lowers it
    assert storage.hlc_high == pack(BASE_MS, 50)
    await storage.close()
    reopened = await Storage.open(db)
    try:
        assert reopened.hlc_high == pack(BASE_MS, 50)
    finally:
        await reopened.close()


# -- group commit ----------------------------------------------------------------


async def test_concurrent_puts_share_commits_and_all_survive_reopen(db: Path) -> None:
    storage = await Storage.open(db)
    records = [record(key(i), i + 1, body=f"body {i}") for i in range(200)]
    results = await asyncio.gather(
        *(storage.put(r, hlc=pack(BASE_MS, i + 1)) for i, r in enumerate(records))
    )
    stats = storage.stats
    assert stats.writes == 200
    assert stats.commits < stats.writes
    assert stats.largest_batch > 1
    assert [s.record for s in results] == records
    await storage.close()

    reopened = await Storage.open(db)
    try:
        assert await reopened.count() == 200
        for r in records:
            got = await reopened.get(r.key)
            assert got is not None and got.record == r
    finally:
        await reopened.close()


async def test_a_state_is_not_served_before_its_commit(db: Path) -> None:
    """While a put waits for the write lock, reads still return the old state."""
    storage = await Storage.open(db)
    old_cached, old_cold = record(key(1), 1), record(key(2), 1)
    await storage.put(old_cached, hlc=pack(BASE_MS, 1))
    await storage.put(old_cold, hlc=pack(BASE_MS, 1))
    await storage.close()
    storage = await Storage.open(db)  # key(2) is only ever read from the file
    try:
        assert (await storage.get(key(1))) is not None  # key(1) is now in the cache
        new_cached, new_cold, brand_new = (
            record(key(1), 2, body="new"),
            record(key(2), 2, body="new"),
            record(key(3), 2),
        )
        with outside(db) as blocker:
            blocker.execute("BEGIN IMMEDIATE")  # the writer's BEGIN IMMEDIATE now waits
            puts = [
                asyncio.create_task(storage.put(r, hlc=pack(BASE_MS, 2)))
                for r in (new_cached, new_cold, brand_new)
            ]
            for _ in range(5):
                await asyncio.sleep(0.02)
                assert not any(p.done() for p in puts)
                got_cached, got_cold = await storage.get(key(1)), await storage.get(key(2))
                assert got_cached is not None and got_cached.record == old_cached
                assert got_cold is not None and got_cold.record == old_cold
                assert await storage.get(key(3)) is None
            blocker.execute("ROLLBACK")
        await asyncio.wait_for(asyncio.gather(*puts), 10)
        for r in (new_cached, new_cold, brand_new):
            got = await storage.get(r.key)
            assert got is not None and got.record == r
            assert committed_state(db, r.key) == codec.encode(r)
    finally:
        await storage.close()


async def test_put_resolves_only_after_its_state_is_committed(storage: Storage, db: Path) -> None:
    written = record(key(1), 1)
    await storage.put(written, hlc=pack(BASE_MS, 1))
    # Another connection, i.e. another process after a crash, sees it at once.
    assert committed_state(db, key(1)) == codec.encode(written)


# -- the cache ---------------------------------------------------------------------


async def test_the_cache_is_bounded_and_evicted_states_are_read_back(db: Path) -> None:
    storage = await Storage.open(db, cache_size=10)
    try:
        records = [record(key(i), i + 1) for i in range(50)]
        for r in records:
            await storage.put(r, hlc=pack(BASE_MS, 1))
        assert len(storage._cache) <= 10
        for r in records:
            got = await storage.get(r.key)
            assert got is not None and got.record == r
            assert len(storage._cache) <= 10
        # Overwrites of evicted and cached keys are both served fresh.
        for r in (records[0], records[-1]):
            newer = r.set_fields({"body": "newer"}, stamp(100))
            await storage.put(newer, hlc=pack(BASE_MS, 100))
            got = await storage.get(r.key)
            assert got is not None and got.record == newer
    finally:
        await storage.close()


# -- scans -------------------------------------------------------------------------


async def test_scan_returns_keys_in_range_in_order(storage: Storage) -> None:
    keys = [
        key(1),
        key(2),
        key(3),
        key(1, topic="other"),
        key(1, repo="lattice2"),
        key(1, repo="latt"),
    ]
    for i, k in enumerate(reversed(keys)):
        await storage.put(record(k, i + 1), hlc=pack(BASE_MS, 1))
    lower, upper = "repo/lattice/mem/", "repo/lattice/mem0"  # "0" follows "/"
    got = await storage.scan(lower, upper, limit=100, include_deleted=False)
    assert [s.record.key for s in got] == sorted([key(1), key(2), key(3), key(1, topic="other")])

    topic = await storage.scan(
        "repo/lattice/mem/backlog/", "repo/lattice/mem/backlog0", limit=100, include_deleted=False
    )
    assert [s.record.key for s in topic] == [key(1), key(2), key(3)]

    page = await storage.scan(lower, upper, limit=2, include_deleted=False)
    assert [s.record.key for s in page] == [key(1), key(2)]
    rest = await storage.scan(lower, upper, after=key(2), limit=2, include_deleted=False)
    assert [s.record.key for s in rest] == [key(3), key(1, topic="other")]
    last = key(1, topic="other")
    assert await storage.scan(lower, upper, after=last, limit=2, include_deleted=False) == []


async def test_scan_shows_tombstones_only_when_asked(storage: Storage) -> None:
    await storage.put(record(key(1), 1), hlc=pack(BASE_MS, 1))
    await storage.put(deleted(key(2), 1), hlc=pack(BASE_MS, 2))
    await storage.put(record(key(3), 1), hlc=pack(BASE_MS, 1))
    lower, upper = "repo/lattice/mem/", "repo/lattice/mem0"
    live = await storage.scan(lower, upper, limit=10, include_deleted=False)
    assert [s.record.key for s in live] == [key(1), key(3)]
    every = await storage.scan(lower, upper, limit=10, include_deleted=True)
    assert [s.record.key for s in every] == [key(1), key(2), key(3)]
    assert every[1].record.is_deleted
    # A record brought back to life leaves the tombstone filter too.
    revived = deleted(key(2), 1).set_deleted(False, stamp(5))
    await storage.put(revived, hlc=pack(BASE_MS, 5))
    live = await storage.scan(lower, upper, limit=10, include_deleted=False)
    assert [s.record.key for s in live] == [key(1), key(2), key(3)]
    assert await storage.count() == 3


async def test_a_data_file_from_before_replication_is_migrated(tmp_path: Path) -> None:
    """Regression: a file without the bucket column failed with 'no such column'."""
    path = tmp_path / "old.sqlite3"
    record = Record("repo/r/mem/t/old").create("local", Stamp(0, pack(1_000), "n"))
    state = codec.encode(record)
    with contextlib.closing(sqlite3.connect(path)) as old:
        old.executescript(
            "CREATE TABLE records (key TEXT PRIMARY KEY, state BLOB NOT NULL,"
            " digest BLOB NOT NULL, deleted INTEGER NOT NULL) WITHOUT ROWID;"
            "CREATE TABLE meta (name TEXT PRIMARY KEY, value) WITHOUT ROWID;"
        )
        old.execute(
            "INSERT INTO records VALUES (?, ?, ?, 0)", (record.key, state, codec.digest(state))
        )
        old.commit()
    storage = await Storage.open(path)
    try:
        assert storage.record_count == 1
        entries = await storage.bucket_entries(
            [range(bucket_of(record.key), bucket_of(record.key) + 1)]
        )
        assert entries == [(record.key, codec.digest(state), record.max_hlc())]
        expected = DigestTree()
        expected.update(record.key, None, codec.digest(state))
        assert storage.tree.root == expected.root
    finally:
        await storage.close()


async def test_a_listing_of_thousands_of_bucket_ranges_returns_exactly_their_records(
    storage: Storage,
) -> None:
    """A round may list a few thousand tree nodes at once: more ranges than SQLite
    parses in one WHERE clause. The listing is every record in the ranges, in key
    order, and nothing outside them."""
    records = [record(key(i)) for i in range(300)]
    for r in records:
        await storage.put(r, hlc=pack(1))
    spans = [range(b, b + 1) for b in range(0, 65536, 2)]  # 32768 disjoint ranges
    wanted = sorted(
        (r.key, codec.digest(codec.encode(r)), r.max_hlc())
        for r in records
        if bucket_of(r.key) % 2 == 0
    )
    assert 0 < len(wanted) < len(records)
    assert await storage.bucket_entries(spans) == wanted
    assert await storage.bucket_entries([range(0, 65536)]) == sorted(
        (r.key, codec.digest(codec.encode(r)), r.max_hlc()) for r in records
    )


async def test_preloaded_states_are_the_stored_ones(db: Path) -> None:
    """``preload`` reads many states in one query into the cache; what ``get`` then
    returns is exactly what a fresh read of the file returns."""
    first = await Storage.open(db)
    try:
        for i in range(20):
            await first.put(claimed(key(i), i + 1, token=i + 1), hlc=pack(1))
    finally:
        await first.close()
    cold, fresh = await Storage.open(db), await Storage.open(db)
    try:
        await cold.preload([key(i) for i in range(25)])  # five of them do not exist
        assert sorted(cold._cache) == sorted(key(i) for i in range(20))
        for i in range(25):
            assert await cold.get(key(i)) == await fresh.get(key(i))
    finally:
        await cold.close()
        await fresh.close()


async def test_a_read_sees_every_commit_made_before_it_while_other_reads_are_under_way(
    db: Path,
) -> None:
    """Regression: ``get`` of a state not in the cache took two trips to the reader
    (execute, then fetch) and left its statement open between them, which kept the
    reader's read transaction open: a read other tasks ran meanwhile saw the file as
    it was before commits that had already returned. A watcher then jumped past feed
    rows it could not see (``watch.follow`` trusts ``feed_last``)."""
    storage = await Storage.open(db, cache_size=1)  # nearly every get reads the file
    keys = [key(i) for i in range(40)]
    stop = asyncio.Event()

    async def getting(offset: int) -> None:
        n = offset
        while not stop.is_set():
            await storage.get(keys[n % len(keys)])
            n += 7

    try:
        for n, k in enumerate(keys):
            await storage.put(record(k, n + 1), hlc=pack(BASE_MS, n + 1))
        getters = [asyncio.create_task(getting(i)) for i in range(4)]
        unseen = []
        for n in range(300):
            k = keys[n % len(keys)]
            await storage.put(record(k, n + 100), hlc=pack(BASE_MS, n + 100), change="updated")
            last = storage.feed_last  # this commit's row: committed before the read below
            rows = await storage.changes(last - 1, "repo/", "repo0", limit=10)
            if [row.seq for row in rows] != [last]:
                unseen.append(last)
        stop.set()
        await asyncio.gather(*getters)
    finally:
        await storage.close()
    assert not unseen, f"{len(unseen)} of 300 committed feed rows not seen by the next read"


async def test_a_commit_reads_the_feeds_ends_by_searching_not_scanning(
    storage: Storage, db: Path
) -> None:
    """Every commit that feeds reads the feed's oldest and last ``seq``; the feed
    holds up to ``--feed-window`` rows of whole states. One SELECT of min() and
    max() together scanned them all per commit (SQLite optimizes a lone min or max
    only): a node's commits grew slower as the window filled, 122 to 65 claim
    cycles/s at one client within 20 s. The query must search the primary key."""
    with outside(db) as conn:
        plan = conn.execute(f"EXPLAIN QUERY PLAN {FEED_ENDS}").fetchall()
    steps = [row[3] for row in plan]
    assert any(step.startswith("SEARCH feed") for step in steps), steps
    assert not any(step.startswith("SCAN feed") for step in steps), steps

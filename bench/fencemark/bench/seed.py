"""Data directories holding N typical records, written through the node's own write path.

Seeding through the API would take minutes at 100k records; instead the records
are remembered through ``Replica.remember`` in-process (the same rules, stamps,
encoding, group commit and SQLite file a node's ``Remember`` uses), then the file
is copied for each region, each copy given its own node id as a node that
replicated them would have.
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
import sqlite3
from pathlib import Path

from fencemark.bench.records import REPO, record_id, typical_fields, typical_tags
from fencemark.node.api.server import DB_FILE
from fencemark.node.core.replica import Replica
from fencemark.node.crdt import HybridClock
from fencemark.node.rules.admission import ANYONE
from fencemark.node.store.storage import Storage

TOPIC = "seed"
CHUNK = 1024  # concurrent remembers: they share group commits


def seed_key(index: int) -> str:
    return f"repo/{REPO}/mem/{TOPIC}/{record_id('s', index)}"


async def seed(data_dir: Path, count: int, *, home: str) -> Path:
    """Write ``count`` typical records homed in ``home`` into a new data dir."""
    storage = await Storage.open(data_dir / DB_FILE)
    try:
        replica = Replica(storage, HybridClock(), home)
        await replica.gate.caught_up()  # the seeded file stands for a node that decided
        tags = typical_tags(home)
        for start in range(0, count, CHUNK):
            await asyncio.gather(
                *(
                    replica.remember(
                        REPO,
                        TOPIC,
                        record_id("s", i),
                        fields=typical_fields(i),
                        tags=tags,
                        caller=ANYONE,  # unfenced: no claim to act for
                    )
                    for i in range(start, min(count, start + CHUNK))
                )
            )
    finally:
        await storage.close()
    return data_dir


def _copy(source: Path, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source / DB_FILE, target / DB_FILE)
    with sqlite3.connect(target / DB_FILE) as db:
        db.execute("UPDATE meta SET value = ? WHERE name = 'node_id'", (secrets.token_hex(6),))


async def copy_replica(source: Path, target: Path) -> Path:
    """A copy of a seeded data dir under a new node identity."""
    await asyncio.to_thread(_copy, source, target)
    return target


def _file_stats(db: Path) -> tuple[int, int, float]:
    with sqlite3.connect(db) as conn:
        count, average = conn.execute("SELECT count(*), avg(length(state)) FROM records").fetchone()
    size = sum(p.stat().st_size for p in db.parent.glob(DB_FILE + "*"))
    return size, int(count), float(average or 0.0)


async def file_stats(data_dir: Path) -> tuple[int, int, float]:
    """(bytes on disk of the database and its WAL, records, mean canonical state bytes)."""
    return await asyncio.to_thread(_file_stats, data_dir / DB_FILE)

"""What one ``ClaimNext`` costs as its topic grows: 1k, 10k, 100k records.

The topic is a queue that has been in use: half of its N records are ``done``
(the older half, as a queue's history is), half are an open backlog, and the 64
oldest open items are claimed by other agents (in flight). So a pick has to pass
over what is not eligible in both ways the pick index knows of: done items,
which the index does not hold at all, and claimed ones, which it holds with
their lease and skips in its scan (``fencemark.node.store.picks``). What it does
*not* exercise: items deferred into the future and items waiting on ``after:``,
which the index also holds and skips one row (or one record) at a time — their
cost grows with how many of them stand ahead, not with N.

The data dir is written in-process through the node's own rules and file
(``Replica.remember``, then ``Claims.claim`` and a ``done`` release for the
older half), as ``seed.py`` does, then a node process is started on it and the
in-flight claims are made through the API. One agent then alternates, ``samples``
times: a ``ClaimNext`` (timed) whose item it releases as done (untimed), and a
plain ``Claim`` by key of an open item from the newest end of the backlog
(timed) that it releases (untimed) — the reference: the same node, file and
record sizes, no pick.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from fencemark.bench.progress import Progress
from fencemark.bench.records import REPO, record_id, typical_fields, typical_tags
from fencemark.bench.stats import median, percentile
from fencemark.client import AsyncClient
from fencemark.node.api.server import DB_FILE
from fencemark.node.core.claims import Claims
from fencemark.node.core.replica import Replica
from fencemark.node.crdt import HybridClock
from fencemark.node.rules.admission import ANYONE
from fencemark.node.store.storage import Storage
from fencemark.node.tools.process import NodeProcess

TOPIC = "picks"
HOME = "local"
IN_FLIGHT = 64  # open items claimed by other agents while the picks run
CHUNK = 1024  # concurrent in-process writes: they share group commits
LEASE_SECONDS = 600


def pick_key(index: int) -> str:
    return f"repo/{REPO}/mem/{TOPIC}/{record_id('p', index)}"


async def seed_used_queue(data_dir: Path, count: int) -> Path:
    """``count`` typical records in one topic, the older half of them done."""
    await asyncio.to_thread(data_dir.mkdir, parents=True, exist_ok=True)
    storage = await Storage.open(data_dir / DB_FILE)
    try:
        replica = Replica(storage, HybridClock(), HOME)
        await replica.gate.caught_up()  # the seeded file stands for a node that decided
        claims = Claims(replica)
        tags = typical_tags(HOME)

        async def create(index: int) -> None:
            fields = typical_fields(index)
            await replica.remember(REPO, TOPIC, record_id("p", index), fields=fields, tags=tags,
                                   caller=ANYONE)  # fmt: skip

        for start in range(0, count, CHUNK):  # in index order: born oldest first
            await asyncio.gather(*(create(i) for i in range(start, min(count, start + CHUNK))))

        async def finish(index: int) -> None:
            key = pick_key(index)
            granted = await claims.claim(key, "seeder", caller=ANYONE, lease_seconds=60)
            assert granted.ok, (key, granted)
            released = await claims.release(key, granted.token, caller=ANYONE, outcome="done")
            assert released.ok, (key, released)

        done = count // 2
        for start in range(0, done, CHUNK):
            await asyncio.gather(*(finish(i) for i in range(start, min(done, start + CHUNK))))
    finally:
        await storage.close()
    return data_dir


async def measure_picks(count: int, samples: int, work: Path, progress: Progress) -> dict[str, Any]:
    """ClaimNext and Claim latencies (ms) on a used queue of ``count`` records."""
    done = count // 2
    if count - done < IN_FLIGHT + 2 * samples:
        raise ValueError(f"{count:,} records leave too few open items for {samples} samples")
    progress.status(f"seeding a used queue of {count:,} records")
    began = time.monotonic()
    data = await seed_used_queue(work / f"picks-{count}", count)
    progress.line(f"seeded {count:,} records ({done:,} done) in {time.monotonic() - began:.1f} s")
    node = await NodeProcess.start(data, region=HOME)
    try:
        async with AsyncClient(node.address, retries=0) as client:
            for n in range(IN_FLIGHT):  # the oldest open items, held by other agents
                held = await client.claim(pick_key(done + n), f"other-{n}",
                                          lease_seconds=LEASE_SECONDS)  # fmt: skip
                assert held.granted, (pick_key(done + n), held.reason)
            picks: list[float] = []
            claims: list[float] = []
            for n in range(samples):
                if n % 20 == 0:
                    progress.status(f"{count:,} records: pick {n}/{samples}")
                began = time.perf_counter()
                picked = await client.claim_next(REPO, TOPIC, "picker", lease_seconds=60)
                picks.append((time.perf_counter() - began) * 1000)
                assert picked.granted and picked.record is not None, picked.reason
                await client.release_claim(picked.record.key, picked.fencing_token,
                                           outcome="done")  # fmt: skip
                key = pick_key(count - 1 - n)  # the newest end: never picked here
                began = time.perf_counter()
                claimed = await client.claim(key, "picker", lease_seconds=60)
                claims.append((time.perf_counter() - began) * 1000)
                assert claimed.granted, (key, claimed.reason)
                await client.release_claim(key, claimed.fencing_token)
    finally:
        await node.stop()
    return {
        "records": count,
        "done": done,
        "in_flight": IN_FLIGHT,
        "samples": samples,
        "pick_p50_ms": median(picks),
        "pick_p99_ms": percentile(picks, 99),
        "claim_p50_ms": median(claims),
        "claim_p99_ms": percentile(claims, 99),
        "pick_ms": picks,
        "claim_ms": claims,
    }

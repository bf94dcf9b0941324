"""Scenario 5: a node's resident memory and its disk bytes per record at N records.

The data dir holds N typical records (``records.py``: five tags, a 300-character
body), written through the node's own write path (``seed.py``). A node process
is started on it, then serves a short mixed load (reads and updates of random
records, so its cache is warm); its RSS is read with psutil after start-up and
after the load. Disk is the database file plus its WAL after a clean stop.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import psutil

from fencemark.bench.anti_entropy import Seeds
from fencemark.bench.progress import Progress
from fencemark.bench.results import ScenarioResult, Settings, Table, at_most, fmt
from fencemark.bench.seed import copy_replica, file_stats, seed_key
from fencemark.client import AsyncClient
from fencemark.node.tools.process import NodeProcess

MIB = 1 << 20
CLIENTS = 16
OPS_PER_CLIENT = 200


async def run_footprint(
    settings: Settings, progress: Progress, work: Path, out: Path, seeds: Seeds
) -> ScenarioResult:
    count = settings.footprint_records
    source = await seeds.get(count, progress)
    data = await copy_replica(source, work / "footprint")
    node = await NodeProcess.start(data, region="us")
    try:
        process = psutil.Process(node.proc.pid)
        started_rss = process.memory_info().rss
        progress.status(f"mixed load on {count:,} records")

        async def client_load(seed_value: int) -> None:
            rng = random.Random(seed_value)
            async with AsyncClient(node.address, retries=0) as client:
                for n in range(OPS_PER_CLIENT):
                    key = seed_key(rng.randrange(count))
                    if n % 2:
                        await client.get(key)
                    else:
                        await client.update(key, fields={"status": f"seen {n}"})

        await asyncio.gather(*(client_load(i) for i in range(CLIENTS)))
        loaded_rss = process.memory_info().rss
    finally:
        await node.stop()
    disk, records, state_bytes = await file_stats(data)
    per_record = disk / records if records else float("nan")
    table = Table(
        f"Footprint at {records:,} typical records",
        ["what", "measured"],
        [
            ["node RSS after start", f"{fmt(started_rss / MIB, 1)} MiB"],
            [f"node RSS after {CLIENTS * OPS_PER_CLIENT:,} mixed operations",
             f"{fmt(loaded_rss / MIB, 1)} MiB"],
            ["database + WAL on disk", f"{fmt(disk / MIB, 1)} MiB"],
            ["disk bytes per record", fmt(per_record)],
            ["canonical state bytes per record (mean)", fmt(state_bytes)],
        ],
    )  # fmt: skip
    rss = max(started_rss, loaded_rss) / MIB
    return ScenarioResult(
        "footprint",
        "Footprint",
        {
            "records": records,
            "rss_started_mib": started_rss / MIB,
            "rss_loaded_mib": loaded_rss / MIB,
            "disk_bytes": disk,
            "disk_bytes_per_record": per_record,
            "state_bytes_per_record": state_bytes,
        },
        [table],
        [
            at_most(f"node RSS at {records:,} records", rss, 200, " MiB"),
            at_most(f"disk per typical record at {records:,} records", per_record, 2048, " bytes"),
        ],
    )

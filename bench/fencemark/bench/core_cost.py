"""The core's own cost of a claim-path call, in-process: no gRPC, no network.

The claims scenario's node target (docs/performance.md, *The floor of a Python
node*) compares the node's CPU per claim-path call with what a call must cost a
Python node at least: the bare gRPC call's CPU on the same node (``grpc-health``)
plus this — the same claim → fenced update → release cycles, by as many
concurrent callers, run straight against ``Claims`` and ``Replica`` on a real
SQLite file (its group commit, its writer thread), timed by the process's CPU
clock (every thread). Measured in the same run as the node, so both share the
machine's moment.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

from fencemark.bench.records import REPO, typical_fields, typical_tags
from fencemark.node.api.server import DB_FILE
from fencemark.node.core.claims import Claims
from fencemark.node.core.replica import Replica
from fencemark.node.crdt import HybridClock
from fencemark.node.rules.admission import ANYONE
from fencemark.node.store.storage import Storage

TOPIC = "core"
LEASE_SECONDS = 60.0
CALLS_PER_CYCLE = 3  # claim, fenced update, release


async def core_ms_per_call(data_dir: Path, callers: int, seconds: float) -> float:
    """CPU milliseconds per call of ``callers`` concurrent claim cycles in-process,
    over ``seconds`` (after a short warm-up), each caller on its own record."""
    await asyncio.to_thread(data_dir.mkdir, parents=True, exist_ok=True)
    storage = await Storage.open(data_dir / DB_FILE)
    try:
        replica = Replica(storage, HybridClock(), "local")
        await replica.gate.caught_up()
        claims = Claims(replica)
        keys = []
        for index in range(callers):
            made = await replica.remember(
                REPO, TOPIC, f"c-{index:04d}", fields=typical_fields(index),
                tags=typical_tags("local"), caller=ANYONE,
            )  # fmt: skip
            keys.append(made.stored.record.key)
        calls = 0
        counting = False
        deadline = 0.0

        async def caller(key: str, owner: str) -> None:
            nonlocal calls
            step = 0
            while not counting or time.monotonic() < deadline:
                granted = await claims.claim(key, owner, caller=ANYONE, lease_seconds=LEASE_SECONDS)
                assert granted.ok, granted
                await replica.update(key, fields={"body": f"step {step}"},
                                     fencing_token=granted.token, caller=ANYONE)  # fmt: skip
                released = await claims.release(key, granted.token, caller=ANYONE)
                assert released.ok, released
                step += 1
                if counting:
                    calls += CALLS_PER_CYCLE

        workers = [asyncio.create_task(caller(k, f"w-{i}")) for i, k in enumerate(keys)]
        try:
            await asyncio.sleep(min(0.5, seconds / 4))  # warm-up: caches, first commits
            began_cpu = time.process_time()
            deadline = time.monotonic() + seconds
            counting = True
            await asyncio.gather(*workers)
            cpu = time.process_time() - began_cpu
        finally:
            for worker in workers:
                worker.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(*workers, return_exceptions=True)
        return cpu * 1000 / calls if calls else float("nan")
    finally:
        await storage.close()

"""Scenario ``fleet``: N connected agents on one node, most of them idle — what an
idle agent costs, and what one new item costs when hundreds wait for it.

One node process. N agents (100 and 1,000; ``--quick``: 100), each on its own
channel, behave as agents do:

- 80 % **wait for work** in a topic where nothing appears: ``ClaimNext`` with a
  wait, again whenever the wait ends;
- 15 % **hold a claim** alive with the client's keepalive (a renewal every third of
  a 6 s lease), each on its own record;
- 5 % **work**: claim next → fenced update → release done, paced to a few items a
  second in all, from a topic of their own.

Measured, with the working agents paused for the quiet figures: the node's CPU
(% of a core) and RSS, against the same node with no agent connected, per idle
agent; its open file descriptors; renewals (p99 latency) and renewals refused
because their lease had run out (must be 0). Then one new item in the waiters'
topic, five times: how many waiters were woken for it, how many ``ClaimNext``
calls the node served for it, and the time from its creation to its grant. Last,
the working agents' ``ClaimNext`` p99 with the fleet connected, against their p99
with no fleet (measured first).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fencemark.bench import plots
from fencemark.bench.progress import Progress
from fencemark.bench.records import REPO
from fencemark.bench.results import ScenarioResult, Settings, Table, Target, at_most, fmt
from fencemark.bench.stats import percentile, ratio
from fencemark.client import AsyncClient, RenewResult
from fencemark.node.tools.process import NodeProcess

IDLE, HELD, WORK = "fleet-idle", "fleet-held", "fleet-work"
LEASE_S = 6.0  # holders renew every 2 s
WAIT_S = 60.0  # a waiter's ClaimNext wait
WORK_RATE = 5.0  # items a second, all working agents together
QUIET_S = 5.0  # the window the quiet CPU is measured over
PROBES = 5  # new items, one at a time, with the fleet waiting
PROBE_WAIT_S = 3.0  # how long a probe's wake-ups are counted
LIMIT = 20_000  # the node's waiter and stream limits, raised above any N here


@dataclass
class Timed:
    """A client wrapper for the keepalive that times its renewals."""

    client: AsyncClient
    latencies: list[float]
    lapsed: list[str]

    async def renew_claim(
        self, key: str, fencing_token: int, *, lease_seconds: float = 0.0
    ) -> RenewResult:
        began = time.perf_counter()
        result = await self.client.renew_claim(key, fencing_token, lease_seconds=lease_seconds)
        self.latencies.append(time.perf_counter() - began)
        if not result.renewed and result.reason == "expired":
            self.lapsed.append(key)
        return result


@dataclass
class Fleet:
    """The agents of one N, and what they saw."""

    clients: list[AsyncClient]
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    woken: list[float] = field(default_factory=list)  # monotonic time a waiter's wait ended
    granted: list[tuple[float, str]] = field(default_factory=list)  # (time, key) to a waiter
    renewals: list[float] = field(default_factory=list)
    lapsed: list[str] = field(default_factory=list)
    work_claims: list[float] = field(default_factory=list)
    working: asyncio.Event = field(default_factory=asyncio.Event)

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)


def node_usage(pid: int) -> tuple[float, float, int]:
    """(CPU seconds, RSS MiB, open file descriptors) of the node process."""
    import psutil

    process = psutil.Process(pid)
    times = process.cpu_times()
    return times.user + times.system, process.memory_info().rss / 2**20, process.num_fds()


async def cpu_share(pid: int, seconds: float) -> float:
    """The node's CPU over ``seconds``, as % of one core."""
    before = node_usage(pid)[0]
    await asyncio.sleep(seconds)
    return (node_usage(pid)[0] - before) / seconds * 100


async def waiter(client: AsyncClient, owner: str, fleet: Fleet) -> None:
    while True:
        result = await client.claim_next(REPO, IDLE, owner, wait_seconds=WAIT_S, lease_seconds=30)
        fleet.woken.append(time.monotonic())
        if result.granted and result.record is not None:
            fleet.granted.append((time.monotonic(), result.record.key))
            await client.release_claim(result.record.key, result.fencing_token, outcome="done")


async def holder(client: AsyncClient, index: int, fleet: Fleet) -> None:
    made = await client.remember(REPO, HELD, f"held-{index:05d}")
    claim = await client.claim(made.record.key, f"holder-{index}", lease_seconds=LEASE_S)
    timed = Timed(client, fleet.renewals, fleet.lapsed)
    from fencemark.client.keepalive import holding

    async with holding(timed, made.record.key, claim.fencing_token, LEASE_S):
        await asyncio.Event().wait()  # holds until cancelled


async def worker(client: AsyncClient, owner: str, pace_s: float, fleet: Fleet) -> None:
    while True:
        await fleet.working.wait()
        began = time.perf_counter()
        picked = await client.claim_next(REPO, WORK, owner, lease_seconds=30)
        fleet.work_claims.append(time.perf_counter() - began)
        if picked.granted and picked.record is not None:
            key, token = picked.record.key, picked.fencing_token
            await client.update(key, fields={"progress": "done"}, fencing_token=token)
            await client.release_claim(key, token, outcome="done", fields={"result": "ok"})
        await asyncio.sleep(pace_s)


@contextlib.asynccontextmanager
async def a_fleet(
    address: str, n: int, progress: Progress, *, only_workers: bool = False
) -> AsyncIterator[Fleet]:
    """N connected agents: 80 % waiting, 15 % holding, 5 % working (paused); or N
    working agents alone (``only_workers``)."""
    holders, workers = max(1, n * 15 // 100), max(1, n * 5 // 100)
    waiters = n - holders - workers
    if only_workers:
        waiters, holders, workers = 0, 0, n
    fleet = Fleet([AsyncClient(address, retries=0, timeout=WAIT_S + 10) for _ in range(n)])
    try:
        pace = workers / WORK_RATE
        for i, client in enumerate(fleet.clients):
            if i < waiters:
                task = waiter(client, f"waiter-{i}", fleet)
            elif i < waiters + holders:
                task = holder(client, i, fleet)
            else:
                task = worker(client, f"worker-{i}", pace, fleet)
            fleet.tasks.append(asyncio.create_task(task))
            if i % 100 == 99:
                progress.status(f"{i + 1:,} of {n:,} agents connected")
                await asyncio.sleep(0.05)
        yield fleet
    finally:
        await fleet.close()


async def probe(address: str, fleet: Fleet, index: int) -> tuple[int, float]:
    """One new item in the waiters' topic: (waiters woken for it, creation → grant s);
    every waiter woken calls again once, so the node served as many calls for it."""
    async with AsyncClient(address) as pm:
        began = time.monotonic()
        made = await pm.remember(REPO, IDLE, f"probe-{index:03d}")
    key = made.record.key
    deadline = began + PROBE_WAIT_S
    await asyncio.sleep(max(0.0, deadline - time.monotonic()))  # the waiters note when
    grant = next((t for t, k in fleet.granted if k == key), math.nan)
    woken = sum(1 for t in fleet.woken if began <= t <= deadline)
    return woken, grant - began


async def measure(
    address: str, pid: int, n: int, settings: Settings, progress: Progress
) -> dict[str, Any]:
    async with a_fleet(address, n, progress) as fleet:
        await asyncio.sleep(2.0)  # every waiter in line, every holder renewing
        progress.status(f"{n:,} agents: quiet")
        cpu = await cpu_share(pid, QUIET_S if not settings.quick else 2.0)
        _, rss, fds = node_usage(pid)
        wakes, grants = [], []
        for index in range(PROBES if not settings.quick else 2):
            progress.status(f"{n:,} agents: a new item ({index + 1})")
            woken, took = await probe(address, fleet, n * 100 + index)
            wakes.append(woken)
            grants.append(took)
        progress.status(f"{n:,} agents: the working ones work")
        fleet.work_claims.clear()
        fleet.working.set()
        await asyncio.sleep(settings.duration * 2)
        fleet.working.clear()
        return {
            "agents": n,
            "cpu_pct": cpu,
            "rss_mib": rss,
            "fds": fds,
            "woken_per_item": sum(wakes) / len(wakes),
            "woken_max": max(wakes),
            "grant_p50_ms": percentile([g * 1000 for g in grants], 50),
            "grant_max_ms": max(g * 1000 for g in grants),
            "renewals": len(fleet.renewals),
            "renewal_p99_ms": percentile([r * 1000 for r in fleet.renewals], 99),
            "lapsed": len(fleet.lapsed),
            "work_claim_p99_ms": percentile([c * 1000 for c in fleet.work_claims], 99),
            "work_claims": len(fleet.work_claims),
        }


async def run_fleet(
    settings: Settings, progress: Progress, work: Path, out: Path
) -> ScenarioResult:
    sizes: Sequence[int] = (100,) if settings.quick else (100, 1_000)
    limits = ("--max-waiters", str(LIMIT), "--max-waiters-per-client", str(LIMIT),
              "--max-streams-per-client", str(LIMIT))  # fmt: skip
    node = await NodeProcess.start(work / "fleet-node", extra_args=limits)
    try:
        async with AsyncClient(node.address) as seeder:
            for index in range(int(WORK_RATE * 60) + 200):
                await seeder.remember(REPO, WORK, f"item-{index:05d}")
        pid = node.proc.pid
        progress.status("no agents: quiet")
        base_cpu = await cpu_share(pid, 2.0)
        _, base_rss, base_fds = node_usage(pid)
        rows = []
        for n in sizes:
            # The fleet's working agents alone first: the same number, the same pace.
            alone = max(1, n * 5 // 100)
            progress.status(f"{alone} working agents alone")
            async with a_fleet(node.address, alone, progress, only_workers=True) as workers:
                workers.working.set()
                await asyncio.sleep(settings.duration * 2)
            base_p99 = percentile([c * 1000 for c in workers.work_claims], 99)
            row = await measure(node.address, pid, n, settings, progress)
            row["cpu_pct_per_idle_agent"] = (row["cpu_pct"] - base_cpu) / n
            row["rss_kib_per_agent"] = (row["rss_mib"] - base_rss) * 1024 / n
            row["work_claim_p99_alone_ms"] = base_p99
            row["work_p99_vs_alone"] = ratio(row["work_claim_p99_ms"], base_p99)
            rows.append(row)
            progress.line(
                f"fleet {n:>5,} agents: node CPU {row['cpu_pct']:.1f} % of a core, RSS"
                f" {row['rss_mib']:.0f} MiB, {row['woken_per_item']:.1f} woken per new item,"
                f" grant {row['grant_p50_ms']:.1f} ms, renewal p99"
                f" {row['renewal_p99_ms']:.1f} ms, {row['lapsed']} lapsed"
            )
    finally:
        await node.stop()
    data = {"base": {"cpu_pct": base_cpu, "rss_mib": base_rss, "fds": base_fds},
            "fleets": rows}  # fmt: skip
    notes = ["The agents of one load-generator process share one connection to the node"
             " (gRPC's global subchannel pool): file descriptors and per-connection costs"
             " are not in these figures."]  # fmt: skip
    return ScenarioResult("fleet", "A fleet of agents on one node, most of them idle", data,
                          _tables(data), _targets(rows), _plots(out, data), notes)  # fmt: skip


def _tables(data: dict[str, Any]) -> list[Table]:
    table = Table(
        "N agents on one node: 80 % waiting, 15 % holding a claim alive, 5 % working",
        ["agents", "node CPU, quiet", "RSS", "fds", "woken per new item", "creation → grant",
         "renewal p99", "lapsed", "working ClaimNext p99"],
    )  # fmt: skip
    base = data["base"]
    table.rows.append(["0", f"{fmt(base['cpu_pct'], 1)} %", f"{fmt(base['rss_mib'])} MiB",
                       str(base["fds"]), "-", "-", "-", "-",
                       "-"])  # fmt: skip
    for row in data["fleets"]:
        table.rows.append([
            f"{row['agents']:,}", f"{fmt(row['cpu_pct'], 1)} %", f"{fmt(row['rss_mib'])} MiB",
            str(row["fds"]), f"{row['woken_per_item']:.1f} (max {row['woken_max']})",
            f"{fmt(row['grant_p50_ms'], 1)} ms (max {fmt(row['grant_max_ms'], 1)})",
            f"{fmt(row['renewal_p99_ms'], 1)} ms", str(row["lapsed"]),
            f"{fmt(row['work_claim_p99_ms'], 1)} ms (alone"
            f" {fmt(row['work_claim_p99_alone_ms'], 1)})",
        ])  # fmt: skip
    return [table]


def _targets(rows: list[dict[str, Any]]) -> list[Target]:
    top = rows[-1]
    n = f"{top['agents']:,} agents"
    return [
        at_most(f"node CPU while the fleet idles, {n}", top["cpu_pct"], 5, " %"),
        at_most(f"node RSS, {n}", top["rss_mib"], 300, " MiB"),
        at_most(f"leases lapsed while renewed, {n}", top["lapsed"], 0, ""),
        at_most(f"renewal p99, {n}", top["renewal_p99_ms"], 100, " ms"),
        at_most(f"waiters woken per new item, {n}", top["woken_per_item"], 3, ""),
        at_most(f"creation → grant (max of the probes), {n}", top["grant_max_ms"], 50, " ms"),
        at_most(f"working ClaimNext p99 with the fleet / alone, {n}",
                top["work_p99_vs_alone"], 2, "x"),
    ]  # fmt: skip


def _plots(out: Path, data: dict[str, Any]) -> list[Path]:
    rows = data["fleets"]
    xs = [float(r["agents"]) for r in rows]
    cost = plots.lines(out / "fleet_cost.png", "Node CPU (quiet) and RSS against connected agents",
                       {"CPU, % of a core": (xs, [r["cpu_pct"] for r in rows]),
                        "RSS, MiB": (xs, [r["rss_mib"] for r in rows])},
                       "agents", "CPU % / MiB", logx=True)  # fmt: skip
    wakes = plots.lines(out / "fleet_wakes.png", "Waiters woken per new item",
                        {"woken": (xs, [r["woken_per_item"] for r in rows])},
                        "agents", "waiters woken", logx=True)  # fmt: skip
    return [cost, wakes]

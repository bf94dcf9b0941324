"""Scenario ``fleet``: N connected agents, most of them idle — what an idle agent
costs a node, and what one new item costs when hundreds wait for it.

**One node** (N = 100, 1,000, 10,000; ``--quick``: 100). The agents run in
load-generator processes (``fencemark.bench.fleet_agents``, up to
``AGENTS_PER_PROCESS`` each), every agent an ``AsyncClient`` with a connection of
its own, and behave as agents do:

- 80 % **wait for work** in a topic where nothing appears: nine in ten through
  ``ClaimNext`` with a wait, one in ten through the MCP server's
  ``repocontext_wait_for_work`` (an MCP session each); a wait lasts the node's
  longest (300 s), and the first is spread so none runs out while measured;
- 15 % **hold a claim** alive with the client's keepalive (a renewal every third of
  a 30 s lease), each on its own record;
- 5 % **work**: claim next → fenced update → release done, paced to a few items a
  second in all, from a topic of their own.

Measured: the node's CPU (% of a core) while nothing but the fleet's waiting goes
on — before the holders start and with them renewing —, its RSS and open file
descriptors, against the same node with no agent; renewals (p99) and renewals
refused because their lease had run out (must be 0). Then one new item in the
waiters' topic, five times: how many waiters were woken for it (answered before
their wait ran out), how many ``ClaimNext`` calls the node served meanwhile, and
the time from the item's creation to its grant. Last, the working agents'
``ClaimNext`` p99 with the fleet connected, against their p99 with no fleet.

**Three regions** (N = 100, 1,000; ``--quick``: 100): every agent in ``us`` waits
through a client that knows all three regions; the new items are homed in ``eu``.
Measured: waiters woken in ``us`` per item, ``ClaimNext`` calls served by ``eu``
and by ``us`` per item, and creation → grant.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fencemark.bench import plots
from fencemark.bench.anti_entropy import until
from fencemark.bench.fleet_agents import AgentsSpec, Seen
from fencemark.bench.progress import Progress
from fencemark.bench.records import REPO
from fencemark.bench.results import ScenarioResult, Settings, Table, Target, at_most, fmt
from fencemark.bench.stats import percentile, ratio
from fencemark.client import AsyncClient
from fencemark.node.tools.ports import Ports
from fencemark.node.tools.process import NodeProcess

IDLE, HELD, WORK = "fleet-idle", "fleet-held", "fleet-work"
LEASE_S, QUICK_LEASE_S = 30.0, 3.0  # holders renew every third of it
WAIT_S = 300.0  # a waiter's ClaimNext wait: the node's longest
MCP_SHARE = 10  # one waiter in this many waits through the MCP server
WORK_RATE = 5.0  # items a second, all working agents together
QUIET_S = 5.0  # the window the quiet CPU is measured over
PROBES = 5  # new items, one at a time, with the fleet waiting
PROBE_WAIT_S = 3.0  # how long a probe's wake-ups are counted
LIMIT = 20_000  # the node's waiter, stream and connection limits, above any N here
AGENTS_PER_PROCESS = 2_500
WORK_WINDOW_S = 20.0  # the working agents' window: about 100 items at WORK_RATE
READY_S = 900.0  # a load generator's agents connected within this


class Generators:
    """The load-generator processes of one fleet."""

    def __init__(self, procs: list[asyncio.subprocess.Process]) -> None:
        self.procs = procs
        self.seen = Seen()

    @classmethod
    @contextlib.asynccontextmanager
    async def running(
        cls, specs: Sequence[AgentsSpec], logs: Path, progress: Progress, label: str
    ) -> AsyncIterator[Generators]:
        await asyncio.to_thread(logs.mkdir, parents=True, exist_ok=True)
        procs = []
        for index, spec in enumerate(specs):
            with (logs / f"agents-{index}.log").open("ab") as log:
                procs.append(await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "fencemark.bench.fleet_agents",
                    json.dumps(asdict(spec)),
                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=log,
                ))  # fmt: skip
        generators = cls(procs)
        try:
            await generators._ready(progress, label)
            yield generators
        finally:
            await generators._stop()

    async def _line(self, proc: asyncio.subprocess.Process) -> dict[str, Any]:
        assert proc.stdout is not None
        line = await proc.stdout.readline()
        if not line:
            raise RuntimeError(f"a load generator exited ({await proc.wait()}): see its log")
        message: dict[str, Any] = json.loads(line)
        return message

    async def _ready(self, progress: Progress, label: str) -> None:
        connected = [0] * len(self.procs)

        async def one(index: int, proc: asyncio.subprocess.Process) -> None:
            while "ready" not in (message := await self._line(proc)):
                connected[index] = message["connected"]
                progress.status(f"{label}: {sum(connected):,} agents connected")
            connected[index] = message["ready"]

        async with asyncio.timeout(READY_S):
            await asyncio.gather(*(one(i, p) for i, p in enumerate(self.procs)))

    async def ask(self, command: str) -> list[dict[str, Any]]:
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(command.encode() + b"\n")
        answers = await asyncio.gather(*(self._line(p) for p in self.procs))
        if command == "report":
            for answer in answers:
                self.seen.add(answer)
        return answers

    async def _stop(self) -> None:
        for proc in self.procs:
            if proc.returncode is None and proc.stdin is not None:
                with contextlib.suppress(ConnectionError):
                    proc.stdin.write(b"stop\n")
        for proc in self.procs:
            try:
                async with asyncio.timeout(30):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()


def plan(
    n: int, *, target: str, regions: dict[str, str] | None = None, only_workers: bool = False,
    only_waiters: bool = False, quick: bool = False,
) -> list[AgentsSpec]:  # fmt: skip
    """The fleet's agents split over load-generator processes."""
    holders, workers = max(1, n * 15 // 100), max(1, n * 5 // 100)
    if only_workers:
        holders, workers = 0, n
    if only_waiters:
        holders, workers = 0, 0
    waiters = n - holders - workers
    mcp = waiters // MCP_SHARE
    pace = max(1, workers) / WORK_RATE
    count = max(1, math.ceil(n / AGENTS_PER_PROCESS))
    specs, first = [], 0
    for index in range(count):

        def share(total: int, i: int = index) -> int:
            return total // count + (1 if i < total % count else 0)

        spec = AgentsSpec(
            target=target, regions=regions, repo=REPO, first=first,
            waiters=share(waiters - mcp), mcp_waiters=share(mcp), holders=share(holders),
            workers=share(workers), idle_topic=IDLE, held_topic=HELD, work_topic=WORK,
            wait_s=WAIT_S, lease_s=QUICK_LEASE_S if quick else LEASE_S, pace_s=pace,
        )  # fmt: skip
        specs.append(spec)
        first += spec.waiters + spec.mcp_waiters + spec.holders + spec.workers
    return specs


def work_window(settings: Settings) -> float:
    return settings.duration * 2 if settings.quick else WORK_WINDOW_S


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


class Node:
    """A node process with its metrics port: ClaimNext calls it served."""

    def __init__(self, process: NodeProcess, metrics_port: int) -> None:
        self.process = process
        self.metrics_port = metrics_port

    @property
    def address(self) -> str:
        return self.process.address

    @property
    def pid(self) -> int:
        return self.process.proc.pid

    @classmethod
    async def start(cls, data: Path, *, region: str = "local", peers: Sequence[str] = (),
                    listen: str = "127.0.0.1:0") -> Node:  # fmt: skip
        """A node process; ``peers``: ``REGION=HOST:PORT`` each."""
        held = Ports()  # the metrics port, held until the node listens on it
        port = held.take()
        limits = ("--max-waiters", str(LIMIT), "--max-waiters-per-client", str(LIMIT),
                  "--max-streams-per-client", str(LIMIT), "--max-connections", str(LIMIT),
                  # streams per client stay below the read budget (the node insists)
                  "--max-concurrent-reads", str(2 * LIMIT),
                  "--metrics-listen", f"127.0.0.1:{port}")  # fmt: skip
        extra = (*limits, *(f"--peer={peer}" for peer in peers))
        try:
            return cls(await NodeProcess.start(data, region=region, listen=listen,
                                               extra_args=extra), port)  # fmt: skip
        finally:
            held.close()  # the node listens on it now, or never will

    def claim_next_calls(self) -> float:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("fencemark_requests_total{") and "ClaimNext" in line
        )

    async def calls(self) -> float:
        return await asyncio.to_thread(self.claim_next_calls)


async def probe(
    home: Node, nodes: Sequence[Node], fleet: Generators, index: int, *, region: str = ""
) -> dict[str, float]:
    """One new item in the waiters' topic, made at ``home`` (homed in ``region`` when
    given): waiters woken for it, ClaimNext calls each node served meanwhile, creation
    → grant (s)."""
    await fleet.ask("report")  # what came before is not this item's
    woken_before = len(fleet.seen.woken)
    calls_before = [await n.calls() for n in nodes]
    async with AsyncClient(home.address) as pm:
        tags = [f"homeRegion:{region}"] if region else []
        began = time.monotonic()
        made = await pm.remember(REPO, IDLE, f"probe-{index:06d}", tags=tags)
    await asyncio.sleep(max(0.0, began + PROBE_WAIT_S - time.monotonic()))
    calls_after = [await n.calls() for n in nodes]
    await fleet.ask("report")
    grant = next((t for t, k in fleet.seen.granted if k == made.record.key), math.nan)
    woken = sum(1 for t in fleet.seen.woken[woken_before:] if t >= began)
    out = {"woken": float(woken), "grant_s": grant - began}
    for number, (before, after) in enumerate(zip(calls_before, calls_after, strict=True)):
        out[f"calls_{number}"] = after - before
    return out


async def alone_p99(node: Node, n: int, settings: Settings, work: Path,
                    progress: Progress) -> float:  # fmt: skip
    """The working agents' ClaimNext p99 with no fleet: the same number, the same pace."""
    alone = max(1, n * 5 // 100)
    specs = plan(alone, target=node.address, only_workers=True, quick=settings.quick)
    async with Generators.running(specs, work, progress, f"{alone} working agents") as fleet:
        await fleet.ask("work")
        await asyncio.sleep(work_window(settings))
        await fleet.ask("rest")
        await fleet.ask("report")
    return percentile([c * 1000 for c in fleet.seen.work_claims], 99)


async def measure_one_node(
    node: Node, n: int, settings: Settings, work: Path, progress: Progress
) -> dict[str, Any]:
    quiet_s = QUIET_S if not settings.quick else 2.0
    specs = plan(n, target=node.address, quick=settings.quick)
    async with Generators.running(specs, work, progress, f"{n:,} agents") as fleet:
        await asyncio.sleep(2.0)
        progress.status(f"{n:,} agents: quiet, waiting only")
        cpu_waiting = await cpu_share(node.pid, quiet_s)
        progress.status(f"{n:,} agents: the holders claim")
        await fleet.ask("hold")
        await asyncio.sleep(2.0)
        await fleet.ask("report")
        renewals_before = len(fleet.seen.renewals)
        progress.status(f"{n:,} agents: quiet, holders renewing")
        # A third of the lease: every holder renews once in the window, wherever it falls.
        renewing_s = (QUICK_LEASE_S if settings.quick else LEASE_S) / 3
        cpu = await cpu_share(node.pid, renewing_s)
        await fleet.ask("report")
        renewal_rate = (len(fleet.seen.renewals) - renewals_before) / renewing_s
        _, rss, fds = node_usage(node.pid)
        probes = []
        for index in range(PROBES if not settings.quick else 2):
            progress.status(f"{n:,} agents: a new item ({index + 1})")
            probes.append(await probe(node, [node], fleet, n * 100 + index))
        progress.status(f"{n:,} agents: the working ones work")
        fleet.seen.work_claims.clear()
        await fleet.ask("work")
        await asyncio.sleep(work_window(settings))
        await fleet.ask("rest")
        await fleet.ask("report")
        seen = fleet.seen
    return {
        "agents": n,
        "processes": len(specs),
        "mcp_waiters": sum(s.mcp_waiters for s in specs),
        "cpu_pct_waiting": cpu_waiting,
        "cpu_pct": cpu,
        "renewals_per_s": renewal_rate,
        "rss_mib": rss,
        "fds": fds,
        "woken_per_item": sum(p["woken"] for p in probes) / len(probes),
        "woken_max": int(max(p["woken"] for p in probes)),
        "calls_per_item": sum(p["calls_0"] for p in probes) / len(probes),
        "grant_p50_ms": percentile([p["grant_s"] * 1000 for p in probes], 50),
        "grant_max_ms": max(p["grant_s"] * 1000 for p in probes),
        "renewals": len(seen.renewals),
        "renewal_p99_ms": percentile([r * 1000 for r in seen.renewals], 99),
        "lapsed": len(seen.lapsed),
        "timeouts": seen.timeouts,
        "errors": dict(seen.errors),
        "work_claim_p99_ms": percentile([c * 1000 for c in seen.work_claims], 99),
        "work_claims": len(seen.work_claims),
    }


async def measure_regions(
    nodes: dict[str, Node], n: int, settings: Settings, work: Path, progress: Progress
) -> dict[str, Any]:
    regions = {r: node.address for r, node in nodes.items()}
    specs = plan(n, target=regions["us"], regions=regions, only_waiters=True,
                 quick=settings.quick)  # fmt: skip
    label = f"{n:,} agents in us"
    async with Generators.running(specs, work, progress, label) as fleet:
        await asyncio.sleep(2.0)
        probes = []
        for index in range(PROBES if not settings.quick else 2):
            progress.status(f"{label}: a new item in eu ({index + 1})")
            probes.append(await probe(nodes["eu"], [nodes["us"], nodes["eu"]], fleet,
                                      n * 100 + 50 + index, region="eu"))  # fmt: skip
        seen = fleet.seen
    return {
        "agents": n,
        "mcp_waiters": sum(s.mcp_waiters for s in specs),
        "woken_per_item": sum(p["woken"] for p in probes) / len(probes),
        "woken_max": int(max(p["woken"] for p in probes)),
        "calls_us_per_item": sum(p["calls_0"] for p in probes) / len(probes),
        "calls_eu_per_item": sum(p["calls_1"] for p in probes) / len(probes),
        "grant_p50_ms": percentile([p["grant_s"] * 1000 for p in probes], 50),
        "grant_max_ms": max(p["grant_s"] * 1000 for p in probes),
        "timeouts": seen.timeouts,
        "errors": dict(seen.errors),
    }


async def run_fleet(
    settings: Settings, progress: Progress, work: Path, out: Path
) -> ScenarioResult:
    sizes: Sequence[int] = (100,) if settings.quick else (100, 1_000, 10_000)
    region_sizes: Sequence[int] = (100,) if settings.quick else (100, 1_000)
    node = await Node.start(work / "fleet-node")
    try:
        async with AsyncClient(node.address) as seeder:
            for index in range(int(WORK_RATE * 60) + 200):
                await seeder.remember(REPO, WORK, f"item-{index:05d}")
        progress.status("no agents: quiet")
        base_cpu = await cpu_share(node.pid, 2.0)
        _, base_rss, base_fds = node_usage(node.pid)
        rows = []
        for n in sizes:
            progress.status(f"{max(1, n * 5 // 100)} working agents alone")
            base_p99 = await alone_p99(node, n, settings, work / f"alone-{n}", progress)
            row = await measure_one_node(node, n, settings, work / f"fleet-{n}", progress)
            row["cpu_pct_per_1000_waiting"] = (row["cpu_pct_waiting"] - base_cpu) * 1000 / n
            row["rss_kib_per_agent"] = (row["rss_mib"] - base_rss) * 1024 / n
            row["fds_per_agent"] = (row["fds"] - base_fds) / n
            row["work_claim_p99_alone_ms"] = base_p99
            row["work_p99_vs_alone"] = ratio(row["work_claim_p99_ms"], base_p99)
            rows.append(row)
            progress.line(
                f"fleet {n:>6,} agents: node CPU {row['cpu_pct_waiting']:.1f} % waiting,"
                f" {row['cpu_pct']:.1f} % with {row['renewals_per_s']:.0f} renewals/s;"
                f" RSS {row['rss_mib']:.0f} MiB, {row['fds']:,} fds;"
                f" {row['woken_per_item']:.1f} woken and {row['calls_per_item']:.1f} calls"
                f" per new item, grant {row['grant_p50_ms']:.1f} ms; renewal p99"
                f" {row['renewal_p99_ms']:.1f} ms, {row['lapsed']} lapsed"
            )
    finally:
        await node.process.stop()
    across = await run_regions(settings, progress, work, region_sizes)
    data = {"base": {"cpu_pct": base_cpu, "rss_mib": base_rss, "fds": base_fds},
            "fleets": rows, "regions": across}  # fmt: skip
    notes = [
        f"Each agent on a connection of its own, up to {AGENTS_PER_PROCESS:,} per"
        " load-generator process. Waiting: ClaimNext for the node's longest wait"
        f" ({WAIT_S:.0f} s; N/{WAIT_S:.0f} calls a second, not in the quiet windows), one"
        f" in {MCP_SHARE} through an MCP session's repocontext_wait_for_work; holding: a"
        f" {LEASE_S:.0f} s lease renewed every third; working: {WORK_RATE:g} items/s in"
        f" all, for {WORK_WINDOW_S:.0f} s, against the same agents alone. CPU waiting: over"
        f" {QUIET_S:.0f} s before the holders claim; + renewals: over a third of a lease."
        f" With no agent: {fmt(base_cpu, 1)} % of a core, {fmt(base_rss)} MiB,"
        f" {base_fds} fds.",
    ]
    return ScenarioResult("fleet", "A fleet of agents on one node, most of them idle", data,
                          _tables(data), _targets(rows, across), _plots(out, data),
                          notes)  # fmt: skip


async def run_regions(
    settings: Settings, progress: Progress, work: Path, sizes: Sequence[int]
) -> list[dict[str, Any]]:
    names = ("us", "eu", "ap")
    held = Ports()  # the nodes' ports, held until they listen (fencemark.node.tools.ports)
    ports = {r: held.take() for r in names}
    nodes: dict[str, Node] = {}
    rows = []
    try:
        for region in names:
            peers = [f"{p}=127.0.0.1:{ports[p]}" for p in names if p != region]
            listen = f"127.0.0.1:{ports[region]}"
            nodes[region] = await Node.start(work / f"regions-{region}", region=region,
                                             peers=peers, listen=listen)  # fmt: skip
        progress.status("three regions: every one deciding claims")
        async with contextlib.AsyncExitStack() as stack:
            clients = [await stack.enter_async_context(AsyncClient(node.address))
                       for node in nodes.values()]  # fmt: skip

            async def all_deciding() -> bool:
                return all([(await c.info()).claims_serving for c in clients])

            await until("every region deciding claims", all_deciding, 60, 0.1)
        for n in sizes:
            row = await measure_regions(nodes, n, settings, work / f"regions-{n}", progress)
            rows.append(row)
            progress.line(
                f"fleet {n:>6,} agents in us, items in eu: {row['woken_per_item']:.1f} woken,"
                f" {row['calls_eu_per_item']:.1f} calls at eu and"
                f" {row['calls_us_per_item']:.1f} at us per item,"
                f" grant {row['grant_p50_ms']:.1f} ms"
            )
    finally:
        await asyncio.gather(*(node.process.stop() for node in nodes.values()))
        held.close()
    return rows


def _tables(data: dict[str, Any]) -> list[Table]:
    one = Table(
        "N agents on one node: 80 % waiting (one in ten through MCP), 15 % holding a claim"
        " alive, 5 % working",
        ["agents", "CPU, waiting", "CPU, + renewals", "RSS", "fds", "woken / calls per new"
         " item", "creation → grant", "renewal p99", "lapsed", "working ClaimNext p99"],
    )  # fmt: skip
    for row in data["fleets"]:
        one.rows.append([
            f"{row['agents']:,}", f"{fmt(row['cpu_pct_waiting'], 1)} %",
            f"{fmt(row['cpu_pct'], 1)} % ({fmt(row['renewals_per_s'])}/s)",
            f"{fmt(row['rss_mib'])} MiB", f"{row['fds']:,}",
            f"{row['woken_per_item']:.1f} / {row['calls_per_item']:.1f}",
            f"{fmt(row['grant_p50_ms'], 1)} ms (max {fmt(row['grant_max_ms'], 1)})",
            f"{fmt(row['renewal_p99_ms'], 1)} ms", str(row["lapsed"]),
            f"{fmt(row['work_claim_p99_ms'], 1)} ms (alone"
            f" {fmt(row['work_claim_p99_alone_ms'], 1)})",
        ])  # fmt: skip
    regions = Table(
        "N agents waiting in us (one in ten through MCP), each new item homed in eu",
        ["agents", "woken per item", "ClaimNext at eu / at us per item", "creation → grant"],
    )
    for row in data["regions"]:
        regions.rows.append([
            f"{row['agents']:,}", f"{row['woken_per_item']:.1f} (max {row['woken_max']})",
            f"{row['calls_eu_per_item']:.1f} / {row['calls_us_per_item']:.1f}",
            f"{fmt(row['grant_p50_ms'], 1)} ms (max {fmt(row['grant_max_ms'], 1)})",
        ])  # fmt: skip
    return [one, regions]


def _targets(rows: list[dict[str, Any]], across: list[dict[str, Any]]) -> list[Target]:
    at = next((r for r in rows if r["agents"] == 1_000), rows[-1])
    n = f"{at['agents']:,} agents"
    targets = [
        at_most(f"node CPU while the fleet idles, {n}", at["cpu_pct"], 5, " %"),
        at_most(f"node RSS, {n}", at["rss_mib"], 300, " MiB"),
        at_most(f"leases lapsed while renewed, {n}", at["lapsed"], 0, ""),
        at_most(f"renewal p99, {n}", at["renewal_p99_ms"], 100, " ms"),
        at_most(f"waiters woken per new item, {n}", at["woken_per_item"], 3, ""),
        at_most(f"ClaimNext calls per new item, {n}", at["calls_per_item"], 5, ""),
        at_most(f"creation → grant (max of the probes), {n}", at["grant_max_ms"], 50, " ms"),
        at_most(f"working ClaimNext p99 with the fleet / alone, {n}",
                at["work_p99_vs_alone"], 2, "x"),
    ]  # fmt: skip
    top = across[-1]
    targets.append(at_most(f"waiters in us woken per new eu item, {top['agents']:,} agents",
                           top["woken_per_item"], 3, ""))  # fmt: skip
    targets.append(at_most(f"ClaimNext calls at eu per new eu item, {top['agents']:,} agents",
                           top["calls_eu_per_item"], 5, ""))  # fmt: skip
    return targets  # the stretch (10,000 agents) is reported in the table, not judged


def _plots(out: Path, data: dict[str, Any]) -> list[Path]:
    rows, across = data["fleets"], data["regions"]
    xs = [float(r["agents"]) for r in rows]
    cost = plots.lines(out / "fleet_cost.png", "Node CPU (quiet) and RSS against connected agents",
                       {"CPU, % of a core (waiting)": (xs, [r["cpu_pct_waiting"] for r in rows]),
                        "CPU, % of a core (+ renewals)": (xs, [r["cpu_pct"] for r in rows]),
                        "RSS, MiB": (xs, [r["rss_mib"] for r in rows])},
                       "agents", "CPU % / MiB", logx=True)  # fmt: skip
    wakes = plots.lines(out / "fleet_wakes.png", "Waiters woken, and calls, per new item",
                        {"one node: woken": (xs, [r["woken_per_item"] for r in rows]),
                         "one node: ClaimNext calls": (xs, [r["calls_per_item"] for r in rows]),
                         "us waiters, eu item: woken": ([float(r["agents"]) for r in across],
                                                        [r["woken_per_item"] for r in across]),
                         "us waiters, eu item: calls at eu": (
                             [float(r["agents"]) for r in across],
                             [r["calls_eu_per_item"] for r in across])},
                        "agents", "per new item", logx=True)  # fmt: skip
    return [cost, wakes]

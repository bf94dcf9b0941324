"""Scenario ``wan``: agents in three regions over a slow network and a partition,
on Fencemark, on an etcd cluster spread over the regions, and on one Redis.

Three regions ``us``, ``eu``, ``ap`` on one machine, a round trip of R between any
two (``wan_net``: every link through a fault proxy; a region's own clients
direct). N agents per region drain a backlog, each on its own connection, with
each system's recipe of the ``drain`` scenario (``work_queues``): take the next
item under a fencing token, a fenced update, done with the result.

- **Fencemark**: one node per region, items homed evenly in the three regions
  (``homeRegion:``); an agent uses the routing client as agents do: ``ClaimNext``
  asked of its own region first, then the others; the update and the done go to
  the item's home.
- **etcd**: three members, one per region, each region's agents on their own
  member: every step is a transaction through the raft log, committed by a quorum
  across the regions.
- **Redis**: one durable primary (AOF, fsync always) in ``us``; the agents of the
  other regions reach it across the network.

**Windows.** For each R and N, each system in turn drains for a fixed time; the
backlog is topped up before each window to outlast it (a window that runs dry is
flagged). Per system and region: items/s, per-item latency p50/p99, errors by kind.
**The cut.** At the largest R with the fewest agents: a steady phase, then ``ap``
cut off from both other regions while every agent keeps working (ap's agents keep
calling their own region: for Redis that is the cut link), then the heal. Items/s
per region per second across it. For Fencemark, how long after the heal the work
done on either side of the cut is seen everywhere, and that the replicas are
identical at the end.

**The ledger.** Every item any agent finished, by system: no item done twice, and
no acknowledged result lost (each is done, with its result, in the final state).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fencemark.bench import plots, wan_net
from fencemark.bench.drivers import CycleFailed
from fencemark.bench.progress import Progress
from fencemark.bench.records import REPO, typical_fields, typical_tags
from fencemark.bench.results import (
    ScenarioResult,
    Settings,
    Table,
    Target,
    at_least,
    at_most,
    fmt,
)
from fencemark.bench.stats import percentile, ratio
from fencemark.bench.work_queues import (
    ETCD_SEED_BATCH,
    LEASE_SECONDS,
    RESULT,
    Take,
    _etcd_take,
    _fencemark_take,
    _redis_take,
    item_id,
    seed_redis,
)
from fencemark.client import AsyncClient

REGIONS = ("us", "eu", "ap")
SYSTEMS = ("fencemark", "etcd", "redis")
CUT = "ap"  # the region cut off in the cut phase
TOPIC = "wan"
ETCD_BASE, REDIS_BASE = "/wan", "wan"
CALL_TIMEOUT_S = 3.0  # an agent's call across a cut gives up after this
RETRY_PAUSE_S = 0.2  # after an error, before the agent tries again
# Items/s guessed for a system's first window, to size its backlog (more than any
# system drains on two cores: a backlog that runs dry makes the rate a lower bound).
FIRST_SEED = {"fencemark": 600, "etcd": 500, "redis": 4_000}
SETTLE_LIMIT_S = 60.0  # for a seeded backlog to reach every Fencemark replica
CONVERGE_LIMIT_S = 30.0
SAMPLED = 30  # items done during the cut, checked everywhere after the heal


@dataclass
class Finished:
    """One item an agent finished: where, when (seconds into the run) and how long."""

    system: str
    phase: str
    region: str
    item: str
    at: float
    seconds: float


@dataclass
class Ledger:
    started: float = field(default_factory=time.monotonic)
    finished: list[Finished] = field(default_factory=list)
    errors: Counter[tuple[str, str, str, str]] = field(default_factory=Counter)
    dry: set[tuple[str, str]] = field(default_factory=set)  # (system, phase) that ran out

    def now(self) -> float:
        return time.monotonic() - self.started

    def of(self, system: str, phase: str) -> list[Finished]:
        return [f for f in self.finished if f.system == system and f.phase == phase]


class Agents:
    """One system's agents, N per region, and how to top up its backlog."""

    def __init__(
        self,
        system: str,
        takes: Mapping[str, Sequence[Take]],
        seed: Callable[[int], Awaitable[None]],
        close: Callable[[], Awaitable[None]],
    ) -> None:
        self.system = system
        self.takes = takes
        self.seed = seed
        self.close = close


@dataclass
class Network:
    fencemark: Any  # LocalCluster
    etcd: wan_net.EtcdCluster
    redis: wan_net.RedisPrimary

    def set_rtt(self, seconds: float) -> None:
        wan_net.set_fencemark_rtt(self.fencemark, seconds)
        self.etcd.set_rtt(seconds)
        self.redis.set_rtt(seconds)

    def isolate(self, system: str, region: str) -> None:
        if system == "fencemark":
            assert self.fencemark.mesh is not None
            self.fencemark.mesh.isolate(region)
        elif system == "etcd":
            self.etcd.isolate(region)
        else:
            self.redis.isolate(region)

    def heal(self, system: str) -> None:
        if system == "fencemark":
            assert self.fencemark.mesh is not None
            self.fencemark.mesh.heal()
        elif system == "etcd":
            self.etcd.heal()
        else:
            self.redis.heal()

    async def stop(self) -> None:
        await asyncio.gather(
            self.fencemark.stop(), self.etcd.stop(), self.redis.stop(), return_exceptions=True
        )


class Seeds:
    """Fresh item numbers for every system, so a top-up never repeats an id."""

    def __init__(self) -> None:
        self.next: dict[str, int] = defaultdict(int)

    def take(self, system: str, count: int) -> range:
        start = self.next[system]
        self.next[system] = start + count
        return range(start, start + count)


# -- each system's agents ------------------------------------------------------------


async def fencemark_agents(cluster: Any, agents: int, seeds: Seeds) -> Agents:
    clients = {
        region: [
            AsyncClient(
                cluster.addresses[region],
                regions=cluster.routes_from(region),
                retries=0,
                timeout=CALL_TIMEOUT_S,
            )
            for _ in range(agents)
        ]
        for region in REGIONS
    }
    takes = {
        region: [_fencemark_take(c, TOPIC, f"{region}-agent-{i}") for i, c in enumerate(cs)]
        for region, cs in clients.items()
    }

    async def seed(count: int) -> None:
        per_region = max(1, count // len(REGIONS))
        await asyncio.gather(*(
            _seed_in(cluster.addresses[region], region, seeds.take(f"fm-{region}", per_region))
            for region in REGIONS
        ))  # fmt: skip
        await _replicated(cluster)  # a window measures draining, not replicating the seeds

    async def close() -> None:
        await asyncio.gather(*(c.close() for cs in clients.values() for c in cs))

    return Agents("fencemark", takes, seed, close)


async def _replicated(cluster: Any) -> None:
    """Until every node holds as many records as the one holding most (the seeds
    replicated everywhere), or ``SETTLE_LIMIT_S``."""
    clients = [AsyncClient(cluster.addresses[r], retries=2) for r in REGIONS]
    try:
        deadline = time.monotonic() + SETTLE_LIMIT_S
        while time.monotonic() < deadline:
            counts = [(await c.info()).record_count for c in clients]
            if min(counts) == max(counts):
                return
            await asyncio.sleep(0.2)
    finally:
        await asyncio.gather(*(c.close() for c in clients))


async def _seed_in(address: str, region: str, indexes: range) -> None:
    """Items homed in ``region``, created at its own node (ids carry the region)."""
    clients = [AsyncClient(address, retries=2) for _ in range(8)]
    try:
        queue = iter(indexes)

        async def seeder(client: AsyncClient) -> None:
            for index in queue:
                name = f"{region}-{item_id(index)}"
                await client.remember(REPO, TOPIC, name, tags=typical_tags(region),
                                      fields=typical_fields(index))  # fmt: skip

        await asyncio.gather(*(seeder(clients[i % len(clients)]) for i in range(32)))
    finally:
        await asyncio.gather(*(c.close() for c in clients))


async def etcd_agents(etcd: wan_net.EtcdCluster, agents: int, seeds: Seeds) -> Agents:
    import aetcd

    clients: dict[str, list[Any]] = {}
    takes: dict[str, list[Take]] = {}
    for region in REGIONS:
        port = etcd.client_ports[region]
        clients[region], takes[region] = [], []
        for index in range(agents):
            client = aetcd.Client(host="127.0.0.1", port=port, timeout=CALL_TIMEOUT_S)
            await client.connect()
            session = await client.lease(LEASE_SECONDS * 5)
            clients[region].append(client)
            spread = index * len(REGIONS) + REGIONS.index(region)
            takes[region].append(
                _etcd_take(client, session, ETCD_BASE, f"{region}-{index}", spread)
            )
    seeder = clients[REGIONS[0]][0]

    async def seed(count: int) -> None:
        from fencemark.bench.work_queues import _item_value

        tx = seeder.transactions
        indexes = seeds.take("etcd", count)
        for start in range(indexes.start, indexes.stop, ETCD_SEED_BATCH):
            batch = range(start, min(indexes.stop, start + ETCD_SEED_BATCH))
            puts = [
                tx.put(f"{ETCD_BASE}/queue/{item_id(i)}".encode(), _item_value(i)) for i in batch
            ]
            await seeder.transaction(compare=[], success=puts, failure=[])

    async def close() -> None:
        for client in (c for cs in clients.values() for c in cs):
            with contextlib.suppress(Exception):
                await client.close()

    return Agents("etcd", takes, seed, close)


async def redis_agents(redis: wan_net.RedisPrimary, agents: int, seeds: Seeds) -> Agents:
    from redis.asyncio import Redis

    clients = {
        region: [
            Redis(host=redis.address(region)[0], port=redis.address(region)[1],
                  socket_timeout=CALL_TIMEOUT_S, socket_connect_timeout=CALL_TIMEOUT_S)
            for _ in range(agents)
        ]
        for region in REGIONS
    }  # fmt: skip
    takes = {
        region: [_redis_take(c, REDIS_BASE, f"{region}-{i}") for i, c in enumerate(cs)]
        for region, cs in clients.items()
    }
    seeder = Redis(host="127.0.0.1", port=redis.server.port, socket_timeout=30)

    async def seed(count: int) -> None:
        await seed_redis(seeder, REDIS_BASE, seeds.take("redis", count), "us")

    async def close() -> None:
        for client in (*(c for cs in clients.values() for c in cs), seeder):
            with contextlib.suppress(Exception):
                await client.aclose()

    return Agents("redis", takes, seed, close)


# -- running agents -------------------------------------------------------------------


def _kind(exc: BaseException) -> str:
    """An error's kind for the report: a gRPC code, a timeout, or the exception's class."""
    code = getattr(exc, "code", None)
    if callable(code):
        with contextlib.suppress(Exception):
            return str(code().name).lower()
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return "timeout"
    if isinstance(exc, CycleFailed):
        return "refused"
    return type(exc).__name__


async def work(agents: Agents, phase: str, seconds: float, ledger: Ledger) -> None:
    """Every agent works for ``seconds``: items finished go to the ledger, errors are
    counted by kind and the agent tries again; an empty queue is flagged."""
    until = time.monotonic() + seconds

    async def agent(region: str, take: Take) -> None:
        while time.monotonic() < until:
            began = time.monotonic()
            try:
                async with asyncio.timeout(max(0.1, until - began + CALL_TIMEOUT_S)):
                    got = await take()
            except Exception as exc:
                ledger.errors[(agents.system, phase, region, _kind(exc))] += 1
                await asyncio.sleep(min(RETRY_PAUSE_S, max(0.0, until - time.monotonic())))
                continue
            if got is None:
                ledger.dry.add((agents.system, phase))
                await asyncio.sleep(0.05)
                continue
            ledger.finished.append(
                Finished(
                    agents.system, phase, region, got[0], ledger.now(), time.monotonic() - began
                )
            )

    await asyncio.gather(*(agent(r, t) for r, ts in agents.takes.items() for t in ts))


# -- one region's figures ----------------------------------------------------------------


def region_figures(done: Sequence[Finished], seconds: float) -> dict[str, float]:
    latencies = [f.seconds * 1000 for f in done]
    return {
        "items": len(done),
        "items_per_s": len(done) / seconds if seconds else math.nan,
        "p50_ms": percentile(latencies, 50),
        "p99_ms": percentile(latencies, 99),
    }


def figures(ledger: Ledger, system: str, phase: str, seconds: float) -> dict[str, Any]:
    done = ledger.of(system, phase)
    row: dict[str, Any] = {
        region: region_figures([f for f in done if f.region == region], seconds)
        for region in REGIONS
    }
    row["errors"] = {
        f"{region}:{kind}": n
        for (s, p, region, kind), n in sorted(ledger.errors.items())
        if s == system and p == phase
    }
    row["ran_dry"] = (system, phase) in ledger.dry
    return row


# -- the scenario -------------------------------------------------------------------------


async def run_wan(
    settings: Settings, progress: Progress, work_dir: Path, out: Path
) -> ScenarioResult:
    progress.line("starting three Fencemark nodes, a three-member etcd cluster and Redis")
    started = await asyncio.gather(
        wan_net.start_fencemark(REGIONS, work_dir),
        wan_net.start_etcd_cluster(REGIONS, work_dir),
        wan_net.start_redis_primary(REGIONS, work_dir),
        return_exceptions=True,
    )
    failed = [s for s in started if isinstance(s, BaseException)]
    if failed:
        for stoppable in started:
            if not isinstance(stoppable, BaseException):
                with contextlib.suppress(Exception):
                    await stoppable.stop()
        raise failed[0]
    network = Network(*started)  # type: ignore[arg-type]
    ledger, seeds = Ledger(), Seeds()
    try:
        windows = await _windows(settings, progress, network, ledger, seeds)
        cut = await _cut(settings, progress, network, ledger, seeds)
        checks = await _checks(progress, network, ledger)
    finally:
        await network.stop()
    data = {"rtts_ms": list(settings.wan_rtts_ms), "windows": windows, "cut": cut,
            "ledger": checks}  # fmt: skip
    return ScenarioResult(
        "wan",
        "Across regions: three regions, a round trip of R between them, and a cut",
        data,
        _tables(settings, data),
        _targets(settings, data),
        _plots(settings, out, data, ledger),
        _notes(settings, data),
    )


async def _start_agents(network: Network, system: str, agents: int, seeds: Seeds) -> Agents:
    if system == "fencemark":
        return await fencemark_agents(network.fencemark, agents, seeds)
    if system == "etcd":
        return await etcd_agents(network.etcd, agents, seeds)
    return await redis_agents(network.redis, agents, seeds)


async def _topped_up(agents: Agents, ledger: Ledger, seeded: dict[str, int], need: int) -> None:
    """Seed until the backlog left holds at least ``need`` items (outside the timing)."""
    system = agents.system
    left = seeded[system] - sum(1 for f in ledger.finished if f.system == system)
    if left < need:
        more = need - left
        await agents.seed(more)
        seeded[system] += more


async def _windows(
    settings: Settings, progress: Progress, network: Network, ledger: Ledger, seeds: Seeds
) -> dict[str, Any]:
    """Every system drains for ``wan_window_s`` at every (N, R)."""
    windows: dict[str, Any] = {}
    seeded: dict[str, int] = defaultdict(int)
    rate: dict[str, float] = dict(FIRST_SEED)
    for n in settings.wan_agents:
        for system in SYSTEMS:
            network.set_rtt(0.0)
            agents = await _start_agents(network, system, n, seeds)
            try:
                for rtt_ms in settings.wan_rtts_ms:
                    phase = f"n{n}-r{rtt_ms}"
                    network.set_rtt(0.0)  # seeding is not what is measured
                    need = int(rate[system] * settings.wan_window_s * 1.5) + 50
                    progress.status(f"{system}: seeding {need:,} items for N={n}, R={rtt_ms} ms")
                    await _topped_up(agents, ledger, seeded, need)
                    network.set_rtt(rtt_ms / 1000)
                    progress.status(f"{system}: {n} agents per region, R={rtt_ms} ms")
                    await work(agents, phase, settings.wan_window_s, ledger)
                    row = figures(ledger, system, phase, settings.wan_window_s)
                    total = sum(row[r]["items_per_s"] for r in REGIONS)
                    rate[system] = max(total, 20.0)
                    windows.setdefault(str(n), {}).setdefault(str(rtt_ms), {})[system] = row
                    slowest = min(row[r]["items_per_s"] for r in REGIONS)
                    progress.line(
                        f"{system:9} N={n:<2} R={rtt_ms:>3} ms: {total:8.1f} items/s"
                        f" (slowest region {slowest:.1f}), p50 "
                        + " ".join(f"{r} {fmt(row[r]['p50_ms'], 1)}" for r in REGIONS)
                        + " ms"
                    )
            finally:
                await agents.close()
    return windows


async def _cut(
    settings: Settings, progress: Progress, network: Network, ledger: Ledger, seeds: Seeds
) -> dict[str, Any]:
    """At the largest R and the fewest agents: steady, ``ap`` cut off, healed."""
    rtt_ms, n = max(settings.wan_rtts_ms), min(settings.wan_agents)
    steady, cut, heal = settings.wan_cut_phases
    result: dict[str, Any] = {"rtt_ms": rtt_ms, "agents": n, "phases_s": [steady, cut, heal]}
    seeded: dict[str, int] = defaultdict(int)
    for system in SYSTEMS:
        network.set_rtt(0.0)
        agents = await _start_agents(network, system, n, seeds)
        try:
            last = [
                f for f in ledger.finished if f.system == system and f.phase == f"n{n}-r{rtt_ms}"
            ]
            need = int(len(last) / settings.wan_window_s * (steady + cut + heal) * 1.5) + 100
            seeded[system] = need + sum(1 for f in ledger.finished if f.system == system)
            progress.status(f"{system}: seeding {need:,} items for the cut")
            await agents.seed(need)
            network.set_rtt(rtt_ms / 1000)
            began = ledger.now()
            progress.status(f"{system}: steady, R={rtt_ms} ms")
            await work(agents, f"cut-steady-{system}", steady, ledger)
            network.isolate(system, CUT)
            cut_at = ledger.now()
            progress.status(f"{system}: {CUT} cut off")
            await work(agents, f"cut-cut-{system}", cut, ledger)
            network.heal(system)
            healed_at = ledger.now()
            progress.status(f"{system}: healed")
            converging = (
                asyncio.create_task(_cut_work_seen(network, ledger, system, cut_at, healed_at))
                if system == "fencemark"
                else None
            )
            await work(agents, f"cut-heal-{system}", heal, ledger)
            row: dict[str, Any] = {
                "began_s": began,
                "cut_s": cut_at,
                "healed_s": healed_at,
                "ended_s": ledger.now(),
            }
            for part, seconds in (("steady", steady), ("cut", cut), ("heal", heal)):
                row[part] = figures(ledger, system, f"cut-{part}-{system}", seconds)
            if converging is not None:
                row["seen_everywhere_s"] = await converging
            before = row["steady"][CUT]["items_per_s"]
            during = row["cut"][CUT]["items_per_s"]
            row["cut_region_rate_vs_before"] = ratio(during, before)
            result[system] = row
            progress.line(
                f"{system:9} cut of {CUT}: {CUT} drained {row['cut'][CUT]['items']:,} items"
                f" in {cut:g} s ({fmt(during, 1)} items/s; before {fmt(before, 1)})"
            )
        finally:
            await agents.close()
    return result


async def _cut_work_seen(
    network: Network, ledger: Ledger, system: str, cut_at: float, healed_at: float
) -> float:
    """Seconds after the heal until a sample of the items finished on either side of
    the cut shows ``done`` at every other region's node (NaN: not within the limit)."""
    cluster = network.fencemark
    during = [f for f in ledger.finished if f.system == system and cut_at <= f.at <= healed_at]
    inside = [f for f in during if f.region == CUT][:SAMPLED]
    outside = [f for f in during if f.region != CUT][:SAMPLED]
    checks = [(f.item, r) for f in inside for r in REGIONS if r != CUT]
    checks += [(f.item, CUT) for f in outside]
    clients = {r: AsyncClient(cluster.addresses[r], retries=0) for r in REGIONS}
    try:
        pending = set(checks)
        while pending and ledger.now() - healed_at < CONVERGE_LIMIT_S:
            for item, region in list(pending):
                with contextlib.suppress(Exception):
                    record = await clients[region].get(item)
                    if record.status == "done":
                        pending.discard((item, region))
            if pending:
                await asyncio.sleep(0.1)
        return math.nan if pending else ledger.now() - healed_at
    finally:
        await asyncio.gather(*(c.close() for c in clients.values()))


async def _checks(progress: Progress, network: Network, ledger: Ledger) -> dict[str, Any]:
    """The ledger against each system's final state."""
    progress.status("checking every finished item against each system's final state")
    out: dict[str, Any] = {}
    for system in SYSTEMS:
        items = [f.item for f in ledger.finished if f.system == system]
        twice = sum(n - 1 for n in Counter(items).values() if n > 1)
        out[system] = {"finished": len(items), "done_twice": twice}
    fm = await _fencemark_final(network)
    out["fencemark"].update(lost=sum(1 for f in ledger.finished if f.system == "fencemark"
                                     and fm["done"].get(f.item) != RESULT["result"]),
                            identical=fm["identical"], identical_after_s=fm["after_s"])  # fmt: skip
    done = await _etcd_done(network.etcd)
    out["etcd"]["lost"] = sum(
        1 for f in ledger.finished if f.system == "etcd" and f.item.rsplit("/", 1)[-1] not in done
    )
    out["redis"]["lost"] = await _redis_lost(network.redis, ledger)
    for system in SYSTEMS:
        row = out[system]
        progress.line(
            f"{system:9} ledger: {row['finished']:,} items finished, {row['done_twice']} done"
            f" twice, {row['lost']} results lost"
        )
    return out


async def _fencemark_final(network: Network) -> dict[str, Any]:
    """After the agents stop: how long until the three replicas hold the same states,
    and each item's result as the (first) replica holds it."""
    cluster = network.fencemark
    clients = {r: AsyncClient(cluster.addresses[r], retries=2) for r in REGIONS}
    began = time.monotonic()
    try:
        while True:
            states = {}
            for region, client in clients.items():
                states[region] = {r.key: r async for r in client.iter_records(REPO, topic=TOPIC)}
            digests = [{k: r.digest for k, r in s.items()} for s in states.values()]
            identical = all(d == digests[0] for d in digests)
            if identical or time.monotonic() - began > CONVERGE_LIMIT_S:
                first = states[REGIONS[0]]
                done = {
                    key: record.fields.get("result", "")
                    for key, record in first.items()
                    if record.status == "done"
                }
                return {"identical": identical, "after_s": time.monotonic() - began, "done": done}
            await asyncio.sleep(0.2)
    finally:
        await asyncio.gather(*(c.close() for c in clients.values()))


async def _etcd_done(etcd: wan_net.EtcdCluster) -> set[str]:
    import aetcd

    client = aetcd.Client(host="127.0.0.1", port=etcd.client_ports[REGIONS[0]], timeout=30)
    try:
        prefix = f"{ETCD_BASE}/done/".encode()
        return {kv.key[len(prefix) :].decode() async for kv in _etcd_keys(client, prefix)}
    finally:
        with contextlib.suppress(Exception):
            await client.close()


async def _etcd_keys(client: Any, prefix: bytes) -> Any:
    result = await client.get_prefix(prefix, keys_only=True)
    for kv in result:
        yield kv


async def _redis_lost(redis: wan_net.RedisPrimary, ledger: Ledger) -> int:
    from redis.asyncio import Redis

    client = Redis(host="127.0.0.1", port=redis.server.port, socket_timeout=30)
    try:
        items = [f.item for f in ledger.finished if f.system == "redis"]
        pipe = client.pipeline(transaction=False)
        for item in items:
            pipe.hmget(f"{REDIS_BASE}:item:{item}", "status", "result")
        answers = await pipe.execute() if items else []
        return sum(1 for status, result in answers if (status, result) != (b"done", b"ok"))
    finally:
        await client.aclose()


# -- the report ------------------------------------------------------------------------


def _tables(settings: Settings, data: dict[str, Any]) -> list[Table]:
    rtts, agents = settings.wan_rtts_ms, list(data["windows"])
    table = Table(
        "Per item p50 ms · items/s, by agents per region (N) and round trip (R)",
        ["system", "region", *(f"N {n}, R {r}" for n in agents for r in rtts)],
    )
    for system in SYSTEMS:
        for region in REGIONS:
            cells = []
            for n in agents:
                for rtt in rtts:
                    row = data["windows"][n][str(rtt)][system][region]
                    cells.append(f"{fmt(row['p50_ms'], 1)} · {fmt(row['items_per_s'], 1)}")
            table.rows.append([system, region, *cells])
    tables = [table]
    cut = data["cut"]
    table = Table(
        f"The cut: {CUT} cut off for {cut['phases_s'][1]:g} s at R = {cut['rtt_ms']} ms,"
        f" {cut['agents']} agents per region: items/s before · during · after",
        ["system", *REGIONS, f"{CUT} during the cut", "errors during the cut"],
    )
    for system in SYSTEMS:
        row = cut[system]
        cells = [
            " · ".join(fmt(row[p][r]["items_per_s"], 1) for p in ("steady", "cut", "heal"))
            for r in REGIONS
        ]
        errors = ", ".join(f"{k} {v}" for k, v in row["cut"]["errors"].items()) or "none"
        cells.append(f"{row['cut'][CUT]['items']:,} items")
        table.rows.append([system, *cells, errors])
    tables.append(table)
    ledger = Table("The ledger", ["system", "items finished", "done twice", "results lost"])
    for system in SYSTEMS:
        row = data["ledger"][system]
        ledger.rows.append([system, f"{row['finished']:,}", str(row["done_twice"]),
                            str(row["lost"])])  # fmt: skip
    tables.append(ledger)
    return tables


def _slowest(row: Mapping[str, Any], key: str, regions: Sequence[str] = REGIONS) -> float:
    values = [float(row[r][key]) for r in regions]
    return min(values) if key == "items_per_s" else max(values)


def _targets(settings: Settings, data: dict[str, Any]) -> list[Target]:
    rtt = max(settings.wan_rtts_ms)
    windows = data["windows"]
    few, many = str(min(settings.wan_agents)), str(max(settings.wan_agents))
    at_few = windows[few][str(rtt)]
    fm_p50 = _slowest(at_few["fencemark"], "p50_ms")
    away = [r for r in REGIONS if r != REGIONS[0]]
    targets = [
        at_most(f"p50 per item, every region, vs etcd's slowest region (R {rtt} ms, N {few})",
                ratio(fm_p50, _slowest(at_few["etcd"], "p50_ms")), 0.1, "x"),
        at_most(f"p50 per item, every region, vs Redis away from its primary (R {rtt} ms, N {few})",
                ratio(fm_p50, min(at_few["redis"][r]["p50_ms"] for r in away)), 0.1, "x"),
    ]  # fmt: skip
    at_many = windows[many][str(rtt)]
    fm_rate = _slowest(at_many["fencemark"], "items_per_s")
    targets += [
        at_least(f"items/s, slowest region, vs etcd's slowest (R {rtt} ms, N {many})",
                 ratio(fm_rate, _slowest(at_many["etcd"], "items_per_s")), 5.0, "x"),
        at_least(f"items/s, slowest region, vs Redis's slowest (R {rtt} ms, N {many})",
                 ratio(fm_rate, _slowest(at_many["redis"], "items_per_s")), 3.0, "x"),
        at_least(f"{CUT} drains during its cut, vs before it",
                 data["cut"]["fencemark"]["cut_region_rate_vs_before"], 0.5, "x"),
        at_most("items done twice, every system",
                sum(data["ledger"][s]["done_twice"] for s in SYSTEMS), 0, ""),
        at_most("acknowledged results lost, every system",
                sum(data["ledger"][s]["lost"] for s in SYSTEMS), 0, ""),
        at_most("the cut's work seen in every region after the heal",
                data["cut"]["fencemark"].get("seen_everywhere_s", math.nan), 5.0, " s"),
    ]  # fmt: skip
    return targets


def sanity_problems(settings: Settings, data: dict[str, Any]) -> list[str]:
    """The harness checks itself: a baseline's p50 in a region that must cross the
    network is at least R, or the delay was not applied and the run is void."""
    problems = []
    for n, by_rtt in data["windows"].items():
        for rtt, systems in by_rtt.items():
            if int(rtt) == 0:
                continue
            crossing = {"etcd": REGIONS, "redis": REGIONS[1:]}
            for system, regions in crossing.items():
                for region in regions:
                    p50 = systems[system][region]["p50_ms"]
                    if not p50 >= int(rtt):
                        where = f"{system} in {region} at R {rtt} ms, N {n}"
                        problems.append(f"{where}: p50 {fmt(p50, 1)} ms < R: no delay applied")
    return problems


def _notes(settings: Settings, data: dict[str, Any]) -> list[str]:
    notes = sanity_problems(settings, data)
    if not notes:
        notes.append("Sanity: every baseline's p50 in a region that crosses the network is ≥ R.")
    dry = [
        f"{s} N {n} R {r}"
        for n, by_rtt in data["windows"].items()
        for r, systems in by_rtt.items()
        for s in SYSTEMS
        if systems[s]["ran_dry"]
    ]
    if dry:
        notes.append("Backlog ran out within the window (a lower bound): " + ", ".join(dry))
    fm = data["ledger"]["fencemark"]
    notes.append(
        "Fencemark's replicas "
        + ("were identical" if fm["identical"] else "were NOT identical")
        + f" {fm['identical_after_s']:.1f} s after the agents stopped."
    )
    return notes


def _plots(settings: Settings, out: Path, data: dict[str, Any], ledger: Ledger) -> list[Path]:
    rtts = list(settings.wan_rtts_ms)
    many = str(max(settings.wan_agents))
    panels: dict[str, dict[str, tuple[list[float], list[float]]]] = {}
    for region in REGIONS:
        series = {}
        for system in SYSTEMS:
            for q in ("p50", "p99"):
                ys = [data["windows"][many][str(r)][system][region][f"{q}_ms"] for r in rtts]
                series[f"{system} {q}"] = ([float(r) for r in rtts], ys)
        panels[region] = series
    latency = plots.panel_lines(
        out / "wan_latency.png",
        f"Per item latency by region against R ({many} agents per region)",
        panels, "round trip between regions R (ms)", "per item (ms, log scale)", logy=True,
    )  # fmt: skip
    cut = data["cut"]
    timelines: dict[str, dict[str, tuple[list[float], list[float]]]] = {}
    for system in SYSTEMS:
        row = cut[system]
        start, end = row["began_s"], row["ended_s"]
        seconds = max(1, math.ceil(end - start))
        series = {}
        for region in REGIONS:
            counts = [0] * seconds
            for f in ledger.finished:
                if f.system == system and f.region == region and start <= f.at < end:
                    counts[min(seconds - 1, int(f.at - start))] += 1
            series[region] = ([float(s) for s in range(seconds)], [float(c) for c in counts])
        cut_at, healed_at = row["cut_s"] - start, row["healed_s"] - start
        timelines[f"{system} ({CUT} cut {cut_at:.0f} to {healed_at:.0f} s)"] = series
    timeline = plots.panel_lines(
        out / "wan_cut.png",
        f"Items/s per region across the cut of {CUT} (R {cut['rtt_ms']} ms)",
        timelines, "seconds", "items/s",
    )  # fmt: skip
    return [latency, timeline]

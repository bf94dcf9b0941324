"""Scenario ``failover``: the leader killed under a drain — a region of three members,
a three-member etcd cluster, and a Redis primary with a replica and three Sentinels.

- **Set-up** (``ha_servers``): a region of three Fencemark members (``--decider-ttl
  2``) with a three-member etcd cluster of its own; a three-member etcd cluster; a
  durable Redis primary, its replica and three Sentinels. All on loopback, as the
  other scenarios' servers.
- **The steady-state price**: 16 agents drain ``drain_items`` items, and 16 clients
  run the claim cycle, on one node (a region's only node) and on the three members,
  ``repeats`` times back to back. The drain's ratio is the target; CPU per item is
  the members' together against the one node's.
- **The failover**, each system in turn: a backlog sized from the system's own
  steady rate in this run, 16 agents draining it (``failover_agents``), and at
  ``failover_kill_s`` the leader killed with ``SIGKILL`` — the region's decider, etcd's
  leader, Redis's primary. Measured: the window from the kill to the first grant
  asked after it, items/s per ``failover_bin_s`` across it, p99 per item before the
  kill and after the window. Fencemark also keeps claims by key across the kill
  (``Holder``). The run goes on ``failover_after_s`` past the window.
- **The ledger**, against each system's final state: items done twice, items handed
  out twice, acknowledged results lost (an item whose done was acknowledged and is
  not done, with its result, once the agents stopped), tokens granted twice, and
  claims whose holder was refused with the token it held.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from fencemark.bench import drivers, failover_report
from fencemark.bench.drain import GOAL_AGENTS, drain_limit_s
from fencemark.bench.failover_agents import (
    Agent,
    FencemarkAgent,
    Holder,
    Ledger,
    TakeAgent,
    run,
)
from fencemark.bench.ha_servers import (
    SENTINEL_SERVICE,
    EtcdTrio,
    MemberRegion,
    RedisGroup,
    start_etcd_trio,
    start_member_region,
    start_redis_group,
)
from fencemark.bench.load import closed_loop, cpu_seconds
from fencemark.bench.progress import Progress
from fencemark.bench.records import REPO
from fencemark.bench.results import ScenarioResult, Settings
from fencemark.bench.work_queues import (
    ETCD_SEED_BATCH,
    LEASE_SECONDS,
    _etcd_take,
    _item_value,
    _redis_take,
    _seed_fencemark,
    item_id,
    seed_redis,
)
from fencemark.client import AsyncClient
from fencemark.node.tools.process import NodeProcess

REGION = "us"
MEMBERS = ("us-a", "us-b", "us-c")
DECIDER_TTL_S = 2
HOLDERS = 4
AGENT_TIMEOUT_S = 5.0  # one call of a Fencemark agent
BASELINE_TIMEOUT_S = 2.0  # one call of an etcd or Redis agent
EXPECTED_WINDOW_S = 5.0  # a failover's length, for sizing the backlog
BACKLOG_MARGIN = 2.0  # the rate after a kill may beat the steady one (fewer members)
WINDOW_LIMIT_S = 30.0  # a failover longer than this is reported as not over
CONVERGE_LIMIT_S = 30.0
SYSTEMS = ("fencemark", "etcd", "redis")


async def run_failover(
    settings: Settings, progress: Progress, work: Path, out: Path
) -> ScenarioResult:
    async with contextlib.AsyncExitStack() as stack:
        progress.status("starting a region of three members, one node, etcd and Redis")
        region, node, etcd, redis = await _start(stack, work)
        progress.line(
            f"members {', '.join(m.address for m in region.members.values())}; one node"
            f" {node.address}; etcd {', '.join(etcd.endpoints)}; redis primary"
            f" :{redis.primary.port}, replica :{redis.replica.port}, sentinels"
            f" {', '.join(str(s.port) for s in redis.sentinels)}"
        )
        price = await _price(region, node, settings, progress)
        await node.stop()
        steady = {
            "etcd": await _etcd_drain(etcd, settings, progress, settings.drain_items, None),
            "redis": await _redis_drain(redis, settings, progress, settings.drain_items, None),
        }
        rates = {
            "fencemark": price["three_members"]["drain"]["ops_per_s"],
            **{s: steady[s]["rate"] for s in steady},
        }
        runs: dict[str, dict[str, Any]] = {}
        runs["fencemark"] = await _fencemark_failover(region, settings, progress, rates)
        await region.stop()
        etcd_items = _backlog(settings, rates["etcd"])
        runs["etcd"] = await _etcd_drain(etcd, settings, progress, etcd_items, "leader")
        await etcd.stop()
        runs["redis"] = await _redis_drain(
            redis, settings, progress, _backlog(settings, rates["redis"]), "primary"
        )
    for system in SYSTEMS:
        row = runs[system]
        progress.line(
            f"{system}: window {row['window_s']:.2f} s, {row['finished']:,} items, done twice"
            f" {row['done_twice']}, lost {row['lost']}, tokens reused {row['tokens_reused']}"
        )
    return failover_report.report(settings, price, steady, runs, out)


async def _start(
    stack: contextlib.AsyncExitStack, work: Path
) -> tuple[MemberRegion, NodeProcess, EtcdTrio, RedisGroup]:
    """Every server at once (they start side by side; each stops when the run ends)."""
    started = await asyncio.gather(
        start_member_region(work / "region", MEMBERS, DECIDER_TTL_S, REGION),
        NodeProcess.start(work / "one-node", region=REGION),
        start_etcd_trio(work / "etcd", "etcd"),
        start_redis_group(work / "redis"),
        return_exceptions=True,
    )
    for server in started:
        if not isinstance(server, BaseException):
            stack.push_async_callback(server.stop)
    for server in started:
        if isinstance(server, BaseException):
            raise server
    region, node, etcd, redis = started
    assert isinstance(region, MemberRegion) and isinstance(node, NodeProcess)
    assert isinstance(etcd, EtcdTrio) and isinstance(redis, RedisGroup)
    return region, node, etcd, redis


def _backlog(settings: Settings, rate: float) -> int:
    """Items enough to outlast the kill, the window and the time after it."""
    seconds = settings.failover_kill_s + EXPECTED_WINDOW_S + settings.failover_after_s
    wanted = rate * seconds * BACKLOG_MARGIN if math.isfinite(rate) else 0
    return max(settings.drain_items, math.ceil(wanted))


# -- the steady-state price ---------------------------------------------------------------


async def _price(
    region: MemberRegion, node: NodeProcess, settings: Settings, progress: Progress
) -> dict[str, Any]:
    """One node against three members: the drain and the claim cycle, at 16."""
    decider = region.members[await region.decider()]
    setups = {
        "one_node": ([node.address], node.address, [node.proc.pid]),
        "three_members": (
            [m.address for m in region.members.values()],
            decider.address,
            [decider.proc.pid, *(m.proc.pid for m in region.members.values() if m is not decider)],
        ),
    }
    drains: dict[str, list[dict[str, Any]]] = {name: [] for name in setups}
    cycles: dict[str, list[Any]] = {name: [] for name in setups}
    for repeat in range(settings.repeats):
        for name, (addresses, address, pids) in setups.items():
            label = f"{name.replace('_', ' ')} (run {repeat + 1}/{settings.repeats})"
            tag = f"price-r{repeat}"
            row = await _fencemark_drain(addresses, address, pids, settings, progress, tag, label)
            drains[name].append(row)
            progress.line(f"{label}: drain {row['rate']:,.0f} items/s, p99 {row['p99_ms']:.1f} ms")
            async with drivers.fencemark_clients(
                address, GOAL_AGENTS, f"cycle-r{repeat}", settings.records_per_client, region=REGION
            ) as pairs:
                operations = [
                    drivers.fencemark_claim_cycle(client, keys, f"worker-{i}")
                    for i, (client, keys) in enumerate(pairs)
                ]
                result = await closed_loop(
                    operations, warmup=settings.warmup, duration=settings.duration,
                    progress=progress, label=f"{label}: claim cycles",
                )  # fmt: skip
            cycles[name].append(result)
            progress.line(f"{label}: {result.rate:,.0f} claim cycles/s, p99 {result.p(99):.1f} ms")
    return failover_report.price(drains, cycles)


async def _fencemark_drain(
    addresses: Sequence[str],
    seed_at: str,
    pids: Sequence[int],
    settings: Settings,
    progress: Progress,
    tag: str,
    label: str,
) -> dict[str, Any]:
    """16 agents drain ``settings.drain_items`` items; the CPU of every server process
    in ``pids`` is counted, the first one's (the node, or the deciding member) also alone."""
    items = settings.drain_items
    topic = f"drain-{tag}-{len(addresses)}"
    progress.status(f"{label}: seeding {items:,} items")
    await _seed_fencemark(seed_at, topic, items, REGION)
    async with _clients(addresses, GOAL_AGENTS) as clients:
        ledger = Ledger()
        agents: list[Agent] = [
            FencemarkAgent(own, topic, f"agent-{i}", ledger, i) for i, own in enumerate(clients)
        ]
        before = [cpu_seconds(pid) for pid in pids]
        await run(agents, ledger, progress, label, limit_s=drain_limit_s(items))
        used = [cpu_seconds(pid) - was for pid, was in zip(pids, before, strict=True)]
    return failover_report.drained(ledger, items, sum(used), deciding_cpu_s=used[0])


@contextlib.asynccontextmanager
async def _clients(addresses: Sequence[str], agents: int) -> AsyncIterator[list[list[AsyncClient]]]:
    """Per agent, a client of each address (the agent turns to the next on a failure)."""
    made = [
        [AsyncClient(a, retries=0, timeout=AGENT_TIMEOUT_S) for a in addresses]
        for _ in range(agents)
    ]
    try:
        yield made
    finally:
        await asyncio.gather(*(c.close() for own in made for c in own), return_exceptions=True)


# -- Fencemark's failover ------------------------------------------------------------------


async def _fencemark_failover(
    region: MemberRegion, settings: Settings, progress: Progress, rates: dict[str, float]
) -> dict[str, Any]:
    items = _backlog(settings, rates["fencemark"])
    topic, held_topic = "failover", "held"
    first = await region.decider()
    decider = region.members[first]
    progress.status(f"fencemark: seeding {items:,} items at {first}")
    began = time.monotonic()
    await _seed_fencemark(decider.address, topic, items, REGION)
    progress.line(f"fencemark: {items:,} items seeded in {time.monotonic() - began:.1f} s")
    addresses = [m.address for m in region.members.values()]
    async with (
        _clients(addresses, GOAL_AGENTS) as clients,
        _clients(addresses, HOLDERS) as holder_clients,
    ):
        async with AsyncClient(decider.address, retries=2) as seeder:
            tags = [f"homeRegion:{REGION}"]
            made = [await seeder.remember(REPO, held_topic, f"h-{i}", tags=tags)
                    for i in range(HOLDERS)]  # fmt: skip
            keys = [m.record.key for m in made]
        ledger = Ledger()
        holders = [
            Holder(own, key, f"holder-{i}", ledger, i)
            for i, (own, key) in enumerate(zip(holder_clients, keys, strict=True))
        ]
        for holder in holders:
            await holder.take()
        agents: list[Agent] = [
            FencemarkAgent(own, topic, f"agent-{i}", ledger, i) for i, own in enumerate(clients)
        ]
        agents += [holder.keep for holder in holders]

        killed = [first]

        async def kill() -> float:
            killed[0] = await region.decider()  # the decider now, should it have changed
            return await region.kill(killed[0])

        await run(
            agents, ledger, progress, "fencemark", limit_s=WINDOW_LIMIT_S, kill=kill,
            kill_at=settings.failover_kill_s, after_s=settings.failover_after_s,
        )  # fmt: skip
    second = await region.decider(other_than=killed[0])
    progress.status("fencemark: reading every item at the members left")
    final = await failover_report.fencemark_final(region, topic)
    row = failover_report.failover_figures(ledger, items, settings, final["done"])
    row.update(
        killed=killed[0], new_decider=second, holders=len(holders),
        holder_renewals=sum(h.renewals for h in holders),
        identical=final["identical"], identical_after_s=final["after_s"],
    )  # fmt: skip
    return {**row, "ledger": ledger}


# -- etcd ------------------------------------------------------------------------------------


async def _etcd_drain(
    etcd: EtcdTrio, settings: Settings, progress: Progress, items: int, kill: str | None
) -> dict[str, Any]:
    """etcd's drain on its three members; ``kill``: its leader, at ``failover_kill_s``."""
    import aetcd

    label = "etcd" + (" failover" if kill else " steady")
    base = f"/failover/{'kill' if kill else 'steady'}"
    progress.status(f"{label}: seeding {items:,} items")
    seeder = aetcd.Client(host="127.0.0.1", port=etcd.members[0].port, timeout=30)
    try:
        tx = seeder.transactions
        for start in range(0, items, ETCD_SEED_BATCH):
            puts = [tx.put(f"{base}/queue/{item_id(i)}".encode(), _item_value(i))
                    for i in range(start, min(items, start + ETCD_SEED_BATCH))]  # fmt: skip
            await seeder.transaction(compare=[], success=puts, failure=[])
        ledger = Ledger()
        clients = [
            [aetcd.Client(host="127.0.0.1", port=p, timeout=BASELINE_TIMEOUT_S) for p in
             (m.port for m in etcd.members)]
            for _ in range(GOAL_AGENTS)
        ]  # fmt: skip
        try:
            # Connected now, every one: the recipe calls the KV stub itself, which an
            # aetcd client has only once connected (an agent whose first member is the
            # leader killed would otherwise turn to members it cannot ask).
            await asyncio.gather(*(client.connect() for own in clients for client in own))
            agents: list[TakeAgent] = []
            for index, own in enumerate(clients):
                session = await own[0].lease(LEASE_SECONDS * 5)
                agent = TakeAgent(f"agent-{index}", ledger, index)
                agent.takes = [
                    _etcd_take(c, session, base, agent.owner, index, agent.granted) for c in own
                ]
                agents.append(agent)
            ledger.started = time.monotonic()

            async def killed() -> float:
                return await etcd.kill(await etcd.leader())

            if kill is None:
                await run(agents, ledger, progress, label, limit_s=drain_limit_s(items))
            else:
                await run(
                    agents, ledger, progress, label, limit_s=WINDOW_LIMIT_S, kill=killed,
                    kill_at=settings.failover_kill_s, after_s=settings.failover_after_s,
                )  # fmt: skip
        finally:
            for own in clients:
                for client in own:
                    with contextlib.suppress(Exception):
                        await client.close()
        progress.status(f"{label}: reading every done item")
        done = await _etcd_done(etcd, base)
    finally:
        with contextlib.suppress(Exception):
            await seeder.close()
    if kill is None:
        return failover_report.drained(ledger, items, math.nan)
    row = failover_report.failover_figures(ledger, items, settings, done)
    return {**row, "ledger": ledger}


async def _etcd_done(etcd: EtcdTrio, base: str) -> dict[str, str]:
    """Every done item (id -> its result) as a live member reads it."""
    import json

    import aetcd

    port = etcd.members[etcd.alive()[0]].port
    client = aetcd.Client(host="127.0.0.1", port=port, timeout=30)
    try:
        prefix = f"{base}/done/".encode()
        found = await client.get_prefix(prefix)
        return {
            kv.key[len(prefix) :].decode(): json.loads(kv.value).get("result", "") for kv in found
        }
    finally:
        with contextlib.suppress(Exception):
            await client.close()


# -- Redis ------------------------------------------------------------------------------------


async def _redis_drain(
    redis: RedisGroup, settings: Settings, progress: Progress, items: int, kill: str | None
) -> dict[str, Any]:
    """Redis's drain through the Sentinels; ``kill``: its primary, at ``failover_kill_s``."""
    from redis.asyncio import Redis
    from redis.asyncio.sentinel import Sentinel

    label = "redis" + (" failover" if kill else " steady")
    base = f"failover:{'kill' if kill else 'steady'}"
    progress.status(f"{label}: seeding {items:,} items")
    seeder = Redis(host="127.0.0.1", port=redis.primary.port, socket_timeout=30)
    try:
        await seed_redis(seeder, base, range(items), REGION)
    finally:
        await seeder.aclose()
    sentinel = Sentinel(  # type: ignore[no-untyped-call]  # redis-py leaves it untyped
        redis.sentinel_addresses,
        socket_timeout=BASELINE_TIMEOUT_S,
        sentinel_kwargs={"socket_timeout": BASELINE_TIMEOUT_S},
    )
    ledger = Ledger()
    clients = [
        sentinel.master_for(SENTINEL_SERVICE, socket_timeout=BASELINE_TIMEOUT_S,
                            socket_connect_timeout=BASELINE_TIMEOUT_S)
        for _ in range(GOAL_AGENTS)
    ]  # fmt: skip
    try:
        agents: list[TakeAgent] = []
        for index, client in enumerate(clients):
            agent = TakeAgent(f"agent-{index}", ledger, index)
            agent.takes = [_redis_take(client, base, agent.owner, agent.granted)]
            agents.append(agent)
        if kill is None:
            await run(agents, ledger, progress, label, limit_s=drain_limit_s(items))
        else:
            await run(
                agents, ledger, progress, label, limit_s=WINDOW_LIMIT_S,
                kill=redis.kill_primary, kill_at=settings.failover_kill_s,
                after_s=settings.failover_after_s,
            )  # fmt: skip
        progress.status(f"{label}: reading every finished item at the primary")
        done = await _redis_done(clients[0], base, [f.item for f in ledger.finished])
        primary: Any = await sentinel.discover_master(SENTINEL_SERVICE)
    finally:
        for client in clients:
            with contextlib.suppress(Exception):
                await client.aclose()
        for watcher in sentinel.sentinels:
            with contextlib.suppress(Exception):
                await watcher.aclose()
    if kill is None:
        return failover_report.drained(ledger, items, math.nan)
    row = failover_report.failover_figures(ledger, items, settings, done)
    row["new_primary_port"] = int(primary[1])
    return {**row, "ledger": ledger}


async def _redis_done(client: Any, base: str, items: list[str]) -> dict[str, str]:
    """The finished items done at the primary now (id -> its result)."""
    pipe = client.pipeline(transaction=False)
    for item in items:
        pipe.hmget(f"{base}:item:{item}", "status", "result")
    answers = await pipe.execute() if items else []
    return {
        item: (result or b"").decode()
        for item, (status, result) in zip(items, answers, strict=True)
        if status == b"done"
    }

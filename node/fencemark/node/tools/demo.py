"""``fencemark demo``: the main job. Agents in three regions drain a backlog.

It starts a three-region cluster on the embedded SQLite default (one node
process per region, node-to-node traffic through a fault proxy mesh), seeds a
backlog homed across the regions (priorities, an ``after:`` link across regions,
one poison item), and runs several agents per region that take the next item with
``ClaimNext``, write fenced progress, renew and release it ``done`` (the poison item
``failed``, until it is parked); an agent that finds no work waits on its region's
change feed rather than polling. Meanwhile a nemesis pauses one
agent past its lease (it must then be refused) and cuts one region off, then
heals it. A live line shows progress; the run ends with a verification report
and exits non-zero if any check fails.

With ``members=3`` (``fencemark demo --members 3``) the first region runs as three
members electing their decider through etcd (from this machine), and the nemesis
also kills that decider (``SIGKILL``) mid-drain: the report adds how long the
region went without one, and that no acknowledged write was lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

from fencemark.client import AsyncClient, ClaimEvent, FencemarkError, Record
from fencemark.client import History as ClaimHistory
from fencemark.node.tools.cluster import LocalCluster
from fencemark.node.tools.etcd_process import EtcdMissing
from fencemark.node.tools.feed_signal import FeedSignal
from fencemark.node.tools.queue_checks import queue_checks
from fencemark.node.tools.workload import (
    POISON,
    REPO,
    TOPIC,
    Agent,
    Check,
    History,
    QueueAgent,
    acknowledged_everywhere,
    check_history,
    seed_queue,
)

Out = Callable[[str], None]
DRAIN_LIMIT_S = 240.0


async def _poll(what: str, condition: Callable[[], Awaitable[bool]], limit: float) -> float:
    """Wait (bounded) until ``await condition()`` is true; returns the seconds it took."""
    started = time.monotonic()
    while time.monotonic() - started < limit:
        with contextlib.suppress(FencemarkError):
            if await condition():
                return time.monotonic() - started
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{what}: not within {limit:.0f} s")


async def _deciding(client: AsyncClient) -> bool:
    """Whether the region of ``client``'s node decides claims: its node, or in a region
    of several members, the decider that node names."""
    info = await client.info()
    if not info.member or info.member == (info.decider.member if info.decider else ""):
        return info.claims_serving
    if info.decider is None:
        return False
    async with AsyncClient(info.decider.address, retries=0, timeout=2) as decider:
        return (await decider.info()).claims_serving


async def _records(client: AsyncClient, topic: str = "") -> dict[str, Record]:
    listing = client.iter_records(REPO, topic=topic, include_deleted=True)
    return {record.key: record async for record in listing}


class Demo:
    def __init__(
        self, cluster: LocalCluster, *, out: Out, lease: float, rng: random.Random
    ) -> None:
        self.cluster = cluster
        self.out = out
        self.lease = lease
        self.rng = rng
        self.regions = list(cluster.nodes)
        self.history = History()
        self.clients = {
            region: AsyncClient(cluster.addresses[region], regions=cluster.routes_from(region))
            for region in self.regions
        }
        self.done: dict[str, int] = dict.fromkeys(self.regions, 0)
        self.totals: dict[str, int] = dict.fromkeys(self.regions, 0)
        self.lags: list[float] = []  # seconds from an acknowledged write to everywhere
        # What each region's agents wait on when there is no work (not a poll).
        self.feeds = {region: FeedSignal(client, REPO, TOPIC)
                      for region, client in self.clients.items()}  # fmt: skip
        self.cut: str | None = None
        self.failover: tuple[str, str, float] | None = None  # killed, next decider, seconds
        self.at_members: dict[str, AsyncClient] = {}  # a member's address -> a client of it

    async def close(self) -> None:
        for client in [*self.clients.values(), *self.at_members.values()]:
            await client.close()

    def log(self, text: str) -> None:
        self.out(f"[{time.monotonic() - self.history.started:6.1f}s] {text}")

    async def run(
        self, *, items: int, agents_per_region: int, cut_seconds: float, work_seconds: float
    ) -> list[Check]:
        keys = await self._seed(items)
        agents = self._agents(agents_per_region, work_seconds)
        await self._drain(keys, agents, cut_seconds)
        return await self._verify(items, agents[0])

    async def _seed(self, items: int) -> list[str]:
        """Once every node decides claims: ``items`` backlog items, homed round-robin."""

        async def all_serving() -> bool:
            return all([await _deciding(c) for c in self.clients.values()])

        took = await _poll("every node caught up", all_serving, 60)
        self.log(f"{len(self.regions)} regions serving claims after {took:.1f} s")
        keys = await seed_queue(self.clients, items)
        homes = sorted(self.regions)  # seed_queue homes items round-robin in name order
        for index in range(items):
            self.totals[homes[index % len(homes)]] += 1
        self.totals[homes[0]] += 1  # the poison item
        self.log(
            f"seeded {items} items, homed round-robin in {', '.join(self.regions)}, priorities"
            f" P0-P2, one after: link, and a poison item"
        )
        return keys

    def _agents(self, agents_per_region: int, work_seconds: float) -> list[Agent]:
        """The workers; the first stalls past its lease once, after its first claim."""
        return [
            QueueAgent(
                f"{region}-agent-{i}", region, self.clients[region], self.history,
                lease_seconds=self.lease, pause_once=(region, i) == (self.regions[0], 0),
                work_seconds=work_seconds,
                seed=self.rng.randrange(1 << 30),
            ).waking_on(self.feeds[region])
            for region in self.regions
            for i in range(agents_per_region)
        ]  # fmt: skip

    async def _drain(self, keys: Sequence[str], agents: list[Agent], cut_seconds: float) -> None:
        """Run the agents, the display, the nemesis and the lag probe until the backlog
        is drained and every fault has played out."""
        stop = asyncio.Event()
        tasks = [asyncio.create_task(feed.follow(stop)) for feed in self.feeds.values()]
        tasks += [asyncio.create_task(agent.run(stop)) for agent in agents]
        paused = agents[0]
        watchers = [
            asyncio.create_task(self._display(stop, paused)),
            asyncio.create_task(self._nemesis(cut_seconds, stop)),
            asyncio.create_task(self._probe_lag(stop)),
        ]
        faults = watchers[1:2]
        if self.cluster.members:
            watchers.append(asyncio.create_task(self._kill_decider(len(keys), stop)))
            faults.append(watchers[-1])
        self.log(f"nemesis: {paused.name} will stall past its lease after its first claim")

        async def finished() -> bool:
            # Drained, and every fault has played out: the cut healed, the decider
            # killed and replaced, and the stalled worker (if it ever claimed) has woken
            # up and been answered.
            stalled = paused.pause_once or paused.paused_refusal is not None
            played = all(fault.done() for fault in faults)
            return await self._drained(keys) and played and stalled

        try:
            drained = await _poll("backlog drained", finished, DRAIN_LIMIT_S)
            self.log(f"backlog drained and faults played out in {drained:.1f} s")
        finally:
            stop.set()
            for task in tasks[: len(self.feeds)]:
                task.cancel()  # a feed's watch waits for the next change; nothing more comes
            await asyncio.gather(*tasks, *watchers, return_exceptions=True)
        feeds = self.feeds.values()
        self.log(
            f"agents found no work {sum(f.woken + f.lapsed for f in feeds)} times and waited on"
            f" their region's change feed: woken by a change {sum(f.woken for f in feeds)}"
            f" times, looked again after {self.lease:g} s without one"
            f" {sum(f.lapsed for f in feeds)} times; {sum(f.events for f in feeds)} feed events"
        )

    async def _verify(self, items: int, paused: Agent) -> list[Check]:
        """Heal, wait for byte-identical replicas, and check the history against them."""
        assert self.cluster.mesh is not None
        self.cluster.mesh.heal()
        converged = await _poll("byte-identical replicas", self._converged, 120)
        self.log(f"replicas byte-identical {converged:.2f} s after the last write")
        finals = {region: await _records(self.clients[region], TOPIC) for region in self.regions}
        lags = sorted(self.lags) or [0.0]
        self.log(
            f"replication lag (write acknowledged -> visible in every region): median"
            f" {lags[len(lags) // 2] * 1000:.0f} ms, max {lags[-1] * 1000:.0f} ms"
            f" over {len(self.lags)} probes"
        )
        histories = {
            key: await self._claim_history(key, record.home_region)
            for key, record in finals[self.regions[0]].items()
        }
        checks = [
            *self._failover_checks(finals),
            Check("every item completed", all(
                record.status == "done" for record in finals[self.regions[0]].values()
                if record.id != POISON
            ), f"{items} items done in every region"),
            *check_history(self.history, finals),
            *queue_checks(finals[self.regions[0]], histories),
            Check("byte-identical replicas after the final heal", True,
                  f"converged in {converged:.2f} s"),
            Check("the stalled worker was refused", paused.paused_refusal is not None
                  and "superseded" in paused.paused_refusal, str(paused.paused_refusal)),
        ]  # fmt: skip
        return checks

    async def _claim_history(self, key: str, region: str) -> ClaimHistory:
        """``key``'s claim events as its home decided them. In a region of several
        members each member keeps those its deciders sent it, but not those of
        decisions whose state reached it otherwise, as while it was down
        (docs/consistency.md): there, every member's, once each, in time order."""
        group = self.cluster.members.get(region)
        if group is None:
            return await self.clients[region].history(key)
        events: list[ClaimEvent] = []
        for member in group.values():
            if member.address not in self.at_members:  # one client each, for every key
                self.at_members[member.address] = AsyncClient(member.address, retries=2, timeout=5)
            events += (await self.at_members[member.address].history(key)).events
        once = dict.fromkeys(events)  # the same event, kept by several members
        ordered = sorted(once, key=lambda e: e.at or datetime.min.replace(tzinfo=UTC))
        return ClaimHistory(tuple(ordered), region)

    def _failover_checks(self, finals: dict[str, dict[str, Record]]) -> list[Check]:
        """With a region of members: the decider killed was replaced, and every write
        and result acknowledged (before, across and after the kill) is everywhere."""
        if not self.cluster.members:
            return []
        if self.failover is None:
            return [Check("failover", False, "the decider was not killed, or not replaced")]
        killed, after, took = self.failover
        return [
            Check("failover", True, f"new decider after {took:.1f} s ({after}, after {killed}"
                  " was killed mid-drain)"),
            acknowledged_everywhere(self.history, finals, ("write", "done"),
                                    "no acknowledged write lost", "writes and results"),
        ]  # fmt: skip

    async def _kill_decider(self, items: int, stop: asyncio.Event) -> None:
        """Once a third of the backlog is done: SIGKILL the members' decider, then wait
        until the members left name the next one."""
        region = next(iter(self.cluster.members))

        async def a_third_done() -> bool:
            return stop.is_set() or sum(self.done.values()) >= items / 3

        await _poll("a third of the backlog done", a_third_done, DRAIN_LIMIT_S)
        if stop.is_set():
            return
        killed = await self.cluster.decider(region)
        killed_at = time.monotonic()
        await self.cluster.members[region][killed].kill()
        self.log(f"nemesis: {killed}, the decider of {region}, killed (SIGKILL) mid-drain")
        after = await self.cluster.decider(region, other_than=killed)
        took = time.monotonic() - killed_at
        self.failover = (killed, after, took)
        self.log(f"failover: {after} decides for {region}, {took:.1f} s after the kill")
        await self.cluster.restart_member(region, killed)
        self.log(f"nemesis: {killed} restarted on its disk, a member that does not decide")

    async def _drained(self, keys: Sequence[str]) -> bool:
        # Each item is finished (or the poison one parked) at its home region; look there.
        for region, client in self.clients.items():
            records = await _records(client, TOPIC)
            mine = [r for r in records.values() if r.home_region == region]
            self.done[region] = sum(r.status == "done" for r in mine)
            parked = sum(r.status == "parked" for r in mine)
            self.done[region] += parked
        return sum(self.done.values()) == len(keys)

    async def _converged(self) -> bool:
        views = [await _records(client) for client in self.clients.values()]
        digests = [{key: record.digest for key, record in view.items()} for view in views]
        return all(d == digests[0] for d in digests)

    async def _nemesis(self, cut_seconds: float, stop: asyncio.Event) -> None:
        assert self.cluster.mesh is not None
        victim = self.regions[-1]
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1.0):
                await stop.wait()
                return
        self.cut = victim
        self.cluster.mesh.isolate(victim)
        self.log(f"nemesis: region {victim} cut off from the others for {cut_seconds:.0f} s")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(cut_seconds):
                await stop.wait()
        self.cluster.mesh.heal()
        self.cut = None
        self.log(f"nemesis: region {victim} healed")

    async def _probe_lag(self, stop: asyncio.Event) -> None:
        """Replication lag, measured: a write at one region, then watch the others see it."""
        beat = 0
        while not stop.is_set():
            await asyncio.sleep(0.5)
            source = self.rng.choice([r for r in self.regions if r != self.cut])
            beat += 1
            try:
                made = await self.clients[source].remember(
                    REPO, "probe", source, fields={"beat": str(beat)}, tags=[f"homeRegion:{source}"]
                )
            except FencemarkError:
                continue
            written = time.monotonic()
            others = [c for r, c in self.clients.items() if r not in (source, self.cut)]
            while others and time.monotonic() - written < 5 and not stop.is_set():
                seen = []
                for client in others:
                    with contextlib.suppress(FencemarkError):
                        record = await client.get(made.record.key)
                        if record.fields.get("beat") == str(beat):
                            seen.append(client)
                others = [c for c in others if c not in seen]
                if others:
                    await asyncio.sleep(0.005)
            if not others:
                self.lags.append(time.monotonic() - written)

    async def _display(self, stop: asyncio.Event, paused: Agent) -> None:
        tty = sys.stdout.isatty()
        last = 0.0
        told = False
        while not stop.is_set():
            await asyncio.sleep(0.5)
            if paused.paused_refusal is not None and not told:
                told = True
                if tty:
                    print()
                self.log(f"nemesis: {paused.name} woke up after its lease and was refused:"
                         f" {paused.paused_refusal}")  # fmt: skip
            counts = self.history.counts
            done = " ".join(f"{r} {self.done[r]}/{self.totals[r]}" for r in self.regions)
            lag = f"{self.lags[-1] * 1000:.0f}ms" if self.lags else "-"
            events = sum(feed.events for feed in self.feeds.values())
            refusals = " ".join(
                f"{word} {counts[f'refused:{word}']}"
                for word in ("claimed", "superseded", "expired", "wrong_region")
            )
            line = (
                f"done {done} | grants {counts['grant:ok']} contended"
                f" {counts['refused:contended']} | refused {refusals} | events {events}"
                f" | repl lag {lag}" + (f" | {self.cut} CUT" if self.cut else "")
            )
            if tty:
                print(f"\r\033[K{line}", end="", flush=True)
            elif time.monotonic() - last >= 2:
                self.log(line)
                last = time.monotonic()
        if tty:
            print()


def report(checks: Sequence[Check], out: Out) -> bool:
    out("\nverification report")
    for check in checks:
        out(f"  {'PASS' if check.ok else 'FAIL'}  {check.name}: {check.detail}")
    ok = all(check.ok for check in checks)
    out("demo: PASSED" if ok else "demo: FAILED")
    return ok


async def run_demo(
    *,
    regions: Sequence[str] = ("us", "eu", "ap"),
    items: int = 30,
    agents_per_region: int = 3,
    lease_seconds: float = 2.0,
    cut_seconds: float = 4.0,
    work_seconds: float = 0.3,
    seed_value: int | None = None,
    data_dir: str | None = None,
    members: int = 1,
    out: Out = print,
) -> int:
    chosen = seed_value if seed_value is not None else random.randrange(1 << 20)
    several = f" ({regions[0]} of {members} members)" if members > 1 else ""
    out(f"fencemark demo: {len(regions)} regions{several}, {items} items, {agents_per_region}"
        f" agents per region, lease {lease_seconds:g} s, seed {chosen}")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="fencemark-demo-") as scratch:
        root = Path(data_dir) if data_dir else Path(scratch)
        try:
            cluster = await LocalCluster.start(
                regions, root, faults=True, anti_entropy_interval=0.3, members=members
            )
        except EtcdMissing as exc:
            out(f"fencemark demo --members {members}: {exc}")
            return 2
        for region, address in cluster.addresses.items():
            group = cluster.members.get(region)
            if group is None:
                out(f"  region {region}: node on {address}, data in {root / region}")
                continue
            listed = ", ".join(f"{name} on {member.address}" for name, member in group.items())
            assert cluster.etcd is not None
            out(f"  region {region}: members {listed}, electing their decider through etcd on"
                f" 127.0.0.1:{cluster.etcd.port}; data in {root}/{region}-*")  # fmt: skip
        out(
            "  transport: plaintext gRPC (--insecure), loopback only; mutual TLS is"
            " `fencemark node --tls-dir` (docs/security.md)"
        )
        demo = Demo(cluster, out=out, lease=lease_seconds, rng=random.Random(chosen))
        try:
            checks = await demo.run(
                items=items,
                agents_per_region=agents_per_region,
                cut_seconds=cut_seconds,
                work_seconds=work_seconds,
            )
        except TimeoutError as exc:
            checks = [Check("the run finished", False, str(exc))]
        finally:
            await demo.close()
            await cluster.stop()
    return 0 if report(checks, out) else 1

"""The nemesis: faults scheduled from a seed, played one after another, each healed.

A schedule is a list of :class:`Fault` drawn from ``random.Random(seed)``: the
short run plays every kind once in a seeded order; a longer run then draws kinds
at random until its time is spent. Faults never overlap (each heals before the
next starts, with a quiet gap between), so the checker can attribute what it
sees to one fault, and a seed replays the same faults in the same order with the
same targets (timing still varies with the machine).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from docker.errors import DockerException

from fencemark.client import AsyncClient, FencemarkError
from fencemark.node.proxy import ProxyMesh
from fencemark.node.workload import Agent
from tests.chaos.cluster import ChaosCluster

PARTITIONS = ("isolate", "halves", "bridge")
KINDS = (*PARTITIONS, "kill", "wipe", "pause", "agent-pause", "loss", "slow")
FAULT_SECONDS = (4.0, 7.0)  # how long a timed fault lasts, drawn uniformly
GAP_SECONDS = (1.5, 3.0)  # quiet time between faults
DOWN_SECONDS = (1.0, 3.0)  # how long a killed node stays down
LOSS_PROBABILITY = 0.3
SLOW_LATENCY_MS = 250.0
SLOW_BANDWIDTH = 64 * 1024.0  # bytes/s each way
RECOVER_LIMIT_S = 60.0  # a restarted node must decide claims again within this


@dataclass(frozen=True)
class Fault:
    kind: str
    # Regions (isolate: the victim, then the rest; halves: one half, then the
    # other; bridge: the two kept apart); for agent-pause, the agent's name.
    targets: tuple[str, ...]
    seconds: float  # how long it lasts (for kill/wipe: downtime; pause: past the lease)
    gap: float  # quiet time before it


@dataclass(frozen=True)
class Played:
    """A fault as it happened, on the run's clock (seconds since the run started)."""

    kind: str
    targets: tuple[str, ...]
    started: float
    ended: float
    detail: str = ""
    cut: tuple[tuple[str, str], ...] = ()  # for partitions: the region pairs cut apart
    injected: bool = True  # False: the engine refused the fault (see detail); healed at once
    # kill, wipe: when the node was dead for sure (SIGKILL delivered; for a wipe, the
    # disk gone). A write the node acknowledged before this was acknowledged by it.
    down_at: float = 0.0


def schedule(
    rng: random.Random,
    regions: Sequence[str],
    agents: Sequence[str],
    seconds: float,
    lease: float,
) -> list[Fault]:
    """Every kind once in random order; then random kinds while ``seconds`` last."""
    faults: list[Fault] = []
    budget = seconds
    kinds = list(KINDS)
    rng.shuffle(kinds)
    while kinds or budget > 0:
        kind = kinds.pop() if kinds else rng.choice(KINDS)
        fault = _draw(rng, kind, list(regions), list(agents), lease)
        faults.append(fault)
        budget -= fault.gap + fault.seconds
    return faults


def _draw(
    rng: random.Random, kind: str, regions: list[str], agents: list[str], lease: float
) -> Fault:
    gap = round(rng.uniform(*GAP_SECONDS), 2)
    span = round(rng.uniform(*FAULT_SECONDS), 2)
    if kind == "isolate":
        victim = rng.choice(regions)  # first: the region cut off from all the others
        return Fault(kind, (victim, *(r for r in regions if r != victim)), span, gap)
    if kind == "halves":
        shuffled = rng.sample(regions, len(regions))
        return Fault(kind, tuple(shuffled), span, gap)  # first half | second half
    if kind == "bridge":
        a, b = rng.sample(regions, 2)
        return Fault(kind, (a, b), span, gap)  # a and b apart; both still reach the rest
    if kind in ("kill", "wipe"):
        return Fault(kind, (rng.choice(regions),), round(rng.uniform(*DOWN_SECONDS), 2), gap)
    if kind == "pause":
        return Fault(kind, (rng.choice(regions),), round(2 * lease, 2), gap)
    if kind == "agent-pause":
        return Fault(kind, (rng.choice(agents),), lease + 10, gap)
    return Fault(kind, tuple(regions), span, gap)  # loss, slow: between every node


def cut_pairs(fault: Fault) -> list[tuple[str, str]]:
    """The region pairs a partition separates."""
    if fault.kind == "bridge":
        return [(fault.targets[0], fault.targets[1])]
    half = 1 if fault.kind == "isolate" else len(fault.targets) // 2
    return [(a, b) for a in fault.targets[:half] for b in fault.targets[half:]]


class Nemesis:
    """Plays a schedule against the cluster, the host-side mesh and the agents."""

    def __init__(
        self,
        cluster: ChaosCluster,
        mesh: ProxyMesh,
        agents: Sequence[Agent],
        clock: Callable[[], float],
        log: Callable[[str], None],
    ) -> None:
        self.cluster = cluster
        self.mesh = mesh
        self.agents = {agent.name: agent for agent in agents}
        self.clock = clock
        self.log = log
        self.played: list[Played] = []
        self._down_at = 0.0

    async def play(
        self, faults: Sequence[Fault], stop: asyncio.Event, until: float | None = None
    ) -> None:
        """Play ``faults`` in order; past the first of each kind, none starts after ``until``
        (run clock), since restarts and stalled agents take longer than scheduled."""
        for index, fault in enumerate(faults):
            late = until is not None and index >= len(KINDS) and self.clock() >= until
            if stop.is_set() or late:
                return
            await asyncio.sleep(fault.gap)
            started = self.clock()
            self.log(f"nemesis: {fault.kind} {' '.join(fault.targets)} ({fault.seconds:.1f} s)")
            self._down_at = 0.0
            try:
                detail = await self._inject(fault)
            except (DockerException, RuntimeError) as exc:
                # The engine, not Fencemark, failed (e.g. the cgroup freezer timing
                # out): heal everything, say so in the report, and go on.
                self.log(f"nemesis: {fault.kind} could not be injected: {exc}")
                await asyncio.to_thread(self.cluster.heal_all)
                self.mesh.heal()
                why = f"not injected: {exc}"[:300]
                self.played.append(
                    Played(fault.kind, fault.targets, started, self.clock(), why, injected=False)
                )
                continue
            self.played.append(
                Played(
                    fault.kind,
                    fault.targets,
                    started,
                    self.clock(),
                    detail,
                    tuple(cut_pairs(fault)) if fault.kind in PARTITIONS else (),
                    down_at=self._down_at,
                )
            )
            self.log(f"nemesis: {fault.kind} healed{': ' + detail if detail else ''}")

    async def _inject(self, fault: Fault) -> str:
        region = fault.targets[0]
        if fault.kind in PARTITIONS:
            pairs = cut_pairs(fault)
            await asyncio.to_thread(self.cluster.cut, pairs)
            for a, b in pairs:  # agents in a region are cut off from the other side too
                self.mesh.link(a, b).cut()
                self.mesh.link(b, a).cut()
            await asyncio.sleep(fault.seconds)
            self.mesh.heal()
            await asyncio.to_thread(self.cluster.heal_network)
            return ""
        if fault.kind in ("kill", "wipe"):
            await asyncio.to_thread(self.cluster.kill, region)
            if fault.kind == "wipe":
                await asyncio.to_thread(self.cluster.wipe, region)
            self._down_at = self.clock()
            await asyncio.sleep(fault.seconds)
            await asyncio.to_thread(self.cluster.start_node, region)
            took = await self._until_deciding(region)
            return f"{region} deciding claims again {took:.1f} s after its restart"
        if fault.kind == "pause":
            await self._retry(self.cluster.pause, region)
            await asyncio.sleep(fault.seconds)
            await asyncio.to_thread(self.cluster.unpause, region)
            return ""
        if fault.kind == "agent-pause":
            agent = self.agents[region]
            agent.pause_once = True
            deadline = time.monotonic() + fault.seconds + 20
            while agent.pause_once or agent.paused_refusal is None:
                if time.monotonic() > deadline:
                    return f"{agent.name} did not stall and wake within the fault's time"
                await asyncio.sleep(0.2)
            return f"{agent.name} woke and was told {agent.paused_refusal}"
        if fault.kind == "loss":
            await asyncio.to_thread(self.cluster.lose_packets, LOSS_PROBABILITY)
            await asyncio.sleep(fault.seconds)
            await asyncio.to_thread(self.cluster.heal_network)
            return ""
        if fault.kind == "slow":
            await asyncio.to_thread(self.cluster.slow_link, SLOW_LATENCY_MS, SLOW_BANDWIDTH)
            await asyncio.sleep(fault.seconds)
            await asyncio.to_thread(self.cluster.set_link_faults, {})
            return "-".join(self.cluster.proxied)
        raise ValueError(f"unknown fault kind {fault.kind!r}")

    @staticmethod
    async def _retry(action: Callable[[str], None], region: str, attempts: int = 5) -> None:
        """``action(region)`` in a thread, retried: the freezer sometimes cannot freeze a
        process in the middle of an fsync at once ("unable to freeze")."""
        for attempt in range(attempts):
            try:
                await asyncio.to_thread(action, region)
                return
            except DockerException:
                if attempt == attempts - 1:
                    raise
                await asyncio.sleep(0.2)

    async def _until_deciding(self, region: str) -> float:
        """Seconds until a restarted node serves claims again (after catch-up), bounded."""
        client = AsyncClient(self.cluster.regions[region].address, timeout=1.0, retries=0)
        try:
            return await wait_for(
                f"{region} serving claims", lambda: _serving(client), RECOVER_LIMIT_S
            )
        finally:
            await client.close()


async def _serving(client: AsyncClient) -> bool:
    try:
        return (await client.info()).claims_serving
    except FencemarkError:
        return False


async def wait_for(what: str, condition: Callable[[], Awaitable[bool]], limit: float) -> float:
    """Poll ``condition`` every 0.1 s until true; the seconds it took. Bounded by ``limit``."""
    started = time.monotonic()
    while not await condition():
        if time.monotonic() - started > limit:
            raise TimeoutError(f"{what}: not within {limit:.0f} s")
        await asyncio.sleep(0.1)
    return time.monotonic() - started

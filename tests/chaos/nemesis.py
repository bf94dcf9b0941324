"""The nemesis: faults scheduled from a seed, played one after another, each healed.

A schedule is a list of :class:`Fault` drawn from ``random.Random(seed)``: the
short run plays every kind once in a seeded order; a longer run then draws kinds
at random until its time is spent. Faults never overlap (each heals before the
next starts, with a quiet gap between), so the checker can attribute what it
sees to one fault, and a seed replays the same faults in the same order with the
same targets (timing still varies with the machine).

Some faults set the workload going on a shape of its own (:class:`Shapes`): a
partition has the same untagged ids created on both of its sides, a node
restarted again and again before it has caught up is pressed with claims, and so
is a node whose disk went back in time (``rollback``), for what it forgot.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from docker.errors import DockerException

from fencemark.client import AsyncClient, FencemarkError
from fencemark.node.tools.proxy import ProxyMesh
from fencemark.node.tools.workload import Agent
from tests.chaos.cluster import ChaosCluster
from tests.chaos.forger import Forger, Pushed
from tests.chaos.workload import TESTER

PARTITIONS = ("isolate", "halves", "bridge")
DISK_LOSSES = ("wipe", "wipe-restart")
ROLLBACK = "rollback"
# Faults after which a node's data file may lack writes it acknowledged: all of them
# (a lost disk), or those made after a copy it was put back to (its disk went back
# in time). A write acknowledged by it may be gone with them unless it had time to
# pass it on (claims.disk_lost_at).
DISK_FAULTS = (*DISK_LOSSES, ROLLBACK)
KINDS = (*PARTITIONS, "kill", *DISK_LOSSES, "pause", "agent-pause", "loss", "slow", "forge",
         ROLLBACK)  # fmt: skip
FAULT_SECONDS = (4.0, 7.0)  # how long a timed fault lasts, drawn uniformly
GAP_SECONDS = (1.5, 3.0)  # quiet time between faults
DOWN_SECONDS = (1.0, 3.0)  # how long a killed node stays down
# wipe-restart: how many times the node is stopped again before it has caught up,
# with which signal, and how likely (past the first of the kind) one peer is cut
# off meanwhile, so that the catch-up cannot finish.
RESTARTS = (2, 3)
STOP_SIGNALS = ("SIGKILL", "SIGTERM")
CUT_PEER_PROBABILITY = 0.75
HOLDING_LIMIT_S = 10.0  # a restarted node holds some of its peers' records within this
UP_BEFORE_STOP_S = 1.0  # then it serves (reads, and refuses the rest) this long
CUT_WATCH_S = 2.0  # after its last restart, how long it is up, cut off, before the heal
LOSS_PROBABILITY = 0.3
SLOW_LATENCY_MS = 250.0
SLOW_BANDWIDTH = 64 * 1024.0  # bytes/s each way
RECOVER_LIMIT_S = 60.0  # a restarted node must decide claims again within this
# A node woken from a pause notices its nap at its next tick (a fifth of nap_s); one
# that still says it decides this long after the wake never noticed.
NAP_NOTICE_S = 3.0
# rollback: how long the workload runs between the copy of the node's data directory
# and the kill that puts it back. Longer than claims.DISK_LOSS_GRACE_S, so that what
# the node acknowledged early in it had time to reach its peers (and must survive).
ROLLBACK_SECONDS = (7.0, 10.0)
PRESS_AFTER_S = 2.0  # the rolled-back node is pressed this long after it decides again


@dataclass(frozen=True)
class Fault:
    kind: str
    # Regions (isolate: the victim, then the rest; halves: one half, then the
    # other; bridge: the two kept apart); for agent-pause, the agent's name.
    targets: tuple[str, ...]
    # how long it lasts (for kill/wipe: downtime; pause: past the lease; rollback: from
    # the copy of the data directory to the kill that puts it back)
    seconds: float
    gap: float  # quiet time before it
    # wipe-restart (targets: the node, then the peer cut off from it, if any): the
    # signal of each stop that comes before the node has caught up.
    restarts: tuple[str, ...] = ()


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
    # kill, wipe, rollback: when the node was dead for sure (SIGKILL delivered; for a
    # wipe, the disk gone). A write the node acknowledged before this was acknowledged
    # by it. pause: when it was frozen for sure.
    down_at: float = 0.0
    # rollback: when the copy its data directory was put back to was taken (just before
    # the node was frozen for it): what the node acknowledged before is on the copy.
    copied_at: float = 0.0
    # wipe-restart with a peer cut off: when that cut was healed (until then the node
    # cannot have caught up), and when it said it served claims before that (0: never).
    cut_healed: float = 0.0
    serving_early: float = 0.0
    # pause: the last moment the woken node said it decided nothing yet (settling with
    # its peers after the nap), asked after the wake; 0 if it never said so.
    settling_until: float = 0.0
    # forge: each forged state pushed, and how the node answered (forger.Pushed)
    forged: tuple[Pushed, ...] = ()


class Shapes(Protocol):
    """What the workload does when a fault sets up one of its shapes."""

    def split(self, sides: tuple[str, str], healed: asyncio.Event) -> None:
        """Create untagged ids on both ``sides`` of a partition (until ``healed``)."""

    def press(self, region: str, until: asyncio.Event) -> None:
        """Claim records homed at ``region`` while its node catches up (until ``until``)."""

    async def before_copy(self, region: str) -> None:
        """Work for ``region``'s node that is on the copy of its data directory about to
        be taken, undone, and that the workload does after it (a ``rollback``)."""

    def rolled_back(self, region: str, since: float, until: asyncio.Event) -> None:
        """Ask ``region``'s node, restarted on a copy of its data directory taken at
        ``since`` (run clock), to decide again on what it decided after (until ``until``)."""


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
        first = bool(kinds)
        kind = kinds.pop() if kinds else rng.choice(KINDS)
        fault = _draw(rng, kind, list(regions), list(agents), lease, first=first)
        faults.append(fault)
        budget -= fault.gap + fault.seconds
    return faults


def _draw(
    rng: random.Random,
    kind: str,
    regions: list[str],
    agents: list[str],
    lease: float,
    *,
    first: bool = False,
) -> Fault:
    """One fault of ``kind``; the ``first`` of its kind in a schedule (the short run's)
    takes a sure form: a wipe-restart cuts a peer off, and is quick about it."""
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
    if kind == ROLLBACK:
        return Fault(kind, (rng.choice(regions),), round(rng.uniform(*ROLLBACK_SECONDS), 2), gap)
    if kind == "wipe-restart":
        victim = rng.choice(regions)
        down = round(rng.uniform(*DOWN_SECONDS), 2)
        stops = RESTARTS[0] if first else rng.randint(*RESTARTS)
        restarts = tuple(rng.choice(STOP_SIGNALS) for _ in range(stops))
        cut_off = first or rng.random() < CUT_PEER_PROBABILITY
        peer = (rng.choice([r for r in regions if r != victim]),) if cut_off else ()
        return Fault(kind, (victim, *peer), down, gap, restarts)
    if kind == "pause":
        return Fault(kind, (rng.choice(regions),), round(2 * lease, 2), gap)
    if kind == "agent-pause":
        return Fault(kind, (rng.choice(agents),), lease + 10, gap)
    if kind == "forge":  # the node forged against, then the region the forger poses as
        victim, posing = rng.sample(regions, 2)
        return Fault(kind, (victim, posing), 0.0, gap)
    return Fault(kind, tuple(regions), span, gap)  # loss, slow: between every node


def cut_pairs(fault: Fault) -> list[tuple[str, str]]:
    """The region pairs a partition separates (wipe-restart: the node and its cut peer)."""
    if fault.kind == "wipe-restart":
        return [(fault.targets[0], fault.targets[1])] if len(fault.targets) > 1 else []
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
        shapes: Shapes | None = None,
        forger: Forger | None = None,
    ) -> None:
        self.cluster = cluster
        self.mesh = mesh
        self.agents = {agent.name: agent for agent in agents}
        self.clock = clock
        self.log = log
        self.shapes = shapes
        self.forger = forger
        self.played: list[Played] = []
        self._down_at = 0.0
        self._cut_healed = 0.0
        self._serving_early = 0.0
        self._copied_at = 0.0
        self._settling_until = 0.0
        self._forged: tuple[Pushed, ...] = ()

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
            self._down_at = self._cut_healed = self._serving_early = self._copied_at = 0.0
            self._settling_until = 0.0
            self._forged = ()
            try:
                detail = await self._inject(fault)
            except (DockerException, RuntimeError) as exc:
                # The engine, not Fencemark, failed (e.g. the cgroup freezer timing
                # out): heal everything, say so in the report, and go on.
                self.log(f"nemesis: {fault.kind} could not be injected: {exc}")
                await asyncio.to_thread(self.cluster.heal_all)
                self.mesh.heal()
                why = f"not injected: {exc}"[:300]
                # How far it got: a rollback's node may have been put back already.
                failed = Played(fault.kind, fault.targets, started, self.clock(), why,
                                injected=False, down_at=self._down_at,
                                copied_at=self._copied_at)  # fmt: skip
                self.played.append(failed)
                continue
            self.played.append(
                Played(
                    fault.kind,
                    fault.targets,
                    started,
                    self.clock(),
                    detail,
                    tuple(cut_pairs(fault)) if fault.kind in (*PARTITIONS, "wipe-restart") else (),
                    down_at=self._down_at,
                    cut_healed=self._cut_healed,
                    serving_early=self._serving_early,
                    copied_at=self._copied_at,
                    settling_until=self._settling_until,
                    forged=self._forged,
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
            healed = asyncio.Event()
            if self.shapes is not None:  # the same new ids on both sides of the cut
                self.shapes.split(pairs[0], healed)
            try:
                await asyncio.sleep(fault.seconds)
            finally:
                self.mesh.heal()
                await asyncio.to_thread(self.cluster.heal_network)
                healed.set()
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
        if fault.kind == "wipe-restart":
            return await self._wipe_restart(fault)
        if fault.kind == ROLLBACK:
            return await self._rollback(fault)
        if fault.kind == "pause":
            await self._retry(self.cluster.pause, region)
            self._down_at = self.clock()  # frozen for sure: it decides nothing from here
            await asyncio.sleep(fault.seconds)
            await asyncio.to_thread(self.cluster.unpause, region)
            self._settling_until = await self._until_settled(region)
            if not self._settling_until:
                return f"{region} never said it was settling after the pause"
            return f"{region} settling until {self._settling_until:.1f} s"
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
        if fault.kind == "forge":
            if self.forger is None:
                return "no forger: nothing pushed"
            self._forged, note = await self.forger.forge(region, fault.targets[1], self.log)
            return note
        if fault.kind == "slow":
            await asyncio.to_thread(self.cluster.slow_link, SLOW_LATENCY_MS, SLOW_BANDWIDTH)
            await asyncio.sleep(fault.seconds)
            await asyncio.to_thread(self.cluster.set_link_faults, {})
            return "-".join(self.cluster.proxied)
        raise ValueError(f"unknown fault kind {fault.kind!r}")

    async def _wipe_restart(self, fault: Fault) -> str:
        """Disk loss, then the node stopped again (and again) before it has caught up:
        each time it comes back on a data directory that holds part of what its peers
        have. With a peer cut off meanwhile, it cannot catch up until the cut heals,
        and must decide nothing until then (SPEC §4); a watcher notes if it does."""
        region = fault.targets[0]
        pairs = cut_pairs(fault)
        pressed = asyncio.Event()
        watcher: asyncio.Task[None] | None = None
        notes = []
        try:
            if pairs:  # cut while both run: a stopped node's rules cannot be set
                await asyncio.to_thread(self.cluster.cut, pairs)
            address = await asyncio.to_thread(self.cluster.ip, region)
            await asyncio.to_thread(self.cluster.kill, region)
            await asyncio.to_thread(self.cluster.wipe, region)
            self._down_at = self.clock()
            if self.shapes is not None:
                self.shapes.press(region, pressed)
            if pairs:
                watcher = asyncio.create_task(self._watch_not_deciding(region))
            await asyncio.sleep(fault.seconds)
            for signal in fault.restarts:
                moved = await self._start_cut_off(region, pairs, address)
                holding = await self._until_holding(region)
                await asyncio.sleep(UP_BEFORE_STOP_S)  # calls meet a node catching up
                await asyncio.to_thread(self.cluster.kill, region, signal)
                notes.append(f"{signal} holding {holding} records{moved}")
                await asyncio.sleep(0.3)
            notes.append("started" + await self._start_cut_off(region, pairs, address))
            if pairs:  # up and answering, not only started, while it cannot catch up
                await self._until_holding(region)
                await asyncio.sleep(CUT_WATCH_S)
                watcher_done(watcher)
                await asyncio.to_thread(self.cluster.heal_network)
                self._cut_healed = self.clock()
            took = await self._until_deciding(region)
        finally:
            watcher_done(watcher)
            pressed.set()
        detail = f"{region} stopped before catching up: {', '.join(notes)}"
        if pairs:
            detail += f"; cut off from {pairs[0][1]}, deciding claims {took:.1f} s after the heal"
        else:
            detail += f"; deciding claims {took:.1f} s after its last restart"
        if self._serving_early:
            detail += f"; SERVED CLAIMS while cut off, at {self._serving_early:.1f} s"
        return detail

    async def _rollback(self, fault: Fault) -> str:
        """The node's disk goes back in time: a crash-consistent copy of its data
        directory (the node frozen meanwhile, as a disk snapshot holds it), the workload
        for ``fault.seconds`` more, then ``kill -9``, the copy put back in place of the
        directory, and a restart. The node comes back with its own id and a consistent
        file that lacks everything it did since the copy; its peers hold what reached
        them. At once it is asked to decide again on what it forgot (``Shapes``)."""
        region = fault.targets[0]
        copy = self.cluster.root / "rollback" / f"{region}-{len(self.played)}"
        if self.shapes is not None:
            await self.shapes.before_copy(region)
        self._copied_at = self.clock()  # acknowledged before this: on the copy
        await self._retry(self.cluster.pause, region)
        try:
            files = await asyncio.to_thread(self.cluster.copy_data, region, copy)
        finally:
            await asyncio.to_thread(self.cluster.unpause, region)
        await asyncio.sleep(fault.seconds)
        await asyncio.to_thread(self.cluster.kill, region)
        self._down_at = self.clock()
        await asyncio.to_thread(self.cluster.restore_data, region, copy)
        pressed = asyncio.Event()
        try:
            await asyncio.to_thread(self.cluster.start_node, region)
            if self.shapes is not None:
                self.shapes.rolled_back(region, self._copied_at, pressed)
            took = await self._until_deciding(region)
            await asyncio.sleep(PRESS_AFTER_S)
        finally:
            pressed.set()
        lost = self._down_at - self._copied_at
        return (
            f"{region} put back to its copy of {self._copied_at:.1f} s ({files} files),"
            f" {lost:.1f} s of its writes forgotten; deciding claims {took:.1f} s after its"
            " restart"
        )

    async def _start_cut_off(
        self, region: str, pairs: Sequence[tuple[str, str]], address: str
    ) -> str:
        """Start ``region``'s node and (again) cut it from its peer: a restarted
        container has a fresh network namespace, without the old rules. The peer's
        rules still drop the node's old address; a note if it got a new one (then
        the node may have reached its peer before the cut was renewed)."""
        await asyncio.to_thread(self.cluster.start_node, region)
        if not pairs:
            return ""
        await asyncio.to_thread(self.cluster.cut, pairs)
        now = await asyncio.to_thread(self.cluster.ip, region)
        return "" if now == address else f" (new address {now}, was {address})"

    async def _until_holding(self, region: str) -> int:
        """Wait until a restarted node holds some records (it is catching up); how many."""
        client = self._client(region)
        held = 0

        async def holding() -> bool:
            nonlocal held
            try:
                held = (await client.info()).record_count
            except FencemarkError:
                return False
            return held > 0

        try:
            await wait_for(f"{region} holding records", holding, HOLDING_LIMIT_S)
        except TimeoutError:
            pass  # stopped empty-handed: still a restart before catching up
        finally:
            await client.close()
        return held

    async def _watch_not_deciding(self, region: str) -> None:
        """Poll a node that cannot have caught up; note when it says it decides claims."""
        client = self._client(region)
        try:
            while not self._serving_early:
                if await _serving(client):
                    self._serving_early = self.clock()
                    self.log(f"nemesis: {region} serves claims before it could catch up")
                await asyncio.sleep(0.2)
        finally:
            await client.close()

    def _client(self, region: str) -> AsyncClient:
        """The nemesis's own look at ``region``'s node (closed by the caller)."""
        address = self.cluster.regions[region].address
        credentials = self.cluster.client_credentials(TESTER)
        return AsyncClient(address, timeout=1.0, retries=0, credentials=credentials)

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

    async def _until_settled(self, region: str) -> float:
        """After a pause: ask the woken node whether it decides claims every 0.1 s,
        until it says it does having said once that it did not (it settles with its
        peers after a nap), or NAP_NOTICE_S passed without it ever saying so. The
        run-clock moment the last "not deciding" was asked (0 if none): it decided
        nothing before then (the flag only turns on once after a nap)."""
        client = self._client(region)
        began, settling_until = time.monotonic(), 0.0
        try:
            while time.monotonic() - began < RECOVER_LIMIT_S:
                asked = self.clock()
                try:
                    serving = (await client.info()).claims_serving
                except FencemarkError:
                    serving = None  # no answer says nothing
                if serving is False:
                    settling_until = asked
                elif serving and (settling_until or time.monotonic() - began > NAP_NOTICE_S):
                    break
                await asyncio.sleep(0.1)
        finally:
            await client.close()
        return settling_until

    async def _until_deciding(self, region: str) -> float:
        """Seconds until a restarted node serves claims again (after catch-up), bounded."""
        client = self._client(region)
        try:
            return await wait_for(
                f"{region} serving claims", lambda: _serving(client), RECOVER_LIMIT_S
            )
        finally:
            await client.close()


def watcher_done(task: asyncio.Task[None] | None) -> None:
    if task is not None:
        task.cancel()


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

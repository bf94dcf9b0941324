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
is a node whose disk went back in time (``rollback``), for what it forgot, and a
second process started from a copy of a live node's data directory (``twin``)
and its original, both at once.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from docker.errors import DockerException

from fencemark.client import AsyncClient, FencemarkError, NodeInfo
from fencemark.node.replication.tuning import TWIN_FORGET_S
from fencemark.node.tools.proxy import ProxyMesh
from tests.chaos.cluster import PEER_PORT, ChaosCluster, Region
from tests.chaos.forger import Forger, Pushed
from tests.chaos.workload import TESTER, StallingAgent

FLOOD = "flood"  # a bridge while a flood of silent connections holds the victim's peer port
PARTITIONS = ("isolate", "halves", "bridge", FLOOD)
DISK_LOSSES = ("wipe", "wipe-restart")
ROOT = Path(__file__).resolve().parents[2]
ROLLBACK = "rollback"
TWIN = "twin"
# Faults after which a node's data file may lack writes it acknowledged: all of them
# (a lost disk), or those made after a copy it was put back to (its disk went back
# in time). A write acknowledged by it may be gone with them unless it had time to
# pass it on (claims.disk_lost_at).
DISK_FAULTS = (*DISK_LOSSES, ROLLBACK)
KINDS = (*PARTITIONS, "kill", *DISK_LOSSES, "pause", "agent-pause", "loss", "slow", "forge",
         ROLLBACK, TWIN)  # fmt: skip
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
# flood: silent connections kept open to the victim's peer listener from the host, and
# how long the flood outlasts the heal (the peers it was cut from reach it through it).
FLOOD_SOCKETS = 500
FLOOD_AFTER_HEAL_S = 3.0
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
# twin: how long the second process runs from its first answer until it is killed.
# Longer than settle_s (4 s: docs/replication.md, *Twins*) with its slack, so that a
# copy its peers did not refuse would have settled and decided by then.
TWIN_SECONDS = (6.0, 8.0)
TWIN_ANSWER_LIMIT_S = 30.0  # a twin's container answers within this (else it is stopped)
TWIN_POLL_S = 0.2  # how often the twin and its original are asked whether they decide
# Once the twin is stopped, its original decides again when its peers have forgotten
# the twin's life (TWIN_FORGET_S after they last heard it) and it has caught up with
# every one of them: that must happen within TWIN_CATCH_UP_S more (checker,
# availability), and the nemesis waits for it at most TWIN_RECOVER_LIMIT_S.
TWIN_CATCH_UP_S = 15.0
TWIN_RECOVER_LIMIT_S = TWIN_FORGET_S + 30.0
# How a node says a peer refused it as a twin (the TWIN_NODE refusal's message, in
# Info's per-peer last_error), and how a node's log says its file is behind its own
# writes a peer holds (the rollback alarm: docs/replication.md).
TWIN_REFUSAL = "two live processes"
ROLLBACK_ALARM = b"holds writes this node made that its data file does not remember"


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
    # twin (copied_at: when the copy it started from was taken; serving_early: when the
    # twin said it served claims, 0: never): when the twin first answered, when it was
    # killed, and when its original decided claims again after it (0: not within
    # TWIN_RECOVER_LIMIT_S).
    twin_answered: float = 0.0
    twin_stopped: float = 0.0
    deciding_again: float = 0.0


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

    def twinned(
        self, region: str, twin: str, twin_gone: asyncio.Event, until: asyncio.Event
    ) -> None:
        """Ask a twin of ``region``'s node (at ``twin``, an address) for claims until
        ``twin_gone``, and the original for the same meanwhile, until ``until``."""


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
    if kind in ("bridge", FLOOD):
        a, b = rng.sample(regions, 2)
        return Fault(kind, (a, b), span, gap)  # a and b apart; both still reach the rest
    if kind in ("kill", "wipe"):
        return Fault(kind, (rng.choice(regions),), round(rng.uniform(*DOWN_SECONDS), 2), gap)
    if kind == ROLLBACK:
        return Fault(kind, (rng.choice(regions),), round(rng.uniform(*ROLLBACK_SECONDS), 2), gap)
    if kind == TWIN:
        return Fault(kind, (rng.choice(regions),), round(rng.uniform(*TWIN_SECONDS), 2), gap)
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
    if fault.kind in ("bridge", FLOOD):
        return [(fault.targets[0], fault.targets[1])]
    half = 1 if fault.kind == "isolate" else len(fault.targets) // 2
    return [(a, b) for a in fault.targets[:half] for b in fault.targets[half:]]


class Nemesis:
    """Plays a schedule against the cluster, the host-side mesh and the agents."""

    def __init__(
        self,
        cluster: ChaosCluster,
        mesh: ProxyMesh,
        agents: Sequence[StallingAgent],
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
        self._twin_answered = self._twin_stopped = self._deciding_again = 0.0

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
            self._twin_answered = self._twin_stopped = self._deciding_again = 0.0
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
                                copied_at=self._copied_at, twin_answered=self._twin_answered,
                                twin_stopped=self._twin_stopped)  # fmt: skip
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
                    twin_answered=self._twin_answered,
                    twin_stopped=self._twin_stopped,
                    deciding_again=self._deciding_again,
                )
            )
            self.log(f"nemesis: {fault.kind} healed{': ' + detail if detail else ''}")

    async def _inject(self, fault: Fault) -> str:
        region = fault.targets[0]
        if fault.kind in PARTITIONS:
            flood = await self._flood(region) if fault.kind == FLOOD else None
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
                if flood is not None:  # the peers come back through the flooded port
                    await asyncio.sleep(FLOOD_AFTER_HEAL_S)
                    note = await _end_flood(flood)
            return note if flood is not None else ""
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
        if fault.kind == TWIN:
            return await self._twin(fault)
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
            return await self._agent_pause(fault)
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

    async def _flood(self, region: str) -> asyncio.subprocess.Process:
        """``python -m tests.floods`` against ``region``'s peer listener, from the host:
        FLOOD_SOCKETS silent connections, re-opened as they are closed, until stopped."""
        target = f"{await asyncio.to_thread(self.cluster.ip, region)}:{PEER_PORT}"
        flood = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.floods", f"--target={target}",
            f"--sockets={FLOOD_SOCKETS}", "--seconds=600",
            stdout=asyncio.subprocess.PIPE, cwd=ROOT,
        )  # fmt: skip
        assert flood.stdout is not None
        async with asyncio.timeout(30):
            said = await flood.stdout.readline()
        if said.strip() != b"flooding":
            flood.kill()
            await flood.wait()
            raise RuntimeError(f"the flood of {target} did not start: {said!r}")
        return flood

    async def _agent_pause(self, fault: Fault) -> str:
        """The agent stalls after its next grant until its lease has lapsed and someone
        else holds the item (or 10 s), then writes and renews with its old token; the
        nemesis waits until it woke (bounded). What it was told is judged by invariant
        1 from the history (``claim_invariants.stale_wakes``)."""
        agent = self.agents[fault.targets[0]]
        woken = agent.stalls
        agent.paused_refusal = None
        agent.pause_once = True
        deadline = time.monotonic() + fault.seconds + 20
        while agent.stalls == woken:
            if time.monotonic() > deadline:
                agent.pause_once = False  # not stalled yet: not later, in another fault
                return f"{agent.name} did not stall and wake within the fault's time"
            await asyncio.sleep(0.2)
        key, token = agent.last_stall
        return (
            f"{agent.name} stalled on {key.rsplit('/', 1)[-1]} (token {token}), woke and was"
            f" told {agent.paused_refusal}"
        )

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
        files = await self._frozen_copy(region, copy)
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

    async def _frozen_copy(self, region: str, copy: Path) -> int:
        """A crash-consistent copy of ``region``'s data directory into ``copy``, the node
        frozen meanwhile (as a disk snapshot of a running machine holds it); how many
        files. ``_copied_at``: what the node acknowledged before it is on the copy."""
        self._copied_at = self.clock()
        await self._retry(self.cluster.pause, region)
        try:
            return await asyncio.to_thread(self.cluster.copy_data, region, copy)
        finally:
            await asyncio.to_thread(self.cluster.unpause, region)

    async def _twin(self, fault: Fault) -> str:
        """A twin: a crash-consistent copy of the node's data directory (frozen for it,
        as ``rollback`` takes it), started as a second container beside the original,
        which goes on running — same region, node certificate and peers, its own alias
        and port. Both are pressed with claims (``Shapes.twinned``) while the twin runs
        for ``fault.seconds`` from its first answer; then it is killed and removed. The
        peers hear two lives of one node id and refuse both (``TWIN_NODE``): the twin
        must never decide, the original stops deciding until the peers have forgotten
        the twin's life and it has caught up; the nemesis waits for that (bounded) and
        presses the original ``PRESS_AFTER_S`` more. Both are polled meanwhile
        (``TwinWatch``): whether the twin ever says it serves claims (``serving_early``:
        it must not), when the original stopped, and when each heard a peer refuse it."""
        region = fault.targets[0]
        copy = self.cluster.root / "twin" / f"{region}-{len(self.played)}"
        files = await self._frozen_copy(region, copy)
        twin_gone, pressed = asyncio.Event(), asyncio.Event()
        notes = [f"{region} copied at {self._copied_at:.1f} s ({files} files)"]
        try:
            await self._twin_life(region, copy, fault.seconds, twin_gone, pressed, notes)
            try:
                took = await self._until_deciding(region, TWIN_RECOVER_LIMIT_S)
            except TimeoutError:
                notes.append(f"{region} NOT deciding claims again {TWIN_RECOVER_LIMIT_S:.0f} s"
                             " after the twin was killed")  # fmt: skip
            else:
                self._deciding_again = self.clock()
                notes.append(f"{region} deciding claims again {took:.1f} s after the twin was"
                             " killed")  # fmt: skip
                await asyncio.sleep(PRESS_AFTER_S)
        finally:
            twin_gone.set()
            pressed.set()
        return "; ".join(notes)

    async def _twin_life(
        self,
        region: str,
        copy: Path,
        seconds: float,
        twin_gone: asyncio.Event,
        pressed: asyncio.Event,
        notes: list[str],
    ) -> None:
        """Start the twin from ``copy``, have both pressed, let it run ``seconds`` from
        its first answer, kill and remove it (whatever happens); ``notes`` for the
        report."""
        seen = TwinWatch()
        twin: Region | None = None
        watcher: asyncio.Task[None] | None = None
        output = b""
        try:
            twin = await asyncio.to_thread(self.cluster.start_twin, region, copy)
            if self.shapes is not None:
                self.shapes.twinned(region, twin.address, twin_gone, pressed)
            watcher = asyncio.create_task(self._watch_twin(region, twin.address, seen))

            async def answered() -> bool:
                return bool(self._twin_answered)

            try:
                await wait_for(f"the twin of {region} answering", answered, TWIN_ANSWER_LIMIT_S)
            except TimeoutError:
                notes.append(f"its twin {twin.name} never answered")
            else:
                await asyncio.sleep(seconds)
        finally:
            watcher_done(watcher)
            twin_gone.set()
            if twin is not None:
                self._twin_stopped = self.clock()  # the kill is the first thing stop_twin does
                output = await asyncio.to_thread(self.cluster.stop_twin, twin)
        if twin is not None and self._twin_answered:
            notes.append(f"its twin {twin.name} answered at {self._twin_answered:.1f} s,"
                         f" killed at {self._twin_stopped:.1f} s")  # fmt: skip
        if self._serving_early:
            notes.append(f"THE TWIN SERVED CLAIMS at {self._serving_early:.1f} s")
        notes.extend(seen.notes(region, output))

    async def _watch_twin(self, region: str, twin: str, seen: TwinWatch) -> None:
        """Poll a twin and its original every ``TWIN_POLL_S`` into ``seen``; note when
        the twin first answers (``_twin_answered``) and whether it ever says it serves
        claims (``_serving_early``: a connected copy must not)."""
        copy, original = self._client(address=twin), self._client(region)
        try:
            while True:
                try:
                    info = await copy.info()
                except FencemarkError:
                    pass
                else:
                    if not self._twin_answered:
                        self._twin_answered = self.clock()
                    if info.claims_serving and not self._serving_early:
                        self._serving_early = self.clock()
                        self.log(f"nemesis: the twin of {region} says it serves claims")
                    seen.refusals(seen.twin, info, self.clock())
                if self._twin_answered:
                    try:
                        info = await original.info()
                    except FencemarkError:
                        pass
                    else:
                        if not info.claims_serving and not seen.stopped:
                            seen.stopped = self.clock()
                        seen.refusals(seen.original, info, self.clock())
                await asyncio.sleep(TWIN_POLL_S)
        finally:
            await copy.close()
            await original.close()

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

    def _client(self, region: str = "", address: str = "") -> AsyncClient:
        """The nemesis's own look at ``region``'s node, or the one at ``address``
        (closed by the caller)."""
        address = address or self.cluster.regions[region].address
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

    async def _until_deciding(self, region: str, limit: float = RECOVER_LIMIT_S) -> float:
        """Seconds until a restarted node serves claims again (after catch-up), bounded."""
        client = self._client(region)
        try:
            return await wait_for(f"{region} serving claims", lambda: _serving(client), limit)
        finally:
            await client.close()


@dataclass
class TwinWatch:
    """What the nemesis saw of a twin and its original (``Nemesis._watch_twin``), run
    clock: when the original first said it decides no claims after the twin answered,
    and for each process, when it first named a peer's refusal as a twin (that peer's
    ``last_error`` in ``Info``: the ``TWIN_NODE`` refusal's message)."""

    stopped: float = 0.0
    original: dict[str, float] = field(default_factory=dict)
    twin: dict[str, float] = field(default_factory=dict)

    @staticmethod
    def refusals(into: dict[str, float], info: NodeInfo, now: float) -> None:
        for peer in info.peers:
            if TWIN_REFUSAL in peer.last_error:
                into.setdefault(peer.region, now)

    def notes(self, region: str, output: bytes) -> list[str]:
        """The report's words for it; ``output`` is the twin's log, which says how often
        its own file was found behind its peers' states of its writes (its original
        wrote on after the copy: the rollback alarm, which catches a copy too)."""

        def refused(by: dict[str, float]) -> str:
            named = ", ".join(f"{peer} at {at:.1f} s" for peer, at in sorted(by.items()))
            return f"refused as a twin by {named}" if by else "no refusal as a twin seen"

        behind = output.count(ROLLBACK_ALARM)
        return [
            f"{region} {refused(self.original)}",
            f"{region} stopped deciding at {self.stopped:.1f} s"
            if self.stopped
            else f"{region} never said it stopped deciding",
            f"the twin {refused(self.twin)}"
            + (f", and found its file behind its own writes {behind} times" if behind else ""),
        ]


async def _end_flood(flood: asyncio.subprocess.Process) -> str:
    """Stop a flood; what it did, in words."""
    assert flood.stdout is not None
    if flood.returncode is None:
        flood.terminate()
    out, _ = await flood.communicate()
    tallies = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
    return "; ".join(
        f"{t['target']} flooded: {t['opened']} silent connections, {t['closed']} closed by"
        f" the node, {t['failed']} refused"
        for t in tallies
    )


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

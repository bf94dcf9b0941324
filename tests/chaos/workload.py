"""What runs against the chaos cluster while the nemesis breaks it, and what it records.

- Agents (``fencemark.node.tools.workload.Agent``), several per region: claim a todo
  item (routed to its home region), write fenced progress (each write to a
  field of its own), renew, finish, release. The nemesis stalls one now and
  then past its lease (``agent-pause``, :class:`StallingAgent`). A region's
  agents reach their own node directly and other regions through a host-side
  :class:`ProxyMesh`, which the nemesis cuts along with the nodes' links, so a
  partition separates agents from remote homes as it separates the nodes.
- Holders, one per region: the same agents, but each keeps its claim for
  several leases (more steps, slower), renewing as it goes: the claims that
  ``shapes.py``'s meddlers write around.
- A producer that keeps the backlog topped up, creating items at their home.
- A prober per region, straight at its own node: a read, an unfenced write to
  an unclaimed record (each to a field of its own), and a home-only call that
  the region must refuse (a claim on a record homed elsewhere, without routing).
- A sampler: once a second, how many records each region is behind on, for the
  convergence timeline.

Every client speaks mutual TLS with a client certificate of the run's CA: each
agent and holder its own identity (its name: a claim is bound to the identity it
was granted to, docs/security.md), everything else the one identity ``chaos``.

Every operation lands in one :class:`History` (invoke/ok/fail/unknown, with its
start and end on the run's monotonic clock). ``shapes.py`` adds what the agents
never do: ids born on both sides of a partition, unfenced writes around live
claims, claims at a node that is catching up.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import grpc

from fencemark.client import (
    AsyncClient,
    ClaimConflict,
    ClaimResult,
    FencemarkError,
    Record,
    Unavailable,
)
from fencemark.node.tools.proxy import ProxyMesh
from fencemark.node.tools.workload import REPO, TAG, TOPIC, Agent, Event, History

NOTES_TOPIC = "notes"
TESTER = "chaos"  # the client identity of every test-side client that is not an agent
CALL_TIMEOUT_S = 2.0  # an agent's deadline per call: no call of theirs hangs longer
# A probe's deadline. Availability is about answering at all, not latency: on
# this shared 2-core machine one fsync can stall every container for a second or two.
PROBE_TIMEOUT_S = 5.0
SAMPLE_TIMEOUT_S = 1.0
PROBE_INTERVAL_S = 0.25
NOTES_PER_RECORD = 100  # then a probe starts a new note record (MAX_FIELDS is 256)
SAMPLE_INTERVAL_S = 1.0
AGENT_STEPS = 2  # an agent's fenced writes per claim, each followed by a renewal
HOLDER_STEPS = 8  # a holder's
HOLDER_WORK_S = 0.6  # between them: a claim held about three 2 s leases


class StallingAgent(Agent):
    """An agent the nemesis stalls past its lease (``agent-pause``: ``pause_once``).
    While it stalls, ``stalled_on`` names the item it holds (the meddlers leave that
    item alone: deleted, it would refuse the woken worker ``missing``, which tests no
    fencing); ``stalls`` counts the stalls it woke from, the latest on ``last_stall``
    (key, token)."""

    stalled_on = ""
    stalls = 0
    last_stall: tuple[str, int] = ("", 0)

    async def _pause_past_lease(self, key: str, token: int) -> None:
        self.stalled_on, self.last_stall = key, (key, token)
        try:
            await super()._pause_past_lease(key, token)
        finally:
            self.stalled_on = ""
            self.stalls += 1


@dataclass
class Sample:
    """One look at every region: records it is behind on (None: it did not answer)."""

    at: float
    divergent: dict[str, int | None]


@dataclass
class Workload:
    addresses: Mapping[str, str]  # region -> the node's published address
    mesh: ProxyMesh  # host-side links from each region to the others' nodes
    history: History
    rng: random.Random
    # A client identity's mutual TLS credentials (ChaosCluster.client_credentials).
    credentials: Callable[[str], grpc.ChannelCredentials]
    lease_seconds: float = 2.0
    agents_per_region: int = 2
    backlog: int = 12  # todo items the producer keeps available
    homes: dict[str, str] = field(default_factory=dict)  # key -> home region
    notes: dict[str, str] = field(default_factory=dict)  # region -> its note record's key
    samples: list[Sample] = field(default_factory=list)
    agents: list[StallingAgent] = field(default_factory=list)
    holders: list[StallingAgent] = field(default_factory=list)  # agents that keep claims for long
    _clients: list[AsyncClient] = field(default_factory=list)
    _created: int = 0

    @property
    def regions(self) -> list[str]:
        return sorted(self.addresses)

    def now(self) -> float:
        return time.monotonic() - self.history.started

    def client(
        self,
        region: str,
        *,
        routed: bool = False,
        timeout: float = CALL_TIMEOUT_S,
        retries: int = 0,
        identity: str = TESTER,
    ) -> AsyncClient:
        """A client at ``region``'s node, with ``identity``'s certificate; ``routed``
        reaches other homes through the mesh."""
        routes = {region: self.addresses[region], **self.mesh.peers(region)} if routed else None
        made = AsyncClient(
            self.addresses[region],
            regions=routes,
            timeout=timeout,
            retries=retries,
            credentials=self.credentials(identity),
        )
        self._clients.append(made)
        return made

    async def close(self) -> None:
        for made in self._clients:
            await made.close()

    def record(
        self,
        who: str,
        op: str,
        key: str,
        outcome: str,
        invoked: float,
        detail: str = "",
        value: str = "",
        token: int = 0,
    ) -> None:
        """Add an operation that ends now to the history (``invoked``: monotonic)."""
        self.history.add(
            Event(who, op, key, token, outcome, invoked, time.monotonic(), detail, value)
        )

    # -- setup -----------------------------------------------------------------------

    async def prepare(self) -> None:
        """A note record per region (never claimed), and the first backlog."""
        for region in self.regions:
            key = await self._new_notes(self.client(region, retries=4), region, 0)
            assert key is not None, f"could not create {region}'s first note record"
            self.notes[region] = key
        direct = {region: self.client(region, retries=4) for region in self.regions}
        for _ in range(self.backlog):
            await self._create(direct)
        self.agents = [
            self._agent(f"{region}-agent-{i}", region, AGENT_STEPS, 0.1)
            for region in self.regions
            for i in range(self.agents_per_region)
        ]
        self.holders = [
            self._agent(f"{region}-holder-0", region, HOLDER_STEPS, HOLDER_WORK_S)
            for region in self.regions
        ]

    def _agent(self, name: str, region: str, steps: int, work_seconds: float) -> StallingAgent:
        """An agent of ``region`` with a client certificate of its own (its name)."""
        return StallingAgent(
            name,
            region,
            self.client(region, routed=True, retries=2, identity=name),
            self.history,
            lease_seconds=self.lease_seconds,
            steps=steps,
            work_seconds=work_seconds,
            seed=self.rng.randrange(1 << 30),
        )

    async def _new_notes(self, node: AsyncClient, region: str, index: int) -> str | None:
        """Create ``region``'s ``index``-th note record at its own node; its key, or None."""
        name = f"notes-{region}-{index}"
        invoked = time.monotonic()
        try:
            made = await node.remember(REPO, NOTES_TOPIC, name, title=f"notes kept in {region}",
                                       tags=[f"homeRegion:{region}"])  # fmt: skip
        except FencemarkError as exc:
            self.record(f"probe-{region}", "create", name, outcome_of(exc), invoked,
                        detail_of(exc), region)  # fmt: skip
            return None
        self.homes[made.record.key] = region
        self.record(f"probe-{region}", "create", made.record.key, "ok", invoked, region)
        return made.record.key

    async def _create(self, direct: Mapping[str, AsyncClient]) -> None:
        home = self.regions[self._created % len(self.regions)]
        name = f"item-{self._created:05d}"
        self._created += 1
        invoked = time.monotonic()
        try:
            made = await direct[home].remember(
                REPO,
                TOPIC,
                name,
                kind="Task",
                author="chaos",
                title=f"Backlog item {name}",
                fields={"status": "todo"},
                tags=[TAG, f"homeRegion:{home}"],
            )
        except FencemarkError as exc:  # acknowledged: the region; otherwise why, and the region
            self.record("producer", "create", name, outcome_of(exc), invoked, detail_of(exc), home)
            return
        self.homes[made.record.key] = home
        self.record("producer", "create", made.record.key, "ok", invoked, home)

    # -- the concurrent parts --------------------------------------------------------

    def tasks(self, stop: asyncio.Event) -> list[asyncio.Task[None]]:
        return [
            *(asyncio.create_task(agent.run(stop)) for agent in (*self.agents, *self.holders)),
            asyncio.create_task(self._produce(stop)),
            *(asyncio.create_task(self._probe(region, stop)) for region in self.regions),
            asyncio.create_task(self._sample(stop)),
        ]

    async def _produce(self, stop: asyncio.Event) -> None:
        direct = {region: self.client(region) for region in self.regions}
        while not await stopped(stop, 0.5):
            todo = None
            for region in self.rng.sample(self.regions, len(self.regions)):
                with contextlib.suppress(FencemarkError):
                    listing = direct[region].iter_records(REPO, topic=TOPIC, tag=TAG)
                    todo = sum([r.fields.get("status") != "done" async for r in listing])
                    break
            for _ in range(max(0, self.backlog - todo) if todo is not None else 0):
                await self._create(direct)

    async def _probe(self, region: str, stop: asyncio.Event) -> None:
        """Reads, unfenced writes and a refused home-only call, at ``region``'s node only."""
        node = self.client(region, timeout=PROBE_TIMEOUT_S)
        who = f"probe-{region}"
        elsewhere = self.notes[self.regions[(self.regions.index(region) + 1) % len(self.regions)]]
        n = written = records = 0
        while not await stopped(stop, PROBE_INTERVAL_S):
            if written >= NOTES_PER_RECORD:  # a record holds at most 256 fields: a new one
                made = await self._new_notes(node, region, records + 1)
                if made is not None:
                    self.notes[region], written, records = made, 0, records + 1
            key = self.notes[region]
            invoked = time.monotonic()
            try:
                await node.get(key)
                self.record(who, "probe-read", key, "ok", invoked)
            except FencemarkError as exc:
                self.record(who, "probe-read", key, outcome_of(exc), invoked, detail_of(exc))
            n += 1
            name, value = f"note.{region}.{n}", f"{region}:{n}"
            invoked = time.monotonic()
            try:
                await node.update(key, fields={name: value})
                self.record(who, "note", key, "ok", invoked, name, value)
                written += 1
            except FencemarkError as exc:  # the reason as the detail, the field as the value
                self.record(who, "note", key, outcome_of(exc), invoked, detail_of(exc), name)
            invoked = time.monotonic()
            try:
                claimed = await node.claim(elsewhere, who, lease_seconds=self.lease_seconds)
                outcome = "ok" if claimed.granted else "fail"
                self.record(who, "probe-home-only", elsewhere, outcome, invoked, _reason(claimed))
            except FencemarkError as exc:
                self.record(
                    who, "probe-home-only", elsewhere, outcome_of(exc), invoked, detail_of(exc)
                )

    async def _sample(self, stop: asyncio.Event) -> None:
        readers = {region: self.client(region, timeout=SAMPLE_TIMEOUT_S) for region in self.regions}
        while not await stopped(stop, SAMPLE_INTERVAL_S):
            self.samples.append(await self.sample(readers))

    async def sample(self, readers: Mapping[str, AsyncClient]) -> Sample:
        sample, _ = await self.look(readers)
        return sample

    async def look(
        self, readers: Mapping[str, AsyncClient]
    ) -> tuple[Sample, dict[str, dict[str, Record] | None]]:
        """Every region's records (None: it did not answer), and the sample they make."""
        at = self.now()
        seen: dict[str, dict[str, Record] | None] = {}
        for region, reader in readers.items():
            try:
                seen[region] = await all_records(reader)
            except FencemarkError:
                seen[region] = None
        views = {r: None if records is None else versions(records) for r, records in seen.items()}
        return Sample(at, divergence(views)), seen


Version = tuple[float, bytes]  # a record at one region: (updated_at, digest)


def divergence(views: Mapping[str, Mapping[str, Version] | None]) -> dict[str, int | None]:
    """Per region: records it lacks or holds in an older version than another region does.

    The newest version of a record is the largest ``(updated_at, digest)`` any
    answering region holds; a region that holds it is not behind on that
    record. All zero means byte-identical (``None``: the region did not answer).
    """
    answered = [view for view in views.values() if view is not None]
    newest: dict[str, Version] = {}
    for view in answered:
        for key, version in view.items():
            newest[key] = max(newest.get(key, version), version)
    return {
        region: None
        if view is None
        else sum(view.get(key) != version for key, version in newest.items())
        for region, view in views.items()
    }


def versions(records: Mapping[str, Record]) -> dict[str, Version]:
    return {
        key: (r.updated_at.timestamp() if r.updated_at else 0.0, r.digest)
        for key, r in records.items()
    }


async def all_records(client: AsyncClient) -> dict[str, Record]:
    listing = client.iter_records(REPO, include_deleted=True)
    return {record.key: record async for record in listing}


async def stopped(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep ``seconds`` unless ``stop`` is set first; whether it is set."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
    return stop.is_set()


def outcome_of(exc: FencemarkError) -> str:
    return "unknown" if isinstance(exc, Unavailable) else "fail"


def detail_of(exc: FencemarkError) -> str:
    if isinstance(exc, ClaimConflict):
        return exc.reason
    if isinstance(exc, Unavailable) and exc.code is not None:
        return exc.code.name
    return type(exc).__name__


def _reason(result: ClaimResult) -> str:
    return result.reason or ("granted" if result.granted else "")

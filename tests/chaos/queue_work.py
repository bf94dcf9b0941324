"""The workload's work queue (SPEC §8): items taken with ``ClaimNext``, not by key.

Its own topic (``QUEUE_TOPIC``, apart from the backlog ``workload.py``'s agents
claim by key, so that what those invariants judge keeps its meaning):

- **Queue agents**, two per region (``fencemark.node.tools.workload.QueueAgent``,
  the same as ``fencemark demo``'s), each with a client certificate of its own and a
  routed client: ``ClaimNext`` asks their own region's node first, then the
  others', then waits a little at their own node. A claim's holder writes fenced
  progress once, renews, and releases it ``done`` with a ``result`` field of its
  own (``done by <agent>@<token>``), in one commit under the token. A region cut off
  from the others drains the items homed there; the others' are out of its reach.
- **A queue producer** per region: a small batch of items at their home every few
  seconds, with priorities ``P0``-``P3`` (one in five untagged: last), while its
  region has fewer than ``QUEUE_OPEN`` open as far as the history shows.
- **A poison item** per region (tags ``poison`` and ``maxAttempts:2``): its agent
  releases it ``failed`` every time, so its second failure parks it.
- **An operator** (the identity ``operator``, the one the run's access map lets
  ``operate``): now and then it reopens a parked item, or one time in four a done
  one, as its node lists them (``Claims.Reopen``, routed to the home), so that an
  item may legitimately be done again after a reopen. The history records each
  reopen (value: the status the operator saw).

Invariant 12 (``queue_invariants.py``) judges it; its grants and writes feed the
claim invariants like every other claim's.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

from fencemark.client import AsyncClient, FencemarkError
from fencemark.node.tools.workload import POISON, POISON_ATTEMPTS, REPO, QueueAgent
from tests.chaos.cluster import OPERATOR
from tests.chaos.workload import Workload, detail_of, outcome_of, stopped

QUEUE_TOPIC = QUEUE_TAG = "queue"
AGENTS_PER_REGION = 2
STEPS = 1  # fenced writes (each followed by a renewal) before the release done
WORK_S = 0.3
WAIT_S = 1.0  # how long ClaimNext may wait at the agent's own node when none has an item
BATCH = 2  # items a region's queue producer creates at a time, this often:
BATCH_INTERVAL_S = 3.0
QUEUE_OPEN = 4  # unless its region has this many open already, as far as it knows
PRIORITIES = 4  # priority:P0 .. P3, and one item in five untagged (last)
OPERATOR_INTERVAL_S = 2.5
REOPEN_DONE_SHARE = 0.25  # how often the operator reopens a done item, not a parked one
PRODUCER = "queue-producer"


def queue_key(name: str) -> str:
    return f"repo/{REPO}/mem/{QUEUE_TOPIC}/{name}"


def is_queued(key: str) -> bool:
    return f"/mem/{QUEUE_TOPIC}/" in key


class QueueWork:
    """The work queue's agents, producers and operator, into the workload's history."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.history = workload.history
        self.agents: list[QueueAgent] = []
        self._seed = workload.rng.randrange(1 << 30)
        self._created: Counter[str] = Counter()  # region -> items it created
        self._open: Counter[str] = Counter()  # region -> open items, as the history says
        self._read = 0  # history events counted into ``_open``

    async def prepare(self) -> None:
        """Per region its poison item, a first batch, and its queue agents."""
        workload, rng = self.workload, random.Random(self._seed)
        for region in workload.regions:
            node = workload.client(region, retries=4)
            await self._enqueue(node, region, poison=True)
            for _ in range(BATCH):
                await self._enqueue(node, region, rng=rng)
        self.agents = [
            QueueAgent(
                name, region,
                workload.client(region, routed=True, retries=2, identity=name),
                self.history, lease_seconds=workload.lease_seconds, steps=STEPS,
                work_seconds=WORK_S, seed=rng.randrange(1 << 30),
            ).asking(QUEUE_TOPIC, (QUEUE_TAG,), WAIT_S)
            for region in workload.regions
            for name in (f"{region}-queue-{i}" for i in range(AGENTS_PER_REGION))
        ]  # fmt: skip

    def tasks(self, stop: asyncio.Event) -> list[asyncio.Task[None]]:
        regions = self.workload.regions
        return [
            *(asyncio.create_task(agent.run(stop)) for agent in self.agents),
            *(asyncio.create_task(self._produce(region, stop)) for region in regions),
            asyncio.create_task(self._operate(stop)),
        ]

    async def _enqueue(
        self,
        node: AsyncClient,
        region: str,
        *,
        poison: bool = False,
        rng: random.Random | None = None,
    ) -> None:
        """Create a queue item at ``region``'s node, its home: a priority drawn from
        ``rng`` (without: last), or the region's poison item."""
        if poison:
            name, order = f"{POISON}-{region}", [POISON, f"maxAttempts:{POISON_ATTEMPTS}"]
        else:
            name = f"q-{region}-{self._created[region]:05d}"
            self._created[region] += 1
            level = rng.randrange(PRIORITIES + 1) if rng else PRIORITIES
            order = [f"priority:P{level}"] if level < PRIORITIES else []
        key = queue_key(name)
        # Its tag names its home: a creation whose outcome is unknown is homed there too.
        self.workload.homes[key] = region
        invoked = time.monotonic()
        try:
            await node.remember(REPO, QUEUE_TOPIC, name, kind="Task", author="chaos",
                                title=f"Queue item {name}",
                                tags=[QUEUE_TAG, f"homeRegion:{region}", *order])  # fmt: skip
        except FencemarkError as exc:
            self.workload.record(PRODUCER, "create", key, outcome_of(exc), invoked,
                                 detail_of(exc), region)  # fmt: skip
            return
        self._open[region] += not poison
        self.workload.record(PRODUCER, "create", key, "ok", invoked, region)

    def _count_ends(self) -> None:
        """Count the releases done, and the reopens of done items, since the last look."""
        events, homes = self.history.events, self.workload.homes
        for event in events[self._read :]:
            if event.outcome != "ok" or not is_queued(event.key):
                continue
            if event.op == "done":
                self._open[homes.get(event.key, "")] -= 1
            elif event.op == "reopen" and event.value == "done":
                self._open[homes.get(event.key, "")] += 1
        self._read = len(events)

    async def _produce(self, region: str, stop: asyncio.Event) -> None:
        """Every ``BATCH_INTERVAL_S``, a batch of items at ``region``'s node, unless it
        has ``QUEUE_OPEN`` open already."""
        rng = random.Random(self._seed + 1 + self.workload.regions.index(region))
        node = self.workload.client(region)
        while not await stopped(stop, BATCH_INTERVAL_S):
            self._count_ends()
            for _ in range(min(BATCH, QUEUE_OPEN - self._open[region])):
                await self._enqueue(node, region, rng=rng)

    async def _operate(self, stop: asyncio.Event) -> None:
        """Now and then reopen a parked item, or a done one, as the operator's node
        lists them; the item's home decides (the client routes the call there)."""
        workload, rng = self.workload, random.Random(self._seed - 1)
        node = workload.client(workload.regions[0], routed=True, identity=OPERATOR)
        while not await stopped(stop, OPERATOR_INTERVAL_S):
            try:
                items = [r async for r in node.iter_records(REPO, topic=QUEUE_TOPIC)]
            except FencemarkError:
                continue
            parked = [r for r in items if r.status == "parked"]
            done = [r for r in items if r.status == "done"]
            pool = done if done and (not parked or rng.random() < REOPEN_DONE_SHARE) else parked
            if not pool:
                continue
            item = rng.choice(pool)
            invoked = time.monotonic()
            try:
                answer = await node.reopen(item.key, f"{OPERATOR}: a {item.status} item, again")
            except FencemarkError as exc:
                workload.record(OPERATOR, "reopen", item.key, outcome_of(exc), invoked,
                                detail_of(exc), item.status)  # fmt: skip
                continue
            outcome = "ok" if answer.reopened else "fail"
            workload.record(OPERATOR, "reopen", item.key, outcome, invoked, answer.reason,
                            item.status)  # fmt: skip

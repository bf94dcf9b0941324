"""Agents that drain a backlog with claims, a history of what they did, and its checker.

Used by ``fencemark demo`` (and the chaos tier). Every operation is recorded
Jepsen-style: when it was invoked and completed, and whether it was
acknowledged (``ok``), refused (``fail``, with the reason) or has an unknown
outcome (``unknown``: the call failed in transit). The checker then judges the
history and the final states of every region, one invariant at a time. About
420 lines: the agents and the checker of their history are read together (each
check names the operations the agents record).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Self, TypeVar

from fencemark.client import (
    AsyncClient,
    ClaimConflict,
    ClaimNextResult,
    ClaimResult,
    FencemarkError,
    Record,
    ReleaseResult,
    RenewResult,
    Unavailable,
)
from fencemark.node.tools.feed_signal import FeedSignal

REPO, TOPIC, TAG = "lattice", "backlog", "backlog"
POISON = "poison"  # an item that fails every time it is worked on (QueueAgent)
# Operations accepted only under their token: a release done writes its fields too.
FENCED = ("write", "finish", "done", "stale-write")
T = TypeVar("T")


@dataclass(frozen=True)
class Event:
    agent: str
    # claim | write | renew | finish | release | stale-write | stale-renew; a
    # QueueAgent's claim-next | done | fail (the release with its outcome)
    op: str
    key: str
    token: int
    outcome: str  # ok | fail | unknown
    invoked: float
    completed: float
    detail: str = ""  # the refusal reason, the field written, or for a grant the granting region
    value: str = ""
    # For a granted claim or a renewal: when its lease ends as the reply said, on the
    # same monotonic clock as ``invoked`` (the nodes' clock is the host's).
    expires: float = 0.0


def monotonic_at(moment: datetime | None) -> float:
    """``moment`` (an absolute UTC time from a node) on this process's monotonic clock."""
    if moment is None:
        return 0.0
    return time.monotonic() + (moment.timestamp() - time.time())


@dataclass
class History:
    started: float = field(default_factory=time.monotonic)
    events: list[Event] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)

    def add(self, event: Event) -> None:
        self.events.append(event)
        self.counts[f"{event.op}:{event.outcome}"] += 1
        if event.outcome == "fail" and event.detail:
            self.counts[f"refused:{event.detail}"] += 1


async def recorded(
    history: History,
    who: str,
    op: str,
    key: str,
    token: int,
    call: Awaitable[T],
    *,
    detail: str = "",
    value: str = "",
) -> tuple[T | None, Event]:
    """Await ``call`` and add its event to ``history``: the result (None unless it
    completed) and the event. A claim, renewal or release that is not granted is a
    value, not an error; the history records it as the refusal it is."""
    invoked = time.monotonic()
    outcome, result, expires = "ok", None, 0.0
    try:
        result = await call
        if isinstance(result, ClaimResult | ClaimNextResult | RenewResult):
            expires = monotonic_at(result.lease_expires_at)
        if isinstance(result, ClaimResult | ClaimNextResult | RenewResult | ReleaseResult) and not (
            getattr(result, "granted", False)
            or getattr(result, "renewed", False)
            or getattr(result, "released", False)
        ):
            outcome, detail = "fail", result.reason
    except ClaimConflict as exc:
        outcome, detail = "fail", exc.reason
    except Unavailable as exc:
        outcome, detail = "unknown", exc.code.name if exc.code else "unavailable"
    except FencemarkError as exc:
        outcome, detail = "fail", type(exc).__name__
    event = Event(who, op, key, token, outcome, invoked, time.monotonic(), detail, value, expires)
    history.add(event)
    return result, event


def grant_of(call: Event, claim: ClaimResult | ClaimNextResult) -> Event:
    """The grant a granted claim call made: it took effect somewhere during the call,
    at the region that answered (``detail``), with the lease the reply named."""
    key = claim.record.key if isinstance(claim, ClaimNextResult) and claim.record else call.key
    return Event(call.agent, "grant", key, claim.fencing_token, "ok", call.invoked,
                 call.completed, claim.home_region, "", call.expires)  # fmt: skip


def item_id(index: int) -> str:
    return f"item-{index:03d}"


async def seed(clients: Mapping[str, AsyncClient], items: int) -> list[str]:
    """Remember ``items`` backlog items, homed round-robin across the regions."""
    regions = sorted(clients)
    keys = []
    for index in range(items):
        home = regions[index % len(regions)]
        made = await clients[home].remember(
            REPO, TOPIC, item_id(index),
            kind="Task", author="demo", title=f"Backlog item {index}",
            fields={"status": "todo"}, tags=[TAG, f"homeRegion:{home}"],
        )  # fmt: skip
        keys.append(made.record.key)
    return keys


POISON_ATTEMPTS = 2  # the poison item's maxAttempts:N


async def seed_queue(clients: Mapping[str, AsyncClient], items: int) -> list[str]:
    """A work queue of ``items`` items homed round-robin (SPEC §8): priorities P0-P2,
    item 1 waiting on item 0 (``after:``, homed in another region), and one more
    item, ``poison``, that fails until it is parked after ``POISON_ATTEMPTS``."""
    regions = sorted(clients)
    keys = []
    for index in range(items):
        home = regions[index % len(regions)]
        order = [f"after:{item_id(0)}"] if index == 1 else [f"priority:P{index % 3}"]
        made = await clients[home].remember(
            REPO, TOPIC, item_id(index), kind="Task", author="demo",
            title=f"Backlog item {index}", tags=[TAG, f"homeRegion:{home}", *order],
        )  # fmt: skip
        keys.append(made.record.key)
    home = regions[0]
    poison = await clients[home].remember(
        REPO, TOPIC, POISON, kind="Task", author="demo", title="An item that always fails",
        tags=[TAG, f"homeRegion:{home}", POISON, f"maxAttempts:{POISON_ATTEMPTS}"],
    )  # fmt: skip
    return [*keys, poison.record.key]


class Agent:
    """Claims a random unfinished item, writes fenced progress, renews, finishes, releases."""

    def __init__(
        self,
        name: str,
        region: str,
        client: AsyncClient,
        history: History,
        *,
        lease_seconds: float,
        steps: int = 3,
        work_seconds: float = 0.05,
        pause_once: bool = False,
        seed: int = 0,
    ) -> None:
        self.name = name
        self.region = region
        self.client = client
        self.history = history
        self.lease = lease_seconds
        self.steps = steps
        self.work = work_seconds
        self.pause_once = pause_once
        self.rng = random.Random(seed)
        self.finished = 0
        self.paused_refusal: str | None = None  # what the paused worker was told
        self.last: Event | None = None  # the latest operation's event

    async def _call(self, op: str, key: str, token: int, call: Awaitable[T], **kw: str) -> T | None:
        result, self.last = await recorded(self.history, self.name, op, key, token, call, **kw)
        return result

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                todo = [r for r in await self._items() if r.fields.get("status") != "done"]
            except FencemarkError:
                await asyncio.sleep(0.2)
                continue
            if not todo:
                await asyncio.sleep(0.2)
                continue
            item = self.rng.choice(todo)
            claim = await self._call(
                "claim",
                item.key,
                0,
                self.client.claim(item.key, self.name, lease_seconds=self.lease),
            )
            if claim is None or not claim.granted:
                await asyncio.sleep(self.rng.uniform(0.02, 0.1))
                continue
            assert self.last is not None
            self.history.add(grant_of(self.last, claim))
            await self._work_on(item.key, claim.fencing_token)

    async def _items(self) -> list[Record]:
        return [r async for r in self.client.iter_records(REPO, topic=TOPIC, tag=TAG)]

    async def _work_on(self, key: str, token: int) -> None:
        if self.pause_once:
            self.pause_once = False
            await self._pause_past_lease(key, token)
            return
        for step in range(self.steps):
            name, value = f"progress.{self.name}.{token}.{step}", f"{self.name}@{token}"
            write = self.client.update(key, fields={name: value}, fencing_token=token)
            if await self._call("write", key, token, write, detail=name, value=value) is None:
                return  # refused or unknown: stop writing to this item at once
            await asyncio.sleep(self.work)
            renewed = await self._call(
                "renew", key, token, self.client.renew_claim(key, token, lease_seconds=self.lease)
            )
            if renewed is None or not renewed.renewed:
                return
        await self._finish(key, token)

    async def _finish(self, key: str, token: int) -> None:
        done = {"status": "done", "done_by": self.name}
        finish = self.client.update(key, fields=done, fencing_token=token)
        if await self._call("finish", key, token, finish, detail="status", value="done"):
            self.finished += 1
        await self._call("release", key, token, self.client.release_claim(key, token))

    async def _pause_past_lease(self, key: str, token: int) -> None:
        """The nemesis: a worker that stalls past its lease, then wakes up and writes."""
        deadline = time.monotonic() + self.lease + 10
        while time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            try:
                status = await self.client.claim_status(key)
            except FencemarkError:
                continue
            if status.fence > token:
                break  # someone else holds it now
        name = f"stale.{self.name}.{token}"
        write = self.client.update(key, fields={name: "late"}, fencing_token=token)
        await self._call("stale-write", key, token, write, detail="", value="late")
        renewed = await self._call("stale-renew", key, token, self.client.renew_claim(key, token))
        reason = renewed.reason if renewed is not None else "unknown"
        refused = [e for e in self.history.events if e.op == "stale-write" and e.agent == self.name]
        self.paused_refusal = (
            refused[-1].detail if refused and refused[-1].outcome == "fail" else None
        )
        if reason and reason != self.paused_refusal:
            self.paused_refusal = f"{self.paused_refusal} (renew: {reason})"


class QueueAgent(Agent):
    """Takes work with ``ClaimNext`` and ends each claim with its outcome (SPEC §8): the
    result and ``done`` in one release under the token. An item tagged ``poison``
    fails every time: released ``failed`` until it is parked.

    Its history says what it did: ``claim-next`` (no key: the node picks), the
    ``grant`` it got, ``write``/``renew`` as an :class:`Agent`'s, then ``done`` (the
    release, with the ``result`` field it wrote, a value of its own per claim) or
    ``fail``. ``topic`` and ``tags`` say which items it asks for; ``wait_seconds``,
    how long its own region's node may keep it waiting when no region has one;
    ``feed``, what it waits on after that (without one, it asks again soon)."""

    topic: str = TOPIC
    tags: tuple[str, ...] = (TAG,)
    wait: float = 0.0
    feed: FeedSignal | None = None  # what it waits on when no region has work

    def waking_on(self, feed: FeedSignal) -> Self:
        """This agent, waiting for a change on ``feed`` (its region's node's change
        feed of the topic) when no region has work, instead of asking again soon."""
        self.feed = feed
        return self

    def asking(self, topic: str, tags: Sequence[str], wait_seconds: float = 0.0) -> Self:
        """This agent, asking for the items of ``topic`` with ``tags``, waiting up to
        ``wait_seconds`` when no region has one."""
        self.topic, self.tags, self.wait = topic, tuple(tags), wait_seconds
        return self

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            seen = self.feed.generation if self.feed is not None else 0
            picked = await self._call(
                "claim-next", "", 0,
                self.client.claim_next(REPO, self.topic, self.name, lease_seconds=self.lease,
                                       wait_seconds=self.wait, tags=self.tags),
            )  # fmt: skip
            if picked is None or not picked.granted or picked.record is None:
                if self.feed is not None and picked is not None and picked.reason == "empty":
                    await self.feed.wait_after(seen, fallback_seconds=self.lease)
                else:
                    await asyncio.sleep(self.rng.uniform(0.05, 0.2))
                continue
            assert self.last is not None
            grant = grant_of(self.last, picked)
            self.history.add(grant)
            key, token = grant.key, grant.token
            if POISON in picked.record.tags:
                failed = self.client.release_claim(key, token, outcome="failed")
                await self._call("fail", key, token, failed, value="failed")
                continue
            await self._work_on(key, token)

    async def _finish(self, key: str, token: int) -> None:
        result = f"done by {self.name}@{token}"  # whose claim it was, in the final state
        release = self.client.release_claim(key, token, outcome="done", fields={"result": result})
        released = await self._call("done", key, token, release, detail="result", value=result)
        if released is not None and released.released:
            self.finished += 1


# -- the checker ---------------------------------------------------------------------


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def check_history(history: History, finals: Mapping[str, Mapping[str, Record]]) -> list[Check]:
    """Judge the history and every region's final states (key -> Record)."""
    grants = grants_by_key(history)
    return [
        fencing_safety(history, grants),
        tokens_increase(grants),
        _writes_everywhere(history, finals),
    ]


def grants_by_key(history: History) -> dict[str, list[Event]]:
    grants: dict[str, list[Event]] = {}
    for event in history.events:
        if event.op == "grant":
            grants.setdefault(event.key, []).append(event)
    return grants


def fencing_safety(history: History, grants: Mapping[str, list[Event]]) -> Check:
    violations = []
    for event in history.events:
        if event.op not in FENCED or event.outcome != "ok":
            continue
        for grant in grants.get(event.key, []):
            if grant.token > event.token and grant.completed < event.invoked:
                violations.append(
                    f"{event.agent} wrote {event.key} with token {event.token}"
                    f" after token {grant.token} was granted"
                )
                break
    told = {
        (e.agent, e.key, e.token): e.completed
        for e in history.events
        if e.outcome == "fail" and e.detail == "superseded"
    }
    for event in history.events:
        since = told.get((event.agent, event.key, event.token))
        late = since is not None and event.invoked > since
        if late and event.outcome == "ok" and event.op in FENCED:
            violations.append(f"{event.agent} wrote {event.key} after being told superseded")
        elif event.op == "stale-write" and event.outcome == "ok":
            # Written after the worker stalled past its lease: expired or superseded.
            violations.append(f"{event.agent} wrote {event.key} with a lapsed token {event.token}")
    detail = "; ".join(violations[:3]) or "no write got through with a stale token"
    return Check("fencing safety", not violations, detail)


def tokens_increase(grants: Mapping[str, list[Event]]) -> Check:
    """Per record: a grant that completed before another began has a smaller token,
    and no token is granted to two owners (the same owner's re-claim is a retry)."""
    violations = []
    for key, events in grants.items():
        owners: dict[int, str] = {}
        for grant in events:
            holder = owners.setdefault(grant.token, grant.agent)
            if holder != grant.agent:
                violations.append(
                    f"{key}: token {grant.token} granted to {holder} and {grant.agent}"
                )
        for first in events:
            for then in events:
                same_claim = first.token == then.token and first.agent == then.agent
                if first.completed < then.invoked and first.token >= then.token and not same_claim:
                    violations.append(f"{key}: token {then.token} granted after {first.token}")
    count = sum(len(events) for events in grants.values())
    detail = "; ".join(violations[:3]) or f"{count} grants, in order, none reused"
    return Check("tokens strictly increase", not violations, detail)


def _writes_everywhere(history: History, finals: Mapping[str, Mapping[str, Record]]) -> Check:
    return acknowledged_everywhere(
        history, finals, ("write",), "every acknowledged write is in every region", "writes"
    )


def acknowledged_everywhere(
    history: History,
    finals: Mapping[str, Mapping[str, Record]],
    ops: tuple[str, ...],
    name: str,
    what: str,
) -> Check:
    """Every acknowledged event of ``ops`` (a field ``detail`` written with ``value``)
    is in every region's final state; the check called ``name``, counting ``what``."""
    acked = [e for e in history.events if e.op in ops and e.outcome == "ok"]
    missing = [
        f"{e.key} {e.detail}={e.value} at {region}"
        for region, records in finals.items()
        for e in acked
        if e.key not in records or records[e.key].fields.get(e.detail) != e.value
    ]
    detail = (
        "; ".join(missing[:3]) or f"{len(acked)} acknowledged {what}, in all {len(finals)} regions"
    )
    return Check(name, not missing, detail)

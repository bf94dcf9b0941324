"""Hasty clients: callers that leave while the node is committing their change.

A caller whose call is cancelled while its change is being committed — its deadline
passes, or it disconnects — must leave the record as if it had waited: the change
lands or not, and either way the next change of the key reads it, and whoever
follows commits (the lapse watcher, waiters, the push, the feed) hears of it. A
renewal that landed for a caller that left must still lapse.

- **Hasty clients**, ``HASTY_PER_REGION`` per region, each with a client certificate
  of its own and a routed client, for the whole run. Each episode: pick an item — one
  of the shared hasty items (``HASTY_SHARED`` per region, homed there: hasty clients
  of every region contend for them) or, while it has made fewer than
  ``OWN_ITEMS``, a fresh item of its own homed in a region drawn at random, which it
  then leaves alone (what it left behind is still there at the end: a grant or
  renewal that landed and was never lapsed shows in the final state) — then claim it,
  write fenced fields (``hasty.<client>.<token>.<step>``, each a field of its own),
  renew after each, and release. Every call gets a deadline drawn from
  ``DEADLINE_MS`` (about a commit's time here), so many are cancelled while their
  change is committed: three calls in four by the deadline the client sends
  (``DEADLINE_EXCEEDED``), one in four by the caller cancelling it (the client
  disconnects the call, ``CANCELLED``). Either is recorded as ``unknown``: the call
  may or may not have landed.
- After an unknown claim it walks away half the time (a grant that may have landed
  for a caller that left), else asks again with an ordinary deadline (the same
  owner's retry of a live claim gets its own token back). After an unknown renewal it
  walks away a third of the time (the past bug's shape: a renewal that landed for a
  caller that left, never lapsed); after an unknown write it goes on. A refusal ends
  the episode, an unknown release too.

The history records each call as every agent's is recorded (``claim``, ``grant``,
``write``, ``renew``, ``release``), so invariants 1, 2, 7, 8 and 9 judge them with
every other claim; invariant 14 (``claim_invariants.leases_recorded``) judges what
the homes' claim histories say at the end. docs/chaos.md says what is promised.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Awaitable
from typing import TypeVar

import grpc

from fencemark.client import AsyncClient, FencemarkError, Unavailable
from fencemark.node.tools.workload import REPO, Event, grant_of, monotonic_at, recorded
from tests.chaos.claims import Ending
from tests.chaos.workload import CALL_TIMEOUT_S, Workload, detail_of, outcome_of, stopped

HASTY_TOPIC = "hasty"
HASTY_PER_REGION = 1
HASTY_SHARED = 2  # shared hasty items per region, homed there
OWN_ITEMS = 40  # fresh items a hasty client makes and then leaves alone
OWN_SHARE = 0.5  # how often an episode takes a fresh item of its own (while it may)
DEADLINE_MS = (1.0, 15.0)  # a call's deadline, drawn uniformly: about one commit here
CANCEL_SHARE = 0.25  # calls the caller cancels itself (a disconnect), not by deadline
STEPS = 2  # fenced writes per claim, each followed by a renewal
WALK_AWAY_AFTER_CLAIM = 0.5
WALK_AWAY_AFTER_RENEW = 1 / 3
PAUSE_S = (0.01, 0.05)  # between two calls of an episode
REST_S = (0.05, 0.2)  # between episodes
T = TypeVar("T")


def hasty_key(name: str) -> str:
    return f"repo/{REPO}/mem/{HASTY_TOPIC}/{name}"


class HastyClient:
    """One caller that keeps leaving its calls early (module docstring)."""

    def __init__(self, work: HastyWork, name: str, region: str, seed: int) -> None:
        self.work = work
        self.name = name
        self.region = region
        self.rng = random.Random(seed)
        self.client = work.workload.client(region, routed=True, identity=name)
        self.own: list[str] = []
        self.calls: Counter[str] = Counter()  # outcome (unknown split by how) -> calls

    async def _call(
        self,
        op: str,
        key: str,
        token: int,
        call: Awaitable[T],
        *,
        patient: bool = False,
        detail: str = "",
        value: str = "",
    ) -> tuple[T | None, Event]:
        """Make ``call`` with a hasty deadline (``patient``: the agents' ordinary one),
        and record it: cancelled or past its deadline, its outcome is unknown."""
        if patient:
            self.client.timeout, cancel_after = CALL_TIMEOUT_S, None
        else:
            seconds = self.rng.uniform(*DEADLINE_MS) / 1000
            if self.rng.random() < CANCEL_SHARE:  # the caller leaves: the call is cancelled
                self.client.timeout, cancel_after = CALL_TIMEOUT_S, seconds
            else:  # the deadline travels with the call, and the node sees it pass
                self.client.timeout, cancel_after = seconds, None
        result, event = await recorded(
            self.work.history,
            self.name,
            op,
            key,
            token,
            _leaving(call, cancel_after),
            detail=detail,
            value=value,
        )
        how = event.detail if event.outcome == "unknown" else event.outcome
        self.calls[how] += 1
        return result, event

    async def run(self, stop: asyncio.Event) -> None:
        while not await stopped(stop, self.rng.uniform(*REST_S)):
            key = await self._pick()
            if key is not None:
                await self._episode(key)

    async def _pick(self) -> str | None:
        if len(self.own) < OWN_ITEMS and self.rng.random() < OWN_SHARE:
            return await self.work.create(
                f"{self.name}-{len(self.own):03d}",
                self.rng.choice(self.work.workload.regions),
                self,
            )
        return self.rng.choice(self.work.shared) if self.work.shared else None

    async def _episode(self, key: str) -> None:
        work = self.work
        lease = work.workload.lease_seconds
        claim, event = await self._call(
            "claim", key, 0, self.client.claim(key, self.name, lease_seconds=lease)
        )
        if event.outcome == "unknown":
            if self.rng.random() < WALK_AWAY_AFTER_CLAIM:
                return  # a grant that may have landed, for a caller that left
            claim, event = await self._call(
                "claim",
                key,
                0,
                self.client.claim(key, self.name, lease_seconds=lease),
                patient=True,
            )
        if claim is None or not claim.granted:
            return
        work.history.add(grant_of(event, claim))
        token = claim.fencing_token
        for step in range(STEPS):
            await asyncio.sleep(self.rng.uniform(*PAUSE_S))
            name, value = f"hasty.{self.name}.{token}.{step}", f"{self.name}@{token}.{step}"
            write = self.client.update(key, fields={name: value}, fencing_token=token)
            _, event = await self._call("write", key, token, write, detail=name, value=value)
            if event.outcome == "fail":
                return
            await asyncio.sleep(self.rng.uniform(*PAUSE_S))
            renew = self.client.renew_claim(key, token, lease_seconds=lease)
            renewed, event = await self._call("renew", key, token, renew)
            if event.outcome == "unknown" and self.rng.random() < WALK_AWAY_AFTER_RENEW:
                return  # a renewal that may have landed, for a caller that left
            if event.outcome == "fail" or (renewed is not None and not renewed.renewed):
                return
        await asyncio.sleep(self.rng.uniform(*PAUSE_S))
        await self._call("release", key, token, self.client.release_claim(key, token))


async def _leaving(call: Awaitable[T], cancel_after: float | None) -> T:
    """``call``, cancelled by its caller after ``cancel_after`` seconds (None: never):
    the client gives the call up, and the node sees it cancelled."""
    if cancel_after is None:
        return await call
    try:
        async with asyncio.timeout(cancel_after):
            return await call
    except TimeoutError:
        raise Unavailable(grpc.StatusCode.CANCELLED, "the caller left: outcome unknown") from None


class HastyWork:
    """The hasty clients and their items, into the workload's history."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.history = workload.history
        self._seed = workload.rng.randrange(1 << 30)
        self.shared: list[str] = []
        self.clients: list[HastyClient] = []
        self._direct: dict[str, AsyncClient] = {}

    async def prepare(self) -> None:
        """The shared items, homed in every region, and the hasty clients."""
        workload, rng = self.workload, random.Random(self._seed)
        self._direct = {region: workload.client(region, retries=4) for region in workload.regions}
        for region in workload.regions:
            for i in range(HASTY_SHARED):
                key = await self.create(f"shared-{region}-{i}", region, None)
                assert key is not None, f"could not create a shared hasty item at {region}"
        self._direct = {region: workload.client(region) for region in workload.regions}
        self.clients = [
            HastyClient(self, f"{region}-hasty-{i}", region, rng.randrange(1 << 30))
            for region in workload.regions
            for i in range(HASTY_PER_REGION)
        ]

    def tasks(self, stop: asyncio.Event) -> list[asyncio.Task[None]]:
        return [asyncio.create_task(client.run(stop)) for client in self.clients]

    async def create(self, name: str, home: str, owner: HastyClient | None) -> str | None:
        """Create a hasty item at ``home``'s node (an ordinary deadline); its key, or None.
        An item of ``owner``'s own counts against its ``OWN_ITEMS`` even if refused."""
        key = hasty_key(name)
        if owner is not None:
            owner.own.append(key)
        self.workload.homes[key] = home  # its tag names its home, whatever the outcome
        invoked = time.monotonic()
        try:
            await self._direct[home].remember(
                REPO,
                HASTY_TOPIC,
                name,
                kind="Task",
                author="chaos",
                title=f"Hasty item {name}",
                tags=[HASTY_TOPIC, f"homeRegion:{home}"],
            )
        except FencemarkError as exc:
            self.workload.record(
                "hasty-producer", "create", key, outcome_of(exc), invoked, detail_of(exc), home
            )
            return None
        self.workload.record("hasty-producer", "create", key, "ok", invoked, home)
        if owner is None:
            self.shared.append(key)
        return key

    def summary(self) -> str:
        """A progress line: the hasty calls by outcome (unknown ones by how they ended)."""
        calls: Counter[str] = Counter()
        for client in self.clients:
            calls.update(client.calls)
        total = sum(calls.values())
        return f"hasty clients: {total} calls, " + ", ".join(
            f"{how} {n}" for how, n in calls.most_common()
        )


ENDING_KINDS = ("granted", "renewed", "released", "lapsed", "forced")


async def read_endings(workload: Workload) -> tuple[list[Ending], int]:
    """At the end: for every record the history shows a claim of, the latest claim
    event its home kept (``Records.History``, read at the home), and how many could
    not be read (a tombstone of a never-created key, a call that failed)."""
    history = workload.history
    keys = sorted({e.key for e in history.events if e.op in ("claim", "grant") and e.key})
    nodes = {region: workload.client(region) for region in workload.regions}
    endings: list[Ending] = []
    unread = 0
    for key in keys:
        home = workload.homes.get(key)
        if home is None:
            unread += 1
            continue
        try:
            kept = await nodes[home].history(key)
        except FencemarkError:
            unread += 1
            continue
        read_at = time.monotonic() - history.started
        last = next((e for e in reversed(kept.events) if e.kind in ENDING_KINDS), None)
        if last is None:
            endings.append(Ending(key, home, "", 0, "", 0.0, read_at))
            continue
        at = monotonic_at(last.at) - history.started
        endings.append(Ending(key, home, last.kind, last.fencing_token, last.owner, at, read_at))
    return endings, unread

"""Agents that drain through a failover, the holders that keep a claim across it, and
the ledger both keep: every grant (item, token, owner, when asked, when answered),
every item finished and every error, by kind.

- **Fencemark** (``FencemarkAgent``): the drain recipe (``ClaimNext`` → fenced
  ``Update`` → ``ReleaseClaim(done)``, ``work_queues``), each *step* asked again
  every ``RETRY_PAUSE_S`` while a failover refuses it (``NOT_SERVING``,
  ``NO_MAJORITY``, ``NOT_DECIDER``, a member gone), turning to the next member's
  address each time. A step asked again is safe: ``ClaimNext`` asked again by its
  owner answers the item it holds (SPEC §8); a fenced update is idempotent for the
  live claim; a ``done`` release whose reply was lost answers ``released`` when asked
  again (the item is done, its acknowledgement was the lost reply). Any other
  refusal of an update or a release with the token the agent holds is a claim lost
  by its holder — what a failover must never do.
- **Holders** (``Holder``, Fencemark only): a claim by key taken before the kill,
  renewed every second through it, then a fenced write and the release with the
  same token, and a claim by another owner, whose token must be above.
- **etcd and Redis** (``TakeAgent``): the ``drain`` scenario's recipes as they are,
  each take tried whole: a take that fails is counted by kind and the next one asked
  of the next member (etcd) or of the primary the Sentinels name (Redis, through
  redis-py's Sentinel client). An item whose take failed half-way stays locked; it is
  not counted as done.

``run`` drives the agents: from the start, and with a ``kill`` at ``kill_at`` s,
until the first grant asked after the kill plus ``after_s``, or until the backlog
is drained.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from fencemark.bench.drivers import CycleFailed
from fencemark.bench.progress import Progress
from fencemark.bench.records import REPO
from fencemark.bench.work_queues import EMPTY, LEASE_SECONDS, PROGRESS, RESULT, Take
from fencemark.client import AsyncClient
from fencemark.client.errors import ClaimConflict, FencemarkError, NotDecider, Unavailable
from fencemark.client.types import ClaimNextResult

T = TypeVar("T")
RETRY_PAUSE_S = 0.1  # between two asks of a step a failover refused
TAKE_LIMIT_S = 10.0  # one take of etcd's or Redis's recipe, at most
STOP_GRACE_S = 15.0  # for an item in hand to be finished once the run stops
HOLD_LEASE_S = 30.0  # a holder's lease: longer than any failover measured
RENEW_EVERY_S = 1.0
DRAIN, HOLD = "drain", "hold"


@dataclass
class Grant:
    """One grant an agent or a holder heard: when it was asked and when answered
    (seconds into the run)."""

    item: str
    token: int
    owner: str
    asked: float
    at: float
    kind: str = DRAIN


@dataclass
class Finished:
    """One item finished: its take began, its grant was answered, its done answered."""

    item: str
    began: float
    granted: float
    ended: float
    acknowledged: bool = True  # False: its done's reply was lost, the retry said so


@dataclass
class Ledger:
    started: float = field(default_factory=time.monotonic)
    grants: list[Grant] = field(default_factory=list)
    finished: list[Finished] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    said: dict[str, str] = field(default_factory=dict)  # kind -> its first error's words
    lost_claims: list[str] = field(default_factory=list)  # "item: reason"
    ran_dry: bool = False
    killed_at: float = math.nan

    def now(self) -> float:
        return time.monotonic() - self.started

    def failed(self, exc: BaseException) -> None:
        """Count a call that failed, by kind; keep what the first of a kind said."""
        kind = kind_of(exc)
        self.errors[kind] += 1
        words = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
        self.said.setdefault(kind, (words or "")[:120])

    def first_grant_after(self, moment: float) -> float:
        """When the first grant asked at or after ``moment`` was answered (NaN: none)."""
        answered = [g.at for g in self.grants if g.asked >= moment]
        return min(answered) if answered else math.nan


Agent = Callable[[asyncio.Event], Coroutine[Any, Any, None]]


def kind_of(exc: BaseException) -> str:
    """An error's kind for the report."""
    if isinstance(exc, Unavailable):
        return exc.reason or exc.code.name
    if isinstance(exc, NotDecider):
        return "NOT_DECIDER"
    if isinstance(exc, FencemarkError):
        return exc.code.name
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, CycleFailed):
        return "refused"
    return type(exc).__name__


class Stopped(Exception):
    """The run is over: the agent asks nothing more."""


class _Steps:
    """Steps asked again while a failover refuses them, over one client per member.
    Once ``stop`` is set, a step outside an item is not asked any more, and one inside
    an item (``holding``) is given up ``STOP_GRACE_S`` later."""

    def __init__(self, clients: Sequence[AsyncClient], ledger: Ledger, start: int) -> None:
        self.clients = clients
        self.ledger = ledger
        self.index = start % len(clients)
        self.uncertain = False  # a refusal since the last reset may have been applied
        self.stop = asyncio.Event()
        self.holding = False
        self._stopped_at = math.inf

    def _over(self) -> bool:
        if not self.stop.is_set():
            return False
        if not self.holding:
            return True
        if math.isinf(self._stopped_at):
            self._stopped_at = self.ledger.now()
        return self.ledger.now() > self._stopped_at + STOP_GRACE_S

    async def again(self, call: Callable[[AsyncClient], Awaitable[T]]) -> tuple[float, T]:
        """``call`` at the current member until answered; (when asked, the answer)."""
        while True:
            if self._over():
                raise Stopped
            asked = self.ledger.now()
            try:
                return asked, await call(self.clients[self.index])
            except (Unavailable, NotDecider) as exc:
                # NOT_SERVING and NOT_DECIDER did nothing; anything else may have.
                said = exc.reason if isinstance(exc, Unavailable) else "NOT_DECIDER"
                self.uncertain |= said not in ("NOT_SERVING", "NOT_DECIDER")
                self.ledger.failed(exc)
            except FencemarkError as exc:
                if exc.code != grpc.StatusCode.CANCELLED:
                    raise
                self.uncertain = True
                self.ledger.failed(exc)
            self.index = (self.index + 1) % len(self.clients)
            await asyncio.sleep(RETRY_PAUSE_S)


class FencemarkAgent:
    """One agent of the drain recipe, each step asked again through a failover."""

    def __init__(
        self, clients: Sequence[AsyncClient], topic: str, owner: str, ledger: Ledger, start: int
    ) -> None:
        self.steps = _Steps(clients, ledger, start)
        self.topic = topic
        self.owner = owner
        self.ledger = ledger

    async def __call__(self, stop: asyncio.Event) -> None:
        ledger, steps = self.ledger, self.steps
        steps.stop = stop
        while not stop.is_set():
            began = ledger.now()
            steps.holding = False
            try:
                asked, picked = await steps.again(self._next)
                if not picked.granted or picked.record is None:
                    if picked.reason == EMPTY:
                        ledger.ran_dry = True
                        return
                    ledger.errors[f"not granted: {picked.reason}"] += 1
                    await asyncio.sleep(RETRY_PAUSE_S)
                    continue
                key, token = picked.record.key, picked.fencing_token
                granted = ledger.now()
                ledger.grants.append(Grant(key, token, self.owner, asked, granted))
                steps.holding = True
                await self._item(key, token, began, granted)
            except Stopped:
                return
            except FencemarkError as exc:  # not a failover's: counted, the item left
                ledger.failed(exc)
                await asyncio.sleep(RETRY_PAUSE_S)

    async def _next(self, client: AsyncClient) -> ClaimNextResult:
        return await client.claim_next(REPO, self.topic, self.owner, lease_seconds=LEASE_SECONDS)

    async def _item(self, key: str, token: int, began: float, granted: float) -> None:
        ledger, steps = self.ledger, self.steps
        try:
            await steps.again(lambda c: c.update(key, fields=PROGRESS, fencing_token=token))
        except ClaimConflict as conflict:
            ledger.lost_claims.append(f"{key}: update refused {conflict.reason}")
            return
        steps.uncertain = False
        _, done = await steps.again(
            lambda c: c.release_claim(key, token, outcome="done", fields=RESULT)
        )
        if done.released:
            ledger.finished.append(Finished(key, began, granted, ledger.now()))
        elif done.reason == "released" and steps.uncertain:
            # An earlier ask was applied and its reply lost: done, unacknowledged.
            ledger.finished.append(Finished(key, began, granted, ledger.now(), False))
        else:
            ledger.lost_claims.append(f"{key}: done refused {done.reason}")


class Holder:
    """A claim by key held across the failover (see the module docstring)."""

    def __init__(
        self, clients: Sequence[AsyncClient], key: str, owner: str, ledger: Ledger, start: int
    ) -> None:
        self.steps = _Steps(clients, ledger, start)
        self.steps.holding = True  # a holder finishes what it holds, stopped or not
        self.key = key
        self.owner = owner
        self.ledger = ledger
        self.token = 0
        self.renewals = 0

    async def take(self) -> None:
        """Claim the key (before the kill)."""
        key, ledger = self.key, self.ledger
        asked, held = await self.steps.again(
            lambda c: c.claim(key, self.owner, lease_seconds=HOLD_LEASE_S)
        )
        if not held.granted:
            raise CycleFailed(f"holder {self.owner}: claim of {key} refused {held.reason}")
        self.token = held.fencing_token
        ledger.grants.append(Grant(key, self.token, self.owner, asked, ledger.now(), HOLD))

    async def keep(self, stop: asyncio.Event) -> None:
        """Renew until ``stop``; then a fenced write, the release, and a claim by another
        owner (its token must be above)."""
        try:
            await self._keep(stop)
        except Stopped:  # the region never came back within the grace
            self.ledger.errors["holder gave up"] += 1

    async def _keep(self, stop: asyncio.Event) -> None:
        key, token, ledger = self.key, self.token, self.ledger
        self.steps.stop = stop
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(RENEW_EVERY_S):
                    await stop.wait()
            _, renewed = await self.steps.again(
                lambda c: c.renew_claim(key, token, lease_seconds=HOLD_LEASE_S)
            )
            if not renewed.renewed:
                ledger.lost_claims.append(f"{key}: renewal refused {renewed.reason}")
                return
            self.renewals += 1
        try:
            await self.steps.again(
                lambda c: c.update(key, fields={"held": "across"}, fencing_token=token)
            )
        except ClaimConflict as conflict:
            ledger.lost_claims.append(f"{key}: update refused {conflict.reason}")
            return
        self.steps.uncertain = False
        _, released = await self.steps.again(lambda c: c.release_claim(key, token))
        if not released.released and not self.steps.uncertain:
            ledger.lost_claims.append(f"{key}: release refused {released.reason}")
            return
        after = f"{self.owner}-after"
        asked, next_claim = await self.steps.again(
            lambda c: c.claim(key, after, lease_seconds=HOLD_LEASE_S)
        )
        if next_claim.granted:
            ledger.grants.append(
                Grant(key, next_claim.fencing_token, after, asked, ledger.now(), HOLD)
            )
            await self.steps.again(lambda c: c.release_claim(key, next_claim.fencing_token))


class TakeAgent:
    """One agent of etcd's or Redis's drain recipe: a take tried whole, turning to the
    next of ``takes`` (one per server it may reach) after a failed one."""

    def __init__(self, owner: str, ledger: Ledger, start: int) -> None:
        self.owner = owner
        self.ledger = ledger
        self.start = start
        self.takes: list[Take] = []
        self._began = 0.0
        self._granted = 0.0

    def granted(self, item: str, token: int) -> None:
        """The recipe's ``granted``: a grant answered to this agent's take in hand."""
        self._granted = self.ledger.now()
        self.ledger.grants.append(Grant(item, token, self.owner, self._began, self._granted))

    async def __call__(self, stop: asyncio.Event) -> None:
        ledger = self.ledger
        index = self.start % len(self.takes)
        while not stop.is_set():
            self._began = ledger.now()
            try:
                async with asyncio.timeout(TAKE_LIMIT_S):
                    got = await self.takes[index]()
            except Exception as exc:
                ledger.failed(exc)
                index = (index + 1) % len(self.takes)
                await asyncio.sleep(RETRY_PAUSE_S)
                continue
            if got is None:
                ledger.ran_dry = True
                return
            item = got[0].rsplit("/", 1)[-1]  # etcd's answer is the queue key: its id
            ledger.finished.append(Finished(item, self._began, self._granted, ledger.now()))


async def run(
    agents: Sequence[Agent],
    ledger: Ledger,
    progress: Progress,
    label: str,
    *,
    limit_s: float,
    kill: Callable[[], Awaitable[float]] | None = None,
    kill_at: float = math.nan,
    after_s: float = 0.0,
) -> None:
    """Run ``agents`` until the backlog is drained, or with ``kill``: ``kill()`` at
    ``kill_at`` s, then until ``after_s`` past the first grant asked after it (or
    ``limit_s`` past the kill). Raises what an agent raised unexpectedly."""
    stop = asyncio.Event()
    tasks = [asyncio.create_task(agent(stop)) for agent in agents]

    def status() -> None:
        phase = "" if math.isnan(ledger.killed_at) else ", killed"
        progress.status(f"{label}: {len(ledger.finished):,} items{phase}")

    async def until(holds: Callable[[], bool], deadline: float) -> None:
        while not holds() and ledger.now() < deadline and not all(t.done() for t in tasks):
            status()
            await asyncio.sleep(0.05)

    try:
        if kill is None:
            await until(lambda: False, limit_s)
        else:
            await until(lambda: False, kill_at)
            if all(t.done() for t in tasks):
                raise CycleFailed(f"{label}: the backlog ran out before the kill")
            ledger.killed_at = await kill() - ledger.started
            progress.line(f"{label}: killed at {ledger.killed_at:.1f} s")
            seen = len(ledger.grants)

            def granted_again() -> bool:  # only the grants since the last look
                nonlocal seen
                fresh, seen = ledger.grants[seen:], len(ledger.grants)
                return any(g.asked >= ledger.killed_at for g in fresh)

            await until(granted_again, ledger.killed_at + limit_s)
            await until(lambda: False, ledger.now() + after_s)
    finally:
        stop.set()
        done, pending = await asyncio.wait(tasks, timeout=STOP_GRACE_S + 5)
        for task in pending:
            task.cancel()
        for task in pending:
            with contextlib.suppress(asyncio.CancelledError):
                await task
    for task in done:
        failure = task.exception()
        if failure is not None:
            raise failure

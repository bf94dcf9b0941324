"""The workload's sharper shapes: what an attacker did that the agents never do.

- **Split births.** When the nemesis partitions the cluster, the same untagged ids
  are created on both sides of the cut at once (each side's node homes such an id
  in its own region), claimed on both sides, written and renewed. After the heal
  their holders keep writing and renewing until they are refused; meanwhile the ids
  are watched until every region names one home whose fence is past every token
  either side granted (the births *met*); then each id is claimed once more, at
  that home. The history says which ids were created where: a ``create`` event
  per side (acknowledged: detail the region, value ``created`` or ``merged``, as
  the node answered; otherwise detail the reason, value the region).
- **Meddlers**, one per region: unfenced writes and deletes, at their own node, of
  backlog items homed elsewhere whose claims are live and being renewed (never the
  item an agent the nemesis stalled holds, ``agent-pause``). Holders
  (agents that keep a claim for several leases, see ``workload.py``) give them
  claims that outlive a non-home node's view of the lease. A meddling write goes
  to a field the holder writes under its token (``progress.<holder>.<token>.<step>``)
  with a value of its own, so the final state says which write won.
- **Pressing a node that catches up**: while a node that lost its disk is restarted
  before catching up (``wipe-restart``), claims of items homed there, at that node.
- **Pressing a node whose disk went back in time** (``rollback``): right before the
  copy of its data directory, work-queue items enqueued at it (on the copy, open; the
  queue agents do them after it); as soon as it answers again after the rollback,
  claims at that node of every backlog item it granted after the copy, and
  ``ClaimNext`` of the work queue there: a node that decides on its old file grants
  those tokens again, and hands out again the items it had done.
- **Pressing twins** (``twin``): while a second process started from a copy of a
  live node's data directory runs beside it, claims of the same backlog items homed
  there at both processes at once, and ``ClaimNext`` of the work queue at the copy
  (clients misrouted to the copy's address, and to the original meanwhile); the
  original is pressed on until it decides again after the copy is gone. Two
  processes that both decided would grant one record twice.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

from fencemark.client import (
    AsyncClient,
    ClaimNextResult,
    ClaimResult,
    FencemarkError,
    RenewResult,
)
from fencemark.node.tools.workload import REPO, TOPIC, Event, grant_of, recorded
from tests.chaos.queue_work import PRIORITIES, QUEUE_TAG, QUEUE_TOPIC, queue_key
from tests.chaos.workload import (
    AGENT_STEPS,
    CALL_TIMEOUT_S,
    HOLDER_STEPS,
    TESTER,
    Workload,
    detail_of,
    outcome_of,
    stopped,
)

T = TypeVar("T")

SPLIT_TOPIC = "split"  # apart from the backlog: agents and the producer never see them
SPLIT_IDS = 2  # ids born on both sides of each partition
SPLIT_STEP_S = 0.4  # a split holder writes and renews this often
# After the heal the births must meet within this (as many anti-entropy rounds as
# convergence may take, docs/chaos.md); holders stop trying a little after it.
SPLIT_MEET_LIMIT_S = 20.0
MEET_POLL_S = 0.25
POST_HEAL_TRIES = 3
MEDDLE_INTERVAL_S = 0.3
MEDDLE_DELETE_SHARE = 0.1
PRESS_INTERVAL_S = 0.3
ROLLBACK_PRESS_INTERVAL_S = 0.3  # a rolled-back node is asked at once, then this often
ANSWER_POLL_S = 0.02  # how often a restarted node is tried until it answers
ANSWER_TIMEOUT_S = 0.5
BEFORE_COPY_ITEMS = 2  # queue items enqueued at a node right before its copy is taken
TWIN_KEYS = 4  # backlog items claimed at a twin and its original in each round (half held)
HELD_WINDOW = 400  # events looked back over to find the claims being held


def twin_presser(region: str) -> str:
    """Who asks a twin of ``region``'s node for claims (the client that reached the copy)."""
    return f"twin-{region}"


class Shapes:
    """Runs the shapes against the workload's nodes, into the workload's history."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.history = workload.history
        self.lease = workload.lease_seconds
        self.spawned: list[asyncio.Task[None]] = []  # split births and presses, as started
        self._direct: dict[str, AsyncClient] = {}
        self._splits = 0
        self._enqueued = 0  # queue items enqueued before a copy
        self._split_grants: dict[str, list[tuple[str, int]]] = {}  # key -> (region, token)
        self._seeds = {region: workload.rng.randrange(1 << 30) for region in workload.regions}

    def direct(self, region: str) -> AsyncClient:
        """A client of ``region``'s node alone (never routed elsewhere)."""
        if region not in self._direct:
            self._direct[region] = self.workload.client(region, timeout=CALL_TIMEOUT_S)
        return self._direct[region]

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        self.spawned.append(asyncio.create_task(work))

    async def _call(
        self, who: str, op: str, key: str, token: int, call: Awaitable[T], **kw: str
    ) -> tuple[T | None, Event]:
        return await recorded(self.history, who, op, key, token, call, **kw)

    # -- nemesis hooks (nemesis.Shapes) ------------------------------------------------

    def split(self, sides: tuple[str, str], healed: asyncio.Event) -> None:
        self._spawn(self._split(sides, healed))

    def press(self, region: str, until: asyncio.Event) -> None:
        self._spawn(self._press(region, until))

    async def before_copy(self, region: str) -> None:
        """Queue items at ``region``'s node, its own, right before its data directory is
        copied: on the copy they are open, and the queue agents do them after it (the
        agents drain the queue within a second of its items' creation, so few others
        are open at any one moment). First in line (``P0``) for the rolled-back node."""
        node = self.direct(region)
        who = f"rollback-{region}"
        for _ in range(BEFORE_COPY_ITEMS):
            name = f"before-copy-{region}-{self._enqueued:03d}"
            self._enqueued += 1
            key = queue_key(name)
            self.workload.homes[key] = region  # tagged so: its home even if unknown
            tags = [QUEUE_TAG, f"homeRegion:{region}", "priority:P0"]
            invoked = time.monotonic()
            try:
                await node.remember(REPO, QUEUE_TOPIC, name, kind="Task", author="chaos",
                                    title=f"Queue item {name}", tags=tags)  # fmt: skip
            except FencemarkError as exc:
                self.workload.record(who, "create", key, outcome_of(exc), invoked,
                                     detail_of(exc), region)  # fmt: skip
                continue
            self.workload.record(who, "create", key, "ok", invoked, region)

    def rolled_back(self, region: str, since: float, until: asyncio.Event) -> None:
        self._spawn(self._press_rolled_back(region, since, until))

    def twinned(
        self, region: str, twin: str, twin_gone: asyncio.Event, until: asyncio.Event
    ) -> None:
        self._spawn(self._press_twins(region, twin, twin_gone, until))

    def tasks(self, stop: asyncio.Event) -> list[asyncio.Task[None]]:
        return [asyncio.create_task(self._meddle(r, stop)) for r in self.workload.regions]

    # -- split births --------------------------------------------------------------------

    async def _split(self, sides: tuple[str, str], healed: asyncio.Event) -> None:
        n = self._splits
        self._splits += 1
        born = []
        for i in range(SPLIT_IDS):
            name = f"split-{n:03d}-{i}"
            made = await asyncio.gather(*(self._create(f"{name}-{r}", r, name) for r in sides))
            if all(made):
                born.append(f"repo/{REPO}/mem/{SPLIT_TOPIC}/{name}")
        await asyncio.gather(*(self._after_birth(key, sides, healed) for key in born))

    async def _create(self, who: str, region: str, name: str) -> bool:
        """Create ``name`` untagged at ``region``'s node; whether this call created it."""
        invoked = time.monotonic()
        try:
            made = await self.direct(region).remember(
                REPO, SPLIT_TOPIC, name, kind="Task", author="chaos",
                title=f"Born on both sides: {name}",
            )  # fmt: skip
        except FencemarkError as exc:
            key = f"repo/{REPO}/mem/{SPLIT_TOPIC}/{name}"
            self.workload.record(
                who, "create", key, outcome_of(exc), invoked, detail_of(exc), region
            )
            return False
        value = "created" if made.created else "merged"
        self.workload.record(who, "create", made.record.key, "ok", invoked, region, value)
        return made.created

    async def _after_birth(self, key: str, sides: tuple[str, str], healed: asyncio.Event) -> None:
        """Claim ``key`` on both sides; after the heal, until the births meet; then once more."""
        met = asyncio.ensure_future(self._until_met(key, healed))
        ends = await asyncio.gather(*(self._hold(key, region, healed) for region in sides))
        home = await met
        if not home:
            return
        # Not before every split-time claim has surely ended (refused or lapsed): its
        # holder would still believe it live (docs/chaos.md, one live claim at a time).
        await asyncio.sleep(max(0.0, max(ends, default=0.0) - time.monotonic()) + 0.1)
        await self._claim_once(key, home, f"{key.rsplit('/', 1)[1]}-after")

    async def _hold(self, key: str, region: str, healed: asyncio.Event) -> float:
        """Claim ``key`` at ``region``'s node (which believes it is its home), then write
        and renew until refused; the time (monotonic) the claim had surely ended."""
        who = f"{key.rsplit('/', 1)[1]}-{region}"
        node = self.direct(region)
        claim, called = await self._call(
            who, "claim", key, 0, node.claim(key, who, lease_seconds=self.lease)
        )
        if claim is None or not claim.granted:
            return time.monotonic()
        self.history.add(grant_of(called, claim))
        token = claim.fencing_token
        self._split_grants.setdefault(key, []).append((region, token))
        expires, step, healed_at = called.expires, 0, 0.0
        while True:
            if healed.is_set() and not healed_at:
                healed_at = time.monotonic()
            if healed_at and time.monotonic() > healed_at + SPLIT_MEET_LIMIT_S + 2:
                return expires  # never refused: the checker says what that means
            name = f"split.{who}.{token}.{step}"
            value = f"{who}@{token}"
            write = node.update(key, fields={name: value}, fencing_token=token)
            _, wrote = await self._call(who, "write", key, token, write, detail=name, value=value)
            if wrote.outcome != "ok":
                return wrote.completed if wrote.outcome == "fail" else expires
            await asyncio.sleep(SPLIT_STEP_S)
            renewal = node.renew_claim(key, token, lease_seconds=self.lease)
            renewed, called = await self._call(who, "renew", key, token, renewal)
            if not isinstance(renewed, RenewResult) or not renewed.renewed:
                return called.completed if called.outcome == "fail" else expires
            expires, step = called.expires, step + 1

    async def _until_met(self, key: str, healed: asyncio.Event) -> str:
        """After the heal: the home every region names once the births met, or "" if
        they did not in time. Met: one home, whose fence is past every split-time
        token — every token either side granted, but those the home granted after
        its fence moved (its ``History`` shows the ``moved`` event first: the births
        met there through the third region, before the heal). Those are recorded
        (``met-grant``): ordinary claims, which the meeting does not end."""
        await healed.wait()
        invoked = time.monotonic()
        seen = "no answer"
        name = key.rsplit("/", 1)[1]
        while time.monotonic() < invoked + SPLIT_MEET_LIMIT_S:
            try:
                records = [await self.direct(r).get(key) for r in self.workload.regions]
                homes = sorted({r.home_region for r in records})
                after = await self._granted_after_move(key, homes[0]) if len(homes) == 1 else []
            except FencemarkError as exc:
                seen = type(exc).__name__
            else:
                fence = min(r.fence for r in records)
                grants = self._split_grants.get(key, [])
                split = max((t for r, t in grants if (r, t) not in after), default=0)
                if len(homes) == 1 and fence > split:
                    for _, token in after:
                        self.workload.record(name, "met-grant", key, "ok", invoked, homes[0],
                                             token=token)  # fmt: skip
                    self.workload.record(name, "split-met", key, "ok", invoked, homes[0],
                                         str(fence), token=split)  # fmt: skip
                    return homes[0]
                seen = f"homes {','.join(homes)}, fence {fence} (split-time tokens up to {split})"
            await asyncio.sleep(MEET_POLL_S)
        # What it saw last as the value: the detail of a failure counts as a refusal.
        self.workload.record(name, "split-met", key, "fail", invoked, "", seen)
        return ""

    async def _granted_after_move(self, key: str, home: str) -> list[tuple[str, int]]:
        """The split grants of ``key`` that ``home`` made after its last move of the
        fence, as its ``History`` orders them (none if it shows no move)."""
        events = (await self.direct(home).history(key)).events
        moves = [i for i, e in enumerate(events) if e.kind == "moved"]
        if not moves:
            return []
        later = {e.fencing_token for e in events[moves[-1] + 1 :] if e.kind == "granted"}
        return [(r, t) for r, t in self._split_grants.get(key, []) if r == home and t in later]

    async def _claim_once(self, key: str, home: str, who: str) -> None:
        """Claim ``key`` at its home, write under the token, release."""
        node = self.direct(home)
        for _ in range(POST_HEAL_TRIES):
            claim, called = await self._call(
                who, "claim", key, 0, node.claim(key, who, lease_seconds=self.lease)
            )
            if isinstance(claim, ClaimResult) and claim.granted:
                break
            await asyncio.sleep(0.5)
        else:
            return
        self.history.add(grant_of(called, claim))
        token = claim.fencing_token
        name, value = f"split.{who}.{token}.0", f"{who}@{token}"
        write = node.update(key, fields={name: value}, fencing_token=token)
        await self._call(who, "write", key, token, write, detail=name, value=value)
        await self._call(who, "release", key, token, node.release_claim(key, token))

    # -- meddlers ------------------------------------------------------------------------

    def held(self) -> list[Event]:
        """Grants of backlog items whose holders have not (yet) released, been refused
        or given up, as far as the recent history shows; newest first."""
        ended: set[tuple[str, str, int]] = set()
        holding = []
        for event in reversed(self.history.events[-HELD_WINDOW:]):
            claim = (event.agent, event.key, event.token)
            if event.op == "grant":
                if claim not in ended and f"/mem/{TOPIC}/" in event.key:
                    holding.append(event)
            elif event.token and (event.op == "release" or event.outcome != "ok"):
                ended.add(claim)
        return holding

    async def _meddle(self, region: str, stop: asyncio.Event) -> None:
        """Unfenced writes and deletes at ``region``'s node of items claimed elsewhere,
        but the one a stalled agent holds."""
        rng = random.Random(self._seeds[region])
        node = self.direct(region)
        who = f"meddler-{region}"
        n = 0
        while not await stopped(stop, MEDDLE_INTERVAL_S):
            homes = self.workload.homes
            # Never the item a stalled agent holds (agent-pause): its woken worker must
            # meet the fence, not a deleted record.
            stalled = {agent.stalled_on for agent in self.workload.agents}
            targets = [
                g
                for g in self.held()
                if homes.get(g.key, region) != region and g.key not in stalled
            ]
            if not targets:
                continue
            # Holders' claims first: they outlive a non-home node's view of the lease.
            long = [g for g in targets if "-holder-" in g.agent]
            grant = rng.choice(long if long and rng.random() < 0.7 else targets)
            n += 1
            invoked = time.monotonic()
            if rng.random() < MEDDLE_DELETE_SHARE:
                try:
                    await node.delete(grant.key)
                    self.workload.record(who, "meddle-delete", grant.key, "ok", invoked)
                except FencemarkError as exc:
                    outcome = outcome_of(exc)
                    self.workload.record(who, "meddle-delete", grant.key, outcome, invoked,
                                         detail_of(exc) if outcome == "fail" else "")  # fmt: skip
                continue
            steps = HOLDER_STEPS if "-holder-" in grant.agent else AGENT_STEPS
            name = f"progress.{grant.agent}.{grant.token}.{rng.randrange(steps)}"
            value = f"meddle:{region}:{n}"
            try:
                await node.update(grant.key, fields={name: value})
                self.workload.record(who, "meddle", grant.key, "ok", invoked, name, value)
            except FencemarkError as exc:
                # Refused: the reason; unknown: the field, as it may have been written.
                outcome = outcome_of(exc)
                detail = name if outcome == "unknown" else detail_of(exc)
                self.workload.record(who, "meddle", grant.key, outcome, invoked, detail, value)

    # -- a node catching up --------------------------------------------------------------

    async def _press(self, region: str, until: asyncio.Event) -> None:
        """Claims at ``region``'s node of items homed there, held ones first, until
        ``until``; a claim it grants is released at once."""
        rng = random.Random(self._seeds[region] + 1)
        node = self.direct(region)
        who = f"press-{region}"
        while not await stopped(until, PRESS_INTERVAL_S):
            homed = [k for k, home in self.workload.homes.items() if home == region]
            held = [g.key for g in self.held() if g.key in homed]
            keys = held or [k for k in homed if f"/mem/{TOPIC}/" in k]
            if not keys:
                continue
            key = rng.choice(keys)
            claim, called = await self._call(
                who, "claim", key, 0, node.claim(key, who, lease_seconds=self.lease)
            )
            if isinstance(claim, ClaimResult) and claim.granted:
                self.history.add(grant_of(called, claim))
                token = claim.fencing_token
                await self._call(who, "release", key, token, node.release_claim(key, token))

    # -- a node whose disk went back in time -----------------------------------------------

    async def _press_rolled_back(self, region: str, since: float, until: asyncio.Event) -> None:
        """At ``region``'s node, restarted on a copy of its data directory taken at
        ``since`` (run clock), until ``until``: a claim of each backlog item the node
        granted since (by key; once one is granted, that item has made its point), and
        ``ClaimNext`` of the work queue at that node alone, once per priority (so never
        the poison item, which has none: its grants are counted against its attempts).
        All at once, the moment the node first answers (before its first anti-entropy
        round with a peer can have told it much), then again every
        ``ROLLBACK_PRESS_INTERVAL_S``. Whatever is granted is released at once. A node
        that decides on its old file grants those tokens again (2, 8) and hands out
        again the items it had done (12)."""
        start = self.history.started
        forgot = sorted({
            e.key for e in self.history.events
            if e.op == "grant" and e.outcome == "ok" and e.detail == region
            and e.completed - start >= since and f"/mem/{TOPIC}/" in e.key
        })  # fmt: skip
        who = f"rollback-{region}"
        node = await self._first_answer(self.workload.addresses[region], until)
        if node is None:
            return
        granted: set[str] = set()
        try:
            while True:
                keys = [k for k in forgot if k not in granted]
                await asyncio.gather(
                    *(self._press_key(node, who, key, granted) for key in keys),
                    *(self._press_queue(node, who, level) for level in range(PRIORITIES)),
                )
                if await stopped(until, ROLLBACK_PRESS_INTERVAL_S):
                    return
        finally:
            await node.close()

    async def _first_answer(self, address: str, until: asyncio.Event) -> AsyncClient | None:
        """A client of the node at ``address`` that it has just answered (None: ``until``
        came first): a fresh one per try, so that no reconnect back-off delays the first
        call."""
        credentials = self.workload.credentials(TESTER)
        while not until.is_set():
            node = AsyncClient(address, timeout=CALL_TIMEOUT_S, retries=0,
                               credentials=credentials)  # fmt: skip
            try:
                await asyncio.wait_for(node.info(), ANSWER_TIMEOUT_S)
                return node
            except (FencemarkError, TimeoutError):
                await node.close()
                await asyncio.sleep(ANSWER_POLL_S)
        return None

    async def _press_key(self, node: AsyncClient, who: str, key: str, granted: set[str]) -> None:
        claim, called = await self._call(
            who, "claim", key, 0, node.claim(key, who, lease_seconds=self.lease)
        )
        if isinstance(claim, ClaimResult) and claim.granted:
            granted.add(key)
            await self._release_at_once(node, who, grant_of(called, claim))

    async def _press_queue(self, node: AsyncClient, who: str, level: int) -> None:
        tags = (QUEUE_TAG, f"priority:P{level}")
        asked = node.claim_next(REPO, QUEUE_TOPIC, who, lease_seconds=self.lease, tags=tags,
                                only_target=True)  # fmt: skip
        picked, called = await self._call(who, "claim-next", "", 0, asked)
        if isinstance(picked, ClaimNextResult) and picked.granted and picked.record:
            await self._release_at_once(node, who, grant_of(called, picked))

    async def _release_at_once(self, node: AsyncClient, who: str, grant: Event) -> None:
        self.history.add(grant)
        release = node.release_claim(grant.key, grant.token)
        await self._call(who, "release", grant.key, grant.token, release)

    # -- twins -------------------------------------------------------------------------------

    async def _press_twins(
        self, region: str, address: str, twin_gone: asyncio.Event, until: asyncio.Event
    ) -> None:
        """At a twin of ``region``'s node (at ``address``, from its first answer until
        ``twin_gone``) and at the original (until ``until``), every
        ``ROLLBACK_PRESS_INTERVAL_S``: claims of the same backlog items homed there, at
        both at once (``twin-<region>`` at the copy, ``misrouted-<region>`` at the
        original), and at the copy ``ClaimNext`` of the work queue, once per priority.
        Whatever is granted is released at once. A copy beside its original must be
        refused by their peers before it decides (docs/replication.md, *Twins*); had
        both decided, one record would have been granted twice (2, 7, 8, 12)."""
        rng = random.Random(self._seeds[region] + 2)
        original = self.direct(region)
        answered = asyncio.create_task(self._first_answer(address, twin_gone))
        twin: AsyncClient | None = None
        try:
            while True:
                if twin is None and answered.done():
                    twin = answered.result()
                keys = self._twin_keys(region, rng)
                calls = [self._press_key(original, f"misrouted-{region}", k, set()) for k in keys]
                if twin is not None and not twin_gone.is_set():
                    who = twin_presser(region)
                    calls += [self._press_key(twin, who, key, set()) for key in keys]
                    calls += [self._press_queue(twin, who, level) for level in range(PRIORITIES)]
                await asyncio.gather(*calls)
                if await stopped(until, ROLLBACK_PRESS_INTERVAL_S):
                    return
        finally:
            answered.cancel()
            if twin is not None:
                await twin.close()

    def _twin_keys(self, region: str, rng: random.Random) -> list[str]:
        """Up to ``TWIN_KEYS`` backlog items homed at ``region``: half of them held (a
        copy that decided would grant over a live claim), the rest not (both processes
        would grant them; and the original, once it decides again, grants them above
        whatever either granted)."""
        homed = [k for k, home in self.workload.homes.items()
                 if home == region and f"/mem/{TOPIC}/" in k]  # fmt: skip
        mine = set(homed)
        held = list(dict.fromkeys(g.key for g in self.held() if g.key in mine))
        keys = held[: TWIN_KEYS // 2]
        free = [k for k in homed if k not in held]
        keys += rng.sample(free, min(len(free), TWIN_KEYS - len(keys)))
        return keys

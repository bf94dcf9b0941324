"""The work queue (SPEC §8): claim the next eligible item of a topic, reopen a
parked one, take a claim back.

``ClaimNext`` reads the pick index (``store.picks``) in pick order and tries each
candidate under its record's lock with the full rule (``queue.eligible``), so the
index saves reading every record and is never trusted for a grant. Callers that
wait for an item stand in one FIFO line per topic (``PickLines``): the line looks
whenever a record of the topic changes (a release, a new item, a merge) or a
deferral or lease of the topic ends, and each waiter picks with its own tags in
turn, so an item goes to the first waiter it suits and a waiter whose tags match
nothing blocks nobody. Grants are ``Claims``' grants: the same tokens, attempts,
signatures and waiter bounds.

A waiter may also ask to hear of items homed in other regions (``hint_elsewhere``:
the routing client's cross-region wait). Every record reaches this node's replica,
so a look that finds nothing here also reads the pick index of the other homes and
tells the first such waiter it suits of one eligible item there (``elsewhere``,
with the item): that waiter asks the item's home, the others go on waiting. An item
told of is not told of again for ``HINT_HOLD_S`` — the waiter's claim there, or its
failure, reaches this node meanwhile — so one new item in ``eu`` sends one waiter of
``us`` there, not all of them (docs/consistency.md, *Waiting across regions*).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fencemark.node.core.claims import LOOK_AGAIN_S, Claims
from fencemark.node.core.lines import Picker, PickLines
from fencemark.node.crdt import Record
from fencemark.node.crdt.record import DONE, FORCED
from fencemark.node.rules import queue, validation
from fencemark.node.rules.admission import Caller, Outcome, decide_claim, not_here
from fencemark.node.rules.errors import InvalidInput, Reason
from fencemark.node.store.picks import Pickable, scope_of
from fencemark.node.store.storage import Stored

log = logging.getLogger(__name__)

PICK_PAGE = 32  # candidates read from the pick index at a time
# An item homed elsewhere that one waiter was told of is told of to no other waiter
# for this long: its claim at the home (or that waiter's going) replicates back
# within it; after it, the next waiter it suits is told.
HINT_HOLD_S = 2.0
MAX_REASON_CHARS = 256  # of an operator's reason for a reopen or a force-release


@dataclass(frozen=True)
class Picked:
    """The answer to ``claim_next``, ``reopen`` or ``force_release``: the outcome,
    and the record as the call left it (None when nothing was changed)."""

    outcome: Outcome
    stored: Stored | None = None
    superseded: int = 0  # force_release: the token taken back


class WorkQueue:
    def __init__(self, claims: Claims) -> None:
        self.claims = claims
        self.replica = claims.replica
        # Callers waiting for an item, FIFO per topic.
        self._lines: PickLines[Picked] = PickLines(self._next_look_s)
        self._told: dict[str, float] = {}  # item homed elsewhere -> when a waiter was told
        self._hinting: Counter[str] = Counter()  # waiters to tell of items elsewhere, by topic
        self.hints = 0  # waiters told of an item elsewhere (metrics, tests)
        self.replica.on_change(self._changed)

    async def stop(self) -> None:
        """Before the storage closes: the topics' lines look no more."""
        await self._lines.stop()

    def _changed(self, key: str) -> None:
        self._lines.wake(key.rsplit("/", 1)[0] + "/")  # the topic's line looks again

    async def _next_look_s(self, scope: str) -> float:
        """Seconds until the topic's earliest deferral or lease ends (inf: none) —
        of the items homed here, and of those homed elsewhere that a waiter may be
        told of (their deferral ends with no write to say so)."""
        replica = self.replica
        now_ms = replica.wall_ms()
        ends = [await replica.next_pickable_ms(scope, now_ms)]
        if self._hinting[scope]:
            for home in await replica.other_homes(scope):
                ends.append(await replica.storage.next_pickable_ms(scope, home, now_ms))
        soonest = min((e for e in ends if e is not None), default=None)
        return float("inf") if soonest is None else (soonest - now_ms) / 1000 + LOOK_AGAIN_S

    async def claim_next(
        self,
        repo: str,
        topic: str,
        owner: str,
        *,
        caller: Caller,
        lease_seconds: float = 0.0,
        wait_seconds: float = 0.0,
        tags: Sequence[str] = (),
        client: str = "",
        on_wait: Callable[[], None] | None = None,
        hint_elsewhere: bool = False,
    ) -> Picked:
        """Claim the first eligible item of ``repo``/``topic`` homed here, or answer
        ``empty``; with ``wait_seconds``, wait in the topic's line that long first
        (within the same waiter bounds as ``Claims.claim``), and with
        ``hint_elsewhere`` hear of an eligible item homed in another region while
        waiting (``elsewhere``, module docstring). An owner that holds the live
        claim of an item of the topic (asking from an identity that acts for it)
        gets that item again, its lease extended: the retry of a lost reply."""
        scope = scope_of(validation.segment(repo, "repo"), validation.segment(topic, "topic"))
        validation.owner(owner)
        lease_ms = round(validation.lease(lease_seconds) * 1000)
        wait_s = validation.wait(wait_seconds)
        wanted = validation.tags(tags, "tags")
        self.claims.check_deciding()
        picked = await self._held(scope, owner, caller, lease_ms, wanted)
        if picked is None and self._lines.depth(scope) == 0:
            picked = await self._pick(scope, owner, caller, lease_ms, wanted)
        if picked is None and wait_s > 0:
            with self.claims.waiter(client, on_wait):
                picked = await self._wait_for_item(
                    scope, owner, caller, lease_ms, wanted, wait_s, hint_elsewhere=hint_elsewhere
                )
        elif picked is None and self._lines.depth(scope) > 0:
            # Callers are waiting: one look behind them, so that a newcomer takes only
            # what suits none of those ahead of it (it does not overtake).
            picked = await self._wait_for_item(scope, owner, caller, lease_ms, wanted, 0.0)
        if picked is None:
            picked = Picked(Outcome(False, Reason.EMPTY, home_region=self.replica.region))
        reason = picked.outcome.reason
        self.claims.outcomes["granted" if reason is None else reason.value] += 1
        return picked

    async def _pick(
        self, scope: str, owner: str, caller: Caller, lease_ms: int, tags: list[str]
    ) -> Picked | None:
        """Grant the first candidate of the pick index that is eligible under its lock.

        A candidate whose lock is taken — most often another caller being granted it
        right now — is passed over at first and tried only if nothing after it could
        be had: callers that all read the same first page then spread over its items
        instead of queueing on the first one's fsync, and a busy item that turns out
        to be free is still handed out rather than answered ``empty``."""
        after: Pickable | None = None
        passed: list[str] = []
        while True:
            page = await self.replica.picks(
                scope, self.replica.wall_ms(), after=after, limit=PICK_PAGE
            )
            for candidate in page:
                if self.replica.busy(candidate.key):
                    passed.append(candidate.key)
                    continue
                picked = await self._try(candidate.key, scope, owner, caller, lease_ms, tags)
                if picked is not None:
                    return picked
            if len(page) < PICK_PAGE:
                break
            after = page[-1]
        for key in passed:
            picked = await self._try(key, scope, owner, caller, lease_ms, tags)
            if picked is not None:
                return picked
        return None

    async def _held(
        self, scope: str, owner: str, caller: Caller, lease_ms: int, tags: list[str]
    ) -> Picked | None:
        """The item of ``scope`` whose live claim ``owner`` already holds, from an
        identity that acts for it, its lease extended: a ``ClaimNext`` retried after
        a lost reply is answered from the durable state, never with a second item
        (SPEC §4; as ``Claim``'s retry). None when the owner holds none."""
        replica = self.replica
        for key in await replica.held_by(scope, owner, replica.wall_ms()):

            def change(current: Record) -> tuple[Record, Outcome | None]:
                replica.check_gate(current)
                current = replica.lapse_if_due(current)
                now_ms = replica.wall_ms()
                if not queue.held_for_retry(current, region=replica.region, now_ms=now_ms,
                                            tags=tags):  # fmt: skip
                    return current, None
                fence, outcome = decide_claim(
                    current, owner, caller=caller, lease_ms=lease_ms, now_ms=now_ms,
                    hlc=replica.now_hlc(), region=replica.region, queued_ahead=False,
                    recovered_hlc=replica.recovered_hlc, life_hlc=replica.era_hlc,
                )  # fmt: skip
                if not outcome.ok:  # another identity's claim under the same owner name
                    return current, None
                return current.with_fence(fence), outcome  # the same token, extended

            stored, outcome = await replica.transact(
                key, change, decides=True, asserts=lambda o: o is not None and o.ok
            )
            if outcome is not None:
                return Picked(outcome, stored)
        return None

    async def _try(
        self, key: str, scope: str, owner: str, caller: Caller, lease_ms: int, tags: list[str]
    ) -> Picked | None:
        replica, claims = self.replica, self.claims
        found = await replica.find(key)
        if found is None:
            return None
        done = {item: await self._done(scope + item) for item in found.record.waits_on}

        def change(current: Record) -> tuple[Record, Outcome | None]:
            # The gate under the item's lock, not only as the call arrived: a caller
            # that waited in the topic's line is handed an item only by a node that
            # decides now (it may have napped, or come to owe a catch-up, meanwhile).
            replica.check_gate(current)
            current = replica.lapse_if_due(current)  # a lapse may park it
            now_ms = replica.wall_ms()
            if not queue.eligible(current, region=replica.region, now_ms=now_ms, tags=tags,
                                  done=lambda item: done.get(item, False)):  # fmt: skip
                return current, None
            fence, outcome = decide_claim(
                current,
                owner,
                caller=caller,
                lease_ms=lease_ms,
                now_ms=now_ms,
                hlc=replica.now_hlc(),
                region=replica.region,
                queued_ahead=claims.queue_depth(key) > 0,
                recovered_hlc=replica.recovered_hlc,
                life_hlc=replica.era_hlc,
            )
            if not outcome.ok:
                return current, None
            return claims.with_grant(current, fence), outcome

        stored, outcome = await replica.transact(key, change, decides=True)
        return None if outcome is None else Picked(outcome, stored)

    async def _done(self, key: str) -> bool:
        found = await self.replica.find(key)
        return found is not None and found.record.visible and found.record.status == DONE

    async def _wait_for_item(
        self,
        scope: str,
        owner: str,
        caller: Caller,
        lease_ms: int,
        tags: list[str],
        wait_s: float,
        *,
        hint_elsewhere: bool = False,
    ) -> Picked | None:
        """Stand in the topic's line up to ``wait_s`` seconds (0: for one look);
        ``hint_elsewhere``: a look that finds nothing here may tell of an item homed
        in another region instead."""

        async def give_back(picked: Picked) -> None:
            # Picked for a caller that left meanwhile: released at once rather than
            # held by nobody for a whole lease (docs/consistency.md, *Claims*).
            if picked.stored is None:
                return
            key = picked.stored.record.key
            if not picked.outcome.ok:  # told of an item elsewhere: tell the next waiter
                self._told.pop(key, None)
                self._lines.wake(scope)
                return
            await self.claims.withdraw(key, picked.outcome.token, caller=caller)

        async def try_pick() -> Picked | None:
            caller.still_allowed()  # revoked while it waited: refused, the next may have it
            picked = await self._pick(scope, owner, caller, lease_ms, tags)
            if picked is None and hint_elsewhere:
                picked = await self._elsewhere(scope, tags)
            return picked

        picker = Picker[Picked](
            # What a pick finds depends on the tags, and on whether it may tell of
            # items elsewhere.
            kind=(tuple(sorted(tags)), hint_elsewhere),
            once=wait_s <= 0,
            try_pick=try_pick,
            give_back=give_back,
        )
        self._hinting[scope] += hint_elsewhere
        try:
            return await self._lines.wait(scope, picker, wait_s)
        finally:
            self._hinting[scope] -= hint_elsewhere
            if not self._hinting[scope]:
                del self._hinting[scope]

    async def _elsewhere(self, scope: str, tags: list[str]) -> Picked | None:
        """An item of ``scope`` homed in another region that looks eligible to this
        node (its home decides), and that no waiter was told of in the last
        ``HINT_HOLD_S``: the answer ``elsewhere`` with it. None when there is none."""
        replica = self.replica
        now_ms, now = replica.wall_ms(), asyncio.get_running_loop().time()
        self._told = {k: t for k, t in self._told.items() if now - t < HINT_HOLD_S}
        for home in await replica.other_homes(scope):
            after: Pickable | None = None
            while True:
                page = await replica.storage.picks(scope, home, now_ms, after=after,
                                                   limit=PICK_PAGE)  # fmt: skip
                for candidate in page:
                    if candidate.key in self._told:
                        continue
                    found = await replica.find(candidate.key)
                    if found is None:
                        continue
                    record = found.record
                    finished = {i for i in record.waits_on if await self._done(scope + i)}
                    if queue.eligible(record, region=home, now_ms=now_ms, tags=tags,
                                      done=finished.__contains__):  # fmt: skip
                        self._told[candidate.key] = now
                        self.hints += 1
                        # Told of, it is told of again after the hold if still there.
                        asyncio.get_running_loop().call_later(HINT_HOLD_S, self._lines.wake, scope)
                        outcome = Outcome(False, Reason.ELSEWHERE, home_region=home,
                                          fence=record.fence.fence)  # fmt: skip
                        return Picked(outcome, found)
                if len(page) < PICK_PAGE:
                    break
                after = page[-1]
        return None

    async def reopen(self, key: str, reason: str, *, caller: Caller) -> Picked:
        """Make the item ``open`` again with no attempts counted (an operator's call)."""
        validation.key(key)
        why = _reason(reason)
        replica = self.replica

        def change(current: Record) -> tuple[Record, Outcome]:
            replica.check_gate(current)
            refusal = not_here(current, replica.region)
            if refusal is not None:
                return current, refusal
            stamp = replica.stamp(current.fence.fence)
            opened = replica.signed_queue(queue.reopened(current, stamp), stamp)
            return opened, Outcome(True, None, home_region=current.home_region,
                                   fence=current.fence.fence)  # fmt: skip

        stored, outcome = await replica.transact(
            key, change, note=why, actor=caller.identity, decides=True
        )
        if outcome.ok:
            log.info("reopened %s for %s: %s", key, caller.identity or "a caller", why)
        return Picked(outcome, stored if outcome.ok else None)

    async def force_release(self, key: str, reason: str, *, caller: Caller) -> Picked:
        """Take the live claim back: the fence moves past it, so its holder is
        refused ``superseded`` from now on (SPEC §8)."""
        validation.key(key)
        why = _reason(reason)
        replica = self.replica

        def change(current: Record) -> tuple[Record, tuple[Outcome, int]]:
            replica.check_gate(current)
            current = replica.lapse_if_due(current)
            refusal = not_here(current, replica.region)
            if refusal is not None:
                return current, (refusal, 0)
            home, fence = current.home_region, current.fence
            if not current.claim_live(replica.wall_ms()):
                return current, (Outcome(False, Reason.NO_CLAIM, home_region=home,
                                         fence=fence.fence), 0)  # fmt: skip
            token = fence.fence
            moved = current.with_fence(fence.move(token + 1))
            ended = replica.end_claim(moved, replica.stamp(token + 1), FORCED)
            return ended, (Outcome(True, None, home_region=home, fence=token + 1), token)

        stored, (outcome, token) = await replica.transact(
            key, change, note=why, actor=caller.identity, decides=True
        )
        if outcome.ok:
            log.info("took claim %d of %s back for %s: %s", token, key,
                     caller.identity or "a caller", why)  # fmt: skip
            self.claims.wake(key)
        return Picked(outcome, stored if outcome.ok else None, token)


def _reason(reason: str) -> str:
    if not 1 <= len(reason) <= MAX_REASON_CHARS or not reason.isprintable():
        raise InvalidInput.field(
            "reason", f"1-{MAX_REASON_CHARS} printable characters saying why, for the history"
        )
    return reason

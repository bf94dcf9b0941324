"""Claims: grant, renew and release leases, with a FIFO queue of waiters.

The decisions are ``admission``'s; this module adds what needs time and
memory: waiting in line for a claim, and reading a claim's status. The queue is
a hint kept in this node's memory; the record's durable state is the authority
and is re-checked whenever a waiter reaches the head of the line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass

from fencemark.node.core.lines import Lines
from fencemark.node.core.replica import Replica
from fencemark.node.crdt import FenceState, Grant, Record
from fencemark.node.crdt.record import DEFERRED
from fencemark.node.rules import queue, validation
from fencemark.node.rules.admission import (
    Caller,
    Outcome,
    acts_for,
    decide_claim,
    decide_fenced_release,
    decide_release,
    decide_renew,
    settled,
)
from fencemark.node.rules.errors import Exhausted, InvalidInput, Reason

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Status:
    """What this node knows of a record's claim; never authoritative. ``token`` is
    0 for a caller that does not act for the holder (``admission.acts_for``)."""

    holder: Grant | None
    token: int
    expiry_ms: int
    fence: int
    queue_depth: int
    home_region: str


MAX_WAITERS = 10_000  # callers waiting in claim queues, over every record and client
MAX_WAITERS_PER_CLIENT = 100  # of them from one client (certificate identity, or address)
LOOK_AGAIN_S = 0.001  # the head of the line looks again this long after a lease lapses


def until_lapse(record: Record | None, now_ms: int) -> float:
    """Seconds from ``now_ms`` until the live lease of ``record`` lapses, and
    ``LOOK_AGAIN_S`` more: when the head of the line looks at the claim again. Only
    ``LOOK_AGAIN_S`` when no lease is live (it lapsed since the claim was refused)."""
    if record is None or not record.claim_live(now_ms):
        return LOOK_AGAIN_S
    fence = record.fence  # live: its expiry is after now_ms
    return (fence.expiry(fence.fence) - now_ms) / 1000 + LOOK_AGAIN_S


class Claims:
    def __init__(
        self,
        replica: Replica,
        *,
        max_waiters: int = MAX_WAITERS,
        max_waiters_per_client: int = MAX_WAITERS_PER_CLIENT,
    ) -> None:
        self.replica = replica
        self.max_waiters = max_waiters
        self.max_waiters_per_client = max_waiters_per_client
        self._lines = Lines()  # claimers waiting for a record, FIFO per key
        self._waiting_by_client: Counter[str] = Counter()
        # Claim outcomes decided here ("granted" or the reason) and queue entries:
        # read by the metrics collector (fencemark.node.api.telemetry).
        self.outcomes: Counter[str] = Counter()
        self.waits = 0
        self.waiting_total = 0  # callers in ``waiter``: for a record or a topic's items
        # At a member of a region of several: merge a record's state from the fellow
        # members (``replication.majority.Majority.look_up``).
        self.look_up: Callable[[str], Awaitable[None]] | None = None

    @property
    def waiting(self) -> int:
        """Callers waiting in line, over every record and topic (``ClaimNext``)."""
        return self.waiting_total

    @property
    def clients_waiting(self) -> int:
        """Clients with at least one caller waiting in line."""
        return len(self._waiting_by_client)

    @property
    def deciding(self) -> bool:
        """Whether this node decides claims now (``Replica.deciding``; on the wire,
        ``claims_serving`` and the Claims service's health)."""
        return self.replica.deciding

    def queue_depth(self, key: str) -> int:
        return self._lines.depth(key)

    async def claim(
        self,
        key: str,
        owner: str,
        *,
        caller: Caller,
        lease_seconds: float = 0.0,
        wait_seconds: float = 0.0,
        client: str = "",
        on_wait: Callable[[], None] | None = None,
    ) -> Outcome:
        """Grant, or say why not; with ``wait_seconds``, wait in line that long first.

        Waiting is bounded: beyond ``max_waiters`` in all, or
        ``max_waiters_per_client`` from one ``client``, a caller that would wait
        is refused with :class:`Exhausted` instead of queueing. ``on_wait`` is
        called as the caller joins the line (the server stops counting the call
        against its budget of calls in flight: the waiter limits bound it).
        """
        validation.key(key)
        validation.owner(owner)
        lease_ms = round(validation.lease(lease_seconds) * 1000)
        wait_s = validation.wait(wait_seconds)
        ahead = self.queue_depth(key) > 0
        outcome, _ = await self._try(key, owner, caller, lease_ms, queued_ahead=ahead)
        if outcome.reason is Reason.MISSING and self.look_up is not None:
            # At a deciding member (only one decides; the others redirect): a write
            # acknowledged by a majority it is not in may not have reached it yet, and
            # a claim sent on to it right after that write would be answered missing.
            await self.look_up(key)
            outcome, _ = await self._try(key, owner, caller, lease_ms, queued_ahead=ahead)
        if not (outcome.ok or outcome.reason is not Reason.CONTENDED or wait_s == 0):
            with self.waiter(client, on_wait):
                outcome = await self._wait_in_line(
                    key, owner, caller, lease_ms, wait_s, outcome.home_region
                )
        self.outcomes["granted" if outcome.reason is None else outcome.reason.value] += 1
        return outcome

    @contextlib.contextmanager
    def waiter(self, client: str, on_wait: Callable[[], None] | None) -> Iterator[None]:
        """One more caller waiting (for a record, or for an item of a topic), within
        ``max_waiters`` in all and ``max_waiters_per_client`` from ``client``, or
        :class:`Exhausted`; its place is given back when it stops waiting."""
        if self.waiting_total >= self.max_waiters:
            raise Exhausted("claim waiters", self.max_waiters)
        if self._waiting_by_client[client] >= self.max_waiters_per_client:
            raise Exhausted("claim waiters from one client", self.max_waiters_per_client)
        self.waits += 1
        self.waiting_total += 1
        self._waiting_by_client[client] += 1
        if on_wait is not None:
            on_wait()
        try:
            yield
        finally:
            self.waiting_total -= 1
            self._waiting_by_client[client] -= 1
            if not self._waiting_by_client[client]:
                del self._waiting_by_client[client]

    async def _wait_in_line(
        self, key: str, owner: str, caller: Caller, lease_ms: int, wait_s: float, home: str
    ) -> Outcome:
        async def at_head() -> tuple[Outcome | None, float]:
            nonlocal home
            caller.still_allowed()  # revoked while it waited: refused, the next may have it
            outcome = await self._try_at_head(key, owner, caller, lease_ms)
            if outcome.ok or outcome.reason is not Reason.CONTENDED:
                return outcome, 0.0
            home = outcome.home_region
            # Held by someone else: look again when that lease lapses, or earlier if
            # it is released (``wake``).
            stored = await self.replica.find(key)
            record = None if stored is None else stored.record
            return None, until_lapse(record, self.replica.wall_ms())

        outcome = await self._lines.wait(key, owner, wait_s, at_head)
        return outcome if outcome is not None else Outcome(False, Reason.TIMEOUT, home_region=home)

    async def _try_at_head(self, key: str, owner: str, caller: Caller, lease_ms: int) -> Outcome:
        """``_try`` for the head of the line, whose caller may leave meanwhile.

        A waiter is granted whenever the holder lets go, which is when its caller
        is likeliest to have given up. Cancelled while its grant is being made
        durable, it would never hear of the token, and the claim would sit with
        nobody for a whole lease while the line behind starves (docs/consistency.md,
        *Claims*). So the attempt runs to its end, and a token it newly granted is
        withdrawn before the cancellation goes on (an owner's live claim that it
        merely extended is left alone).
        """
        attempt = asyncio.create_task(self._try(key, owner, caller, lease_ms, queued_ahead=False))
        try:
            outcome, _ = await asyncio.shield(attempt)
        except asyncio.CancelledError:
            try:
                outcome, granted = await attempt
                if granted:
                    await self.withdraw(key, outcome.token, caller=caller)
            except Exception:  # the lease still lapses on its own
                log.exception("withdrawing %s, granted to a caller that left, failed", key)
            raise
        return outcome

    async def _try(
        self, key: str, owner: str, caller: Caller, lease_ms: int, *, queued_ahead: bool
    ) -> tuple[Outcome, bool]:
        """Decide a claim at this moment; also say whether it granted a new token."""
        replica = self.replica

        def change(current: Record) -> tuple[Record, tuple[Outcome, bool]]:
            # The gate under the record's lock, not only as the call arrived: a waiter
            # reaching the head of the line is granted only by a node that decides now.
            replica.check_gate(current)
            current = replica.lapse_if_due(current)  # the lapse counts as an attempt's end
            fence, outcome = decide_claim(
                current,
                owner,
                caller=caller,
                lease_ms=lease_ms,
                now_ms=replica.wall_ms(),
                hlc=replica.now_hlc(),
                region=replica.region,
                queued_ahead=queued_ahead,
                recovered_hlc=replica.recovered_hlc,
                life_hlc=replica.era_hlc,
            )
            granted = fence.fence != current.fence.fence
            if not granted:
                return current.with_fence(fence), (outcome, False)
            return self.with_grant(current, fence), (outcome, True)

        # A retry answered from the state as it is (its lease already as asked).
        _, result = await replica.transact(key, change, decides=True, asserts=lambda r: r[0].ok)
        return result

    def with_grant(self, record: Record, fence: FenceState) -> Record:
        """``record`` with the new grant that ``fence`` holds: signed by this (home)
        node before it is durable, and counted as one attempt (SPEC §8; ``withdraw``
        gives it back)."""
        replica = self.replica
        if replica.signer is not None:
            fence = replica.signer.sign_fence(record.key, fence)
        stamp = replica.stamp(fence.fence)
        return replica.signed_queue(queue.granted(record.with_fence(fence), stamp), stamp)

    async def renew(
        self, key: str, token: int, *, caller: Caller, lease_seconds: float = 0.0
    ) -> Outcome:
        validation.key(key)
        _token(token)
        lease_ms = round(validation.lease(lease_seconds) * 1000)
        replica = self.replica

        def change(current: Record) -> tuple[Record, Outcome]:
            replica.check_gate(current)
            fence, outcome = decide_renew(
                current,
                token,
                caller=caller,
                lease_ms=lease_ms,
                now_ms=replica.wall_ms(),
                region=replica.region,
            )
            return current.with_fence(fence), outcome

        _, outcome = await replica.transact(key, change, decides=True, asserts=_ok)
        return outcome

    async def release(
        self,
        key: str,
        token: int,
        *,
        caller: Caller,
        outcome: str = "",
        fields: Mapping[str, str] | None = None,
        retry_after_seconds: float = 0.0,
    ) -> Outcome:
        """Release ``token``'s claim. With an ``outcome`` (``done``, ``failed``,
        ``deferred``) or ``fields``, the release is the holder's last fenced write:
        the fields, the queue state and the release are one commit under the token,
        refused (as a value) unless the token is the live claim (SPEC §8)."""
        validation.key(key)
        _token(token)
        ending = _outcome(outcome)
        written = validation.fields(fields or {})
        retry_after_ms = _retry_after(ending, retry_after_seconds)
        replica = self.replica

        def change(current: Record) -> tuple[Record, Outcome]:
            replica.check_gate(current)
            if not ending and not written:
                fence, plain = decide_release(current, token, caller=caller, region=replica.region)
                return current.with_fence(fence), plain
            current = replica.lapse_if_due(current)
            now_ms = replica.wall_ms()
            problem = decide_fenced_release(current, token, caller=caller,
                                            region=replica.region, now_ms=now_ms)  # fmt: skip
            if problem is not None:
                if problem.reason is Reason.RELEASED and queue.already_ended(
                    current, token, ending, written
                ):
                    return current, settled(current, token)  # a retry whose answer was lost
                return current, problem
            stamp = replica.stamp(token)
            changed = current.set_fields(written, stamp)
            validation.record_size(changed, "fields")
            if ending:
                changed = replica.end_claim(changed, stamp, ending,
                                            not_before_ms=now_ms + retry_after_ms)  # fmt: skip
            changed = replica.signed_queue(changed, stamp)
            return changed.with_fence(changed.fence.release(token)), settled(changed, token)

        # A retry whose answer was lost is answered from the state: acknowledged again.
        _, answer = await self.replica.transact(key, change, decides=True, asserts=_ok)
        if answer.ok:
            self.wake(key)
        return answer

    async def withdraw(self, key: str, token: int, *, caller: Caller) -> Outcome:
        """Release ``token``, granted to a caller that left before it heard of it, and
        give its attempt back (``queue.withdrawn``) in the same commit: the item is
        handed back as it was, but for the spent token. Only the live claim of
        ``token`` is withdrawn; anything else is a plain release's answer."""
        replica = self.replica

        def change(current: Record) -> tuple[Record, Outcome]:
            replica.check_gate(current)
            fence, answer = decide_release(current, token, caller=caller, region=replica.region)
            live = token == current.fence.fence and not current.fence.ended(token)
            if not answer.ok or not live:  # superseded, or ended with its attempt counted
                return current.with_fence(fence), answer
            stamp = replica.stamp(token)
            changed = replica.signed_queue(queue.withdrawn(current, stamp), stamp)
            return changed.with_fence(fence), answer

        _, answer = await replica.transact(key, change, decides=True)
        if answer.ok:
            self.wake(key)
        return answer

    def wake(self, key: str) -> None:
        """The claim of ``key`` ended: the head of its line may take it now."""
        self._lines.wake(key)

    async def status(self, key: str, *, caller: Caller) -> Status:
        """The claim as this node sees it; the live token only for a caller that
        acts for its holder (docs/security.md, *Claims are bound to identities*)."""
        stored = await self.replica.get(key)
        fence: FenceState = stored.record.fence
        live = stored.record.claim_live(self.replica.wall_ms())
        holder = fence.holder() if live else None
        return Status(
            holder=holder,
            token=fence.fence if holder is not None and acts_for(caller, holder) else 0,
            expiry_ms=fence.expiry(fence.fence) if holder is not None else 0,
            fence=fence.fence,
            queue_depth=self.queue_depth(key),
            home_region=stored.record.home_region,
        )

    def check_deciding(self) -> None:
        self.replica.gate.check()


def _ok(outcome: Outcome) -> bool:
    """Whether ``outcome`` answers yes (``Replica.transact``'s ``asserts``)."""
    return outcome.ok


def _outcome(outcome: str) -> str:
    if outcome not in queue.RELEASE_OUTCOMES:
        words = ", ".join(repr(word) for word in queue.RELEASE_OUTCOMES)
        raise InvalidInput.field("outcome", f"an outcome is one of {words}, got {outcome!r}")
    return outcome


def _retry_after(ending: str, seconds: float) -> int:
    """Milliseconds a ``deferred`` release keeps the item back; 0 for the others."""
    if ending != DEFERRED:
        if seconds:
            raise InvalidInput.field(
                "retry_after_seconds", "only a deferred release takes retry_after_seconds"
            )
        return 0
    if not (math.isfinite(seconds) and 0 <= seconds <= queue.MAX_RETRY_AFTER_S):
        raise InvalidInput.field(
            "retry_after_seconds",
            f"between 0 and {queue.MAX_RETRY_AFTER_S} seconds, got {seconds}",
        )
    return round(seconds * 1000)


def _token(token: int) -> None:
    if token <= 0:
        raise InvalidInput.field("fencing_token", "a fencing token is a positive integer")

"""One decider per region, elected through etcd; a decider in doubt stops.

The model is etcd's own ``client/v3/concurrency`` (a session's lease kept alive, the
leader key's create revision as the leader's identity), with the lesson Kubernetes'
leader election states plainly: an election does not guarantee that only one
process acts as leader. So:

- The decider holds the region's decider key, created under its own lease; the
  key's create revision is its **term**. Every other member watches the key and
  names the decider to its callers.
- It decides only while ``deciding()``: until ``DECIDE_SHARE`` of the lease's TTL
  after the *send* time of the last renewal etcd answered, by its own monotonic
  clock. etcd expires the lease a whole TTL after it *received* that renewal, so
  the decider has stopped before anyone else can be elected, unless its clock runs
  more than a third slow (the margin for clock-rate drift). A stalled loop, a paused
  process, an unreachable etcd all end in the same place: the time runs out.
- Once in doubt it does not come back on the same term: it lets the lease go and
  campaigns anew, so a decider always starts a term with the catch-up a new term
  owes (``fencemark.node.core.grant_gate``).
- A decider must reach its fellow members too: one whose calls a majority of them
  (itself counted) has not answered for a while (``reaches``) could get nothing
  acknowledged, yet etcd would keep it elected as long as it reaches etcd. It steps
  aside, and campaigns again only once it reaches a majority, so the members that do
  elect one of their own (as Raft's leaders check their quorum, and its candidates
  pre-vote).
- Fencing tokens, not the election, make a stale decider harmless: a new term's
  first grant on each record jumps above anything an earlier term could have
  granted (the recovery floor, keyed to the term).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from fencemark.node.coordination.etcd import Entry, Etcd, EtcdError, entry_of

log = logging.getLogger(__name__)

DECIDE_SHARE = 2 / 3  # of the TTL, from a renewal's send time, that a decider decides
RENEW_SHARE = 1 / 4  # of the TTL between two renewals
DEFAULT_TTL_S = 2
KEY_PREFIX = b"/fencemark/regions/"


def decider_key(region: str) -> bytes:
    return KEY_PREFIX + region.encode() + b"/decider"


@dataclass(frozen=True)
class Decider:
    """Who decides for a region now, as the decider key says."""

    member: str
    address: str  # where clients reach it
    term: int  # the key's create revision

    @classmethod
    def of(cls, entry: Entry) -> Decider:
        said = json.loads(entry.value)
        return cls(str(said["member"]), str(said["address"]), entry.create_revision)


@dataclass
class LeaseClock:
    """Until when a decider may decide, on its own monotonic clock."""

    ttl_s: float
    until: float = 0.0

    def renewed(self, sent_at: float, ttl_s: float) -> None:
        """etcd answered a renewal sent at ``sent_at`` with a TTL of ``ttl_s``."""
        self.until = max(self.until, sent_at + ttl_s * DECIDE_SHARE)

    def deciding(self, now: float) -> bool:
        return now < self.until

    def stop(self) -> None:
        self.until = 0.0


class Campaign:
    """A member's part in its region's election: campaign, hold the key while the
    lease lasts, stop at the first doubt, campaign again; meanwhile know who decides.

    ``on_term`` is called with the new term when this member becomes decider, and
    ``on_stop`` when it stops deciding (before the lease can have expired).
    ``reaches`` says whether a majority of the region's members answered this one
    lately: it campaigns only then, and steps aside as soon as it is not."""

    def __init__(
        self,
        etcd: Etcd,
        region: str,
        member: str,
        address: str,
        *,
        ttl_s: int = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
        on_term: Callable[[int], None] = lambda term: None,
        on_stop: Callable[[], None] = lambda: None,
        reaches: Callable[[], bool] = lambda: True,
    ) -> None:
        self.etcd = etcd
        self.region = region
        self.member = member
        self.address = address
        self.ttl_s = ttl_s
        self.clock = clock
        self.on_term = on_term
        self.on_stop = on_stop
        self.reaches = reaches
        self.aside = False  # not campaigning: too few members answer this one
        self.key = decider_key(region)
        self.lease_clock = LeaseClock(ttl_s)
        self.term = 0  # this member's term while it holds the key, else 0
        self.decider: Decider | None = None  # who decides, as last seen
        self._task: asyncio.Task[None] | None = None
        self._lease = 0
        # Leases this member let go of while etcd could not be told: revoked as soon as
        # it can be, so that a successor need not wait for them to expire.
        self._unrevoked: list[int] = []

    def deciding(self) -> bool:
        """Whether this member may decide now (checked at each decision)."""
        return self.term > 0 and self.lease_clock.deciding(self.clock())

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"campaign {self.region}")

    async def stop(self) -> None:
        """Stop campaigning; a decider lets its key go at once, for a fast successor."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._end_term()
        self._let_go()
        await self._revoke_left()

    async def _run(self) -> None:
        while True:
            try:
                await self._campaign_once()
            except EtcdError as exc:
                log.warning("region %s: etcd: %s", self.region, exc)
                self.decider = None  # unknown until etcd answers again: named to nobody
                self._end_term()
                self._let_go()  # a create whose answer was lost may hold the key
                await asyncio.sleep(self.ttl_s * RENEW_SHARE)

    async def _campaign_once(self) -> None:
        await self._revoke_left()
        if not self.reaches():
            await self._stand_aside()
            return
        if self.aside:
            self.aside = False
            log.info("region %s: member %s reaches a majority of its members again and"
                     " campaigns", self.region, self.member)  # fmt: skip
        sent_at = self.clock()
        self._lease, ttl = await self.etcd.grant(self.ttl_s)
        said = json.dumps({"member": self.member, "address": self.address}).encode()
        created = await self.etcd.create(self.key, said, self._lease)
        if created.entry is not None:
            self.decider = Decider.of(created.entry)
        if created.created and created.entry is not None:
            self.lease_clock.renewed(sent_at, ttl)
            await self._hold(created.entry.create_revision)
        else:
            self._let_go()
            await self._revoke_left()
            await self._follow(created.entry)

    async def _stand_aside(self) -> None:
        """Too few members answer this one: it does not campaign (it would be elected
        for nothing), and only reads who decides, a renewal interval at a time."""
        if not self.aside:
            self.aside = True
            log.warning(
                "region %s: member %s does not reach a majority of its members: it does"
                " not campaign until it does", self.region, self.member,
            )  # fmt: skip
        entry = await self.etcd.get(self.key)
        decider = Decider.of(entry) if entry is not None else None
        self.decider = decider if decider is not None and decider.member != self.member else None
        await asyncio.sleep(self.ttl_s * RENEW_SHARE)

    async def _hold(self, term: int) -> None:
        """Decide while the lease lasts and the key is ours; return at the first doubt."""
        self.term = term
        log.info("region %s: member %s decides, term %d", self.region, self.member, term)
        self.on_term(term)
        try:
            while self.lease_clock.deciding(self.clock()):
                await asyncio.sleep(self.ttl_s * RENEW_SHARE)
                sent_at = self.clock()
                try:
                    ttl = await self.etcd.keep_alive(self._lease)
                    entry = await self.etcd.get(self.key)
                except EtcdError as exc:
                    log.warning("region %s: renewing the decider lease: %s", self.region, exc)
                    continue  # the clock decides when to stop
                if ttl <= 0 or entry is None or entry.create_revision != term:
                    log.warning(
                        "region %s: member %s lost the decider key (term %d)",
                        self.region, self.member, term,
                    )  # fmt: skip
                    return
                if not self.reaches():
                    log.warning(
                        "region %s: member %s steps aside (term %d): too few of its"
                        " members answer it to acknowledge anything",
                        self.region, self.member, term,
                    )  # fmt: skip
                    self.decider = None  # itself no longer; whoever is elected next
                    return
                self.lease_clock.renewed(sent_at, ttl)
        finally:
            self._end_term()
            self._let_go()
            await self._revoke_left()

    def _let_go(self) -> None:
        """The lease in hand is to be revoked (``_revoke_left``), and no longer held."""
        if self._lease:
            self._unrevoked.append(self._lease)
            self._lease = 0

    async def _revoke_left(self) -> None:
        """Revoke the leases let go of before; those etcd cannot be told of yet stay."""
        for lease in list(self._unrevoked):
            try:
                await self.etcd.revoke(lease)
            except EtcdError as exc:
                if exc.code is None or exc.code.name != "NOT_FOUND":
                    return  # etcd away: later
            self._unrevoked.remove(lease)

    async def _follow(self, entry: Entry | None) -> None:
        """Until the decider key is gone (or etcd is in doubt): know who decides."""
        if entry is None:
            return
        async for events in self.etcd.changes(self.key, entry.mod_revision):
            for event in events:
                if event.type == 1:  # DELETE: the decider's lease ended, or it let go
                    self.decider = None
                    return
                self.decider = Decider.of(entry_of(event.kv))

    def _end_term(self) -> None:
        if self.term:
            self.term = 0
            self.lease_clock.stop()
            self.on_stop()

"""A node as one member of a region of several (SPEC §10): its campaign for the
region's decider key, what the grant gate asks of it before every decision, and its
entry among the region's members (``registry``), from which it learns its fellow
members to replicate with.

The member is the gate's ``role`` (``fencemark.node.core.grant_gate.Role``). While its
campaign holds the key and its lease clock runs (``decider.Campaign.deciding``), it
decides in the key's term — once it has caught up: at the start of each term it holds
the states of a majority of the region's members (a complete anti-entropy round with
enough of them, ``catch_up``) before its first decision, so every acknowledged grant,
renewal and release of an earlier term is in its hands. A member whose file may lack
what it acknowledged (new, emptied or restored, under a name that served before)
counts for none of them, and campaigns only once it has caught up itself. Each new
term starts an era of tokens above every earlier term's (``GrantGate.new_term``),
acknowledged or not. Otherwise a deciding call is refused: with a redirect naming
the decider's address when another member holds the key (``NotDecider``), else
``NotServing`` with a retry hint of one lease time — an election or a catch-up under
way, etcd unreachable, or this member's own lease in doubt.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from fencemark.node.coordination.decider import DEFAULT_TTL_S, Campaign, Decider
from fencemark.node.coordination.etcd import Etcd
from fencemark.node.coordination.registry import Registered, Registry
from fencemark.node.core.grant_gate import GrantGate
from fencemark.node.rules.errors import NotDecider, NotServing
from fencemark.node.rules.validation import REGION
from fencemark.node.security.tls import TlsFiles

log = logging.getLogger(__name__)

MAX_TTL_S = 60  # a longer lease only lengthens the failover
# A member none of whose calls a majority of its members answered within this many
# lease times does not campaign, and a decider steps aside (``Campaign.reaches``):
# every fellow is called at least once a second, so two lease times (two seconds
# at least) is a lost link, not a slow answer.
REACH_TTLS = 2


@dataclass(frozen=True)
class MemberConfig:
    """How a node takes part in its region's election: its name among the region's
    members, the etcd endpoints and the TLS material it reaches them with, and the
    decider lease's TTL."""

    name: str
    etcd: Sequence[str]
    etcd_tls: TlsFiles | None
    ttl_s: int = DEFAULT_TTL_S
    # The region's member set, made in etcd by the first member to start when the
    # region has none (``registry``); () for a member joining a region that has one.
    initial: Sequence[str] = ()

    def problem(self) -> str:
        """What is wrong with this configuration, naming the field; "" if nothing.
        Checked before the node opens anything (``NodeServer.start``)."""
        if REGION.fullmatch(self.name) is None:
            return f"member: a member's name must match {REGION.pattern}, got {self.name[:100]!r}"
        if not self.etcd:
            return "member.etcd: no endpoint: the members of a region elect their decider there"
        if not 1 <= self.ttl_s <= MAX_TTL_S:
            return f"member.ttl_s: the decider lease takes 1 to {MAX_TTL_S} s, got {self.ttl_s}"
        for name in self.initial:
            if REGION.fullmatch(name) is None:
                pattern = REGION.pattern
                return f"member.initial: a member's name must match {pattern}, got {name[:100]!r}"
        if self.initial and self.name not in self.initial:
            listed = list(self.initial)
            return f"member.initial: the set {listed} leaves out this member, {self.name!r}"
        return ""


class Member:
    """This node's part in its region's election, as the grant gate's ``role``."""

    def __init__(
        self,
        config: MemberConfig,
        region: str,
        gate: GrantGate,
        *,
        max_clock_offset_ms: int,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.config = config
        self.region = region
        self.name = config.name
        self.etcd = Etcd(config.etcd, config.etcd_tls)
        self._gate = gate
        self._offset_ms = max_clock_offset_ms
        self._on_change = on_change
        self.campaign: Campaign | None = None
        self.registry: Registry | None = None
        self.caught_up_term = 0  # the term whose catch-up with a majority is done
        self._catch_up: Callable[[], Awaitable[None]] | None = None
        # Whether a majority answered it within a time (``start``); until then, yes.
        self._reaches: Callable[[float], bool] = lambda within_s: True
        self._catching_up: asyncio.Task[None] | None = None
        self._starting: asyncio.Task[None] | None = None
        # Set once the file owes no catch-up (``file_caught_up``): a member campaigns then.
        self._file_caught_up = asyncio.Event()
        if not gate.owed:
            self._file_caught_up.set()
        gate.role = self  # from now on, and before the node listens: no decision until elected

    def start(
        self,
        address: str,
        peer_address: str,
        on_members: Callable[[Mapping[str, Registered]], Awaitable[None]],
        catch_up: Callable[[], Awaitable[None]],
        first_life: Callable[[], Awaitable[None]],
        reaches: Callable[[float], bool] = lambda within_s: True,
    ) -> None:
        """Register (clients reach this member at ``address``, its fellow members at
        ``peer_address``) and campaign; ``on_members`` hears of the other members
        each time they change; ``catch_up`` returns once this member holds the states
        of a majority of them (awaited at the start of each term). A member on a new,
        emptied or restored file campaigns only once it has caught up; when its name
        serves for the first time (``Registry.first_life``) it acknowledged nothing
        before, and says so (``first_life``). ``reaches(within_s)``: whether enough
        members answered this one within ``within_s`` to make a majority with it; it
        campaigns only then, and a decider steps aside when not (``REACH_TTLS``)."""
        self._catch_up = catch_up
        self._reaches = reaches
        self.registry = Registry(
            self.etcd,
            self.region,
            Registered(self.name, address, peer_address),
            ttl_s=self.config.ttl_s,
            on_change=on_members,
            initial=self.config.initial,
        )
        self.registry.start()
        campaign = self.campaign = Campaign(
            self.etcd,
            self.region,
            self.name,
            address,
            ttl_s=self.config.ttl_s,
            on_term=self._new_term,
            on_stop=self._on_change,
            reaches=self._reached,
        )
        registry, gate = self.registry, self._gate

        async def campaign_once_registered() -> None:
            await registry.registered.wait()  # a second process with this name never does
            if registry.first_life:
                await first_life()
            elif gate.owed:
                log.warning(
                    "region %s: member %s starts on a new, emptied or restored file:"
                    " it catches up with a majority of its fellow members before it"
                    " campaigns, and counts for no majority's states until then",
                    self.region, self.name,
                )  # fmt: skip
            await self._file_caught_up.wait()
            campaign.start()

        self._starting = asyncio.create_task(campaign_once_registered())

    def file_caught_up(self) -> None:
        """This member's file owes no catch-up any more (``GrantGate.caught_up``)."""
        self._file_caught_up.set()

    async def stop(self) -> None:
        """Stop deciding, let the key go for a fast successor, close etcd's channels."""
        if self._catching_up is not None:
            self._catching_up.cancel()
        if self._starting is not None:
            self._starting.cancel()
        if self.campaign is not None:
            await self.campaign.stop()
        if self.registry is not None:
            await self.registry.stop()
        await self.etcd.close()

    def _new_term(self, term: int) -> None:
        self._gate.new_term(term, self._offset_ms)
        if self._catching_up is not None:
            self._catching_up.cancel()
        self._catching_up = asyncio.create_task(self._caught_up(term))

    async def _caught_up(self, term: int) -> None:
        """Decide in ``term`` once caught up with a majority (``catch_up``)."""
        if self._catch_up is not None:
            await self._catch_up()
        campaign = self.campaign
        if campaign is not None and campaign.term == term:
            self.caught_up_term = term
            log.info("region %s: member %s caught up; deciding in term %d",
                     self.region, self.name, term)  # fmt: skip
            self._on_change()

    def decider(self) -> Decider | None:
        """The region's decider as this member knows it now (None: none known)."""
        campaign = self.campaign
        if campaign is None:
            return None
        if self._deciding():
            return Decider(self.name, campaign.address, campaign.term)
        if campaign.deciding():
            return None  # elected, catching up: nobody decides yet
        return campaign.decider if campaign.term == 0 else None  # in doubt: nobody

    def cut_off(self) -> bool:
        """Whether too few members answered this one lately to make a majority (its
        member set read): it does not campaign, and would step aside as decider."""
        return bool(self.configured()) and not self._reached()

    def _reached(self) -> bool:
        """Whether a majority answered this member within ``REACH_TTLS`` lease times."""
        return self._reaches(self.config.ttl_s * REACH_TTLS)

    def configured(self) -> tuple[str, ...]:
        """The region's configured member set as last read from etcd (() before)."""
        return self.registry.configured if self.registry is not None else ()

    def _deciding(self) -> bool:
        """Holding the key, by the lease clock, and caught up in its term."""
        campaign = self.campaign
        return campaign is not None and campaign.deciding() and self.caught_up_term == campaign.term

    def term(self) -> int:
        """The term this member decides in now; 0 when it does not decide."""
        campaign = self.campaign
        return campaign.term if campaign is not None and self._deciding() else 0

    def check(self) -> None:
        """Raise unless this member decides now: ``NotDecider`` naming the member that
        does, or ``NotServing`` when none is known to."""
        campaign = self.campaign
        if self._deciding():
            return
        retry_ms = self.config.ttl_s * 1000
        if campaign is not None and campaign.deciding():
            raise NotServing(
                f"this member was elected decider of region {self.region!r} (term"
                f" {campaign.term}) and first catches up with a majority of its members",
                retry_after_ms=retry_ms,
            )
        if campaign is not None and campaign.term:
            raise NotServing(
                f"this member's decider lease for region {self.region!r} is in doubt (etcd"
                " has not answered its renewals): it decides nothing until it holds the"
                " lease anew",
                retry_after_ms=retry_ms,
            )
        decider = campaign.decider if campaign is not None else None
        if decider is not None and decider.member != self.name:
            raise NotDecider(self.region, decider.member, decider.address, decider.term)
        if campaign is not None and campaign.aside:
            raise NotServing(
                f"this member does not reach a majority of region {self.region!r}'s members"
                " (cut off from them): it decides nothing, and no decider is known to it",
                retry_after_ms=retry_ms,
            )
        raise NotServing(
            f"no member decides for region {self.region!r} now (an election under way, or"
            " etcd unreachable); reads, the feed and unfenced writes go on",
            retry_after_ms=retry_ms,
        )

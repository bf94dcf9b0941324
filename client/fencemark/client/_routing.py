"""Where a call goes: the default target, or the record's home region (SPEC §4).

Claims, renewals, releases and fenced writes are decided only by the node of
the record's home region; every other node answers ``wrong_region`` and names
the home. So the client routes:

- reads (get, list, claim_status, info, health) and unfenced writes go to
  ``target``, the local region;
- home-only calls (claim, renew, release, fenced update/delete/remember, and
  ``remember`` with a ``homeRegion:R`` tag, since a new record is born in its
  home) go to the record's home when the client knows it (from the tag, or
  cached from an earlier answer) and ``regions`` maps it to an address;
  otherwise to ``target``;
- a ``wrong_region`` answer (a claim/renew/release value, or a ``WrongRegion``
  refusal, which is a ``ClaimConflict``) naming a home that ``regions`` maps is followed
  once: the same call is re-sent there, within the same deadline. Any other
  answer, or a home not in ``regions``, reaches the caller unchanged.
  Re-sending is safe even for ``update``: a ``wrong_region`` refusal changed
  nothing.

A region of several members decides at one of them, its decider (SPEC §10); every
other member answers a deciding call ``NOT_DECIDER`` naming the decider's address
(``NotDecider``), having done nothing. The client re-sends the call there within the
same deadline, and from then on sends the deciding calls meant for the member that
redirected it to that decider (``via``), until another redirect names another; a
remembered decider that cannot be reached is forgotten and the member asked again
(``forget``), which names the new one after a failover.

The router keeps the state this needs: one channel per address, opened on
first use, a cache of each key's home, filled from every answer that
names it, and the decider each redirecting address named. A record's home never
changes after creation (SPEC §2), so a cached home is never stale; the cache is
bounded only to keep memory flat.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2

from fencemark.client.errors import ClaimConflict
from fencemark.client.retry import channel_options
from fencemark.client.types import (
    ClaimResult,
    ClaimStatus,
    ForceReleaseResult,
    History,
    Record,
    ReleaseResult,
    RememberResult,
    RenewResult,
    ReopenResult,
)
from fencemark.v1 import claims_pb2_grpc, node_pb2_grpc, records_pb2_grpc

__all__ = ["HOME_CACHE_SIZE", "Router", "Stubs", "home_named", "home_tag"]

WRONG_REGION = "wrong_region"
HOME_TAG_PREFIX = "homeRegion:"
HOME_CACHE_SIZE = 10_000  # keys whose home is remembered; the oldest learnt goes first

_HEALTH_CHECK = "/grpc.health.v1.Health/Check"


def home_named(answer: object) -> tuple[str, bool]:
    """The home region an answer (or refusal) names, and whether it says ``wrong_region``."""
    match answer:
        case (
            ClaimResult()
            | RenewResult()
            | ReleaseResult()
            | ReopenResult()
            | ForceReleaseResult()
            | ClaimConflict()
        ):
            return answer.home_region, answer.reason == WRONG_REGION
        case History():
            # Only the home keeps a record's history: an answer from any other
            # node is followed to the home, if the regions map has it.
            return answer.home_region, True
        case Record() | ClaimStatus():
            return answer.home_region, False
        case RememberResult():
            return answer.record.home_region, False
    return "", False


def home_tag(tags: Iterable[str]) -> str:
    """The region the first ``homeRegion:R`` tag names, or ``""``."""
    for tag in tags:
        if tag.startswith(HOME_TAG_PREFIX):
            return tag.removeprefix(HOME_TAG_PREFIX)
    return ""


class Stubs:
    """The typed stubs of one channel, i.e. of one node."""

    def __init__(self, channel: aio.Channel) -> None:
        self.channel = channel
        self.records = records_pb2_grpc.RecordsStub(channel)
        self.claims = claims_pb2_grpc.ClaimsStub(channel)
        self.node = node_pb2_grpc.NodeStub(channel)
        # The standard health service has no typed stub; call it by name.
        self.health_check: aio.UnaryUnaryMultiCallable[Any, Any] = channel.unary_unary(
            _HEALTH_CHECK,
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )


class Router:
    """Channels by address, and the home region of the keys seen so far."""

    def __init__(
        self,
        target: str,
        regions: Mapping[str, str],
        retries: int,
        credentials: grpc.ChannelCredentials | None = None,
        own_connection: bool = False,
    ) -> None:
        self.target = target
        self.credentials = credentials  # None: plaintext
        self.regions = dict(regions)
        self._options = channel_options(retries)
        if own_connection:  # not gRPC's process-wide pool of connections
            self._options.append(("grpc.use_local_subchannel_pool", 1))
        self._stubs: dict[str, Stubs] = {}
        self._homes: OrderedDict[str, str] = OrderedDict()
        # An address that answered NOT_DECIDER -> the decider's address it named.
        self._deciders: dict[str, str] = {}
        self._closed = False
        self.default = self.stubs(target)

    def stubs(self, address: str) -> Stubs:
        """The stubs for ``address``, opening its channel on first use."""
        stubs = self._stubs.get(address)
        if stubs is None:
            if self._closed:
                raise RuntimeError("the client is closed")
            if self.credentials is None:
                channel = aio.insecure_channel(address, options=self._options)
            else:
                channel = aio.secure_channel(address, self.credentials, options=self._options)
            stubs = Stubs(channel)
            self._stubs[address] = stubs
        return stubs

    @property
    def homes(self) -> dict[str, str]:
        """A copy of the cache: key -> home region."""
        return dict(self._homes)

    def learn(self, key: str, home: str) -> None:
        """Remember that ``key`` is homed in ``home`` (ignored when empty)."""
        if not home:
            return
        self._homes[key] = home
        self._homes.move_to_end(key)
        while len(self._homes) > HOME_CACHE_SIZE:
            self._homes.popitem(last=False)

    def address_for(self, key: str, home: str = "") -> str:
        """Where a home-only call for ``key`` goes first.

        ``home`` (e.g. from a ``homeRegion:`` tag) wins over the cache; a home
        that is unknown or not in the regions map means the default target.
        """
        return self.regions.get(home or self._homes.get(key, ""), self.target)

    def redirect(self, home: str, tried: str) -> str | None:
        """Where to re-send a call that ``tried`` answered with ``wrong_region``.

        None when the home has no address in the regions map, or when its
        address is the one that just answered (re-sending there would only
        repeat the answer).
        """
        address = self.regions.get(home)
        return None if address is None or address == tried else address

    def via(self, address: str) -> str:
        """Where a deciding call meant for ``address`` goes: the decider it named in
        its latest ``NOT_DECIDER``, or ``address`` itself."""
        return self._deciders.get(address, address)

    def moved(self, asked: str, decider: str) -> None:
        """``asked`` (an address a call was meant for) named ``decider`` as its
        region's decider: deciding calls for ``asked`` go there from now on."""
        if decider and decider != asked:
            self._deciders[asked] = decider
        else:
            self._deciders.pop(asked, None)

    def forget(self, asked: str) -> None:
        """The decider ``asked`` named could not be reached: ask ``asked`` again."""
        self._deciders.pop(asked, None)

    @property
    def deciders(self) -> dict[str, str]:
        """A copy of the redirects followed: address -> its region's decider."""
        return dict(self._deciders)

    async def close(self) -> None:
        """Close every channel; calls still in flight are cancelled."""
        self._closed = True
        await asyncio.gather(*(stubs.channel.close(grace=None) for stubs in self._stubs.values()))

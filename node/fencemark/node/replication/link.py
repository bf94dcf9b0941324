"""This node's link to one peer: its channel and stub, its push queue, its back-off
and whether it answers (``PeerLink``)."""

from __future__ import annotations

import asyncio
import logging
import random
import time

import grpc
from google.rpc import error_details_pb2

from fencemark.node.replication.lives import status_details
from fencemark.node.replication.peer_check import PeerCheck
from fencemark.node.replication.peers import PeerStats
from fencemark.node.replication.tuning import CHANNEL_OPTIONS, RECONNECT_BACKOFF_MS, Tuning
from fencemark.node.security.tls import peer_channel, retire_channel
from fencemark.v1 import replication_pb2_grpc

log = logging.getLogger(__name__)


class PeerLeft(ConnectionError):
    """A call to a peer whose channel was closed under it: the peer left this node's
    peers, or the channel was replaced and its grace ran out. gRPC cancels such a
    call, which would otherwise end the task that made it — an anti-entropy loop,
    a write's acknowledgement — as if that task had been cancelled."""


def asked_to_wait(error: grpc.aio.AioRpcError) -> float:
    """How long, in seconds, a peer that refused a call asked this node to wait before
    the next (its ``RetryInfo``: a peer that just woke from a nap, ``grant_gate.quiet``);
    0 when it named no wait."""
    for detail in status_details(error):
        info = error_details_pb2.RetryInfo()
        if detail.Unpack(info):
            return float(info.retry_delay.ToMilliseconds()) / 1000
    return 0.0


class PeerLink:
    def __init__(self, stats: PeerStats, tuning: Tuning, check: PeerCheck | None = None) -> None:
        self.stats = stats
        self.tuning = tuning
        self.check = check  # the peer's certificate, with TLS (peer_check)
        self.refused = False  # the check refused it, and its channel was replaced
        self._connect()
        self.backlog: dict[str, None] = {}  # an ordered set of keys to push
        self.pushing = False  # a batch is in flight ...
        self.fetched: set[str] = set()  # ... and the peer fetched these meanwhile
        # A fellow member's: keys whose state just committed here it acknowledged
        # already (``Replicator.held_by``): their eager push is not sent.
        self.delivered: set[str] = set()
        self.wake = asyncio.Event()
        self.retry_at = 0.0
        self.asked_until = 0.0  # the peer's own refusal asked for no call before this
        self.behind_until = 0.0  # no rounds with it before: it was behind, and pulls
        self.accepts_push = True
        self.push_probe_at = 0.0  # when to try pushing again to a peer that refused
        self.unanswered = 0  # calls in a row that did not reach the peer
        self.unanswered_since = 0.0  # ... since when
        self.last_called = 0.0  # monotonic start of the latest call to it (heartbeat)
        self.first_answered: float | None = None  # start of the first call it answered
        self.answered_at = 0.0  # monotonic end of the latest call it answered
        self.settle_after = 0.0  # ... of those that began after this (a nap: grant_gate)
        self.fresh_after = 0.0  # no new channel before (connect_now)

    def _connect(self) -> None:
        self.credentials = self.stats.credentials
        self.channel = peer_channel(self.stats.address, self.credentials, CHANNEL_OPTIONS)
        self._stub = replication_pb2_grpc.ReplicationStub(self.channel)

    @property
    def stub(self) -> replication_pb2_grpc.ReplicationStub:
        """The peer's stub, on a new channel once the node's certificate was renewed
        (``tls_reload``): an open connection would keep presenting the old one."""
        if self.stats.credentials is not self.credentials:
            self._reconnect()
        return self._stub

    def _reconnect(self) -> None:
        """A new channel; calls still running on the old one may finish."""
        old = self.channel
        self._connect()
        retire_channel(old)

    def connect_now(self) -> None:
        """The peer has just called this node, so it is up; if this node's channel to it
        is waiting out a reconnect backoff, every call on it would fail at once until
        the backoff ends (up to RECONNECT_BACKOFF_MS x 1.2). A new channel connects on
        its first call instead; at most one per backoff period, should it fail too."""
        now = time.monotonic()
        if now < self.fresh_after:
            return
        if self.channel.get_state() == grpc.ChannelConnectivity.TRANSIENT_FAILURE:
            self.fresh_after = now + RECONNECT_BACKOFF_MS / 1000
            self._reconnect()

    async def allowed(self) -> None:
        """Before every call: raise ``PeerRefused`` (nothing is sent) while the
        certificate the peer's address presents is revoked or not its region's
        (peer_check). A peer newly refused gets a new channel, so no connection made
        with its refused certificate is used again, and its push queue is dropped:
        it pulls what it missed once it is admitted again."""
        if self.check is None:
            return
        try:
            await self.check.admit()
        finally:
            if self.check.refused and not self.refused:
                self.backlog.clear()
                self._reconnect()
            self.refused = self.check.refused

    def pushes_allowed(self) -> bool:
        """False while the peer refuses pushes (writes disabled; retried every minute)
        or its certificate is refused (re-checked by anti-entropy rounds)."""
        if self.check is not None and self.check.refused:
            return False
        if not self.accepts_push and time.monotonic() >= self.push_probe_at:
            self.accepts_push = True
        return self.accepts_push

    def refuses_pushes(self) -> None:
        self.accepts_push = False
        self.push_probe_at = time.monotonic() + 60.0
        self.backlog.clear()  # it pulls by itself; nothing queued would be sent

    def requeue(self, keys: list[str]) -> None:
        """Put back the keys of a batch that did not get through (unless the peer
        fetched them meanwhile)."""
        for key in keys:
            if len(self.backlog) < self.tuning.push_queue_limit and key not in self.fetched:
                self.backlog.setdefault(key, None)

    def unreachable(self) -> bool:
        return (
            self.unanswered >= self.tuning.unreachable_after
            and time.monotonic() - self.unanswered_since >= self.tuning.unreachable_after_s
        )

    def back_off(self, why: str, code: grpc.StatusCode | None = None, asked_s: float = 0.0) -> None:
        """A call failed: no round or push before ``retry_at``, an exponential
        back-off, and no earlier than the wait the peer asked for (``asked_s``,
        ``asked_to_wait``), which a call of the peer's does not cut short
        (``Replicator.heard_from``)."""
        self.stats.failed(why)
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            if not self.unanswered:
                self.unanswered_since = time.monotonic()
            self.unanswered += 1
            if self.stats.next_address():  # a region of several members: another serves it
                log.info("peer %s: trying %s", self.stats.name, self.stats.address)
                self._reconnect()
            if self.unreachable() or len(self.backlog) > self.tuning.kept_push_limit:
                self.backlog.clear()  # it pulls what it missed once it is back
        doublings = min(self.stats.failures, 9) - 1  # failed() counted this one: >= 1
        delay = min(self.tuning.max_backoff_s, self.tuning.first_backoff_s * 2**doublings)
        now = time.monotonic()
        self.retry_at = now + delay * random.uniform(0.5, 1.5)
        if asked_s > 0:
            self.asked_until = now + asked_s
            self.retry_at = max(self.retry_at, self.asked_until)

    def answered(self) -> None:
        self.stats.succeeded()
        self.unanswered = 0

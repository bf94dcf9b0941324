"""Budgets of calls in flight, one per class of call, so no class can starve another.

gRPC's own ``maximum_concurrent_rpcs`` is one pool for every call: claims waiting
in line (up to 300 s each) filled it, and ``Node.Info``, health checks and the
peers' ``Replication.Tree`` were refused RESOURCE_EXHAUSTED, so peers marked the
node unreachable. Here each class has a budget of its own (docs/operations.md,
*Call budgets*):

- ``read``: methods without side effects (``Get``, ``List``, ``ClaimStatus``,
  ``Info``), health ``Watch`` streams and reflection;
- ``write``: every other client method (claims included, until they wait);
- ``replication``: the peers' ``fencemark.v1.Replication`` calls;
- ``health``: ``grpc.health.v1.Health/Check``, which answers at once.

A stream a caller can hold open for as long as it likes — ``Records.Watch``, health
``Watch``, reflection — also counts against its client's own cap
(``--max-streams-per-client``: one certificate identity, or one address without
TLS), so that no one caller holds the whole ``read`` budget against the others.

A claim that starts waiting in line gives its slot back (:func:`give_back`): a
waiting claim holds a place in a queue, bounded by the waiter limits
(``--max-waiters``, ``--max-waiters-per-client``), not a call slot. A call over its
class's budget is refused at once with RESOURCE_EXHAUSTED and an ``ErrorInfo``
naming the resource and the limit, and counted by class.
"""

from __future__ import annotations

import collections
import contextvars
import inspect
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from fencemark.node.api.claims_service import client_of
from fencemark.node.api.interceptor import Behaviour, Interceptor, Shape
from fencemark.node.api.service import refuse
from fencemark.node.api.telemetry import NodeMetrics
from fencemark.node.rules.errors import Exhausted

CLASSES = ("read", "write", "replication", "health")
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
# Calls that stay open as long as their caller likes: each counts against its
# client's cap too.
LONG_LIVED = frozenset({
    "/fencemark.v1.Records/Watch",
    "/grpc.health.v1.Health/Watch",
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
})  # fmt: skip


@dataclass(frozen=True)
class Limits:
    """Calls in flight per class (``--max-concurrent-reads`` and the others)."""

    read: int = 512
    write: int = 512
    replication: int = 128
    health: int = 64
    streams_per_client: int = 64  # long-lived streams open from one client

    def of(self, kind: str) -> int:
        return int(getattr(self, kind))

    def problem(self) -> str:
        """What makes these limits unsafe together; "" if nothing. A client's long-lived
        streams are reads: as many as the read budget let one client take every read
        slot (issue 43), so they must stay below it."""
        if self.streams_per_client >= self.read:
            return (
                f"--max-streams-per-client ({self.streams_per_client}) must be below"
                f" --max-concurrent-reads ({self.read}): one client's streams would hold"
                " every read slot"
            )
        return ""


class _Slot:
    def __init__(self, budgets: CallBudgets, kind: str, client: str | None = None) -> None:
        self.budgets = budgets
        self.kind = kind
        self.client = client  # a long-lived stream's client
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.budgets.leave(self.kind, self.client)


_slot: contextvars.ContextVar[_Slot | None] = contextvars.ContextVar("budget_slot", default=None)


def give_back() -> None:
    """The call being served stops counting against its class's budget (a claim
    that starts waiting in line). Nothing outside a budgeted call."""
    slot = _slot.get()
    if slot is not None:
        slot.release()


class CallBudgets(Interceptor):
    """The server interceptor that keeps each class of call within its budget.

    ``classes`` maps a method's full path to its class; a path not in it is a
    ``read`` (reflection, health ``Watch``), except ``Health/Check``.
    """

    def __init__(self, limits: Limits, classes: Mapping[str, str], metrics: NodeMetrics) -> None:
        self.limits = limits
        self.classes = classes
        self.in_flight = dict.fromkeys(CLASSES, 0)
        self.streams: collections.Counter[str] = collections.Counter()  # open, per client
        # Each class's gauge and counter, looked up once rather than on every call.
        self._gauges = {kind: metrics.in_flight.labels(kind) for kind in CLASSES}
        self._refusals = {kind: metrics.budget_refusals.labels(kind) for kind in CLASSES}
        for kind in CLASSES:
            metrics.budget.labels(kind).set(limits.of(kind))

    def kind_of(self, method: str) -> str:
        if method == HEALTH_CHECK:
            return "health"
        return self.classes.get(method, "read")

    async def enter(
        self, kind: str, context: grpc.aio.ServicerContext[Any, Any], long_lived: bool = False
    ) -> _Slot:
        """A slot of ``kind``'s budget (and for a ``long_lived`` stream, of its
        client's cap), or the call refused RESOURCE_EXHAUSTED."""
        limit = self.limits.of(kind)
        if self.in_flight[kind] >= limit:
            self._refusals[kind].inc()
            await refuse(context, Exhausted(f"concurrent {kind} calls", limit))
        client = client_of(context) if long_lived else None
        if client is not None and self.streams[client] >= self.limits.streams_per_client:
            self._refusals[kind].inc()
            cap = self.limits.streams_per_client
            await refuse(context, Exhausted("open streams from one client", cap))
        self.in_flight[kind] += 1
        self._gauges[kind].inc()
        if client is not None:
            self.streams[client] += 1
        return _Slot(self, kind, client)

    def leave(self, kind: str, client: str | None = None) -> None:
        self.in_flight[kind] -= 1
        self._gauges[kind].dec()
        if client is not None:
            self.streams[client] -= 1
            if not self.streams[client]:
                del self.streams[client]

    def wrap(self, method: str, behaviour: Behaviour, shape: Shape) -> Behaviour:
        return self._within(self.kind_of(method), behaviour, method in LONG_LIVED)

    def _within(self, kind: str, behaviour: Behaviour, long_lived: bool) -> Behaviour:
        """``behaviour`` holding a slot of ``kind`` while it runs (or streams)."""
        if inspect.isasyncgenfunction(behaviour):

            async def streaming(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                slot = await self.enter(kind, context, long_lived)
                try:
                    responses: AsyncIterator[Any] = behaviour(request, context)
                    async for response in responses:
                        yield response
                finally:
                    slot.release()

            return streaming

        async def call(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            slot = await self.enter(kind, context, long_lived)
            _slot.set(slot)
            try:
                return await behaviour(request, context)
            finally:
                slot.release()

        return call

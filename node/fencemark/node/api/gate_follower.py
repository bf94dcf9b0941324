"""What a node does when its grant gate changes its mind: replicate anew, and say so
in health (``fencemark.node.core.grant_gate`` decides; this follows)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from grpc_health.v1 import health_pb2

from fencemark.node.core.replica import Replica
from fencemark.node.replication.replicator import Replicator

log = logging.getLogger(__name__)

CLAIMS_SERVICE = "fencemark.v1.Claims"  # health's name for "this node decides claims"


class GateFollower:
    """What the node does when its grant gate changes its mind
    (``fencemark.node.core.grant_gate``):

    - it comes to owe a catch-up again (its data file went back in time, or a peer
      refused it as a twin): the replicator asks every peer anew and health stops
      serving claims until it has;
    - it napped (the process stood still): the replicator settles with every peer
      again, health stops serving claims, and the restart's bounded wait begins
      again;
    - a restart's (or a nap's) bounded wait ends without a round with every peer:
      it decides on its era of tokens alone (``waited``)."""

    def __init__(
        self, replica: Replica, replicator: Replicator, health: Any, start_wait_s: float
    ) -> None:
        self.replica = replica
        self.replicator = replicator
        self.health = health
        self.start_wait_s = start_wait_s
        self._pending: set[asyncio.Task[None]] = set()
        self._wait: asyncio.Task[None] | None = None
        replica.gate.on_owed(self._owed)
        replica.gate.on_nap(self._napped)

    def _owed(self) -> None:
        self.replicator.catch_up_again()
        self._not_serving()

    def _napped(self) -> None:
        self.replicator.settle_again()
        self._not_serving()
        self.wait_for_peers()

    def decider_changed(self) -> None:
        """This member became its region's decider, or stopped deciding (SPEC §10)."""
        task = asyncio.create_task(serve_claims(self.health, self.replica))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    def _not_serving(self) -> None:
        task = asyncio.create_task(
            self.health.set(CLAIMS_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        )
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    def wait_for_peers(self) -> None:
        """(Again) decide once every peer gave a round, or after ``start_wait_s``."""
        if self._wait is not None:
            self._wait.cancel()
        self._wait = asyncio.create_task(self._wait_for_peers())

    async def _wait_for_peers(self) -> None:
        """A restarted node decides once every peer gave it a round, or after
        ``start_wait_s`` (``grant_gate``): then on its new era of tokens alone,
        saying who was not heard."""
        await asyncio.sleep(self.start_wait_s)
        if self.replica.gate.waited():
            self.replicator.catching_up = False
            log.warning(
                "deciding claims %.0f s after the start (or a pause) without a round"
                " with every peer (%s); what this node's file may have forgotten and"
                " only they hold is learnt when they answer",
                self.start_wait_s,
                ", ".join(self.replicator.unsynced()) or "none",
            )
            await serve_claims(self.health, self.replica)

    def stop(self) -> None:
        if self._wait is not None:
            self._wait.cancel()


async def serve_claims(health: Any, replica: Replica) -> None:
    """Health serves claims where claims are decided: SERVING while the grant gate
    lets this node decide (at a member of a region of several, only at its decider)."""
    status = health_pb2.HealthCheckResponse
    serving = replica.gate.deciding
    await health.set(CLAIMS_SERVICE, status.SERVING if serving else status.NOT_SERVING)

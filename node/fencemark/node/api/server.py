"""Run a region node: its layers assembled, its ports bound, then started.

The write gate is fail-closed: on a node started without writes enabled the
mutating methods are not registered at all, so clients get UNIMPLEMENTED and
nothing can write by accident. Which methods mutate is read from the proto
itself (a method is a read iff its ``idempotency_level`` is NO_SIDE_EFFECTS).
How each layer is put together is ``fencemark.node.api.assembly``.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Mapping

# grpc-stubs predates the asyncio health servicer; it is grpc_health.v1.health.aio.
from grpc_health.v1.health import aio as health_aio  # type: ignore[attr-defined]

from fencemark.node.api import assembly, dashboard, metrics_http
from fencemark.node.api.assembly import MAX_RECEIVE_BYTES as MAX_RECEIVE_BYTES
from fencemark.node.api.assembly import MAX_SEND_BYTES as MAX_SEND_BYTES
from fencemark.node.api.config import NodeConfig as NodeConfig  # re-exported: what start() takes
from fencemark.node.api.config import default_data_dir as default_data_dir
from fencemark.node.api.config import live_tls, transport
from fencemark.node.api.dashboard import Dashboard
from fencemark.node.api.gate_follower import CLAIMS_SERVICE as CLAIMS_SERVICE
from fencemark.node.api.telemetry import say
from fencemark.node.coordination.member import Member
from fencemark.node.coordination.registry import Registered
from fencemark.node.security.tls_reload import LiveTls
from fencemark.node.store.storage import (
    DB_FILE as DB_FILE,  # re-exported: where a node keeps its file
)

log = logging.getLogger(__name__)


class NodeServer:
    """A running node. ``await NodeServer.start(config)``, then ``stop()``."""

    def __init__(
        self,
        config: NodeConfig,
        core: assembly.Core,
        peering: assembly.Replication,
        surfaces: assembly.Surfaces,
        tls: LiveTls | None,
    ) -> None:
        self.config = config
        self.tls = tls
        # store and core
        self.storage = core.storage
        self.replica = core.replica
        self.claims = core.claims
        self.work = core.work
        self.lapses = core.lapses
        # replication
        self.replicator = peering.replicator
        self._gate = peering.gate
        self._peering = peering
        # the surfaces
        self.server = surfaces.server
        self.peer_server = surfaces.peer_server  # the peer listener, if any
        self.health = surfaces.health
        self.metrics = surfaces.metrics
        self._services = surfaces.names
        self.port = 0
        self.peer_port = 0
        self.dashboard_port = 0  # where the dashboard is served, if it is
        self._stop_metrics: Callable[[], Awaitable[None]] | None = None
        self._stop_dashboard: Callable[[], Awaitable[None]] | None = None
        self._dashboard: Dashboard | None = None
        self._tls_watch: asyncio.Task[None] | None = None
        self.stopped = False

    @property
    def address(self) -> str:
        return _bound(self.config.listen, self.port)

    @property
    def member(self) -> Member | None:
        """Its part in its region's election, at a member of a region of several."""
        return self._peering.member

    @property
    def peer_address(self) -> str:
        """Where peers dial in: the peer listener, else the client port."""
        if self.peer_server is None:
            return self.address
        return _bound(self.config.peer_listen, self.peer_port)

    @classmethod
    async def start(cls, config: NodeConfig) -> NodeServer:
        """Assemble the layers bottom up (``fencemark.node.api.assembly``), bind the
        ports, then start: health says SERVING once the node listens, and SERVING for
        claims once it has caught up."""
        if config.member is not None and (problem := config.member.problem()):
            raise ValueError(problem)  # before anything opens
        tls = live_tls(config)
        connections = assembly.Connections.of(config)  # bounds refused before anything opens
        core = await assembly.open_core(config, tls)  # store, rules, core
        health = health_aio.HealthServicer()
        peering = await assembly.replication(config, tls, core, health)
        surfaces = assembly.surfaces(config, tls, core, peering, health, connections)
        node = cls(config, core, peering, surfaces, tls)
        try:
            node._listen()
        except OSError:
            await core.storage.close()
            raise
        await node._start()
        log.info(
            "region %s node %s listening on %s%s (%s, writes %s, data %s)",
            config.region,
            node.storage.node_id,
            node.address,
            f", peers on {node.peer_address}" if node.peer_server is not None else "",
            transport(config),
            "enabled" if config.enable_writes else "disabled",
            config.db_path,
        )
        return node

    def _listen(self) -> None:
        """Bind the client port and the peer listener's; OSError if one is taken."""
        self.port = assembly.listen(self.server, self.config.listen, self.tls)
        if self.peer_server is not None:
            self.peer_port = assembly.listen(self.peer_server, self.config.peer_listen, self.tls)

    async def _start(self) -> None:
        """Serve, then replicate, record lapses, and serve metrics and the dashboard."""
        config, peering = self.config, self._peering
        await self.server.start()
        if self.peer_server is not None:
            await self.peer_server.start()
        # A member serves claims once elected (``GateFollower.decider_changed``).
        await assembly.serve_health(
            self.health,
            self._services,
            catching_up=peering.catching_up or peering.member is not None,
        )
        self.replicator.start(members=peering.member is not None)
        self.lapses.start()
        if config.metrics_listen:
            self.metrics.port, _, self._stop_metrics = await metrics_http.serve(
                self.metrics.registry, config.metrics_listen, config.handshake_timeout_s
            )
        if self.replica.gate.starting:
            self._gate.wait_for_peers()
        if peering.member is not None:
            peer_address = config.advertise_peer or (
                self.peer_address if self.peer_server is not None else ""
            )
            address = config.advertise or self.address
            peering.member.start(
                address,
                peer_address or address,
                self._members_changed,
                self.replicator.catch_up_with_majority,
                self.replicator.first_life,
                self.replicator.reaches_majority,
            )
        if config.dashboard_listen:
            self._dashboard = Dashboard(
                self.replica,
                self.claims,
                peering.peers,
                self.metrics.recent_refusals,
                member=peering.member,
            )
            self.dashboard_port, self._stop_dashboard = await dashboard.serve(
                self._dashboard,
                config.dashboard_listen,
                config.tls,
                config.access,
                self.tls.revocations if self.tls is not None else None,
                config.handshake_timeout_s,
            )
        if self.tls is not None and config.tls_reload_interval > 0:
            self._tls_watch = asyncio.create_task(self._watch_tls(config.tls_reload_interval))

    async def _members_changed(self, members: Mapping[str, Registered]) -> None:
        """The region's other members, as etcd registers them, are this node's peers
        in its region (``Replicator.set_members``)."""
        await self.replicator.set_members({m.name: m.peer_address for m in members.values()})

    async def stop(self, grace: float | None = None) -> None:
        """Refuse new calls, let running ones finish (up to ``grace`` s), close storage."""
        if self.stopped:
            return
        self.stopped = True
        if self._tls_watch is not None:
            self._tls_watch.cancel()
        self._gate.stop()
        if self._peering.member is not None:
            await self._peering.member.stop()  # the key let go at once: a fast successor
        await self.health.enter_graceful_shutdown()
        self.replica.end_feed()  # watch streams end now: they resume from their cursor
        grace = self.config.grace_seconds if grace is None else grace
        stopping = [self.server.stop(grace)]
        if self.peer_server is not None:
            stopping.append(self.peer_server.stop(grace))
        await asyncio.gather(*stopping)
        await self.work.stop()
        await self.replicator.stop()
        await self.lapses.stop()
        if self._stop_dashboard is not None and self._dashboard is not None:
            await self._stop_dashboard()
            await self._dashboard.stop()
        await self.storage.close()
        if self._stop_metrics is not None:
            await self._stop_metrics()
        log.info("region %s node stopped", self.config.region)

    def reload_tls(self) -> bool:
        """Take renewed TLS files and crl.pem into use now; True if anything changed."""
        return self.tls.reload() if self.tls is not None else False

    async def _watch_tls(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                self.reload_tls()
            except Exception:  # never let the watcher die: the next look may succeed
                log.exception("looking at the TLS files failed")


def _bound(listen: str, port: int) -> str:
    """``listen``'s host with the port it was bound to (``:0`` picks one)."""
    return f"{listen.rsplit(':', 1)[0]}:{port}"


async def serve(config: NodeConfig, ready: asyncio.Event | None = None) -> None:
    """Run a node until SIGTERM or SIGINT, then shut down gracefully."""
    # Handlers first: a SIGTERM sent the moment the node says it listens must
    # already mean a graceful stop.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    node = await NodeServer.start(config)
    # SIGHUP: take renewed certificates and crl.pem into use now (docs/operations.md).
    loop.add_signal_handler(signal.SIGHUP, node.reload_tls)
    peers_on = f", peers on {node.peer_address}" if node.peer_server is not None else ""
    say(
        "fencemark node",
        f"region {config.region} listening on {node.address}{peers_on} ({transport(config)},"
        f" writes {'enabled' if config.enable_writes else 'disabled'}, data {config.db_path})",
        region=config.region,
        address=node.address,
        peer_address=node.peer_address,
    )
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
    finally:
        await node.stop()

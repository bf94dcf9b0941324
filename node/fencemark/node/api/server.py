"""Assemble and run a region node: storage, rules, gRPC services, health, reflection.

The write gate is fail-closed: on a node started without writes enabled the
mutating methods are not registered at all, so clients get UNIMPLEMENTED and
nothing can write by accident. Which methods mutate is read from the proto
itself (a method is a read iff its ``idempotency_level`` is NO_SIDE_EFFECTS).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, cast

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from grpc_health.v1 import health_pb2, health_pb2_grpc

# grpc-stubs predates the asyncio health servicer; it is grpc_health.v1.health.aio.
from grpc_health.v1.health import aio as health_aio  # type: ignore[attr-defined]

from fencemark.node.api import dashboard
from fencemark.node.api.authz import DEFAULT_ACCESS, Authorize, caller_of
from fencemark.node.api.budgets import CallBudgets, give_back
from fencemark.node.api.claims_service import ClaimsService
from fencemark.node.api.config import NodeConfig as NodeConfig  # re-exported: what start() takes
from fencemark.node.api.config import default_data_dir as default_data_dir
from fencemark.node.api.config import live_tls, transport
from fencemark.node.api.connections import connection_options, peer_connection_options
from fencemark.node.api.dashboard import Dashboard
from fencemark.node.api.handlers import SERVICES, call_classes, gated_handler
from fencemark.node.api.interceptor import Chain, Interceptor, Registrar
from fencemark.node.api.reflection import enable as enable_reflection
from fencemark.node.api.replication import ReplicationService
from fencemark.node.api.service import NodeService, RecordsService, anyone
from fencemark.node.api.telemetry import NodeMetrics, Telemetry, say
from fencemark.node.core.claims import Claims
from fencemark.node.core.lapses import LapseWatcher
from fencemark.node.core.replica import Replica
from fencemark.node.core.work_queue import WorkQueue
from fencemark.node.crdt import HybridClock
from fencemark.node.replication.lives import Lives
from fencemark.node.replication.peers import PeerStats, stats_for
from fencemark.node.replication.replicator import Replicator
from fencemark.node.replication.signers import load_keyring
from fencemark.node.rules.integrity import Bounds
from fencemark.node.security.signing import Keyring, Signer
from fencemark.node.security.tls_reload import LiveTls
from fencemark.node.store.storage import (
    DB_FILE as DB_FILE,  # re-exported: where a node keeps its file
)
from fencemark.node.store.storage import Storage

log = logging.getLogger(__name__)

# A client's record is at most 4 MiB (validation.MAX_RECORD_BYTES); replication
# batches and merged states may be larger.
MAX_RECEIVE_BYTES = 16 << 20
MAX_SEND_BYTES = 64 << 20
CLAIMS_SERVICE = "fencemark.v1.Claims"
# storage meta: "2" once every fence grant, birth and write under a claim made here
# is signed ("1": grants and births, before writes were signed)
OWN_SIGNED = "own_states_signed"
OWN_SIGNED_ALL = "2"


class NodeServer:
    """A running node. ``await NodeServer.start(config)``, then ``stop()``."""

    def __init__(
        self,
        config: NodeConfig,
        storage: Storage,
        replica: Replica,
        claims: Claims,
        work: WorkQueue,
        server: grpc.aio.Server,
        health_servicer: Any,
        port: int,
        replicator: Replicator,
        metrics: NodeMetrics,
        stop_metrics: Callable[[], None] | None,
        lapses: LapseWatcher,
        gate: _GateFollower,
        tls: LiveTls | None = None,
    ) -> None:
        self.config = config
        self.storage = storage
        self.replica = replica
        self.claims = claims
        self.work = work
        self.server = server
        self.health = health_servicer
        self.port = port
        self.replicator = replicator
        self.metrics = metrics
        self._stop_metrics = stop_metrics
        self.lapses = lapses
        self._gate = gate
        self.stopped = False
        self.tls = tls
        self._tls_watch: asyncio.Task[None] | None = None
        self.dashboard_port = 0  # where the dashboard is served, if it is
        self.peer_server: grpc.aio.Server | None = None  # the peer listener, if any
        self.peer_port = 0
        self._stop_dashboard: Callable[[], Awaitable[None]] | None = None
        self._dashboard: Dashboard | None = None
        if tls is not None and config.tls_reload_interval > 0:
            self._tls_watch = asyncio.create_task(self._watch_tls(config.tls_reload_interval))

    @property
    def address(self) -> str:
        return _bound(self.config.listen, self.port)

    @property
    def peer_address(self) -> str:
        """Where peers dial in: the peer listener, else the client port."""
        if self.peer_server is None:
            return self.address
        return _bound(self.config.peer_listen, self.peer_port)

    @classmethod
    async def start(cls, config: NodeConfig) -> NodeServer:
        """Open the data file, then: signing (with TLS), the catch-up gate, replication,
        the gRPC services, the port; health says SERVING once it listens.

        About 70 lines on purpose: each statement builds one component, in the
        order they depend on each other; the steps with logic are functions of
        their own (``_open_replica``, ``_grpc_server``, ``_add_services``)."""
        tls = live_tls(config)
        # Bounds checked (ValueError) before anything opens.
        peer_connections = (
            peer_connection_options(config.max_peer_connections) if config.peer_listen else None
        )
        reserved = config.max_peer_connections if peer_connections else 0
        client_connections = connection_options(config.max_connections, reserved)
        storage, replica = await _open_replica(config, tls)
        lapses = LapseWatcher(replica)  # the home records lapses (SPEC §4)
        claims = Claims(
            replica,
            max_waiters=config.max_waiters,
            max_waiters_per_client=config.max_waiters_per_client,
        )
        work = WorkQueue(claims)  # ClaimNext, Reopen, ForceRelease (SPEC §8)
        peers = _peers(config, tls, replica)
        # A node on a new, emptied or restored data directory decides nothing
        # before a complete pass with every peer; a restarted one waits for one round
        # with each, for a bounded time (fencemark.node.core.grant_gate).
        if not peers:
            await replica.gate.caught_up()  # nobody to learn from
        if config.start_wait_s <= 0:
            replica.gate.waited()  # a restart decides at once, on its era of tokens
        catching_up = not replica.gate.deciding
        health_servicer = health_aio.HealthServicer()

        async def caught_up() -> None:
            await replica.gate.caught_up()
            await health_servicer.set(CLAIMS_SERVICE, health_pb2.HealthCheckResponse.SERVING)

        replicator = Replicator(
            replica,
            storage,
            peers,
            interval=config.anti_entropy_interval,
            catching_up=catching_up,
            on_caught_up=caught_up,
            tls=tls,  # checks the certificate each peer presents (replication.peer_check)
            tuning=config.replication,
            max_clock_offset_s=config.max_clock_offset_ms / 1000,
        )
        # Who calls with which node id, to tell a restart from a twin (replication.lives).
        lives = Lives(config.max_clock_offset_ms, config.replication.twin_forget_s)
        metrics = NodeMetrics(config.region)
        storage.on_commit = metrics.observe_commit
        metrics.watch(replica, claims, peers, lives)
        if tls is not None:
            metrics.watch_tls(tls)
        chain = _interceptors(config, tls, metrics)
        server = _grpc_server(client_connections)
        servicers = _servicers(
            config, tls, storage, replica, claims, work, replicator, peers, lives
        )
        names = _add_services(
            Registrar(server, chain), servicers, health_servicer, config.enable_writes
        )
        peer_server = None
        if peer_connections:
            peer_server = _grpc_server(peer_connections)
            _add_peer_services(
                Registrar(peer_server, chain), servicers, health_servicer, config.enable_writes
            )
        try:
            port = _listen(server, config.listen, tls)
            peer_port = _listen(peer_server, config.peer_listen, tls) if peer_server else 0
        except OSError:
            await storage.close()
            raise
        await server.start()
        if peer_server is not None:
            await peer_server.start()
        await _serve_health(health_servicer, names, catching_up=catching_up)
        follower = _GateFollower(replica, replicator, health_servicer, config.start_wait_s)
        replicator.start()
        lapses.start()
        stop_metrics = metrics.serve(config.metrics_listen) if config.metrics_listen else None
        node = cls(config, storage, replica, claims, work, server, health_servicer, port,
                   replicator, metrics, stop_metrics, lapses, follower, tls)  # fmt: skip
        node.peer_server, node.peer_port = peer_server, peer_port
        if replica.gate.starting:
            follower.wait_for_peers()
        if config.dashboard_listen:
            node._dashboard = Dashboard(replica, claims, peers, metrics.recent_refusals)
            node.dashboard_port, node._stop_dashboard = await dashboard.serve(
                node._dashboard,
                config.dashboard_listen,
                config.tls,
                config.access,
                tls.revocations if tls is not None else None,
            )
        log.info(
            "region %s node %s listening on %s%s (%s, writes %s, data %s)",
            config.region,
            storage.node_id,
            node.address,
            f", peers on {node.peer_address}" if peer_server is not None else "",
            transport(config),
            "enabled" if config.enable_writes else "disabled",
            config.db_path,
        )
        return node

    async def stop(self, grace: float | None = None) -> None:
        """Refuse new calls, let running ones finish (up to ``grace`` s), close storage."""
        if self.stopped:
            return
        self.stopped = True
        if self._tls_watch is not None:
            self._tls_watch.cancel()
        self._gate.stop()
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
            await asyncio.to_thread(self._stop_metrics)
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


async def _open_replica(config: NodeConfig, tls: LiveTls | None) -> tuple[Storage, Replica]:
    """The node's data file as a ``Replica``, complete: its bounds, and with TLS its
    signer and keyring (docs/security.md, *Signed grants*)."""
    # Read before anything opens: a key that cannot sign refuses the start (ValueError).
    signer = Signer.from_files(config.tls) if config.tls is not None else None
    keyring: Keyring | None = None
    if config.tls is not None and tls is not None:
        # Signatures by a revoked certificate are refused once its CRL is in use.
        keyring = Keyring.for_files(config.tls, tls.revocations)
    storage = await Storage.open(
        config.db_path, cache_size=config.cache_size, feed_window=config.feed_window
    )
    if keyring is not None:
        load_keyring(storage, keyring)
    clock = HybridClock(max_offset_ms=config.max_clock_offset_ms, last=storage.hlc_high)
    replica = Replica(
        storage,
        clock,
        config.region,
        bounds=Bounds(config.max_clock_offset_ms, max_token_jump=config.max_token_jump),
        signer=signer if keyring is not None else None,
        keyring=keyring,
        max_attempts=config.max_attempts,
    )
    for kid, der in keyring.known() if keyring is not None else ():
        await replica.keep_signer(kid, der)  # ours and any the files name: kept for restarts
    if replica.signer is not None:
        if storage.meta.get(OWN_SIGNED) != OWN_SIGNED_ALL:
            # Once per file: grants, births and writes under claims from before
            # they were signed, or from an --insecure run.
            signed = await replica.sign_own()
            log.info("signed the grants, births and writes of %d records", signed)
            await storage.put_meta(OWN_SIGNED, OWN_SIGNED_ALL)
    elif storage.meta.get(OWN_SIGNED, "0") != "0":
        await storage.put_meta(OWN_SIGNED, "0")  # what is made now goes unsigned
    if storage.meta.get("restored_at"):
        log.info(
            "data restored from a backup at %s (fencemark restore): the first grant on each"
            " record homed here jumps its fence",
            storage.meta["restored_at"],
        )
    return storage, replica


def _peers(config: NodeConfig, tls: LiveTls | None, replica: Replica) -> dict[str, PeerStats]:
    """The configured peers; with TLS, a renewed certificate reaches their channels
    (the replicator reconnects each) and the replica's signer and keyring."""
    peers = stats_for(config.peers, tls.channel_credentials if tls is not None else None)
    if tls is not None:

        def renew(credentials: grpc.ChannelCredentials) -> None:
            for stats in peers.values():
                stats.credentials = credentials

        tls.on_channel_credentials(renew)
        if replica.keyring is not None:
            tls.on_renewed(functools.partial(_renew_signer, replica, replica.keyring))
    return peers


def _interceptors(config: NodeConfig, tls: LiveTls | None, metrics: NodeMetrics) -> Chain:
    """The interceptors every service is registered with, on the client port and the
    peer listener alike, in order: telemetry first (it times and counts what
    Authorize and the budgets refuse, too), Authorize before the budgets (a call
    refused anyway takes no slot). One set of budgets for the node, whichever port a
    call came in on."""
    interceptors: list[Interceptor] = [Telemetry(metrics)]
    if tls is not None:
        interceptors.append(Authorize(config.access or DEFAULT_ACCESS, tls.revocations))
    # Per class, not gRPC's maximum_concurrent_rpcs: one pool let waiting claims
    # starve health checks and the peers' replication (fencemark.node.api.budgets).
    interceptors.append(CallBudgets(config.call_limits, call_classes(), metrics))
    return Chain(interceptors)


def _grpc_server(connections: list[tuple[str, int]]) -> grpc.aio.Server:
    """A gRPC server whose connections are bounded by ``connections``' options."""
    return grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
            ("grpc.max_send_message_length", MAX_SEND_BYTES),
            # gRPC sets SO_REUSEPORT by default on Linux: a second node on the
            # same port would start and share its connections. Refuse instead.
            ("grpc.so_reuseport", 0),
            # Peers ping idle replication connections (replicator.KEEPALIVE_MS):
            # accept those pings instead of answering GOAWAY "too_many_pings".
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
            # One more connection is closed as it comes, and a burst of one call per
            # connection waits for the loop (fencemark.node.api.connections).
            *connections,
        ],
    )


def _servicers(
    config: NodeConfig,
    tls: LiveTls | None,
    storage: Storage,
    replica: Replica,
    claims: Claims,
    work: WorkQueue,
    replicator: Replicator,
    peers: dict[str, PeerStats],
    lives: Lives | None = None,
) -> dict[str, object]:
    """The four fencemark servicers, by service name."""
    # A grant records the identity it was made to; without TLS there is none.
    callers = caller_of(config.access or DEFAULT_ACCESS) if tls is not None else anyone
    return {
        "Records": RecordsService(
            replica, caller_of=callers, watch_send_timeout=config.watch_send_timeout
        ),
        "Claims": ClaimsService(claims, work, caller_of=callers, on_wait=give_back),
        "Node": NodeService(
            replica, claims, replicator, peers, writes_enabled=config.enable_writes
        ),
        "Replication": ReplicationService(
            replica,
            storage,
            peers,
            replicator.heard_from,
            replicator.pulled_by,
            authenticate=config.tls is not None,
            max_list_records=config.max_list_records,
            lives=lives,
        ),
    }


def _add_services(
    server: Registrar, servicers: Mapping[str, object], health: Any, writes_enabled: bool
) -> list[str]:
    """Fencemark's services (only their reads when writes are disabled), health and
    reflection; returns the full names of fencemark's services."""
    server.add_generic_rpc_handlers(
        tuple(gated_handler(servicers[s.name], s, writes_enabled=writes_enabled) for s in SERVICES)
    )
    health_pb2_grpc.add_HealthServicer_to_server(health, cast(Any, server))
    names = [s.full_name for s in SERVICES]
    enable_reflection(server, [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name])
    return names


def _add_peer_services(
    server: Registrar, servicers: Mapping[str, object], health: Any, writes_enabled: bool
) -> None:
    """The peer listener's services: replication and health, nothing a client calls
    (gated as on the client port)."""
    (replication,) = (s for s in SERVICES if s.name == "Replication")
    server.add_generic_rpc_handlers(
        (gated_handler(servicers["Replication"], replication, writes_enabled=writes_enabled),)
    )
    health_pb2_grpc.add_HealthServicer_to_server(health, cast(Any, server))


class _GateFollower:
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
            await self.health.set(CLAIMS_SERVICE, health_pb2.HealthCheckResponse.SERVING)

    def stop(self) -> None:
        if self._wait is not None:
            self._wait.cancel()


async def _serve_health(health: Any, names: list[str], *, catching_up: bool) -> None:
    """Every service SERVING, but Claims while the node catches up."""
    for name in ("", *names):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    if catching_up:
        await health.set(CLAIMS_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)


def _bound(listen: str, port: int) -> str:
    """``listen``'s host with the port it was bound to (``:0`` picks one)."""
    return f"{listen.rsplit(':', 1)[0]}:{port}"


def _listen(server: grpc.aio.Server, address: str, tls: LiveTls | None) -> int:
    """Bind one of the node's ports (plaintext, or mutual TLS); OSError if it cannot."""
    try:
        if tls is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, tls.server_credentials())
    except RuntimeError as exc:
        raise OSError(f"cannot listen on {address}: {exc}") from exc


def _renew_signer(replica: Replica, keyring: Keyring, ca: bytes, cert: bytes, key: bytes) -> None:
    """After a TLS reload: sign grants with the new key, trust the new CA bundle,
    and know (and keep) the new certificate, so peers can verify what it signs."""
    try:
        signer = Signer.from_pem(key)
        keyring.cas = x509.load_pem_x509_certificates(ca)
        der = x509.load_pem_x509_certificate(cert).public_bytes(serialization.Encoding.DER)
        kid = keyring.add(der)
    except ValueError as exc:
        log.error("reloaded TLS files cannot sign grants, keeping the old key: %s", exc)
        return
    replica.use_signer(signer)
    task = asyncio.get_running_loop().create_task(replica.keep_signer(kid, der))
    _background.add(task)
    task.add_done_callback(_background.discard)


_background: set[asyncio.Task[None]] = set()  # fire-and-forget tasks, kept referenced


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

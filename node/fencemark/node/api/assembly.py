"""How a node is put together, one layer at a time (docs/architecture.md, *Layers*).

``NodeServer.start`` makes one call per layer, bottom up, each taking what the
layers below it made:

- ``open_core``: the data file (``store``), the replica under its rules, the
  claims' lines, the work queue and the lapse watcher (``core``);
- ``replication``: the peers, the replicator, who calls with which node id, and
  what the node does when its grant gate changes its mind;
- ``surfaces``: the metrics, the interceptor chain, the gRPC servers of the client
  port and the peer listener with their services, and health.

Nothing here starts anything: ``NodeServer`` binds the ports and starts each part
once every layer exists.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fencemark.node.api import dashboard, metrics_http
from fencemark.node.api.authz import DEFAULT_ACCESS, Authorize, caller_of
from fencemark.node.api.budgets import CallBudgets, give_back
from fencemark.node.api.claims_service import ClaimsService
from fencemark.node.api.config import NodeConfig
from fencemark.node.api.connections import connection_options, peer_connection_options
from fencemark.node.api.gate_follower import CLAIMS_SERVICE, GateFollower, serve_claims
from fencemark.node.api.handlers import SERVICES, call_classes, gated_handler
from fencemark.node.api.handshakes import defer_listeners
from fencemark.node.api.interceptor import Chain, Interceptor, Registrar
from fencemark.node.api.reflection import enable as enable_reflection
from fencemark.node.api.replication import ReplicationService
from fencemark.node.api.service import NodeService, RecordsService, anyone
from fencemark.node.api.telemetry import NodeMetrics, Telemetry
from fencemark.node.coordination.member import Member
from fencemark.node.core.claims import Claims
from fencemark.node.core.lapses import LapseWatcher
from fencemark.node.core.replica import Replica
from fencemark.node.core.work_queue import WorkQueue
from fencemark.node.crdt import HybridClock
from fencemark.node.replication.lives import Lives
from fencemark.node.replication.majority import Majority
from fencemark.node.replication.peers import PeerStats, stats_for
from fencemark.node.replication.replicator import Replicator
from fencemark.node.replication.signers import load_keyring
from fencemark.node.rules.integrity import Bounds
from fencemark.node.security.signing import Keyring, Signer
from fencemark.node.security.tls_reload import LiveTls
from fencemark.node.store.storage import Storage

log = logging.getLogger(__name__)

# A client's record is at most 4 MiB (validation.MAX_RECORD_BYTES); replication
# batches and merged states may be larger.
MAX_RECEIVE_BYTES = 16 << 20
MAX_SEND_BYTES = 64 << 20
MAX_HANDSHAKE_TIMEOUT_S = 120.0  # gRPC's own default: a longer deadline is no bound
# storage meta: "2" once every fence grant, birth and write under a claim made here
# is signed ("1": grants and births, before writes were signed)
OWN_SIGNED = "own_states_signed"
OWN_SIGNED_ALL = "2"


# -- bounds -------------------------------------------------------------------------


@dataclass(frozen=True)
class Connections:
    """gRPC's options that bound each port's connections (``api.connections``) and
    the time one has to complete its handshake (``api.handshakes``)."""

    client: list[tuple[str, int]]
    peer: list[tuple[str, int]] | None  # None: no peer listener

    @classmethod
    def of(cls, config: NodeConfig) -> Connections:
        """ValueError naming the flag when a bound cannot be met: checked before
        anything opens (``fencemark node`` exits 2 with it)."""
        if problem := config.call_limits.problem():
            raise ValueError(problem)
        if not 0 < config.handshake_timeout_s <= MAX_HANDSHAKE_TIMEOUT_S:
            raise ValueError(
                f"--handshake-timeout takes more than 0 and at most"
                f" {MAX_HANDSHAKE_TIMEOUT_S:.0f} seconds, got {config.handshake_timeout_s}"
            )
        handshake = [("grpc.server_handshake_timeout_ms", int(config.handshake_timeout_s * 1000))]
        peer = peer_connection_options(config.max_peer_connections) if config.peer_listen else None
        # Descriptors set aside before the client port's bound is fitted to the
        # open-file limit: the peer listener's, the dashboard's and the metrics'
        # bounds, so a flood of clients cannot starve them, nor they the clients.
        reserved = (
            (config.max_peer_connections if peer else 0)
            + (dashboard.MAX_CONNECTIONS if config.dashboard_listen else 0)
            + (metrics_http.MAX_CONNECTIONS if config.metrics_listen else 0)
        )
        client = connection_options(config.max_connections, reserved)
        return cls([*client, *handshake], None if peer is None else [*peer, *handshake])


# -- store and core -----------------------------------------------------------------


@dataclass(frozen=True)
class Core:
    """The data file and the state machine over it."""

    storage: Storage
    replica: Replica
    claims: Claims
    work: WorkQueue
    lapses: LapseWatcher


async def open_core(config: NodeConfig, tls: LiveTls | None) -> Core:
    """The node's data file as a ``Replica`` (with TLS, its signer and keyring), the
    claims' lines over it, the work queue and the home's lapse watcher."""
    storage, replica = await _open_replica(config, tls)
    claims = Claims(
        replica,
        max_waiters=config.max_waiters,
        max_waiters_per_client=config.max_waiters_per_client,
    )
    return Core(
        storage,
        replica,
        claims,
        WorkQueue(claims),  # ClaimNext, Reopen, ForceRelease (SPEC §8)
        LapseWatcher(replica),  # the home records lapses (SPEC §4)
    )


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


# -- replication --------------------------------------------------------------------


@dataclass(frozen=True)
class Replication:
    """The node's peers and what talks to them."""

    peers: dict[str, PeerStats]
    replicator: Replicator
    lives: Lives  # who calls with which node id, to tell a restart from a twin
    gate: GateFollower
    catching_up: bool  # the node starts without deciding claims
    member: Member | None  # its part in its region's election, if the region has several


async def replication(
    config: NodeConfig, tls: LiveTls | None, core: Core, health: Any
) -> Replication:
    """The peers and the replicator, and whether the node decides at once: a node on
    a new, emptied or restored data directory decides nothing before a complete pass
    with every peer; a restarted one waits for one round with each, for a bounded
    time (``fencemark.node.core.grant_gate``). ``health`` says SERVING for claims once
    the node has caught up."""
    replica = core.replica
    peers = _peers(config, tls, replica)
    if not peers and config.member is None:
        await replica.gate.caught_up()  # nobody to learn from (a member's come from etcd)
    if config.start_wait_s <= 0:
        replica.gate.waited()  # a restart decides at once, on its era of tokens

    async def caught_up() -> None:
        await replica.gate.caught_up()
        if member is not None:
            member.file_caught_up()  # it may campaign now
        await serve_claims(health, replica)

    member: Member | None = None
    if config.member is not None:
        replica.member = config.member.name  # every replication call it makes names it
    catching_up = replica.gate.owed or replica.gate.starting
    replicator = Replicator(
        replica,
        core.storage,
        peers,
        interval=config.anti_entropy_interval,
        catching_up=catching_up,
        on_caught_up=caught_up,
        tls=tls,  # checks the certificate each peer presents (replication.peer_check)
        tuning=config.replication,
        max_clock_offset_s=config.max_clock_offset_ms / 1000,
    )
    lives = Lives(config.max_clock_offset_ms, config.replication.twin_forget_s)
    gate = GateFollower(replica, replicator, health, config.start_wait_s)
    if config.member is not None:
        member = Member(config.member, config.region, replica.gate,
                        max_clock_offset_ms=config.max_clock_offset_ms,
                        on_change=gate.decider_changed)  # fmt: skip
        replicator.configured = member.configured  # a member's catch-up counts a majority
        majority = Majority(replicator, timeout_s=config.member.ttl_s)
        core.storage.acknowledge = majority.acknowledge
        core.claims.look_up = majority.look_up  # a claim on a record not here yet
    return Replication(peers, replicator, lives, gate, catching_up, member)


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


# -- the surfaces: gRPC servers, their services, health, metrics ----------------------


@dataclass(frozen=True)
class Surfaces:
    """What clients and peers reach: the client port's server, the peer listener's
    (if any), health, and the metrics every call is counted in."""

    server: grpc.aio.Server
    peer_server: grpc.aio.Server | None
    health: Any
    metrics: NodeMetrics
    names: list[str]  # the full names of fencemark's services


def surfaces(
    config: NodeConfig,
    tls: LiveTls | None,
    core: Core,
    peering: Replication,
    health: Any,
    connections: Connections,
) -> Surfaces:
    """The gRPC servers with every service registered through one interceptor chain
    (on the client port and the peer listener alike), and the metrics watching the
    layers below."""
    metrics = NodeMetrics(config.region)
    core.storage.on_commit = metrics.observe_commit
    metrics.watch(core.replica, core.claims, peering.peers, peering.lives)
    if peering.member is not None:
        metrics.watch_member(peering.member)
    if tls is not None:
        metrics.watch_tls(tls)
    chain = _interceptors(config, tls, metrics)
    servicers = _servicers(config, tls, core, peering)
    server = _grpc_server(connections.client)
    names = _add_services(Registrar(server, chain), servicers, health, config.enable_writes)
    peer_server = None
    if connections.peer is not None:
        peer_server = _grpc_server(connections.peer)
        _add_peer_services(Registrar(peer_server, chain), servicers, health, config.enable_writes)
    return Surfaces(server, peer_server, health, metrics, names)


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
            # accept those pings instead of answering GOAWAY "too_many_pings" — even
            # several at once, as a node that stood still (a flood, a stall) reads
            # the ones that waited in its socket: a ping only ever reaches a node
            # over a connection that completed its handshake (authenticated, with TLS).
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
            ("grpc.http2.max_ping_strikes", 0),
            # One more connection is closed as it comes, and a burst of one call per
            # connection waits for the loop (fencemark.node.api.connections).
            *connections,
        ],
    )


def _servicers(
    config: NodeConfig, tls: LiveTls | None, core: Core, peering: Replication
) -> dict[str, object]:
    """The four fencemark servicers, by service name."""
    # A grant records the identity it was made to; without TLS there is none.
    callers = caller_of(config.access or DEFAULT_ACCESS) if tls is not None else anyone
    replicator, peers = peering.replicator, peering.peers
    return {
        "Records": RecordsService(
            core.replica, caller_of=callers, watch_send_timeout=config.watch_send_timeout
        ),
        "Claims": ClaimsService(core.claims, core.work, caller_of=callers, on_wait=give_back),
        "Node": NodeService(
            core.replica,
            core.claims,
            replicator,
            peers,
            writes_enabled=config.enable_writes,
            member=peering.member,
        ),
        "Replication": ReplicationService(
            core.replica,
            core.storage,
            peers,
            replicator.heard_from,
            replicator.pulled_by,
            authenticate=config.tls is not None,
            max_list_records=config.max_list_records,
            lives=peering.lives,
            lacks_acknowledged=replicator.lacks_acknowledged,
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
    (replication_service,) = (s for s in SERVICES if s.name == "Replication")
    server.add_generic_rpc_handlers(
        (
            gated_handler(
                servicers["Replication"], replication_service, writes_enabled=writes_enabled
            ),
        )
    )
    health_pb2_grpc.add_HealthServicer_to_server(health, cast(Any, server))


async def serve_health(health: Any, names: list[str], *, catching_up: bool) -> None:
    """Every service SERVING, but Claims while the node catches up."""
    for name in ("", *names):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    if catching_up:
        await health.set(CLAIMS_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)


def listen(server: grpc.aio.Server, address: str, tls: LiveTls | None) -> int:
    """Bind one of the node's ports (plaintext, or mutual TLS), its connections handed
    over by the kernel only once they speak (``handshakes.defer_listeners``); OSError
    if it cannot."""
    try:
        if tls is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, tls.server_credentials())
    except RuntimeError as exc:
        raise OSError(f"cannot listen on {address}: {exc}") from exc
    if not defer_listeners(port):
        log.warning("no listening socket of port %d found: it takes idle connections", port)
    return port

"""A node's configuration (``NodeConfig``), where its data lives by default, and the
TLS material it names, checked before anything opens."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

# grpc-stubs predates the asyncio health servicer; it is grpc_health.v1.health.aio.
from fencemark.node.api.authz import AccessMap
from fencemark.node.api.budgets import Limits
from fencemark.node.api.connections import MAX_CONNECTIONS, MAX_PEER_CONNECTIONS
from fencemark.node.api.handshakes import HANDSHAKE_TIMEOUT_S
from fencemark.node.coordination.member import MemberConfig
from fencemark.node.core.claims import MAX_WAITERS, MAX_WAITERS_PER_CLIENT
from fencemark.node.crdt.hlc import DEFAULT_MAX_CLOCK_OFFSET_MS
from fencemark.node.replication.intake import MAX_LIST_RECORDS
from fencemark.node.replication.tuning import Tuning
from fencemark.node.rules.integrity import DEFAULT_MAX_TOKEN_JUMP
from fencemark.node.rules.queue import DEFAULT_MAX_ATTEMPTS
from fencemark.node.security.tls import Identity, TlsFiles
from fencemark.node.security.tls_reload import LiveTls
from fencemark.node.store.feed import DEFAULT_WINDOW as DEFAULT_FEED_WINDOW
from fencemark.node.store.storage import (
    DB_FILE as DB_FILE,  # re-exported: where a node keeps its file
)


def default_data_dir(region: str) -> Path:
    """``$FENCEMARK_DATA_DIR`` or ``$XDG_DATA_HOME/fencemark/<region>``."""
    if explicit := os.environ.get("FENCEMARK_DATA_DIR"):
        return Path(explicit)
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "fencemark" / region


@dataclass(frozen=True)
class NodeConfig:
    region: str = "local"
    listen: str = "127.0.0.1:7400"
    data_dir: Path | None = None  # None: default_data_dir(region)
    enable_writes: bool = False
    max_clock_offset_ms: int = DEFAULT_MAX_CLOCK_OFFSET_MS
    cache_size: int = 10_000
    grace_seconds: float = 5.0
    peers: Mapping[str, str] = field(default_factory=dict)  # region -> HOST:PORT
    # HOST:PORT where peers dial in: replication and health only, with a connection
    # bound of its own (fencemark.node.api.connections); "" serves peers on `listen`.
    peer_listen: str = ""
    anti_entropy_interval: float = 1.0
    # A restarted node compares its states with every peer before it decides claims,
    # for at most this many seconds (fencemark.node.core.grant_gate: a data file that
    # went back in time); 0 decides at once, on the new era of tokens alone.
    start_wait_s: float = 10.0
    metrics_listen: str = ""  # HOST:PORT for Prometheus /metrics; "" serves none
    dashboard_listen: str = ""  # HOST:PORT for the read-only web dashboard; "" serves none
    # Floods: calls in flight beyond their class's budget are refused
    # RESOURCE_EXHAUSTED (fencemark.node.api.budgets); claims waiting in line hold no
    # call slot and are bounded in all and per client (fencemark.node.core.claims).
    max_concurrent_reads: int = Limits.read
    max_concurrent_writes: int = Limits.write
    max_concurrent_replication: int = Limits.replication
    max_concurrent_health: int = Limits.health
    max_waiters: int = MAX_WAITERS
    max_waiters_per_client: int = MAX_WAITERS_PER_CLIENT
    max_streams_per_client: int = Limits.streams_per_client
    # Connections open at once on `listen` (clients, and peers without peer_listen);
    # one more is closed as it comes (UNAVAILABLE, retried), never left to stall.
    max_connections: int = MAX_CONNECTIONS
    max_peer_connections: int = MAX_PEER_CONNECTIONS  # on peer_listen, if it is set
    # Seconds a connection that sent its first bytes has to complete its handshake,
    # on every port (fencemark.node.api.handshakes); one that sent nothing is kept
    # out of the process by the kernel.
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S
    # Attempts after which a failed or lapsed claim parks an item (SPEC §8), for
    # items without a maxAttempts:N tag.
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    # The change feed (Records.Watch): changes kept for cursors to resume from, and
    # how long a watcher may leave an event untaken before it is cut off.
    feed_window: int = DEFAULT_FEED_WINDOW
    watch_send_timeout: float = 10.0
    # A merged grant more than this above the grant below it is refused (integrity.py).
    max_token_jump: int = DEFAULT_MAX_TOKEN_JUMP
    # Transport security (docs/security.md): this node's certificate, key and the
    # cluster CA. None is plaintext: the in-process default (tests, benchmarks);
    # the `fencemark node` command insists on --tls-dir or an explicit --insecure.
    tls: TlsFiles | None = None
    # With tls: which client identity may do what (None: authz.DEFAULT_ACCESS).
    access: AccessMap | None = None
    # With tls: seconds between looks at the TLS files (renewed certificates, CA
    # bundle, crl.pem; fencemark.node.security.tls_reload); 0 reloads on SIGHUP only.
    tls_reload_interval: float = 5.0
    # Replication's bounds and pauses (fencemark.node.replication.replicator.Tuning),
    # and the records one listing a peer asks this node for may hold.
    replication: Tuning = field(default_factory=Tuning)
    max_list_records: int = MAX_LIST_RECORDS
    # A member of a region of several (SPEC §10): its name, etcd, the decider lease's
    # TTL (fencemark.node.coordination.member). None: the region's only node.
    member: MemberConfig | None = None
    # HOST:PORT this node's clients are sent to (the decider's redirect names it);
    # "": the bound client address.
    advertise: str = ""
    # HOST:PORT a member's fellow members replicate with it at (its registry entry);
    # "": the bound peer listener's address, else the client address it advertises.
    advertise_peer: str = ""

    @property
    def db_path(self) -> Path:
        return (self.data_dir or default_data_dir(self.region)) / DB_FILE

    @property
    def call_limits(self) -> Limits:
        return Limits(
            read=self.max_concurrent_reads,
            write=self.max_concurrent_writes,
            replication=self.max_concurrent_replication,
            health=self.max_concurrent_health,
            streams_per_client=self.max_streams_per_client,
        )


def transport(config: NodeConfig) -> str:
    """How the node's port is secured, in words for its start-up line."""
    if config.tls is None:
        return "plaintext, --insecure"
    return f"mutual TLS, CA {config.tls.ca}" + (", access map" if config.access else "")


def live_tls(config: NodeConfig) -> LiveTls | None:
    """The port's and the peer channels' TLS material, checked before anything opens.

    OSError for a file that cannot be read; ValueError for a certificate that is
    not this region's node (its peers would refuse it), a CRL no CA of the bundle
    signed, or an access map without TLS.
    """
    if config.tls is None:
        if config.access is not None:
            raise ValueError("an access map needs TLS: identities come from certificates")
        return None
    own = config.tls.identity()
    if own != Identity("region", config.region):
        raise ValueError(
            f"{config.tls.cert} is the certificate of {own}, not of region/{config.region}:"
            f" peers would refuse this node (make one: fencemark certs issue --region"
            f" {config.region})"
        )
    return LiveTls(config.tls, config.region)

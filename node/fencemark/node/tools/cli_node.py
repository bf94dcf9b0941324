"""``fencemark node``: its flags (each also from a ``FENCEMARK_*`` variable or the
``--config`` file) and running it."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fencemark.node.api.authz import AccessMap, load_access
from fencemark.node.api.server import NodeConfig, serve
from fencemark.node.api.telemetry import say
from fencemark.node.coordination.decider import DEFAULT_TTL_S
from fencemark.node.coordination.member import MemberConfig
from fencemark.node.replication.peers import parse_peers
from fencemark.node.rules import validation
from fencemark.node.rules.errors import InvalidInput
from fencemark.node.rules.queue import MAX_ATTEMPTS_LIMIT
from fencemark.node.security.tls import TlsFiles
from fencemark.node.tools.cli_rpc import usage_error

DEFAULT_TARGET = "127.0.0.1:7400"
# The cyclic garbage collector's thresholds in a node process: young collections as
# Python's default (700 allocations, then every 10th of those), a full collection
# only after FULL_COLLECTION_EVERY of the second generation's instead of 10.
# A full collection scans every object the process holds — thousands of cached
# record states, each dozens of tuples and dicts — and merging a peer's states
# (each one decoded and cached, as long-lived as the cache) set one off every few
# hundred merges: they took half the CPU of a repair (docs/performance.md, *The
# collector*). What they free, cycles that outlived two younger collections, is
# rare in a node: record states hold no cycles.
FULL_COLLECTION_EVERY = 1000
TRUE_WORDS = {"1", "true", "yes", "on"}


SECURITY_CHOICE = (
    "choose the transport: --tls-dir DIR (mutual TLS with certificates from"
    " `fencemark certs init`; env FENCEMARK_TLS_DIR) or --insecure (plaintext, for local"
    " development only; env FENCEMARK_INSECURE=1)"
)


def node_security(args: argparse.Namespace) -> tuple[TlsFiles | None, AccessMap | None]:
    """The node's TLS files and access map from its flags; ValueError if the choice is unclear."""
    if args.insecure and args.tls_dir:
        raise ValueError(f"--insecure and --tls-dir exclude each other: {SECURITY_CHOICE}")
    if not args.insecure and not args.tls_dir:
        raise ValueError(SECURITY_CHOICE)
    if args.insecure:
        if args.access:
            raise ValueError("--access needs --tls-dir: identities come from certificates")
        return None, None
    files = TlsFiles.in_dir(args.tls_dir, args.tls_name or args.region)
    return files, load_access(args.access) if args.access else None


def tune_collector() -> None:
    """Set this process's garbage collector for a node (``FULL_COLLECTION_EVERY``)."""
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_COLLECTION_EVERY)


def _refuse_to_start(message: str) -> int:
    """Why the node does not start, on stderr in the log format; the exit code, 2."""
    say("fencemark node", message, level=logging.ERROR, stream=sys.stderr)
    return 2


def _bad_bounds(args: argparse.Namespace) -> str:
    """What is wrong with the node's numeric flags; "" if nothing."""
    if args.feed_window < 1 or args.cache_size < 1 or not args.watch_send_timeout > 0:
        return (
            "--feed-window and --cache-size take 1 or more,"
            " --watch-send-timeout more than 0 seconds"
        )
    if not 0 <= args.start_wait <= 3600:
        return f"--start-wait takes 0 to 3600 seconds, got {args.start_wait}"
    if not 1 <= args.max_attempts <= MAX_ATTEMPTS_LIMIT:
        return f"--max-attempts takes 1 to {MAX_ATTEMPTS_LIMIT}, got {args.max_attempts}"
    for flag in ("max_connections", "max_peer_connections"):
        if getattr(args, flag) < 1:
            return f"--{flag.replace('_', '-')} takes 1 or more, got {getattr(args, flag)}"
    return ""


def cmd_node(args: argparse.Namespace) -> int:
    """Run the node: every line it writes follows ``--log-format``; exits 0 once stopped
    by SIGTERM or SIGINT, 2 when it cannot start (bad flags, its port taken)."""
    try:
        validation.region(args.region, "--region")
        peers = parse_peers(args.peer or args.configured_peers, own_region=args.region)
        tls_files, access = node_security(args)
        member = _member(args)
    except (InvalidInput, ValueError) as exc:
        return _refuse_to_start(str(exc))
    if args.max_concurrent_rpcs:
        say(
            "fencemark node",
            "--max-concurrent-rpcs is deprecated: it now sets"
            " --max-concurrent-reads and --max-concurrent-writes; replication and health"
            " checks have budgets of their own (docs/operations.md)",
            level=logging.WARNING,
            stream=sys.stderr,
        )
    if bad := _bad_bounds(args):
        return _refuse_to_start(bad)
    config = NodeConfig(
        region=args.region,
        listen=args.listen,
        data_dir=Path(args.data) if args.data else None,
        enable_writes=args.enable_writes,
        max_clock_offset_ms=args.max_clock_offset_ms,
        peers=peers,
        anti_entropy_interval=args.anti_entropy_interval,
        start_wait_s=args.start_wait,
        metrics_listen=args.metrics_listen,
        dashboard_listen=args.dashboard_listen,
        max_concurrent_reads=args.max_concurrent_rpcs or args.max_concurrent_reads,
        max_concurrent_writes=args.max_concurrent_rpcs or args.max_concurrent_writes,
        max_concurrent_replication=args.max_concurrent_replication,
        max_concurrent_health=args.max_concurrent_health,
        max_waiters=args.max_waiters,
        max_waiters_per_client=args.max_waiters_per_client,
        max_streams_per_client=args.max_streams_per_client,
        max_connections=args.max_connections,
        max_peer_connections=args.max_peer_connections,
        handshake_timeout_s=args.handshake_timeout,
        peer_listen=args.peer_listen,
        max_attempts=args.max_attempts,
        max_token_jump=args.max_token_jump,
        feed_window=args.feed_window,
        watch_send_timeout=args.watch_send_timeout,
        cache_size=args.cache_size,
        tls=tls_files,
        access=access,
        tls_reload_interval=args.tls_reload_interval,
        member=member,
        advertise=args.advertise,
        advertise_peer=args.advertise_peer,
    )
    tune_collector()
    try:
        asyncio.run(serve(config))
    except (OSError, ValueError) as exc:
        return _refuse_to_start(str(exc))
    return 0


def _member(args: argparse.Namespace) -> MemberConfig | None:
    """``--member`` and its flags as a ``MemberConfig`` (None: the region's only node);
    ValueError naming the flag when they do not fit together. The names themselves
    are checked with the rest of the configuration (``MemberConfig.problem``)."""
    from fencemark.node.coordination.etcd import parse_endpoints

    if not args.member:
        for flag in ("etcd", "etcd_tls_dir", "initial_members"):
            if getattr(args, flag):
                raise ValueError(f"--{flag.replace('_', '-')}: only with --member NAME")
        return None
    if not args.etcd:
        raise ValueError("--etcd: a member elects its region's decider through etcd: HOST:PORT")
    tls_dir = args.etcd_tls_dir or args.tls_dir
    if not tls_dir and not args.insecure:
        raise ValueError(
            "--etcd-tls-dir: etcd is reached over mutual TLS with the region's certificate"
            " (DIR/ca.pem, DIR/REGION.pem); give it, or --tls-dir"
        )
    name = args.tls_name or args.region
    initial = [n.strip() for n in args.initial_members.split(",") if n.strip()]
    return MemberConfig(
        args.member,
        parse_endpoints(args.etcd),
        TlsFiles.in_dir(Path(tls_dir), name) if tls_dir else None,
        args.decider_ttl,
        tuple(initial),
    )


def load_config(path: str) -> dict[str, Any]:
    """A node's TOML configuration file (keys as the flags; docs/replication.md#peers)."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        usage_error(f"fencemark: cannot read config {path}: {exc}")


def _setting(config: Mapping[str, Any], name: str, default: Any) -> Any:
    """A node setting's default: FENCEMARK_<NAME>, else the config file, else ``default``."""
    env = os.environ.get("FENCEMARK_" + name.upper())
    if env is not None and env != "":
        if isinstance(default, bool):
            return env.strip().lower() in TRUE_WORDS
        return type(default)(env) if default is not None else env
    return config.get(name, default)


def add_node_command(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], config: Mapping[str, Any]
) -> None:
    """``fencemark node``: every flag's default from the environment, else ``config``.

    About 65 lines of one ``add_argument`` each: a long list, not long logic."""
    node = sub.add_parser(
        "node",
        help="run a region node until SIGTERM/SIGINT",
        description="Run a region node. Each flag's default comes from FENCEMARK_<FLAG>"
        " (e.g. FENCEMARK_REGION), else from the --config file, else the built-in default.",
    )
    node.add_argument("--config", help="TOML file with the settings below (env FENCEMARK_CONFIG)")
    node.add_argument("--region", default=_setting(config, "region", "local"))
    node.add_argument(
        "--listen",
        default=_setting(config, "listen", DEFAULT_TARGET),
        help="HOST:PORT to serve gRPC on (port 0 picks a free one)",
    )
    node.add_argument(
        "--data",
        default=os.environ.get("FENCEMARK_DATA_DIR") or config.get("data"),
        help="data directory (default: $XDG_DATA_HOME/fencemark/REGION)",
    )
    node.add_argument(
        "--enable-writes",
        action="store_true",
        default=_setting(config, "enable_writes", False),
        help="serve mutating methods (env FENCEMARK_ENABLE_WRITES=1); off: reads only",
    )
    node.add_argument(
        "--peer",
        action="append",
        metavar="REGION=HOST:PORT[,HOST:PORT...]",
        help="a peer region's node (repeat; env FENCEMARK_PEERS=eu=h:p,ap=h:p;"
        " config table [peers]): its --peer-listen address if it has one; for a region of"
        " several members, any of them (several addresses, tried in turn)",
    )
    node.add_argument(
        "--peer-listen",
        default=_setting(config, "peer_listen", ""),
        metavar="HOST:PORT",
        help="serve the peers' replication (and health) on a port of their own, with a"
        " connection bound of its own, on a network only peers reach (default: none,"
        " peers dial --listen)",
    )
    node.add_argument(
        "--max-clock-offset-ms",
        type=int,
        default=_setting(config, "max_clock_offset_ms", 500),
        help="refuse remote stamps further ahead of this node's clock",
    )
    node.add_argument(
        "--anti-entropy-interval",
        type=float,
        default=_setting(config, "anti_entropy_interval", 1.0),
        help="mean seconds between anti-entropy rounds (jittered ±50%%)",
    )
    node.add_argument(
        "--start-wait",
        type=float,
        default=_setting(config, "start_wait", NodeConfig.start_wait_s),
        metavar="SECONDS",
        help="after a restart, decide claims once every peer gave one anti-entropy round,"
        " or after this many seconds (a data file that went back in time learns what it"
        " forgot first; docs/replication.md); 0: at once",
    )
    node.add_argument(
        "--metrics-listen",
        default=_setting(config, "metrics_listen", ""),
        metavar="HOST:PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (default: none)",
    )
    node.add_argument(
        "--dashboard-listen",
        default=_setting(config, "dashboard_listen", ""),
        metavar="HOST:PORT",
        help="serve the read-only web dashboard at http://HOST:PORT/ (https, asking for a"
        " client certificate, when the node serves TLS; default: none)",
    )
    defaults = NodeConfig()
    _add_bound_flags(node, config, defaults)
    _add_feed_flags(node, config, defaults)
    _add_security_flags(node, config, defaults)
    _add_member_flags(node, config)
    configured = os.environ.get("FENCEMARK_PEERS")
    node.set_defaults(
        func=cmd_node,
        configured_peers=[configured]
        if configured
        else [f"{r}={a}" for r, a in dict(config.get("peers", {})).items()],
    )


def _add_feed_flags(
    node: argparse.ArgumentParser, config: Mapping[str, Any], defaults: NodeConfig
) -> None:
    """The change feed's (Records.Watch) window and its watchers' send deadline, and
    the record cache in front of the file both read."""
    node.add_argument(
        "--feed-window",
        type=int,
        default=_setting(config, "feed_window", defaults.feed_window),
        help="changes the change feed keeps for Watch cursors to resume from"
        " (about 1 KiB of disk each for a typical record)",
    )
    node.add_argument(
        "--watch-send-timeout",
        type=float,
        default=_setting(config, "watch_send_timeout", defaults.watch_send_timeout),
        help="seconds a watcher may leave an event untaken before it is cut off",
    )
    node.add_argument(
        "--cache-size",
        type=int,
        default=_setting(config, "cache_size", defaults.cache_size),
        help="records whose decoded state is kept in memory; reads of the others go to"
        " the data file",
    )


def _add_bound_flags(
    node: argparse.ArgumentParser, config: Mapping[str, Any], defaults: NodeConfig
) -> None:
    """The node's bounds on floods: calls in flight per class, waiters, token jumps."""
    budgets = (
        ("reads", "Get, List, ClaimStatus, Info, health Watch streams, reflection"),
        ("writes", "Remember, Update, Delete, renewals, releases, and claims until they"
                   " wait in line: a waiting claim holds no call slot, --max-waiters bounds it"),
        ("replication", "the peers' Replication calls"),
        ("health", "grpc.health.v1 Check"),
    )  # fmt: skip
    for kind, methods in budgets:
        name = f"max_concurrent_{kind}"
        node.add_argument(
            f"--max-concurrent-{kind}",
            type=int,
            default=_setting(config, name, getattr(defaults, name)),
            help=f"calls in flight of this class ({methods}); beyond it a call is refused"
            f" RESOURCE_EXHAUSTED (env FENCEMARK_{name.upper()})",
        )
    node.add_argument(
        "--max-concurrent-rpcs",
        type=int,
        default=_setting(config, "max_concurrent_rpcs", 0),
        help="deprecated: sets both --max-concurrent-reads and --max-concurrent-writes",
    )
    node.add_argument(
        "--max-waiters",
        type=int,
        default=_setting(config, "max_waiters", defaults.max_waiters),
        help="claims waiting in queues (wait_seconds), over all records and clients",
    )
    node.add_argument(
        "--max-waiters-per-client",
        type=int,
        default=_setting(config, "max_waiters_per_client", defaults.max_waiters_per_client),
        help="claims waiting in queues from one client: one certificate identity"
        " (with --tls-dir), or one address (--insecure)",
    )
    node.add_argument(
        "--max-streams-per-client",
        type=int,
        default=_setting(config, "max_streams_per_client", defaults.max_streams_per_client),
        help="long-lived streams (Records.Watch, health Watch, reflection) open from one"
        " client: one certificate identity (with --tls-dir), or one address (--insecure)",
    )
    node.add_argument(
        "--max-connections",
        type=int,
        default=_setting(config, "max_connections", defaults.max_connections),
        help="connections open at once on --listen (clients, and peers without"
        " --peer-listen); one more is closed as it comes (UNAVAILABLE: retry). Lowered to"
        " fit the process's open-file limit",
    )
    node.add_argument(
        "--max-peer-connections",
        type=int,
        default=_setting(config, "max_peer_connections", defaults.max_peer_connections),
        help="connections open at once on --peer-listen; its descriptors are kept aside"
        " before --max-connections is fitted",
    )
    node.add_argument(
        "--handshake-timeout",
        type=float,
        default=_setting(config, "handshake_timeout", defaults.handshake_timeout_s),
        help="seconds a connection to any of the node's ports has, once it sent its first"
        " bytes, to complete its (TLS) handshake; one that sends nothing never reaches the"
        " node (env FENCEMARK_HANDSHAKE_TIMEOUT)",
    )
    node.add_argument(
        "--max-attempts",
        type=int,
        default=_setting(config, "max_attempts", defaults.max_attempts),
        help="claims of a work item after which a failed release or a lapsed lease parks"
        " it, for items without a maxAttempts:N tag",
    )
    node.add_argument(
        "--max-token-jump",
        type=int,
        default=_setting(config, "max_token_jump", defaults.max_token_jump),
        help="refuse to merge a grant further than this above the grant below it"
        " (default 2^21: twice the jump a home makes after a disk loss)",
    )


def _add_member_flags(node: argparse.ArgumentParser, config: Mapping[str, Any]) -> None:
    members = node.add_argument_group(
        "a region of several members (docs/operations.md, *A region of several members*)"
    )
    members.add_argument(
        "--member",
        default=_setting(config, "member", ""),
        metavar="NAME",
        help="run as member NAME of --region: its decider is elected through --etcd, and a"
        " write is answered once a majority of the region's members hold it (default:"
        " the region's only node, no etcd)",
    )
    members.add_argument(
        "--etcd",
        default=_setting(config, "etcd", ""),
        metavar="HOST:PORT[,HOST:PORT...]",
        help="the etcd cluster the region's members elect their decider through",
    )
    members.add_argument(
        "--etcd-tls-dir",
        default=_setting(config, "etcd_tls_dir", ""),
        metavar="DIR",
        help="reach etcd with DIR/ca.pem and the region's DIR/REGION.pem (default: --tls-dir)",
    )
    members.add_argument(
        "--decider-ttl",
        type=int,
        default=_setting(config, "decider_ttl", DEFAULT_TTL_S),
        metavar="SECONDS",
        help="the decider lease's TTL: a failover takes about this long",
    )
    members.add_argument(
        "--initial-members",
        default=_setting(config, "initial_members", ""),
        metavar="NAME,NAME...",
        help="the region's member set, made in etcd if the region has none yet (the first"
        " start of a region); later changes: fencemark etcd members",
    )
    members.add_argument(
        "--advertise",
        default=_setting(config, "advertise", ""),
        metavar="HOST:PORT",
        help="where clients reach this member (a redirect names it; default: --listen)",
    )
    members.add_argument(
        "--advertise-peer",
        default=_setting(config, "advertise_peer", ""),
        metavar="HOST:PORT",
        help="where the region's other members replicate with it (default: --peer-listen,"
        " else --advertise)",
    )


def _add_security_flags(
    node: argparse.ArgumentParser, config: Mapping[str, Any], defaults: NodeConfig
) -> None:
    security = node.add_argument_group(
        "transport security (docs/security.md): one of --tls-dir or --insecure is required"
    )
    security.add_argument(
        "--tls-dir",
        default=_setting(config, "tls_dir", ""),
        metavar="DIR",
        help="serve mutual TLS with DIR/ca.pem and this node's DIR/NAME.pem, DIR/NAME-key.pem"
        " (as `fencemark certs init` writes them); peers are called with the same certificate",
    )
    security.add_argument(
        "--tls-name",
        default=_setting(config, "tls_name", ""),
        metavar="NAME",
        help="the certificate's file name in --tls-dir (default: the region)",
    )
    security.add_argument(
        "--tls-reload-interval",
        type=float,
        default=_setting(config, "tls_reload_interval", defaults.tls_reload_interval),
        metavar="SECONDS",
        help="look at the --tls-dir files this often and take renewed certificates, a new"
        " ca.pem and crl.pem into use without a restart (0: on SIGHUP only)",
    )
    security.add_argument(
        "--insecure",
        action="store_true",
        default=_setting(config, "insecure", False),
        help="plaintext gRPC, no authentication: local development only",
    )
    security.add_argument(
        "--access",
        default=_setting(config, "access", ""),
        metavar="FILE",
        help="TOML (or .json) map of client names to rights: read, write, claim"
        " (default with TLS: every client certificate of the CA may read, write and claim)",
    )

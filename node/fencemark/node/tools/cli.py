"""The ``fencemark`` command: run a node, talk to one, or run the demo.

Subcommands that talk to a node mirror the gRPC API one to one (etcdctl style)
and print JSON; ``node``, ``walkthrough``, ``demo`` and ``status`` are for
operators. Every flag of ``node`` can also come from a ``FENCEMARK_*`` variable.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import signal
import sys
import tomllib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fencemark.node import __version__
from fencemark.node.api.authz import AccessMap, load_access
from fencemark.node.api.server import NodeConfig, default_data_dir, serve
from fencemark.node.api.telemetry import LOG_FORMATS, configure_logging
from fencemark.node.replication.peers import parse_peers
from fencemark.node.rules import validation
from fencemark.node.rules.errors import InvalidInput
from fencemark.node.security.tls import TlsFiles
from fencemark.node.tools.cli_rpc import add_rpc_commands, client_credentials
from fencemark.node.tools.proxy_command import add_proxy_command

DEFAULT_TARGET = "127.0.0.1:7400"
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


def cmd_node(args: argparse.Namespace) -> int:
    try:
        validation.region(args.region, "--region")
        peers = parse_peers(args.peer or args.configured_peers, own_region=args.region)
        tls_files, access = node_security(args)
    except (InvalidInput, ValueError) as exc:
        print(f"fencemark node: {exc}", file=sys.stderr)
        return 2
    if args.max_concurrent_rpcs:
        print(
            "fencemark node: --max-concurrent-rpcs is deprecated: it now sets"
            " --max-concurrent-reads and --max-concurrent-writes; replication and health"
            " checks have budgets of their own (docs/operations.md)",
            file=sys.stderr,
        )
    config = NodeConfig(
        region=args.region,
        listen=args.listen,
        data_dir=Path(args.data) if args.data else None,
        enable_writes=args.enable_writes,
        max_clock_offset_ms=args.max_clock_offset_ms,
        peers=peers,
        anti_entropy_interval=args.anti_entropy_interval,
        metrics_listen=args.metrics_listen,
        max_concurrent_reads=args.max_concurrent_rpcs or args.max_concurrent_reads,
        max_concurrent_writes=args.max_concurrent_rpcs or args.max_concurrent_writes,
        max_concurrent_replication=args.max_concurrent_replication,
        max_concurrent_health=args.max_concurrent_health,
        max_waiters=args.max_waiters,
        max_waiters_per_client=args.max_waiters_per_client,
        max_token_jump=args.max_token_jump,
        tls=tls_files,
        access=access,
        tls_reload_interval=args.tls_reload_interval,
    )
    try:
        asyncio.run(serve(config))
    except (OSError, ValueError) as exc:
        print(f"fencemark node: {exc}", file=sys.stderr)
        return 2
    return 0


# -- client commands ----------------------------------------------------------------


def cmd_walkthrough(args: argparse.Namespace) -> int:
    from fencemark.client.walkthrough import run_walkthrough

    ok = asyncio.run(
        run_walkthrough(
            args.target, lease_seconds=args.lease_seconds, credentials=client_credentials(args)
        )
    )
    return 0 if ok else 1


def cmd_mcp(args: argparse.Namespace) -> int:
    from fencemark.mcp.server import run

    return run(
        args.target,
        regions=args.regions,
        timeout=args.timeout,
        transport=args.transport,
        listen=args.listen,
        credentials=client_credentials(args),
    )


def cmd_status(args: argparse.Namespace) -> int:
    """A cluster overview: one row per node, one indented row per peer it replicates with."""
    from fencemark.client import AsyncClient, FencemarkError, NodeInfo

    async def look(target: str) -> tuple[NodeInfo, str] | FencemarkError:
        try:
            async with AsyncClient(
                target, timeout=args.timeout, retries=0, credentials=credentials
            ) as client:
                return await client.info(), await client.health()
        except FencemarkError as exc:
            return exc

    credentials = client_credentials(args)

    async def run() -> list[str]:
        seen = await asyncio.gather(*(look(target) for target in args.targets))
        width = max(22, *(len(t) + 1 for t in args.targets))
        lines = [
            f"{'TARGET':<{width}} {'REGION':<8} {'NODE':<13} {'HEALTH':<12} {'CLAIMS':<12}"
            f" {'WRITES':<6} {'RECORDS':>8}"
        ]
        serving, lags, divergence, skew = 0, [], 0, 0
        for target, answer in zip(args.targets, seen, strict=True):
            if isinstance(answer, FencemarkError):
                lines.append(f"{target:<{width}} unreachable: {answer}")
                continue
            info, health = answer
            serving += health == "SERVING"
            claims = "serving" if info.claims_serving else "catching-up"
            lines.append(
                f"{target:<{width}} {info.region:<8} {info.node_id:<13} {health:<12} {claims:<12}"
                f" {'on' if info.writes_enabled else 'off':<6} {info.record_count:>8}"
            )
            for p in info.peers:
                lags.append(p.lag_ms)
                divergence += p.divergence
                skew += p.skew_alarms
                state = "reachable" if p.reachable else "UNREACHABLE"
                row = (
                    f"  peer {p.region:<8} {state:<12} lag {p.lag_ms / 1000:>6.1f} s"
                    f"  divergence {p.divergence:>5}  skew alarms {p.skew_alarms:>3}"
                    f"  push backlog {p.push_backlog:>5}"
                    + (f"  REFUSED {p.merges_refused} states" if p.merges_refused else "")
                )
                lines.append(row + (f"  last error: {p.last_error}" if p.last_error else ""))
                if p.last_refusal:
                    lines.append(f"    last refused state: {p.last_refusal}")
        lines.append(
            f"{serving} of {len(args.targets)} nodes serving; largest peer lag"
            f" {max(lags, default=0) / 1000:.1f} s; divergence {divergence}; skew alarms {skew}"
        )
        return lines

    print("\n".join(asyncio.run(run())))
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    """Exit 0 iff the node reports SERVING (standard grpc.health.v1 Check): a probe."""
    from fencemark.client import AsyncClient, FencemarkError

    credentials = client_credentials(args)

    async def check() -> str:
        async with AsyncClient(
            args.target, timeout=args.timeout, retries=0, credentials=credentials
        ) as client:
            return await client.health(args.service)

    subject = f"{args.target} {args.service or '(node)'}"
    try:
        status = asyncio.run(check())
    except FencemarkError as exc:
        print(f"fencemark health: {subject}: {exc}", file=sys.stderr)
        return 1
    print(f"fencemark health: {subject}: {status}")
    return 0 if status == "SERVING" else 1


def cmd_demo(args: argparse.Namespace) -> int:
    from fencemark.node.tools.demo import run_demo

    return asyncio.run(
        run_demo(
            regions=_regions(args.regions),
            items=args.items,
            agents_per_region=args.agents_per_region,
            lease_seconds=args.lease_seconds,
            cut_seconds=args.cut_seconds,
            work_seconds=args.work_seconds,
            seed_value=args.seed,
            data_dir=args.data,
        )
    )


def cmd_bench(args: argparse.Namespace) -> int:
    try:
        from fencemark.bench.runner import main as bench
    except ImportError as exc:
        print(
            f"fencemark bench: {exc}; install the benchmark extra: pip install 'fencemark[bench]'",
            file=sys.stderr,
        )
        return 2
    docs = args.docs
    if docs is None and not args.quick and not args.scenarios and not args.no_docs:
        default = Path("docs") / "performance.md"  # a full run in the repository
        docs = str(default) if default.is_file() else None
    return bench(
        args.scenarios, quick=args.quick, results=args.results, docs=None if args.no_docs else docs
    )


def _regions(spec: str) -> list[str]:
    regions = [r.strip() for r in spec.split(",") if r.strip()]
    try:
        for region in regions:
            validation.region(region, "--regions")
    except InvalidInput as exc:
        raise SystemExit(f"fencemark: {exc}") from exc
    if len(set(regions)) != len(regions) or len(regions) < 2:
        raise SystemExit("fencemark: --regions takes two or more distinct names, e.g. us,eu,ap")
    return regions


def cmd_cluster(args: argparse.Namespace) -> int:
    from fencemark.node.tools.cluster import LocalCluster

    regions = _regions(args.regions)
    root = Path(args.data) if args.data else default_data_dir("cluster")

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        cluster = await LocalCluster.start(regions, root, base_port=args.base_port)
        try:
            print(
                f"fencemark cluster: {len(regions)} regions, plaintext (--insecure),"
                f" data under {root}"
            )
            for region, address in cluster.addresses.items():
                print(f"  region {region:<8} listening on {address}")
            first = cluster.addresses[regions[0]]
            routes = ",".join(f"{r}={a}" for r, a in cluster.addresses.items())
            print(f"try: fencemark status --targets {' '.join(cluster.addresses.values())}")
            print(f"     fencemark walkthrough --target {first}")
            print(f"     (a client routing by region: AsyncClient({first!r}, regions=...{routes}))")
            print("Ctrl-C stops the cluster.", flush=True)
            await stop.wait()
        finally:
            await cluster.stop()

    asyncio.run(run())
    return 0


def cmd_certs_init(args: argparse.Namespace) -> int:
    from fencemark.node.security.tls import init_dir

    directory = Path(args.dir)
    try:
        if args.if_missing and (directory / "ca.pem").exists():
            print(f"fencemark certs: {directory} already holds a CA; nothing to do")
            return 0
        written = init_dir(
            directory,
            regions=_names(args.regions),
            clients=_names(args.clients),
            hosts=_names(args.hosts),
        )
    except (InvalidInput, ValueError, OSError) as exc:
        print(f"fencemark certs: {exc}", file=sys.stderr)
        return 2
    print(
        f"fencemark certs: a development CA and {len(written) // 2 - 1} certificates in {directory}"
    )
    for path in written:
        print(f"  {path}")
    return 0


def cmd_certs_issue(args: argparse.Namespace) -> int:
    from fencemark.node.security.tls import Identity, issue_into

    try:
        if args.region:
            identity = Identity("region", validation.region(args.region, "--region"))
        else:
            identity = Identity("client", validation.region(args.client, "--client"))
        files = issue_into(Path(args.dir), identity, hosts=_names(args.hosts))
    except (InvalidInput, ValueError, OSError) as exc:
        print(f"fencemark certs: {exc}", file=sys.stderr)
        return 2
    print(f"fencemark certs: {identity.uri}: {files.cert}, {files.key}")
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    """Mark a stopped node's database as restored from a backup (docs/operations.md)."""
    from fencemark.node.core.restore import RestoreError, mark_restored
    from fencemark.node.rules.admission import RECOVERY_GAP

    try:
        restored = mark_restored(Path(args.data), backup=Path(args.backup) if args.backup else None)
    except (RestoreError, OSError) as exc:
        print(f"fencemark restore: {exc}", file=sys.stderr)
        return 2
    print(
        f"fencemark restore: {restored.path} ({restored.records} records) is marked restored,"
        f" new node id {restored.node_id}: the first claim granted on each record homed in this"
        f" node's region jumps its fencing token at least {RECOVERY_GAP} above the fence, past"
        " every token granted after the backup. Restore every region this way before"
        " starting any."
    )
    return 0


def add_restore_command(sub: Any) -> None:
    restore = sub.add_parser(
        "restore",
        help="restore a stopped node from a backup so no fencing token is granted twice",
        description="Restore a whole cluster: stop every node, run this on each node's data"
        " directory with the same backup, then start them. The node gets a new identity, and"
        " the first grant on each record it is home of jumps 2^20 above the fence, so a token"
        " granted after the backup (and forgotten by it) is never granted again: its holder is"
        " refused as superseded (docs/operations.md, backups and restores).",
    )
    restore.add_argument(
        "--data", required=True, metavar="DIR", help="the stopped node's data directory"
    )
    restore.add_argument(
        "--from",
        dest="backup",
        default="",
        metavar="BACKUP",
        help="copy this backup file into DIR first (refused if DIR already holds a database);"
        " without it, mark the database already copied into DIR",
    )
    restore.set_defaults(func=cmd_restore)


def cmd_certs_revoke(args: argparse.Namespace) -> int:
    from fencemark.node.security.revocation import revoke, serial_of

    directory = Path(args.dir)
    try:
        if args.serial:
            try:
                serial = int(args.serial, 16)
            except ValueError:
                raise ValueError(f"--serial: not a hexadecimal number: {args.serial!r}") from None
            what = f"serial {serial:x}"
        else:
            name = args.client or args.region
            if name:
                validation.region(name, "--client" if args.client else "--region")
            cert = Path(args.cert) if args.cert else directory / f"{name}.pem"
            serial = serial_of(cert)
            what = f"{cert} (serial {serial:x})"
        path, count = revoke(directory, [serial])
    except (InvalidInput, ValueError, OSError) as exc:
        print(f"fencemark certs: {exc}", file=sys.stderr)
        return 2
    print(
        f"fencemark certs: revoked {what}; {path} lists {count} revoked certificates."
        " Copy it into every node's --tls-dir: nodes read it within --tls-reload-interval"
        " (or at once on SIGHUP)."
    )
    return 0


def _names(spec: str) -> list[str]:
    return [n.strip() for n in (spec or "").split(",") if n.strip()]


def add_certs_command(sub: Any) -> None:
    certs = sub.add_parser(
        "certs",
        help="make a development CA and node/client certificates for mutual TLS",
        description="A development CA (EC P-256) and certificates whose identity is a"
        " fencemark://region/NAME or fencemark://client/NAME URI (docs/operations.md).",
    )
    what = certs.add_subparsers(dest="certs_command", required=True, metavar="ACTION")
    init = what.add_parser("init", help="a new CA, one certificate per region and client")
    init.add_argument("--dir", required=True, help="where to write the PEM files")
    init.add_argument("--regions", required=True, help="comma-separated region names")
    init.add_argument("--clients", default="", help="comma-separated client names")
    init.add_argument(
        "--hosts", default="", help="extra DNS names/IPs for every node certificate (comma-sep.)"
    )
    init.add_argument(
        "--if-missing", action="store_true", help="do nothing if DIR already holds a CA"
    )
    init.set_defaults(func=cmd_certs_init)
    issue = what.add_parser("issue", help="one more certificate from an existing CA in --dir")
    issue.add_argument("--dir", required=True)
    who = issue.add_mutually_exclusive_group(required=True)
    who.add_argument("--region", help="a node certificate for this region")
    who.add_argument("--client", help="a client certificate with this name")
    issue.add_argument("--hosts", default="", help="extra DNS names/IPs (node certificates)")
    issue.set_defaults(func=cmd_certs_issue)
    revoke = what.add_parser(
        "revoke",
        help="add a certificate to the CA's revocation list (--dir/crl.pem)",
        description="Revoke one certificate of the CA in --dir: its serial number goes into"
        " crl.pem, a CRL signed by that CA. Nodes refuse it on every call"
        " (PERMISSION_DENIED, revoked_certificate) once crl.pem is in their --tls-dir."
        " A new certificate for the same name is not affected.",
    )
    revoke.add_argument("--dir", required=True, help="the CA's directory (ca.pem, ca-key.pem)")
    which = revoke.add_mutually_exclusive_group(required=True)
    which.add_argument("--client", help="revoke DIR/CLIENT.pem")
    which.add_argument("--region", help="revoke DIR/REGION.pem (a node's certificate)")
    which.add_argument("--cert", help="revoke the certificate in this PEM file")
    which.add_argument("--serial", help="revoke by serial number (hexadecimal)")
    revoke.set_defaults(func=cmd_certs_revoke)


def add_client_tls_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tls-dir",
        default=os.environ.get("FENCEMARK_TLS_DIR", ""),
        metavar="DIR",
        help="call over mutual TLS with DIR/ca.pem and the client certificate --tls-name"
        " (env FENCEMARK_TLS_DIR); without it, plaintext",
    )
    p.add_argument(
        "--tls-name",
        default=os.environ.get("FENCEMARK_TLS_NAME", ""),
        metavar="NAME",
        help="DIR/NAME.pem and DIR/NAME-key.pem (env FENCEMARK_TLS_NAME)",
    )


# -- argument parsing -----------------------------------------------------------------


def load_config(path: str) -> dict[str, Any]:
    """A node's TOML configuration file (keys as the flags; docs/replication.md#peers)."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SystemExit(f"fencemark: cannot read config {path}: {exc}") from exc


def _setting(config: Mapping[str, Any], name: str, default: Any) -> Any:
    """A node setting's default: FENCEMARK_<NAME>, else the config file, else ``default``."""
    env = os.environ.get("FENCEMARK_" + name.upper())
    if env is not None and env != "":
        if isinstance(default, bool):
            return env.strip().lower() in TRUE_WORDS
        return type(default)(env) if default is not None else env
    return config.get(name, default)


def build_parser(config: Mapping[str, Any] | None = None) -> argparse.ArgumentParser:
    """The ``fencemark`` parser; ``config`` is a node config file's contents."""
    config = config or {}
    parser = argparse.ArgumentParser(
        prog="fencemark",
        description="Fencemark: a replicated store for agent work queues, with fenced claims.",
    )
    parser.add_argument("--version", action="version", version=f"fencemark {__version__}")
    parser.add_argument(
        "--log-level",
        default=os.environ.get("FENCEMARK_LOG_LEVEL", "WARNING"),
        help="log level (env FENCEMARK_LOG_LEVEL); INFO adds one line per request",
    )
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=os.environ.get("FENCEMARK_LOG_FORMAT") or "text",
        help="text for people, json (one object per line, with request ids) for log"
        " pipelines (env FENCEMARK_LOG_FORMAT)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _add_node_command(sub, config)
    client_parser = functools.partial(_client_parser, sub)
    _add_walkthrough_command(client_parser)
    _add_mcp_command(client_parser)
    _add_demo_command(sub)
    _add_bench_command(sub)
    _add_cluster_command(sub)
    _add_status_command(sub)
    _add_health_command(client_parser)
    add_certs_command(sub)
    add_restore_command(sub)
    add_proxy_command(sub)
    add_rpc_commands(client_parser)
    return parser


def _add_node_command(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], config: Mapping[str, Any]
) -> None:
    """``fencemark node``: every flag's default from the environment, else ``config``."""
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
        metavar="REGION=HOST:PORT",
        help="a peer region's node (repeat; env FENCEMARK_PEERS=eu=h:p,ap=h:p;"
        " config table [peers])",
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
        "--metrics-listen",
        default=_setting(config, "metrics_listen", ""),
        metavar="HOST:PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (default: none)",
    )
    defaults = NodeConfig()
    _add_bound_flags(node, config, defaults)
    _add_security_flags(node, config, defaults)
    configured = os.environ.get("FENCEMARK_PEERS")
    node.set_defaults(
        func=cmd_node,
        configured_peers=[configured]
        if configured
        else [f"{r}={a}" for r, a in dict(config.get("peers", {})).items()],
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
        "--max-token-jump",
        type=int,
        default=_setting(config, "max_token_jump", defaults.max_token_jump),
        help="refuse to merge a grant further than this above the grant below it"
        " (default 2^21: twice the jump a home makes after a disk loss)",
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


def _client_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, help: str
) -> argparse.ArgumentParser:
    """A command that calls one node: --target, --timeout and the client's TLS flags."""
    p = sub.add_parser(name, help=help)
    p.add_argument("--target", default=os.environ.get("FENCEMARK_TARGET", DEFAULT_TARGET))
    p.add_argument("--timeout", type=float, default=10.0, help="deadline per call (s)")
    add_client_tls_flags(p)
    return p


def _add_walkthrough_command(client_parser: Callable[[str, str], argparse.ArgumentParser]) -> None:
    walk = client_parser("walkthrough", "run the SPEC §1 walkthrough against a node")
    walk.add_argument("--lease-seconds", type=float, default=2.0)
    walk.set_defaults(func=cmd_walkthrough)


def _add_mcp_command(client_parser: Callable[[str, str], argparse.ArgumentParser]) -> None:
    mcp = client_parser(
        "mcp", "serve the repocontext_* MCP tools (stdio or streamable HTTP) for a node"
    )
    mcp.add_argument(
        "--regions",
        default=None,
        metavar="REGION=HOST:PORT,...",
        help="route claims and fenced writes to each record's home region",
    )
    mcp.add_argument("--transport", choices=("stdio", "http"), default="stdio")
    mcp.add_argument(
        "--listen",
        default="127.0.0.1:7480",
        help="HOST:PORT for --transport http (port 0 picks one); the endpoint is /mcp",
    )
    mcp.set_defaults(func=cmd_mcp)


def _add_demo_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    demo = sub.add_parser(
        "demo",
        help="the main job: agents in three regions drain a backlog under faults, then verify",
    )
    demo.add_argument("--regions", default="us,eu,ap", help="comma-separated region names")
    demo.add_argument("--items", type=int, default=30, help="backlog items to drain")
    demo.add_argument(
        "--work-seconds", type=float, default=0.3, help="time an agent spends per progress step"
    )
    demo.add_argument("--agents-per-region", type=int, default=3)
    demo.add_argument("--lease-seconds", type=float, default=2.0)
    demo.add_argument("--cut-seconds", type=float, default=4.0, help="how long a region is cut off")
    demo.add_argument("--seed", type=int, default=None, help="replay a run's random choices")
    demo.add_argument("--data", default=None, help="data directory (default: a temporary one)")
    demo.set_defaults(func=cmd_demo)


def _add_bench_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = sub.add_parser(
        "bench",
        help="benchmarks: claim cycle vs etcd and Redis, writes, lag, anti-entropy, footprint",
        description="Run the benchmark scenarios (all by default: claims, writes, lag,"
        " anti-entropy, footprint) with their baselines, and write JSON, Markdown and PNG"
        " plots under --results. A full run of every scenario in the repository also"
        " rewrites the headline of docs/performance.md.",
    )
    bench.add_argument("scenarios", nargs="*", metavar="SCENARIO", help="scenarios to run")
    bench.add_argument(
        "--quick", action="store_true", help="short runs (under two minutes): a smoke test"
    )
    bench.add_argument("--results", default=str(Path("bench") / "results"), help="output dir")
    bench.add_argument("--docs", default=None, help="the Markdown file to write the headline in")
    bench.add_argument("--no-docs", action="store_true", help="never rewrite any docs")
    bench.set_defaults(func=cmd_bench)


def _add_cluster_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cluster = sub.add_parser(
        "cluster", help="run a local multi-region cluster (one node process per region)"
    )
    cluster.add_argument("--regions", default="us,eu,ap", help="comma-separated region names")
    cluster.add_argument(
        "--base-port", type=int, default=7400, help="first region's port; the next ones follow"
    )
    cluster.add_argument("--data", default=None, help="data root (default: XDG data dir)")
    cluster.set_defaults(func=cmd_cluster)


def _add_status_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    status = sub.add_parser(
        "status",
        help="cluster overview: each node's health, records and claims, and per peer:"
        " reachability, lag, divergence, skew alarms",
    )
    status.add_argument(
        "--targets",
        nargs="+",
        default=os.environ.get("FENCEMARK_TARGETS", DEFAULT_TARGET).split(","),
    )
    status.add_argument("--timeout", type=float, default=3.0)
    add_client_tls_flags(status)
    status.set_defaults(func=cmd_status)


def _add_health_command(client_parser: Callable[[str, str], argparse.ArgumentParser]) -> None:
    health = client_parser("health", "grpc.health.v1 Check: exit 0 iff SERVING (a probe)")
    health.add_argument(
        "--service",
        default="",
        help="a service's health instead of the node's, e.g. fencemark.v1.Claims",
    )
    # A probe answers fast or not at all: shorter than docker's 5 s healthcheck timeout.
    health.set_defaults(func=cmd_health, timeout=3.0)


def main(argv: Sequence[str] | None = None) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=os.environ.get("FENCEMARK_CONFIG"))
    known, _ = pre.parse_known_args(argv)
    config = load_config(known.config) if known.config else {}
    args = build_parser(config).parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    result: int = args.func(args)
    return result

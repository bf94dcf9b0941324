"""The ``fencemark`` command: run a node, talk to one, or run the demo.

Subcommands that talk to a node mirror the gRPC API one to one (etcdctl style)
and print JSON; ``node``, ``walkthrough``, ``demo`` and ``status`` are for
operators. Every flag of ``node`` can also come from a ``FENCEMARK_*`` variable.

Exit codes (docs/api.md, *Exit codes*): a command that calls a node exits 0 done, 1
refused with an error, 2 bad usage, 3 answered no as a value, 4 node unreachable
(``cli_rpc``). The checks (``health``, ``walkthrough``, ``demo``) exit 0 when they
pass and 1 when not, as Docker's HEALTHCHECK reads them; ``status`` is a report: 0
once it printed.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import os
import re
import signal
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fencemark.node import __version__
from fencemark.node.api.server import default_data_dir
from fencemark.node.api.telemetry import LOG_FORMATS, configure_logging
from fencemark.node.rules import validation
from fencemark.node.rules.errors import InvalidInput
from fencemark.node.tools.cli_certs import add_certs_command, add_restore_command
from fencemark.node.tools.cli_etcd import add_etcd_command
from fencemark.node.tools.cli_node import DEFAULT_TARGET, add_node_command, load_config
from fencemark.node.tools.cli_rpc import (
    add_rpc_commands,
    client_credentials,
    failure_line,
    print_json,
    usage_error,
)
from fencemark.node.tools.proxy_command import add_proxy_command

if TYPE_CHECKING:
    from fencemark.client import NodeInfo
    from fencemark.node.tools.adopt import Bindings, PushBindings

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

    target, regions = args.target, args.regions
    if args.bindings:
        from fencemark.node.tools.adopt import AdoptError, load_bindings

        try:
            bindings = load_bindings(Path(args.bindings))
        except AdoptError as exc:
            print(f"fencemark mcp: {exc}", file=sys.stderr)
            return 2
        target = target or bindings.target
        regions = regions or bindings.regions_flag()
    return run(
        target or os.environ.get("FENCEMARK_TARGET", DEFAULT_TARGET),
        regions=regions,
        timeout=args.timeout,
        transport=args.transport,
        listen=args.listen,
        credentials=client_credentials(args),
    )


def _decider_words(info: NodeInfo) -> str:
    """What a member says of its region's decider, for ``fencemark status``."""
    decider = info.decider
    if decider is None:
        return f"no decider known for region {info.region} (an election, or etcd unreachable)"
    if decider.member == info.member:
        return f"decides for region {info.region} (term {decider.term})"
    return f"decider {decider.member} (term {decider.term}) at {decider.address}"


def _claims_words(info: NodeInfo) -> str:
    """``fencemark status``'s CLAIMS column: whether the node decides its region's
    claims, and if not, why: catching up, or a member that leaves them to its decider
    (``to-decider``) or knows none (``no-decider``)."""
    if info.claims_serving:
        return "serving"
    if info.member and not info.owes_catch_up:
        decider = info.decider
        if decider is None:
            return "no-decider"
        if decider.member != info.member:
            return "to-decider"
    return "catching-up"


def cmd_status(args: argparse.Namespace) -> int:
    """A cluster overview: one row per node, one indented row per peer it replicates with."""
    from fencemark.client import AsyncClient, FencemarkError

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
            claims = _claims_words(info)
            lines.append(
                f"{target:<{width}} {info.region:<8} {info.node_id:<13} {health:<12} {claims:<12}"
                f" {'on' if info.writes_enabled else 'off':<6} {info.record_count:>8}"
            )
            if info.member:
                lines.append(f"  member {info.member}: {_decider_words(info)}")
                members = ", ".join(info.members) if info.members else "not known yet"
                learner = " (a learner: not in it)" if info.member not in info.members else ""
                lines.append(f"  members of region {info.region}: {members}{learner}")
                if info.owes_catch_up:
                    lines.append(
                        f"  member {info.member} owes a catch-up (a new, emptied or restored"
                        " file): it campaigns once it has caught up with its fellow members"
                    )
                if info.cut_off:
                    lines.append(
                        f"  member {info.member} reaches no majority of its members (cut off"
                        " from them): it does not campaign until it does"
                    )
            for p in info.peers:
                lags.append(p.lag_ms)
                divergence += p.divergence
                skew += p.skew_alarms
                state = "reachable" if p.reachable else "UNREACHABLE"
                row = (
                    f"  {'member' if p.member else 'peer'} {p.name:<8} {state:<12}"
                    f" lag {p.lag_ms / 1000:>6.1f} s"
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

    async def answers() -> list[dict[str, object]]:
        seen = await asyncio.gather(*(look(target) for target in args.targets))
        return [
            {"target": target, "error": str(answer)}
            if isinstance(answer, FencemarkError)
            else {"target": target, "health": answer[1], **dataclasses.asdict(answer[0])}
            for target, answer in zip(args.targets, seen, strict=True)
        ]

    async def deciders() -> tuple[dict[str, str], list[str]]:
        """region -> the decider every answering member names; the regions whose
        members disagree, or of which one names none (an election under way)."""
        seen = await asyncio.gather(*(look(target) for target in args.targets))
        named: dict[str, set[str | None]] = {}
        for answer in seen:
            if isinstance(answer, FencemarkError) or not answer[0].member:
                continue
            info = answer[0]
            named.setdefault(info.region, set()).add(info.decider.member if info.decider else None)
        agreed = {r: next(iter(m)) for r, m in sorted(named.items()) if len(m) == 1}
        return (
            {r: m for r, m in agreed.items() if m is not None},
            [r for r in sorted(named) if agreed.get(r) is None],
        )

    if args.json:
        print_json({"nodes": asyncio.run(answers())})  # times as ISO 8601, as `info` shows them
        return 0
    if args.decider:
        agreed, undecided = asyncio.run(deciders())
        for region, member in agreed.items():
            print(member if len(agreed) == 1 and not undecided else f"{region} {member}")
        for region in undecided:
            print(f"fencemark status: region {region}: its members name no one decider",
                  file=sys.stderr)  # fmt: skip
        if not agreed and not undecided:
            print("fencemark status: no target is a member of a region of several", file=sys.stderr)
        return 0 if agreed and not undecided else 1
    print("\n".join(asyncio.run(run())))
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    """Exit 0 iff the node reports SERVING (standard grpc.health.v1 Check): a probe.

    Docker's HEALTHCHECK reads 0 healthy and 1 unhealthy, and reserves 2: anything
    but SERVING, the node unreachable included, is 1 (not the 4 of the RPC commands).
    """
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
        why = failure_line(exc, target=args.target, tls=credentials is not None)
        print(f"fencemark health: {subject}: {why}", file=sys.stderr)
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
            members=args.members,
        )
    )


def cmd_bench(args: argparse.Namespace) -> int:
    from fencemark.bench.scenarios import INSTALL_EXTRA, missing_modules

    missing = missing_modules()
    if missing:
        print(
            f"fencemark bench: {', '.join(missing)} not installed (the benchmark extra):"
            f" {INSTALL_EXTRA}",
            file=sys.stderr,
        )
        return 2
    from fencemark.bench.runner import main as bench

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
        usage_error(f"fencemark: {exc}")
    if len(set(regions)) != len(regions) or len(regions) < 2:
        usage_error("fencemark: --regions takes two or more distinct names, e.g. us,eu,ap")
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

    add_node_command(sub, config)
    client_parser = functools.partial(_client_parser, sub)
    _add_walkthrough_command(client_parser)
    _add_mcp_command(client_parser)
    _add_adopt_commands(sub, client_parser)
    _add_demo_command(sub)
    _add_bench_command(sub)
    _add_cluster_command(sub)
    _add_status_command(sub)
    _add_health_command(client_parser)
    add_certs_command(sub)
    add_etcd_command(sub)
    add_restore_command(sub)
    add_proxy_command(sub)
    add_rpc_commands(client_parser)
    return parser


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
    mcp.add_argument(
        "--bindings",
        default=None,
        metavar="FILE",
        help="take --target and --regions from a repository's bindings"
        " (.fencemark/bindings.toml, written by `fencemark init`)",
    )
    mcp.set_defaults(target=None)  # from --bindings, FENCEMARK_TARGET or the default
    mcp.add_argument("--transport", choices=("stdio", "http"), default="stdio")
    mcp.add_argument(
        "--listen",
        default="127.0.0.1:7480",
        help="HOST:PORT for --transport http (port 0 picks one); the endpoint is /mcp",
    )
    mcp.set_defaults(func=cmd_mcp)


def _add_adopt_commands(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    client_parser: Callable[[str, str], argparse.ArgumentParser],
) -> None:
    init = sub.add_parser(
        "init", help="write the agent template into a repository, its bindings filled in"
    )
    init.add_argument("--dir", default=".", help="the repository's root (default: here)")
    init.add_argument("--repo", default=None, help="repo id (default: the git remote's name)")
    init.add_argument("--region", required=True, help="this repository's agents' own region")
    init.add_argument(
        "--regions", default=None, metavar="REGION=HOST:PORT,...",
        help="every region's node (default: REGION=127.0.0.1:7400)",
    )  # fmt: skip
    init.add_argument("--force", action="store_true", help="overwrite files that differ")
    init.set_defaults(func=cmd_init)

    mirror = client_parser("mirror", "bring a repository's issues into the backlog")
    mirror.set_defaults(target=None, func=cmd_mirror)
    mirror.add_argument("--regions", default=None, metavar="REGION=HOST:PORT,...")
    mirror.add_argument("--repo", default=None)
    mirror.add_argument("--topic", default=None)
    mirror.add_argument("--region", default=None, help="home of items without a region: label")
    mirror.add_argument(
        "--from", dest="source", default="-", metavar="FILE",
        help="gh issue list --json ... output, or JSON lines (default: stdin)",
    )  # fmt: skip
    mirror.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    mirror.add_argument(
        "--push", action="store_true",
        help="the other way: comment on and close, label or reopen the issues of items"
        " whose state changed (through gh)",
    )  # fmt: skip
    mirror.add_argument("--no-close", action="store_true",
                        help="--push: comment on a done item's issue, leave it open")  # fmt: skip
    mirror.add_argument(
        "--comment-on", default=None, metavar="OUTCOME,...",
        help="--push: comment on these outcomes too (failed, deferred)",
    )  # fmt: skip
    mirror.add_argument(
        "--gh-repo", default="", metavar="OWNER/NAME",
        help="--push: the issues' repository (default: gh's choice, GH_REPO or the remote)",
    )  # fmt: skip


def cmd_init(args: argparse.Namespace) -> int:
    from fencemark.node.tools.adopt import cmd_init as init

    return init(args.dir, args.repo, args.region, args.regions, args.force)


def cmd_mirror(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from fencemark.node.tools import mirror
    from fencemark.node.tools.adopt import (
        BINDINGS,
        AdoptError,
        load_bindings,
        make_bindings,
        parse_regions,
    )

    try:
        if BINDINGS.is_file():
            bindings = load_bindings(BINDINGS)
        elif args.repo and (args.region or args.regions):
            regions = parse_regions(args.regions) if args.regions else None
            region = args.region or next(iter(regions or {}))
            bindings = make_bindings(args.repo, region, regions)
        else:
            raise AdoptError(
                f"no {BINDINGS} here: run `fencemark init`, or pass --repo and --region"
            )
        overrides: dict[str, object] = {}
        if args.repo:
            overrides["repo"] = args.repo
        if args.topic:
            overrides["topic"] = args.topic
        if args.regions:
            overrides["regions"] = parse_regions(args.regions)
        if args.region:
            overrides["region"] = args.region
        if args.target and not args.regions:
            # An explicit --target is the address of --region (the bindings' own
            # region without it) unless --regions says otherwise.
            region = overrides.get("region", bindings.region)
            overrides["regions"] = {**bindings.regions, str(region): args.target}
        bindings = replace(bindings, **overrides)  # type: ignore[arg-type]
        checked: Bindings = make_bindings(bindings.repo, bindings.region, bindings.regions)
        bindings = replace(bindings, regions=checked.regions)
        if args.push:
            bindings = replace(bindings, push=push_settings(args, bindings))
    except AdoptError as exc:
        print(f"fencemark mirror: {exc}", file=sys.stderr)
        return 2
    if args.push:
        from fencemark.node.tools import mirror_push

        credentials = client_credentials(args)
        return mirror_push.run(bindings, gh_repo=args.gh_repo, dry_run=args.dry_run,
                               timeout=args.timeout, credentials=credentials)  # fmt: skip
    return mirror.run(bindings, args.source, dry_run=args.dry_run, timeout=args.timeout,
                      credentials=client_credentials(args), target=args.target)  # fmt: skip


def push_settings(args: argparse.Namespace, bindings: Bindings) -> PushBindings:
    """``--push``'s settings: the bindings' ``[push]``, then the flags."""
    from fencemark.node.tools.adopt import COMMENT_OUTCOMES, AdoptError

    if args.source != "-":
        raise AdoptError("--push reads the backlog, not issues: --from does not go with it")
    outcomes = list(bindings.push.comment_on)
    if args.comment_on is not None:
        outcomes = [o.strip() for o in args.comment_on.split(",") if o.strip()]
        wrong = [o for o in outcomes if o not in COMMENT_OUTCOMES]
        if wrong:
            known = ", ".join(COMMENT_OUTCOMES)
            raise AdoptError(f"--comment-on: {wrong[0]!r} is not one of {known}")
    if args.gh_repo and not re.fullmatch(r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+", args.gh_repo):
        raise AdoptError(f"--gh-repo: {args.gh_repo!r} is not OWNER/NAME")
    return dataclasses.replace(
        bindings.push, close=bindings.push.close and not args.no_close, comment_on=tuple(outcomes)
    )


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
    demo.add_argument(
        "--members",
        type=int,
        choices=(1, 3, 5),
        default=1,
        help="run the first region as this many members electing their decider through"
        " etcd (needs etcd on this machine), and kill that decider mid-drain (default: 1,"
        " one node per region, no etcd)",
    )
    demo.set_defaults(func=cmd_demo)


def _add_bench_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from fencemark.bench.scenarios import INSTALL_EXTRA, SCENARIOS

    bench = sub.add_parser(
        "bench",
        help=f"benchmarks against etcd and Redis: {', '.join(SCENARIOS)}",
        description=textwrap.fill(
            "Run the benchmark scenarios (all by default) with their baselines, and write"
            " JSON, Markdown and PNG plots under --results. A full run of every scenario in"
            " the repository also rewrites the headline of docs/performance.md. Needs the"
            f" benchmark extra: {INSTALL_EXTRA}.",
            width=88,
        ),
        epilog="scenarios:\n"
        + "\n".join(f"  {name:<14}{what}" for name, what in SCENARIOS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument(
        "scenarios", nargs="*", metavar="SCENARIO", help="scenarios to run (below); all if none"
    )
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
    status.add_argument(
        "--json", action="store_true", help="each node's answer as JSON, for programs"
    )
    status.add_argument(
        "--decider",
        action="store_true",
        help="print only the member deciding for the targets' region of several members,"
        " as every answering member names it (REGION MEMBER per line for several regions);"
        " exit 1 while they name none or differ (an election under way)",
    )
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

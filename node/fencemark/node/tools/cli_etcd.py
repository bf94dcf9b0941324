"""``fencemark etcd restrict``: turn an etcd cluster's authentication on for Fencemark's
regions, once, as its ``root`` (fencemark.node.coordination.access); ``fencemark etcd
members``: show or change a region's configured member set
(fencemark.node.coordination.registry)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fencemark.node.rules import validation
from fencemark.node.rules.errors import InvalidInput

if TYPE_CHECKING:
    from fencemark.node.security.tls import TlsFiles

WAIT_S = 30.0  # an etcd just started: how long its first answer may take
MAX_WAIT_S = 3600.0


def cmd_etcd_restrict(args: argparse.Namespace) -> int:
    from fencemark.node.coordination.access import ROOT, restrict, user_of
    from fencemark.node.coordination.etcd import Etcd, EtcdError, parse_endpoints

    try:
        endpoints = parse_endpoints(args.etcd)
        regions = [validation.region(r.strip(), "--regions") for r in args.regions.split(",")]
        tls = _tls_files(args.tls_dir, ROOT, "fencemark certs etcd --root")
        _check_wait(args.wait)
    except (InvalidInput, ValueError) as exc:
        print(f"fencemark etcd: {exc}", file=sys.stderr)
        return 2

    async def run() -> None:
        etcd = Etcd(endpoints, tls)
        try:
            await etcd.answering(b"/fencemark/", args.wait)
            await restrict(etcd, regions)
        finally:
            await etcd.close()

    try:
        asyncio.run(run())
    except EtcdError as exc:
        print(f"fencemark etcd: {exc}", file=sys.stderr)
        return 1
    users = ", ".join(user_of(r) for r in regions)
    print(f"fencemark etcd: authentication on; each region's members ({users}) own its keys")
    return 0


def cmd_etcd_members(args: argparse.Namespace) -> int:
    from fencemark.node.coordination.etcd import Etcd, EtcdError, parse_endpoints
    from fencemark.node.coordination.registry import change_members, config_key, parse_config

    try:
        endpoints = parse_endpoints(args.etcd)
        region = validation.region(args.region, "--region")
        for flag, name in (("--add", args.add), ("--remove", args.remove)):
            if name:
                validation.region(name, flag)
        tls = _tls_files(args.tls_dir, region, f"fencemark certs issue --region {region}")
        _check_wait(args.wait)
    except (InvalidInput, ValueError) as exc:
        print(f"fencemark etcd: {exc}", file=sys.stderr)
        return 2

    async def run() -> tuple[str, ...]:
        etcd = Etcd(endpoints, tls)
        try:
            await etcd.answering(config_key(region), args.wait)
            if args.add or args.remove:
                return await change_members(etcd, region, add=args.add, remove=args.remove)
            entry = await etcd.get(config_key(region))
            return parse_config(entry.value) if entry is not None else ()
        finally:
            await etcd.close()

    try:
        names = asyncio.run(run())
    except EtcdError as exc:
        print(f"fencemark etcd: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"fencemark etcd: {exc}", file=sys.stderr)
        return 2
    print(f"region {region}: members {', '.join(names) if names else '(none configured)'}")
    return 0


def add_etcd_command(sub: Any) -> None:
    etcd = sub.add_parser(
        "etcd",
        help="set up the etcd cluster a region's members elect their decider through",
    )
    what = etcd.add_subparsers(dest="etcd_command", required=True, metavar="ACTION")
    restrict = what.add_parser(
        "restrict",
        help="turn etcd's authentication on: each region's certificates own its keys",
        description="As etcd's root (DIR/root.pem, fencemark certs etcd --root), give each"
        " region a role that may read and write /fencemark/regions/REGION/ only and a user"
        " region/REGION (the common name of that region's node certificates), then turn"
        " authentication on. Run once per etcd cluster, again to add regions.",
    )
    _reach_etcd(restrict, "holds ca.pem and root.pem")
    restrict.add_argument("--regions", required=True, help="comma-separated region names")
    restrict.set_defaults(func=cmd_etcd_restrict)
    members = what.add_parser(
        "members",
        help="show or change a region's configured member set",
        description="Show a region's configured member set (a majority is counted over"
        " it), or change it by one member: --add a running member that has caught up, or"
        " --remove one (docs/operations.md, *Adding or removing a member*). Each change"
        " applies only to the set it read. Speaks as the region (DIR/REGION.pem).",
    )
    _reach_etcd(members, "holds ca.pem and REGION.pem")
    members.add_argument("--region", required=True)
    change = members.add_mutually_exclusive_group()
    change.add_argument("--add", default="", metavar="MEMBER")
    change.add_argument("--remove", default="", metavar="MEMBER")
    members.set_defaults(func=cmd_etcd_members)


def _reach_etcd(parser: Any, holds: str) -> None:
    parser.add_argument("--etcd", required=True, help="HOST:PORT[,HOST:PORT...] (TLS)")
    parser.add_argument("--tls-dir", required=True, help=holds)
    parser.add_argument(
        "--wait",
        type=float,
        default=WAIT_S,
        metavar="SECONDS",
        help="how long to wait for etcd to answer (one just started elects its leader"
        f" first; default {WAIT_S:g})",
    )


def _check_wait(seconds: float) -> None:
    if not 0 <= seconds <= MAX_WAIT_S:
        raise ValueError(f"--wait: 0 to {MAX_WAIT_S:g} seconds, got {seconds:g}")


def _tls_files(tls_dir: str, name: str, makes_it: str) -> TlsFiles:
    """``name``'s TLS files in ``tls_dir``; ValueError naming the one missing."""
    from fencemark.node.security.tls import TlsFiles

    tls = TlsFiles.in_dir(Path(tls_dir), name)
    for path in (tls.ca, tls.cert, tls.key):
        if not path.is_file():
            raise ValueError(f"--tls-dir: no {path} ({makes_it})")
    return tls

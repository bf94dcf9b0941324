"""``fencemark etcd restrict``: turn an etcd cluster's authentication on for Fencemark's
regions, once, as its ``root`` (fencemark.node.coordination.access)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from fencemark.node.rules import validation
from fencemark.node.rules.errors import InvalidInput


def cmd_etcd_restrict(args: argparse.Namespace) -> int:
    from fencemark.node.coordination.access import ROOT, restrict, user_of
    from fencemark.node.coordination.etcd import Etcd, EtcdError, parse_endpoints
    from fencemark.node.security.tls import TlsFiles

    try:
        endpoints = parse_endpoints(args.etcd)
        regions = [validation.region(r.strip(), "--regions") for r in args.regions.split(",")]
        tls = TlsFiles.in_dir(Path(args.tls_dir), ROOT)
        for path in (tls.ca, tls.cert, tls.key):
            if not path.is_file():
                raise ValueError(f"--tls-dir: no {path} (fencemark certs etcd --root)")
    except (InvalidInput, ValueError) as exc:
        print(f"fencemark etcd: {exc}", file=sys.stderr)
        return 2

    async def run() -> None:
        etcd = Etcd(endpoints, tls)
        try:
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
    restrict.add_argument("--etcd", required=True, help="HOST:PORT[,HOST:PORT...] (TLS)")
    restrict.add_argument("--tls-dir", required=True, help="holds ca.pem and root.pem")
    restrict.add_argument("--regions", required=True, help="comma-separated region names")
    restrict.set_defaults(func=cmd_etcd_restrict)

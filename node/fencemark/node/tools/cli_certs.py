"""``fencemark certs`` (a cluster CA, node and client certificates, revocation) and
``fencemark restore`` (mark a data directory restored from a backup)."""

from __future__ import annotations

import argparse
import getpass
import sys
from pathlib import Path
from typing import Any

from fencemark.node.rules import validation
from fencemark.node.rules.errors import InvalidInput


def cmd_certs_init(args: argparse.Namespace) -> int:
    from fencemark.node.coordination.access import ROOT
    from fencemark.node.security.tls import init_dir, issue_named_into

    directory = Path(args.dir)
    try:
        if args.if_missing and (directory / "ca.pem").exists():
            print(f"fencemark certs: {directory} already holds a CA; nothing to do")
            return 0
        etcd = [validation.region(name, "--etcd") for name in _names(args.etcd)]
        taken = {*_names(args.regions), *_names(args.clients)} & {*etcd, ROOT}
        if taken:
            raise ValueError(f"--etcd: {sorted(taken)} would overwrite another certificate")
        written = init_dir(
            directory,
            regions=_names(args.regions),
            clients=_names(args.clients),
            hosts=_names(args.hosts),
        )
        for name, hosts in [*((name, [name]) for name in etcd), *([(ROOT, [])] if etcd else [])]:
            written += issue_named_into(directory, name, server_hosts=hosts)
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
    from fencemark.node.security.tls import Identity, issue_into, write_p12

    directory = Path(args.dir)
    try:
        if args.region:
            identity = Identity("region", validation.region(args.region, "--region"))
        else:
            identity = Identity("client", validation.region(args.client, "--client"))
        password = b""
        if args.p12:
            if identity.kind != "client":
                raise ValueError("--p12 is for client certificates (a browser's)")
            if (p12 := directory / f"{identity.name}.p12").exists():
                raise FileExistsError(f"{p12} exists: remove it first to make a new one")
            password = p12_password(args.password_file, f"{identity.name}.p12")
        files = issue_into(directory, identity, hosts=_names(args.hosts))
        print(f"fencemark certs: {identity.uri}: {files.cert}, {files.key}")
        if args.p12:
            print(f"fencemark certs: {write_p12(directory, identity.name, password)} {P12_SAYS}")
    except (InvalidInput, ValueError, OSError) as exc:
        print(f"fencemark certs: {exc}", file=sys.stderr)
        return 2
    return 0


P12_SAYS = (
    "holds the certificate, its key and the CA, for a browser (docs/deploy.md, The dashboard)"
)


def p12_password(source: str, what: str) -> bytes:
    """A PKCS#12 file's password: the first line of ``source`` (``-``: standard input),
    else asked twice on the terminal; ValueError when there is neither."""
    if source:
        text = sys.stdin.read() if source == "-" else Path(source).read_text()
        password = text.splitlines()[0] if text else ""
    elif sys.stdin.isatty():
        try:
            password = getpass.getpass(f"password for {what}: ")
            if getpass.getpass("the same again: ") != password:
                raise ValueError("the two passwords differ")
        except EOFError:
            raise ValueError("no password given") from None
    else:
        raise ValueError(
            "a password for the PKCS#12 file: --password-file FILE (- for standard input),"
            " or run on a terminal to be asked"
        )
    if not password:
        raise ValueError("a PKCS#12 file holds the private key: give it a password")
    return password.encode()


def cmd_certs_etcd(args: argparse.Namespace) -> int:
    """etcd's certificates from the CA in --dir: a server's, or its ``root`` client's."""
    from fencemark.node.coordination.access import ROOT
    from fencemark.node.security.tls import issue_named_into

    try:
        if args.root:
            name, hosts = ROOT, []
        else:
            name = validation.region(args.server, "--server")
            hosts = [name, *_names(args.hosts)]
        cert_path, key_path = issue_named_into(Path(args.dir), name, server_hosts=hosts)
    except (InvalidInput, ValueError, OSError) as exc:
        print(f"fencemark certs: {exc}", file=sys.stderr)
        return 2
    what = "etcd's root user" if args.root else f"the etcd server {name} ({', '.join(hosts)})"
    print(f"fencemark certs: {what}: {cert_path}, {key_path}")
    return 0


def cmd_certs_p12(args: argparse.Namespace) -> int:
    from fencemark.node.security.tls import write_p12

    try:
        name = validation.region(args.client, "--client")
        password = p12_password(args.password_file, f"{name}.p12")
        path = write_p12(Path(args.dir), name, password)
    except (InvalidInput, ValueError, OSError) as exc:
        print(f"fencemark certs: {exc}", file=sys.stderr)
        return 2
    print(f"fencemark certs: {path} {P12_SAYS}")
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


PASSWORD_HELP = (
    "the .p12 file's password: this file's first line (- for standard input);"
    " without it, asked twice on the terminal"
)


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
        "--etcd",
        default="",
        metavar="NAME,NAME...",
        help="also a region's etcd: a server certificate per NAME (its DNS name) and the"
        " certificate of etcd's root user (as `certs etcd --server NAME`, `--root`)",
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
    issue.add_argument(
        "--p12", action="store_true", help="also write DIR/CLIENT.p12, for a browser (see p12)"
    )
    issue.add_argument("--password-file", default="", metavar="FILE", help=PASSWORD_HELP)
    issue.set_defaults(func=cmd_certs_issue)
    etcd = what.add_parser(
        "etcd",
        help="a certificate for an etcd server, or for etcd's root user",
        description="Certificates of the CA in --dir that name no Fencemark identity: an etcd"
        " server's (--server NAME: DIR/NAME.pem, good for NAME and --hosts), or the client"
        " certificate of etcd's root user (--root: DIR/root.pem, common name root), with"
        " which `fencemark etcd restrict` turns etcd's authentication on. A node's own"
        " certificate (common name region/R) is its etcd user (docs/security.md).",
    )
    etcd.add_argument("--dir", required=True, help="the CA's directory (ca.pem, ca-key.pem)")
    whom = etcd.add_mutually_exclusive_group(required=True)
    whom.add_argument("--server", help="an etcd server's certificate, named so")
    whom.add_argument("--root", action="store_true", help="etcd's root user's certificate")
    etcd.add_argument("--hosts", default="", help="the server's other DNS names/IPs (comma-sep.)")
    etcd.set_defaults(func=cmd_certs_etcd)
    p12 = what.add_parser(
        "p12",
        help="a client's certificate, key and the CA as DIR/CLIENT.p12, for a browser",
        description="Bundle DIR/CLIENT.pem, DIR/CLIENT-key.pem and DIR/ca.pem into"
        " DIR/CLIENT.p12 (PKCS#12, PBES2 with AES-256, readable by its owner only), which"
        " a browser imports as its client certificate for the node's dashboard"
        " (docs/deploy.md, The dashboard).",
    )
    p12.add_argument("--dir", required=True, help="the CA's directory, holding CLIENT.pem")
    p12.add_argument("--client", required=True, help="the client certificate's name")
    p12.add_argument("--password-file", default="", metavar="FILE", help=PASSWORD_HELP)
    p12.set_defaults(func=cmd_certs_p12)
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

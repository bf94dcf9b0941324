"""The ``fencemark`` subcommands that mirror the gRPC API one to one (etcdctl style).

Each takes the RPC's field names as flags and prints the result as JSON. Their exit
codes are one rule (docs/api.md, *Exit codes*): 0 done; 1 the node refused the call
with an error, said on stderr as ``fencemark: CODE[ reason]: message``; 2 bad usage;
3 the call answered no as a value (``granted: false``...), its JSON still on stdout;
4 the node could not be reached in time.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import socket
import ssl
import sys
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, NoReturn

import grpc

if TYPE_CHECKING:
    from fencemark.client import FencemarkError

EXIT_DONE = 0
EXIT_REFUSED = 1  # the node refused the call with an error: stderr says why
EXIT_USAGE = 2  # argparse's own
EXIT_ANSWERED_NO = 3  # the call answered no as a value: its JSON is on stdout
EXIT_UNREACHABLE = 4  # the node could not be reached in time (UNAVAILABLE, DEADLINE_EXCEEDED)

# The fields by which a result says no as a value (granted: false, reason empty...).
_ANSWERS = ("granted", "renewed", "released", "reopened")
TLS_ADVICE = "pass --tls-dir/--tls-name or set FENCEMARK_TLS_DIR/FENCEMARK_TLS_NAME"


def usage_error(message: str) -> NoReturn:
    """Bad usage the parser could not see (a flag's value, a file it names): said on
    stderr, exit 2 like argparse's own."""
    print(message, file=sys.stderr)
    raise SystemExit(EXIT_USAGE)


def _json_default(value: object) -> object:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.hex()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    raise TypeError(f"cannot show {type(value).__name__}")


def print_json(value: object) -> None:
    """``value`` as indented JSON: dataclasses as objects, times as ISO 8601."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    print(json.dumps(value, default=_json_default, indent=2, ensure_ascii=False))


# -- node -------------------------------------------------------------------------


def client_credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    """Mutual TLS credentials from ``--tls-dir``/``--tls-name``; None (plaintext) without."""
    from fencemark.client import tls_credentials

    if not args.tls_dir:
        return None
    if not args.tls_name:
        usage_error(
            "fencemark: --tls-dir needs --tls-name NAME (env FENCEMARK_TLS_NAME): the"
            " certificate NAME.pem and key NAME-key.pem in the directory"
        )
    try:
        return tls_credentials(args.tls_dir, args.tls_name)
    except OSError as exc:
        usage_error(f"fencemark: {exc}")


def answered_no(result: object) -> bool:
    """Whether ``result`` is a refusal the API answers as a value: ``granted``,
    ``renewed``, ``released`` or ``reopened`` false (its ``reason`` says why)."""
    return any(getattr(result, name, True) is False for name in _ANSWERS)


def failure_line(exc: FencemarkError, *, target: str, tls: bool) -> str:
    """A failed call in one line: ``CODE[ reason[ (identity)]]: message[; hint]``.

    ``reason`` is the node's machine-readable word when it gave one (a refused fenced
    write's conflict, a PERMISSION_DENIED's denial). A node that could not be reached
    is looked at once more (:func:`transport_at`) for the hint: nothing listening,
    or a transport other than the call's (``tls``)."""
    from fencemark.client import ClaimConflict, PermissionDenied, Unavailable

    head = exc.code.name
    if isinstance(exc, ClaimConflict | PermissionDenied) and exc.reason:
        head += f" {exc.reason}"
    if isinstance(exc, PermissionDenied) and exc.identity:
        head += f" ({exc.identity})"
    line = f"{head}: {exc.message}" if exc.message else head
    if not isinstance(exc, Unavailable):
        return line
    found = transport_at(target)
    if found == "nothing":
        return f"{line}; nothing listens at {target}: is the node running, and --target right?"
    if found == "tls" and not tls:
        return f"{line}; the node serves TLS: {TLS_ADVICE}"
    if found == "plaintext" and tls:
        return f"{line}; the node is plaintext (--insecure): call it without --tls-dir"
    if found == "unknown" and not tls:
        return f"{line}; is the node serving TLS? {TLS_ADVICE}"
    return line


def transport_at(target: str, timeout: float = 1.0) -> str:
    """What listens at ``target`` (HOST:PORT): ``tls`` (it completes a TLS handshake),
    ``plaintext`` (it answers, not in TLS), ``nothing`` (no connection), or
    ``unknown`` (no target, another form of one, or no clear answer in ``timeout``)."""
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return "unknown"
    host = host.strip("[]")
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout)
    except ConnectionRefusedError:
        return "nothing"
    except OSError:
        return "unknown"
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False  # only whether it speaks TLS: no certificate checked
    context.verify_mode = ssl.CERT_NONE
    try:
        with context.wrap_socket(sock, server_hostname=host):
            return "tls"
    except ssl.SSLError as exc:  # an alert is TLS too: it wanted a client certificate
        if exc.reason == "WRONG_VERSION_NUMBER":
            return "plaintext"
        return "tls" if "ALERT" in str(exc.reason) else "unknown"
    except OSError:
        return "unknown"
    finally:
        sock.close()


def failed(exc: FencemarkError, *, target: str, tls: bool, prefix: str = "fencemark") -> int:
    """Say on stderr why a call failed; its exit code (4 unreachable, else 1)."""
    from fencemark.client import Unavailable

    print(f"{prefix}: {failure_line(exc, target=target, tls=tls)}", file=sys.stderr)
    return EXIT_UNREACHABLE if isinstance(exc, Unavailable) else EXIT_REFUSED


def _client_call(args: argparse.Namespace, call: Callable[[Any], Awaitable[object]]) -> int:
    from fencemark.client import AsyncClient, FencemarkError

    credentials = client_credentials(args)

    async def run() -> object:
        async with AsyncClient(
            args.target, timeout=args.timeout, credentials=credentials
        ) as client:
            return await call(client)

    try:
        result = asyncio.run(run())
    except FencemarkError as exc:
        return failed(exc, target=args.target, tls=credentials is not None)
    if result is None:  # the call printed its own output (watch)
        return EXIT_DONE
    print_json(result)
    return EXIT_ANSWERED_NO if answered_no(result) else EXIT_DONE


def _fields(pairs: Sequence[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            usage_error(f"fencemark: --field takes NAME=VALUE, got {pair!r}")
        out[name] = value
    return out


def add_rpc_commands(client_parser: Callable[[str, str], argparse.ArgumentParser]) -> None:
    """One subcommand per RPC, with the RPC's field names as flags."""
    _add_remember(client_parser)
    _add_get(client_parser)
    _add_update(client_parser)
    _add_delete(client_parser)
    _add_list(client_parser)
    _add_claim(client_parser)
    _add_renew_claim(client_parser)
    _add_release_claim(client_parser)
    _add_claim_status(client_parser)
    _add_claim_next(client_parser)
    _add_reopen(client_parser)
    _add_force_release(client_parser)
    _add_history(client_parser)
    _add_watch(client_parser)
    _add_info(client_parser)


def _add_remember(client_parser: Callable[[str, str], argparse.ArgumentParser]) -> None:
    p = client_parser("remember", "Records.Remember: create or merge a record")
    for name in ("repo", "topic", "id"):
        p.add_argument(f"--{name}", required=True)
    for name in ("kind", "author", "title", "body"):
        p.add_argument(f"--{name}", default="")
    p.add_argument("--tag", action="append", default=[], dest="tags")
    p.add_argument("--field", action="append", default=[], dest="fields", metavar="NAME=VALUE")
    p.add_argument("--fencing-token", type=int, default=0)
    p.set_defaults(
        func=lambda a: _client_call(
            a,
            lambda c: c.remember(
                a.repo, a.topic, a.id, kind=a.kind, author=a.author, title=a.title,
                body=a.body, tags=a.tags, fields=_fields(a.fields),
                fencing_token=a.fencing_token,
            ),
        )
    )  # fmt: skip


def _add_get(client_parser: Callable[[str, str], argparse.ArgumentParser]) -> None:
    p = client_parser("get", "Records.Get: one record")
    p.add_argument("key")
    p.set_defaults(func=lambda a: _client_call(a, lambda c: c.get(a.key)))


def _add_update(client_parser: Callable[[str, str], argparse.ArgumentParser]) -> None:
    p = client_parser("update", "Records.Update: write fields and tags")
    p.add_argument("key")
    p.add_argument("--field", action="append", default=[], dest="fields", metavar="NAME=VALUE")
    p.add_argument("--add-tag", action="append", default=[], dest="add_tags")
    p.add_argument("--remove-tag", action="append", default=[], dest="remove_tags")
    p.add_argument("--fencing-token", type=int, default=0)
    p.set_defaults(
        func=lambda a: _client_call(
            a,
            lambda c: c.update(
                a.key, fields=_fields(a.fields), add_tags=a.add_tags,
                remove_tags=a.remove_tags, fencing_token=a.fencing_token,
            ),
        )
    )  # fmt: skip


def _add_delete(client_parser: Callable[[str, str], argparse.ArgumentParser]) -> None:
    p = client_parser("delete", "Records.Delete: write a tombstone")
    p.add_argument("key")
    p.add_argument("--fencing-token", type=int, default=0)
    p.set_defaults(
        func=lambda a: _client_call(a, lambda c: c.delete(a.key, fencing_token=a.fencing_token))
    )


def _add_list(client_parser: Callable[[str, str], argparse.ArgumentParser]) -> None:
    p = client_parser("list", "Records.List: a page of records")
    p.add_argument("--repo", required=True)
    p.add_argument("--topic", default="")
    p.add_argument("--tag", default="")
    p.add_argument("--page-size", type=int, default=0)
    p.add_argument("--page-token", default="")
    p.add_argument("--include-deleted", action="store_true")
    p.set_defaults(
        func=lambda a: _client_call(
            a,
            lambda c: c.list(
                a.repo, topic=a.topic, tag=a.tag, page_size=a.page_size,
                page_token=a.page_token, include_deleted=a.include_deleted,
            ),
        )
    )  # fmt: skip


def _add_claim(client_parser: Callable[[str, str], argparse.ArgumentParser]) -> None:
    p = client_parser("claim", "Claims.Claim: ask for a record's lease")
    p.add_argument("key")
    p.add_argument("--owner", required=True)
    p.add_argument("--lease-seconds", type=float, default=0.0)
    p.add_argument("--wait-seconds", type=float, default=0.0)
    p.set_defaults(
        func=lambda a: _client_call(
            a,
            lambda c: c.claim(
                a.key, a.owner, lease_seconds=a.lease_seconds, wait_seconds=a.wait_seconds
            ),
        )
    )


def _add_renew_claim(client_parser: Callable[[str, str], argparse.ArgumentParser]) -> None:
    p = client_parser("renew-claim", "Claims.RenewClaim: extend a live claim")
    p.add_argument("key")
    p.add_argument("--fencing-token", type=int, required=True)
    p.add_argument("--lease-seconds", type=float, default=0.0)
    p.set_defaults(
        func=lambda a: _client_call(
            a,
            lambda c: c.renew_claim(a.key, a.fencing_token, lease_seconds=a.lease_seconds),
        )
    )


def _add_release_claim(client_parser: Callable[[str, str], argparse.ArgumentParser]) -> None:
    p = client_parser("release-claim", "Claims.ReleaseClaim: end a claim, with its outcome")
    p.add_argument("key")
    p.add_argument("--fencing-token", type=int, required=True)
    p.add_argument(
        "--outcome", default="", choices=["", "done", "failed", "deferred"],
        help="how the work ended (default: a plain release)",
    )  # fmt: skip
    p.add_argument("--field", action="append", default=[], dest="fields", metavar="NAME=VALUE")
    p.add_argument("--retry-after-seconds", type=float, default=0.0)
    p.set_defaults(
        func=lambda a: _client_call(
            a,
            lambda c: c.release_claim(
                a.key, a.fencing_token, outcome=a.outcome, fields=_fields(a.fields),
                retry_after_seconds=a.retry_after_seconds,
            ),
        )
    )  # fmt: skip


def _add_claim_next(client_parser: Callable[[str, str], argparse.ArgumentParser]) -> None:
    p = client_parser("claim-next", "Claims.ClaimNext: claim the next eligible item of a topic")
    p.add_argument("--repo", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--owner", required=True)
    p.add_argument("--lease-seconds", type=float, default=0.0)
    p.add_argument("--wait-seconds", type=float, default=0.0)
    p.add_argument("--tag", action="append", default=[], dest="tags")
    p.set_defaults(
        func=lambda a: _client_call(
            a,
            lambda c: c.claim_next(
                a.repo, a.topic, a.owner, lease_seconds=a.lease_seconds,
                wait_seconds=a.wait_seconds, tags=a.tags,
            ),
        )
    )  # fmt: skip


def _add_reopen(client_parser: Callable[[str, str], argparse.ArgumentParser]) -> None:
    p = client_parser("reopen", "Claims.Reopen: open a parked or done item again")
    p.add_argument("key")
    p.add_argument("--reason", required=True)
    p.set_defaults(func=lambda a: _client_call(a, lambda c: c.reopen(a.key, a.reason)))


def _add_force_release(client_parser: Callable[[str, str], argparse.ArgumentParser]) -> None:
    p = client_parser("force-release", "Claims.ForceRelease: take a live claim back")
    p.add_argument("key")
    p.add_argument("--reason", required=True)
    p.set_defaults(func=lambda a: _client_call(a, lambda c: c.force_release(a.key, a.reason)))


def _add_history(client_parser: Callable[[str, str], argparse.ArgumentParser]) -> None:
    p = client_parser("history", "Records.History: a record's recent claim events")
    p.add_argument("key")
    p.set_defaults(func=lambda a: _client_call(a, lambda c: c.history(a.key)))


def _add_watch(client_parser: Callable[[str, str], argparse.ArgumentParser]) -> None:
    p = client_parser(
        "watch", "Records.Watch: follow the changes, one JSON line per event, resuming by itself"
    )
    p.add_argument("--repo", required=True)
    p.add_argument("--topic", default="")
    p.add_argument("--tag", action="append", default=[], help="only records with it (repeat)")
    p.add_argument("--cursor", default="", help="resume right after this event (default: now)")
    p.add_argument("--count", type=int, default=0, help="stop after this many events (0: never)")

    async def watch(client: Any, a: argparse.Namespace) -> None:
        taken = 0
        async for event in client.watch(a.repo, topic=a.topic, tags=a.tag, cursor=a.cursor):
            line = dataclasses.asdict(event)
            print(json.dumps(line, default=_json_default, ensure_ascii=False), flush=True)
            taken += 1
            if taken == a.count:
                return

    p.set_defaults(func=lambda a: _client_call(a, lambda c: watch(c, a)))


def _add_claim_status(client_parser: Callable[[str, str], argparse.ArgumentParser]) -> None:
    p = client_parser("claim-status", "Claims.ClaimStatus: what the node knows of a claim")
    p.add_argument("key")
    p.set_defaults(func=lambda a: _client_call(a, lambda c: c.claim_status(a.key)))


def _add_info(client_parser: Callable[[str, str], argparse.ArgumentParser]) -> None:
    p = client_parser("info", "Node.Info: the node's identity and state")
    p.set_defaults(func=lambda a: _client_call(a, lambda c: c.info()))

"""Authorization: which identity may call which method.

Only on a node that serves TLS (``--tls-dir``): there every caller has
presented a certificate of the cluster CA, and :func:`fencemark.node.security.tls.peer_identity`
says who it is. Each ``fencemark.v1`` method needs one :class:`Right`
(:data:`METHOD_RIGHTS`, the one table); an identity holds a set of rights:

- a node (``fencemark://region/R``) holds ``read`` and ``replicate``, always;
  whether its region is a configured peer, and the one its requests claim to
  come from, is checked by the Replication servicer itself;
- a client (``fencemark://client/NAME``) holds what the access map
  (``--access FILE``) gives NAME, or the map's ``"*"`` entry; without a map,
  every client of the CA holds ``read``, ``write`` and ``claim``.

One right belongs to no method: ``act-for-others`` lets an identity use the
tokens of claims granted to other identities (renew, release, write with them,
retry their claims, see them in ``ClaimStatus``). The claim rules ask for it
(:func:`caller_of`, ``admission.acts_for``); the method still needs its own right.

A denial is ``PERMISSION_DENIED`` with an ``ErrorInfo`` (reason
``PERMISSION_DENIED``, metadata ``denial``, ``identity``, ``right``), decided
before the servicer runs, so nothing is read or written for it. Health checking
and reflection pass the same check (:data:`OTHER_METHOD_RIGHTS`): a health
``Check`` needs no right (a load balancer's probe), but no revoked certificate;
the streams — health ``Watch``, reflection — need ``read``. docs/security.md has
the model.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

import grpc

from fencemark.node.api.interceptor import Behaviour, Handler, Interceptor, Shape, awaited
from fencemark.node.api.service import refuse
from fencemark.node.rules.admission import Caller
from fencemark.node.rules.errors import ACT_FOR_OTHERS as ACTING_FOR_OTHERS
from fencemark.node.rules.errors import Denial, PermissionDenied
from fencemark.node.security.revocation import Revocations
from fencemark.node.security.tls import Identity, check_name, peer_identity

__all__ = [
    "DEFAULT_ACCESS",
    "METHOD_RIGHTS",
    "REGION_RIGHTS",
    "AccessMap",
    "Authorize",
    "Right",
    "caller_of",
    "load_access",
]

PACKAGE = "/fencemark.v1."


class Right(StrEnum):
    READ = "read"
    WRITE = "write"
    CLAIM = "claim"
    REPLICATE = "replicate"
    # Take claims back and reopen parked items (Claims.ForceRelease, Reopen).
    OPERATE = "operate"
    # Use claims granted to other identities (docs/security.md, *Claims are bound to
    # identities*). Needed by no method: the claim rules ask for it.
    ACT_FOR_OTHERS = ACTING_FOR_OTHERS


# Every fencemark.v1 method and the right it needs. A method missing here is
# refused to everyone (tests/test_authz.py checks the table covers the protos).
METHOD_RIGHTS: Mapping[str, Right] = {
    "/fencemark.v1.Records/Get": Right.READ,
    "/fencemark.v1.Records/List": Right.READ,
    "/fencemark.v1.Records/Remember": Right.WRITE,
    "/fencemark.v1.Records/Update": Right.WRITE,
    "/fencemark.v1.Records/Delete": Right.WRITE,
    "/fencemark.v1.Records/History": Right.READ,
    "/fencemark.v1.Records/Watch": Right.READ,
    "/fencemark.v1.Claims/ClaimStatus": Right.READ,
    "/fencemark.v1.Claims/Claim": Right.CLAIM,
    "/fencemark.v1.Claims/RenewClaim": Right.CLAIM,
    "/fencemark.v1.Claims/ReleaseClaim": Right.CLAIM,
    "/fencemark.v1.Claims/ClaimNext": Right.CLAIM,
    "/fencemark.v1.Claims/Reopen": Right.OPERATE,
    "/fencemark.v1.Claims/ForceRelease": Right.OPERATE,
    "/fencemark.v1.Node/Info": Right.READ,
    "/fencemark.v1.Replication/Tree": Right.REPLICATE,
    "/fencemark.v1.Replication/Buckets": Right.REPLICATE,
    "/fencemark.v1.Replication/Fetch": Right.REPLICATE,
    "/fencemark.v1.Replication/Push": Right.REPLICATE,
    "/fencemark.v1.Replication/Certificates": Right.REPLICATE,
}
# The standard services beside fencemark.v1, the same way: a health Check is
# answered to any caller of the CA that is not revoked (None: no right needed); the
# streams a caller can hold open need `read`.
OTHER_METHOD_RIGHTS: Mapping[str, Right | None] = {
    "/grpc.health.v1.Health/Check": None,
    "/grpc.health.v1.Health/Watch": Right.READ,
    "/grpc.health.v1.Health/List": Right.READ,
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo": Right.READ,
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": Right.READ,
}
# A node holds every record anyway; `read` lets its certificate serve probes and status.
REGION_RIGHTS = frozenset({Right.READ, Right.REPLICATE})
CLIENT_RIGHTS = frozenset({Right.READ, Right.WRITE, Right.CLAIM})
ANY_CLIENT = "*"


@dataclass(frozen=True)
class AccessMap:
    """Client name -> rights; ``default`` for clients the map does not name."""

    clients: Mapping[str, frozenset[Right]] = field(default_factory=dict)
    default: frozenset[Right] = CLIENT_RIGHTS

    def rights(self, identity: Identity) -> frozenset[Right]:
        if identity.kind == "region":
            return REGION_RIGHTS
        return self.clients.get(identity.name, self.default)

    def check(self, identity: Identity | None, method: str) -> PermissionDenied | None:
        """Why ``identity`` may not call ``method`` (a full gRPC method name); None if it may."""
        if method in OTHER_METHOD_RIGHTS and OTHER_METHOD_RIGHTS[method] is None:
            return None  # a health Check: any caller of the CA (a load balancer's probe)
        if identity is None:
            return PermissionDenied(
                Denial.NO_IDENTITY,
                "the client certificate names no fencemark:// identity"
                " (make one with `fencemark certs issue`)",
            )
        right = METHOD_RIGHTS.get(method) or OTHER_METHOD_RIGHTS.get(method)
        if right is None or right not in self.rights(identity):
            wanted = right.value if right is not None else "?"
            return PermissionDenied(
                Denial.MISSING_RIGHT,
                f"{identity} may not call {method.rsplit('/', 1)[-1]}: it needs the"
                f" {wanted!r} right (docs/security.md, the access map)",
                identity=str(identity),
                right=wanted,
            )
        return None

    def caller(self, identity: Identity | None) -> Caller:
        """Who ``identity`` is to the claim rules: its name and whether it acts for others."""
        if identity is None:  # Authorize refuses such a call before any servicer runs
            raise PermissionDenied(Denial.NO_IDENTITY, "the caller's certificate names no identity")
        return Caller(str(identity), Right.ACT_FOR_OTHERS in self.rights(identity))


DEFAULT_ACCESS = AccessMap()


# The authorization of the call under way, asked again by a long-lived call before
# each hand-over (Caller.still_allowed); set by Authorize for each fencemark.v1 call.
_CALL_CHECK: ContextVar[Callable[[], None] | None] = ContextVar("call_check", default=None)


def caller_of(access: AccessMap) -> Callable[[grpc.aio.ServicerContext[Any, Any]], Caller]:
    """The servicers' view of a call's caller on a node serving TLS."""

    def of(context: grpc.aio.ServicerContext[Any, Any]) -> Caller:
        caller = access.caller(peer_identity(context))
        check = _CALL_CHECK.get()
        return caller if check is None else replace(caller, still_allowed=check)

    return of


def parse_access(data: Mapping[str, Any], source: str = "access map") -> AccessMap:
    """``{"clients": {NAME: [RIGHT, ...], "*": [...]}}`` -> an AccessMap (ValueError if bad)."""
    unknown = set(data) - {"clients"}
    if unknown:
        raise ValueError(f"{source}: unknown keys {sorted(unknown)}; expected only 'clients'")
    table = data.get("clients", {})
    if not isinstance(table, Mapping):
        raise ValueError(f"{source}: 'clients' must be a table of NAME = [rights]")
    clients: dict[str, frozenset[Right]] = {}
    default = frozenset[Right]()  # with a map, a client it does not name gets nothing
    for name, values in table.items():
        if name != ANY_CLIENT:
            check_name(name, f"{source}: client")
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise ValueError(f"{source}: clients.{name} must be a list of rights")
        try:
            rights = frozenset(Right(v) for v in values)
        except ValueError:
            raise ValueError(
                f"{source}: clients.{name}: rights are {[r.value for r in Right]}, got {values}"
            ) from None
        if Right.REPLICATE in rights:
            raise ValueError(
                f"{source}: clients.{name}: 'replicate' belongs to node certificates only"
            )
        if name == ANY_CLIENT:
            default = rights
        else:
            clients[name] = rights
    return AccessMap(clients, default)


def load_access(path: Path | str) -> AccessMap:
    """An access map file: TOML, or JSON when it ends in ``.json``."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        data = json.loads(raw) if path.suffix == ".json" else tomllib.loads(raw.decode())
    except (OSError, ValueError) as exc:  # JSON and TOML decode errors are ValueErrors
        raise ValueError(f"cannot read the access map {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a table with 'clients'")
    return parse_access(data, str(path))


# Generic in grpc-stubs only: not subscriptable at runtime.
class Authorize(Interceptor):
    """Refuse every fencemark.v1 call whose caller lacks the method's right.

    Installed after ``Telemetry`` so a denial is counted and logged like any
    refusal (``fencemark_refusals_total{reason="missing_right"}``). A caller
    whose certificate is revoked is refused first (``revoked_certificate``),
    for every fencemark.v1 method, Replication included.
    """

    def __init__(self, access: AccessMap, revocations: Revocations | None = None) -> None:
        self.access = access
        # The CRL (fencemark.node.security.revocation), reloaded in place when crl.pem changes.
        self.revocations = revocations or Revocations()

    def wrap(self, method: str, behaviour: Behaviour, shape: Shape) -> Behaviour | None:
        if not method.startswith(PACKAGE) and method not in OTHER_METHOD_RIGHTS:
            raise RuntimeError(f"{method}: no right is named for it (OTHER_METHOD_RIGHTS)")
        access, revocations = self.access, self.revocations

        def denial(context: grpc.aio.ServicerContext[Any, Any]) -> PermissionDenied | None:
            # A revoked certificate first: clients and peers alike, whatever its rights.
            return revocations.check(context) or access.check(peer_identity(context), method)

        if not awaited(shape, behaviour):  # reflection: a stream of requests and answers

            async def streaming(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                denied = denial(context)
                if denied is not None:
                    await refuse(context, denied)
                async for response in behaviour(request, context):
                    yield response

            return streaming
        inner: Handler = behaviour

        async def authorized(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            def still_allowed() -> None:
                denied = denial(context)
                if denied is not None:
                    raise denied

            denied = denial(context)
            if denied is not None:
                await refuse(context, denied)
            checking = _CALL_CHECK.set(still_allowed)
            try:
                return await inner(request, context)
            finally:
                _CALL_CHECK.reset(checking)

        return authorized

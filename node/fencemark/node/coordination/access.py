"""Who may write what in etcd: each region's members its own keys, and nobody else.

etcd serves mutual TLS with ``--client-cert-auth`` and takes a client certificate's
common name as its user. A node's certificate (``fencemark certs``) has the common
name ``region/R``, a client's ``client/NAME``, so no client is ever the user of a
region. ``restrict`` turns etcd's authentication on as an operator does once per etcd
cluster: the caller becomes etcd's ``root`` (its certificate's common name must be
``root``: ``fencemark certs etcd-root``), each region gets a role that may read and
write ``/fencemark/regions/R/`` only, and a user ``region/R`` with that role. After it,
a certificate of another region, a client's, or one etcd does not know is refused
``PERMISSION_DENIED`` on any key of a region's.
"""

from __future__ import annotations

from collections.abc import Awaitable, Iterable
from typing import Any

from aetcd import rpc

from fencemark.node.coordination.decider import KEY_PREFIX
from fencemark.node.coordination.etcd import Etcd, EtcdError
from fencemark.node.security.tls import Identity

ROOT = "root"


def user_of(region: str) -> str:
    """The etcd user a member of ``region`` is: its certificate's common name."""
    return str(Identity("region", region))


def prefix_of(region: str) -> bytes:
    return KEY_PREFIX + region.encode() + b"/"


async def restrict(etcd: Etcd, regions: Iterable[str]) -> None:
    """Give each of ``regions`` its role and user, and turn authentication on (the
    caller must be ``root``); idempotent: what exists already is kept."""
    auth = rpc.AuthStub
    await _exists(etcd.call(auth, "UserAdd", _user(ROOT)))
    await _exists(
        etcd.call(auth, "UserGrantRole", rpc.AuthUserGrantRoleRequest(user=ROOT, role=ROOT))
    )
    for region in regions:
        role = f"fencemark-region-{region}"
        await _exists(etcd.call(auth, "RoleAdd", rpc.AuthRoleAddRequest(name=role)))
        prefix = prefix_of(region)
        permission = rpc.Permission(
            permType=rpc.Permission.READWRITE, key=prefix, range_end=prefix[:-1] + b"0"
        )
        await etcd.call(
            auth, "RoleGrantPermission",
            rpc.AuthRoleGrantPermissionRequest(name=role, perm=permission),
        )  # fmt: skip
        await _exists(etcd.call(auth, "UserAdd", _user(user_of(region))))
        await etcd.call(
            auth, "UserGrantRole", rpc.AuthUserGrantRoleRequest(user=user_of(region), role=role)
        )
    await etcd.call(auth, "AuthEnable", rpc.AuthEnableRequest())


def _user(name: str) -> Any:
    return rpc.AuthUserAddRequest(name=name, options=rpc.UserAddOptions(no_password=True))


async def _exists(call: Awaitable[Any]) -> None:
    """Await ``call``; an "already exists" refusal is success (a second run)."""
    try:
        await call
    except EtcdError as exc:
        if "already exists" not in str(exc):
            raise

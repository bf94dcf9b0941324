"""A region's members as etcd knows them (SPEC §10): each live member registers its
addresses under a lease of its own, and every member reads the others' from there,
with the region's configured member set, over which a majority is counted.

A member's entry is ``/fencemark/regions/R/members/NAME``, holding where its clients
reach it and where its fellow members replicate with it, written under a lease the
member keeps alive. A member that stops, or dies, or is cut off from etcd, drops
out once its lease expires; one that comes back registers anew. Every member reads
the region's entries once per renewal: a bounded read of a handful of keys, so no
watch to resume after etcd restarts or compacts.

The configured set is ``/fencemark/regions/R/config``, ``{"members": [NAME, ...]}``:
created by the first member to start, from its ``initial`` set (etcd's own
``--initial-cluster``, taken only when the region has none), and changed one member
at a time by ``fencemark members`` (``change_members``), each change a transaction
on the revision it read. A registered member outside the set is a *learner*: it
replicates with the others and catches up, but its acknowledgement counts for no
majority until it is added.

A member's name, once it has served, is known for good:
``/fencemark/regions/R/known/NAME``, created (with no lease) before its first entry.
Its first process, on whatever file, acknowledged nothing before: a new file
there lacks nothing it acknowledged (``first_life``). A later process on a new,
emptied or restored file may: it owes a catch-up with a majority of the others
before it counts as holding what it acknowledged (docs/consistency.md).

Only a region's members can write under its prefix (``coordination.access``), so an
entry names a process that holds a certificate of the region. What an entry says
is only where to replicate: the replication calls themselves are checked against
the certificate the address presents (``replication.peer_check``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from fencemark.node.coordination.decider import KEY_PREFIX, RENEW_SHARE
from fencemark.node.coordination.etcd import Etcd, EtcdError

log = logging.getLogger(__name__)


def members_prefix(region: str) -> bytes:
    return KEY_PREFIX + region.encode() + b"/members/"


def config_key(region: str) -> bytes:
    return KEY_PREFIX + region.encode() + b"/config"


def known_key(region: str, name: str) -> bytes:
    return KEY_PREFIX + region.encode() + b"/known/" + name.encode()


def parse_config(value: bytes) -> tuple[str, ...]:
    """The member names a config entry lists (ValueError if it is not one)."""
    said = json.loads(value)
    names = said["members"] if isinstance(said, dict) else None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError('a config entry is {"members": [NAME, ...]}')
    return tuple(sorted(set(names)))


def config_value(names: Iterable[str]) -> bytes:
    return json.dumps({"members": sorted(set(names))}).encode()


@dataclass(frozen=True)
class Registered:
    """A member as its entry says: its name, and where clients and peers reach it."""

    name: str
    address: str
    peer_address: str


class Registry:
    """This member's entry, kept alive, and the region's members as last read.

    ``on_change`` is awaited with the other members (name -> ``Registered``) each
    time that set changes; while etcd cannot be read it keeps the last set (the
    members replicate with each other whether or not etcd answers)."""

    def __init__(
        self,
        etcd: Etcd,
        region: str,
        me: Registered,
        *,
        ttl_s: int,
        on_change: Callable[[Mapping[str, Registered]], Awaitable[None]],
        initial: Sequence[str] = (),
    ) -> None:
        self.etcd = etcd
        self.region = region
        self.me = me
        self.ttl_s = ttl_s
        self.on_change = on_change
        self.initial = tuple(initial)
        self.members: dict[str, Registered] = {}  # the others, as last read
        # The configured member set, as last read (empty: none read yet, or none made).
        self.configured: tuple[str, ...] = ()
        self._lease = 0
        self._task: asyncio.Task[None] | None = None
        # Set once this member's entry is its own: a second process started with the
        # same name waits, and does not campaign, while the first one's entry lives.
        self.registered = asyncio.Event()
        self.taken_by = ""  # the address of the other process holding this name
        # Whether this process is the first ever to serve under this name (None until
        # etcd said, before the first entry): it acknowledged nothing before.
        self.first_life: bool | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"registry {self.region}")

    async def stop(self) -> None:
        """Stop, and take this member's entry out at once (its lease revoked)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._lease:
            with contextlib.suppress(EtcdError):
                await self.etcd.revoke(self._lease)
            self._lease = 0

    async def _run(self) -> None:
        while True:
            try:
                await self._register()
                await self._read()
            except EtcdError as exc:
                log.warning("region %s: the members' registry: %s", self.region, exc)
            await asyncio.sleep(self.ttl_s * RENEW_SHARE)

    async def _register(self) -> None:
        """Renew this member's lease; register anew when it is gone (and make the
        region's configured set from ``initial`` if it has none)."""
        if self._lease and await self.etcd.keep_alive(self._lease) > 0:
            return
        if self.initial:
            await self.etcd.create(config_key(self.region), config_value(self.initial), 0)
        if self.first_life is None:
            known = await self.etcd.create(known_key(self.region, self.me.name), b"", 0)
            self.first_life = known.created
        if self._lease:
            with contextlib.suppress(EtcdError):
                await self.etcd.revoke(self._lease)
        self._lease, _ = await self.etcd.grant(self.ttl_s)
        said = {"address": self.me.address, "peer": self.me.peer_address}
        key = members_prefix(self.region) + self.me.name.encode()
        created = await self.etcd.create(key, json.dumps(said).encode(), self._lease)
        if created.created:
            self.taken_by = ""
            self.registered.set()
            return
        other = created.entry.value.decode(errors="replace") if created.entry else "?"
        if other != self.taken_by:
            log.error(
                "region %s: member name %s is registered by another process (%s): this"
                " one neither replicates as it nor campaigns until that entry's lease"
                " ends (this member's previous life, gone within a TTL; or two"
                " processes given one --member)",
                self.region, self.me.name, other,
            )  # fmt: skip
        self.taken_by = other
        await self.etcd.revoke(self._lease)
        self._lease = 0

    async def _read(self) -> None:
        config = await self.etcd.get(config_key(self.region))
        if config is not None:
            try:
                self.configured = parse_config(config.value)
            except (ValueError, KeyError):
                log.warning("region %s: its config entry is unreadable", self.region)
        prefix = members_prefix(self.region)
        found: dict[str, Registered] = {}
        for entry in await self.etcd.get_prefix(prefix):
            name = entry.key[len(prefix) :].decode(errors="replace")
            if name == self.me.name:
                continue
            try:
                said = json.loads(entry.value)
                found[name] = Registered(name, str(said["address"]), str(said["peer"]))
            except (ValueError, KeyError, TypeError):
                log.warning("region %s: member %s's entry is unreadable", self.region, name)
        if found != self.members:
            self.members = found
            await self.on_change(dict(found))


async def change_members(
    etcd: Etcd, region: str, *, add: str = "", remove: str = ""
) -> tuple[str, ...]:
    """One change of ``region``'s configured member set: ``add`` a member (running:
    registered in etcd) or ``remove`` one; the set after it. A transaction on the
    revision read, so two changes at once cannot both apply on one old set.
    ValueError, saying why, when the change may not be made."""
    if bool(add) == bool(remove):
        raise ValueError("one change at a time: add one member or remove one")
    entry = await etcd.get(config_key(region))
    names = parse_config(entry.value) if entry is not None else ()
    if add:
        if add in names:
            raise ValueError(f"member {add!r} is in the member set of region {region!r} already")
        if await etcd.get(members_prefix(region) + add.encode()) is None:
            raise ValueError(
                f"member {add!r} of region {region!r} is not running (no entry in etcd):"
                " start it first, and add it once it has caught up"
            )
        changed = (*names, add)
    else:
        if remove not in names:
            raise ValueError(
                f"member {remove!r} is not in the member set of region {region!r}, {list(names)}"
            )
        if len(names) == 1:
            raise ValueError(f"member {remove!r} is the last of region {region!r}: it cannot leave")
        changed = tuple(n for n in names if n != remove)
    revision = entry.mod_revision if entry is not None else 0
    if not await etcd.put_if_unchanged(config_key(region), config_value(changed), revision):
        raise ValueError(
            f"the member set of region {region!r} changed meanwhile: look again, then retry"
        )
    return tuple(sorted(changed))

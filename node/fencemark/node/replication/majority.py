"""A member's writes acknowledged by a majority of its region's members (SPEC §10).

At a member of a region of several, a local write — a client's write, or the
decider's grant, renewal or release — is answered only once a majority of the
region's configured members (``coordination.registry``) hold it durably: this
member, if it is one of them, and fellow members whose ``Push`` of it returned (a
``Push`` returns once the receiver's commit is on disk). It is one round per group
commit (``Storage.acknowledge``): every write of the commit in one ``Push`` to each
fellow member, all at once, answered as soon as enough have returned.

A write that does not reach a majority within ``timeout_s`` is refused to its caller
``NoMajority`` (UNAVAILABLE): it is durable here, and replication still carries it
to the others, so its outcome is unknown to the caller, as a lost reply's. Losing
any minority of members, disks included, loses nothing that was acknowledged.
"""

from __future__ import annotations

import asyncio
import contextlib

from fencemark.node.replication.replicator import Replicator
from fencemark.node.rules import quorum
from fencemark.node.rules.errors import NoMajority


class Majority:
    def __init__(self, replicator: Replicator, *, timeout_s: float) -> None:
        self.replicator = replicator  # its region, its member name and the member set
        self.region = replicator.replica.region
        self.member = replicator.member
        self.timeout_s = timeout_s

    async def acknowledge(self, keys: list[str], states: list[bytes]) -> None:
        """Return once a majority of the region's members hold ``states`` (of
        ``keys``) durably; raise ``NoMajority`` if that is not so within
        ``timeout_s``. A member that acknowledged them is not sent them again by the
        eager push that follows their commit (``Replicator.held_by``)."""
        names = self.replicator.configured()  # the member set, as last read from etcd
        if not names:
            raise NoMajority(
                self.region, 0, 0, 0, "the region's member set is not known yet (etcd not read)"
            )
        holders = {self.member}  # durable here before this is called
        if quorum.acknowledged(names, holders):
            return
        fellows = [name for name in names if name != self.member]

        async def push_to(name: str) -> str:
            """``name`` once it holds the states; "" if it refused any."""
            if not await self.replicator.push_to_member(name, states):
                return ""
            self.replicator.held_by(name, keys)
            return name

        pushes = [asyncio.create_task(push_to(name)) for name in fellows]
        why = f"no majority within {self.timeout_s:g} s"
        try:
            async with asyncio.timeout(self.timeout_s):
                for answer in asyncio.as_completed(pushes):
                    with contextlib.suppress(Exception):  # unreachable, refused: not acked
                        holders.add(await answer)
                    if quorum.acknowledged(names, holders):
                        return
            why = "too few members answered"
        except TimeoutError:
            pass
        finally:
            for push in pushes:
                push.cancel()
        acked = len(holders & set(names))
        raise NoMajority(self.region, acked, quorum.majority(len(names)), len(names), why)

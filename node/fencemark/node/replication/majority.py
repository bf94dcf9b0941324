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
from collections.abc import Callable

from fencemark.node.replication.replicator import Replicator
from fencemark.node.rules.errors import NoMajority


class Majority:
    def __init__(
        self,
        replicator: Replicator,
        region: str,
        member: str,
        configured: Callable[[], tuple[str, ...]],
        *,
        timeout_s: float,
    ) -> None:
        self.replicator = replicator
        self.region = region
        self.member = member
        self.configured = configured  # the region's member set, as last read from etcd
        self.timeout_s = timeout_s

    async def acknowledge(self, states: list[bytes]) -> None:
        """Return once a majority of the region's members hold ``states`` durably;
        raise ``NoMajority`` if that is not so within ``timeout_s``."""
        names = self.configured()
        if not names:
            raise NoMajority(
                self.region, 0, 0, 0, "the region's member set is not known yet (etcd not read)"
            )
        needed = len(names) // 2 + 1
        acked = 1 if self.member in names else 0
        if acked >= needed:
            return
        fellows = [name for name in names if name != self.member]
        pushes = [
            asyncio.create_task(self.replicator.push_to_member(name, states)) for name in fellows
        ]
        why = f"no majority within {self.timeout_s:g} s"
        try:
            async with asyncio.timeout(self.timeout_s):
                for push in asyncio.as_completed(pushes):
                    with contextlib.suppress(Exception):  # unreachable, refused: not acked
                        acked += await push
                    if acked >= needed:
                        return
            why = "too few members answered"
        except TimeoutError:
            pass
        finally:
            for push in pushes:
                push.cancel()
        raise NoMajority(self.region, acked, needed, len(names), why)

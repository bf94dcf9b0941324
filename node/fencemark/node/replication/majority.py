"""A member's writes acknowledged by a majority of its region's members (SPEC §10).

At a member of a region of several, a local write — a client's write, or the
decider's grant, renewal or release — is answered only once a majority of the
region's configured members (``coordination.registry``) hold it durably: this
member, if it is one of them, and fellow members whose ``Push`` of it returned (a
``Push`` returns once the receiver's commit is on disk). It is one round per group
commit (``Storage.acknowledge``): every write of the commit in one ``Push`` to each
fellow member, all at once, answered as soon as enough have returned. Commits made
while a push to a member is under way go to it together in the next one
(``Replicator.push_to_member``). The pushes
still under way then are left to finish (at most ``MAX_TRAILING`` per member): the
states are on their way to that member, so the eager push does not send them again
(``Replicator.held_by``); were the push to fail, anti-entropy still carries them.

A write that does not reach a majority within ``timeout_s`` is refused to its caller
``NoMajority`` (UNAVAILABLE): it is durable here, and replication still carries it
to the others, so its outcome is unknown to the caller, as a lost reply's. Losing
any minority of members, disks included, loses nothing that was acknowledged.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Sequence

import grpc

from fencemark.node.replication.link import PeerLeft
from fencemark.node.replication.replicator import Fetched, Replicator
from fencemark.node.rules import quorum
from fencemark.node.rules.errors import NoMajority, NotServing
from fencemark.node.store.events import Event

log = logging.getLogger(__name__)

# What a push to a fellow member that does not hold the states raises: the call
# failed (unreachable, refused, past its deadline) or the member left the peers.
EXPECTED = (grpc.aio.AioRpcError, PeerLeft, TimeoutError)

# Pushes to one member left running after their majority answered; past this (a member
# far behind, or cut off), the next one is cancelled instead and the eager push and
# anti-entropy carry its states, as for a member that refused them.
MAX_TRAILING = 64


class Majority:
    def __init__(self, replicator: Replicator, *, timeout_s: float) -> None:
        self.replicator = replicator  # its region, its member name and the member set
        self.region = replicator.replica.region
        self.member = replicator.member
        self.timeout_s = timeout_s
        self._trailing: dict[str, set[asyncio.Task[str]]] = {}  # by member
        self._looking: dict[str, asyncio.Task[None]] = {}  # look_up under way, by key

    async def acknowledge(
        self, keys: list[str], states: list[bytes], events: Sequence[Sequence[Event]] = ()
    ) -> None:
        """Return once a majority of the region's members hold ``states`` (of
        ``keys``) durably; raise ``NoMajority`` if that is not so within
        ``timeout_s``. ``events`` are each state's claim events, decided here: they
        go with the states, and each fellow member keeps them (``Records.History``
        answers alike at every member). A member that acknowledged the states is not
        sent them again by the eager push that follows their commit
        (``Replicator.held_by``)."""
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
            if not await self.replicator.push_to_member(name, states, events):
                return ""
            self.replicator.held_by(name, keys)
            return name

        pushes = {name: asyncio.create_task(push_to(name)) for name in fellows}
        why = f"no majority within {self.timeout_s:g} s"
        try:
            async with asyncio.timeout(self.timeout_s):
                for answer in asyncio.as_completed(pushes.values()):
                    try:
                        holders.add(await answer)
                    except EXPECTED:  # unreachable, refused, gone: not acked
                        pass
                    except Exception:  # a fault of this node's: not acked, and said
                        log.exception(
                            "a majority push to a fellow member of %s failed", self.region
                        )
                    if quorum.acknowledged(names, holders):
                        self._let_finish(pushes, keys)
                        return
            why = "too few members answered"
        except TimeoutError:
            pass
        finally:
            for push in pushes.values():
                push.cancel()  # those left to finish are no longer here
        acked = len(holders & set(names))
        raise NoMajority(self.region, acked, quorum.majority(len(names)), len(names), why)

    async def look_up(self, key: str) -> None:
        """Merge ``key``'s state from the fellow members: for the decider, before it
        answers a claim on a record it does not hold. A write acknowledged by a
        majority this member was not part of is then in its hands, and the claim is
        not answered ``missing``: that majority shares a member with this one and the
        fellows that answered. Returns once a fellow sent a state (merged), or enough
        said they hold none (``quorum.fellows_needed``); raises ``NotServing`` when too
        few answered within ``timeout_s`` (a grant would need them too). A fellow that
        may lack what it acknowledged (back on a lost disk, not caught up: its answer
        says ``owed``) says nothing by holding none, as it counts for no majority.
        Claims of one key share the lookup under way, so a burst of them costs each
        fellow one ``Fetch``."""
        looking = self._looking.get(key)
        if looking is None:
            looking = self._looking[key] = asyncio.create_task(self._look_up(key))
            looking.add_done_callback(functools.partial(self._looked_up, key))
        await asyncio.shield(looking)

    def _looked_up(self, key: str, task: asyncio.Task[None]) -> None:
        del self._looking[key]
        if not task.cancelled():
            task.exception()  # retrieved: its claims may all have left

    async def _look_up(self, key: str) -> None:
        names = self.replicator.configured()
        needed = quorum.fellows_needed(names, self.member, intact=True)
        if needed == 0:
            return
        fellows = [name for name in names if name != self.member]
        asks = [asyncio.create_task(self.replicator.fetch_from_member(n, [key])) for n in fellows]
        answered = owing = 0
        found: Fetched | None = None
        try:
            async with asyncio.timeout(self.timeout_s):
                for answer in asyncio.as_completed(asks):
                    try:
                        fetched = await answer
                    except EXPECTED:  # unreachable, refused, gone: no answer
                        continue
                    if fetched.states:
                        found = fetched
                        break
                    if fetched.owed:
                        owing += 1
                        continue
                    answered += 1
                    if answered >= needed:
                        return
        except TimeoutError:
            pass
        finally:
            for ask in asks:  # calls only: nothing is merged by them
                ask.cancel()
            await asyncio.gather(*asks, return_exceptions=True)
        if found is not None:
            await found.merge()
            return
        owes = f" ({owing} more may lack what they acknowledged)" if owing else ""
        raise NotServing(
            f"record {key!r} is not held here, and {answered} of the {needed} fellow"
            f" members of region {self.region!r} needed to say they hold none answered"
            f"{owes}",
            retry_after_ms=1000,
        )

    def _let_finish(self, pushes: dict[str, asyncio.Task[str]], keys: list[str]) -> None:
        """Leave the pushes still under way to finish, out of ``pushes``: the member
        receives them anyway, and a second send of the same states by the eager push
        would cost it a decode and a merge of each for nothing."""
        for name, push in list(pushes.items()):
            trailing = self._trailing.setdefault(name, set())
            if push.done() or len(trailing) >= MAX_TRAILING:
                continue
            del pushes[name]
            trailing.add(push)
            push.add_done_callback(_forget(trailing))
            self.replicator.held_by(name, keys)


def _forget(trailing: set[asyncio.Task[str]]) -> Callable[[asyncio.Task[str]], None]:
    def done(push: asyncio.Task[str]) -> None:
        trailing.discard(push)
        if not push.cancelled():
            push.exception()  # retrieved: a failed push is anti-entropy's to repair

    return done

"""This node's side of replication: eager push and anti-entropy rounds.

- Eager push: every local write enqueues its key for every peer (a bounded,
  de-duplicated queue per peer); a worker per peer pushes the latest states in
  batches. A slow or dead peer only fills its own queue, never blocks a client;
  what overflows is left to anti-entropy, and so is the whole queue of a peer
  that stays unreachable (``UNREACHABLE_AFTER_S``).
- Anti-entropy: every ``interval`` (jittered) a random peer that is not backed
  off gets one round: compare digest-tree roots; if they differ, descend level
  by level into differing nodes (salted check values; at most ``MAX_FRONTIER``
  per level) until listing a node's records costs less than its children, list
  those records (at most ``MAX_ROUND_RECORDS``, a chunk at a time), and pull
  what differs and merge it. A peer found behind is left to pull for a while.
  Rounds only pull: every node repairs itself, one round at a time, so no state
  is delivered twice by rounds of different nodes racing each other. A round is
  bounded; a round that pulled something is followed by another one soon.
- Catch-up: while this node owes a catch-up (a new or restored data directory,
  recorded durably by ``fencemark.node.core.grant_gate``) its rounds go first to
  the peers that have not yet given a complete one, and it decides claims only
  once every peer has (docs/replication.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from fencemark.node.core.replica import Replica
from fencemark.node.replication.intake import (
    MAX_BATCH_BYTES,
    MAX_STATES,
    decided_event,
    too_large,
)
from fencemark.node.replication.link import PeerLeft, PeerLink, asked_to_wait
from fencemark.node.replication.lives import refused_as_twin
from fencemark.node.replication.peer_check import PeerCheck
from fencemark.node.replication.peers import PeerStats
from fencemark.node.replication.rounds import RoundResult, Rounds
from fencemark.node.replication.tuning import Tuning
from fencemark.node.rules import quorum
from fencemark.node.rules.errors import ClockSkewed
from fencemark.node.rules.validation import MAX_RECORD_BYTES
from fencemark.node.security.tls_reload import LiveTls
from fencemark.node.store.events import Event
from fencemark.node.store.storage import Storage
from fencemark.v1 import replication_pb2

log = logging.getLogger(__name__)


# A fellow member that may lack what it acknowledged (``Tree`` said ``owed``): how
# long a member catching up waits before asking it again.
OWED_PEER_PAUSE_S = 0.25
# A majority push waits for the one under way to the same member only while that
# one is younger than this: a round trip, under load. A call that has taken longer
# may be stuck on a link that was cut (until its deadline); the pushes after it go
# on their own, at once, as they would with no push under way.
JOIN_WITHIN_S = 0.5


class Replicator(Rounds):
    def __init__(
        self,
        replica: Replica,
        storage: Storage,
        peers: dict[str, PeerStats],
        *,
        interval: float = 1.0,
        timeout: float = 10.0,
        catching_up: bool = False,
        on_caught_up: Callable[[], Awaitable[None]] | None = None,
        tls: LiveTls | None = None,
        tuning: Tuning | None = None,
        max_clock_offset_s: float = 0.5,
    ) -> None:
        self.replica = replica  # what it pulls merges through it ...
        self.storage = storage  # ... what it compares and pushes is read straight
        self.tuning = tuning or Tuning()
        self.interval = interval
        self.timeout = timeout
        self.catching_up = catching_up
        self._on_caught_up = on_caught_up
        self._tls = tls
        # The peers by name, shared with the replication service (which counts what
        # each sends); fellow members come and go (``set_members``).
        self._stats = peers
        self._peers = {name: self._link(stats) for name, stats in peers.items()}
        self._tasks: list[asyncio.Task[None]] = []
        self._peer_tasks: dict[str, list[asyncio.Task[None]]] = {}
        self._started = False
        self._members_changed = asyncio.Event()  # set, and replaced, by set_members
        self._synced: set[str] = set()  # while catching up: peers that gave a complete round
        # A member's region's configured member set (``Member.configured``); () for a
        # region's only node. A member catching up counts a majority of it.
        self.configured: Callable[[], tuple[str, ...]] = tuple
        # Fellow members whose last complete round said they may lack what they
        # acknowledged: not asked again before then (name -> monotonic time).
        self._owed_peers: dict[str, float] = {}
        self._first_life = False  # a member whose name serves for the first time
        # A restarted node counts a peer's round only once the peer has had time to
        # hear any other live process with this node id (a twin): ``_settled``.
        self.settle_s = (
            self.tuning.heartbeat_s + 2 * max_clock_offset_s + self.tuning.settle_slack_s
        )
        self._settling: dict[str, float] = {}  # peer name -> when its rounds count
        self.rounds = 0
        # Set when a call gets across to or from a peer after a while in which no call
        # of this node's reached any peer: the next round need not wait (_reached).
        self._round_due = asyncio.Event()
        # The majority push under way to a fellow member, by name, and those waiting
        # for it (``push_to_member``): sent together when it returns.
        self._pushing: dict[str, _Pushing] = {}

    # -- lifecycle ---------------------------------------------------------------

    def _link(self, stats: PeerStats) -> PeerLink:
        # With TLS, every call first checks the certificate the peer presents.
        tls = self._tls
        return PeerLink(stats, self.tuning, PeerCheck(stats, tls) if tls is not None else None)

    def start(self, *, members: bool = False) -> None:
        """Push, heartbeat and run rounds with every peer; ``members``: this node is a
        member of a region of several, whose fellow members come later
        (``set_members``), so its rounds and nap ticks run even with no peer yet."""
        self._started = True
        self.replica.on_local_write(self._enqueue)
        self.replica.on_sender_lacks(self._enqueue_for)
        for peer in self._peers.values():
            self._start_peer(peer)
        if self._peers or members:
            self._tasks.append(asyncio.create_task(self._anti_entropy_loop()))
            self._tasks.append(asyncio.create_task(self._tick_loop()))

    def _start_peer(self, peer: PeerLink) -> None:
        self._peer_tasks[peer.stats.name] = [
            asyncio.create_task(self._push_loop(peer)),
            asyncio.create_task(self._heartbeat_loop(peer)),
        ]

    async def stop(self) -> None:
        tasks = [*self._tasks, *(t for ts in self._peer_tasks.values() for t in ts)]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for peer in self._peers.values():
            await peer.channel.close(None)

    async def set_members(self, members: Mapping[str, str]) -> None:
        """This node's fellow members are now ``members`` (name -> the address their
        peers reach them at, this node left out): a new one becomes a peer, pushed
        to and synced with like any other (``REGION/NAME``); one gone (or moved to
        another address) stops being one. Another region's peers are left alone."""
        region = self.replica.region
        wanted = {f"{region}/{name}": address for name, address in members.items()}
        changed, self._members_changed = self._members_changed, asyncio.Event()
        changed.set()
        for name, peer in list(self._peers.items()):
            if peer.stats.member and wanted.get(name) != peer.stats.address:
                await self._drop(name)
        for name, address in wanted.items():
            if name not in self._peers:
                member = name.partition("/")[2]
                tls = self._tls
                credentials = tls.channel_credentials if tls is not None else None
                stats = PeerStats(region, address, member=member, credentials=credentials)
                self._stats[name] = stats
                peer = self._peers[name] = self._link(stats)
                log.info("member %s joins this node's peers at %s", name, address)
                if self._started:
                    self._start_peer(peer)
                    self._round_due.set()

    async def push_to_member(
        self, member: str, states: list[bytes], events: Sequence[Sequence[Event]] = ()
    ) -> bool:
        """Push ``states`` to fellow member ``member`` now, outside its queue, with
        each state's claim events (``events``, as decided here: the member keeps
        them); True once it holds them durably, False if it refused any. A member
        not registered yet is waited for (the caller bounds the wait); a failed call
        raises, as any push's (``replication.majority``)."""
        name = f"{self.replica.region}/{member}"
        while (peer := self._peers.get(name)) is None:
            await self._members_changed.wait()
        mine = _Waiting(states, events, asyncio.get_running_loop().create_future())
        pushing = self._pushing.get(name)
        if pushing is None:
            self._pushing[name] = _Pushing(time.monotonic())
            task = asyncio.create_task(self._push_waiting(peer, name, [mine]))
            self._tasks.append(task)
            task.add_done_callback(self._tasks.remove)
        elif time.monotonic() - pushing.since < JOIN_WITHIN_S:
            pushing.waiting.append(mine)  # a push to it is under way: go with the next one
        else:
            return await self._push_held(peer, states, events)  # that one may be stuck
        return await asyncio.shield(mine.held)

    async def _push_held(
        self, peer: PeerLink, states: Sequence[bytes], events: Sequence[Sequence[Event]]
    ) -> bool:
        """One majority push to ``peer``: whether it holds every state."""
        refused = await self._push(peer, states, events)
        self._reached(peer)
        peer.answered()
        return refused == 0

    async def _push_waiting(self, peer: PeerLink, name: str, batch: list[_Waiting]) -> None:
        """Push ``batch`` to fellow member ``name`` in one call, then whatever was
        asked meanwhile, in one more, until none waits: under load a member gets one
        ``Push`` per round trip, not one per commit. Each asker hears whether the
        member holds its states (False: it refused any of the call's)."""
        pushing = self._pushing[name]
        try:
            while batch:
                pushing.since = time.monotonic()
                states = [state for one in batch for state in one.states]
                events = [given for one in batch for given in _padded(one)]
                try:
                    held = await self._push_held(peer, states, events)
                except Exception as exc:
                    for one in batch:
                        if not one.held.done():
                            one.held.set_exception(exc)
                            one.held.exception()  # whoever gave up on it need not see it
                else:
                    for one in batch:
                        if not one.held.done():
                            one.held.set_result(held)
                batch, pushing.waiting = pushing.waiting, []
        finally:
            del self._pushing[name]
            for one in pushing.waiting + batch:
                if not one.held.done():
                    one.held.cancel()

    async def fetch_from_member(self, member: str, keys: list[str]) -> Fetched:
        """The states of ``keys`` that fellow member ``member`` holds, fetched now
        (merge them with ``Fetched.merge``). A member that is not a peer (not
        registered, or gone) raises ``PeerLeft``; a failed call raises, as any call's."""
        peer = self._peers.get(f"{self.replica.region}/{member}")
        if peer is None:
            raise PeerLeft(f"{member} is not among this node's fellow members")
        fetched = await self.fetch_now(peer, keys)
        return Fetched(self, peer, list(fetched.states), owed=fetched.owed)

    def held_by(self, member: str, keys: Sequence[str]) -> None:
        """Fellow member ``member`` acknowledged the states of ``keys`` as just
        committed here (``replication.majority``): the eager push that follows their
        commit (``_enqueue``) would send them again, so it skips them once."""
        peer = self._peers.get(f"{self.replica.region}/{member}")
        if peer is not None:
            peer.delivered.update(keys)

    async def catch_up_with_majority(self) -> None:
        """Return once this member holds the states of a majority of its region's
        configured members (``configured()``, itself counted if it is one and owes no
        catch-up): a complete round with enough of the others, each begun after this
        call (a new decider's catch-up, SPEC §10). A member that owes a catch-up
        itself (a new, emptied or restored file) may lack what it acknowledged: its
        rounds count for nothing (``rules.quorum``). Rounds with every other
        member run at once, so one that is paused or cut off holds up nothing;
        members not registered are waited for."""
        done: set[str] = set()
        rounds: dict[str, asyncio.Task[None]] = {}

        async def complete_round(member: str) -> None:
            name = f"{self.replica.region}/{member}"
            while True:
                peer = self._peers.get(name)
                if peer is None:
                    await self._members_changed.wait()
                    continue
                pause = 0.05
                try:
                    result = await self.sync_round(peer, whole=True)
                    if result.complete and not result.peer_owed:
                        done.add(member)
                        return
                    if result.peer_owed:
                        pause = OWED_PEER_PAUSE_S  # until it has caught up itself
                except Exception as exc:  # unreachable, refused: try again, others may do
                    log.debug("catching up with %s: %r", member, exc)
                await asyncio.sleep(pause)

        try:
            while True:
                names = self.configured()
                if self._holds_majority(names, done):
                    return
                for member in names:
                    if member != self.member and member not in rounds:
                        rounds[member] = asyncio.create_task(complete_round(member))
                await asyncio.sleep(0.05)
        finally:
            for task in rounds.values():
                task.cancel()
            await asyncio.gather(*rounds.values(), return_exceptions=True)

    def reaches_majority(self, within_s: float) -> bool:
        """Whether this member's calls were answered, within the last ``within_s``, by
        enough of its region's configured members to make a majority with it (itself
        counted if it is one: ``quorum.acknowledged``). A member that is not could
        get no write acknowledged, so it neither campaigns nor stays decider
        (``coordination.decider.Campaign``). Every fellow is called at least each
        ``heartbeat_s``."""
        now = time.monotonic()
        prefix = f"{self.replica.region}/"
        reached = {
            name.removeprefix(prefix)
            for name, peer in self._peers.items()
            if name.startswith(prefix) and now - peer.answered_at <= within_s
        }
        return quorum.acknowledged(self.configured(), reached | {self.member})

    def lacks_acknowledged(self) -> bool:
        """Whether this node's file may lack writes it acknowledged: it owes a
        catch-up (a new, emptied or restored file) and, at a member, its name served
        before (``first_life``). Its ``Tree`` answers say so: a member counts no
        round with it towards a majority's states."""
        return self.replica.gate.owed and not self._first_life

    async def first_life(self) -> None:
        """This member's name serves for the first time (etcd never saw it): it
        acknowledged nothing before, so it counts as holding all it acknowledged.
        It still catches up before it decides, as a majority of its fellow members'
        states and every other region's peer are its to learn."""
        self._first_life = True
        if self.catching_up and self.replica.gate.owed and self._pass_complete():
            await self._caught_up(self._synced)

    def _holds_majority(self, names: tuple[str, ...], rounds_with: Collection[str]) -> bool:
        """Whether complete rounds with the fellow members ``rounds_with`` (each
        holding all it acknowledged) give this member a majority's states of the
        configured set ``names``, itself counted unless its file may lack what it
        acknowledged (``rules.quorum``)."""
        intact = not self.lacks_acknowledged()
        return quorum.holds_majority(names, self.member, intact=intact, rounds_with=rounds_with)

    def _pass_complete(self) -> bool:
        """Whether the rounds counted so far end this node's catch-up: one complete
        round with every peer — for a member, with every peer of another region and
        with enough fellow members, each owing no catch-up, to hold a majority's
        states (``_holds_majority``)."""
        if not self.member:
            return set(self._peers) <= self._synced
        others = {name for name, peer in self._peers.items() if not peer.stats.member}
        if not others <= self._synced:
            return False
        prefix = f"{self.replica.region}/"
        fellows = {name.removeprefix(prefix) for name in self._synced if name.startswith(prefix)}
        return self._holds_majority(self.configured(), fellows)

    async def _drop(self, name: str) -> None:
        peer = self._peers.pop(name)
        self._stats.pop(name, None)
        self._synced.discard(name)
        self._settling.pop(name, None)
        self._owed_peers.pop(name, None)
        tasks = self._peer_tasks.pop(name, [])
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await peer.channel.close(None)
        log.info("member %s left this node's peers", name)

    def backlog(self, name: str) -> int:
        return len(self._peers[name].backlog)

    def peer_stats(self, name: str) -> PeerStats:
        return self._peers[name].stats

    def peer_check(self, name: str) -> PeerCheck | None:
        """The check of the certificate peer ``name``'s address presents (None without TLS)."""
        return self._peers[name].check

    def leaves_to_pull(self, name: str) -> bool:
        """Whether this node runs no round with peer ``name`` for now: it found it
        behind, or it came back from a partition that did not cut this node off."""
        return self._peers[name].behind_until > time.monotonic()

    def unreachable(self, name: str) -> bool:
        """Whether no call has reached peer ``name`` for a while: its push queue is
        dropped and nothing is queued for it until it is reached again."""
        return self._peers[name].unreachable()

    async def sync_with(self, name: str) -> RoundResult:
        """One anti-entropy round with peer ``name`` now, outside the schedule
        (``fencemark bench`` measures what one round costs)."""
        return await self.sync_round(self._peers[name])

    # -- calls ---------------------------------------------------------------------

    async def _push(
        self, peer: PeerLink, states: Sequence[bytes], events: Sequence[Sequence[Event]] = ()
    ) -> int:
        """Push states in batches bounded by count and bytes, each with its claim
        events (``events[i]`` are ``states[i]``'s, if given); how many the peer
        refused."""
        batch: list[bytes] = []
        decided: list[replication_pb2.DecidedEvent] = []
        size = 0
        refused = 0
        for index, state in enumerate([*states, None]):
            if batch and (
                state is None or len(batch) == MAX_STATES or size + len(state) > MAX_BATCH_BYTES
            ):
                request = replication_pb2.PushRequest(
                    origin=self._origin(), states=batch, events=decided
                )
                answer = await self._call(peer, "Push", request, replication_pb2.PushResponse)
                peer.stats.records_sent += len(batch)
                refused += answer.refused
                batch, decided, size = [], [], 0
            if state is not None:
                if index < len(events):
                    decided += (decided_event(len(batch), e) for e in events[index])
                batch.append(state)
                size += len(state)
        return refused

    # -- eager push ------------------------------------------------------------------

    def _enqueue(self, key: str) -> None:
        for peer in self._peers.values():
            self._queue(peer, key)

    def _enqueue_for(self, key: str, name: str) -> None:
        peer = self._peers.get(name)
        if peer is not None:
            self._queue(peer, key)

    def _queue(self, peer: PeerLink, key: str) -> None:
        if peer.delivered and key in peer.delivered:
            peer.delivered.discard(key)  # the majority round carried this commit there
            return
        if not peer.pushes_allowed() or peer.unreachable():
            return
        if key in peer.backlog or len(peer.backlog) < self.tuning.push_queue_limit:
            peer.backlog[key] = None
            peer.wake.set()

    def heard_from(self, name: str) -> None:
        """Peer ``name`` just called this one: it is up, so a back-off from its
        earlier failures is over — push and sync with it now, not seconds later —
        and writes are queued for it again."""
        peer = self._peers.get(name)
        if peer is None:
            return
        self._reached(peer)
        if peer.unreachable():
            peer.unanswered = 0  # reachable again; its own call proved it
        peer.connect_now()  # the next call must not be refused by a channel backing off
        self._back_off_over(peer)

    def _reached(self, peer: PeerLink) -> None:
        """A call got across between this node and ``peer`` (either way) after calls of
        this node's that did not reach it: a partition may have healed. If no call of
        this node's reached any other peer either, this node was cut off from all of
        them and is the one likely behind: its next round goes now — waiting out the
        round loop's pause (up to 1.5 intervals) would leave the repair idle. If it
        kept another peer, the returning one is likely the one behind, pulling in its
        own rounds: it gets an interval's head start before this node's next round
        with it, which would only list the differences for nothing (docs/performance.md)."""
        if not peer.unanswered:
            return
        if all(p.unanswered for p in self._peers.values() if p is not peer):
            self._round_due.set()
        elif peer.unreachable():
            peer.behind_until = max(peer.behind_until, time.monotonic() + self.interval)

    def _back_off_over(self, peer: PeerLink) -> None:
        """``peer`` is up again: end its back-off and let its pushes go now — all but
        a wait the peer itself asked for (``PeerLink.asked_until``). A peer that just
        woke from a nap calls out while it refuses calls: were its calls to end the
        wait, two nodes that napped together (one host, one suspended VM) would
        answer each other's refusals with calls as fast as they come."""
        now = time.monotonic()
        if peer.retry_at > now:
            peer.retry_at = peer.asked_until if peer.asked_until > now else 0.0
            peer.wake.set()

    def pulled_by(self, name: str, keys: list[str]) -> None:
        """Peer ``name`` just fetched the current states of ``keys`` from this one:
        pushing them too would deliver them twice (after a partition heals, the
        peer's own round and this node's kept queue both reach for them)."""
        peer = self._peers.get(name)
        if peer is not None:
            for key in keys:
                peer.backlog.pop(key, None)
            if peer.pushing:
                peer.fetched.update(keys)

    async def _push_loop(self, peer: PeerLink) -> None:
        while True:
            await peer.wake.wait()
            peer.wake.clear()
            while peer.backlog and peer.pushes_allowed():
                pause = peer.retry_at - time.monotonic()
                if pause > 0:
                    # Backed off; heard_from() (the peer called in) ends it early.
                    peer.wake.clear()
                    # Not wait_for: on Python 3.11 it can swallow a cancellation that
                    # arrives with the wake-up, and stop() would wait for this loop forever.
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(pause):
                            await peer.wake.wait()
                    continue
                # Take the keys out before reading their states: a write landing
                # while this batch is in flight puts its key back for the next one.
                keys = list(itertools.islice(peer.backlog, MAX_STATES))
                for key in keys:
                    del peer.backlog[key]
                peer.pushing, peer.fetched = True, set()
                try:
                    states = await self.storage.states(keys)
                    fresh = [k for k in keys if k in states and k not in peer.fetched]
                    for key in fresh:
                        if len(states[key]) > MAX_RECORD_BYTES:
                            # The peer would refuse it, and it may not fit a message:
                            # left out, so it cannot hold up the others.
                            too_large(peer.stats, peer.stats.name, key, len(states[key]))
                    fresh = [k for k in fresh if len(states[k]) <= MAX_RECORD_BYTES]
                    if not fresh:
                        continue  # fetched meanwhile, or gone: no call, nothing learned
                    await self._push(peer, [states[k] for k in fresh])
                except grpc.aio.AioRpcError as exc:
                    peer.requeue(keys)
                    if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                        peer.refuses_pushes()  # a read-only peer: it pulls instead
                    elif refused_as_twin(exc):
                        await self._twinned(peer)
                    elif exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                        peer.stats.skew_alarms += 1  # the peer refused our clock
                    why = f"push: {exc.code().name}: {exc.details()}"
                    peer.back_off(why, exc.code(), asked_to_wait(exc))
                    continue
                except PeerLeft as exc:  # its channel replaced: the next one carries them
                    peer.requeue(keys)
                    peer.back_off(str(exc))
                    continue
                except Exception as exc:  # a local fault: keep the keys, never end the loop
                    log.exception("push to %s failed", peer.stats.name)
                    peer.requeue(keys)
                    peer.back_off(f"push failed: {exc!r}")
                    continue
                finally:
                    peer.pushing = False
                self._reached(peer)
                peer.answered()

    # -- anti-entropy ----------------------------------------------------------------

    def unsynced(self) -> list[str]:
        """The peers that have not given a complete round since catch-up began."""
        return sorted(set(self._peers) - self._synced)

    def catch_up_again(self) -> None:
        """The node owes a catch-up again (its data file went back in time, or a peer
        refused it as a twin: ``grant_gate``): every peer owes it a complete round
        anew, begun from now on (``_settled``): one in flight as the obligation came
        may have been served before the peer heard a twin."""
        now = time.monotonic()
        self._synced = set()
        self.catching_up = True
        for peer in self._peers.values():
            peer.settle_after = max(peer.settle_after, now)

    async def _anti_entropy_loop(self) -> None:
        while True:
            now = time.monotonic()
            owes = self.catching_up and self.member and self.replica.gate.owed
            if owes and self._pass_complete():
                # A member's set changed (etcd read, a fellow registered), or it needs
                # no fellow at all (a member set of one): no round to wait for.
                await self._caught_up(self._synced)
            owed = self.catching_up and not self._pass_complete()
            # A peer found behind is left to pull, but not one still owed a round:
            # this node decides nothing until it has had one (it lists what the peer
            # lacks and pulls nothing; it completes all the same).
            ready = [
                p
                for p in self._peers.values()
                if p.retry_at <= now
                and (p.behind_until <= now or (owed and p.stats.name not in self._synced))
                and self._owed_peers.get(p.stats.name, 0.0) <= now
            ]
            pending = [p for p in ready if p.stats.name not in self._synced]
            if owed and pending:
                ready = pending  # the peers still owed a complete round go first
            result = None
            if ready:
                peer = random.choice(ready)
                began = time.monotonic()
                result = await self._guarded_round(peer)
                complete = result is not None and result.complete
                owing = result is not None and result.peer_owed and peer.stats.member
                if self.catching_up and complete and owing:
                    # It may lack what it acknowledged: it counts for no majority's
                    # states, and it is asked again a little later.
                    self._owed_peers[peer.stats.name] = time.monotonic() + OWED_PEER_PAUSE_S
                    complete = False
                if self.catching_up and complete and self._settled(peer, began):
                    # Into the set as it is after the round: one that found the node's
                    # file went back in time began the catch-up anew (catch_up_again).
                    self._synced.add(peer.stats.name)
                    if self._pass_complete():
                        await self._caught_up(self._synced)
            # Hurry only while pulling: a round that pulled nothing, even a truncated
            # one, found a peer that is behind, and that peer pulls in its own rounds.
            busy = result is not None and result.pulled > 0
            if owed:
                busy = True  # nothing is decided here until every peer gave a round
            pause = 0.02 if busy else self.interval * random.uniform(0.5, 1.5)
            now, peers = time.monotonic(), list(self._peers.values())
            if not any(p.retry_at <= now and p.behind_until <= now for p in peers):
                # Every peer backed off (or behind): the next round is due when the
                # first back-off ends, not an interval later — after a partition
                # heals, that interval would leave the link idle (docs/performance.md).
                ends = [p.retry_at for p in peers if p.retry_at > now]
                if ends:
                    pause = min(pause, min(ends) - now)
            elif all(p.unanswered for p in peers):
                # No call of this node's reaches any peer (cut off): a peer whose
                # back-off ended is tried now, at the back-offs' pace.
                pause = min(pause, 0.02)
            if owed:
                # Every peer still owed a round is only settling: no hurry until then.
                left = [self._settling.get(r) for r in set(self._peers) - self._synced]
                if left and all(at is not None for at in left):
                    wake = min(at for at in left if at is not None)
                    pause = max(pause, wake - time.monotonic())
            # Not wait_for: see _push_loop. A back-off ended meanwhile wakes it early.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(pause):
                    await self._round_due.wait()
            self._round_due.clear()

    def _settled(self, peer: PeerLink, began: float) -> bool:
        """Whether a complete round with ``peer`` that began at ``began`` counts
        towards a restarted node's first pass, or a catch-up. A node whose process
        drew its node id (a new or emptied file: ``GrantGate.fresh``) counts every
        complete round begun since its latest nap or owed catch-up
        (``PeerLink.settle_after``, which every round must have begun after): no
        other process can have that id, and a round begun after the nap reaches a
        peer that would refuse it had a copy started meanwhile. Any other file — a
        restart, a restored file, one that still owes the catch-up of its first
        start, one refused as a twin — may be a copy of a node that still runs: it
        counts a round that began ``settle_s`` after the peer first answered it. By
        then every other live process with this node id has called that peer
        (``heartbeat_s``) since this life began there, and the peer refuses the
        round as a twin's (``lives``) instead of answering it."""
        gate = self.replica.gate
        if not (gate.owed or gate.starting):
            return True
        if began < peer.settle_after:
            # Begun before the latest nap or obligation and answered after it (in
            # flight across a SIGSTOP, or as a twin was refused): it says nothing of
            # what the peer heard since.
            return False
        if gate.fresh:
            return True  # no copy of it can settle unseen
        if peer.first_answered is None:
            return False
        at = peer.first_answered + self.settle_s
        if began >= at:
            return True
        self._settling[peer.stats.name] = at
        gate.settled_at = max(gate.settled_at, at)  # the refusals meanwhile say when
        return False

    async def _tick_loop(self) -> None:
        """Tell the gate the event loop runs, five times per ``nap_s``: a longer gap
        is a nap (``grant_gate.tick``), after which this node settles again."""
        gate = self.replica.gate
        gate.start_ticking(self.tuning.nap_s, self.tuning.nap_quiet_s)
        while True:
            await asyncio.sleep(gate.nap_s / 5)
            gate.tick()

    def settle_again(self) -> None:
        """The process napped (``grant_gate.tick``): a copy of it may have started
        meanwhile and been heard alone. Every peer owes a round again, counted only
        once it began ``settle_s`` after the peer's first answer to a call made
        after the nap — as after a restart."""
        now = time.monotonic()
        self._synced = set()
        self._settling = {}
        self.catching_up = True
        for peer in self._peers.values():
            peer.first_answered, peer.settle_after = None, now
        # The earliest it can decide again; the refusals meanwhile say so (pushback).
        # A node whose process drew its node id waits for no settle, only for a
        # round begun since (``_settled``): its refusals name no wait.
        gate = self.replica.gate
        gate.settled_at = 0.0 if gate.fresh else now + self.settle_s

    async def _heartbeat_loop(self, peer: PeerLink) -> None:
        """Call ``peer`` at least every ``heartbeat_s``: a root-only ``Tree`` call
        when no round or push went out meanwhile. Its peers hearing each of its lives
        within a bounded time is what lets a restarted node tell, by waiting
        ``settle_s``, that no twin of it runs (``_settled``)."""
        every = self.tuning.heartbeat_s
        while True:
            # Whatever the earlier calls met (a peer down, backed off, refusing): a
            # peer that comes back, or wakes, hears this life within a heartbeat.
            # One call at a time; to a peer that is down it costs a refused
            # connection a second.
            now = time.monotonic()
            due = peer.last_called + every
            if due > now:
                await asyncio.sleep(due - now)
                continue
            request = replication_pb2.TreeRequest(origin=self._origin(), level=0)
            try:
                await self._call(peer, "Tree", request, replication_pb2.TreeResponse)
            except grpc.aio.AioRpcError as exc:
                if refused_as_twin(exc):
                    await self._twinned(peer)
                # Any other failure is the rounds' and pushes' to count and back off.
            except Exception:  # a refused certificate, a local fault: rounds report it
                log.debug("heartbeat to %s failed", peer.stats.name, exc_info=True)
            else:
                if peer.unanswered:
                    # Earlier calls did not reach it (a partition, a restart) and this
                    # one did: the link is back. A back-off for anything else (a
                    # refusal, a malformed reply) runs its course.
                    self._reached(peer)
                    peer.unanswered = 0
                    self._back_off_over(peer)

    async def _caught_up(self, synced: set[str]) -> None:
        """Every peer has given one complete round: this node has seen every grant its
        peers hold (fencemark.node.core.grant_gate). A peer that stays unreachable keeps
        the node from deciding; removing it from ``--peer`` is the operator's way to
        say it is gone for good (docs/operations.md, *A node that lost its disk*)."""
        self.catching_up = False
        log.info("caught up with %s; deciding claims", ", ".join(sorted(synced)))
        if self._on_caught_up is not None:
            await self._on_caught_up()

    async def _twinned(self, peer: PeerLink) -> None:
        """``peer`` refused this node: another live process calls it with this node's
        id (``lives``). Stop deciding until a complete pass with every peer — which
        they allow only once the other process has stopped (``grant_gate.twinned``)."""
        if self.replica.gate.deciding:
            log.error(
                "%s refuses this node: another live process calls it as node %s (a copy"
                " of this data directory started elsewhere); deciding no claims until it"
                " has stopped and this node has caught up",
                peer.stats.name,
                self.replica.node_id,
            )
        await self.replica.gate.twinned()

    async def _guarded_round(self, peer: PeerLink) -> RoundResult | None:
        try:
            result = await self.sync_round(peer)
        except ClockSkewed as exc:
            peer.stats.skew_alarms += 1
            peer.back_off(str(exc))
            log.warning("anti-entropy with %s: %s", peer.stats.name, exc)
            return None
        except grpc.aio.AioRpcError as exc:
            if refused_as_twin(exc):
                await self._twinned(peer)
            elif exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                peer.stats.skew_alarms += 1  # the peer refused our clock
            peer.back_off(f"{exc.code().name}: {exc.details()}", exc.code(), asked_to_wait(exc))
            return None
        except PeerLeft as exc:
            if self._peers.get(peer.stats.name) is peer:  # its channel replaced
                peer.back_off(str(exc))
            log.debug("anti-entropy with %s: %s", peer.stats.name, exc)
            return None
        except Exception as exc:  # a malformed reply, a local fault: never end the loop
            log.exception("anti-entropy with %s failed", peer.stats.name)
            peer.back_off(f"round failed: {exc!r}")
            return None
        # As for a push or a heartbeat: a round that got across after calls that did
        # not may be the first sign that a partition healed (a round in flight as it
        # did). Were ``answered`` to clear the count first, the head start that a
        # returning peer is owed (``_reached``) would never be given.
        self._reached(peer)
        peer.answered()
        peer.stats.last_sync = time.time()
        peer.stats.divergence = result.divergence
        if not result.in_sync and result.pulled == 0:
            # Everything that differs is the peer's to pull: leave it to its own
            # rounds for a while instead of descending into it again and again.
            peer.behind_until = time.monotonic() + self.tuning.behind_pause_s
        return result


@dataclass(frozen=True)
class Fetched:
    """States a fellow member sent, not merged yet (``Replicator.fetch_from_member``)."""

    rounds: Rounds
    peer: PeerLink
    states: list[bytes]
    owed: bool  # the member may lack what it acknowledged: a key it lacks says nothing

    async def merge(self) -> None:
        await self.rounds.merge_fetched(self.peer, self.states)


@dataclass
class _Waiting:
    """A majority push's states, their claim events and whether the member holds them."""

    states: Sequence[bytes]
    events: Sequence[Sequence[Event]]
    held: asyncio.Future[bool]


@dataclass
class _Pushing:
    """A majority push under way to one fellow member: when it began, and the pushes
    asked since, to go together in the next call."""

    since: float
    waiting: list[_Waiting] = field(default_factory=list)


def _padded(waiting: _Waiting) -> list[Sequence[Event]]:
    """``waiting``'s events, one entry per state (none given: none each)."""
    given = list(waiting.events)
    return given + [()] * (len(waiting.states) - len(given))

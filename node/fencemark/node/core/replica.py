"""The node's replica of every record: reads, and writes that pass admission.

Every change to a record goes through ``transact``: under the record's lock it
reads the durable state, applies a pure change (which may refuse by raising),
and persists the result before returning, so an acknowledged write is on disk
and a refused one changed nothing. The rules themselves live in ``admission``
and ``validation``.

One module of about 640 lines, on purpose: every change to a record passes here,
and the steps of one write — the gate, admission, the lapse due and what it does
to the work queue, the signature, ``transact`` with its claim events — read in one
place, in the order they run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from fencemark.node.core import history
from fencemark.node.core.grant_gate import GrantGate
from fencemark.node.crdt import HybridClock, Record, Stamp, codec, tagset
from fencemark.node.crdt.record import LAPSED, Birth
from fencemark.node.rules import changes, integrity, queue, validation
from fencemark.node.rules.admission import (
    Caller,
    admit_write,
    lapse_due,
    require_home,
    split_tokens,
)
from fencemark.node.rules.errors import InvalidInput, NoMajority, NotFound
from fencemark.node.security.signing import META_PREFIX, Keyring, Signer, certificate_pem
from fencemark.node.store.events import Event
from fencemark.node.store.feed import Change
from fencemark.node.store.picks import Pickable
from fencemark.node.store.storage import Storage, Stored

T = TypeVar("T")
log = logging.getLogger(__name__)
MAX_PAGE_BYTES = validation.MAX_RECORD_BYTES  # a page stops early rather than exceed this


class KeyLocks:
    """One asyncio lock per key, dropped when nobody holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)

    def busy(self, key: str) -> bool:
        """Someone holds ``key``'s lock or waits for it."""
        return key in self._locks


@dataclass(frozen=True)
class Remembered:
    stored: Stored
    created: bool


async def _through_cancellation(committed: asyncio.Future[None]) -> bool:
    """Wait for ``committed`` even if the waiting task is cancelled meanwhile (any
    number of times); True if it was. Raises the commit's error, if it failed."""
    cancelled = False
    while True:
        try:
            await asyncio.shield(committed)
            return cancelled
        except asyncio.CancelledError:
            if committed.cancelled():  # the storage closed under it: nothing to wait for
                raise
            if committed.done():
                committed.result()  # the commit's own error, if any
                return True
            cancelled = True


def _within_limits(changed: Record, known: tuple[Record, bytes] | None, *, local: bool) -> bytes:
    """``changed``'s canonical state, refused if over the limits of a client write."""
    # A merge that takes the remote state whole stores its bytes as they came:
    # canonical, so equal records encode alike.
    state = known[1] if known is not None and changed == known[0] else codec.encode(changed)
    if local and len(state) > validation.MAX_RECORD_BYTES:
        raise InvalidInput.field(
            "fields",
            f"the record would be {len(state)} bytes; at most {validation.MAX_RECORD_BYTES}",
        )
    # A merge's result obeys the limits of a client write too, or is not stored
    # (docs/consistency.md, *Limits and merges*).
    if not local and (problem := validation.state_problem(changed, len(state))):
        raise integrity.MergeRefused(
            changed.key, validation.OVER_LIMIT, f"merged with this node's state: {problem}"
        )
    return state


class Replica:
    def __init__(
        self,
        storage: Storage,
        clock: HybridClock,
        region: str,
        *,
        bounds: integrity.Bounds | None = None,
        signer: Signer | None = None,
        keyring: Keyring | None = None,
        max_attempts: int = queue.DEFAULT_MAX_ATTEMPTS,
    ) -> None:
        self.storage = storage
        self.clock = clock
        self.region = region
        self.node_id = storage.node_id
        # This life of the node: sent with every replication call, so that peers
        # tell a restart from a twin (fencemark.node.replication.lives).
        self.life = secrets.randbits(63) + 1
        # Its name among its region's members ("": the region's only node), sent with
        # every replication call it makes: a fellow member answers only a registered one.
        self.member = ""
        self._locks = KeyLocks()
        self._write_listeners: list[Callable[[str], None]] = []
        self._share_listeners: list[Callable[[str, str], None]] = []
        self._lease_listeners: list[Callable[[str, int], None]] = []
        self._change_listeners: list[Callable[[str], None]] = []
        # Whether this node may decide yet (catch-up after a new or lost disk).
        self.gate = GrantGate(storage, clock, region=region)
        # What merges may bring (fencemark.node.rules.integrity).
        self.bounds = bounds or integrity.Bounds(max_offset_ms=clock.max_offset_ms)
        # With TLS (both, or neither): this node signs what it grants and writes under
        # claims, and merges verify signatures (fencemark.node.security.signing). A TLS
        # reload replaces the signer (``use_signer``); the keyring learns in place.
        self.signer = signer
        self.keyring = keyring
        # Attempts after which a failed or lapsed claim parks an item without a
        # maxAttempts:N tag (SPEC §8).
        self.max_attempts = max_attempts

    def use_signer(self, signer: Signer) -> None:
        """Sign with ``signer`` from now on (a renewed node certificate's key)."""
        self.signer = signer

    # -- this node's clock and file, for the modules around it ---------------------

    def wall_ms(self) -> int:
        """This node's wall clock in ms: what leases are measured by."""
        return self.clock.wall_ms()

    def now_hlc(self) -> int:
        """A new timestamp of this node's hybrid logical clock."""
        return self.clock.now()

    def check_clock(self, hlc: int) -> None:
        """Raise ``ClockSkew`` when a peer's ``hlc`` is further ahead of this node's
        clock than the clock offset allows."""
        self.clock.check(hlc)

    @property
    def max_clock_offset_ms(self) -> int:
        return self.clock.max_offset_ms

    @property
    def record_count(self) -> int:
        """Records held, tombstones included (kept current by every commit)."""
        return self.storage.record_count

    async def find(self, key: str) -> Stored | None:
        """``key``'s stored state as it is (a tombstone too); None if never seen here."""
        return await self.storage.get(key)

    async def preload(self, keys: Sequence[str]) -> None:
        """Read ``keys`` into the cache in one query (before merging many of them)."""
        await self.storage.preload(keys)

    async def scan_all(self, after: str, limit: int) -> list[Stored]:
        """A page of every record after the key ``after``, tombstones included."""
        # Every key starts with "repo/" (validation.KEY); "0" follows "/".
        return await self.storage.scan("repo/", "repo0", after=after, limit=limit,
                                       include_deleted=True)  # fmt: skip

    async def picks(
        self, scope: str, now_ms: int, *, after: Pickable | None, limit: int
    ) -> list[Pickable]:
        """Items of ``scope`` homed here the pick index offers now, in pick order."""
        return await self.storage.picks(scope, self.region, now_ms, after=after, limit=limit)

    async def other_homes(self, scope: str) -> list[str]:
        """The regions other than this one that items of ``scope`` in the pick index
        are homed in."""
        return await self.storage.homes(scope, exclude=self.region)

    def busy(self, key: str) -> bool:
        """A change of ``key`` is under way (or waiting): its lock is taken."""
        return self._locks.busy(key)

    async def held_by(self, scope: str, owner: str, now_ms: int) -> list[str]:
        """Keys of ``scope``'s items homed here that a live lease of ``owner`` holds,
        as the pick index says."""
        return await self.storage.held_by(scope, self.region, owner, now_ms)

    # -- the change feed (core.watch reads it) --------------------------------------

    @property
    def feed_id(self) -> str:
        """Names this node's feed in cursors: its node id, new with a new data file."""
        return self.storage.node_id

    @property
    def feed_last(self) -> int:
        return self.storage.feed_last

    @property
    def feed_era(self) -> int:
        """The first ``seq`` of this life of the feed (``store.feed.era_start``; 0: the
        feed's first life): a ``seq`` below it that the file does not hold, it forgot."""
        return self.storage.feed_era

    async def feed_first(self) -> int:
        return await self.storage.feed_first()

    async def feed_changes(self, after: int, lower: str, upper: str, *, limit: int) -> list[Change]:
        """Feed rows after ``after`` of keys in ``[lower, upper)``, in commit order."""
        return await self.storage.changes(after, lower, upper, limit=limit)

    async def feed_grew(self, after: int) -> None:
        await self.storage.feed_grew(after)

    @property
    def feed_ended(self) -> bool:
        return self.storage.feed_ended

    def end_feed(self) -> None:
        """The node is stopping: its watchers are told now, not after the grace."""
        self.storage.end_feed()

    async def next_pickable_ms(self, scope: str, now_ms: int) -> int | None:
        """When a deferral or lease of ``scope``'s items homed here next ends."""
        return await self.storage.next_pickable_ms(scope, self.region, now_ms)

    async def history(self, key: str) -> list[Event]:
        """``key``'s claim events kept here (its home keeps them), oldest first."""
        validation.key(key)
        return await self.storage.events(key)

    async def keep_signer(self, kid: bytes, der: bytes) -> None:
        """Keep a signer's certificate in the data file, so a restart knows it."""
        name = META_PREFIX + kid.hex()
        if name not in self.storage.meta:
            await self.storage.put_meta(name, certificate_pem(der))

    @property
    def deciding(self) -> bool:
        """Whether this node decides claims and admits writes (``GrantGate``)."""
        return self.gate.deciding

    @property
    def recovered_hlc(self) -> int:
        return self.gate.recovered_hlc

    @property
    def era_hlc(self) -> int:
        """The era floor of the next grant: this life's, or the term's (``GrantGate``)."""
        return self.gate.era_hlc

    def on_lease(self, listener: Callable[[str, int], None]) -> None:
        """Call ``listener(key, expiry_ms)`` after each commit that leaves a record
        homed here with an unreleased grant (``lapses.LapseWatcher``)."""
        self._lease_listeners.append(listener)

    def on_change(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(key)`` after each change of a record is durable, local or
        merged (``ClaimNext``'s waiters look again)."""
        self._change_listeners.append(listener)

    def on_local_write(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(key)`` after each local write is durable (eager push)."""
        self._write_listeners.append(listener)

    def on_sender_lacks(self, listener: Callable[[str, str], None]) -> None:
        """Call ``listener(key, region)`` when a merge of a state ``region``'s node sent
        left this node's record as it was, but holding what the sender lacks: only
        that node needs it (eager push back to the sender)."""
        self._share_listeners.append(listener)

    def stamp(self, epoch: int) -> Stamp:
        """A fresh stamp for a local write admitted under ``epoch``."""
        return Stamp(epoch, self.clock.now(), self.node_id)

    async def transact(
        self,
        key: str,
        change: Callable[[Record], tuple[Record, T]],
        *,
        local: bool = True,
        known: tuple[Record, bytes] | None = None,
        note: str = "",
        actor: str = "",
        decides: bool = False,
        decided: list[Event] | None = None,
        asserts: Callable[[T], bool] | None = None,
    ) -> tuple[Stored | None, T]:
        """Apply ``change`` to the durable state of ``key`` and persist the result.

        Returns the stored state (None if the record does not exist and was not
        written) and whatever ``change`` returned beside the new record. ``local``
        is False for merges of remote states, which are not pushed on again and
        whose result must be within the limits of a client write
        (:class:`~fencemark.node.rules.integrity.MergeRefused`, ``over_limit``, if not).
        ``known`` is a record with its canonical encoding: should the new record
        equal it, that encoding is stored instead of encoding again. A local change
        at the record's home keeps its claim events (``history``) in the same
        commit, ``note`` (an operator's reason) and ``actor`` (who) with them; a merge
        keeps those ``change`` appended to ``decided`` (the home's move when two
        births meet, ``merge``). A change that ``decides`` (a grant, a renewal, a
        release, a fenced write) is refused (:class:`NotServing`) if this process
        napped before it was committed (``grant_gate.awake``): a copy of the node
        may have decided meanwhile.

        ``asserts(result)`` says whether an answer ``change`` drew from a state it left
        unchanged asserts that state (a retried release answered ``released``). At a
        member of a region of several, such a state is acknowledged by a majority
        again before it is answered (``NoMajority`` if not): it may be one this
        member committed without a majority (its first answer ``NO_MAJORITY``), and
        a decider elected without it would decide otherwise — grant the released
        token again, say.
        """
        mark = self.gate.mark()
        async with self._locks.hold(key):
            stored = await self.storage.get(key)
            current = stored.record if stored is not None else Record(key)
            changed, result = change(current)
            changed = self._sealed(changed)
            if changed == current:
                if stored is not None and asserts is not None and asserts(result):
                    await self._acknowledged_again(stored)
                if decides:
                    self.gate.awake(mark)
                return stored, result
            state = _within_limits(changed, known, local=local)
            events = (
                history.events_of(
                    current, changed, at_ms=self.clock.wall_ms(), note=note, actor=actor
                )
                if local and changed.home_region == self.region
                else []
            ) + (decided or [])
            stored, committed = self.storage.enqueue(
                changed,
                hlc=self.clock.last,
                state=state,
                events=events,
                change=changes.kind_of(current, changed),
                at_ms=self.clock.wall_ms(),
                acked=local,
            )
            # Once queued, the write is committed whether the caller waits or not. A
            # caller cancelled meanwhile (a client gone, a deadline) still holds the
            # key's lock until it is, so the next change of the key reads it rather
            # than the state before it, and the listeners hear of it; then the
            # cancellation goes on. Written here but not acknowledged by a majority of
            # the region's members: committed all the same, refused to the caller.
            try:
                cancelled = await _through_cancellation(committed)
            except NoMajority:
                self._committed(key, changed, local)
                raise
        self._committed(key, changed, local)
        if cancelled:
            raise asyncio.CancelledError
        if decides:
            self.gate.awake(mark)
        return stored, result

    async def _acknowledged_again(self, stored: Stored) -> None:
        """At a member: return once a majority holds ``stored`` (``transact``'s
        ``asserts``); raises ``NoMajority`` if none does in time."""
        acknowledge = self.storage.acknowledge
        if acknowledge is not None:
            await acknowledge([stored.record.key], [codec.encode(stored.record)], [()])

    def _committed(self, key: str, changed: Record, local: bool) -> None:
        """Tell whoever follows commits (lapses, waiters, the push) that ``changed`` is
        on disk."""
        fence = changed.fence
        if self._lease_listeners and changed.home_region == self.region and fence.unreleased():
            for lease_listener in self._lease_listeners:
                lease_listener(key, fence.expiry(fence.fence))
        for change_listener in self._change_listeners:
            change_listener(key)
        if local:
            self._written(key)

    async def merge(
        self,
        remote: Record,
        state: bytes | None = None,
        *,
        sender: str = "",
        voided: list[integrity.MergeRefused] | None = None,
        learnt: Sequence[Event] = (),
    ) -> bool:
        """Join a remote state into the local one; True when that changed anything.
        ``state`` is the remote record's canonical encoding, when the caller has it;
        ``sender`` the region whose node sent it, when known; births the join holds
        void that were not void here (``integrity.voided_births``) are added to
        ``voided``, for the caller to count and alert as refusals. ``learnt`` are the
        claim events a fellow member (this region's decider) decided with the state:
        kept with it when it changes a record of this region (``Records.History``).

        A record born elsewhere that holds a claim is *seen* here: this node adds its
        region's signed sighting (``Record.seen``, ``_seen``) the first time, so that a
        birth of this region can never take it from its home afterwards — whoever
        signs it with this region's key (docs/security.md, *Signed births*).

        A state that fails :func:`integrity.check` is not merged at all: it raises
        :class:`~fencemark.node.rules.integrity.MergeRefused` and nothing is written.
        The caller has checked the remote stamps (``clock.check``); receiving
        them advances the local clock past every stamp in the state, so a later
        local write always wins over what was merged (SPEC §3).
        """
        validation.key(remote.key)
        if self.gate.forgets(remote):
            # This node's data file went back in time (docs/replication.md): catch
            # up again, durably, before the state that proves it is merged.
            log.error(
                "the state of %s holds writes this node made that its data file does"
                " not remember: the file went back in time (a reverted snapshot, a"
                " lost fsync, an old copy); deciding no claims until caught up again",
                remote.key,
            )
            await self.gate.rolled_back()
        self.clock.observe(remote.max_hlc())
        await self.gate.merging()
        share = False
        decided: list[Event] = []

        def change(current: Record) -> tuple[Record, bool]:
            nonlocal share
            merged = integrity.check(current, remote, now_ms=self.clock.wall_ms(),
                                     bounds=self.bounds, verifier=self.keyring)  # fmt: skip
            if voided is not None:
                voided.extend(integrity.voided_births(current, merged))
            ours = merged.home_region == self.region
            decided[:] = list(learnt) if ours else []
            if ours and split_tokens(merged):
                # Two births met, and this node is the surviving home: every claim
                # either side granted apart is superseded (SPEC §2).
                merged = merged.with_fence(merged.fence.move(merged.fence.fence + 1))
                decided.append(history.moved(merged, at_ms=self.clock.wall_ms()))
            merged = self._seen(merged)
            # Whatever the sender lacks (a decision just made, or what this node held
            # and the sender did not) is pushed at once, as a write is. Anti-entropy
            # would fetch it only once the sender's largest HLC stops outrunning
            # ours — never, while the sender keeps writing to the record (the chaos
            # tier found a home that kept admitting a split-time token that way).
            # A birth or a moved fence learnt here is passed on at once as well: it
            # decides who may hold the record, and the peer that lacks it may be
            # the one anti-entropy will not fetch it for.
            births = current.births.keys()
            news = bool(births) and merged.births.keys() != births
            news = news or (bool(births) and merged.creators != current.creators)
            news = news or merged.fence.moved != current.fence.moved
            share = news or merged != remote
            return merged, merged != current

        known = (remote, state) if state is not None else None
        _, changed = await self.transact(
            remote.key, change, local=False, known=known, decided=decided
        )
        if share and sender and not changed:
            # Nothing new here: the peers this node was in step with need nothing, only
            # the sender lacks what this node holds (after a partition, a region that
            # pulled a stale state would otherwise push it back to every peer).
            for listener in self._share_listeners:
                listener(remote.key, sender)
        elif share:
            self._written(remote.key)
        return changed

    def _seen(self, record: Record) -> Record:
        """``record`` with this region's sighting, signed, when it holds a claim and
        was born elsewhere only, and this region has none yet (``merge``)."""
        region = self.region
        if not (record.exists and record.fence.grants):
            return record
        if region in record.births or region in record.seen:
            return record
        seen = record.see(region, Birth(self.stamp(0)))
        return self.signer.sign_seen(seen, region) if self.signer is not None else seen

    def _written(self, key: str) -> None:
        for listener in self._write_listeners:
            listener(key)

    def check_gate(self, record: Record) -> None:
        """Raise :class:`NotServing` while this node decides nothing (``grant_gate``:
        catching up, settling after a restart or a nap) — unless ``record`` was born
        with another home: the decision is not this node's anyway, and its answer,
        ``wrong_region`` naming the home, decides nothing, so a routing client goes
        to the home at once instead of waiting out this node's settle
        (docs/api.md, *NOT_SERVING*). A record it does not hold, it cannot tell:
        refused."""
        if not (record.exists and record.home_region != self.region):
            self.gate.check()

    def _check_gate(self, record: Record, fencing_token: int) -> None:
        """A fenced write waits for the gate (``check_gate``); unfenced ones a node
        that is not deciding admits by the rule of a node that is not the home
        (``admit``)."""
        if fencing_token:
            self.check_gate(record)

    def _admit(self, current: Record, token: int, home: str, caller: Caller) -> int:
        return admit_write(current, token, caller=caller, home=home, region=self.region,
                           now_ms=self.clock.wall_ms(), deciding=self.gate.deciding)  # fmt: skip

    def _sealed(self, record: Record) -> Record:
        """With TLS: the end of the fence's claim sealed when this node ended it (the
        home, or the region that granted), and a move signed when this node is the
        home — what lets every other node tell them from a peer's forgery."""
        if self.signer is None:
            return record
        fence = record.fence
        holder = fence.holder()
        home = record.home_region == self.region
        end = holder is not None and (home or holder.region == self.region)
        sealed = self.signer.seal(record.key, fence, end=end, move=home)
        return record if sealed is fence else record.with_fence(sealed)

    def _signed(self, record: Record, stamp: Stamp) -> Record:
        """``record`` with the write made at ``stamp`` signed when it is at the epoch
        of an unreleased grant: only this node (the home, or the region that made
        the grant) admits such a write, and a peer's forgery of one is refused
        (``integrity``; docs/security.md, *Signed writes*)."""
        fence = record.fence
        if self.signer is None or stamp.epoch != fence.fence or not fence.unreleased():
            return record
        return self.signer.sign_writes(record, stamp)

    def lapse_if_due(self, record: Record) -> Record:
        """At the home: record a lapse that is due (SPEC §4) before deciding on it,
        with what it means for the work queue (an attempt that may park the item)."""
        if not (self.gate.deciding and lapse_due(record, self.region, self.clock.wall_ms())):
            return record
        token = record.fence.fence
        lapsed = record.with_fence(record.fence.lapse(token))
        return self.end_claim(lapsed, self.stamp(token), LAPSED)

    def end_claim(
        self, record: Record, stamp: Stamp, ending: str, *, not_before_ms: int = 0
    ) -> Record:
        """``record`` with the queue state of the claim of ``stamp.epoch`` ending with
        ``ending`` (``queue.ended``), written at ``stamp`` and signed by this node."""
        changed = queue.ended(record, ending, stamp, default_max_attempts=self.max_attempts,
                              not_before_ms=not_before_ms)  # fmt: skip
        return self.signed_queue(changed, stamp)

    def signed_queue(self, record: Record, stamp: Stamp) -> Record:
        """``record`` with what this node wrote at ``stamp`` signed, with TLS: queue
        registers are written by the home only, and every other node refuses one
        that its home did not sign (``integrity``, ``unsigned_write``)."""
        return record if self.signer is None else self.signer.sign_writes(record, stamp)

    async def record_lapse(self, key: str) -> bool:
        """Record, at the home, that the lease of ``key``'s fence has run out; True if
        that changed the record. Replicated like any write, it readmits unfenced
        writes on every node."""

        def change(current: Record) -> tuple[Record, bool]:
            lapsed = self.lapse_if_due(current)
            return lapsed, lapsed is not current

        _, changed = await self.transact(key, change)
        return changed

    async def sign_own(self) -> int:
        """Sign every unsigned fence grant, birth and sighting of this region, every
        write this node made at the epoch of an unreleased grant, and every queue
        register it wrote, and see every claimed record born elsewhere that this
        region has not seen yet (a file from before sightings: ``merge``); returns
        how many records that changed.

        Grants, births and writes made before they were signed (a file upgraded
        from an older format), or while this node ran ``--insecure``, carry no
        signature, and a node that has not merged them yet would refuse them
        (``unsigned_grant``, ``unsigned_birth``, ``unsigned_write``). Signed, each
        beats its unsigned version in every join, so the signature spreads like any
        write (docs/security.md, *Signed grants*).
        """
        signer, region = self.signer, self.region
        if signer is None:
            return 0

        def change(current: Record) -> tuple[Record, bool]:
            signed = signer.sign_seen(self._seen(current) if current.exists else current, region)
            signed = signer.sign_birth(signed, region)
            holder = signed.fence.holder()
            ours = holder is not None and holder.region == region == signed.home_region
            if ours and holder is not None and not holder.signature:
                signed = signed.with_fence(signer.sign_fence(signed.key, signed.fence))
            fence = signed.fence
            if holder is not None and fence.unreleased():
                for stamp in {
                    reg.stamp
                    for _, _, reg in signed.registers()
                    if reg.stamp.epoch == fence.fence
                    and reg.stamp.node == self.node_id
                    and not reg.signature
                }:
                    signed = signer.sign_writes(signed, stamp)
            for stamp in {
                reg.stamp
                for reg in signed.queue.values()
                if reg.stamp.node == self.node_id and not reg.signature
            }:
                signed = signer.sign_writes(signed, stamp)  # queue registers: signed always
            signed = self._sealed(signed)  # an end or a move made unsigned
            return signed, signed is not current

        signed, after, page_size = 0, "", 500
        while True:
            page = await self.scan_all(after, page_size)
            for stored in page:
                if change(stored.record)[1]:
                    _, did = await self.transact(stored.record.key, change)
                    signed += did
            if len(page) < page_size:
                return signed
            after = page[-1].record.key

    # -- reads ------------------------------------------------------------------

    async def get(self, key: str) -> Stored:
        validation.key(key)
        stored = await self.storage.get(key)
        if stored is None or not stored.record.visible:
            raise NotFound(key)
        return stored

    async def list(
        self,
        repo: str,
        *,
        topic: str = "",
        tag: str = "",
        page_size: int = 0,
        page_token: str = "",
        include_deleted: bool = False,
    ) -> tuple[list[Stored], str]:
        """A page of records in key order and the token of the next page."""
        prefix, upper = validation.key_range(repo, topic)
        if tag:
            validation.tags([tag], "tag")
        limit = validation.page_size(page_size)
        if page_token and not (
            page_token.startswith(prefix) and validation.KEY.fullmatch(page_token)
        ):
            raise InvalidInput.field("page_token", "not a page token of this listing")
        page: list[Stored] = []
        size = 0
        after = page_token
        while True:
            # One row more than a page tells whether anything follows it.
            batch = await self.storage.scan(
                prefix, upper, after=after, limit=limit + 1, include_deleted=include_deleted
            )
            for stored in batch:
                if tag and tag not in stored.record.tag_values():
                    continue
                if len(page) == limit or (page and size + stored.size > MAX_PAGE_BYTES):
                    return page, page[-1].record.key
                page.append(stored)
                size += stored.size
            if len(batch) <= limit:
                return page, ""
            if len(page) == limit:
                # Full, and more rows follow that may not match the tag: the
                # next page may be empty, but this call stays bounded.
                return page, page[-1].record.key
            after = batch[-1].record.key

    # -- writes -----------------------------------------------------------------

    async def remember(
        self,
        repo: str,
        topic: str,
        id: str,
        *,
        fields: Mapping[str, str],
        tags: Sequence[str],
        fencing_token: int = 0,
        caller: Caller,
    ) -> Remembered:
        """Create the record or merge into it (SPEC §2: born in its home region)."""
        key = str(
            validation.Key(
                validation.segment(repo, "repo"),
                validation.segment(topic, "topic"),
                validation.segment(id, "id"),
            )
        )
        validation.fields(fields)
        validation.tags(tags)
        validation.queue_tags(tags)
        home_tag = validation.home_tag(tags)
        plain_tags = [t for t in tags if not t.startswith(validation.HOME_TAG_PREFIX)]

        def change(current: Record) -> tuple[Record, bool]:
            self._check_gate(current, fencing_token)
            home = current.home_region or home_tag or self.region
            if not current.exists:
                require_home(home, self.region, fence=0, birth=True)
            if home_tag is not None and home_tag != home:
                raise InvalidInput.field(
                    "tags", f"homeRegion is fixed when a record is created: it is {home!r}"
                )
            current = self.lapse_if_due(current)
            stamp = self.stamp(self._admit(current, fencing_token, home, caller))
            created = not current.visible
            changed = current.create(home, stamp)
            if self.signer is not None and not current.exists:
                changed = self.signer.sign_birth(changed, self.region)  # signed births
            if current.is_deleted:
                # Recreated: it starts from what this call says, never from what
                # was deleted (a concurrent write may have reached the tombstone).
                stale_fields = {name: "" for name in current.field_values()}
                stale_tags = tagset.value(current.tags) - set(plain_tags)
                changed = changed.set_deleted(False, stamp).remove_tags(stale_tags, stamp)
                changed = changed.set_fields({**stale_fields, **fields}, stamp)
            else:
                changed = changed.set_fields(fields, stamp)
            changed = self._signed(changed.add_tags(plain_tags, stamp), stamp)
            validation.record_size(changed, "fields")
            return changed, created

        stored, created = await self.transact(key, change, decides=bool(fencing_token))
        assert stored is not None  # remember always writes
        return Remembered(stored, created)

    async def update(
        self,
        key: str,
        *,
        fields: Mapping[str, str],
        add_tags: Sequence[str] = (),
        remove_tags: Sequence[str] = (),
        fencing_token: int = 0,
        caller: Caller,
    ) -> Stored:
        validation.key(key)
        validation.fields(fields)
        validation.tags(add_tags, "add_tags")
        validation.queue_tags(add_tags, "add_tags")
        validation.tags(remove_tags, "remove_tags")
        validation.no_home_tags(add_tags, "add_tags")
        validation.no_home_tags(remove_tags, "remove_tags")
        both = set(add_tags) & set(remove_tags)
        if both:
            raise InvalidInput.field("remove_tags", f"also in add_tags: {sorted(both)[:5]}")

        def change(current: Record) -> tuple[Record, None]:
            self._check_gate(current, fencing_token)
            if not current.visible:
                raise NotFound(key)
            current = self.lapse_if_due(current)
            epoch = self._admit(current, fencing_token, current.home_region, caller)
            if not fields and not add_tags and not remove_tags:
                return current, None  # admitted, nothing to write (but a lapse it recorded)
            stamp = self.stamp(epoch)
            changed = current.set_fields(fields, stamp).add_tags(add_tags, stamp)
            changed = self._signed(changed.remove_tags(remove_tags, stamp), stamp)
            validation.record_size(changed, "fields", "add_tags")
            return changed, None

        stored, _ = await self.transact(key, change, decides=bool(fencing_token))
        assert stored is not None
        return stored

    async def delete(self, key: str, *, fencing_token: int = 0, caller: Caller) -> Stored:
        """Write a tombstone; always written, even for a key never seen here."""
        validation.key(key)

        def change(current: Record) -> tuple[Record, None]:
            self._check_gate(current, fencing_token)
            home = current.home_region or self.region
            current = self.lapse_if_due(current)
            stamp = self.stamp(self._admit(current, fencing_token, home, caller))
            # A delete erases the content; the tombstone keeps home and fence. A
            # key never seen here gets a tombstone without a home: homing it here
            # could take over a record created meanwhile in another region.
            return self._signed(current.clear(stamp).set_deleted(True, stamp), stamp), None

        stored, _ = await self.transact(key, change, decides=bool(fencing_token))
        assert stored is not None
        return stored

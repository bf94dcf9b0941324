"""May this node decide now? Catch-up after a new or lost disk, and the recovery gap.

A node that starts on a new, emptied or restored data directory may hold less
than its earlier life granted: were it to grant at once, it would hand out again
tokens that workers still hold (SPEC §4). So, from the first moment such a
directory is opened, the node *owes a catch-up*: it decides no claim, renewal,
release or fenced write until it has finished a complete anti-entropy pass with
every configured peer. The obligation is a row in the file's meta table
(``catch_up = owed``), written when the file is created
(``storage._open_writer``) or restored (``restore.mark_restored``) and cleared
only by :meth:`GrantGate.caught_up`: a node killed during catch-up, any number
of times, owes it again when it restarts.

A grant of the earlier life that never reached a peer cannot be learnt at all.
If a peer held any record while this node was catching up (the cluster is not
brand new), the node owes a *recovery gap* too (``gap_owed``, durable before the
first such record is merged): the first token it grants on each record whose
holder it did not grant since jumps ``RECOVERY_GAP`` above the fence
(``admission.next_token``), past every token its earlier life can have issued.

Meanwhile it takes unfenced writes by the rule of a node that is not the home
(refused while it sees an unreleased grant): what it has not seen yet is stamped
under an older epoch and never overrides work done under a claim
(docs/consistency.md, *Catch-up*).

A file can also go back in time without being lost: a virtual machine reverted to a
snapshot, a disk that acknowledged an fsync and lost the write, an old copy put back
by hand. Such a file holds no sign of it, so every start of a file that was written
before is treated as if it might be one (docs/replication.md, *A disk that goes back
in time*):

- **A new era of tokens.** ``life_hlc`` is the HLC at which this life of the file
  began. The first token this life grants on a record whose holder it did not
  grant itself is at least ``token_ceiling(life_hlc)`` (``admission.next_token``):
  above every token an earlier life granted, replicated or not, whatever the file
  forgot.
- **A round with every peer first.** The node does not decide until each peer has
  given it one complete round (``starting``), or ``start_wait_s`` has passed: what
  the file forgot and a peer holds (a done item, a live claim) is learnt before
  the work queue hands anything out. A round counts once the peer has had time to
  hear another live process with this node id, if one runs (``Replicator._settled``):
  a copy of a running node is refused as a twin before it decides. Unlike a lost
  disk's, this wait is bounded, so a restart while a peer is down costs seconds of
  claims, not the peer's absence.
- **Detected from the peers.** A state holding a stamp of this node's own, or a
  grant of its region, issued after what the file remembers (``opened_hlc``) and
  before this life began is proof that the file lost writes (``forgets``). The node
  then owes a full catch-up and the recovery gap, durably, as after a lost disk
  (``rolled_back``), and says so in its log and metrics.

Two live processes serving one node's data (a twin: a copy of a live node's
directory started elsewhere) are told apart by their peers, which refuse both
(``replication.lives``); each owes the same full catch-up and gap when it hears
it (``twinned``), and can finish it only once the other has stopped.

Their peers tell only because each live process calls each of them at least once
a heartbeat. A process that stood still — paused (``SIGSTOP``, a suspended virtual
machine, a frozen container) or starved of CPU — called nobody meanwhile: a copy
started then may have settled unseen and decided. So the node watches its own
event loop (``tick``, from the replicator, several times a second); a gap above
``nap_s`` (``replication.tuning.NAP_S``) is a *nap*, and the node settles with its
peers again as after a restart (``starting``) before it decides. The check runs
before every decision, not only at the next tick — a claim waiting in the socket
when the process wakes may be served first — and once more after a grant is
durable (``awake``): one decided before the nap is not handed out after it.

A region served by several members decides at one of them, its *decider*, elected
through etcd (SPEC §10, ``fencemark.node.coordination``): the member's ``role``.
Every check asks it too: a member that is not the decider refuses with a redirect
(``NotDecider``), one whose lease is in doubt ``NotServing``; and a decision made
while the member decided is acknowledged only if the member still decides in the
same term once it is durable (``awake``). Each term starts an era of tokens of its
own (``new_term``): its first grant on each record jumps above every token an
earlier term can have granted (``term_floor``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from fencemark.node.crdt import HybridClock, Record
from fencemark.node.crdt.hlc import pack, physical_ms
from fencemark.node.rules.admission import RECOVERY_GAP, TOKENS_PER_MS_BITS
from fencemark.node.rules.errors import NotServing
from fencemark.node.store.storage import Storage

CATCH_UP = "catch_up"  # meta: "owed" until a complete pass with every peer, then "done"
GAP_OWED = "gap_owed"  # meta: "1" once a peer held records while catch-up was owed
RECOVERED_HLC = "recovered_hlc"  # meta: grants below this HLC are of an earlier life

log = logging.getLogger(__name__)


class Role(Protocol):
    """A member's part in its region's election (``coordination.member``)."""

    def term(self) -> int:
        """The term this member decides in now; 0 when it does not decide."""
        ...

    def check(self) -> None:
        """Raise ``NotDecider`` (another member decides) or ``NotServing`` (nobody
        does, or this member's lease is in doubt) unless this member decides now."""
        ...


# The milliseconds of token ceiling that a recovery's gap spans, and one more.
RECOVERY_GAP_MS = (RECOVERY_GAP >> TOKENS_PER_MS_BITS) + 1


def term_floor(now_hlc: int, max_clock_offset_ms: int) -> int:
    """The HLC whose token ceiling a new term's first grant on each record reaches
    (``admission.next_token``'s era floor): above every token an earlier term can
    have granted. An earlier decider stopped deciding before its lease could have
    expired at etcd, so before this term began; the tokens it granted are below the
    ceiling of its HLC then (the era assumption: fewer than 2**10 grants of one
    record in a millisecond), or, on a record whose holder was granted before it
    recovered from a lost disk, at most the recovery gap above that ceiling
    (``fence + 1 + RECOVERY_GAP``): ``RECOVERY_GAP_MS`` more covers it. Its HLC was
    at most ``max_clock_offset_ms`` ahead of its wall clock (a peer's state further
    ahead is refused, ``intake.check_clock``), and its wall clock at most that far
    ahead of this member's: twice the offset above this member's clock covers it."""
    return pack(physical_ms(now_hlc) + 2 * max_clock_offset_ms + RECOVERY_GAP_MS)


class GrantGate:
    """The node's one answer to "may I decide now, and which token comes next?"."""

    def __init__(
        self,
        storage: Storage,
        clock: HybridClock,
        *,
        region: str = "",
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._storage = storage
        self._clock = clock
        self._region = region
        self._monotonic = monotonic  # what ``tick`` times naps and the settle by
        self._node_id = storage.node_id
        meta = storage.meta
        self.owed = meta.get(CATCH_UP) == "owed"
        self.gap_owed = meta.get(GAP_OWED) == "1"
        self.recovered_hlc = int(meta.get(RECOVERED_HLC) or 0)
        # What the file remembers of its own clock; nothing of this life is in it yet.
        self.opened_hlc = storage.hlc_high
        # A file that holds writes had an earlier life, which the file may not fully
        # remember: this life's tokens start a new era, and it hears from its peers
        # before it decides. A brand-new file has no earlier life (its tokens start
        # at 1); a new, emptied or restored one owes the full catch-up instead.
        earlier = bool(self.opened_hlc)
        self.life_hlc = clock.now() if earlier else 0
        self.starting = earlier and not self.owed
        # This process drew the node id: no other process can have it, so no twin
        # of it can run, and its catch-up needs no settle (Replicator._settled). A
        # file that owes a catch-up and was opened, not created — a restored one,
        # one restarted before its catch-up ended, or a copy of either — settles.
        self.fresh = storage.minted
        self.rollbacks = 0  # states seen that prove the file forgot writes
        self.twins = 0  # peers' refusals saying another live process has this node id
        self.settled_at = 0.0  # monotonic: when a restart's settle ends, once known
        self.nap_s = 0.0  # a longer gap between ticks is a nap; 0 until ticking
        self.quiet_s = 0.0  # replication calls refused this long after a nap (``quiet``)
        self.woke_at = 0.0  # monotonic: when the latest nap was found
        self.naps = 0  # times this life found its event loop stood still (``tick``)
        self.napped = False  # ... and it is settling again since the latest
        self._ticked = 0.0  # monotonic time of the latest tick; 0 until ticking
        self._listeners: list[Callable[[], None]] = []
        self._nap_listeners: list[Callable[[], None]] = []
        # A member of a region of several: its part in the election (None: the
        # region's only node, which decides whenever the rest of the gate says so).
        self.role: Role | None = None
        self.term = 0  # the latest term this member decided in
        self.term_hlc = 0  # ... and its era floor (``term_floor``)

    @property
    def era_hlc(self) -> int:
        """The era floor of the next grant (``admission.next_token``'s ``life_hlc``):
        this life's, or the current term's, whichever is later."""
        return max(self.life_hlc, self.term_hlc)

    def new_term(self, term: int, max_clock_offset_ms: int) -> None:
        """This member became its region's decider in ``term``: its tokens start an
        era above every token of an earlier term (``term_floor``)."""
        self.term = term
        self.term_hlc = max(self.term_hlc, term_floor(self._clock.now(), max_clock_offset_ms))
        log.info("deciding for region %s in term %d", self._region, term)

    @property
    def deciding(self) -> bool:
        """Whether this node decides claims and admits writes now (as of the latest
        ``tick``: it is read from other threads too, by the metrics endpoint)."""
        return not (self.owed or self.starting) and (self.role is None or self.role.term() > 0)

    def tick(self) -> None:
        """The event loop runs: called every ``nap_s``/5 by the replicator, and before
        every decision (``check``, ``awake``), on the event loop's thread. A gap
        since the previous tick above ``nap_s`` is a nap — the process was paused
        or starved — after which the node settles with its peers again before it
        decides (a copy of it may have started meanwhile and settled unseen). A
        node without peers never ticks: no peer could tell it from a twin."""
        now = self._monotonic()
        if not self._ticked:
            return
        gap, self._ticked = now - self._ticked, now
        if gap > self.nap_s:
            self._napped(gap)

    def start_ticking(self, nap_s: float, quiet_s: float) -> None:
        """From now on a gap between ticks above ``nap_s`` is a nap, after which
        replication calls are refused for ``quiet_s`` (``quiet``)."""
        self.nap_s, self.quiet_s, self._ticked = nap_s, quiet_s, self._monotonic()

    def quiet(self) -> bool:
        """Whether this node just woke from a nap: for ``quiet_s`` it refuses the
        replication calls it is handed (``UNAVAILABLE``). As a *witness* it
        must: the calls that waited in its sockets while it slept are served in no
        particular order, and a settling copy's round answered before its
        original's heartbeat would count — a round that began ``settle_s`` after
        this node first answered the copy, with the original unheard. Refused,
        the copy starts its settle again from this node's next answer; by then
        the original has called again (it calls every ``heartbeat_s``)."""
        self.tick()
        return bool(self.woke_at) and self._monotonic() - self.woke_at < self.quiet_s

    def _napped(self, gap: float) -> None:
        self.naps += 1
        self.woke_at = self._monotonic()
        log.warning(
            "this process stood still for %.2f s (paused, suspended or starved of CPU):"
            " settling with its peers again before it decides claims",
            gap,
        )
        if self.owed and self.fresh:
            return  # deciding nothing until a complete pass, and no copy can run
        if not self.owed:
            self.starting, self.settled_at, self.napped = True, 0.0, True
        for listener in self._nap_listeners:
            listener()

    def mark(self) -> tuple[int, int]:
        """What ``awake`` compares after a decision: the naps so far, and the term."""
        return self.naps, self.role.term() if self.role is not None else 0

    def awake(self, mark: tuple[int, int]) -> None:
        """Raise :class:`NotServing` if this process napped since ``mark`` was read
        (``mark()``), or this member no longer decides in the term it decided in: a
        grant decided before a nap is not handed out after it — a copy may have
        granted the same claim meanwhile —, nor one whose decider stopped deciding
        while it was made durable (SPEC §10). The grant stays in the file and its
        lease lapses."""
        self.tick()
        naps, term = mark
        if self.naps != naps:
            raise NotServing(
                "this process stood still while it decided (paused or starved of CPU);"
                " it compares states with its peers again before it decides claims"
            )
        if self.role is not None and self.role.term() != term:
            raise NotServing(
                "this member stopped deciding for its region while it decided (its"
                " decider lease in doubt); ask again: the region's decider answers"
            )

    def check(self) -> None:
        """Raise :class:`NotServing` while catch-up is owed, or while a restarted (or
        napping: ``tick``) node waits for its first round with each peer; and, at a
        member of a region of several, unless it is the region's decider now
        (``Role.check``). A member that does not decide says so first — a redirect
        to the decider, or that nobody decides — whatever its own file owes: the
        call is not its to decide."""
        self.tick()
        if self.role is not None and not self.role.term():
            self.role.check()
        if self.owed:
            raise NotServing(
                "this node is catching up with its peers after starting on a new or"
                " restored data directory, or on one that lost writes: it decides no"
                " claims and no fenced writes until it has seen their states"
            )
        if self.starting:
            left = self.settled_at - self._monotonic()
            why = (
                "this process stood still (paused, or starved of CPU) and is comparing"
                " its states with its peers' again"
                if self.napped
                else "this node has just started and is comparing its states with its peers'"
            )
            raise NotServing(
                f"{why} before it decides claims and fenced writes (a few seconds at most)",
                retry_after_ms=int(left * 1000) + 50 if left > 0 else 0,
            )
        if self.role is not None:
            self.role.check()

    def on_owed(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` when a deciding node comes to owe a catch-up again
        (``rolled_back``): the replicator starts over, health stops serving claims."""
        self._listeners.append(listener)

    def on_nap(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` when a node napped (``tick``), unless it is fresh and
        owes its catch-up: the replicator settles with every peer again, health
        stops serving claims, and the restart's bounded wait (``waited``) begins
        again."""
        self._nap_listeners.append(listener)

    def forgets(self, remote: Record) -> bool:
        """Whether ``remote`` holds something this node's earlier life wrote and its
        file does not remember: a stamp of this node's, or a grant of this region,
        after the file's clock high-water mark and before this life began. Only a
        file that went back in time lacks its own earlier writes (a restored or new
        file has a new node id; a lost one owes a catch-up already). At a member of a
        region of several (a ``role``), the region's other members grant too, so only
        this node's own stamps count (a grant it made carries one: its attempt)."""
        if self.owed or not self.life_hlc:
            return False  # owing a catch-up already, or no earlier life to forget
        lost = range(self.opened_hlc + 1, self.life_hlc)
        if any(s.node == self._node_id and s.hlc in lost for s in remote.stamps()):
            return True
        if self.role is not None:
            return False
        grants = remote.fence.grants.values()
        return any(g.region == self._region and g.granted_hlc in lost for g in grants)

    async def rolled_back(self) -> None:
        """The file lost writes this node made (``forgets``): owe a complete pass with
        every peer and the recovery gap, durably, before the state that proved it is
        merged — as a node that lost its disk does. Once per life is enough: a catch-up
        merges everything the peers hold, and the gap puts every new token above the
        forgotten ones, so the proofs that arrive after it (states in flight, or that
        reached a peer late) are only counted — each would otherwise stop the node
        deciding again."""
        self.rollbacks += 1
        if self.rollbacks > 1:
            return
        await self._owe_again()

    async def twinned(self) -> None:
        """A peer refused this node's call: another live process calls with its node
        id (a twin: a copy of its data directory started twice,
        ``replication.lives``). Both may have decided on the same records apart, so
        owe a complete pass with every peer and the recovery gap, durably, as after
        a lost disk: the pass cannot end while the twin lives (every peer refuses
        both), and the gap then puts this node's next tokens above whatever the twin
        granted. Each refusal while deciding begins it anew; while owed, it is only
        counted."""
        self.twins += 1
        if self.owed:
            return
        await self._owe_again()

    async def _owe_again(self) -> None:
        """Owe a complete pass with every peer and the recovery gap, durably; tell
        the listeners (the replicator starts over, health stops serving claims)."""
        await self._storage.put_meta(GAP_OWED, "1")
        self.gap_owed = True
        await self._storage.put_meta(CATCH_UP, "owed")
        self.owed = True  # a restart's bounded wait, if any, is now a catch-up owed
        for listener in self._listeners:
            listener()

    def waited(self) -> bool:
        """A restarted node waited ``start_wait_s`` for its peers: it decides now,
        on its token era (``life_hlc``) alone. True if it was still waiting."""
        was, self.starting, self.napped = self.starting, False, False
        return was and not self.owed

    async def merging(self) -> None:
        """Before a peer's state is merged: while catch-up is owed, that state says
        the cluster is not brand new, so the recovery gap is owed too — durably,
        before the state itself is, so no restart can forget it."""
        if self.owed and not self.gap_owed:
            await self._storage.put_meta(GAP_OWED, "1")
            self.gap_owed = True

    async def caught_up(self) -> None:
        """A complete pass with every peer is done: decide again (above the gap if
        one is owed). The gap's mark is durable before the obligation ends."""
        self.starting = self.napped = False
        if not self.owed:
            return
        if self.gap_owed:
            self.recovered_hlc = self._clock.now()
            await self._storage.put_meta(RECOVERED_HLC, str(self.recovered_hlc))
        await self._storage.put_meta(CATCH_UP, "done")
        self.owed = False

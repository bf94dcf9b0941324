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
"""

from __future__ import annotations

from fencemark.node.crdt import HybridClock
from fencemark.node.rules.errors import NotServing
from fencemark.node.store.storage import Storage

CATCH_UP = "catch_up"  # meta: "owed" until a complete pass with every peer, then "done"
GAP_OWED = "gap_owed"  # meta: "1" once a peer held records while catch-up was owed
RECOVERED_HLC = "recovered_hlc"  # meta: grants below this HLC are of an earlier life


class GrantGate:
    """The node's one answer to "may I decide now, and which token comes next?"."""

    def __init__(self, storage: Storage, clock: HybridClock) -> None:
        self._storage = storage
        self._clock = clock
        meta = storage.meta
        self.owed = meta.get(CATCH_UP) == "owed"
        self.gap_owed = meta.get(GAP_OWED) == "1"
        self.recovered_hlc = int(meta.get(RECOVERED_HLC) or 0)

    @property
    def deciding(self) -> bool:
        """Whether this node decides claims and admits writes now."""
        return not self.owed

    def check(self) -> None:
        """Raise :class:`NotServing` while catch-up is owed."""
        if self.owed:
            raise NotServing(
                "this node is catching up with its peers after starting on a new or"
                " restored data directory: it decides no claims and no fenced writes"
                " until it has seen their states"
            )

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
        if not self.owed:
            return
        if self.gap_owed:
            self.recovered_hlc = self._clock.now()
            await self._storage.put_meta(RECOVERED_HLC, str(self.recovered_hlc))
        await self._storage.put_meta(CATCH_UP, "done")
        self.owed = False

"""The claim state of a record: grants, lease expiries, released and lapsed tokens.

Five lattices side by side, each with an obvious join:

- ``grants``: token -> ``Grant``, merged by union. A token is granted once, by
  one region, so two replicas never disagree on an entry; if they ever do, the
  larger ``Grant`` (by ``granted_hlc`` first) wins so the join stays a join.
- ``lease_expiry``: token -> expiry (wall-clock ms, decided by the home node),
  merged by maximum. A renewal can only extend a lease.
- ``released``: a grow-only set of tokens.
- ``lapsed``: a grow-only set of tokens whose lease the home saw run out. Only the
  home decides that a lease has lapsed (a renewal may not have reached anyone
  else yet); recording it readmits unfenced writes on every node (SPEC §4).
- ``moved``: a max-register, the token the home moved the fence to without
  granting it — past every token either side issued when two births of one
  record meet (docs/consistency.md, *Two births*).
- ``seals``: token -> the signature of the node that ended that token's claim
  (released it, or recorded its lapse), merged by maximum; ``moved_signature``,
  the home's signature of the move, goes with ``moved`` (the larger move's; of
  one move, the larger signature).
- ``lease_seals``: token -> ``(expiry, signature)`` of the node that decides the
  claim, over that expiry of its lease, merged by maximum (the later expiry's; of
  one expiry, the larger signature).

The *fence* is the largest of ``moved`` and every granted token (0 when none);
it only ever grows. A claim is live when the fence is a granted token, not
released, not lapsed, and ``now < lease_expiry[fence]`` (SPEC §3).

Only the fence's grant carries a signature (``Grant.signature``, the home's, made
with its node key: docs/security.md, *Signed grants*), and only the fence token's
end a seal (*Signed writes*) and its lease's latest expiry a lease seal. A grant
below the fence can never become the fence again, so its signature would protect
nothing; ``_compact`` strips it, and drops the seals and lease seals of tokens
below the fence. Stripping after every join is still a join:
whether a grant keeps its signature (a token its seal) depends only on the tokens
of the join, and a side's own fence grant keeps its signature on that side
(tests/test_crdt_laws.py checks the laws with signed grants, and with two
signatures of one grant).

History is bounded: a state keeps the entries of its ``HISTORY`` largest granted
tokens and folds away everything below them (``_compact``). Every rule only
looks at the fence token, so nothing observable changes, but an item claimed
every minute for a year no longer carries half a million grants. Compacting
after every join is still a join: the floor of ``a ⊔ b`` is the ``HISTORY``-th
largest token of both sides' grants, which every entry the join keeps already
clears on its own side (docs/architecture.md, *The fence keeps a bounded
history*; tests/test_crdt_laws.py checks the laws on long claim histories).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import NamedTuple

from fencemark.node.crdt.lww import merge_maps

# Grants kept per record (the latest ones); older tokens are superseded forever
# whether or not their entries are kept. Part of the CRDT: every node must agree.
HISTORY = 16


class Grant(NamedTuple):
    """Who was granted a token, where and when (HLC of the home node), and the home's
    signature over that (``b""``: unsigned, or stripped below the fence).
    ``identity`` is the client identity the grant was made to under mutual TLS
    (``""``: none recorded)."""

    granted_hlc: int
    owner: str
    region: str
    signature: bytes = b""
    identity: str = ""


@dataclass(frozen=True)
class FenceState:
    grants: Mapping[int, Grant] = field(default_factory=dict)
    lease_expiry: Mapping[int, int] = field(default_factory=dict)
    released: frozenset[int] = frozenset()
    lapsed: frozenset[int] = frozenset()
    moved: int = 0
    seals: Mapping[int, bytes] = field(default_factory=dict)
    moved_signature: bytes = b""
    lease_seals: Mapping[int, tuple[int, bytes]] = field(default_factory=dict)

    # -- lattice --------------------------------------------------------------

    def merge(self, other: FenceState) -> FenceState:
        moved, moved_signature = max(
            (self.moved, self.moved_signature), (other.moved, other.moved_signature)
        )
        return FenceState(
            grants=merge_maps(self.grants, other.grants, max),
            lease_expiry=merge_maps(self.lease_expiry, other.lease_expiry, max),
            released=self.released | other.released,
            lapsed=self.lapsed | other.lapsed,
            moved=moved,
            seals=merge_maps(self.seals, other.seals, max),
            moved_signature=moved_signature,
            lease_seals=merge_maps(self.lease_seals, other.lease_seals, max),
        )._compact()

    def floor(self) -> int:
        """The smallest token whose entries this state keeps (0: all of them):
        the ``HISTORY``-th largest granted token, once there are that many."""
        if len(self.grants) < HISTORY:
            return 0
        return sorted(self.grants)[-HISTORY]

    def _compact(self) -> FenceState:
        """Drop the entries of tokens below the ``HISTORY`` latest grants, the
        signatures of grants below the fence and the seals of tokens below it."""
        floor = self.floor()
        fence = self.fence
        stale = any(g.signature for t, g in self.grants.items() if t != fence)
        stale = stale or any(t != fence for t in self.seals)
        stale = stale or any(t != fence for t in self.lease_seals)
        if not floor and not stale:
            return self
        grants = {
            t: g._replace(signature=b"") if g.signature and t != fence else g
            for t, g in self.grants.items()
            if t >= floor
        }
        seals = {t: sig for t, sig in self.seals.items() if t == fence}
        leases = {t: seal for t, seal in self.lease_seals.items() if t == fence}
        if not floor:
            return replace(self, grants=grants, seals=seals, lease_seals=leases)
        return replace(
            self,
            grants=grants,
            lease_expiry={t: e for t, e in self.lease_expiry.items() if t >= floor},
            released=frozenset(t for t in self.released if t >= floor),
            lapsed=frozenset(t for t in self.lapsed if t >= floor),
            seals=seals,
            lease_seals=leases,
        )

    # -- value ----------------------------------------------------------------

    @cached_property  # read several times per decision; a state never changes
    def fence(self) -> int:
        """The largest token ever granted or moved to; 0 when none."""
        return max(max(self.grants, default=0), self.moved)

    def holder(self) -> Grant | None:
        """The grant of the current fence token, if any (none once the fence moved)."""
        return self.grants.get(self.fence)

    def ended(self, token: int) -> bool:
        """Whether ``token``'s claim was released or seen to lapse by its home."""
        return token in self.released or token in self.lapsed

    def unreleased(self) -> bool:
        """Whether the fence is a grant that nobody has released and the home has
        not seen lapse: a claim that may still be live, as far as anyone but the
        home can tell (SPEC §4)."""
        fence = self.fence
        return fence in self.grants and fence not in self.released and fence not in self.lapsed

    def expiry(self, token: int) -> int:
        """When ``token``'s lease lapses (ms); 0 if it never had one."""
        return self.lease_expiry.get(token, 0)

    def is_live(self, now_ms: int) -> bool:
        return self.unreleased() and now_ms < self.expiry(self.fence)

    # -- updates (each an inflation: merge(old, new) == new) --------------------

    def grant(self, token: int, grant: Grant, expiry_ms: int) -> FenceState:
        if token <= self.fence:
            raise ValueError(f"token {token} is not above the fence {self.fence}")
        # max(): a merge may already have brought a later expiry for this token.
        return replace(
            self,
            grants={**self.grants, token: grant},
            lease_expiry={**self.lease_expiry, token: max(expiry_ms, self.expiry(token))},
        )._compact()

    def signed(self, signature: bytes) -> FenceState:
        """The fence's grant with ``signature`` (the home signs what it granted)."""
        holder = self.holder()
        if holder is None:
            raise ValueError("no grant to sign")
        if holder.signature == signature:
            return self
        if signature < holder.signature:
            raise ValueError("a signature smaller than the grant's own would not be an inflation")
        grants = {**self.grants, self.fence: holder._replace(signature=signature)}
        return replace(self, grants=grants)

    def sealed(self, signature: bytes) -> FenceState:
        """The fence token's end (its release or lapse) with ``signature``, of the
        node that ended it (docs/security.md, *Signed writes*)."""
        fence = self.fence
        if not self.ended(fence):
            raise ValueError(f"token {fence}'s claim has not ended")
        if signature <= self.seals.get(fence, b""):
            return self
        return replace(self, seals={**self.seals, fence: signature})

    def lease_sealed(self, signature: bytes) -> FenceState:
        """The fence token's lease, at its current expiry, with ``signature``, of the
        node that decides the claim (docs/security.md, *Signed writes*)."""
        fence = self.fence
        if fence not in self.grants:
            raise ValueError(f"token {fence} was never granted")
        seal = (self.expiry(fence), signature)
        if seal <= self.lease_seals.get(fence, (0, b"")):
            return self
        return replace(self, lease_seals={**self.lease_seals, fence: seal})

    def lease_seal(self) -> bytes:
        """The signature over the fence token's current expiry (b"": none)."""
        fence = self.fence
        expiry, signature = self.lease_seals.get(fence, (0, b""))
        return signature if expiry == self.expiry(fence) and expiry else b""

    def move_signed(self, signature: bytes) -> FenceState:
        """The move with ``signature``, the home's."""
        if not self.moved:
            raise ValueError("the fence was never moved")
        if signature <= self.moved_signature:
            return self
        return replace(self, moved_signature=signature)

    def extend(self, token: int, expiry_ms: int) -> FenceState:
        """Move ``token``'s expiry to ``expiry_ms`` unless it is already later."""
        if expiry_ms <= self.expiry(token) or token not in self.grants:
            return self  # (tokens below the floor are folded away with their grants)
        return replace(self, lease_expiry={**self.lease_expiry, token: expiry_ms})

    def release(self, token: int) -> FenceState:
        if token in self.released or token not in self.grants:
            return self
        return replace(self, released=self.released | {token})

    def lapse(self, token: int) -> FenceState:
        """Record that ``token``'s lease ran out (the home's decision)."""
        if token in self.lapsed or token not in self.grants:
            return self
        return replace(self, lapsed=self.lapsed | {token})

    def move(self, token: int) -> FenceState:
        """Move the fence to ``token`` without granting it: every token below is
        superseded, and the next grant is ``token + 1``. The fence's grant, if it
        was signed, keeps its signature only while it is the fence (``_compact``)."""
        if token <= self.moved:
            return self
        return replace(self, moved=token, moved_signature=b"")._compact()

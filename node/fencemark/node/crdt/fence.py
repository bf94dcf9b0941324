"""The claim state of a record: grants, lease expiries and released tokens.

Three lattices side by side, each with an obvious join:

- ``grants``: token -> ``Grant``, merged by union. A token is granted once, by
  one region, so two replicas never disagree on an entry; if they ever do, the
  larger ``Grant`` (by ``granted_hlc`` first) wins so the join stays a join.
- ``lease_expiry``: token -> expiry (wall-clock ms, decided by the home node),
  merged by maximum. A renewal can only extend a lease.
- ``released``: a grow-only set of tokens.

The *fence* is the largest granted token (0 when none); it only ever grows.
A claim is live when ``fence > 0``, ``fence`` is not released and
``now < lease_expiry[fence]`` (SPEC §3).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from fencemark.node.crdt.lww import merge_maps


class Grant(NamedTuple):
    """Who was granted a token, where and when (HLC of the home node)."""

    granted_hlc: int
    owner: str
    region: str


@dataclass(frozen=True)
class FenceState:
    grants: Mapping[int, Grant] = field(default_factory=dict)
    lease_expiry: Mapping[int, int] = field(default_factory=dict)
    released: frozenset[int] = frozenset()

    # -- lattice --------------------------------------------------------------

    def merge(self, other: FenceState) -> FenceState:
        return FenceState(
            grants=merge_maps(self.grants, other.grants, max),
            lease_expiry=merge_maps(self.lease_expiry, other.lease_expiry, max),
            released=self.released | other.released,
        )

    # -- value ----------------------------------------------------------------

    @property
    def fence(self) -> int:
        """The largest token ever granted; 0 when none."""
        return max(self.grants, default=0)

    def holder(self) -> Grant | None:
        """The grant of the current fence token, if any."""
        return self.grants.get(self.fence)

    def expiry(self, token: int) -> int:
        """When ``token``'s lease lapses (ms); 0 if it never had one."""
        return self.lease_expiry.get(token, 0)

    def is_live(self, now_ms: int) -> bool:
        fence = self.fence
        return fence > 0 and fence not in self.released and now_ms < self.expiry(fence)

    # -- updates (each an inflation: merge(old, new) == new) --------------------

    def grant(self, token: int, grant: Grant, expiry_ms: int) -> FenceState:
        if token <= self.fence:
            raise ValueError(f"token {token} is not above the fence {self.fence}")
        # max(): a merge may already have brought a later expiry for this token.
        return FenceState(
            grants={**self.grants, token: grant},
            lease_expiry={**self.lease_expiry, token: max(expiry_ms, self.expiry(token))},
            released=self.released,
        )

    def extend(self, token: int, expiry_ms: int) -> FenceState:
        """Move ``token``'s expiry to ``expiry_ms`` unless it is already later."""
        if expiry_ms <= self.expiry(token):
            return self
        return FenceState(
            grants=self.grants,
            lease_expiry={**self.lease_expiry, token: expiry_ms},
            released=self.released,
        )

    def release(self, token: int) -> FenceState:
        if token in self.released:
            return self
        return FenceState(self.grants, self.lease_expiry, self.released | {token})

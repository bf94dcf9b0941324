"""What a node refuses to merge, whoever sends it (SPEC §5; issue 7, state integrity).

A replicated fence is only as safe as what may be merged into it: one forged grant
with a huge token would supersede every holder of a record, forever. Before a
remote state is joined into the local one, :func:`check` holds it against rules
that every state the cluster really wrote satisfies, so a refusal never blocks a
legitimate state (and so never stops convergence):

- ``epoch_beyond_fence``: a stamp's epoch is the fence its writer knew, and the
  writer's state holds that grant; an epoch above the state's own fence would let a
  write outrank every later one;
- a record's births are not refused: two regions may create one key while cut off
  from each other, the earliest birth is the home everywhere, and the home moves
  the fence past every claim either side granted (SPEC §2, ``Replica.merge``);
- ``grant_outside_home``: every grant names the region that made it, and only a
  region that created the record grants (the home; another birth region only
  while the two births were apart);
- ``token_jump``: a home grants ``fence + 1``, or once after a disk loss a recovery
  floor (``admission.next_token``): at most ``RECOVERY_GAP`` above the fence it
  learnt, or the ceiling of the grant's own millisecond (``token_ceiling``). A token
  further than ``max_token_jump`` above both the grant below it and that ceiling was
  never granted;
- ``lease_too_long``: a lease expiry (new to this node) further ahead than the
  longest lease plus ``max_clock_offset``;
- ``orphan_token``: an expiry or a release for a token that no grant names;
- with TLS (a ``verifier``, ``fencemark.node.security.signing.Keyring``): the fence grant of
  the join, when it is not the one this node held, carries the signature of its
  region's node: ``unsigned_grant``, ``bad_signature``, ``signer_not_home``, or
  ``unknown_signer`` while the signing certificate is not known here (the caller
  fetches it from the sending peer first; a later exchange retries), or
  ``revoked_signer``. Grants below the fence carry no signature: they can never
  become the fence again, so they can raise nothing (``fence.py``). Likewise every
  birth the join holds that this node did not hold as it is carries the signature
  of the region it names (``unsigned_birth`` and the same reasons), so no node can
  claim for another region that it created a record — and earlier than its home;
  and every write the join holds at the epoch of an unreleased fence grant that this
  node did not hold as it is carries the signature of the home or of the grant's
  region (``unsigned_write`` and the same reasons): only they admit such a write, a
  fenced write of the holder, so no peer can overwrite or delete a live claim's
  record with a stamp at its epoch; likewise the end of the fence's claim (a
  release or a lapse, which readmits unfenced writes) carries the seal of the node
  that decided it (``unsigned_end``), and a move that is the fence the home's
  signature (``unsigned_move``) (docs/security.md, *Signed writes*).

Stamps further ahead than ``max_clock_offset`` are refused before this (the clock
check), and malformed states when they are decoded. What this does *not* stop is a
node running ``--insecure`` forging a grant that names the home, within the token
bound: without TLS nothing is signed, and only the bounds hold (docs/security.md).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from fencemark.node.crdt import Birth, Record
from fencemark.node.crdt.fence import HISTORY, Grant
from fencemark.node.crdt.record import DELETED, FIELD, Register
from fencemark.node.rules.admission import RECOVERY_GAP, split_tokens, token_ceiling
from fencemark.node.rules.errors import FencemarkError
from fencemark.node.rules.validation import MAX_LEASE_S

DEFAULT_MAX_TOKEN_JUMP = 2 * RECOVERY_GAP


class MergeRefused(FencemarkError):
    """A remote state this node will not merge; ``reason`` is machine-readable."""

    def __init__(self, key: str, reason: str, detail: str) -> None:
        self.key = key
        self.reason = reason
        self.detail = detail
        super().__init__(f"{key}: {reason}: {detail}")


@dataclass(frozen=True)
class Bounds:
    max_offset_ms: int
    max_token_jump: int = DEFAULT_MAX_TOKEN_JUMP
    max_lease_ms: int = round(MAX_LEASE_S * 1000)


class GrantVerifier(Protocol):
    def problem(self, record_key: str, token: int, grant: Grant) -> tuple[str, str] | None:
        """(reason, detail) when ``grant`` is not signed by its region's node."""

    def birth_problem(self, record_key: str, region: str, birth: Birth) -> tuple[str, str] | None:
        """(reason, detail) when ``region``'s ``birth`` is not signed by that region's node."""

    def write_problem(
        self, record_key: str, kind: str, name: str, register: Register, regions: Iterable[str]
    ) -> tuple[str, str] | None:
        """(reason, detail) when ``register`` is not signed by the node of one of ``regions``."""

    def end_problem(
        self, record_key: str, token: int, seal: bytes, regions: Iterable[str]
    ) -> tuple[str, str] | None:
        """(reason, detail) when ``token``'s end is not sealed by one of ``regions``."""

    def move_problem(
        self, record_key: str, token: int, signature: bytes, home: str
    ) -> tuple[str, str] | None:
        """(reason, detail) when the move of the fence to ``token`` is not ``home``'s."""


def check(
    local: Record,
    remote: Record,
    *,
    now_ms: int,
    bounds: Bounds,
    verifier: GrantVerifier | None = None,
) -> Record:
    """The merge of ``remote`` into ``local``, or :class:`MergeRefused`."""
    key = remote.key

    def refuse(reason: str, detail: str) -> MergeRefused:
        return MergeRefused(key, reason, detail)

    fence = remote.fence.fence
    for stamp in remote.stamps():
        if stamp.epoch > fence:
            raise refuse("epoch_beyond_fence", f"a stamp of epoch {stamp.epoch} > fence {fence}")

    merged = local.merge(remote)
    home = merged.home_region
    births = merged.births
    # Grants the join keeps that were not here before (older ones it folds away
    # below its floor can supersede nothing, forged or not).
    new = {
        t: g
        for t, g in remote.fence.grants.items()
        if t not in local.fence.grants and t in merged.fence.grants
    }
    # Most merges bring field writes, not grants: sort the tokens only when needed.
    grants = sorted(merged.fence.grants) if new else []
    for token, grant in new.items():
        if grant.region not in births:
            raise refuse("grant_outside_home", f"token {token} granted by {grant.region!r}, "
                                               f"home is {home!r}")  # fmt: skip
        if grants[0] < token:
            below = grants[bisect.bisect_left(grants, token) - 1]
        elif local.fence.fence or len(remote.fence.grants) < HISTORY:
            below = local.fence.fence
        else:
            # The lowest grant of a folded history, for a record this node has
            # no grant of: nothing to measure its jump from (docs/security.md).
            continue
        ceiling = token_ceiling(grant.granted_hlc)
        if token - below > bounds.max_token_jump and token - ceiling > bounds.max_token_jump:
            above = f"{token - below} above token {below}, {token - ceiling} above its time's"
            raise refuse(
                "token_jump", f"token {token} is {above} (at most {bounds.max_token_jump})"
            )

    if verifier is not None:
        # Every birth this node did not hold as it is: the region that made it signed
        # it, so no other node can claim an earlier birth for it (SPEC §4).
        for region, birth in births.items():
            if local.births.get(region) != birth:
                problem = verifier.birth_problem(key, region, birth)
                if problem is not None:
                    raise refuse(*problem)
        top = merged.fence.fence
        holder = merged.fence.grants.get(top)
        if holder is not None and holder != local.fence.grants.get(top):
            # A fence grant this node did not hold (a new one, or another version of
            # its own): only the home's signature lets it raise the fence.
            if holder.region not in births:
                where = f"token {top} granted by {holder.region!r}, home is {home!r}"
                raise refuse("grant_outside_home", where)
            problem = verifier.problem(key, top, holder)
            if problem is not None:
                raise refuse(*problem)
        # Who decides the fence's claim, and so writes at its epoch and ends it: the
        # home, and the region that made the grant. While the fence is a claim of a
        # split that the home has not moved past yet, any birth region: each side
        # may have granted this very token apart, and the join kept one grant of it
        # (the chaos tier, under TLS, seed 424242) — the home moves past it at once.
        deciders = set(births) if split_tokens(merged) else {home}
        if holder is not None:
            deciders.add(holder.region)
        ended = holder is not None and merged.fence.ended(top)
        if holder is not None and ended and not local.fence.ended(top):
            # The end of the fence's claim: only the node that decides it releases a
            # claim or records its lapse, and either readmits unfenced writes everywhere.
            regions = deciders
            seal = merged.fence.seals.get(top, b"")
            problem = verifier.end_problem(key, top, seal, regions)
            if problem is not None:
                raise refuse(*problem)
        moved = merged.fence.moved
        if moved == top and moved > local.fence.moved:
            # A move that is the fence: only the home moves it (``Replica.merge``).
            problem = verifier.move_problem(key, moved, merged.fence.moved_signature, home)
            if problem is not None:
                raise refuse(*problem)
        if holder is not None and merged.fence.unreleased():
            # Writes at the epoch of an unreleased grant: only a node that decides
            # the claim admits one, as a fenced write of the holder, and signs it
            # (SPEC §4).
            regions = deciders
            for kind, name, register in merged.registers():
                if register.stamp.epoch == top and register != _register(local, kind, name):
                    problem = verifier.write_problem(key, kind, name, register, regions)
                    if problem is not None:
                        raise refuse(*problem)

    moved = remote.fence.moved
    if moved > local.fence.fence:
        # The home moved the fence past the claims of two births (SPEC §2): by one
        # token above them, so no further than a grant may jump.
        below = max((t for t in merged.fence.grants if t < moved), default=local.fence.fence)
        if moved - below > bounds.max_token_jump:
            jump = f"the fence moved to {moved}, {moved - below} above token {below}"
            raise refuse("token_jump", f"{jump} (at most {bounds.max_token_jump})")

    latest = now_ms + bounds.max_lease_ms + bounds.max_offset_ms

    def named(token: int) -> bool:
        return token in remote.fence.grants or token in local.fence.grants

    for token, expiry in remote.fence.lease_expiry.items():
        if not named(token):
            raise refuse("orphan_token", f"a lease expiry for token {token}, which no grant names")
        if expiry > local.fence.expiry(token) and expiry > latest:
            raise refuse("lease_too_long", f"token {token}'s lease ends {expiry - now_ms} ms"
                                           " from now")  # fmt: skip
    for token in remote.fence.released - local.fence.released:
        if not named(token):
            raise refuse("orphan_token", f"a release of token {token}, which no grant names")
    for token in remote.fence.lapsed - local.fence.lapsed:
        if not named(token):
            raise refuse("orphan_token", f"a lapse of token {token}, which no grant names")
    return merged


def _register(record: Record, kind: str, name: str) -> Register | None:
    """``record``'s register of ``kind`` and ``name`` (``Record.registers``), if any."""
    if kind == FIELD:
        return record.fields.get(name)
    if kind == DELETED:
        return record.deleted
    return record.tags.get(name)

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
  the fence past every claim either side granted (SPEC §2, ``Replica.merge``).
  But a birth of a region that had *seen* the record (``Record.seen``: it held a
  claim granted on it, born elsewhere) is void — never the home, never a creator:
  such a region could not have created it. The join keeps it, as signed evidence
  against that region, so every replica computes one home from one state; the
  merge reports it (:func:`voided_births`, ``seen_before_birth``), counted and
  alerted like a refusal;
- ``grant_outside_home``: every grant names the region that made it, and only a
  region that created the record grants (the home; another birth region only
  while the two births were apart; never one whose birth is void);
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
  that decided it (``unsigned_end``), the expiry of its lease, while it is not
  ended, the seal of a node that decides it (``unsigned_lease``: no peer keeps a
  lapsed claim alive), and a move that is the fence the home's signature
  (``unsigned_move``); and every work-queue register new to this node
  carries the signature of a region that created the record (``unsigned_write``)
  (docs/security.md, *Signed writes*).

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
from fencemark.node.crdt.record import DELETED, FIELD, QUEUE, Register
from fencemark.node.rules.admission import RECOVERY_GAP, split_tokens, token_ceiling
from fencemark.node.rules.errors import FencemarkError
from fencemark.node.rules.validation import MAX_LEASE_S

DEFAULT_MAX_TOKEN_JUMP = 2 * RECOVERY_GAP
SEEN_BEFORE_BIRTH = "seen_before_birth"


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

    def birth_problem(
        self, record_key: str, region: str, birth: Birth, *, takes_home: bool = False
    ) -> tuple[str, str] | None:
        """(reason, detail) when ``region``'s ``birth`` is not signed by that region's
        node (or, when it ``takes_home`` from another region's, by a revoked key)."""

    def seen_problem(self, record_key: str, region: str, seen: Birth) -> tuple[str, str] | None:
        """(reason, detail) when ``region``'s sighting is not signed by that region's node."""

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

    def lease_problem(
        self, record_key: str, token: int, expiry_ms: int, seal: bytes, regions: Iterable[str]
    ) -> tuple[str, str] | None:
        """(reason, detail) when ``token``'s lease to ``expiry_ms`` is not sealed by
        the node of one of ``regions``."""


def check(
    local: Record,
    remote: Record,
    *,
    now_ms: int,
    bounds: Bounds,
    verifier: GrantVerifier | None = None,
) -> Record:
    """The merge of ``remote`` into ``local``, or :class:`MergeRefused`: each rule of
    the module docstring in turn, the first one broken refusing the whole state."""
    _check_epochs(remote)
    join = _Join(local, remote, local.merge(remote))
    join.check_grants(bounds)
    join.check_leases(bounds, now_ms)
    if verifier is not None:
        join.check_births(verifier)
        join.check_seen(verifier)
        join.check_fence_grant(verifier)
        join.check_end(verifier)
        join.check_lease(verifier)
        join.check_move_signature(verifier)
        join.check_writes(verifier)
        join.check_queue(verifier)
    join.check_move(bounds)
    return join.merged


def voided_births(local: Record, merged: Record) -> list[MergeRefused]:
    """The births of ``merged`` that are void (their region had seen the record:
    ``Record.seen``) and were not void in ``local`` — a birth new here, or one a
    sighting new here voids: what the merge reports as ``seen_before_birth``."""
    out = []
    for region in sorted(merged.births):
        if region in merged.creators:
            continue
        if local.births.get(region) == merged.births[region] and region not in local.creators:
            continue  # void here already
        seen, birth = merged.seen[region].stamp, merged.births[region].stamp
        out.append(MergeRefused(merged.key, SEEN_BEFORE_BIRTH, (
            f"region {region!r} claims a birth at {tuple(birth)}, but it had seen the record"
            f" born in {merged.home_region!r} (its sighting at {tuple(seen)}): the birth is"
            " void, kept as evidence against that region"
        )))  # fmt: skip
    return out


def _check_epochs(remote: Record) -> None:
    """``epoch_beyond_fence``: a stamp's epoch is a fence its writer knew."""
    fence = remote.fence.fence
    for stamp in remote.stamps():
        if stamp.epoch > fence:
            raise MergeRefused(
                remote.key, "epoch_beyond_fence", f"a stamp of epoch {stamp.epoch} > fence {fence}"
            )


@dataclass(frozen=True)
class _Join:
    """A remote state, this node's, and their join: what each rule looks at."""

    local: Record
    remote: Record
    merged: Record

    def refuse(self, reason: str, detail: str) -> MergeRefused:
        return MergeRefused(self.remote.key, reason, detail)

    @property
    def top(self) -> int:
        return self.merged.fence.fence

    @property
    def holder(self) -> Grant | None:
        return self.merged.fence.grants.get(self.top)

    def check_grants(self, bounds: Bounds) -> None:
        """``grant_outside_home`` for every grant of the join this node did not hold
        as it is; ``token_jump`` for every new one."""
        local, merged = self.local.fence, self.merged.fence
        creators = self.merged.creators
        for token, grant in merged.grants.items():
            if grant != local.grants.get(token) and grant.region not in creators:
                home = self.merged.home_region
                raise self.refuse("grant_outside_home", f"token {token} granted by"
                                  f" {grant.region!r}, home is {home!r}")  # fmt: skip
        # Grants the join keeps that were not here before (older ones it folds away
        # below its floor can supersede nothing, forged or not).
        new = {t: g for t, g in self.remote.fence.grants.items() if t not in local.grants}
        new = {t: g for t, g in new.items() if t in merged.grants}
        # Most merges bring field writes, not grants: sort the tokens only when needed.
        grants = sorted(merged.grants) if new else []
        for token, grant in new.items():
            if grants[0] < token:
                below = grants[bisect.bisect_left(grants, token) - 1]
            elif local.fence or len(self.remote.fence.grants) < HISTORY:
                below = local.fence
            else:
                # The lowest grant of a folded history, for a record this node has
                # no grant of: nothing to measure its jump from (docs/security.md).
                continue
            ceiling = token_ceiling(grant.granted_hlc)
            jump = bounds.max_token_jump
            if token - below > jump and token - ceiling > jump:
                above = f"{token - below} above token {below}, {token - ceiling} above its time's"
                raise self.refuse("token_jump", f"token {token} is {above} (at most {jump})")

    def check_births(self, verifier: GrantVerifier) -> None:
        """Every birth this node did not hold as it is: the region that made it
        signed it, so no other node can claim an earlier birth for it (SPEC §4);
        and one that would take the home from another region's birth is not signed by
        a revoked key (SPEC §2: a revoked key moves no record away from its home)."""
        local, merged = self.local, self.merged
        for region, birth in merged.births.items():
            if local.births.get(region) != birth:
                takes_home = (
                    bool(local.births)
                    and merged.home_region == region
                    and local.home_region != region
                )
                problem = verifier.birth_problem(
                    self.remote.key, region, birth, takes_home=takes_home
                )
                if problem is not None:
                    raise self.refuse(*problem)

    def check_seen(self, verifier: GrantVerifier) -> None:
        """Every sighting this node did not hold as it is: signed by its region, so
        no node can void another region's birth (a sighting only holds against the
        region that made it)."""
        local = self.local.seen
        for region, seen in self.merged.seen.items():
            if local.get(region) != seen:
                problem = verifier.seen_problem(self.remote.key, region, seen)
                if problem is not None:
                    raise self.refuse(*problem)

    def check_fence_grant(self, verifier: GrantVerifier) -> None:
        """A fence grant this node did not hold (a new one, or another version of
        its own): only its region's signature lets it raise the fence."""
        holder = self.holder
        if holder is not None and holder != self.local.fence.grants.get(self.top):
            problem = verifier.problem(self.remote.key, self.top, holder)
            if problem is not None:
                raise self.refuse(*problem)

    def deciders(self, holder: Grant) -> set[str]:
        """Who decides the fence's claim, and so writes at its epoch and ends it: the
        home, and the region that made the grant. While the fence is a claim of a
        split that the home has not moved past yet, any birth region: each side may
        have granted this very token apart, and the join kept one grant of it (the
        chaos tier, under TLS, seed 424242); the home moves past it at once."""
        merged = self.merged
        deciders = set(merged.creators) if split_tokens(merged) else {merged.home_region}
        return deciders | {holder.region}

    def check_end(self, verifier: GrantVerifier) -> None:
        """The end of the fence's claim (a release or a lapse, which readmits
        unfenced writes everywhere) carries the seal of a node that decides it."""
        fence, top, holder = self.merged.fence, self.top, self.holder
        if holder is None or not fence.ended(top) or self.local.fence.ended(top):
            return
        seal = fence.seals.get(top, b"")
        problem = verifier.end_problem(self.remote.key, top, seal, self.deciders(holder))
        if problem is not None:
            raise self.refuse(*problem)

    def check_lease(self, verifier: GrantVerifier) -> None:
        """The lease of an unreleased fence claim, new here (its expiry or its seal):
        sealed at exactly its expiry by a node that decides the claim, so no peer can
        keep a lapsed claim alive or lengthen a live one (a renewal is the home's)."""
        merged, local, top, holder = self.merged.fence, self.local.fence, self.top, self.holder
        if holder is None or not merged.unreleased():
            return
        if (merged.expiry(top), merged.lease_seals.get(top)) == (
            local.expiry(top),
            local.lease_seals.get(top),
        ):
            return
        problem = verifier.lease_problem(
            self.remote.key, top, merged.expiry(top), merged.lease_seal(), self.deciders(holder)
        )
        if problem is not None:
            raise self.refuse(*problem)

    def check_move_signature(self, verifier: GrantVerifier) -> None:
        """A move that is the fence: only the home moves it (``Replica.merge``)."""
        fence = self.merged.fence
        if fence.moved == self.top and fence.moved > self.local.fence.moved:
            home = self.merged.home_region
            problem = verifier.move_problem(
                self.remote.key, fence.moved, fence.moved_signature, home
            )
            if problem is not None:
                raise self.refuse(*problem)

    def check_writes(self, verifier: GrantVerifier) -> None:
        """Writes at the epoch of an unreleased grant: only a node that decides the
        claim admits one, as a fenced write of the holder, and signs it (SPEC §4)."""
        holder = self.holder
        if holder is None or not self.merged.fence.unreleased():
            return
        top, deciders = self.top, self.deciders(holder)
        for kind, name, register in self.merged.registers():
            if register.stamp.epoch == top and register != _register(self.local, kind, name):
                problem = verifier.write_problem(self.remote.key, kind, name, register, deciders)
                if problem is not None:
                    raise self.refuse(*problem)

    def check_queue(self, verifier: GrantVerifier) -> None:
        """Work-queue registers (status, attempts, ...) new to this node: only a
        region that created the record writes them, and signs them (SPEC §8), so no
        peer can mark an item done, reopen it or park it."""
        creators = self.merged.creators
        for name, register in self.merged.queue.items():
            if register != self.local.queue.get(name):
                problem = verifier.write_problem(self.remote.key, QUEUE, name, register, creators)
                if problem is not None:
                    raise self.refuse(*problem)

    def check_move(self, bounds: Bounds) -> None:
        """``token_jump`` for a move: the home moves the fence past the claims of two
        births by one token above them, so no further than a grant may jump."""
        moved, local = self.remote.fence.moved, self.local.fence
        if moved <= local.fence:
            return
        below = max((t for t in self.merged.fence.grants if t < moved), default=local.fence)
        if moved - below > bounds.max_token_jump:
            jump = f"the fence moved to {moved}, {moved - below} above token {below}"
            raise self.refuse("token_jump", f"{jump} (at most {bounds.max_token_jump})")

    def check_leases(self, bounds: Bounds, now_ms: int) -> None:
        """``orphan_token`` for an expiry, a release or a lapse no grant names;
        ``lease_too_long`` for an expiry new here beyond the longest lease."""
        remote, local = self.remote.fence, self.local.fence
        latest = now_ms + bounds.max_lease_ms + bounds.max_offset_ms

        def named(token: int) -> bool:
            return token in remote.grants or token in local.grants

        for token, expiry in remote.lease_expiry.items():
            if not named(token):
                raise self.refuse(
                    "orphan_token", f"a lease expiry for token {token}, which no grant names"
                )
            if expiry > local.expiry(token) and expiry > latest:
                raise self.refuse(
                    "lease_too_long", f"token {token}'s lease ends {expiry - now_ms} ms from now"
                )
        for what, tokens in (("release", remote.released - local.released),
                             ("lapse", remote.lapsed - local.lapsed)):  # fmt: skip
            for token in tokens:
                if not named(token):
                    raise self.refuse(
                        "orphan_token", f"a {what} of token {token}, which no grant names"
                    )


def _register(record: Record, kind: str, name: str) -> Register | None:
    """``record``'s register of ``kind`` and ``name`` (``Record.registers``), if any."""
    if kind == FIELD:
        return record.fields.get(name)
    if kind == DELETED:
        return record.deleted
    if kind == QUEUE:
        return record.queue.get(name)
    return record.tags.get(name)

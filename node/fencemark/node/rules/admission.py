"""What a node accepts: every rule of SPEC §4, and only here.

Pure functions of a record's state, the caller (its token and, under mutual
TLS, its identity) and the node's wall clock. They decide; they never read
storage, stamp, or know about gRPC. docs/consistency.md states the guarantees
these rules add up to; docs/security.md (*Claims are bound to identities*) the
identity rule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from fencemark.node.crdt import FenceState, Grant, Record
from fencemark.node.crdt.hlc import physical_ms
from fencemark.node.rules.errors import (
    ACT_FOR_OTHERS,
    ClaimConflict,
    Denial,
    PermissionDenied,
    Reason,
    WrongRegion,
)

# A node that lost its disk grants its first token of each record this far above
# the fence it caught up to (docs/replication.md, catch-up): a grant of its
# earlier life that never reached a peer then stays below every new token.
RECOVERY_GAP = 1 << 20
# ... and at least at the recovery's wall-clock millisecond times 2**TOKENS_PER_MS_BITS
# (``recovery_floor``): a node that lost its disk twice must not land its second
# life's first token on a grant of its first life that never left that disk.
TOKENS_PER_MS_BITS = 10


def _never_rechecked() -> None:
    """A caller whose call is never re-authorized: a node without TLS knows no one."""


@dataclass(frozen=True)
class Caller:
    """Who asks, as far as claims care: a grant records the identity it was made to.

    ``identity`` is the caller's certificate identity (``client/alice``), ``""``
    on a node without TLS; ``acts_for_others`` is the access map's
    ``act-for-others`` right. ``still_allowed()`` raises ``PermissionDenied`` once
    the caller may no longer make the call it is in (its certificate revoked): a
    long-lived call asks it again at each hand-over — a grant to a caller that
    waited in line, each event of a watch (docs/security.md, *Long-lived calls*).
    """

    identity: str
    acts_for_others: bool = False
    still_allowed: Callable[[], None] = field(default=_never_rechecked, compare=False, repr=False)


# A node without TLS (--insecure) knows no identities: any caller may act on any
# claim there, so a token is a bearer credential (docs/security.md).
ANYONE = Caller("", acts_for_others=True)


def acts_for(caller: Caller, grant: Grant) -> bool:
    """Whether ``caller`` may use ``grant``'s token: renew, release or write with it,
    retry its claim by owner name, see it in ``ClaimStatus`` (SPEC §4: a token is
    not a bearer credential). A grant that records no identity (made without TLS,
    or before grants recorded one) binds no one."""
    return caller.acts_for_others or not grant.identity or grant.identity == caller.identity


def _check_holder(fence: FenceState, token: int, caller: Caller) -> None:
    """Refuse ``not_holder`` when ``token`` names a grant made to another identity.

    Only grants the record still remembers can be checked (its last ``HISTORY``);
    an older token is superseded anyway, and releasing it changes nothing.
    """
    grant = fence.grants.get(token)
    if grant is not None and not acts_for(caller, grant):
        raise PermissionDenied(
            Denial.NOT_HOLDER,
            f"fencing token {token} was granted to another identity than {caller.identity}:"
            f" only that identity (or one with the {ACT_FOR_OTHERS!r} right) may renew,"
            " release or write with it (docs/security.md)",
            identity=caller.identity,
            right=ACT_FOR_OTHERS,
        )


@dataclass(frozen=True)
class Outcome:
    """The answer to a claim, renewal or release: a value, never an error."""

    ok: bool
    reason: Reason | None = None
    token: int = 0
    expiry_ms: int = 0
    home_region: str = ""
    fence: int = 0


def token_problem(fence: FenceState, token: int, now_ms: int) -> Reason | None:
    """Why ``token`` is not the live claim, or None when it is."""
    current = fence.fence
    if token < current:
        return Reason.SUPERSEDED
    if token > current or token not in fence.grants:
        return Reason.UNKNOWN_TOKEN  # above the fence, or the fence was moved to it
    if token in fence.released:
        return Reason.RELEASED
    if token in fence.lapsed or now_ms >= fence.expiry(token):
        return Reason.EXPIRED
    return None


def require_home(home: str, region: str, *, fence: int, birth: bool) -> None:
    """Refuse ``wrong_region`` unless ``region`` is the record's ``home``.

    The one producer of the refusal: a new record's birth (``birth``, SPEC §2)
    and a fenced write (SPEC §4) both come here, so both reach the client in the
    same shape. Claims, renewals and releases answer the same word as a value
    (``not_here``): SPEC §4 makes their outcomes values, not errors.
    """
    if home != region:
        raise WrongRegion(home, region, fence=fence, birth=birth)


def admit_write(
    record: Record,
    token: int,
    *,
    caller: Caller,
    home: str,
    region: str,
    now_ms: int,
    deciding: bool = True,
) -> int:
    """Admit a write to ``record`` at ``region``'s node; return the epoch to stamp it with.

    Unfenced (token 0) at the home: refused ``claimed`` while the claim is live.
    Unfenced anywhere else: refused ``claimed`` while the record has an
    unreleased grant in this node's view — only the home decides that a lease
    has lapsed, because a renewal may not have arrived here yet. Otherwise it is
    admitted under the fence this node knows. Fenced: only the home region
    decides, only the live claim's token gets through, and only from the
    identity it was granted to (``not_holder``, ``acts_for``). A home that is not
    ``deciding`` (catching up: ``grant_gate``) takes unfenced writes by the rule
    of the other nodes; fenced ones it does not see at all.
    """
    fence = record.fence
    if token == 0:
        held = record.claim_live(now_ms) if home == region and deciding else fence.unreleased()
        if held:
            raise ClaimConflict(Reason.CLAIMED, fence=fence.fence, home_region=home)
        return fence.fence
    require_home(home, region, fence=fence.fence, birth=False)
    _check_holder(fence, token, caller)
    problem = token_problem(fence, token, now_ms)
    if problem is None and not record.claim_live(now_ms):
        problem = Reason.SUPERSEDED  # granted by another birth region: superseded at the meet
    if problem is not None:
        raise ClaimConflict(problem, fence=fence.fence, home_region=home)
    return token


def lapse_due(record: Record, region: str, now_ms: int) -> bool:
    """Whether ``region``'s node, the home, should record that the fence's lease
    lapsed: an unreleased grant of its own whose expiry has passed."""
    fence = record.fence
    holder = fence.holder()
    return (
        record.home_region == region
        and holder is not None
        and holder.region == region
        and fence.unreleased()
        and now_ms >= fence.expiry(fence.fence)
    )


def split_tokens(record: Record) -> bool:
    """Whether the record holds claims granted while two of its births were apart
    that the fence has not moved past yet (SPEC §2). The home then moves the fence
    (``FenceState.move``) past every token either side issued.

    When births first meet, the fence has never moved (``moved == 0``): every grant
    so far may have been made apart — each side granted as a home, and two grants
    of one token merge into one entry, so which side made it says nothing. After
    that move, only a grant by another birth region can still be from the split
    (it granted before it learnt of the earlier birth)."""
    if len(record.creators) < 2:
        return False
    fence = record.fence
    if fence.moved == 0:
        return True
    home = record.home_region
    return any(
        token >= fence.moved and grant.region != home for token, grant in fence.grants.items()
    )


def token_ceiling(hlc: int) -> int:
    """The largest token a home can have granted at ``hlc``: its wall-clock
    millisecond times 2**TOKENS_PER_MS_BITS (a recovery floor; ``integrity`` bounds
    merged grants by it)."""
    return physical_ms(hlc) << TOKENS_PER_MS_BITS


def next_token(
    fence: FenceState, recovered_hlc: int = 0, *, life_hlc: int = 0, region: str = ""
) -> int:
    """The token a grant gets: ``fence + 1``; for the first grant a recovered node
    makes on a record (one whose holder it did not grant), past a floor; for the
    first grant of a life of the data file, past that life's floor.

    The recovery floor is ``fence + 1 + RECOVERY_GAP``, and at least ``token_ceiling`` of the
    moment it recovered. A grant its earlier life made and never replicated is
    below the first: that life can have granted fewer than 2**20 tokens unseen. A
    life before that one recovered earlier, so every token it granted is below
    its own recovery millisecond's ceiling plus the grants it made since — below
    the second, unless one record was granted more than 2**10 times in one
    millisecond (each grant is an fsync'd transaction at its home) or the
    recovered node's clock (which has observed every stamp its peers hold) is
    behind its earlier life's (docs/replication.md, catch-up after disk loss).

    The life floor, ``token_ceiling(life_hlc)``, is the same time floor for a file
    that may have gone back in time (a reverted snapshot, a lost fsync): unless the
    holder is a grant of this ``region`` made in this life, every token an earlier
    life granted — remembered by the file or not — is below it, on the same two
    assumptions (docs/replication.md, *A disk that goes back in time*). At a
    member of a region of several, ``life_hlc`` is also the current term's floor
    (``grant_gate.term_floor``), usually far above a recovery made earlier in the
    life: where both floors apply, the token is above both.
    """
    holder = fence.holder()
    token = fence.fence + 1
    if recovered_hlc and (holder is None or holder.granted_hlc < recovered_hlc):
        token = max(token + RECOVERY_GAP, token_ceiling(recovered_hlc))
    ours = holder is not None and holder.region == region and holder.granted_hlc >= life_hlc
    if life_hlc and not ours:
        token = max(token, token_ceiling(life_hlc))
    return token


def not_here(record: Record, region: str, *, tombstone_ok: bool = False) -> Outcome | None:
    """The outcome when ``region``'s node cannot decide claims on ``record``.

    A tombstone keeps its grants, so its holder may still release (and only
    release) its claim.
    """
    if not record.exists or (record.is_deleted and not tombstone_ok):
        home = record.home_region
        return Outcome(False, Reason.MISSING, home_region=home, fence=record.fence.fence)
    if record.home_region != region:
        return Outcome(
            False, Reason.WRONG_REGION, home_region=record.home_region, fence=record.fence.fence
        )
    return None


def decide_claim(
    record: Record,
    owner: str,
    *,
    caller: Caller,
    lease_ms: int,
    now_ms: int,
    hlc: int,
    region: str,
    queued_ahead: bool,
    recovered_hlc: int = 0,
    life_hlc: int = 0,
) -> tuple[FenceState, Outcome]:
    """Grant, retry or refuse a claim; returns the new fence state and the outcome.

    ``queued_ahead`` says other claimers wait in the FIFO queue before this one:
    they go first, so a free claim is still ``contended`` for a newcomer. A claim
    by the holder's owner name is a retry only from an identity that ``acts_for``
    the holder; from any other it is another claimer's, ``contended``. A new
    grant records the caller's identity.
    """
    fence = record.fence
    refusal = not_here(record, region)
    if refusal is not None:
        return fence, refusal
    home = record.home_region
    expiry = now_ms + lease_ms
    if record.claim_live(now_ms):
        holder = fence.holder()
        if holder is not None and holder.owner == owner and acts_for(caller, holder):
            # The grant's reply may have been lost: answer from the durable state.
            token = fence.fence
            extended = fence.extend(token, expiry)
            return extended, Outcome(True, None, token, extended.expiry(token), home, token)
        return fence, Outcome(False, Reason.CONTENDED, home_region=home, fence=fence.fence)
    if queued_ahead:
        return fence, Outcome(False, Reason.CONTENDED, home_region=home, fence=fence.fence)
    token = next_token(fence, recovered_hlc, life_hlc=life_hlc, region=region)
    granted = fence.grant(token, Grant(hlc, owner, region, identity=caller.identity), expiry)
    return granted, Outcome(True, None, token, expiry, home, token)


def decide_renew(
    record: Record, token: int, *, caller: Caller, lease_ms: int, now_ms: int, region: str
) -> tuple[FenceState, Outcome]:
    """Extend the live claim of ``token``; a renewal never shortens a lease.
    Refused ``not_holder`` (raised) for a token granted to another identity."""
    fence = record.fence
    refusal = not_here(record, region)
    if refusal is not None:
        return fence, refusal
    home = record.home_region
    _check_holder(fence, token, caller)
    problem = token_problem(fence, token, now_ms)
    if problem is not None:
        return fence, Outcome(False, problem, home_region=home, fence=fence.fence)
    extended = fence.extend(token, now_ms + lease_ms)
    return extended, Outcome(True, None, token, extended.expiry(token), home, fence.fence)


def decide_release(
    record: Record, token: int, *, caller: Caller, region: str
) -> tuple[FenceState, Outcome]:
    """Release ``token``: idempotent up to the fence, ``unknown_token`` above it,
    refused ``not_holder`` (raised) when it was granted to another identity.

    Only the current fence token changes the state; the fence itself never
    drops, so every older token stays refused (``superseded``) forever.
    """
    fence = record.fence
    refusal = not_here(record, region, tombstone_ok=True)
    if refusal is not None:
        return fence, refusal
    home = record.home_region
    if token > fence.fence:
        return fence, Outcome(False, Reason.UNKNOWN_TOKEN, home_region=home, fence=fence.fence)
    _check_holder(fence, token, caller)
    released = fence.release(token) if token == fence.fence else fence
    return released, Outcome(True, None, token, home_region=home, fence=fence.fence)


def decide_fenced_release(
    record: Record, token: int, *, caller: Caller, region: str, now_ms: int
) -> Outcome | None:
    """Why a release that writes (an outcome, or fields) may not go ahead, as a
    value; None when ``token`` is the live claim and ``caller`` may act for it.

    Such a release is the holder's last fenced write (SPEC §8), so it obeys a fenced
    write's rules, not a plain release's: a token that is no longer the live claim
    (``superseded``, ``expired``, ``released``) records no outcome, so a superseded
    worker can never mark an item done. Refused ``not_holder`` (raised) for a token
    granted to another identity.
    """
    fence = record.fence
    refusal = not_here(record, region)
    if refusal is not None:
        return refusal
    home = record.home_region
    if token > fence.fence:
        return Outcome(False, Reason.UNKNOWN_TOKEN, home_region=home, fence=fence.fence)
    _check_holder(fence, token, caller)
    problem = token_problem(fence, token, now_ms)
    if problem is None and not record.claim_live(now_ms):
        problem = Reason.SUPERSEDED  # granted by another birth region: superseded at the meet
    if problem is not None:
        return Outcome(False, problem, home_region=home, fence=fence.fence)
    return None


def settled(record: Record, token: int) -> Outcome:
    """The answer to a release of ``token`` that took effect (now or before)."""
    return Outcome(True, None, token, home_region=record.home_region, fence=record.fence.fence)

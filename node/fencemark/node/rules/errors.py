"""Refusals the rules layer raises; ``server`` maps each to one gRPC status.

Every refusal carries a machine-readable reason and a sentence a person can
act on. Claim *outcomes* (contended, timeout, ...) are not errors: they are
values returned by ``claims``.
"""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    """The wire words for refusals and claim outcomes (SPEC §4)."""

    # A write refused by the fence, or a renewal/release refused.
    CLAIMED = "claimed"
    SUPERSEDED = "superseded"
    UNKNOWN_TOKEN = "unknown_token"
    RELEASED = "released"
    EXPIRED = "expired"
    WRONG_REGION = "wrong_region"
    # Claim outcomes only.
    CONTENDED = "contended"
    TIMEOUT = "timeout"
    MISSING = "missing"
    # Work-queue outcomes (SPEC §8): nothing eligible for ClaimNext; no live claim
    # for ForceRelease to take back.
    EMPTY = "empty"
    NO_CLAIM = "no_claim"
    # A waiter that asked to hear of items homed elsewhere: one is eligible there.
    ELSEWHERE = "elsewhere"


class FencemarkError(Exception):
    """Base of every refusal."""


class InvalidInput(FencemarkError):
    """Bad input; ``violations`` name the offending request fields."""

    def __init__(self, violations: list[tuple[str, str]]) -> None:
        self.violations = violations
        super().__init__("; ".join(f"{name}: {why}" for name, why in violations))

    @classmethod
    def field(cls, name: str, why: str) -> InvalidInput:
        return cls([(name, why)])


class NotFound(FencemarkError):
    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(f"no record {key!r}")


class ClaimConflict(FencemarkError):
    """A write refused by the record's fence."""

    def __init__(
        self, conflict: Reason, *, fence: int, home_region: str, message: str = ""
    ) -> None:
        self.conflict = conflict
        self.fence = fence
        self.home_region = home_region
        advice = _CONFLICT_HELP.get(conflict, conflict.value)
        super().__init__(message or advice.format(fence=fence, home=home_region))


class WrongRegion(ClaimConflict):
    """Only the record's home region decides this call: a new record's birth or a fenced write.

    One refusal word, one shape: a ``ClaimConflict`` whose conflict is
    ``wrong_region`` (``fence`` is 0 for a record not yet born). Raised only by
    ``admission.require_home``.
    """

    def __init__(self, home_region: str, region: str, *, fence: int, birth: bool) -> None:
        message = (
            f"a new record homed in {home_region!r} must be created there,"
            f" not in {region!r}: send the call to region {home_region!r}"
            if birth
            else ""
        )
        super().__init__(Reason.WRONG_REGION, fence=fence, home_region=home_region, message=message)


class ClockSkewed(FencemarkError):
    """A peer's clock or stamps are beyond ``max_clock_offset`` ahead: nothing merged."""

    def __init__(self, region: str, ahead_ms: int, max_offset_ms: int) -> None:
        self.region = region
        self.ahead_ms = ahead_ms
        self.max_offset_ms = max_offset_ms
        super().__init__(
            f"refused: the clock of region {region!r} is {ahead_ms} ms ahead of this node's"
            f" (at most {max_offset_ms} ms allowed); check NTP on both hosts"
        )


class TwinNode(FencemarkError):
    """Two live processes call with one node id (``replication.lives``): nothing of
    either is taken until one of them has stopped."""

    def __init__(self, node_id: str, region: str) -> None:
        self.node_id = node_id
        self.region = region
        super().__init__(
            f"refused: two live processes of region {region!r} call as node {node_id!r}"
            " (a copy of one data directory started twice); stop one of them — the"
            " other catches up and decides again once this node stops hearing the first"
        )


class NotDecider(FencemarkError):
    """A member of a region that is not its decider was asked to decide (SPEC §10):
    the call belongs at ``address``, where member ``decider`` decides in ``term``.
    A client follows it (docs/api.md, *NOT_DECIDER*)."""

    def __init__(self, region: str, decider: str, address: str, term: int) -> None:
        self.region = region
        self.decider = decider
        self.address = address
        self.term = term
        super().__init__(
            f"this member does not decide for region {region!r}: member {decider!r}"
            f" does (term {term}), at {address}; send deciding calls there"
        )


class NotServing(FencemarkError):
    """This node cannot decide claims right now (e.g. catching up after disk loss).
    ``retry_after_ms``, when known (a restart settling), is when to ask again: sent as
    ``RetryInfo`` and as gRPC's retry pushback, which a retrying client waits for."""

    def __init__(self, message: str, retry_after_ms: int = 0) -> None:
        self.retry_after_ms = retry_after_ms
        super().__init__(message)


class NoMajority(NotServing):
    """A write (a grant, a renewal, a release) durable at this member that a majority
    of its region's configured members did not acknowledge in time (SPEC §10). Its
    outcome is unknown to the caller, as a lost reply's: it may still reach the
    others (replication goes on) and count, or be lost with this member's disk."""

    reason = "NO_MAJORITY"

    def __init__(self, region: str, acked: int, needed: int, members: int, why: str) -> None:
        self.region = region
        self.acked = acked
        self.needed = needed
        super().__init__(
            f"not acknowledged by a majority of the {members} members of region {region!r}"
            f" ({acked} of the {needed} needed hold it): {why}; it is durable at this"
            " member only, and its outcome is unknown until it replicates",
            retry_after_ms=1000,
        )


_CONFLICT_HELP = {
    Reason.CLAIMED: (
        "the record is claimed (fence {fence}): present the claim's fencing token,"
        " or wait for it to be released"
    ),
    Reason.SUPERSEDED: (
        "your fencing token was superseded by token {fence}: you lost this item; stop writing to it"
    ),
    Reason.UNKNOWN_TOKEN: "no such fencing token was ever granted (the fence is {fence})",
    Reason.RELEASED: "the claim of this fencing token was released; claim again",
    Reason.EXPIRED: "the lease of this fencing token lapsed; claim again",
    Reason.WRONG_REGION: (
        "fenced writes are decided by the record's home region {home!r}: send the call there"
    ),
}


class Exhausted(FencemarkError):
    """A bounded resource is full (``what``), e.g. a client's claim waiters."""

    def __init__(self, what: str, limit: int) -> None:
        self.what = what
        self.limit = limit
        super().__init__(f"too many {what} (at most {limit}); retry later")


class Denial(StrEnum):
    """Why a caller was refused PERMISSION_DENIED (``fencemark.node.api.authz``, replication)."""

    # The certificate (verified against the cluster CA) names no fencemark:// identity.
    NO_IDENTITY = "no_identity"
    # The identity lacks the right the method needs (read, write, claim, replicate).
    MISSING_RIGHT = "missing_right"
    # Replication: the caller is not a node (no fencemark://region/ certificate).
    UNAUTHENTICATED_PEER = "unauthenticated_peer"
    # Replication: the caller's region is not one of this node's configured peers.
    UNKNOWN_REGION = "unknown_region"
    # Replication at a member of a region of several: the caller presents this region's
    # own certificate but is no member registered in etcd (not yet, or not at all).
    UNKNOWN_MEMBER = "unknown_member"
    # Replication: the request's origin.region is not the region the certificate names.
    REGION_MISMATCH = "region_mismatch"
    # The caller's certificate is on the CRL (crl.pem in the node's --tls-dir).
    REVOKED_CERTIFICATE = "revoked_certificate"
    # A renewal, release or fenced write presenting the token of a claim granted to
    # another identity, by a caller without the act-for-others right (SPEC §4).
    NOT_HOLDER = "not_holder"


# The access-map right that lets an identity act on claims granted to others
# (``authz.Right.ACT_FOR_OTHERS``); named here because the claim rules refuse with it.
ACT_FOR_OTHERS = "act-for-others"


class PermissionDenied(FencemarkError):
    """The caller may not make this call; nothing was read or written for it."""

    def __init__(
        self, denial: Denial, message: str, *, identity: str = "", right: str = ""
    ) -> None:
        self.denial = denial
        self.identity = identity
        self.right = right
        super().__init__(message)


class CursorExpired(FencemarkError):
    """A change-feed cursor this node can no longer resume from: older than the
    window it keeps, or of another feed (another node, or this node before it lost
    its disk). The watcher lists the records again and watches from now."""

    def __init__(self, cursor: str, why: str) -> None:
        super().__init__(f"cursor {cursor!r} {why}: list the records again, then watch from now")
        self.cursor = cursor


class TooSlow(FencemarkError):
    """A watcher that did not take its events in time is cut off with the cursor of
    the last event it took, to resume from (``Records.Watch``)."""

    def __init__(self, cursor: str, seconds: float) -> None:
        super().__init__(
            f"the watcher did not take an event for {seconds:g} s: resume from cursor {cursor!r}"
        )
        self.cursor = cursor

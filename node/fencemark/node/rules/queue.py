"""The work queue's rules (SPEC §8): what a grant, a claim's end and a reopen write
into a record's queue registers, and which items ``ClaimNext`` may hand out.

Pure functions over records and stamps, like ``admission``; the home applies them
(``Claims``, ``Replica``) under the record's lock, so a claim's end and its queue
state are one commit. Every queue register is written by the home only, at the
epoch of the claim it is about (docs/consistency.md, *Work queue*).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

from fencemark.node.crdt import Record, Stamp, tagset
from fencemark.node.crdt.record import (
    ATTEMPTS,
    DEFERRED,
    DONE,
    FAILED,
    LAPSED,
    MAX_ATTEMPTS_TAG,
    NOT_BEFORE,
    OPEN,
    OUTCOME,
    PARKED,
    STATUS,
)

DEFAULT_MAX_ATTEMPTS = 5  # per node (--max-attempts); the tag maxAttempts:N per record
MAX_ATTEMPTS_LIMIT = 1000  # the largest N a maxAttempts:N tag may name
MAX_RETRY_AFTER_S = 30 * 24 * 3600  # a deferral of at most 30 days
MAX_AFTER_TAGS = 16  # after:<id> tags one item may wait on
# A release's outcome: "" is a plain release (the item stays as it is).
RELEASE_OUTCOMES = ("", DONE, FAILED, DEFERRED)


def max_attempts(record: Record, default: int) -> int:
    """The attempts after which a failed or lapsed claim parks the item: the
    record's ``maxAttempts:N`` tag, else the node's ``default``."""
    for tag in tagset.value(record.tags):
        if tag.startswith(MAX_ATTEMPTS_TAG):
            count = tag.removeprefix(MAX_ATTEMPTS_TAG)
            if count.isdigit() and 1 <= int(count) <= MAX_ATTEMPTS_LIMIT:
                return int(count)
    return default


def granted(record: Record, stamp: Stamp) -> Record:
    """A new grant counts one attempt (written at the new token's epoch)."""
    return record.set_queue({ATTEMPTS: str(record.attempts + 1)}, stamp)


def withdrawn(record: Record, stamp: Stamp) -> Record:
    """A grant its caller never received (it left while the grant was being made
    durable, and the home released it) gives its attempt back, written at that
    grant's epoch: nobody worked the item, so it is as it was but for the spent
    token, and a poison item still parks after exactly ``max_attempts`` tries."""
    return record.set_queue({ATTEMPTS: str(max(0, record.attempts - 1))}, stamp)


def ended(
    record: Record, ending: str, stamp: Stamp, *, default_max_attempts: int, not_before_ms: int = 0
) -> Record:
    """The queue state after the claim of ``stamp.epoch`` ended with ``ending``.

    ``done`` makes the item done. ``failed`` and ``lapsed`` park it once its
    attempts reached ``max_attempts``. ``deferred`` keeps it from ``ClaimNext``
    until ``not_before_ms``. ``forced`` (an operator's force-release) changes
    nothing but the outcome: the holder did not fail, it was stopped.
    """
    values = {OUTCOME: ending}
    if ending == DONE:
        values[STATUS] = DONE
    elif ending in (FAILED, LAPSED):
        if record.attempts >= max_attempts(record, default_max_attempts):
            values[STATUS] = PARKED
    elif ending == DEFERRED:
        values[NOT_BEFORE] = str(not_before_ms)
    return record.set_queue(values, stamp)


def already_ended(record: Record, token: int, ending: str, fields: Mapping[str, str]) -> bool:
    """Whether ``token``'s claim was already released with ``ending`` (``""``: none)
    and ``fields``: a retried release whose first answer was lost is answered from
    the durable state: the claim is released, its ending is ``ending``, and each of
    ``fields`` holds its value at the token's epoch (as it would had the release
    been the last write)."""
    if token not in record.fence.released:
        return False
    outcome = record.outcome
    if ending and not (
        outcome is not None and outcome.stamp.epoch == token and outcome.value == ending
    ):
        return False
    for name, value in fields.items():
        reg = record.fields.get(name)
        if reg is None or reg.stamp.epoch != token or reg.value != value:
            return False
    return True


def reopened(record: Record, stamp: Stamp) -> Record:
    """An operator's reopen: open again, with its attempts counted from zero and
    no deferral left."""
    return record.set_queue({STATUS: OPEN, ATTEMPTS: "0", NOT_BEFORE: "0"}, stamp)


def eligible(
    record: Record,
    *,
    region: str,
    now_ms: int,
    tags: Collection[str],
    done: Callable[[str], bool],
) -> bool:
    """Whether ``ClaimNext`` at ``region``'s node may hand ``record`` out now: homed
    here, visible, ``open``, no live claim, ``not_before`` passed, every requested
    tag present and every ``after:`` item ``done`` (``done(id)``)."""
    if not record.visible or record.home_region != region or record.status != OPEN:
        return False
    if record.claim_live(now_ms) or record.not_before_ms > now_ms:
        return False
    if not set(record.tag_values()).issuperset(tags):
        return False
    return all(done(item) for item in record.waits_on)


def held_for_retry(record: Record, *, region: str, now_ms: int, tags: Collection[str]) -> bool:
    """Whether ``ClaimNext`` at ``region``'s node may answer ``record``'s live claim
    to its holder, as the retry of the call that was granted it: homed here,
    visible, ``open``, the claim live, every requested tag present. (Who the holder
    is, and whether the caller acts for it, ``admission.decide_claim`` says.)"""
    if not record.visible or record.home_region != region or record.status != OPEN:
        return False
    return record.claim_live(now_ms) and set(record.tag_values()).issuperset(tags)

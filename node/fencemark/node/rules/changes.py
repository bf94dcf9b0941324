"""What kind of change one commit made to a record: the word of its change-feed event
(SPEC §9, ``Records.Watch``).

A pure function of the state before and after, so a change a client made here and
the same change merged from a peer get the same word at every node. One commit may
do several things at once (a release with ``done`` ends the claim and finishes the
item); it gets the one word that says the most, in this order: the record appeared
or disappeared; the item's status moved; a claim ended with an outcome; a claim
began or ended; anything else is ``updated`` (fields, tags, a renewal).
"""

from __future__ import annotations

from fencemark.node.crdt import Record
from fencemark.node.crdt.record import DEFERRED, DONE, FAILED, FORCED, LAPSED, OPEN, PARKED

CREATED, UPDATED, DELETED = "created", "updated", "deleted"
CLAIMED, RELEASED, REOPENED = "claimed", "released", "reopened"
# Every word an event may carry, as SPEC §9 lists them.
KINDS = (CREATED, UPDATED, DELETED, CLAIMED, RELEASED, LAPSED, DONE, FAILED, DEFERRED,
         PARKED, REOPENED)  # fmt: skip
# An ending recorded with a release, as the event's word (a force-release is a release).
_ENDINGS = {DONE: DONE, FAILED: FAILED, DEFERRED: DEFERRED, LAPSED: LAPSED, FORCED: RELEASED}


def kind_of(before: Record, after: Record) -> str:
    """The word for the change from ``before`` to ``after`` (a record not there yet is
    ``Record(key)``)."""
    if after.visible != before.visible:
        return CREATED if after.visible else DELETED
    if not after.visible:
        return DELETED  # a tombstone written or merged again
    if after.status != before.status:
        return {PARKED: PARKED, DONE: DONE, OPEN: REOPENED}.get(after.status, UPDATED)
    if after.outcome is not None and after.outcome != before.outcome:
        return _ENDINGS.get(after.outcome.value, UPDATED)
    return _claim_change(before, after)


def _claim_change(before: Record, after: Record) -> str:
    was, now = before.fence, after.fence
    token = now.fence
    if token in now.grants and token not in was.grants and not now.ended(token):
        return CLAIMED
    if token in was.grants and not was.ended(token) and now.ended(token):
        return LAPSED if token in now.lapsed else RELEASED
    return UPDATED

"""Majorities of a region's members (SPEC §10): who must hold a write before it is
acknowledged, and whose states a member must hold before it decides or counts.

Everything rests on one fact: any two majorities of the same configured member set
share a member. A write is acknowledged once a majority holds it (``acknowledged``);
a new decider first holds the states of a majority (``fellows_needed``), so some
member of that majority held the write — provided it still holds what it
acknowledged. A member back on a new, emptied or restored file may not: it counts
neither itself nor is counted by others until it has caught up (``intact``), and
its own catch-up needs a majority of the others, all intact (every other member,
in a set of two; none in a set of one, whose only copy was the lost disk).

Members outside the configured set (learners) count for no majority: their
acknowledgements are durable copies, not votes.
"""

from __future__ import annotations

from collections.abc import Collection


def majority(members: int) -> int:
    """How many of ``members`` configured members make a majority (0 members: 1,
    which no empty set reaches)."""
    return members // 2 + 1


def acknowledged(configured: Collection[str], holders: Collection[str]) -> bool:
    """Whether a write held durably by ``holders`` (this member among them, if it
    holds it) is held by a majority of the ``configured`` members."""
    return len(set(holders) & set(configured)) >= majority(len(configured))


def fellows_needed(configured: Collection[str], me: str, *, intact: bool) -> int:
    """How many fellow members of the ``configured`` set, each intact, must have
    given ``me`` a complete round for ``me`` to hold a majority's states: a
    majority, less ``me`` itself when it is configured and ``intact`` (holds all it
    acknowledged). Never more than there are fellows: a configured member that lost
    its disk in a set of one or two needs every other member, and then holds all
    that any intact member holds (what only its lost disk held is gone)."""
    counts_itself = me in configured and intact
    fellows = len(set(configured) - {me})
    return min(majority(len(configured)) - counts_itself, fellows)


def holds_majority(
    configured: Collection[str], me: str, *, intact: bool, rounds_with: Collection[str]
) -> bool:
    """Whether complete rounds with the intact fellow members ``rounds_with`` give
    ``me`` a majority's states (an unknown, empty configured set gives none): every
    write acknowledged by a majority and still on an intact disk is among them."""
    fellows = (set(rounds_with) & set(configured)) - {me}
    return bool(configured) and len(fellows) >= fellows_needed(configured, me, intact=intact)

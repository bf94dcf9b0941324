"""One record's CRDT state: the product of the lattices beside this module.

``merge`` is componentwise, so it is commutative, associative and idempotent
because each component's merge is (tests/test_crdt_laws.py proves it on whole
records built from real operations). Every update below is an inflation: the
old state merged into the new one gives the new one.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import NamedTuple

from fencemark.node.crdt import lww, tagset
from fencemark.node.crdt.fence import FenceState
from fencemark.node.crdt.hlc import Stamp
from fencemark.node.crdt.lww import LWW, V
from fencemark.node.crdt.tagset import TagSet

HOME_TAG_PREFIX = "homeRegion:"
# What a register is to (``Record.registers``, ``codec.write_message``).
FIELD, TAG, DELETED, QUEUE = "field", "tag", "deleted", "queue"
# The work-queue registers (SPEC §8), each an LWW register of a string like a field,
# written only by a region that created the record (its home): ``status`` (``open``
# until written), ``attempts`` (grants so far, decimal), ``not_before`` (UTC
# milliseconds, decimal) and ``outcome``, how the last claim ended (at its token's
# epoch: what answers a retried release from the durable state).
STATUS, ATTEMPTS, NOT_BEFORE, OUTCOME = "status", "attempts", "not_before", "outcome"
QUEUE_REGISTERS = (ATTEMPTS, NOT_BEFORE, OUTCOME, STATUS)
OPEN, DONE, PARKED = "open", "done", "parked"
STATUSES = (OPEN, DONE, PARKED)
# How a claim ended, beside a plain release: an outcome the holder gave, the home
# seeing its lease lapse, or an operator taking it back.
FAILED, DEFERRED, LAPSED, FORCED = "failed", "deferred", "lapsed", "forced"
ENDINGS = (DONE, FAILED, DEFERRED, LAPSED, FORCED)
# Tags the work queue reads (SPEC §8): priority:P0 (first) ... priority:P9; an item
# without one (or with another spelling) comes last. after:<id> waits on item <id>
# of the same repo and topic; maxAttempts:N overrides the node's default.
PRIORITY_TAG = re.compile(r"priority:P([0-9])")
UNPRIORITIZED = 10
AFTER_TAG = "after:"
MAX_ATTEMPTS_TAG = "maxAttempts:"
Register = LWW[str] | LWW[bool]


class Birth(NamedTuple):
    """When a region created the record, and that region's signature over it
    (``b""``: unsigned — a node without TLS, or a file from before signed births)."""

    stamp: Stamp
    signature: bytes = b""


def merge_birth(a: Birth, b: Birth) -> Birth:
    """A region's earliest birth; of two versions of one birth, the signed one
    (the larger signature), so the join stays a join."""
    if a.stamp != b.stamp:
        return a if a.stamp < b.stamp else b
    return a if a.signature >= b.signature else b


@dataclass(frozen=True)
class Record:
    """``births`` maps each region that created the record to that creation.

    One region creates a record; two do only when they create the same key
    while cut off from each other. The earliest birth is the home, on every
    replica alike (SPEC §2), and the grants of every birth region are kept, so
    that the home can supersede whatever the other side granted
    (docs/consistency.md, *Two births*).

    ``seen`` maps each region that held the record while another region's birth
    was its only origin — it acknowledged a claim granted on it — to when, signed
    by that region (``Replica.merge``). Such a region could not create the record
    afterwards: a birth of its own is void, kept as evidence against it and never
    the home (``creators``; docs/security.md, *Signed births*).
    """

    key: str
    births: Mapping[str, Birth] = field(default_factory=dict)
    fields: Mapping[str, LWW[str]] = field(default_factory=dict)
    tags: TagSet = field(default_factory=dict)
    deleted: LWW[bool] = lww.FALSE
    fence: FenceState = field(default_factory=FenceState)
    queue: Mapping[str, LWW[str]] = field(default_factory=dict)
    seen: Mapping[str, Birth] = field(default_factory=dict)

    # -- lattice --------------------------------------------------------------

    def merge(self, other: Record) -> Record:
        if other.key != self.key:
            raise ValueError(f"cannot merge {other.key!r} into {self.key!r}")
        return Record(
            key=self.key,
            births=lww.merge_maps(self.births, other.births, merge_birth),
            fields=lww.merge_maps(self.fields, other.fields, lww.merge),
            tags=tagset.merge(self.tags, other.tags),
            deleted=lww.merge(self.deleted, other.deleted),
            fence=self.fence.merge(other.fence),
            queue=lww.merge_maps(self.queue, other.queue, lww.merge),
            seen=lww.merge_maps(self.seen, other.seen, merge_birth),
        )

    # -- value ----------------------------------------------------------------

    # The values below are read several times per write (admission, the pick index,
    # the feed, the digest tree's rows): computed once per state, as a state never
    # changes (every update makes a new one: ``replace``).

    @cached_property
    def creators(self) -> frozenset[str]:
        """The regions whose births count: every birth region but one that had
        seen the record first (``seen``) — unless that leaves none, when all do
        (a region voiding its own only birth moves nothing)."""
        counted = frozenset(r for r in self.births if r not in self.seen)
        return counted or frozenset(self.births)

    @cached_property
    def home(self) -> LWW[str] | None:
        """The earliest birth that counts (``creators``), as ``(stamp, region)``;
        None if never created."""
        if not self.births:
            return None
        creators = self.creators
        region, birth = min(
            ((r, b) for r, b in self.births.items() if r in creators),
            key=lambda item: (item[1].stamp, item[0]),
        )
        return LWW(birth.stamp, region)

    @property
    def exists(self) -> bool:
        """Created somewhere (possibly deleted since)."""
        return bool(self.births)

    @property
    def is_deleted(self) -> bool:
        """Deleted, unless a claim was granted after the delete's epoch: a grant
        counts as a write of "not deleted" at its epoch (SPEC §4), so a delete
        admitted where the grant was not yet known never erases a claimed record."""
        deleted = self.deleted
        return deleted.value and deleted.stamp.epoch >= max(self.fence.grants, default=0)

    def claim_live(self, now_ms: int) -> bool:
        """A live claim granted by the home (a grant of another birth region is
        superseded as soon as the births meet)."""
        holder = self.fence.holder()
        return (
            holder is not None and holder.region == self.home_region and self.fence.is_live(now_ms)
        )

    @property
    def visible(self) -> bool:
        return self.exists and not self.is_deleted

    @cached_property
    def home_region(self) -> str:
        return self.home.value if self.home is not None else ""

    def field_values(self) -> dict[str, str]:
        """Fields with a non-empty value (an empty value clears a field)."""
        return {name: reg.value for name, reg in sorted(self.fields.items()) if reg.value}

    def tag_values(self) -> list[str]:
        """Present tags, sorted, with the ``homeRegion:`` tag derived from ``home``."""
        present = set(tagset.value(self.tags))
        if self.home is not None:
            present.add(HOME_TAG_PREFIX + self.home.value)
        return sorted(present)

    @property
    def status(self) -> str:
        """``open``, ``done`` or ``parked`` (SPEC §8); ``open`` until written."""
        reg = self.queue.get(STATUS)
        return reg.value if reg is not None else OPEN

    @property
    def attempts(self) -> int:
        """Claims granted on the item so far, as its home counted them."""
        reg = self.queue.get(ATTEMPTS)
        return int(reg.value) if reg is not None else 0

    @property
    def outcome(self) -> LWW[str] | None:
        """How the last claim ended (``ENDINGS``), at its token's epoch; None before."""
        return self.queue.get(OUTCOME)

    @property
    def not_before_ms(self) -> int:
        """UTC milliseconds before which the item is not handed out; 0: any time."""
        reg = self.queue.get(NOT_BEFORE)
        return int(reg.value) if reg is not None else 0

    @cached_property
    def priority(self) -> int:
        """0 for ``priority:P0`` ... 9; ``UNPRIORITIZED`` without such a tag. Of
        several, the most urgent counts."""
        levels = [
            int(match[1])
            for tag in tagset.value(self.tags)
            if (match := PRIORITY_TAG.fullmatch(tag))
        ]
        return min(levels, default=UNPRIORITIZED)

    @property
    def waits_on(self) -> list[str]:
        """The ids of the items (same repo and topic) this one waits on, sorted."""
        tags = tagset.value(self.tags)
        return sorted(tag.removeprefix(AFTER_TAG) for tag in tags if tag.startswith(AFTER_TAG))

    def stamps(self) -> Iterator[Stamp]:
        yield from (birth.stamp for birth in self.births.values())
        yield from (reg.stamp for reg in self.fields.values())
        yield from (reg.stamp for reg in self.tags.values())
        yield self.deleted.stamp
        yield from (reg.stamp for reg in self.queue.values())
        yield from (sighting.stamp for sighting in self.seen.values())

    def registers(self) -> Iterator[tuple[str, str, Register]]:
        """Every register of the record's content, as ``(kind, name, register)``:
        FIELD, TAG and QUEUE by name, and DELETED (named ``""``)."""
        yield from ((FIELD, name, reg) for name, reg in self.fields.items())
        yield from ((TAG, name, reg) for name, reg in self.tags.items())
        yield DELETED, "", self.deleted
        yield from ((QUEUE, name, reg) for name, reg in self.queue.items())

    def max_hlc(self) -> int:
        """The largest HLC timestamp anywhere in the state (0 for an empty one)."""
        return self._max_hlc

    @cached_property
    def _max_hlc(self) -> int:
        grants = (grant.granted_hlc for grant in self.fence.grants.values())
        return max((*(s.hlc for s in self.stamps()), *grants), default=0)

    # -- updates --------------------------------------------------------------

    def create(self, home_region: str, stamp: Stamp) -> Record:
        """Give the record its home unless it already has one.

        A creation also writes ``deleted=False`` at its stamp, so that a delete of
        the key made earlier elsewhere (by a region that had never seen it) cannot
        delete a record created after it.
        """
        if self.births:
            return self
        return replace(
            self,
            births={home_region: Birth(stamp)},
            deleted=lww.assign(self.deleted, False, stamp),
        )

    def set_fields(self, values: Mapping[str, str], stamp: Stamp) -> Record:
        return replace(self, fields=_assigned(self.fields, values, stamp))

    def set_queue(self, values: Mapping[str, str], stamp: Stamp) -> Record:
        """Write queue registers (``STATUS``, ``ATTEMPTS``, ``NOT_BEFORE``) at ``stamp``."""
        return replace(self, queue=_assigned(self.queue, values, stamp))

    def add_tags(self, names: Iterable[str], stamp: Stamp) -> Record:
        return replace(self, tags=tagset.add(self.tags, names, stamp))

    def remove_tags(self, names: Iterable[str], stamp: Stamp) -> Record:
        return replace(self, tags=tagset.remove(self.tags, names, stamp))

    def set_deleted(self, deleted: bool, stamp: Stamp) -> Record:
        return replace(self, deleted=lww.assign(self.deleted, deleted, stamp))

    def clear(self, stamp: Stamp) -> Record:
        """Empty every field and remove every tag (a delete erases the content)."""
        emptied = self.set_fields({name: "" for name in self.field_values()}, stamp)
        return emptied.remove_tags(tagset.value(self.tags), stamp)

    def with_signed_writes(
        self, stamp: Stamp, signature: Callable[[str, str, Register], bytes]
    ) -> Record:
        """Every register written at ``stamp`` without a signature, signed with
        ``signature(kind, name, register)`` (docs/security.md, *Signed writes*)."""

        def sign(kind: str, name: str, reg: LWW[V]) -> LWW[V]:
            if reg.stamp != stamp or reg.signature:
                return reg
            return reg._replace(signature=signature(kind, name, reg))

        fields = {name: sign(FIELD, name, reg) for name, reg in self.fields.items()}
        tags = {name: sign(TAG, name, reg) for name, reg in self.tags.items()}
        queue = {name: sign(QUEUE, name, reg) for name, reg in self.queue.items()}
        deleted = sign(DELETED, "", self.deleted)
        return replace(self, fields=fields, tags=tags, deleted=deleted, queue=queue)

    def with_fence(self, fence: FenceState) -> Record:
        return replace(self, fence=fence)

    def with_birth(self, region: str, birth: Birth) -> Record:
        """``region``'s birth replaced by ``birth`` — another version of the same one
        (its signature): the merge keeps whichever it prefers."""
        return replace(self, births={**self.births, region: birth})

    def see(self, region: str, sighting: Birth) -> Record:
        """``region`` held the record, born elsewhere, at ``sighting`` (``seen``): kept
        unless it already had (the merge keeps the earliest)."""
        current = self.seen.get(region)
        kept = sighting if current is None else merge_birth(current, sighting)
        return replace(self, seen={**self.seen, region: kept})


def _assigned(
    registers: Mapping[str, LWW[str]], values: Mapping[str, str], stamp: Stamp
) -> dict[str, LWW[str]]:
    """``registers`` with each of ``values`` written at ``stamp`` (a merge: an older
    stamp changes nothing)."""
    out = dict(registers)
    for name, value in values.items():
        current = out.get(name)
        written = LWW(stamp, value)
        out[name] = written if current is None else lww.merge(current, written)
    return out

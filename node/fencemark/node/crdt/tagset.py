"""LWW-element set of tags: per tag a register ``(stamp, present)``.

Adding and removing are both writes; the later one wins, per tag. Unlike an
OR-set this needs no per-add identity, and with epoch-major stamps a removal
made under a newer fence beats an add made under an older one (SPEC §3).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from fencemark.node.crdt import lww
from fencemark.node.crdt.hlc import Stamp
from fencemark.node.crdt.lww import LWW

TagSet = Mapping[str, LWW[bool]]

EMPTY: TagSet = {}


def merge(a: TagSet, b: TagSet) -> TagSet:
    return lww.merge_maps(a, b, lww.merge)


def add(tags: TagSet, names: Iterable[str], stamp: Stamp) -> TagSet:
    return _assign(tags, names, True, stamp)


def remove(tags: TagSet, names: Iterable[str], stamp: Stamp) -> TagSet:
    return _assign(tags, names, False, stamp)


def _assign(tags: TagSet, names: Iterable[str], present: bool, stamp: Stamp) -> TagSet:
    changed = dict(tags)
    for name in names:
        changed[name] = lww.assign(changed.get(name, lww.FALSE), present, stamp)
    return changed


def value(tags: TagSet) -> frozenset[str]:
    """The tags currently present."""
    return frozenset(name for name, register in tags.items() if register.value)

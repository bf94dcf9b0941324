"""Last-writer-wins registers and maps of them.

A register is ``(stamp, value, signature)``; merge keeps the larger triple. Stamps
are unique per write, so the value only breaks a tie that real writes never
produce; it is there so that merge stays commutative on any input. The signature
is the writer's, on a write made under a claim (``b""``: none, the common case;
docs/security.md, *Signed writes*): of two versions of one write, the signed one
wins, as with births and grants.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Generic, NamedTuple, TypeVar

from fencemark.node.crdt.hlc import ZERO_STAMP, Stamp

V = TypeVar("V", str, bool)
K = TypeVar("K")
T = TypeVar("T")


class LWW(NamedTuple, Generic[V]):
    """A last-writer-wins register."""

    stamp: Stamp
    value: V
    signature: bytes = b""


def merge(a: LWW[V], b: LWW[V]) -> LWW[V]:
    """The register with the larger ``(stamp, value, signature)``."""
    return a if (a.stamp, a.value, a.signature) >= (b.stamp, b.value, b.signature) else b


def assign(register: LWW[V], value: V, stamp: Stamp) -> LWW[V]:
    """Write ``value`` at ``stamp``; an older stamp loses to what is there."""
    return merge(register, LWW(stamp, value))


FALSE = LWW(ZERO_STAMP, False)


def merge_maps(a: Mapping[K, T], b: Mapping[K, T], merge_value: Callable[[T, T], T]) -> dict[K, T]:
    """Union of two maps, merging the values of keys present in both."""
    if len(a) < len(b):
        a, b = b, a
    merged = dict(a)
    for key, theirs in b.items():
        ours = merged.get(key)
        merged[key] = theirs if ours is None else merge_value(ours, theirs)
    return merged

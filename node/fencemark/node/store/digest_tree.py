"""A fixed-shape hash tree over a replica's record digests (pure, no I/O).

Anti-entropy compares these trees instead of states (docs/replication.md): two
replicas that agree exchange one root hash whatever their record count, and
replicas that differ descend only into differing subtrees.

Shape: ``FANOUT ** DEPTH`` leaf buckets (16^4 = 65536) under ``DEPTH`` levels of
16-way inner nodes; level 0 is the root. A record's bucket is fixed by its key.
A node's hash is the XOR of ``item_hash(key, digest)`` over every record below
it, so a write updates one path in O(DEPTH) without rehashing anything else,
and the tree never needs to be rebuilt by scanning (only loaded at start-up).
Each node also counts the records below it: a peer descending the tree lists a
node's records directly once there are few enough of them (docs/replication.md).

The root is compared on its whole ``HASH_BYTES``; nodes below it by a
``CHECK_BYTES`` check value, a BLAKE2b of the node's hash and a salt the caller
picks for each round: a difference two checks hide is found by the next round,
whose salt differs, and a round costs a quarter of the bytes of whole hashes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

FANOUT = 16
DEPTH = 4
LEAVES = FANOUT**DEPTH
HASH_BYTES = 16
CHECK_BYTES = 4  # the salted check value of a node below the root
MIN_SALT_BYTES, MAX_SALT_BYTES = 8, 32


def bucket_of(key: str) -> int:
    """The leaf bucket of a key (0 .. LEAVES-1)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=2).digest(), "big")


def item_hash(key: str, digest: bytes) -> int:
    return int.from_bytes(
        hashlib.blake2b(key.encode() + b"\0" + digest, digest_size=HASH_BYTES).digest(), "big"
    )


def level_size(level: int) -> int:
    return int(FANOUT**level)


def children(level: int, node: int) -> range:
    """Indices at ``level + 1`` of the children of ``node`` at ``level``."""
    return range(node * FANOUT, (node + 1) * FANOUT)


def leaf_range(level: int, node: int) -> range:
    """The leaf buckets below ``node`` at ``level``."""
    span = FANOUT ** (DEPTH - level)
    return range(node * span, (node + 1) * span)


class DigestTree:
    def __init__(self) -> None:
        # One list of XOR accumulators per level, root first; record counts beside.
        self._levels = [[0] * level_size(level) for level in range(DEPTH + 1)]
        self._counts = [[0] * level_size(level) for level in range(DEPTH + 1)]

    def update(self, key: str, old_digest: bytes | None, new_digest: bytes | None) -> None:
        """Account for ``key`` changing from ``old_digest`` to ``new_digest`` (None: absent)."""
        delta = 0
        if old_digest is not None:
            delta ^= item_hash(key, old_digest)
        if new_digest is not None:
            delta ^= item_hash(key, new_digest)
        if not delta:
            return
        added = (new_digest is not None) - (old_digest is not None)
        node = bucket_of(key)
        for level in range(DEPTH, -1, -1):
            self._levels[level][node] ^= delta
            self._counts[level][node] += added
            node //= FANOUT

    def load(self, items: Iterable[tuple[str, bytes]]) -> None:
        for key, digest in items:
            self.update(key, None, digest)

    def hash(self, level: int, node: int) -> bytes:
        return self._levels[level][node].to_bytes(HASH_BYTES, "big")

    def check(self, level: int, node: int, salt: bytes) -> bytes:
        """The node's check value for a round salted with ``salt``."""
        return hashlib.blake2b(self.hash(level, node) + salt, digest_size=CHECK_BYTES).digest()

    def checks(self, level: int, nodes: Sequence[int], salt: bytes) -> bytes:
        """The check values of ``nodes``, concatenated in order."""
        return b"".join(self.check(level, node, salt) for node in nodes)

    def count(self, level: int, node: int) -> int:
        """How many records lie below ``node``."""
        return self._counts[level][node]

    def counts(self, level: int, nodes: Sequence[int]) -> list[int]:
        return [self._counts[level][node] for node in nodes]

    @property
    def root(self) -> bytes:
        return self.hash(0, 0)

"""The digest tree's hashes and counts, against a brute-force recount (Hypothesis).

Anti-entropy trusts two things about every tree node: its hash is the XOR of its
records' item hashes (so equal sets give equal hashes, whatever the order of the
writes), and its count is the number of records below it (so a peer can list a
small subtree instead of descending into it). Both are maintained incrementally,
one path per write; here they are recomputed from scratch after arbitrary
sequences of creations, updates and deletions.
"""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from fencemark.node.store.digest_tree import (
    CHECK_BYTES,
    DEPTH,
    FANOUT,
    HASH_BYTES,
    DigestTree,
    bucket_of,
    item_hash,
    leaf_range,
)

KEYS = st.sampled_from([f"repo/r/mem/t/k{i}" for i in range(40)])
DIGESTS = st.binary(min_size=16, max_size=16)
# A write: the key and its new digest, or None for a deletion.
WRITES = st.lists(st.tuples(KEYS, st.none() | DIGESTS), max_size=60)


def replay(writes: list[tuple[str, bytes | None]]) -> tuple[DigestTree, dict[str, bytes]]:
    tree, live = DigestTree(), dict[str, bytes]()
    for key, digest in writes:
        tree.update(key, live.get(key), digest)
        if digest is None:
            live.pop(key, None)
        else:
            live[key] = digest
    return tree, live


def node_of(key: str, level: int) -> int:
    return bucket_of(key) // int(FANOUT ** (DEPTH - level))


@given(WRITES)
def test_every_node_counts_and_hashes_exactly_the_records_below_it(
    writes: list[tuple[str, bytes | None]],
) -> None:
    tree, live = replay(writes)
    for level in range(DEPTH + 1):
        expected: dict[int, tuple[int, int]] = {}
        for key, digest in live.items():
            count, xor = expected.get(node_of(key, level), (0, 0))
            expected[node_of(key, level)] = (count + 1, xor ^ item_hash(key, digest))
        touched = {node_of(key, level) for key, _ in writes} | set(expected)
        for node in touched:
            count, xor = expected.get(node, (0, 0))
            assert tree.count(level, node) == count
            assert tree.hash(level, node) == xor.to_bytes(HASH_BYTES, "big")
    assert tree.count(0, 0) == len(live)


@given(WRITES, st.randoms(use_true_random=False))
def test_the_tree_depends_on_the_records_not_the_order_of_the_writes(
    writes: list[tuple[str, bytes | None]], rnd: random.Random
) -> None:
    tree, live = replay(writes)
    again = DigestTree()
    items = list(live.items())
    rnd.shuffle(items)
    again.load(items)
    for level in range(DEPTH + 1):
        nodes = sorted({node_of(key, level) for key, _ in writes})
        assert again.checks(level, nodes, b"salt1234") == tree.checks(level, nodes, b"salt1234")
        assert again.counts(level, nodes) == tree.counts(level, nodes)


def test_check_values_are_short_salted_and_tell_apart_what_hashes_do() -> None:
    """Below the root peers exchange 4-byte check values of a node's hash and the
    round's salt: equal hashes give equal checks for any salt, and checks of the
    same node under two salts are unrelated (a chance agreement lasts one round)."""
    tree, other = DigestTree(), DigestTree()
    tree.update("k", None, b"d" * 16)
    other.update("k", None, b"e" * 16)
    node = node_of("k", 3)
    salts = [bytes([i]) * 8 for i in range(50)]
    assert all(len(tree.check(3, node, salt)) == CHECK_BYTES for salt in salts)
    assert len({tree.check(3, node, salt) for salt in salts}) == len(salts)
    assert all(tree.check(3, node, s) != other.check(3, node, s) for s in salts)
    copy = DigestTree()
    copy.load([("k", b"d" * 16)])
    assert all(copy.check(3, node, s) == tree.check(3, node, s) for s in salts)
    assert tree.checks(3, [node, node ^ 1], salts[0]) == (
        tree.check(3, node, salts[0]) + tree.check(3, node ^ 1, salts[0])
    )


@given(KEYS, st.integers(0, DEPTH))
def test_a_nodes_leaf_range_holds_exactly_the_buckets_below_it(key: str, level: int) -> None:
    node = node_of(key, level)
    span = leaf_range(level, node)
    assert bucket_of(key) in span
    assert len(span) == FANOUT ** (DEPTH - level)
    assert node + 1 == FANOUT**level or bucket_of(key) not in leaf_range(level, node + 1)

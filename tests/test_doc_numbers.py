"""The numbers the docs quote for a limit, a cap or a batch size are the code's.

A doc that says "at most 512 states" while the code sends 1024 misleads the
operator who sizes a deployment by it. Each row below finds one quoted number
by the words around it and compares it with the constant it names; a doc
rewritten so that the words no longer match fails too, so the row moves with it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fencemark.client import retry
from fencemark.client._routing import HOME_CACHE_SIZE
from fencemark.node.api import dashboard, handshakes, metrics_http
from fencemark.node.api.assembly import MAX_HANDSHAKE_TIMEOUT_S
from fencemark.node.api.budgets import Limits
from fencemark.node.api.connections import KEPT_FILES, MAX_CONNECTIONS, MAX_PEER_CONNECTIONS
from fencemark.node.core import claims
from fencemark.node.crdt.fence import HISTORY
from fencemark.node.replication import intake, signers, tuning
from fencemark.node.rules import validation
from fencemark.node.tools.cli_node import FULL_COLLECTION_EVERY

DOCS = Path(__file__).resolve().parent.parent / "docs"
MIB = 1 << 20

# (doc, the words around the number with (\S+) where it stands, the constant's value,
# the unit the doc quotes it in: the constant divided by this)
QUOTED: list[tuple[str, str, float, float]] = [
    ("security.md", r"`--max-waiters` \((\S+ ?\d*)\)", claims.MAX_WAITERS, 1),
    ("security.md", r"`--max-waiters-per-client` \((\S+)\)", claims.MAX_WAITERS_PER_CLIENT, 1),
    ("security.md", r"`--max-concurrent-reads` \((\S+)\)", Limits.read, 1),
    ("security.md", r"`--max-concurrent-writes` \((\S+)\)", Limits.write, 1),
    ("security.md", r"`--max-concurrent-replication` \((\S+)\)", Limits.replication, 1),
    ("security.md", r"`--max-concurrent-health` \((\S+)\)", Limits.health, 1),
    ("security.md", r"`--max-streams-per-client` \((\S+)\)", Limits.streams_per_client, 1),
    ("security.md", r"`--max-connections` \((\S+)\)", MAX_CONNECTIONS, 1),
    ("operations.md", r"`--max-connections` \((\S+)", MAX_CONNECTIONS, 1),
    ("operations.md", r"`--max-peer-connections` \((\S+),", MAX_PEER_CONNECTIONS, 1),
    ("security.md", r"`--max-peer-connections`, (\S+)\)", MAX_PEER_CONNECTIONS, 1),
    (
        "security.md",
        r"`--handshake-timeout` \((\S+) s\) to complete",
        handshakes.HANDSHAKE_TIMEOUT_S,
        1,
    ),
    ("security.md", r"seconds \((\S+) by default, at most", handshakes.HANDSHAKE_TIMEOUT_S, 1),
    ("security.md", r"by default, at most (\S+)\) to complete", MAX_HANDSHAKE_TIMEOUT_S, 1),
    ("security.md", r"for about (\S+) s; the kernel", handshakes.DEFER_ACCEPT_S, 1),
    ("security.md", r"admits at most (\S+) from one source", handshakes.PENDING_PER_SOURCE, 1),
    ("security.md", r"source address and (\S+) in all to their TLS", handshakes.PENDING_TOTAL, 1),
    ("security.md", r"handshake, below its (\S+) connections", dashboard.MAX_CONNECTIONS, 1),
    (
        "security.md",
        r"`/metrics` at most \S+ from one address and (\S+) in",
        metrics_http.MAX_CONNECTIONS,
        1,
    ),
    ("security.md", r"`/metrics` at most (\S+) from one address", handshakes.PENDING_PER_SOURCE, 1),
    (
        "operations.md",
        r"`FENCEMARK_HANDSHAKE_TIMEOUT`, (\S+) by default",
        handshakes.HANDSHAKE_TIMEOUT_S,
        1,
    ),
    ("operations.md", r"the dashboard admits (\S+) connections", handshakes.PENDING_PER_SOURCE, 1),
    (
        "operations.md",
        r"one address and (\S+) in all to their handshake",
        handshakes.PENDING_TOTAL,
        1,
    ),
    ("operations.md", r"handshake, `/metrics` serves (\S+)\.", metrics_http.MAX_CONNECTIONS, 1),
    ("operations.md", r"longer than (\S+) s \(refused\)", MAX_HANDSHAKE_TIMEOUT_S, 1),
    ("operations.md", r"the dashboard's \((\S+)\) and the metrics'", dashboard.MAX_CONNECTIONS, 1),
    ("operations.md", r"and the metrics' \((\S+)\) descriptors", metrics_http.MAX_CONNECTIONS, 1),
    ("operations.md", r"less (\S+) for the\s+data file", KEPT_FILES, 1),
    ("architecture.md", r"`MAX_BACKOFF_S` = (\S+) s", tuning.MAX_BACKOFF_S, 1),
    ("architecture.md", r"`HISTORY` \((\S+)\)", HISTORY, 1),
    ("architecture.md", r"descend \(≤ (\S+ ?\d*) per level", tuning.MAX_FRONTIER, 1),
    ("architecture.md", r"`home_regions`, at most (\S+ ?\d*) keys", HOME_CACHE_SIZE, 1),
    ("architecture.md", r"up to (\S+) queued keys", intake.MAX_STATES, 1),
    ("replication.md", r"ordered set of at most (\S+ ?\d*) keys", tuning.PUSH_QUEUE_LIMIT, 1),
    ("replication.md", r"takes up to (\S+) keys at a time", intake.MAX_STATES, 1),
    ("replication.md", r"batches of at most (\S+) states", intake.MAX_STATES, 1),
    ("replication.md", r"states and (\S+) MiB", intake.MAX_BATCH_BYTES, MIB),
    ("replication.md", r"a state over the (\S+) MiB", validation.MAX_RECORD_BYTES, MIB),
    ("replication.md", r"back-off \((\S+) s doubling", tuning.FIRST_BACKOFF_S, 1),
    ("replication.md", r"s doubling up to (\S+) s", tuning.MAX_BACKOFF_S, 1),
    ("replication.md", r"at most (\S+ ?\d*) nodes and", intake.MAX_LIST_NODES, 1),
    ("replication.md", r"nodes and (\S+ ?\d*)", intake.MAX_LIST_RECORDS, 1),
    ("replication.md", r"up to (\S+ ?\d*) listed records", tuning.MAX_ROUND_RECORDS, 1),
    ("replication.md", r"`Certificates\(key_ids\)` \(at most (\S+),", signers.MAX_KEY_IDS, 1),
    ("replication.md", r"keepalive pings \(every (\S+) s", tuning.KEEPALIVE_MS, 1000),
    ("replication.md", r"`nap_s` \(`Tuning`, (\S+) s", tuning.NAP_S, 1),
    ("replication.md", r"`nap_quiet_s` \((\S+) s, `Tuning`\)", tuning.NAP_QUIET_S, 1),
    ("replication.md", r"`heartbeat_s` \((\S+) s, `Tuning`\)", tuning.HEARTBEAT_S, 1),
    ("operations.md", r"stood still longer than (\S+) s", tuning.NAP_S, 1),
    ("replication.md", r"s, (\S+) s to answer\)", tuning.KEEPALIVE_TIMEOUT_MS, 1000),
    ("consistency.md", r"at most (\S+) fields,", validation.MAX_FIELDS, 1),
    ("consistency.md", r"(\S+) tags of at most", validation.MAX_TAGS, 1),
    ("consistency.md", r"tags of at most (\S+) characters", validation.MAX_TAG_CHARS, 1),
    ("consistency.md", r"values of at most (\S+) MiB", validation.MAX_VALUE_BYTES, MIB),
    ("api.md", r"The client caps it at (\S+) s", retry.MAX_RECONNECT_BACKOFF_MS, 1000),
    (
        "operations.md",
        r"a full collection a hundred times less often \(after (\S+) second",
        FULL_COLLECTION_EVERY,
        1,
    ),
    (
        "performance-history.md",
        r"full collection after (\S+) second-generation collections",
        FULL_COLLECTION_EVERY,
        1,
    ),
]


def number(text: str) -> float:
    """A number as the docs write it: ``10 000``, ``1 024``, ``2``, ``0.5``."""
    return float(text.replace(" ", "").replace(",", ""))


@pytest.mark.parametrize(("doc", "words", "value", "unit"), QUOTED)
def test_a_quoted_number_is_the_constant_it_names(
    doc: str, words: str, value: float, unit: float
) -> None:
    text = " ".join((DOCS / doc).read_text().split())  # quotes may wrap across lines
    found = re.search(words, text)
    assert found is not None, f"docs/{doc} no longer says {words!r}: update the row"
    assert number(found.group(1)) == value / unit, (
        f"docs/{doc} quotes {found.group(0)!r}, the code has {value / unit:g}"
    )

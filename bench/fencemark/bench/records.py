"""The typical record the benchmarks write: a backlog item like SPEC §1's walkthrough."""

from __future__ import annotations

REPO = "bench"
KIND, AUTHOR = "Note", "backlog-pm"
BODY = (
    "Batch the write-ahead log: group the fsyncs of concurrent writers into one commit,"
    " measure p99 before and after under 16 and 64 clients, and keep every"
    " acknowledged write durable across kill -9. Acceptance: the throughput at 64"
    " clients at least doubles and no acknowledged write is ever lost."
)


def record_id(group: str, index: int) -> str:
    return f"{group}-{index:07d}"


def typical_title(index: int) -> str:
    return f"Backlog item {index}: batch the WAL"


def typical_tags(home: str) -> list[str]:
    return [
        "backlog",
        "priority:P1",
        "phase:implementation",
        f"homeRegion:{home}",
        "baseBranch:feat/epic/wal-batching",
    ]


def typical_fields(index: int) -> dict[str, str]:
    """Every field of a typical record, by name (kind, author, title and body included)."""
    return {"kind": KIND, "author": AUTHOR, "title": typical_title(index), "body": BODY}

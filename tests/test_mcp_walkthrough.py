"""SPEC §1, word for word, through the MCP tools: the seven steps an agent takes.

``run_walkthrough`` drives the tools through any MCP client, given as a
``call(tool, arguments)`` that returns what the client saw (``Outcome``). Here
the client is the official SDK's, in memory, against a real in-process node
with 1 s leases; ``test_mcp_inspector.py`` drives the same steps through the
third-party MCP Inspector CLI.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from mcp import Client
from mcp_types import CallToolResult, TextContent

from fencemark.client import AsyncClient
from fencemark.mcp import CONFLICT_EXCEPTION, create_server
from fencemark.node.api.server import NodeServer

REPO, TOPIC, ID = "lattice", "backlog", "issue-2101"
KEY = f"repo/{REPO}/mem/{TOPIC}/{ID}"
TAGS = [
    "backlog",
    "priority:P1",
    "phase:implementation",
    "homeRegion:local",
    "baseBranch:feat/epic/wal-batching",
]
LAPSE_MARGIN_S = 0.25  # slept past a lease expiry: same machine, same clock
CLOCK_SLACK = timedelta(milliseconds=10)  # the node keeps timestamps in milliseconds


@dataclass(frozen=True)
class Outcome:
    """What an MCP client saw of one tool call."""

    is_error: bool
    structured: dict[str, Any]
    text: str


Call = Callable[[str, dict[str, Any]], Awaitable[Outcome]]


def outcome_of(result: CallToolResult) -> Outcome:
    text = "\n".join(block.text for block in result.content if isinstance(block, TextContent))
    return Outcome(result.is_error, dict(result.structured_content or {}), text)


def sdk_call(client: Client) -> Call:
    async def call(tool: str, arguments: dict[str, Any]) -> Outcome:
        return outcome_of(await client.call_tool(tool, arguments))

    return call


def expect_ok(outcome: Outcome) -> dict[str, Any]:
    assert not outcome.is_error, f"expected a result, got a tool error: {outcome.text}"
    return outcome.structured


def expect_conflict(outcome: Outcome, conflict: str, fence: int) -> None:
    """A fenced-write refusal: a tool error naming the exception, with the conflict data."""
    assert outcome.is_error, f"expected a refusal ({conflict}), got {outcome.structured}"
    assert CONFLICT_EXCEPTION in outcome.text
    error = outcome.structured["error"]
    assert error["exception"] == CONFLICT_EXCEPTION
    assert (error["conflict"], error["fence"], error["homeRegion"]) == (conflict, fence, "local")
    assert "Traceback" not in outcome.text


def utc(text: str) -> datetime:
    moment = datetime.fromisoformat(text)
    assert moment.tzinfo is not None, f"{text} is not an absolute UTC time"
    return moment


async def sleep_past(moment: datetime) -> None:
    remaining = (moment - datetime.now(UTC)).total_seconds()
    await asyncio.sleep(max(remaining, 0.0) + LAPSE_MARGIN_S)


async def run_walkthrough(call: Call, *, lease_seconds: float = 1.0) -> None:
    """The seven steps of SPEC §1 against a fresh node of region ``local`` with writes."""
    # 1. remember creates the record at a deterministic key; repeating it merges in place.
    remember = {
        "repoId": REPO,
        "topic": TOPIC,
        "id": ID,
        "kind": "Note",
        "author": "backlog-pm",
        "title": "Batch WAL fsyncs",
        "body": "Group commits so that one fsync covers many writes.",
        "tags": TAGS,
    }
    first = expect_ok(await call("repocontext_remember", remember))
    assert (first["created"], first["record"]["key"]) == (True, KEY)
    again = expect_ok(await call("repocontext_remember", remember))
    assert again["created"] is False
    assert set(TAGS) <= set(again["record"]["tags"])
    assert again["record"]["homeRegion"] == "local"
    listed = expect_ok(await call("repocontext_list", {"repoId": REPO, "topic": TOPIC}))
    assert [record["key"] for record in listed["records"]] == [KEY]

    # 2. claim by worker-a: granted, a fencing token, an absolute UTC lease expiry.
    before = datetime.now(UTC)
    claim_a = expect_ok(
        await call(
            "repocontext_claim", {"key": KEY, "owner": "worker-a", "leaseSeconds": lease_seconds}
        )
    )
    after = datetime.now(UTC)
    assert claim_a["granted"] is True and claim_a["homeRegion"] == "local"
    token_a = claim_a["fencingToken"]
    assert token_a >= 1
    expiry_a = utc(claim_a["leaseExpiresAtUtc"])  # the node's clock, which is ours here
    lease = timedelta(seconds=lease_seconds)
    assert before + lease - CLOCK_SLACK <= expiry_a <= after + lease + CLOCK_SLACK

    # 3. without the token the update is refused (claimed); with it, admitted.
    unfenced = {"key": KEY, "fields": {"body": "started"}}
    expect_conflict(await call("repocontext_update", unfenced), "claimed", token_a)
    fenced = expect_ok(await call("repocontext_update", {**unfenced, "fencingToken": token_a}))
    assert fenced["record"]["body"] == "started"

    # 4. after the lease lapses, worker-b is granted a strictly higher token.
    await sleep_past(expiry_a)
    claim_b = expect_ok(
        await call("repocontext_claim", {"key": KEY, "owner": "worker-b", "leaseSeconds": 60})
    )
    assert claim_b["granted"] is True
    token_b = claim_b["fencingToken"]
    assert token_b > token_a

    # 5. worker-a's old token is refused (superseded); its renewal says it lost the item.
    stale = {"key": KEY, "fields": {"body": "worker-a was here"}, "fencingToken": token_a}
    expect_conflict(await call("repocontext_update", stale), "superseded", token_b)
    renewal = expect_ok(
        await call(
            "repocontext_renew_claim", {"key": KEY, "fencingToken": token_a, "leaseSeconds": 60}
        )
    )
    assert (renewal["renewed"], renewal["reason"]) == (False, "superseded")

    # 7 (while claimed). The status shows worker-b's live claim, and is never authoritative.
    status = expect_ok(await call("repocontext_claim_status", {"key": KEY}))
    assert status["claim"]["owner"] == "worker-b"
    assert status["claim"]["fencingToken"] == token_b
    assert utc(status["claim"]["leaseExpiresAtUtc"]) == utc(claim_b["leaseExpiresAtUtc"])
    assert (status["fence"], status["queueDepth"], status["authoritative"]) == (token_b, 0, False)

    # 6. release succeeds, is idempotent, readmits unfenced writes, never lowers the fence.
    for _ in range(2):
        released = expect_ok(
            await call("repocontext_release_claim", {"key": KEY, "fencingToken": token_b})
        )
        assert (released["released"], released["fence"]) == (True, token_b)
    done = expect_ok(await call("repocontext_update", {"key": KEY, "fields": {"body": "done"}}))
    assert done["record"]["body"] == "done"
    expect_conflict(await call("repocontext_update", stale), "superseded", token_b)

    # 7 (after release). No live claim; the fence stays; still not authoritative.
    status = expect_ok(await call("repocontext_claim_status", {"key": KEY}))
    assert "claim" not in status
    assert (status["fence"], status["authoritative"]) == (token_b, False)
    recalled = expect_ok(await call("repocontext_recall", {"key": KEY}))
    assert (recalled["body"], recalled["fence"]) == ("done", token_b)


@pytest.fixture
async def fencemark_client(node: NodeServer) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(node.address) as client:
        yield client


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_the_walkthrough_works_through_the_tools(
    fencemark_client: AsyncClient, mode: str
) -> None:
    """``legacy``: JSON-RPC over in-memory streams; ``auto``: the SDK's in-process dispatch."""
    server = create_server(fencemark_client, writes_enabled=True)
    async with Client(server, mode=mode) as client:
        await run_walkthrough(sdk_call(client), lease_seconds=1.0)

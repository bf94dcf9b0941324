"""The MCP tool surface (issue: repocontext_* tools), through the official SDK's client.

Real nodes on loopback, the real ``fencemark.mcp`` server; the client is the
``mcp`` SDK's own: in memory for the rules, over stdio and streamable HTTP for
``fencemark mcp`` itself. The seven-step walkthrough is in
``test_mcp_walkthrough.py``; the third-party client in ``test_mcp_inspector.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped, unused-ignore]
import pytest
from mcp import Client, StdioServerParameters

from fencemark.client import AsyncClient
from fencemark.mcp import (
    CONFLICT_EXCEPTION,
    MUTATING_TOOL_NAMES,
    READ_TOOL_NAMES,
    create_server,
    open_server,
)
from fencemark.node.api.server import NodeServer
from tests.cluster import Cluster, eventually
from tests.conftest import StartNode
from tests.test_mcp_walkthrough import Outcome, expect_ok, outcome_of

ALL_TOOLS = {*MUTATING_TOOL_NAMES, *READ_TOOL_NAMES}
TOOL_ARGUMENTS = {
    "repocontext_remember": {
        "repoId", "topic", "id", "kind", "author", "title", "body", "tags"
    },
    "repocontext_update": {"key", "fields", "fencingToken"},
    "repocontext_claim": {"key", "owner", "leaseSeconds", "waitSeconds", "keepAlive"},
    "repocontext_renew_claim": {"key", "fencingToken", "leaseSeconds"},
    "repocontext_release_claim": {
        "key", "fencingToken", "outcome", "fields", "retryAfterSeconds"
    },
    "repocontext_claim_next": {
        "repoId", "topic", "owner", "leaseSeconds", "waitSeconds", "tags", "keepAlive"
    },
    "repocontext_wait_for_work": {
        "repoId", "topic", "owner", "leaseSeconds", "timeoutSeconds", "tags", "keepAlive"
    },
    "repocontext_claim_status": {"key"},
    "repocontext_recall": {"key"},
    "repocontext_list": {"repoId", "topic", "tag", "pageToken"},
}  # fmt: skip
SUBPROCESS_LIMIT_S = 60.0


@pytest.fixture
async def fencemark_client(node: NodeServer) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(node.address) as client:
        yield client


@contextlib.asynccontextmanager
async def tools_of(target: str, **client_options: Any) -> AsyncIterator[Client]:
    """An in-memory SDK client of the MCP server for the node at ``target``."""
    async with AsyncClient(target, **client_options) as fencemark:
        server = await open_server(fencemark)
        async with Client(server, mode="legacy") as client:
            yield client


async def call(client: Client, tool: str, **arguments: Any) -> Outcome:
    return outcome_of(await client.call_tool(tool, arguments))


async def seed(client: Client, id: str) -> str:
    result = await call(client, "repocontext_remember", repoId="docs", topic="mcp", id=id)
    key: str = expect_ok(result)["record"]["key"]
    return key


# -- the tool list -------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_a_writable_node_lists_every_tool_with_schemas(
    fencemark_client: AsyncClient, mode: str
) -> None:
    server = await open_server(fencemark_client)
    async with Client(server, mode=mode) as client:
        tools = {tool.name: tool for tool in (await client.list_tools()).tools}
    assert set(tools) == ALL_TOOLS
    for name, tool in tools.items():
        assert tool.description and len(tool.description) > 80, name
        assert set(tool.input_schema["properties"]) == TOOL_ARGUMENTS[name]
        assert tool.output_schema is not None and tool.output_schema["type"] == "object"
        assert tool.annotations is not None
        assert tool.annotations.read_only_hint is (name in READ_TOOL_NAMES), name
    claim = tools["repocontext_claim"]
    assert set(claim.input_schema["required"]) == {"key", "owner", "leaseSeconds"}
    assert claim.output_schema is not None
    assert {"granted", "fencingToken", "leaseExpiresAtUtc", "reason", "homeRegion"} <= set(
        claim.output_schema["properties"]
    )
    status = tools["repocontext_claim_status"].output_schema
    assert status is not None and status["properties"]["authoritative"]["const"] is False


async def test_a_read_only_node_lists_no_mutating_tool(start_node: StartNode) -> None:
    """Fail-closed (SPEC §6): not listed at all, rather than listed and failing."""
    read_only = await start_node(enable_writes=False)
    async with tools_of(read_only.address) as client:
        listed = {tool.name for tool in (await client.list_tools()).tools}
        assert listed == set(READ_TOOL_NAMES)
        refused = await call(client, "repocontext_claim", key="repo/a/mem/b/c", owner="w")
        assert refused.is_error and "Unknown tool" in refused.text
        found = expect_ok(await call(client, "repocontext_list", repoId="docs"))
        assert found == {"records": []}


# -- outcomes ------------------------------------------------------------------------


async def test_losing_a_claim_is_a_result_not_an_error(node: NodeServer) -> None:
    async with tools_of(node.address) as client:
        key = await seed(client, "contended")
        held = expect_ok(
            await call(client, "repocontext_claim", key=key, owner="worker-a", leaseSeconds=60)
        )
        lost = await call(client, "repocontext_claim", key=key, owner="worker-b", leaseSeconds=60)
        assert not lost.is_error
        assert lost.structured == {
            "key": key, "owner": "worker-b", "granted": False, "reason": "contended",
            "homeRegion": "local",
        }  # fmt: skip
        waited = await call(
            client, "repocontext_claim", key=key, owner="worker-b", leaseSeconds=60, waitSeconds=0.2
        )
        assert (waited.is_error, waited.structured["reason"]) == (False, "timeout")
        again = expect_ok(
            await call(client, "repocontext_claim", key=key, owner="worker-a", leaseSeconds=60)
        )
        assert again["fencingToken"] == held["fencingToken"]  # the owner's retry: same token
        missing = expect_ok(
            await call(
                client, "repocontext_claim", key="repo/docs/mem/mcp/nope", owner="w", leaseSeconds=5
            )
        )
        assert (missing["granted"], missing["reason"]) == (False, "missing")


async def test_a_claimed_record_refuses_remember_with_the_conflict(node: NodeServer) -> None:
    async with tools_of(node.address) as client:
        key = await seed(client, "claimed")
        expect_ok(await call(client, "repocontext_claim", key=key, owner="a", leaseSeconds=60))
        refused = await call(
            client, "repocontext_remember", repoId="docs", topic="mcp", id="claimed"
        )
        assert refused.is_error and refused.text.startswith(CONFLICT_EXCEPTION)
        assert refused.structured["error"]["conflict"] == "claimed"
        assert refused.structured["error"]["fence"] == 1


@pytest.mark.parametrize(
    ("tool", "arguments", "named"),
    [
        (
            "repocontext_claim",
            {"key": "repo/docs/mem/mcp/x", "leaseSeconds": 5},
            "owner is required",
        ),
        (
            "repocontext_claim",
            {"key": "repo/docs/mem/mcp/x", "owner": "w", "leaseSeconds": "soon"},
            "leaseSeconds: must be a number, not a string",
        ),
        (
            "repocontext_claim",
            {"key": "repo/docs/mem/mcp/x", "owner": "w", "leaseSeconds": 7200},
            "leaseSeconds: must be between 1 and 3600 (got 7200)",
        ),
        (
            "repocontext_claim",
            {"key": "repo/docs/mem/mcp/x", "owner": "w", "leaseSeconds": 5, "waitSeconds": 301},
            "waitSeconds: must be between 0 and 300 (got 301)",
        ),
        ("repocontext_recall", {"key": "not a key"}, "key: must be repo/{repo}/mem/{topic}/{id}"),
        (
            "repocontext_renew_claim",
            {"key": "repo/docs/mem/mcp/x", "fencingToken": -1, "leaseSeconds": 5},
            "fencingToken: must be between 1 and 18446744073709551615 (got -1)",
        ),
        (
            "repocontext_update",
            {"key": "repo/docs/mem/mcp/x", "fields": ["body"]},
            "fields: must be an object, not an array",
        ),
        (
            "repocontext_remember",
            {"repoId": "bad repo", "topic": "mcp", "id": "x"},
            "repoId: must match",
        ),
        ("repocontext_remember", {"repoId": "docs", "topic": "mcp"}, "id is required"),
    ],
)
async def test_bad_arguments_are_named(
    node: NodeServer, tool: str, arguments: dict[str, Any], named: str
) -> None:
    async with tools_of(node.address) as client:
        outcome = await call(client, tool, **arguments)
    assert outcome.is_error
    assert named in outcome.text, outcome.text
    assert "Traceback" not in outcome.text and "pydantic" not in outcome.text


async def test_a_node_that_is_down_is_a_clear_retryable_error(start_node: StartNode) -> None:
    doomed = await start_node()
    async with tools_of(doomed.address, timeout=1.0, retries=1) as client:
        key = await seed(client, "down")
        await doomed.stop()
        attempts: list[tuple[str, dict[str, Any]]] = [
            ("repocontext_recall", {"key": key}),
            ("repocontext_claim", {"key": key, "owner": "w", "leaseSeconds": 5}),
            ("repocontext_update", {"key": key, "fields": {"body": "x"}}),
        ]
        for tool, arguments in attempts:
            outcome = await call(client, tool, **arguments)
            assert outcome.is_error, tool
            assert outcome.text.startswith("Unavailable (retryable)"), outcome.text
            assert "Traceback" not in outcome.text
        assert "may or may not have been applied" in outcome.text  # update is not retried


async def test_a_region_map_routes_home_only_calls_home(tmp_path: Path) -> None:
    """The server in us, given the map, creates, claims and writes an eu record at eu."""
    async with Cluster(tmp_path, ["us", "eu"]) as cluster:
        await cluster.start_all()
        regions = dict(cluster.addresses)
        async with AsyncClient(regions["us"], regions=regions) as fencemark:

            async def serving() -> bool:
                return (await fencemark.info()).claims_serving

            await eventually(serving, "us serving claims")
            async with AsyncClient(regions["eu"]) as eu:

                async def eu_serving() -> bool:
                    return (await eu.info()).claims_serving

                await eventually(eu_serving, "eu serving claims")
            server = create_server(fencemark, writes_enabled=True)
            async with Client(server, mode="legacy") as client:
                made = expect_ok(
                    await call(
                        client, "repocontext_remember", repoId="docs", topic="mcp", id="eu-1",
                        tags=["homeRegion:eu"],
                    )
                )  # fmt: skip
                key = made["record"]["key"]
                assert made["record"]["homeRegion"] == "eu"
                claim = expect_ok(
                    await call(client, "repocontext_claim", key=key, owner="us-1", leaseSeconds=60)
                )
                assert (claim["granted"], claim["homeRegion"]) == (True, "eu")
                token = claim["fencingToken"]
                wrote = expect_ok(
                    await call(
                        client, "repocontext_update", key=key, fields={"body": "done"},
                        fencingToken=token,
                    )
                )  # fmt: skip
                assert wrote["record"]["body"] == "done"
                released = expect_ok(
                    await call(client, "repocontext_release_claim", key=key, fencingToken=token)
                )
                assert released["released"] is True


# -- fencemark mcp, a real process -----------------------------------------------------


def mcp_command(target: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "fencemark.node", "mcp", "--target", target, *extra]


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("FENCEMARK_")}


@contextlib.asynccontextmanager
async def http_server(target: str) -> AsyncIterator[str]:
    """``fencemark mcp --transport http`` on a free loopback port; yields its URL."""
    proc = await asyncio.create_subprocess_exec(
        *mcp_command(target, "--transport", "http", "--listen", "127.0.0.1:0"),
        stdin=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env=clean_env(),
    )
    assert proc.stderr is not None
    try:
        async with asyncio.timeout(SUBPROCESS_LIMIT_S):
            banner = (await proc.stderr.readline()).decode()
        found = re.search(r"http://127\.0\.0\.1:\d+/mcp", banner)
        assert found, f"no URL in {banner!r}"
        yield found.group(0)
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            async with asyncio.timeout(SUBPROCESS_LIMIT_S):
                code = await proc.wait()
            assert code == 0, f"fencemark mcp exited {code} on SIGTERM"


@pytest.mark.slow
async def test_fencemark_mcp_serves_stdio(node: NodeServer) -> None:
    params = StdioServerParameters(command=sys.executable, args=mcp_command(node.address)[1:])
    async with asyncio.timeout(SUBPROCESS_LIMIT_S), Client(params, mode="legacy") as client:
        listed = {tool.name for tool in (await client.list_tools()).tools}
        assert listed == ALL_TOOLS
        key = await seed(client, "stdio")
        assert key == "repo/docs/mem/mcp/stdio"


@pytest.mark.slow
async def test_fencemark_mcp_serves_streamable_http(node: NodeServer) -> None:
    async with http_server(node.address) as url, Client(url) as client:
        listed = {tool.name for tool in (await client.list_tools()).tools}
        assert listed == ALL_TOOLS
        key = await seed(client, "http")
        claim = expect_ok(
            await call(client, "repocontext_claim", key=key, owner="worker-a", leaseSeconds=60)
        )
        refused = await call(client, "repocontext_update", key=key, fields={"body": "x"})
        assert refused.is_error
        assert refused.structured["error"]["fence"] == claim["fencingToken"]
        # Over JSON on the wire too, true is not token 1 (tests/test_mcp_arguments.py).
        sneaky = await call(client, "repocontext_release_claim", key=key, fencingToken=True)
        assert sneaky.is_error
        assert "fencingToken: must be an integer, not a boolean (got true)" in sneaky.text


@pytest.mark.slow
async def test_fencemark_mcp_without_a_node_says_so_and_exits(tmp_path: Path) -> None:
    proc = await asyncio.create_subprocess_exec(
        *mcp_command("127.0.0.1:1", "--timeout", "0.5"),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=clean_env(),
    )
    async with asyncio.timeout(SUBPROCESS_LIMIT_S):
        out, err = await proc.communicate()
    assert proc.returncode == 1
    assert out == b""  # stdout is the protocol channel: nothing but MCP goes there
    assert "cannot reach the Fencemark node at 127.0.0.1:1" in err.decode()
    assert b"Traceback" not in err


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "complaint"),
    [
        (("--regions", "us"), "--regions takes REGION=HOST:PORT"),
        (("--transport", "http", "--listen", "nowhere"), "--listen takes HOST:PORT"),
    ],
)
async def test_fencemark_mcp_refuses_bad_flags(flags: tuple[str, ...], complaint: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        *mcp_command("127.0.0.1:1", *flags),
        stdin=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env=clean_env(),
    )
    async with asyncio.timeout(SUBPROCESS_LIMIT_S):
        _, err = await proc.communicate()
    assert proc.returncode == 2
    assert complaint in err.decode()


# -- the guide -------------------------------------------------------------------------

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "mcp.md"


def guide_examples() -> dict[str, list[tuple[Any, Any]]]:
    """docs/mcp.md's ``### `repocontext_*` `` sections: their JSON blocks, paired (call, result)."""
    sections: dict[str, list[Any]] = {}
    current: list[Any] | None = None
    lines = GUIDE.read_text(encoding="utf-8").splitlines()
    index = 0
    while index < len(lines):
        line = lines[index]
        heading = re.fullmatch(r"#{2,3} `?(repocontext_\w+)`?", line.strip())
        if heading:
            current = sections.setdefault(heading.group(1), [])
        elif line.startswith("#"):
            current = None
        elif line.strip() == "```json" and current is not None:
            end = lines.index("```", index + 1)
            current.append(json.loads("\n".join(lines[index + 1 : end])))
            index = end
        index += 1
    paired: dict[str, list[tuple[Any, Any]]] = {}
    for tool, blocks in sections.items():
        assert blocks and len(blocks) % 2 == 0, f"{tool}: JSON blocks must come as call, result"
        paired[tool] = list(zip(blocks[::2], blocks[1::2], strict=True))
    return paired


async def test_the_guide_shows_every_tool_with_a_call_and_result_that_fit_its_schemas(
    fencemark_client: AsyncClient,
) -> None:
    examples = guide_examples()
    assert set(examples) == ALL_TOOLS
    server = create_server(fencemark_client, writes_enabled=True)
    async with Client(server) as client:
        tools = {tool.name: tool for tool in (await client.list_tools()).tools}
    for name, pairs in examples.items():
        tool = tools[name]
        assert tool.output_schema is not None
        for arguments, result in pairs:
            jsonschema.validate(arguments, tool.input_schema)
            assert set(arguments) <= set(tool.input_schema["properties"]), name
            jsonschema.validate(result, tool.output_schema)
            assert set(result) <= set(tool.output_schema["properties"]), name

"""The tools take exactly what their input schemas say (issue: lax MCP arguments).

The bug these pin: the SDK's lax argument models took ``fencingToken: true``
and ``fencingToken: "1"`` as token 1 (so a release with ``true`` released the
claim of token 1), and dropped unknown arguments silently (so an update with
``fencing_token`` went through as an unfenced write). Real node on loopback,
the real server, the official SDK's client.
"""

from __future__ import annotations

from typing import Any

import jsonschema  # type: ignore[import-untyped, unused-ignore]
import pytest
from mcp import Client

from fencemark.mcp import MUTATING_TOOL_NAMES, READ_TOOL_NAMES
from fencemark.node.api.server import NodeServer
from tests.test_mcp import call, seed, tools_of
from tests.test_mcp_walkthrough import Outcome, expect_ok

ALL_TOOLS = {*MUTATING_TOOL_NAMES, *READ_TOOL_NAMES}
INVALID = "Invalid arguments for "


def refused_arguments(outcome: Outcome) -> bool:
    """The server refused the arguments themselves (not the node the call)."""
    return outcome.is_error and outcome.text.startswith(INVALID)


async def claimed(client: Client, id: str) -> tuple[str, dict[str, Any]]:
    """A record with worker-a's live claim (token 1) and body "before"; its key and claim."""
    key = await seed(client, id)
    expect_ok(await call(client, "repocontext_update", key=key, fields={"body": "before"}))
    claim = expect_ok(
        await call(client, "repocontext_claim", key=key, owner="worker-a", leaseSeconds=600)
    )
    assert claim["fencingToken"] == 1
    return key, claim


@pytest.mark.parametrize(
    ("token", "sent_as"),
    [(True, "a boolean"), ("1", "a string"), (1.5, "a decimal number"), ([1], "an array")],
)
async def test_a_fencing_token_is_a_json_integer_and_nothing_else(
    node: NodeServer, token: object, sent_as: str
) -> None:
    async with tools_of(node.address) as client:
        key, claim = await claimed(client, f"token-{sent_as.split()[-1]}")
        attempts: list[tuple[str, dict[str, Any]]] = [
            ("repocontext_update", {"key": key, "fields": {"body": "after"}}),
            ("repocontext_renew_claim", {"key": key, "leaseSeconds": 3600}),
            ("repocontext_release_claim", {"key": key}),
        ]
        for tool, arguments in attempts:
            outcome = await call(client, tool, **arguments, fencingToken=token)
            assert refused_arguments(outcome), (tool, outcome)
            assert f"fencingToken: must be an integer, not {sent_as}" in outcome.text
            assert outcome.structured == {}
        # Nothing happened: not written, not renewed, not released.
        status = expect_ok(await call(client, "repocontext_claim_status", key=key))
        assert status["claim"] == {
            "owner": "worker-a", "fencingToken": 1,
            "leaseExpiresAtUtc": claim["leaseExpiresAtUtc"],
        }  # fmt: skip
        record = expect_ok(await call(client, "repocontext_recall", key=key))
        assert record["body"] == "before"
        # The same calls with the integer are the claim holder's.
        wrote = expect_ok(
            await call(
                client, "repocontext_update", key=key, fields={"body": "after"}, fencingToken=1
            )
        )
        assert wrote["record"]["body"] == "after"


async def test_an_unknown_argument_is_refused_by_name_not_dropped(node: NodeServer) -> None:
    async with tools_of(node.address) as client:
        key = await seed(client, "misspelt")
        outcome = await call(
            client, "repocontext_update", key=key, fields={"body": "unfenced?"}, fencing_token=1
        )
        assert refused_arguments(outcome)
        assert (
            "unknown argument fencing_token (repocontext_update takes key, fields, fencingToken)"
            in outcome.text
        )
        record = expect_ok(await call(client, "repocontext_recall", key=key))
        assert "body" not in record  # not written as an unfenced update
        several = await call(client, "repocontext_recall", key=key, verbose=True, format="json")
        assert refused_arguments(several)
        assert "unknown arguments verbose, format (repocontext_recall takes key)" in several.text


@pytest.mark.parametrize("tool", sorted(ALL_TOOLS))
async def test_every_tool_refuses_an_argument_it_does_not_take(node: NodeServer, tool: str) -> None:
    valid: dict[str, dict[str, Any]] = {
        "repocontext_remember": {"repoId": "docs", "topic": "mcp", "id": "never"},
        "repocontext_update": {"key": "repo/docs/mem/mcp/never", "fields": {}},
        "repocontext_claim": {"key": "repo/docs/mem/mcp/never", "owner": "w", "leaseSeconds": 5},
        "repocontext_renew_claim": {
            "key": "repo/docs/mem/mcp/never", "fencingToken": 1, "leaseSeconds": 5
        },
        "repocontext_release_claim": {"key": "repo/docs/mem/mcp/never", "fencingToken": 1},
        "repocontext_claim_next": {
            "repoId": "docs", "topic": "mcp", "owner": "w", "leaseSeconds": 5
        },
        "repocontext_wait_for_work": {
            "repoId": "docs", "topic": "mcp", "owner": "w", "leaseSeconds": 5,
            "timeoutSeconds": 0,
        },
        "repocontext_claim_status": {"key": "repo/docs/mem/mcp/never"},
        "repocontext_recall": {"key": "repo/docs/mem/mcp/never"},
        "repocontext_list": {"repoId": "docs"},
    }  # fmt: skip
    async with tools_of(node.address) as client:
        outcome = await call(client, tool, **valid[tool], homeRegion="local")
        assert refused_arguments(outcome)
        assert "unknown argument homeRegion" in outcome.text
        listed = expect_ok(await call(client, "repocontext_list", repoId="docs"))
        assert listed == {"records": []}  # the remember did not happen either


async def test_json_inside_a_string_is_a_string(node: NodeServer) -> None:
    async with tools_of(node.address) as client:
        tags = await call(
            client, "repocontext_remember", repoId="docs", topic="mcp", id="x", tags='["a"]'
        )
        assert refused_arguments(tags)
        assert 'tags: must be an array, not a string (got "[\\"a\\"]")' in tags.text
        key = await seed(client, "x")
        fields = await call(client, "repocontext_update", key=key, fields='{"body": "x"}')
        assert refused_arguments(fields)
        assert "fields: must be an object, not a string" in fields.text


async def test_the_published_schemas_close_every_tool_and_bound_every_number(
    node: NodeServer,
) -> None:
    async with tools_of(node.address) as client:
        tools = (await client.list_tools()).tools
    assert {tool.name for tool in tools} == ALL_TOOLS
    for tool in tools:
        schema = tool.input_schema
        assert schema["additionalProperties"] is False, tool.name
        jsonschema.Draft202012Validator.check_schema(schema)
        for name, prop in schema["properties"].items():
            choices = [choice for choice in [prop, *prop.get("anyOf", ())] if "type" in choice]
            for choice in choices:
                if choice["type"] in ("integer", "number"):
                    assert "minimum" in choice and "maximum" in choice, (tool.name, name)
            if name == "fencingToken":
                types = {choice["type"] for choice in choices}
                assert "integer" in types and types <= {"integer", "null"}, tool.name
    claim = next(tool for tool in tools if tool.name == "repocontext_claim")
    lease = claim.input_schema["properties"]["leaseSeconds"]
    assert (lease["type"], lease["minimum"], lease["maximum"]) == ("number", 1, 3600)


KEY = "repo/docs/mem/mcp/agree"
TOO_BIG = 2**64


@pytest.mark.parametrize(
    ("tool", "arguments", "valid"),
    [
        ("repocontext_renew_claim", {"fencingToken": 1, "leaseSeconds": 600}, True),
        ("repocontext_renew_claim", {"fencingToken": 1.0, "leaseSeconds": 600.0}, True),
        ("repocontext_renew_claim", {"fencingToken": 1, "leaseSeconds": 0.5}, False),
        ("repocontext_renew_claim", {"fencingToken": 1, "leaseSeconds": 3601}, False),
        ("repocontext_renew_claim", {"fencingToken": True, "leaseSeconds": 600}, False),
        ("repocontext_renew_claim", {"fencingToken": "1", "leaseSeconds": 600}, False),
        ("repocontext_renew_claim", {"fencingToken": 0, "leaseSeconds": 600}, False),
        ("repocontext_renew_claim", {"fencingToken": TOO_BIG, "leaseSeconds": 600}, False),
        ("repocontext_renew_claim", {"fencingToken": None, "leaseSeconds": 600}, False),
        ("repocontext_renew_claim", {"fencingToken": 1, "leaseSeconds": "600"}, False),
        ("repocontext_renew_claim", {"fencingToken": 1}, False),
        ("repocontext_claim", {"owner": "worker-a", "leaseSeconds": 600}, True),
        ("repocontext_claim", {"owner": "worker-a", "leaseSeconds": 600, "waitSeconds": 0}, True),
        ("repocontext_claim", {"owner": "worker-a", "leaseSeconds": 60, "waitSeconds": 301}, False),
        ("repocontext_claim", {"owner": "worker-a", "leaseSeconds": False}, False),
        ("repocontext_claim", {"owner": 7, "leaseSeconds": 600}, False),
        ("repocontext_update", {"fields": {"body": "x"}, "fencingToken": 1}, True),
        ("repocontext_update", {"fields": {"body": "x"}, "fencingToken": None}, True),
        ("repocontext_update", {"fields": {"body": "x"}}, True),
        ("repocontext_update", {"fields": {"body": 1}, "fencingToken": 1}, False),
        ("repocontext_update", {"fields": {"body": "x"}, "fencingToken": False}, False),
        ("repocontext_update", {"fields": {"body": "x"}, "fencingToken": -1}, False),
        ("repocontext_update", {"fields": {"body": "x"}, "fencing_token": 1}, False),
        ("repocontext_claim_status", {}, True),
        ("repocontext_claim_status", {"verbose": True}, False),
        ("repocontext_recall", {"key": None}, False),
    ],
)  # fmt: skip
async def test_the_server_accepts_exactly_what_the_schema_accepts(
    node: NodeServer, tool: str, arguments: dict[str, Any], valid: bool
) -> None:
    """``valid`` is JSON Schema's verdict (jsonschema); the server must agree.

    Arguments the schema admits may still be refused by the node or the claim
    (``claimed``); what matters is that the server does not refuse them as arguments.
    """
    arguments = {"key": KEY, **arguments}
    async with tools_of(node.address) as client:
        await claimed(client, "agree")
        schema = next(t for t in (await client.list_tools()).tools if t.name == tool).input_schema
        errors = list(jsonschema.Draft202012Validator(schema).iter_errors(arguments))
        assert (not errors) is valid, errors
        outcome = await call(client, tool, **arguments)
    assert refused_arguments(outcome) is not valid, outcome.text

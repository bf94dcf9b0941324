"""The adoption template (SPEC §7): what ``fencemark init`` writes into a repository.

A repository uses everything in ``template/`` but the bindings unmodified, so what
it tells an agent must hold for the server the agent talks to: every tool it names
is published, every argument it names is in that tool's input schema, every reason
word is one a node or the server answers, and every rule of the protocol cites a
SPEC section that exists. Tools and schemas come from a real server built in
memory; listing its tools calls no node.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import shlex
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from fencemark.client import AsyncClient
from fencemark.client.keepalive import UNREACHABLE
from fencemark.mcp import (
    CONFLICT_EXCEPTION,
    MUTATING_TOOL_NAMES,
    READ_TOOL_NAMES,
    create_server,
)
from fencemark.node.crdt.record import STATUSES
from fencemark.node.rules.errors import Denial, Reason
from fencemark.node.tools.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "template"
PROTOCOL = TEMPLATE / "protocol.md"
BINDINGS = TEMPLATE / "bindings.toml"
AGENTS = {"worker": TEMPLATE / "agents" / "worker.md", "pm": TEMPLATE / "agents" / "backlog-pm.md"}


SPEC = ROOT / "docs" / "spec.md"  # the contract; `fencemark init` writes it beside the protocol

SERVER = "fencemark"  # the server's name in the MCP configuration
PREFIX = f"mcp__{SERVER}__"  # how Claude Code names an MCP server's tools
# Claude Code's own tools an agent definition may also list.
BUILT_IN_TOOLS = {"Read", "Edit", "Write", "Glob", "Grep", "Bash"}
CLAIM_TOOLS = {
    "repocontext_claim",
    "repocontext_claim_next",
    "repocontext_wait_for_work",
    "repocontext_renew_claim",
    "repocontext_release_claim",
}
# What a node or the MCP server answers as a reason: claim, renewal and release
# outcomes and conflict words (SPEC §4, §8), a keepalive that could not reach the
# home before the lease ran out (SPEC §9), and a token of another identity.
REASONS = {*(reason.value for reason in Reason), UNREACHABLE, Denial.NOT_HOLDER.value}
# Names the template itself defines: the item field that holds the resume block.
TEMPLATE_WORDS = {"resume"}
IDENTIFIER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?:: (\S+))?")
TOOL_NAME = re.compile(r"repocontext_\w+")


@dataclass(frozen=True)
class Published:
    """The tools a writable node's server lists, and what their schemas name."""

    inputs: dict[str, set[str]]  # tool -> its arguments
    outputs: dict[str, set[str]]  # tool -> every property name of its results
    values: set[str]  # every enum value of every schema (outcomes, keepAlive states)


def _walk(schema: Any) -> Iterator[dict[str, Any]]:
    if isinstance(schema, dict):
        yield schema
        for value in schema.values():
            yield from _walk(value)
    elif isinstance(schema, list):
        for value in schema:
            yield from _walk(value)


@functools.cache
def published() -> Published:
    async def listed() -> Published:
        async with AsyncClient("127.0.0.1:9") as client:  # never called
            tools = await create_server(client, writes_enabled=True).list_tools()
        inputs = {tool.name: set(tool.input_schema["properties"]) for tool in tools}
        outputs = {
            tool.name: {
                name for part in _walk(tool.output_schema) for name in part.get("properties", {})
            }
            for tool in tools
        }
        values = {
            str(value)
            for tool in tools
            for part in _walk([tool.input_schema, tool.output_schema])
            for value in part.get("enum", [])
        }
        return Published(inputs, outputs, values)

    return asyncio.run(listed())


def rules(markdown: str) -> list[str]:
    """The list items of ``markdown``, each joined with its continuation lines."""
    items: list[str] = []
    in_item = False
    for line in markdown.splitlines():
        if re.match(r"\s*(?:[-*]|\d+\.)\s", line):
            items.append(line.strip())
            in_item = True
        elif in_item and line.startswith(" ") and line.strip():
            items[-1] += " " + line.strip()
        else:
            in_item = False
    return items


def spans(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


def front_matter(path: Path) -> tuple[dict[str, Any], str]:
    text = path.read_text()
    assert text.startswith("---\n"), f"{path.name}: no YAML front matter"
    header, _, body = text[4:].partition("\n---\n")
    meta = yaml.safe_load(header)
    assert isinstance(meta, dict), path.name
    return meta, body


def agent_tools(path: Path) -> list[str]:
    meta, _ = front_matter(path)
    return [tool.strip() for tool in str(meta["tools"]).split(",")]


def filled_bindings(**values: str) -> str:
    text = BINDINGS.read_text()
    for name, value in values.items():
        text = text.replace("{{" + name + "}}", value)
    return text


SAMPLE = {
    "repo": "lattice",
    "region": "us",
    "regions": 'us = "127.0.0.1:7400"\neu = "127.0.0.1:7401"',
}


# -- tools ---------------------------------------------------------------------------


def test_the_server_publishes_the_tools_fencemark_mcp_names() -> None:
    assert set(published().inputs) == {*MUTATING_TOOL_NAMES, *READ_TOOL_NAMES}


@pytest.mark.parametrize(
    "path", sorted(p for p in TEMPLATE.rglob("*") if p.is_file()), ids=lambda p: p.name
)
def test_every_tool_the_template_names_is_published(path: Path) -> None:
    named = set(TOOL_NAME.findall(path.read_text()))
    unknown = named - set(published().inputs)
    assert not unknown, f"{path.relative_to(ROOT)} names tools the server does not publish"


@pytest.mark.parametrize("role", sorted(AGENTS))
def test_an_agent_lists_only_published_tools_and_claude_codes_own(role: str) -> None:
    meta, _ = front_matter(AGENTS[role])
    assert meta["name"].startswith("fencemark-") and len(meta["description"]) > 40
    for tool in agent_tools(AGENTS[role]):
        if tool.startswith("mcp__"):
            assert tool.startswith(PREFIX), f"{tool}: the MCP server is named {SERVER!r}"
            assert tool.removeprefix(PREFIX) in published().inputs, tool
        else:
            assert tool in BUILT_IN_TOOLS, f"{tool}: not a Claude Code tool"
    assert len(set(agent_tools(AGENTS[role]))) == len(agent_tools(AGENTS[role])), "listed twice"


def mcp_tools(role: str) -> set[str]:
    tools = agent_tools(AGENTS[role])
    return {tool.removeprefix(PREFIX) for tool in tools if tool.startswith(PREFIX)}


def test_the_worker_drains_by_the_protocol_and_files_nothing() -> None:
    tools = mcp_tools("worker")
    assert CLAIM_TOOLS - {"repocontext_claim"} <= tools
    assert "repocontext_update" in tools  # the resume block, under the token
    # It takes work from the queue, never by key, and files no items: the PM does.
    assert not tools & {"repocontext_claim", "repocontext_remember"}
    _, body = front_matter(AGENTS["worker"])
    assert ".fencemark/protocol.md" in body


def test_the_backlog_pm_files_items_and_claims_none() -> None:
    tools = mcp_tools("pm")
    assert "repocontext_remember" in tools
    assert not tools & CLAIM_TOOLS
    assert not tools & {"repocontext_update"}  # it never writes to an item a worker holds


def test_the_backlog_pm_reopens_with_the_cli_because_no_tool_does() -> None:
    """If an MCP tool comes to reopen items, give it to the PM instead of the CLI."""
    assert not [name for name in published().inputs if "reopen" in name]
    commands = [
        span
        for span in spans(AGENTS["pm"].read_text())
        if re.match(r"fencemark (reopen|update) ", span)
    ]
    assert any(command.startswith("fencemark reopen ") for command in commands)
    parser = build_parser()
    for command in commands:
        try:
            parser.parse_args(shlex.split(command)[1:])
        except SystemExit:
            pytest.fail(f"the CLI does not take {command!r}")


# -- the protocol --------------------------------------------------------------------


def test_every_word_the_protocol_quotes_is_a_tool_argument_reason_or_value() -> None:
    """Arguments are checked against the tools named in the same rule (any tool's,
    when a rule names none); a lowercase word that is no argument or result field
    must be a reason the server can answer, or a value its schemas list."""
    tools = published()
    known_values = tools.values | set(STATUSES) | {"true", "false"}
    words = REASONS | known_values | TEMPLATE_WORDS | {CONFLICT_EXCEPTION, SERVER}
    words |= set(tomllib.loads(filled_bindings(**SAMPLE)))
    for rule in rules(PROTOCOL.read_text()):
        named = set(TOOL_NAME.findall(rule)) or set(tools.inputs)
        fields = set().union(*(tools.inputs[t] | tools.outputs[t] for t in named))
        for span in spans(rule):
            match = IDENTIFIER.fullmatch(span)
            if match is None or TOOL_NAME.fullmatch(span):
                continue
            name, value = match.groups()
            assert name in fields or name in words, f"{span!r} is nothing the server knows: {rule}"
            if value is not None:
                assert name in fields, f"{span!r}: no tool of this rule takes {name}: {rule}"
                assert value.strip('"') in known_values, f"{span!r}: not a value of {name}"


def test_the_protocol_names_the_arguments_of_a_claim_it_relies_on() -> None:
    inputs = published().inputs
    quoted = set(spans(PROTOCOL.read_text()))
    for tool, argument in [
        ("repocontext_wait_for_work", "keepAlive"),
        ("repocontext_wait_for_work", "timeoutSeconds"),
        ("repocontext_renew_claim", "fencingToken"),
        ("repocontext_release_claim", "outcome"),
        ("repocontext_release_claim", "retryAfterSeconds"),
        ("repocontext_release_claim", "fields"),
    ]:
        assert argument in inputs[tool], (tool, argument)
        assert argument in quoted or f"{argument}: true" in quoted, argument
    outcomes = {"done", "failed", "deferred"}
    assert outcomes <= published().values and outcomes <= quoted


def test_the_protocol_quotes_the_reasons_an_agent_must_act_on() -> None:
    quoted = set(spans(PROTOCOL.read_text()))
    wanted = {"superseded", "contended", "timeout", "missing", "empty", "wrong_region"}
    assert wanted <= quoted & REASONS


def test_every_rule_of_the_protocol_cites_the_spec() -> None:
    found = rules(PROTOCOL.read_text())
    assert len(found) >= 10
    uncited = [rule for rule in found if not re.search(r"SPEC §\d", rule)]
    assert not uncited, "rules without a SPEC section:\n" + "\n".join(uncited)


def test_every_cited_spec_section_exists() -> None:
    sections = set(re.findall(r"^## (\d+)\. ", SPEC.read_text(), re.MULTILINE))
    cited: set[str] = set()
    for path in TEMPLATE.rglob("*.md"):
        plain = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", path.read_text())  # links as their text
        for group in re.findall(r"SPEC (§\d+(?:, §\d+)*)", plain):
            cited |= set(re.findall(r"§(\d+)", group))
    assert cited and cited <= sections, sorted(cited - sections)


def test_the_protocol_links_each_cited_section_to_the_spec_beside_it() -> None:
    """Init writes the contract as .fencemark/spec.md, beside the protocol: a citation
    links there (tests/test_links.py follows every link after a real init)."""
    text = PROTOCOL.read_text()
    linked = re.findall(r"\[(?:SPEC )?§(\d+)\]\(spec\.md#(\d+)-[a-z0-9-]+\)", text)
    assert len(linked) >= len(re.findall(r"§\d+", text)) > 10
    assert all(cited == anchored for cited, anchored in linked)


# -- bindings and MCP configuration --------------------------------------------------


def test_the_bindings_have_exactly_the_three_placeholders() -> None:
    text = BINDINGS.read_text()
    assert sorted(re.findall(r"\{\{(.*?)\}\}", text)) == sorted(SAMPLE)
    filled = filled_bindings(**SAMPLE)
    assert "{{" not in filled and "}}" not in filled


def test_the_filled_bindings_parse() -> None:
    bindings = tomllib.loads(filled_bindings(**SAMPLE))
    assert bindings["repo"] == "lattice" and bindings["region"] == "us"
    assert bindings["topic"] == "backlog"
    assert bindings["regions"] == {"us": "127.0.0.1:7400", "eu": "127.0.0.1:7401"}


def test_the_commented_priorities_are_valid_when_uncommented() -> None:
    lines = filled_bindings(**SAMPLE).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# [priorities]"))
    block = "\n".join(line.removeprefix("# ") for line in lines[start:] if line.startswith("# "))
    priorities = tomllib.loads(block)["priorities"]
    assert priorities and all(re.fullmatch(r"P[0-9]", tag) for tag in priorities.values())


@pytest.mark.parametrize("name", ["stdio.json", "http.json"])
def test_the_mcp_configurations_name_the_server_fencemark(name: str) -> None:
    text = (TEMPLATE / "mcp" / name).read_text()
    config = json.loads(text)
    assert text == json.dumps(config, indent=2) + "\n"
    assert list(config["mcpServers"]) == [SERVER]


def test_the_stdio_server_reads_the_bindings_and_the_http_one_is_started_so() -> None:
    stdio = json.loads((TEMPLATE / "mcp" / "stdio.json").read_text())["mcpServers"][SERVER]
    assert stdio == {
        "command": "fencemark",
        "args": ["mcp", "--bindings", ".fencemark/bindings.toml"],
    }
    http = json.loads((TEMPLATE / "mcp" / "http.json").read_text())["mcpServers"][SERVER]
    assert http["type"] == "http"
    listen = http["url"].removeprefix("http://").removesuffix("/mcp")
    readme = (TEMPLATE / "README.md").read_text()
    assert f"--transport http --listen {listen}" in readme


def test_the_readme_names_every_file_of_the_template() -> None:
    readme = (TEMPLATE / "README.md").read_text()
    for path in TEMPLATE.rglob("*"):
        if path.is_file():
            assert f"`{path.relative_to(TEMPLATE)}`" in readme, path

"""A third-party client: the MCP Inspector CLI (npm @modelcontextprotocol/inspector).

It lists and calls the tools of ``fencemark mcp`` over stdio (the Inspector
spawns the server) and over streamable HTTP (a server subprocess on a free
loopback port), and drives the SPEC §1 walkthrough, whose refusals must come
back as tool errors. The Inspector exits 0 for a result and 5 (``TOOL_ERROR``)
for a result with ``isError: true``; it also validates every structured content
against the tool's output schema, error results included (a mismatch exits 1).

It also waits for work (``repocontext_wait_for_work``) in a session whose claim,
kept alive, lapses when the run ends, and lists and reads the changes resource
(its ``--cli`` mode has no ``resources/subscribe``: an SDK client subscribes).

It runs on Node >= 22 from the project-local prefix ``.ci/ensure-inspector``
installs (``make inspector``). Without it these tests skip, except under CI
(``CI`` set), where they fail: CI must have installed it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from mcp import Client
from mcp.shared.exceptions import MCPDeprecationWarning
from mcp_types import ResourceUpdatedNotification

from fencemark.client import AsyncClient
from fencemark.mcp import MUTATING_TOOL_NAMES, READ_TOOL_NAMES
from fencemark.node.api.server import NodeServer
from tests import components
from tests.cluster import eventually
from tests.conftest import StartNode
from tests.test_mcp import clean_env, http_server, mcp_command
from tests.test_mcp_feed import no_stream_left, waiting_in_line
from tests.test_mcp_walkthrough import (
    KEY,
    Call,
    Outcome,
    expect_conflict,
    expect_ok,
    run_walkthrough,
)

pytestmark = pytest.mark.slow  # every test spawns Node and Python processes

ROOT = Path(__file__).resolve().parent.parent
INSTALLER = ROOT / ".ci" / "ensure-inspector"
PREFIX, BIN = components.INSPECTOR_PREFIX, components.INSPECTOR_BIN
EXIT_OK, EXIT_TOOL_ERROR = 0, 5
INSPECTOR_LIMIT_S = 90.0
ALL_TOOLS = {*MUTATING_TOOL_NAMES, *READ_TOOL_NAMES}


def pinned_version() -> str:
    found = re.search(r"^INSPECTOR_VERSION=(\S+)", INSTALLER.read_text(), re.MULTILINE)
    assert found, f"{INSTALLER} pins no INSPECTOR_VERSION"
    return found.group(1)


@dataclass(frozen=True)
class Inspector:
    """The installed Inspector CLI and the Node that runs it."""

    node: Path
    script: Path
    home: Path

    async def run(self, *args: str) -> tuple[int, Any, str]:
        """Run ``mcp-inspector --cli ARGS``: exit code, the JSON on stdout, stderr."""
        env = {
            **clean_env(),
            "PATH": f"{self.node.parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "HOME": str(self.home),  # whatever it keeps under ~/.mcp-inspector stays here
            "NO_COLOR": "1",
        }
        proc = await asyncio.create_subprocess_exec(
            str(self.node),
            str(self.script),
            "--cli",
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            cwd=self.home,
        )
        async with asyncio.timeout(INSPECTOR_LIMIT_S):
            out, err = await proc.communicate()
        assert proc.returncode is not None
        stdout = out.decode(errors="replace")
        try:
            payload = json.loads(stdout) if stdout.strip() else None
        except ValueError:
            payload = stdout
        return proc.returncode, payload, err.decode(errors="replace")

    async def list_tools(self, *server: str) -> list[dict[str, Any]]:
        code, payload, err = await self.run(
            "--method", "tools/list", "--strict", "--format", "json", *server
        )
        assert code == EXIT_OK, f"tools/list exited {code}: {err}"
        tools: list[dict[str, Any]] = payload["result"]["tools"]
        return tools

    def caller(self, *server: str) -> Call:
        """``call(tool, arguments)`` through the Inspector, for the walkthrough."""

        async def call(tool: str, arguments: dict[str, Any]) -> Outcome:
            code, payload, err = await self.run(
                "--method", "tools/call", "--tool-name", tool,
                "--tool-args-json", json.dumps(arguments), "--format", "json", *server,
            )  # fmt: skip
            assert code in (EXIT_OK, EXIT_TOOL_ERROR), f"{tool} exited {code}: {payload} {err}"
            result = payload["result"]
            is_error = bool(result.get("isError"))
            assert is_error == (code == EXIT_TOOL_ERROR), f"exit {code} for isError {is_error}"
            if is_error:
                assert "tool_is_error" in err
            text = "\n".join(block["text"] for block in result["content"] if "text" in block)
            return Outcome(is_error, result.get("structuredContent") or {}, text)

        return call


@pytest.fixture(scope="module")
def installed() -> tuple[Path, Path]:
    components.require("inspector")
    node, script = BIN / "node", BIN / "mcp-inspector"
    return node, script.resolve()


@pytest.fixture
def inspector(installed: tuple[Path, Path], tmp_path: Path) -> Inspector:
    home = tmp_path / "home"
    home.mkdir()
    node, script = installed
    return Inspector(node=node, script=script, home=home)


def stdio_server(target: str) -> list[str]:
    """The Inspector's target: the command that starts ``fencemark mcp`` over stdio."""
    return ["--", *mcp_command(target)]


async def test_the_inspector_is_the_pinned_version_on_node_22(inspector: Inspector) -> None:
    proc = await asyncio.create_subprocess_exec(
        str(inspector.node), str(inspector.script), "--version",
        stdout=asyncio.subprocess.PIPE, env=clean_env(),
    )  # fmt: skip
    async with asyncio.timeout(INSPECTOR_LIMIT_S):
        out, _ = await proc.communicate()
    assert out.decode().strip() == pinned_version()
    version = await asyncio.create_subprocess_exec(
        str(inspector.node), "--version", stdout=asyncio.subprocess.PIPE
    )
    major = int((await version.communicate())[0].decode().lstrip("v").split(".")[0])
    assert major >= 22


async def test_the_inspector_lists_the_tools_over_stdio(
    inspector: Inspector, node: NodeServer, start_node: StartNode
) -> None:
    """``--strict`` also fails on any tool schema the Inspector finds unportable."""
    tools = await inspector.list_tools(*stdio_server(node.address))
    assert {tool["name"] for tool in tools} == ALL_TOOLS
    for tool in tools:
        assert tool["description"] and tool["inputSchema"]["type"] == "object"
        assert tool["outputSchema"]["type"] == "object", tool["name"]
    read_only = await start_node(enable_writes=False)
    tools = await inspector.list_tools(*stdio_server(read_only.address))
    assert {tool["name"] for tool in tools} == set(READ_TOOL_NAMES)


async def test_the_inspector_calls_the_tools_over_stdio(
    inspector: Inspector, node: NodeServer
) -> None:
    call = inspector.caller(*stdio_server(node.address))
    made = expect_ok(
        await call(
            "repocontext_remember",
            {"repoId": "lattice", "topic": "backlog", "id": "issue-2101", "tags": ["backlog"]},
        )
    )
    assert made["record"]["key"] == KEY
    claim = expect_ok(
        await call("repocontext_claim", {"key": KEY, "owner": "worker-a", "leaseSeconds": 3600})
    )
    token = claim["fencingToken"]
    lost = expect_ok(
        await call("repocontext_claim", {"key": KEY, "owner": "worker-b", "leaseSeconds": 60})
    )
    assert (lost["granted"], lost["reason"]) == (False, "contended")  # exit 0: an answer
    refused = await call("repocontext_update", {"key": KEY, "fields": {"body": "x"}})
    expect_conflict(refused, "claimed", token)  # exit 5: a tool error
    bad = await call("repocontext_claim", {"key": KEY, "owner": "w", "leaseSeconds": 7200})
    assert bad.is_error and "leaseSeconds: must be between 1 and 3600" in bad.text
    # Strict arguments (docs/mcp.md): true is no token, an unknown name is refused.
    sneaky = await call("repocontext_release_claim", {"key": KEY, "fencingToken": True})
    assert sneaky.is_error and "fencingToken: must be an integer, not a boolean" in sneaky.text
    misspelt = await call("repocontext_release_claim", {"key": KEY, "fencing_token": token})
    assert misspelt.is_error and "unknown argument fencing_token" in misspelt.text
    still = expect_ok(await call("repocontext_claim_status", {"key": KEY}))
    assert still["claim"]["fencingToken"] == token  # neither call released it


async def test_the_inspector_drains_a_queue_with_claim_next_and_an_outcome(
    inspector: Inspector, node: NodeServer
) -> None:
    """SPEC §8 through the Inspector: claim the next item, release it done with its
    result; then nothing is left (an answer, not an error), and the record says so."""
    call = inspector.caller(*stdio_server(node.address))
    expect_ok(await call("repocontext_remember", {"repoId": "q", "topic": "t", "id": "only"}))
    args = {"repoId": "q", "topic": "t", "owner": "worker-a", "leaseSeconds": 60}
    picked = expect_ok(await call("repocontext_claim_next", args))
    assert picked["granted"] and picked["record"]["id"] == "only"
    key, token = picked["record"]["key"], picked["fencingToken"]
    released = expect_ok(
        await call(
            "repocontext_release_claim",
            {"key": key, "fencingToken": token, "outcome": "done", "fields": {"result": "ok"}},
        )
    )
    assert released["released"]
    empty = expect_ok(await call("repocontext_claim_next", args))
    assert (empty["granted"], empty["reason"]) == (False, "empty")
    record = expect_ok(await call("repocontext_recall", {"key": key}))
    assert (record["status"], record["lastOutcome"], record["fields"]) == (
        "done",
        "done",
        {"result": "ok"},
    )


async def test_the_walkthrough_through_the_inspector_over_http(
    inspector: Inspector, node: NodeServer
) -> None:
    """Each step is one Inspector run against one ``fencemark mcp --transport http``.

    worker-a's lease is 5 s rather than 1 s: an Inspector run takes most of a
    second, and step 3 makes two of them while the claim must still be live.
    """
    async with http_server(node.address) as url:
        tools = await inspector.list_tools("--transport", "http", url)
        assert {tool["name"] for tool in tools} == ALL_TOOLS
        await run_walkthrough(inspector.caller("--transport", "http", url), lease_seconds=5.0)


# -- the change feed and keepalive (issue 18) -------------------------------------------------


async def test_the_inspector_waits_for_work_and_its_session_s_keepalive_ends_with_it(
    inspector: Inspector, node: NodeServer, client: AsyncClient
) -> None:
    """One Inspector run is one MCP session: the claim it kept alive lapses (is not
    released) once the run is over. The wait itself is in the node's line."""
    call = inspector.caller(*stdio_server(node.address))
    args = {"repoId": "q", "topic": "later", "owner": "worker-a", "leaseSeconds": 2}
    empty = expect_ok(await call("repocontext_wait_for_work", {**args, "timeoutSeconds": 0}))
    assert empty == {"granted": False, "reason": "empty"}  # exit 0: an answer

    async def wait() -> Outcome:
        return await call(
            "repocontext_wait_for_work", {**args, "timeoutSeconds": 60, "keepAlive": True}
        )

    waiting = asyncio.create_task(wait())

    async def in_line() -> bool:
        return waiting_in_line(node) == 1

    await eventually(in_line, "the Inspector's wait in the node's line", within=INSPECTOR_LIMIT_S)
    made = await client.remember("q", "later", "comes", title="Comes while it waits")
    got = expect_ok(await waiting)
    assert (got["granted"], got["record"]["key"]) == (True, made.record.key)
    assert got["keepAlive"]["state"] == "holding"

    async def lapsed() -> bool:
        return (await client.history(made.record.key)).events[-1].kind == "lapsed"

    await eventually(lapsed, "the claim lapsed once the Inspector's session ended")
    assert "released" not in [e.kind for e in (await client.history(made.record.key)).events]


async def test_the_inspector_lists_and_reads_the_changes_resource(
    inspector: Inspector, node: NodeServer
) -> None:
    server = stdio_server(node.address)
    code, listed, err = await inspector.run(
        "--method", "resources/templates/list", "--format", "json", *server
    )
    assert code == EXIT_OK, err
    templates = listed["result"]["resourceTemplates"]
    assert [t["uriTemplate"] for t in templates] == ["fencemark://{repo}/{topic}/changes"]
    assert templates[0]["mimeType"] == "application/json"
    code, read, err = await inspector.run(
        "--method", "resources/read", "--uri", "fencemark://q/t/changes", "--format", "json",
        *server,
    )  # fmt: skip
    assert code == EXIT_OK, err
    content = json.loads(read["result"]["contents"][0]["text"])
    assert (content["following"], content["events"]) == (False, [])  # nobody subscribes
    code, _, err = await inspector.run(
        "--method", "resources/read", "--uri", "fencemark://q/t/nothing", "--format", "json",
        *server,
    )  # fmt: skip
    assert code != EXIT_OK and "Unknown resource: fencemark://q/t/nothing" in err


async def test_the_inspector_reads_what_another_session_follows_over_http(
    inspector: Inspector, node: NodeServer, client: AsyncClient
) -> None:
    """One ``fencemark mcp --transport http``: the SDK's client subscribes (and is told of
    the change); the Inspector, a session with no read position, gets every change kept."""
    uri = "fencemark://q/followed/changes"
    told = asyncio.Event()

    async def on_message(message: object) -> None:
        if isinstance(message, ResourceUpdatedNotification) and message.params.uri == uri:
            told.set()

    async with (
        http_server(node.address) as url,
        Client(url, mode="legacy", message_handler=on_message) as follower,
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", MCPDeprecationWarning)
            await follower.subscribe_resource(uri)
        await client.remember("q", "followed", "one", title="One")
        async with asyncio.timeout(INSPECTOR_LIMIT_S):
            await told.wait()
        code, read, err = await inspector.run(
            "--method", "resources/read", "--uri", uri, "--format", "json",
            "--transport", "http", url,
        )  # fmt: skip
    assert code == EXIT_OK, err
    content = json.loads(read["result"]["contents"][0]["text"])
    assert content["following"] is True
    assert [(e["kind"], e["id"]) for e in content["events"]] == [("created", "one")]
    await no_stream_left(node, ended=1)  # the follower's session closed: its Watch ended


async def test_the_inspector_starts_the_server_from_the_configuration_init_wrote(
    installed: tuple[Path, Path], tmp_path: Path, node: NodeServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Issue 35: a repository after `fencemark init` — the Inspector reads its
    ``.mcp.json``, starts ``fencemark mcp --bindings ...`` from it in the repository,
    and lists every tool."""
    from tests.test_adopt import VENV_BIN, run_cli

    repo = tmp_path / "repo"
    repo.mkdir()
    ran = await run_cli("init", "--repo", "widgets", "--region", "us", "--regions",
                        f"us={node.address}", cwd=repo)  # fmt: skip
    assert ran.code == 0, ran.stderr
    monkeypatch.setenv("PATH", f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    node_bin, script = installed
    in_repo = Inspector(node=node_bin, script=script, home=repo)  # runs in the repository
    tools = await in_repo.list_tools("--config", ".mcp.json", "--server", "fencemark")
    assert {tool["name"] for tool in tools} == ALL_TOOLS

"""Adopting Fencemark in a repository (issue 35): ``fencemark init`` writes the
template with the bindings filled in, ``fencemark mirror`` brings issues into the
backlog, and an agent started from the MCP configuration ``init`` wrote drains it.

Real processes throughout: a node process on loopback, the ``fencemark`` CLI, the
MCP server started from ``.mcp.json`` by the SDK's stdio client, in a temporary git
repository.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from mcp import Client, StdioServerParameters

from fencemark.client import AsyncClient
from fencemark.node.tools.adopt import (
    CONTRACT,
    LAYOUT,
    RENDERED,
    SPEC,
    WORKFLOW,
    AdoptError,
    load_bindings,
    render,
    standalone_spec,
    template_dir,
    template_file,
)
from fencemark.node.tools.process import NodeProcess
from tests import recording_gh
from tests.cluster import eventually
from tests.test_cli import Ran, clean_env
from tests.test_mcp_walkthrough import expect_ok, outcome_of

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
REPO = "widgets"
LIMIT_S = 60.0


async def run_cli(
    *args: str, cwd: Path, stdin: str = "", env: Mapping[str, str] | None = None
) -> Ran:
    """``fencemark ARGS`` in ``cwd``, ``stdin`` piped in, ``env`` added to its environment."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fencemark.node", *args, cwd=cwd, env={**clean_env(), **(env or {})},
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    async with asyncio.timeout(LIMIT_S):
        out, err = await proc.communicate(stdin.encode())
    assert proc.returncode is not None
    return Ran(proc.returncode, out.decode(), err.decode())


def git_repository(path: Path) -> Path:
    path.mkdir()
    for args in (["init", "-q"], ["remote", "add", "origin", f"git@github.com:acme/{REPO}.git"]):
        subprocess.run(["git", "-C", str(path), *args], check=True, capture_output=True)
    return path


def files_under(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): p.read_text()
        for p in root.rglob("*")
        if p.is_file() and ".git" not in p.parts
    }


# -- init -------------------------------------------------------------------------------


@pytest.mark.slow  # spawns a process (the CLI, a node or a browser)
async def test_init_writes_the_template_once_and_never_overwrites_a_changed_file(
    tmp_path: Path,
) -> None:
    repo = git_repository(tmp_path / "widgets")
    first = await run_cli("init", "--region", "us", "--regions",
                          "us=127.0.0.1:7400,eu=127.0.0.1:7401", cwd=repo)  # fmt: skip
    assert first.code == 0, first.stderr
    assert set(files_under(repo)) == set(LAYOUT.values())
    assert f"repo {REPO}, region us" in first.stdout  # the repo id from the git remote
    bindings = load_bindings(repo / ".fencemark/bindings.toml")
    assert (bindings.repo, bindings.region, bindings.target) == (REPO, "us", "127.0.0.1:7400")
    assert dict(bindings.regions) == {"us": "127.0.0.1:7400", "eu": "127.0.0.1:7401"}
    mcp = json.loads((repo / ".mcp.json").read_text())["mcpServers"]["fencemark"]
    assert mcp["command"] == "fencemark" and "--bindings" in mcp["args"]
    # Everything but the bindings and the contract is the template, byte for byte.
    template = template_dir()
    for source, target in LAYOUT.items():
        if source not in {*RENDERED, SPEC}:
            assert (repo / target).read_text() == template_file(template, source).read_text()
    # The workflow carries the bindings as flags (it checks nothing out).
    workflow = (repo / LAYOUT[WORKFLOW]).read_text()
    assert f"--repo {REPO} --region us --regions us=127.0.0.1:7400,eu=127.0.0.1:7401" in workflow
    assert "{{" not in workflow.replace("${{", "")
    # Beside the protocol, the contract it cites: this version's docs/spec.md, word for
    # word, its links to the project's other pages (absent here) written as their paths.
    spec = (ROOT / "docs" / "spec.md").read_text()
    contract = (repo / CONTRACT).read_text()
    assert contract == standalone_spec(spec)
    headings = [line for line in spec.splitlines() if line.startswith("#")]
    assert headings == [line for line in contract.splitlines() if line.startswith("#")]
    assert "what to do on each: `docs/api.md#claims`." in contract
    assert not re.findall(r"\]\((?!#)[^)]*\)", contract)  # no link leaves the file

    written = files_under(repo)
    again = await run_cli("init", "--region", "us", "--regions",
                          "us=127.0.0.1:7400,eu=127.0.0.1:7401", cwd=repo)  # fmt: skip
    assert again.code == 0 and files_under(repo) == written
    assert again.stdout.count("unchanged  ") == len(LAYOUT) and "0 written" in again.stdout

    worker = repo / ".fencemark/agents/worker.md"
    worker.write_text(worker.read_text() + "\nlocal edit\n")
    left = await run_cli("init", "--region", "us", cwd=repo)
    assert left.code == 1
    assert "left       .fencemark/agents/worker.md" in left.stdout
    assert worker.read_text().endswith("local edit\n")  # not overwritten
    forced = await run_cli("init", "--region", "us", "--force", cwd=repo)
    assert forced.code == 0 and "wrote      .fencemark/agents/worker.md" in forced.stdout
    assert not worker.read_text().endswith("local edit\n")


@pytest.mark.slow  # spawns a process (the CLI, a node or a browser)
@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--repo", "bad/name", "--region", "us"], "--repo"),
        (["--repo", "w", "--region", "us", "--regions", "eu=127.0.0.1:7401"], "--region"),
        (["--repo", "w", "--region", "us", "--regions", "us=nowhere"], "--regions"),
        (["--region", "us"], "--repo"),  # no --repo and no git remote
    ],
)
async def test_init_refuses_bad_input_naming_the_flag_and_writes_nothing(
    tmp_path: Path, args: list[str], named: str
) -> None:
    ran = await run_cli("init", *args, cwd=tmp_path)
    assert ran.code == 2 and ran.stderr.startswith(f"fencemark init: {named}"), ran.stderr
    assert ran.stderr.count("\n") == 1  # one line
    assert files_under(tmp_path) == {}


def test_this_repository_consumes_its_own_template() -> None:
    """The repository's own .mcp.json and .fencemark/ are what `fencemark init` writes
    from template/ with its bindings: they drift apart only in the bindings."""
    bindings = load_bindings(ROOT / ".fencemark/bindings.toml")
    for relative, text in render(template_dir(), bindings).items():
        if relative == LAYOUT[WORKFLOW]:
            continue  # its issues are not on GitHub beside a node the workflow could reach
        assert (ROOT / relative).read_text() == text, f"{relative} drifted from template/"


def test_init_takes_the_contract_an_installed_template_carries(tmp_path: Path) -> None:
    """Outside a source checkout the contract is the spec.md a wheel installs in the
    template directory; a template without one, and no checkout around it, is refused
    with a reason, before anything is written."""
    installed = tmp_path / "share" / "fencemark" / "template"
    shutil.copytree(ROOT / "template", installed)
    bindings = load_bindings(ROOT / ".fencemark/bindings.toml")
    with pytest.raises(AdoptError, match="specification is not installed"):
        render(installed, bindings)
    (installed / "spec.md").write_text("# The installed contract\n\nSee [api.md](api.md).\n")
    written = render(installed, bindings)[str(CONTRACT)]
    assert written.startswith("# The installed contract\n\n> Written by `fencemark init`")
    assert written.endswith("\n\nSee `docs/api.md`.\n")


# -- mirror ---------------------------------------------------------------------------------


def gh_issue(number: int, title: str, *labels: str, state: str = "OPEN") -> dict[str, Any]:
    """One entry as `gh issue list --json number,title,body,labels,state,url,updatedAt`
    prints it."""
    return {
        "number": number,
        "title": title,
        "body": f"Body of issue {number}.",
        "labels": [
            {"id": f"L{i}", "name": n, "description": "", "color": "ededed"}
            for i, n in enumerate(labels)
        ],
        "state": state,
        "url": f"https://github.com/acme/{REPO}/issues/{number}",
        "updatedAt": "2026-12-01T10:00:00Z",
    }


ISSUES = [
    gh_issue(1, "Batch the WAL", "P1", "phase:implementation", "bug"),
    gh_issue(2, "Document the queue", "priority: high", "docs"),
    gh_issue(3, "An old one", state="CLOSED"),
    gh_issue(4, "Tidy the logs", "low"),
]


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[NodeProcess]:
    process = await NodeProcess.start(tmp_path / "node", region="us")
    try:
        async with AsyncClient(process.address) as client:

            async def serving() -> bool:
                return (await client.info()).claims_serving

            await eventually(serving, "the node deciding claims")
        yield process
    finally:
        await process.stop()


async def mirror(repo: Path, issues: list[dict[str, Any]], *extra: str) -> Ran:
    return await run_cli("mirror", *extra, cwd=repo, stdin=json.dumps(issues))


async def backlog(address: str) -> dict[str, Any]:
    async with AsyncClient(address) as client:
        return {r.id: r async for r in client.iter_records(REPO, topic="backlog")}


@pytest.mark.slow
async def test_issues_mirrored_into_the_backlog_are_drained_by_an_agent_from_init_s_config(
    tmp_path: Path, node: NodeProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = git_repository(tmp_path / "widgets")
    assert (await run_cli("init", "--region", "us", "--regions", f"us={node.address}",
                          cwd=repo)).code == 0  # fmt: skip

    planned = await mirror(repo, ISSUES, "--dry-run")
    assert planned.code == 0 and "dry run: nothing written" in planned.stdout
    assert await backlog(node.address) == {}
    made = await mirror(repo, ISSUES)
    assert made.code == 0, made.stderr
    assert "3 created" in made.stdout and "1 unchanged" in made.stdout  # #3 closed: not filed
    items = await backlog(node.address)
    assert set(items) == {"issue-1", "issue-2", "issue-4"}
    first = items["issue-1"]
    assert set(first.tags) == {"backlog", "priority:P1", "phase:implementation", "label:bug",
                               "homeRegion:us"}  # fmt: skip
    assert first.fields["title"] == "Batch the WAL" and first.fields["author"] == "backlog-pm"
    assert first.fields["url"].endswith("/issues/1")
    assert "priority:P1" in items["issue-2"].tags and "label:docs" in items["issue-2"].tags
    assert "priority:P3" in items["issue-4"].tags

    # An agent as the worker definition says, its MCP server started from .mcp.json.
    config = json.loads((repo / ".mcp.json").read_text())["mcpServers"]["fencemark"]
    monkeypatch.setenv("PATH", f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    params = StdioServerParameters(command=config["command"], args=config["args"],
                                   cwd=str(repo), env=clean_env())  # fmt: skip
    topic = tomllib.loads((repo / ".fencemark/bindings.toml").read_text())["topic"]
    async with asyncio.timeout(LIMIT_S), Client(params, mode="legacy") as agent:
        picked = expect_ok(outcome_of(await agent.call_tool("repocontext_claim_next", {
            "repoId": REPO, "topic": topic, "owner": "worker-1", "leaseSeconds": 30,
        })))  # fmt: skip
        key, token = picked["record"]["key"], picked["fencingToken"]
        assert key.endswith("/issue-1")  # P1, filed first
        expect_ok(outcome_of(await agent.call_tool("repocontext_update", {
            "key": key, "fields": {"progress": "batched"}, "fencingToken": token,
        })))  # fmt: skip
        released = expect_ok(outcome_of(await agent.call_tool("repocontext_release_claim", {
            "key": key, "fencingToken": token, "outcome": "done", "fields": {"result": "merged"},
        })))  # fmt: skip
        assert released["released"] is True

    again = await mirror(repo, ISSUES)
    assert again.code == 0 and again.stdout.startswith("mirror: nothing to change"), again.stdout
    assert (await backlog(node.address))["issue-1"].status == "done"  # finished, still open

    # Issue 2 closed upstream and retitled while worker-2 holds it: left to its holder.
    async with AsyncClient(node.address) as holder:
        held = await holder.claim(items["issue-2"].key, "worker-2", lease_seconds=60)
        assert held.granted
        changed = [*ISSUES[:1], gh_issue(2, "Document the work queue", "priority: high", "docs",
                                         state="CLOSED"), *ISSUES[2:]]  # fmt: skip
        left = await mirror(repo, changed)
        assert left.code == 0 and "left      issue-2  claimed by worker-2" in left.stdout
        state = (await backlog(node.address))["issue-2"]
        assert state.status == "open" and state.fields["title"] == "Document the queue"
        assert (await holder.claim_status(state.key)).claim is not None
        assert (await holder.release_claim(state.key, held.fencing_token)).released
        done = await mirror(repo, changed)
        assert "done      issue-2  closed upstream; issueState, title" in done.stdout, done.stdout
        closed = (await backlog(node.address))["issue-2"]
        assert closed.status == "done" and closed.fields["result"] == "closed upstream"
        assert closed.fields["title"] == "Document the work queue"

        # Reopened upstream: reopened in the backlog.
        reopened = [*ISSUES[:1], gh_issue(2, "Document the work queue", "priority: high",
                                          "docs"), *ISSUES[2:]]  # fmt: skip
        ran = await mirror(repo, reopened)
        assert "reopened  issue-2  reopened upstream" in ran.stdout, ran.stdout
        assert (await backlog(node.address))["issue-2"].status == "open"
        assert (await mirror(repo, reopened)).stdout.startswith("mirror: nothing to change")


GOOD = json.dumps(ISSUES[0])  # a good entry before the bad one: nothing half-imported


@pytest.mark.slow
@pytest.mark.parametrize(
    ("payload", "named"),
    [
        ("this is not json", "line 1: not JSON"),
        (f'[{GOOD}, {{"title": "no number"}}]', "entry 2: field `number`"),
        (f'{GOOD}\n{{"number": 2}}\n', "line 2 (issue #2): field `title`"),
        (json.dumps([ISSUES[0], gh_issue(9, "x" * (2 << 20))]), "entry 2 (issue #9): "),
        (f'[{GOOD}, {{"number": 1, "title": "b"}}]', "entry 2: number 1 again"),
        (f'[{GOOD}, {{"number": 5, "title": "b", "state": "merged"}}]', "field `state`"),
    ],
    ids=["not-json", "no-number", "no-title", "title-too-long", "number-twice", "bad-state"],
)
async def test_mirror_refuses_bad_input_naming_line_and_field_and_imports_nothing(
    tmp_path: Path, node: NodeProcess, payload: str, named: str
) -> None:
    repo = git_repository(tmp_path / "widgets")
    assert (await run_cli("init", "--region", "us", "--regions", f"us={node.address}",
                          cwd=repo)).code == 0  # fmt: skip
    ran = await run_cli("mirror", cwd=repo, stdin=payload)
    assert ran.code == 2, (ran.stdout, ran.stderr)
    assert ran.stderr.startswith("fencemark mirror: ") and "nothing imported" in ran.stderr
    assert named in ran.stderr, ran.stderr
    assert ran.stderr.count("\n") == 1  # one line
    assert await backlog(node.address) == {}


# -- docs/adopting.md, as written --------------------------------------------------------

GUIDE = ROOT / "docs" / "adopting.md"
DOCUMENTED_NODE = "127.0.0.1:7400"


def guide_commands() -> list[tuple[str, list[str]]]:
    """Every ``$ fencemark`` command of the guide's console blocks (but those marked
    not executed) with the output shown under it."""
    commands: list[tuple[str, list[str]]] = []
    lines = GUIDE.read_text().splitlines()
    inside = skipped = False
    for index, line in enumerate(lines):
        if line.startswith("```"):
            if not inside and line.strip() == "```console":
                before = lines[index - 1] if index else ""
                inside, skipped = True, before.startswith("<!-- not-executed:")
            else:
                inside = False
            continue
        if not inside or skipped:
            continue
        if line.startswith("$ "):
            assert line.startswith("$ fencemark "), f"the guide runs only fencemark: {line}"
            commands.append((line[2:], []))
        else:
            commands[-1][1].append(line)
    return commands


def matches(shown: list[str], printed: list[str]) -> bool:
    """``printed`` is ``shown``, where a ``...`` line stands for any lines."""
    if not shown:
        return not printed
    if shown[0] == "...":
        return any(matches(shown[1:], printed[i:]) for i in range(len(printed) + 1))
    return bool(printed) and printed[0] == shown[0] and matches(shown[1:], printed[1:])


@pytest.mark.slow
async def test_the_adoption_guide_runs_as_shown(tmp_path: Path, node: NodeProcess) -> None:
    commands = guide_commands()
    assert [c.split()[1] for c, _ in commands] == ["init", "init", *["mirror"] * 5]
    repo = git_repository(tmp_path / "widgets")
    (repo / "issues.json").write_text(json.dumps(ISSUES))  # what `gh issue list` printed
    # GitHub's CLI as the guide's step 5 meets it: the recording gh, holding the issues.
    state = tmp_path / "gh-issues.json"
    state.write_text(json.dumps({str(i["number"]): recording_gh.issue() for i in ISSUES}))
    recording_gh.install(tmp_path / "bin")
    env = {
        "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "RECORDING_GH_STATE": str(state),
        "RECORDING_GH_LOG": str(tmp_path / "gh-calls.jsonl"),
    }
    for command, shown in commands:
        if "--push" in command and "--dry-run" in command:  # step 5: worker-1 finished issue-1
            async with AsyncClient(node.address) as client:
                key = (await backlog(node.address))["issue-1"].key
                claim = await client.claim(key, "worker-1", lease_seconds=30)
                await client.release_claim(key, claim.fencing_token, outcome="done",
                                           fields={"result": "merged in #2107"})  # fmt: skip
        argv = command.replace(DOCUMENTED_NODE, node.address).split()[1:]
        ran = await run_cli(*argv, cwd=repo, env=env)
        assert ran.code == 0, (command, ran.stderr)
        expected = [line.replace(DOCUMENTED_NODE, node.address) for line in shown]
        assert matches(expected, ran.stdout.splitlines()), (command, ran.stdout)
    # What the guide says the comment reads, and the issue closed.
    (comment,) = json.loads(state.read_text())["1"]["comments"]
    assert re.match(r"Done by worker-1 on \d{4}-\d\d-\d\d \d\d:\d\d UTC \(fencing token 1\)\.\n\n"
                    r"- result: merged in #2107\n", comment), comment  # fmt: skip
    assert json.loads(state.read_text())["1"]["state"] == "CLOSED"


def test_an_installed_package_carries_every_template_file() -> None:
    """A wheel installs template/ under <prefix>/share/fencemark/template (pyproject's
    data-files), where `fencemark init` finds it outside a source checkout, and
    docs/spec.md there too, as spec.md: the contract init writes beside the protocol."""
    data_files = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "data-files"
    ]
    installed = {
        f"{target.removeprefix('share/fencemark/template')}/{Path(f).name}".lstrip("/"): f
        for target, files in data_files.items()
        for f in files
    }
    template = ROOT / "template"
    shipped = {str(p.relative_to(template)) for p in template.rglob("*") if p.is_file()}
    assert set(installed) == shipped | {"spec.md"}
    assert installed.pop("spec.md") == "docs/spec.md"
    assert all(f == f"template/{name}" for name, f in installed.items())

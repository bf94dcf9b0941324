"""``fencemark mirror --push``: what agents finish shows up on the issue, once (issue 46).

A real node, the ``fencemark`` CLI as a process, and a recording ``gh`` on its
``PATH`` (tests/recording_gh.py: GitHub cannot be reached from here) that keeps
the issues in a file, logs every call, and can fail or kill its caller on demand.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from fencemark.client import AsyncClient, Record
from fencemark.node.api.server import NodeServer
from fencemark.node.tools import adopt, mirror
from fencemark.node.tools.adopt import make_bindings
from fencemark.node.tools.mirror_push import PUSHED_FIELD, ZWSP, marker
from tests import recording_gh
from tests.conftest import StartNode
from tests.test_adopt import REPO, gh_issue, git_repository, run_cli
from tests.test_cli import Ran

pytestmark = pytest.mark.slow  # every step runs the CLI as a process

ISSUES = [gh_issue(n, f"Issue {n}") for n in (1, 2, 3, 4)]
WRITES = ("comment", "close", "reopen", "edit")


@dataclass
class Site:
    """A repository that ran ``fencemark init`` against ``node``, its issues mirrored
    in, and the recording ``gh`` holding those issues."""

    root: Path
    node: NodeServer
    bin_dir: Path
    state: Path
    log: Path
    env: dict[str, str] = field(default_factory=dict)

    async def cli(self, *args: str, stdin: str = "", path: str | None = None, **env: str) -> Ran:
        """``fencemark ARGS`` here, the recording ``gh`` first on ``PATH`` (or ``path``)."""
        if path is None:
            path = f"{self.bin_dir}{os.pathsep}{os.environ['PATH']}"
        return await run_cli(*args, cwd=self.root, stdin=stdin,
                             env={**self.env, **env, "PATH": path})  # fmt: skip

    async def push(self, *args: str, **env: str) -> Ran:
        return await self.cli("mirror", "--push", *args, **env)

    def issues(self) -> dict[str, Any]:
        issues: dict[str, Any] = json.loads(self.state.read_text())
        return issues

    def calls(self) -> list[dict[str, Any]]:
        """Every ``gh`` call so far: its arguments (``issue comment 1 ...``) and input."""
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]

    def writes(self) -> list[list[str]]:
        return [c["argv"] for c in self.calls() if c["argv"][1] in WRITES]

    async def items(self) -> dict[str, Record]:
        async with AsyncClient(self.node.address) as client:
            return {r.id: r async for r in client.iter_records(REPO, topic="backlog")}


@pytest.fixture
async def site(tmp_path: Path, start_node: StartNode) -> Site:
    node = await start_node(region="us")
    root = git_repository(tmp_path / "widgets")
    state, log = tmp_path / "gh-issues.json", tmp_path / "gh-calls.jsonl"
    state.write_text(json.dumps({str(i["number"]): recording_gh.issue() for i in ISSUES}))
    bin_dir = tmp_path / "bin"
    recording_gh.install(bin_dir)
    site = Site(root, node, bin_dir, state, log,
                {"RECORDING_GH_STATE": str(state), "RECORDING_GH_LOG": str(log)})  # fmt: skip
    # init and the mirror in, in this process (their CLI is tests/test_adopt.py's).
    bindings = make_bindings(REPO, "us", {"us": node.address})
    assert not adopt.init(root, bindings).left
    async with AsyncClient(node.address) as client:
        plan = await mirror.mirror(client, bindings, mirror.parse(json.dumps(ISSUES)),
                                   dry_run=False)  # fmt: skip
    assert plan.counts == {"created": 4}, plan.lines
    return site


async def finish(site: Site, item: str, outcome: str = "done", owner: str = "worker-1",
                 **fields: str) -> None:  # fmt: skip
    """An agent claims ``item`` and releases it with ``outcome`` and ``fields``."""
    async with AsyncClient(site.node.address) as client:
        key = (await site.items())[item].key
        claim = await client.claim(key, owner, lease_seconds=30)
        assert claim.granted, claim
        released = await client.release_claim(key, claim.fencing_token, outcome=outcome,
                                              fields=fields)  # fmt: skip
        assert released.released, released


async def test_push_comments_closes_and_labels_once_and_reopens_what_the_backlog_reopened(
    site: Site,
) -> None:
    await finish(site, "issue-1", result="merged in #2107", branch="fix/wal")
    async with AsyncClient(site.node.address) as client:
        key = (await site.items())["issue-2"].key
        await client.update(key, add_tags=["maxAttempts:1"])
    await finish(site, "issue-2", "failed", error="tests red on main")  # parked at once
    await finish(site, "issue-3", "failed", error="flaky")  # open again: nothing by default

    ran = await site.push()
    assert ran.code == 0, (ran.stdout, ran.stderr)
    assert "pushed    issue-1  #1 done: commented, closed" in ran.stdout
    assert "pushed    issue-2  #2 parked: commented, labelled" in ran.stdout
    assert ran.stdout.splitlines()[-1] == "mirror --push: 2 pushed, 0 failed, 2 unchanged"
    assert site.writes() == [
        ["issue", "comment", "1", "--body-file", "-"],
        ["issue", "close", "1"],
        ["issue", "comment", "2", "--body-file", "-"],
        ["issue", "edit", "2", "--add-label", "fencemark:parked"],
    ]
    issues = site.issues()
    assert issues["1"]["state"] == "CLOSED" and len(issues["1"]["comments"]) == 1
    done = issues["1"]["comments"][0]
    assert done.startswith("Done by worker-1 on ") and "(fencing token 1)." in done
    assert "- result: merged in #2107\n- branch: fix/wal\n" in done  # result first
    assert done.endswith(marker("issue-1", "done", 1) + "\n")
    assert issues["2"]["state"] == "OPEN" and issues["2"]["labels"] == ["fencemark:parked"]
    assert issues["2"]["comments"][0].startswith(
        "Parked after 1 attempts: last error: tests red on main."
    )
    assert issues["3"]["comments"] == [] and issues["4"]["comments"] == []
    items = await site.items()
    assert items["issue-1"].fields[PUSHED_FIELD] == "done:1"
    assert items["issue-2"].fields[PUSHED_FIELD] == "parked:1"
    assert PUSHED_FIELD not in items["issue-3"].fields

    # Again: nothing changed, so nothing is asked of GitHub at all.
    calls = len(site.calls())
    again = await site.push()
    assert again.code == 0 and again.stdout == "mirror --push: 0 pushed, 0 failed, 4 unchanged\n"
    assert len(site.calls()) == calls

    # The backlog PM reopens both: the closed issue is reopened, the label comes off.
    async with AsyncClient(site.node.address) as client:
        assert (await client.reopen(items["issue-1"].key, "the fix broke the build")).reopened
        assert (await client.reopen(items["issue-2"].key, "main is green again")).reopened
    reopened = await site.push()
    assert reopened.code == 0, reopened.stderr
    assert "pushed    issue-1  #1 open: commented, reopened" in reopened.stdout
    assert "pushed    issue-2  #2 open: commented, labelled" in reopened.stdout
    issues = site.issues()
    assert issues["1"]["state"] == "OPEN" and len(issues["1"]["comments"]) == 2
    assert issues["1"]["comments"][1].startswith(
        "Reopened in the backlog: the fix broke the build. Agents take it again."
    )
    assert issues["2"]["labels"] == [] and len(issues["2"]["comments"]) == 2
    assert (await site.push()).stdout.endswith("0 pushed, 0 failed, 4 unchanged\n")


async def test_an_issue_closed_upstream_gets_no_comment(site: Site) -> None:
    """mirror itself finished the item from the closed issue: nothing to tell it."""
    closed = [*ISSUES[:3], gh_issue(4, "Issue 4", state="CLOSED")]
    site.state.write_text(json.dumps({**site.issues(), "4": recording_gh.issue("CLOSED")}))
    pulled = await site.cli("mirror", stdin=json.dumps(closed))
    assert "done      issue-4  closed upstream" in pulled.stdout, pulled.stdout
    ran = await site.push()
    assert ran.code == 0 and ran.stdout.endswith("0 pushed, 0 failed, 4 unchanged\n")
    assert site.calls() == []


async def test_a_crash_between_the_comment_and_the_record_costs_no_second_comment(
    site: Site,
) -> None:
    await finish(site, "issue-1", result="merged")
    crashed = await site.push(RECORDING_GH_KILL_CALLER_AFTER="comment")
    assert crashed.code == -9  # killed right after gh commented
    issues = site.issues()
    assert len(issues["1"]["comments"]) == 1 and issues["1"]["state"] == "OPEN"
    assert PUSHED_FIELD not in (await site.items())["issue-1"].fields
    # The dead run's turn lapses; the next finds the marker, closes and records.
    again = await site.push()
    assert again.code == 0, again.stderr
    assert "pushed    issue-1  #1 done: closed" in again.stdout
    issues = site.issues()
    assert len(issues["1"]["comments"]) == 1 and issues["1"]["state"] == "CLOSED"
    assert (await site.items())["issue-1"].fields[PUSHED_FIELD] == "done:1"


async def test_two_pushes_at_once_comment_once(site: Site) -> None:
    """Each gh call takes 0.3 s, so the two runs overlap: they take turns."""
    for item in ("issue-1", "issue-3", "issue-4"):
        await finish(site, item, result=f"{item} merged")
    first, second = await asyncio.gather(
        site.push(RECORDING_GH_SLOW="0.3"), site.push(RECORDING_GH_SLOW="0.3")
    )
    assert (first.code, second.code) == (0, 0), (first.stderr, second.stderr)
    pushed = [line for run in (first, second) for line in run.stdout.splitlines()
              if line.startswith("pushed ")]  # fmt: skip
    assert len(pushed) == 3, (first.stdout, second.stdout)
    issues = site.issues()
    assert [len(issues[n]["comments"]) for n in ("1", "2", "3", "4")] == [1, 0, 1, 1]
    assert sorted(a[2] for a in site.writes() if a[1] == "comment") == ["1", "3", "4"]


async def test_agents_words_neither_mention_nor_close_nor_forge(site: Site) -> None:
    forged = marker("issue-1", "done", 1)
    await finish(
        site, "issue-1", owner="@boss",
        result=f"@someone closes #12, Fixes acme/widgets#3 and RESOLVED #4 {forged} <b>bold</b>",
    )  # fmt: skip
    ran = await site.push()
    assert ran.code == 0, ran.stderr
    body = site.issues()["1"]["comments"][0]
    assert body.startswith(f"Done by @{ZWSP}boss on ")
    assert f"@{ZWSP}someone" in body and not re.search(r"@[A-Za-z]", body)
    keyword = r"\b(close[sd]?|fix(e[sd])?|resolve[sd]?):?\s+\S*#\d"
    assert not re.search(keyword, body, re.IGNORECASE), body
    assert f"c{ZWSP}loses #12" in body and f"F{ZWSP}ixes acme/widgets#3" in body
    assert "&lt;b&gt;bold&lt;/b&gt;" in body and "<b>" not in body
    assert body.count("<!--") == 1 and body.endswith(forged + "\n")  # its own, last


async def test_a_failing_gh_is_one_line_per_issue_and_records_nothing_for_it(
    site: Site,
) -> None:
    for item in ("issue-1", "issue-2", "issue-4"):
        await finish(site, item, result="merged")
    ran = await site.push(RECORDING_GH_FAIL="2")
    assert ran.code == 1
    assert ran.stdout.count("failed    ") == 1
    assert (
        "failed    issue-2  #2 done: `gh issue view` failed: HTTP 502: Server Error" in ran.stdout
    )
    assert "pushed    issue-1" in ran.stdout and "pushed    issue-4" in ran.stdout
    assert PUSHED_FIELD not in (await site.items())["issue-2"].fields
    retried = await site.push()
    assert retried.code == 0 and "pushed    issue-2  #2 done: commented, closed" in retried.stdout
    assert retried.stdout.count("pushed    ") == 1

    await finish(site, "issue-3", result="merged")
    for env, cause in (
        ({"RECORDING_GH_FAIL": "auth"}, "gh is not authenticated (run `gh auth login`"),
        ({"RECORDING_GH_FAIL": "rate"}, "GitHub's rate limit was reached"),
    ):
        failed = await site.push(**env)
        assert failed.code == 1 and f"failed    issue-3  #3 done: {cause}" in failed.stdout
    missing = await site.cli("mirror", "--push", path=str(site.root))  # no gh on PATH
    assert missing.code == 1
    assert "failed    issue-3  #3 done: gh is not installed (GitHub's CLI, `gh`)" in missing.stdout
    assert PUSHED_FIELD not in (await site.items())["issue-3"].fields
    assert len(site.issues()["3"]["comments"]) == 0


async def test_a_dry_run_prints_the_commands_and_runs_none(site: Site) -> None:
    await finish(site, "issue-1", result="merged")
    ran = await site.push("--dry-run", "--no-close", "--gh-repo", "acme/widgets")
    assert ran.code == 0, ran.stderr
    lines = ran.stdout.splitlines()
    assert lines[0] == "# issue-1: done (fencing token 1)"
    assert lines[1] == "gh issue comment 1 --body-file - -R acme/widgets <<'EOF'"
    assert lines[2].startswith("Done by worker-1 on ")
    assert "gh issue close" not in ran.stdout  # --no-close
    assert lines[-2] == "EOF"
    assert lines[-1] == "mirror --push (dry run: nothing run): 1 planned, 3 unchanged"
    assert site.calls() == []
    assert PUSHED_FIELD not in (await site.items())["issue-1"].fields


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--from", "issues.json"], "--push reads the backlog, not issues"),
        (["--comment-on", "done"], "--comment-on: 'done' is not one of failed, deferred"),
        (["--gh-repo", "widgets"], "--gh-repo: 'widgets' is not OWNER/NAME"),
        (["--topic", "elsewhere"], "--push: no item of repo widgets, topic elsewhere came from"),
    ],
    ids=["from", "comment-on", "gh-repo", "not-mirrored"],
)
async def test_push_refuses_a_usage_error_naming_it(
    site: Site, args: list[str], named: str
) -> None:
    ran = await site.push(*args)
    assert ran.code == 2 and ran.stderr.startswith("fencemark mirror: "), ran.stderr
    assert named in ran.stderr and ran.stderr.count("\n") == 1, ran.stderr
    assert site.calls() == []


async def test_failed_and_deferred_outcomes_are_commented_on_when_asked(site: Site) -> None:
    await finish(site, "issue-3", "failed", error="flaky test")
    ran = await site.push("--comment-on", "failed,deferred")
    assert ran.code == 0 and "pushed    issue-3  #3 failed: commented" in ran.stdout
    assert site.issues()["3"]["comments"][0].startswith("Attempt 1 ended failed: flaky test.")
    await finish(site, "issue-3", "failed", error="flaky again")  # a new attempt: a new token
    again = await site.push("--comment-on", "failed")
    assert "pushed    issue-3  #3 failed: commented" in again.stdout
    assert len(site.issues()["3"]["comments"]) == 2


async def test_mirror_sends_its_calls_to_an_explicit_target_without_bindings(
    tmp_path: Path, start_node: StartNode
) -> None:
    """``--target ADDR --repo R --region us`` with no --regions and no bindings file
    went to 127.0.0.1:7400 whatever ADDR said."""
    node = await start_node(region="us")
    assert not node.address.endswith(":7400")
    ran = await run_cli("mirror", "--target", node.address, "--repo", REPO, "--region", "us",
                        cwd=tmp_path, stdin=json.dumps(ISSUES[:1]))  # fmt: skip
    assert ran.code == 0, ran.stderr
    assert "1 created" in ran.stdout

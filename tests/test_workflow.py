"""The GitHub Actions workflow ``fencemark init`` writes (docs/adopting.md, step 5),
checked as GitHub reads it and as an attacker reads it.

- check-jsonschema validates it against the workflow schema (the SchemaStore one it
  carries: no network): keys, events, the shape of every step;
- zizmor, at its most demanding persona, audits it: permissions, injection of
  untrusted text into shell, secrets, unpinned actions. It must find nothing.

actionlint, the other common checker, ships as a Go binary fetched from GitHub,
which this machine cannot reach; both of these install from PyPI with the dev extra.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fencemark.node.tools.adopt import LAYOUT, WORKFLOW, make_bindings, render, template_dir

BIN = Path(sys.executable).parent
REGIONS = {"us": "10.0.0.1:7400", "eu": "10.0.0.2:7400"}


@pytest.fixture
def workflow(tmp_path: Path) -> Path:
    """The workflow as ``init`` writes it for a repository of two regions."""
    path = tmp_path / LAYOUT[WORKFLOW]
    path.parent.mkdir(parents=True)
    path.write_text(
        render(template_dir(), make_bindings("widgets", "us", REGIONS))[LAYOUT[WORKFLOW]]
    )
    return path


def test_the_workflow_matches_githubs_schema(workflow: Path) -> None:
    ran = subprocess.run(
        [BIN / "check-jsonschema", "--builtin-schema", "vendor.github-workflows", workflow],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stdout + ran.stderr


def test_zizmor_finds_nothing_in_the_workflow(workflow: Path) -> None:
    ran = subprocess.run(
        [BIN / "zizmor", "--offline", "--persona=pedantic", "--no-progress", workflow],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "No findings to report" in ran.stdout, ran.stdout


def test_the_workflow_asks_for_issues_write_and_nothing_else(workflow: Path) -> None:
    """Least privilege: nothing at the top, ``issues: write`` for its one job; it
    pulls, then pushes, on issue events and every 15 minutes, one run at a time."""
    document = yaml.safe_load(workflow.read_text())
    assert document["permissions"] == {}
    (job,) = document["jobs"].values()
    assert job["permissions"] == {"issues": "write"}
    events = document[True]  # YAML 1.1 reads the key `on` as true
    assert set(events) == {"issues", "schedule", "workflow_dispatch"}
    assert events["schedule"] == [{"cron": "*/15 * * * *"}]
    assert document["concurrency"]["cancel-in-progress"] is False
    runs = [step.get("run", "") for step in job["steps"]]
    pull = next(i for i, r in enumerate(runs) if "fencemark mirror $BINDINGS" in r)
    push = next(i for i, r in enumerate(runs) if "fencemark mirror --push $BINDINGS" in r)
    assert pull < push
    assert job["env"]["BINDINGS"] == (
        "--repo widgets --region us --regions us=10.0.0.1:7400,eu=10.0.0.2:7400"
    )
    assert not any("uses" in step for step in job["steps"])  # no third-party action

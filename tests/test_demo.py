"""The main job, ``fencemark demo``, in a short configuration: its report must pass.

It runs the real thing: three node processes, the fault proxy mesh, agents
through the client library, the nemesis and the checker.
"""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

import pytest

from tests import components
from tests.test_cli import clean_env, fencemark

pytestmark = pytest.mark.slow

CHECKS = (
    "every item completed",
    "fencing safety",
    "tokens strictly increase",
    "every acknowledged write is in every region",
    "no item done twice",
    "items handed out in priority order within each home",
    "the poison item parked after 2 attempts",
    "byte-identical replicas after the final heal",
    "the stalled worker was refused",
)


async def test_the_demo_drains_the_backlog_under_faults_and_its_report_passes(
    tmp_path: Path,
) -> None:
    ran = await fencemark(
        "demo", "--items", "9", "--agents-per-region", "2", "--lease-seconds", "1",
        "--work-seconds", "0.1", "--cut-seconds", "2", "--seed", "7",
        "--data", str(tmp_path / "demo"),
        limit_s=180,
    )  # fmt: skip
    out = ran.stdout
    assert ran.code == 0, out + ran.stderr
    for check in CHECKS:
        assert re.search(rf"PASS  {re.escape(check)}", out), f"{check!r} did not pass:\n{out}"
    assert "demo: PASSED" in out
    assert re.search(r"region ap cut off", out) and "region ap healed" in out
    assert re.search(r"woke up after its lease and was refused: .*superseded", out), out
    # Agents without work wait on their region's change feed, which the progress counts.
    events = [int(n) for n in re.findall(r"\| events (\d+) \|", out)]
    assert events and events[-1] > 0, out
    waited = re.search(r"waited on their region's change feed: woken by a change (\d+) times", out)
    assert waited is not None and int(waited.group(1)) > 0, out
    # The embedded SQLite default: one database file per region, where we asked.
    for region in ("us", "eu", "ap"):
        assert (tmp_path / "demo" / region / "fencemark.sqlite3").is_file()


async def test_a_failing_check_makes_the_demo_exit_non_zero(tmp_path: Path) -> None:
    """Zero items cannot be drained by a stalled worker: its check must fail, and say so."""
    ran = await fencemark(
        "demo", "--items", "0", "--agents-per-region", "1", "--cut-seconds", "1",
        "--data", str(tmp_path / "demo"), limit_s=120,
    )  # fmt: skip
    assert ran.code == 1, ran.stdout + ran.stderr
    assert "FAIL  the stalled worker was refused" in ran.stdout
    assert "demo: FAILED" in ran.stdout


async def test_with_a_region_of_three_members_the_deciders_kill_loses_nothing(
    tmp_path: Path,
) -> None:
    """``--members 3``: us runs as three members electing through etcd; its decider is
    killed mid-drain, and the report says when the next one decided and that no
    acknowledged write was lost (and the member killed comes back on its disk)."""
    components.require("etcd")
    ran = await fencemark(
        "demo", "--members", "3", "--items", "12", "--agents-per-region", "2",
        "--lease-seconds", "1", "--work-seconds", "0.1", "--cut-seconds", "2", "--seed", "7",
        "--data", str(tmp_path / "demo"),
        limit_s=180,
    )  # fmt: skip
    out = ran.stdout
    assert ran.code == 0, out + ran.stderr
    assert re.search(r"region us: members us-a on .*, us-b on .*, us-c on .*etcd", out), out
    killed = re.search(r"nemesis: (us-[abc]), the decider of us, killed \(SIGKILL\)", out)
    assert killed is not None, out
    after = re.search(r"PASS  failover: new decider after [\d.]+ s \((us-[abc]), after", out)
    assert after is not None and after.group(1) != killed.group(1), out
    assert re.search(r"PASS  no acknowledged write lost: \d+ acknowledged", out), out
    for check in CHECKS:
        assert re.search(rf"PASS  {re.escape(check)}", out), f"{check!r} did not pass:\n{out}"
    for member in ("us-a", "us-b", "us-c"):
        assert (tmp_path / "demo" / member / "fencemark.sqlite3").is_file()


async def test_members_without_etcd_on_the_machine_say_how_to_install_it(
    tmp_path: Path,
) -> None:
    """No ``etcd`` on the PATH: exit 2 with the install command, and nothing started."""
    empty = tmp_path / "bin"
    empty.mkdir()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fencemark.node", "demo", "--members", "3",
        "--data", str(tmp_path / "demo"),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**clean_env(), "PATH": str(empty)},
    )  # fmt: skip
    stdout, _ = await asyncio.wait_for(proc.communicate(), 60)
    out = stdout.decode()
    assert proc.returncode == 2, out
    assert "apt-get install -y etcd-server" in out, out
    assert not any((tmp_path / "demo").glob("*/fencemark.sqlite3"))

"""A chaos run's report says what the nemesis played, not only what it scheduled.

No containers: a hand-made schedule, the faults played from it and a history,
written to a temporary folder.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from fencemark.node.tools.workload import Event, History
from tests.chaos import report
from tests.chaos.checker import Verdict
from tests.chaos.nemesis import Played, schedule

REGIONS = ("us", "eu", "ap")
AGENTS = ("us-agent-0", "eu-agent-0")
KEY = "repo/r/mem/backlog/item-00007"
START = 100.0


def stale(op: str, at: float, detail: str) -> Event:
    return Event("eu-agent-0", op, KEY, 4, "fail", START + at, START + at + 0.1, detail)


def test_the_report_counts_the_faults_played_by_kind_beside_the_schedule(tmp_path: Path) -> None:
    scheduled = schedule(random.Random(5), REGIONS, AGENTS, 300.0, 2.0)
    # The time limit stopped the nemesis after a kill, an agent pause and a second
    # kill the engine refused.
    played = [
        Played("kill", ("us",), 5.0, 9.0),
        Played("agent-pause", ("eu-agent-0",), 12.0, 18.0),
        Played("kill", ("eu",), 20.0, 20.5, "not injected: freezer", injected=False),
    ]
    history = History(started=START)
    history.add(stale("stale-write", 16.0, "superseded"))
    history.add(stale("stale-renew", 16.2, "expired"))
    written = report.write(
        tmp_path,
        settings={"seed": 5, "seconds": 20.5, "regions": 3, "agents": 6, "lease_seconds": 2.0},
        verdicts=[Verdict("1. fencing safety", True, "fine")],
        played=played,
        samples=[],
        history=history,
        heal_at=21.0,
        scheduled=scheduled,
    )
    faults = json.loads((tmp_path / "report.json").read_text())["faults"]
    assert faults == written["faults"]
    assert (faults["played"], faults["not injected"]) == (3, 1)
    assert faults["scheduled"] == len(scheduled) > len(played)
    kill = sum(f.kind == "kill" for f in scheduled)
    assert faults["by kind"]["kill"] == {"played": 2, "not injected": 1, "scheduled": kill}
    assert faults["by kind"]["agent-pause"]["played"] == 1
    assert faults["by kind"]["isolate"]["played"] == 0
    text = (tmp_path / "report.md").read_text()
    assert f"3 faults played over 20 s of nemesis ({len(scheduled)} scheduled)" in text
    assert f"| kill | 2 | 1 | {kill} |" in text
    assert "| 12.0 | eu-agent-0 | item-00007 | 4 | superseded | expired | fenced |" in text
    assert written["agent_pauses"][0]["verdict"] == "fenced"

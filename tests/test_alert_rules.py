"""The Prometheus alert rules (deploy/prometheus/alerts.yml), judged by Prometheus'
own ``promtool`` and against what a real node exports.

- ``promtool check rules`` and ``check config`` accept the rules and the compose
  stack's scrape configuration; ``promtool test rules`` runs alerts_test.yml, where
  each alert fires on series that should fire it and not on the series beside them;
  docs/operations.md's commands that do so run as written (tests/docrun.py).
- Every metric a rule names is one a real node (mutual TLS, a peer, a few calls)
  exports on its /metrics, and every label a rule selects on is one that metric has;
  the metrics only a member of a region of several exports, a real member elected
  through a real etcd does.
- docs/operations.md's table "Alerts worth setting" says what the file says.

promtool comes with Debian's ``prometheus`` package (.ci/run installs it); without it
these tests fail, they do not skip.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import urllib.request
from collections.abc import Set
from pathlib import Path
from typing import Any

import pytest
import yaml

from fencemark.client import AsyncClient, NotFound, Unavailable, tls_credentials
from fencemark.node.api.server import NodeServer
from fencemark.node.security.tls import TlsFiles, init_dir
from tests.cluster import eventually
from tests.conftest import StartNode
from tests.docrun import Shell, Substitutions, run_steps, steps_of
from tests.etcd_server import member_config, restricted
from tests.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS = ROOT / "deploy" / "prometheus"
RULES = PROMETHEUS / "alerts.yml"
RULE_TESTS = PROMETHEUS / "alerts_test.yml"
CONFIG = PROMETHEUS / "prometheus.yml"
OPERATIONS = ROOT / "docs" / "operations.md"
# Series Prometheus makes itself, not a node.
PROMETHEUS_OWN = {"up"}
# Exported by a member of a region of several only (SPEC §10).
MEMBER_ONLY = {
    "fencemark_region_decider",
    "fencemark_region_decider_term",
    "fencemark_member_cut_off",
}


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    """``promtool ARGS`` in deploy/prometheus/ (its tests are marked ``requires("promtool")``)."""
    return subprocess.run(
        ["promtool", *args], cwd=PROMETHEUS, capture_output=True, text=True, timeout=120
    )


def rules() -> list[dict[str, Any]]:
    """Every rule of alerts.yml, in order."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


# -- promtool ---------------------------------------------------------------------------


@pytest.mark.requires("promtool")
def test_promtool_checks_the_rules() -> None:
    done = promtool("check", "rules", RULES.name)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules())} rules found" in done.stdout


@pytest.mark.requires("promtool")
def test_promtool_checks_the_stack_config_and_the_rules_it_loads() -> None:
    done = promtool("check", "config", CONFIG.name)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules())} rules found" in done.stdout


@pytest.mark.requires("promtool")
def test_promtool_unit_tests_of_every_alert_pass() -> None:
    done = promtool("test", "rules", RULE_TESTS.name)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


@pytest.mark.requires("promtool")
def test_operations_md_checks_of_the_rules_run_as_written(tmp_path: Path) -> None:
    """docs/operations.md's ``promtool`` commands, typed at the repository's root."""
    step = steps_of([OPERATIONS])["alerts/check"]
    shell = Shell(ROOT, os.environ, tmp_path / "transcript")
    try:
        checked, tested = run_steps(shell, [step], Substitutions())[step.id]
    finally:
        shell.close()
    assert f"SUCCESS: {len(rules())} rules found" in checked
    assert "SUCCESS" in tested


def test_every_alert_is_unit_tested_firing_and_quiet() -> None:
    """For each alert, a test where it fires, with input series it must not fire on."""
    tests = yaml.safe_load(RULE_TESTS.read_text())
    assert tests["rule_files"] == [RULES.name]
    tested: set[str] = set()
    for test in tests["tests"]:
        given = [_labels(series["series"]) for series in test["input_series"]]
        for check in test["alert_rule_test"]:
            expected = [alert["exp_labels"] for alert in check["exp_alerts"]]
            if not expected:
                continue
            quiet = [labels for labels in given if not any(_within(e, labels) for e in expected)]
            assert quiet, f"{test['name']}: no series that must stay quiet"
            tested.add(check["alertname"])
    assert tested == {rule["alert"] for rule in rules()}


def _labels(series: str) -> dict[str, str]:
    """``name{a="x", b="y"}`` -> {"__name__": name, "a": "x", "b": "y"}."""
    name, _, rest = series.partition("{")
    return {"__name__": name, **dict(re.findall(r'(\w+)="([^"]*)"', rest))}


def _within(expected: dict[str, str], labels: dict[str, str]) -> bool:
    """Whether an alert with ``expected`` labels comes from the series ``labels``."""
    return all(labels.get(k) == str(v) for k, v in expected.items() if k != "severity")


# -- the metrics a node really exports --------------------------------------------------


def selectors(expr: str) -> list[tuple[str, set[str]]]:
    """Each metric an expression selects, with the label names it matches on."""
    found = []
    for match in re.finditer(r"\b([a-z_][a-z0-9_]*)(\{([^}]*)\})?", expr):
        name = match.group(1)
        if name.startswith("fencemark_") or name in PROMETHEUS_OWN:
            found.append((name, set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", match.group(3) or ""))))
    return found


def documented_metrics() -> dict[str, set[str]]:
    """docs/operations.md's metrics table: each metric name -> its documented labels."""
    text = OPERATIONS.read_text()
    table = text[text.index("| metric | type | labels |") : text.index("### Alerts worth setting")]
    metrics: dict[str, set[str]] = {}
    for row in table.splitlines()[2:]:
        cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
        if len(cells) < 4:
            continue
        labels = set(re.findall(r"`(\w+)`", cells[2]))
        for name in re.findall(r"`(fencemark_\w+)`", cells[0]):
            metrics[name] = labels
    return metrics


def exported(text: str) -> dict[str, str]:
    """The sample names an exposition can carry -> the family's documented name."""
    names: dict[str, str] = {}
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.MULTILINE):
        if kind == "histogram":
            names.update({f"{name}{suffix}": name for suffix in ("_bucket", "_sum", "_count")})
        elif not name.endswith("_created"):
            names[name] = name
    return names


def sample_labels(text: str) -> dict[str, set[str]]:
    """The label names of the samples in an exposition, by sample name."""
    labels: dict[str, set[str]] = {}
    for name, rest in re.findall(r"^([a-z_][a-z0-9_]*)\{([^}]*)\}", text, flags=re.MULTILINE):
        labels.setdefault(name, set()).update(re.findall(r'(\w+)="', rest))
    return labels


async def scrape_a_real_node(start_node: StartNode, tmp_path: Path) -> str:
    """/metrics of a node under mutual TLS, with a peer, after a few calls."""
    certs = tmp_path / "certs"
    init_dir(certs, regions=["us", "eu"], clients=["operator"])
    node = await start_node(
        "us",
        tls=TlsFiles.in_dir(certs, "us"),
        peers={"eu": f"127.0.0.1:{free_port()}"},  # nothing listens: unreachable
        metrics_listen="127.0.0.1:0",
    )
    async with AsyncClient(node.address, credentials=tls_credentials(certs, "operator")) as client:
        made = await client.remember("ops", "t", "a", title="x", tags=["homeRegion:us"])
        with pytest.raises(NotFound):  # a refusal, counted by method and reason
            await client.get(made.record.key.replace("/a", "/b"))
        # Catching up with eu, which never answers: claims are refused, not decided.
        with pytest.raises(Unavailable):
            await client.claim(made.record.key, "alice")
    url = f"http://127.0.0.1:{node.metrics.port}/metrics"

    def get() -> str:
        with urllib.request.urlopen(url, timeout=5) as response:
            return str(response.read().decode())

    return await asyncio.to_thread(get)


@pytest.mark.slow
async def test_every_metric_and_label_the_rules_use_is_exported(
    start_node: StartNode, tmp_path: Path
) -> None:
    text = await scrape_a_real_node(start_node, tmp_path)
    judge(text, exempt=MEMBER_ONLY)


def judge(text: str, *, exempt: Set[str] = frozenset(), only: Set[str] | None = None) -> None:
    """The exposition ``text`` against the docs' table and the rules: every metric
    documented (but ``exempt``; ``only`` these, if given) is exported, with the
    documented labels, and every metric a rule selects is, with the labels it uses."""
    names, seen, documented = exported(text), sample_labels(text), documented_metrics()
    wanted = {n for n in documented if n not in exempt and (only is None or n in only)}
    # The docs list what the node exports, no more.
    assert wanted <= set(names.values()), wanted - set(names.values())
    for name, labels in seen.items():
        if name in names and names[name] in wanted and not name.endswith("_bucket"):
            assert labels == documented[names[name]], name
    for rule in rules():
        for name, labels in selectors(rule["expr"]):
            if name in PROMETHEUS_OWN or name in exempt or (only is not None and name not in only):
                continue
            assert name in names, f"{rule['alert']}: {name} is not exported by a node"
            assert labels <= documented[names[name]], f"{rule['alert']}: {name} {labels}"


@pytest.mark.slow
async def test_a_members_metrics_and_the_rules_that_use_them(tmp_path: Path) -> None:
    """A member of a region of several, elected through a real etcd: what it exports
    of its region's decider is documented, and the rules select it as exported."""
    async with restricted(tmp_path) as (server, certs):
        config = member_config(tmp_path, server, certs, "us-a", metrics_listen="127.0.0.1:0")
        node = await NodeServer.start(config)
        try:
            url = f"http://127.0.0.1:{node.metrics.port}/metrics"

            def get() -> str:
                with urllib.request.urlopen(url, timeout=5) as response:
                    return str(response.read().decode())

            async def decides() -> bool:
                return 'fencemark_region_decider{decider="us-a",region="us"} 1.0' in (
                    await asyncio.to_thread(get)
                )

            await eventually(decides, "the member exporting itself as its region's decider")
            judge(await asyncio.to_thread(get), only=MEMBER_ONLY)
        finally:
            await node.stop(0)


# -- the docs' table ----------------------------------------------------------------------


def documented_alerts() -> dict[str, tuple[str, str, str]]:
    """docs/operations.md's alerts table: name -> (expression, for, severity)."""
    text = OPERATIONS.read_text()
    start = text.index("### Alerts worth setting")
    table = text[start : text.index("\n## ", start)]
    alerts = {}
    for row in table.splitlines():
        cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
        name = re.match(r"`(Fencemark\w+)`", cells[0])
        if row.startswith("|") and name:
            expression = re.fullmatch(r"`([^`]+)`", cells[1])
            assert expression, f"{name.group(1)}: the expression cell is one code span"
            alerts[name.group(1)] = (expression.group(1), cells[2].strip("`"), cells[3].strip("`"))
    return alerts


def test_the_docs_table_says_what_the_rules_file_says() -> None:
    in_file = {
        rule["alert"]: (rule["expr"], rule.get("for", "—"), rule["labels"]["severity"])
        for rule in rules()
    }
    assert documented_alerts() == in_file

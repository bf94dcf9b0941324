"""The compose stack's Prometheus (deploy/docker-compose.prometheus.yml).

Its image is Debian's ``prometheus`` package on the air-gapped base
(deploy/build-package-image.sh --package prometheus). The stack with it runs in
docs/deploy.md's compose steps (tests/test_deploy.py), which ask Prometheus' own
HTTP API, on its port published on 127.0.0.1, with the checks here: whether it
scrapes every node, what the nodes report through it, and whether it loaded and
evaluates the alert rules. Here, too: adding or removing the file changes nothing of
the regions, so it recreates none."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.compose import (
    COMPOSE_FILE,
    DATA_VARIABLE,
    MEMBERS,
    NODES,
    PROMETHEUS_FILE,
    REGIONS,
    clean_env,
    region_of,
)
from tests.dockerenv import DEPLOY, run, wait_until

RULES = DEPLOY / "prometheus" / "alerts.yml"
NODE_TARGETS = {f"{node}:9400" for node in NODES}
# Up, a first scrape (every 10 s), a first round of the rules (every 10 s), with room.
READY_LIMIT_S = 120.0


class Prometheus:
    """Prometheus' HTTP API at ``base`` (http://127.0.0.1:PORT)."""

    def __init__(self, base: str) -> None:
        self.base = base

    def get(self, path: str, **query: str) -> Any:
        url = f"{self.base}{path}?{urllib.parse.urlencode(query)}"
        with urllib.request.urlopen(url, timeout=5) as response:
            answer = json.loads(response.read())
        assert answer["status"] == "success", answer
        return answer["data"]

    def answers(self) -> bool:
        try:
            self.get("/api/v1/status/buildinfo")
        except OSError:
            return False
        return True

    def node_targets(self) -> dict[str, dict[str, Any]]:
        """The active targets of job ``fencemark``, by instance."""
        targets = self.get("/api/v1/targets", state="active")["activeTargets"]
        return {t["labels"]["instance"]: t for t in targets if t["labels"]["job"] == "fencemark"}

    def query(self, expr: str) -> dict[str, tuple[dict[str, str], float]]:
        """An instant query's series, keyed by instance (and peer, where there is one)."""
        result = self.get("/api/v1/query", query=expr)["result"]
        return {
            "/".join(filter(None, (s["metric"]["instance"], s["metric"].get("peer")))): (
                s["metric"],
                float(s["value"][1]),
            )
            for s in result
        }

    def rules(self) -> list[dict[str, Any]]:
        return [rule for group in self.get("/api/v1/rules")["groups"] for rule in group["rules"]]


def services(compose: list[str], *files: Path) -> dict[str, object]:
    """Every service as ``docker-compose config`` makes it of ``files``, merged."""
    args = [arg for file in files for arg in ("--file", str(file))]
    env = clean_env(**{DATA_VARIABLE: "/srv/fencemark"})
    done = run([*compose, "--env-file", str(DEPLOY / ".env.example"), *args, "config"], env=env)
    found: dict[str, object] = yaml.safe_load(done.stdout)["services"]
    return found


@pytest.mark.docker
def test_adding_or_removing_prometheus_changes_no_region(compose: list[str]) -> None:
    """docker-compose 1.29 sorts a service's ports and volumes when it merges two files:
    unless the regions list them in that order, their configuration, and so its hash,
    differs with the second file, and turning Prometheus on or off recreates them all."""
    alone = services(compose, COMPOSE_FILE)
    with_prometheus = services(compose, COMPOSE_FILE, PROMETHEUS_FILE)
    assert set(with_prometheus) - set(alone) == {"prometheus"}
    for name, service in alone.items():
        assert with_prometheus[name] == service, name


def check_targets(prometheus: Prometheus) -> None:
    """Every node is a target of job ``fencemark``, and is up."""

    def all_up() -> bool:
        targets = prometheus.node_targets()
        return set(targets) == NODE_TARGETS and all(t["health"] == "up" for t in targets.values())

    try:
        wait_until("every node scraped", READY_LIMIT_S, all_up)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {prometheus.node_targets()}") from None
    up = prometheus.query('up{job="fencemark"}')
    assert {instance: value for instance, (_, value) in up.items()} == dict.fromkeys(
        NODE_TARGETS, 1.0
    )


def peers_of(node: str) -> set[str]:
    """The peers ``node`` replicates with, as its metrics name them: the other regions,
    and a member's fellow members (``us/us-b``)."""
    region = region_of(node)
    fellows = {f"{region}/{m}" for m in MEMBERS if m != node} if node in MEMBERS else set()
    return {r for r in REGIONS if r != region} | fellows


def check_what_the_nodes_report(prometheus: Prometheus) -> None:
    """Each node's own metrics, as Prometheus stored them: which region answers at each
    target, that every node reaches each of its peers, and that us's three members
    name one decider."""
    info = prometheus.query("fencemark_node_info")
    assert {instance: labels["region"] for instance, (labels, _) in info.items()} == {
        f"{node}:9400": region_of(node) for node in NODES
    }
    pairs = {f"{node}:9400/{peer}" for node in NODES for peer in peers_of(node)}

    def all_reachable() -> bool:
        reachable = prometheus.query("fencemark_replication_reachable")
        return set(reachable) == pairs and all(value == 1 for _, value in reachable.values())

    wait_until("every node reaching each of its peers, as scraped", READY_LIMIT_S, all_reachable)
    serving = prometheus.query("fencemark_claims_serving")
    assert set(serving) == NODE_TARGETS

    def one_decider() -> bool:
        named = prometheus.query("fencemark_region_decider")
        deciders = {labels.get("decider") for labels, value in named.values() if value == 1}
        return set(named) == {f"{m}:9400" for m in MEMBERS} and len(deciders) == 1

    wait_until("us's three members naming one decider, as scraped", READY_LIMIT_S, one_decider)


def check_rules(prometheus: Prometheus) -> None:
    """The alert rules of deploy/prometheus/alerts.yml are loaded and evaluate cleanly."""
    expected = {
        rule["alert"]: rule["expr"]
        for group in yaml.safe_load(RULES.read_text())["groups"]
        for rule in group["rules"]
    }

    def evaluated() -> bool:
        rules = prometheus.rules()
        return len(rules) == len(expected) and all(r["health"] == "ok" for r in rules)

    try:
        wait_until("every rule evaluated", READY_LIMIT_S, evaluated)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {prometheus.rules()}") from None
    loaded = {rule["name"]: rule for rule in prometheus.rules()}
    assert {name: rule["query"] for name, rule in loaded.items()} == expected
    assert all(rule["type"] == "alerting" for rule in loaded.values())
    assert all(not rule.get("lastError") for rule in loaded.values())

"""Reading a node's Prometheus counters in tests (its registry, not the HTTP endpoint)."""

from __future__ import annotations

from fencemark.node.api.server import NodeServer
from tests.cluster import eventually


def counters(node: NodeServer, name: str, *labels: str) -> dict[tuple[str, ...], float]:
    """The ``name`` counter's totals, keyed by the values of ``labels``."""
    return {
        tuple(sample.labels[label] for label in labels): sample.value
        for metric in node.metrics.registry.collect()
        if metric.name == name
        for sample in metric.samples
        if sample.name.endswith("_total")
    }


def refusals(node: NodeServer) -> dict[tuple[str, ...], float]:
    """Refusals by (method, reason)."""
    return counters(node, "fencemark_refusals", "method", "reason")


def gauges(node: NodeServer, name: str, *labels: str) -> dict[tuple[str, ...], float]:
    """The ``name`` gauge's values, keyed by the values of ``labels``."""
    return {
        tuple(sample.labels[label] for label in labels): sample.value
        for metric in node.metrics.registry.collect()
        if metric.name == name
        for sample in metric.samples
    }


async def refused_once(node: NodeServer, method: str, reason: str) -> None:
    """Until ``node`` has counted exactly one refusal of ``method`` for ``reason``: the
    counter moves as the call's handler ends, which may be just after the caller
    already has its error (a test that read it at once raced it)."""

    async def counted() -> bool:
        return refusals(node).get((method, reason), 0) >= 1

    await eventually(counted, f"{method}'s {reason} refusal counted", within=5)
    assert refusals(node)[(method, reason)] == 1

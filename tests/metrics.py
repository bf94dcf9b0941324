"""Reading a node's Prometheus counters in tests (its registry, not the HTTP endpoint)."""

from __future__ import annotations

from fencemark.node.api.server import NodeServer


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

"""The benchmark scenarios, by name, in the order a full run takes them.

Standard library only: ``fencemark bench --help`` lists them, and ``fencemark
bench`` says what to install, on an install without the benchmark extra.
"""

from __future__ import annotations

import importlib.util

SCENARIOS: dict[str, str] = {
    "wan": "three regions a round trip apart, and one cut off, vs an etcd cluster across them",
    "claims": "the claim cycle vs bare gRPC, etcd and durable Redis",
    "writes": "unfenced writes vs bare gRPC",
    "lag": "replication lag between regions",
    "anti-entropy": "anti-entropy's cost in sync and after a partition",
    "footprint": "disk and memory per record",
    "drain": "agents draining a backlog vs etcd and durable Redis",
    "feed": "the change feed's latency, and its cost per watcher",
    "fleet": "a fleet of agents on one node, most of them idle",
    "failover": "a region's decider killed under a drain, vs etcd's leader and Redis's primary",
}
# What the scenarios import, from the `bench` extra (pyproject.toml).
EXTRA_MODULES = ("redis", "matplotlib", "psutil", "pyinstrument")
INSTALL_EXTRA = "pip install 'fencemark[bench]'"


def missing_modules() -> list[str]:
    """The benchmark extra's modules this environment cannot import."""
    return [name for name in EXTRA_MODULES if importlib.util.find_spec(name) is None]

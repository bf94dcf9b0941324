"""Shared fixtures: real nodes on loopback, on real SQLite files under tmp_path.

Nothing here mocks a Fencemark component: ``node`` is the gRPC server the
``fencemark node`` command runs, ``client`` the published client library.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings

from fencemark.client import AsyncClient
from fencemark.node.api.server import NodeConfig, NodeServer
from tests import dockerenv

settings.register_profile(
    "ci", max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=50, deadline=None)
settings.register_profile("thorough", max_examples=2000, deadline=None)
# One test run per mutant (make mutate, docs/testing.md): dev-sized, the same examples
# every run so scores compare, and no shrinking (a mutant is killed by any failure;
# shrinking it costs time and tells nothing) nor saved examples (each run stands alone).
settings.register_profile(
    "mutation",
    max_examples=50,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

StartNode = Callable[..., Awaitable[NodeServer]]

LEFTOVER_GRACE_S = 10.0


def pytest_unconfigure(config: pytest.Config) -> None:
    """End the run even when a failed test left a node's threads behind.

    A test stopped by its timeout never stops its nodes, and the interpreter then
    waits at exit for their storage threads: the run would hang after reporting
    its result. Those threads get a grace to finish; then the run ends with the
    status it already has, naming them.
    """
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join(max(deadline - time.monotonic(), 0.0))
    left = [t.name for t in threading.enumerate() if t.is_alive() and not t.daemon]
    left.remove(threading.main_thread().name)
    if left:
        print(f"\nthreads a test left running, not waited for: {left}", file=sys.stderr)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(int(getattr(config, "_fencemark_exit_status", 1)))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config._fencemark_exit_status = exitstatus  # type: ignore[attr-defined]


@pytest.fixture
async def start_node(tmp_path: Path) -> AsyncIterator[StartNode]:
    """Start in-process nodes: ``await start_node(region=..., enable_writes=...)``.

    Each node gets its own data directory under ``tmp_path`` (pass ``data_dir``
    to reuse one, e.g. for a restart); all are stopped at the end of the test.
    """
    running: list[NodeServer] = []

    async def start(
        region: str = "local",
        *,
        enable_writes: bool = True,
        data_dir: Path | None = None,
        **overrides: object,
    ) -> NodeServer:
        config = NodeConfig(
            region=region,
            listen=str(overrides.pop("listen", "127.0.0.1:0")),
            data_dir=data_dir or tmp_path / f"{region}-{len(running)}",
            enable_writes=enable_writes,
            grace_seconds=0.5,
            **overrides,  # type: ignore[arg-type]
        )
        node = await NodeServer.start(config)
        running.append(node)
        return node

    yield start
    for node in reversed(running):
        if not node.stopped:
            await node.stop()


@pytest.fixture
async def node(start_node: StartNode) -> NodeServer:
    """A node of region ``local`` with writes enabled."""
    return await start_node()


@pytest.fixture
async def client(node: NodeServer) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(node.address) as c:
        yield c


@pytest.fixture(scope="session")
def docker_engine() -> None:
    """A Docker engine answers; else skip (locally) or fail (under CI)."""
    if not dockerenv.engine_answers():
        dockerenv.missing("no Docker engine answers")


@pytest.fixture(scope="session")
def image(docker_engine: None) -> str:
    """The Fencemark image's tag, built air-gapped if ``make image`` has not built it."""
    return dockerenv.ensure_image()


@pytest.fixture(scope="session")
def compose(docker_engine: None) -> list[str]:
    """The compose command: Debian's docker-compose (v1.29), else ``docker compose`` (v2)."""
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    dockerenv.missing("neither docker-compose nor docker compose is installed")
    raise AssertionError("unreachable")


@pytest.fixture(scope="session")
def prometheus_image(docker_engine: None) -> str:
    """The stack's Prometheus image, built air-gapped unless it is up to date."""
    return dockerenv.ensure_prometheus_image()

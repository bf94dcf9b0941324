"""Shared fixtures: real nodes on loopback, on real SQLite files under tmp_path.

Nothing here mocks a Fencemark component: ``node`` is the gRPC server the
``fencemark node`` command runs, ``client`` the published client library.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import HealthCheck, Phase, settings

from fencemark.client import AsyncClient
from fencemark.node.api.server import NodeConfig, NodeServer
from fencemark.node.replication.tuning import Tuning
from tests import components, dockerenv
from tests.cluster import shared_loop
from tests.compose import clean_env

if TYPE_CHECKING:
    from tests.docrun import OperatorSite

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


# -- components a test needs (tests/components.py) -----------------------------------


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for mark in item.iter_markers("requires"):
            components.check_names(mark.args, item.nodeid)
    # A test of minutes (marked `long`) first: a worker starts it at once, and the
    # others share the rest meanwhile, instead of waiting for it at the end.
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers("requires"):
        components.require(*mark.args)


# Around pytest's own summary, so that this block comes last, above the counts.
@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter,
) -> Generator[None, object, object]:
    result = yield
    messages = [
        report.longrepr[2]
        for report in terminalreporter.stats.get("skipped", [])
        if isinstance(report.longrepr, tuple)
    ]
    lines = components.summary_lines(messages)
    if lines:
        terminalreporter.section("skipped for want of a component")
        for line in lines:
            terminalreporter.write_line(line)
    return result


# -- tests side by side (pytest-xdist, docs/testing.md) -------------------------------


# Outermost, so that waiting for a lock is not counted in a test's timeout.
@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    """Under pytest-xdist, the region chaos tier (marked ``alone``) runs alone on the
    machine, and the other container tests one at a time beside the rest.

    The region chaos tier judges its nodes' availability, and a node that a busy
    machine starves for a second takes it for a pause (a nap: it settles again and
    refuses claims meanwhile). So while a Docker engine is here every test holds the
    run's lock shared and that test holds it exclusively: it waits until nothing
    else runs (in practice, the end of the run). The member chaos tier judges only
    safety and that a member decides again, which a busy machine slows but cannot
    break: it runs beside the rest. The container tests share one engine's swarm
    and images: each holds a second lock exclusively.
    """
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # the same in every worker of a run
    if not run:
        return (yield)
    docker = item.get_closest_marker("docker") is not None and components.present("docker")
    alone = docker and item.get_closest_marker("alone") is not None
    with contextlib.ExitStack() as held:
        held.enter_context(_locked(f"fencemark-tests-{run}", exclusive=alone))
        if docker:
            held.enter_context(_locked(f"fencemark-tests-{run}-docker", exclusive=True))
        return (yield)


@contextlib.contextmanager
def _locked(name: str, *, exclusive: bool) -> Iterator[None]:
    """A lock the workers of this run share, in the temporary directory."""
    with (Path(tempfile.gettempdir()) / f"{name}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture
async def start_node(tmp_path: Path) -> AsyncIterator[StartNode]:
    """Start in-process nodes: ``await start_node(region=..., enable_writes=...)``.

    Each node gets its own data directory under ``tmp_path`` (pass ``data_dir``
    to reuse one, e.g. for a restart); all are stopped at the end of the test. Like
    ``tests.cluster.Cluster``'s, the nodes share the test's event loop, so its stalls
    are not taken for naps (``shared_loop``).
    """
    running: list[NodeServer] = []

    async def start(
        region: str = "local",
        *,
        enable_writes: bool = True,
        data_dir: Path | None = None,
        replication: Tuning | None = None,
        **overrides: object,
    ) -> NodeServer:
        config = NodeConfig(
            region=region,
            listen=str(overrides.pop("listen", "127.0.0.1:0")),
            data_dir=data_dir or tmp_path / f"{region}-{len(running)}",
            enable_writes=enable_writes,
            grace_seconds=0.5,
            replication=shared_loop(replication),
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
    components.require("docker")


@pytest.fixture(scope="session")
def image(docker_engine: None) -> str:
    """The Fencemark image's tag, built air-gapped if ``make image`` has not built it."""
    return dockerenv.ensure_image()


@pytest.fixture(scope="session")
def compose(docker_engine: None) -> list[str]:
    """The compose command: Debian's docker-compose (1.29), which docs/deploy.md runs."""
    components.require("docker-compose")
    return ["docker-compose"]


@pytest.fixture(scope="session")
def prometheus_image(docker_engine: None) -> str:
    """The stack's Prometheus image, built air-gapped unless it is up to date."""
    return dockerenv.ensure_prometheus_image()


@pytest.fixture(scope="session")
def etcd_image(docker_engine: None) -> str:
    """A region's etcd image (Debian's etcd-server), built air-gapped unless up to date."""
    return dockerenv.ensure_etcd_image()


@pytest.fixture
def operator_site(
    image: str, prometheus_image: str, etcd_image: str, compose: list[str], tmp_path: Path
) -> Iterator[OperatorSite]:
    """docs/deploy.md's operator machine in a scratch directory (tests/docrun.py), as
    root like the page, with tags of its own for the images (removed afterwards)."""
    from tests import docrun  # it reads tests/test_docs.py, which imports this module

    components.require("root")
    run = uuid.uuid4().hex[:10]
    images = {
        "FENCEMARK_IMAGE": f"{image.rpartition(':')[0]}:doc-{run}",
        "FENCEMARK_PROMETHEUS_IMAGE": f"{prometheus_image.rpartition(':')[0]}:doc-{run}",
        "FENCEMARK_ETCD_IMAGE": f"{etcd_image.rpartition(':')[0]}:doc-{run}",
    }
    dockerenv.run(["docker", "tag", image, images["FENCEMARK_IMAGE"]])
    dockerenv.run(["docker", "tag", prometheus_image, images["FENCEMARK_PROMETHEUS_IMAGE"]])
    dockerenv.run(["docker", "tag", etcd_image, images["FENCEMARK_ETCD_IMAGE"]])
    try:
        yield docrun.OperatorSite.make(tmp_path, images, clean_env())
    finally:
        dockerenv.run(["docker", "image", "rm", *images.values()], check=False)

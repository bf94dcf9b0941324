"""The compose stack of deploy/docker-compose.yml, for the deployment tests.

A :class:`Stack` is one compose project, with a name of its own and isolated from a
developer's ``deploy/.env`` and ``FENCEMARK_*``/``COMPOSE_*`` settings; the
``compose`` fixture (tests/conftest.py) says which compose command runs it.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

from fencemark.client import AsyncClient, FencemarkError, tls_credentials
from tests.dockerenv import DEPLOY, ETCD_IMAGE, IMAGE, IMAGE_UID, inspect, run
from tests.ports import free_port

COMPOSE_FILE = DEPLOY / "docker-compose.yml"
PROMETHEUS_FILE = DEPLOY / "docker-compose.prometheus.yml"  # the opt-in Prometheus
DATA_VARIABLE = "REPOCONTEXT_MEMORY_ARCHIVE_PATH"
REGIONS = ("us", "eu", "ap")
MEMBERS = ("us-a", "us-b", "us-c")  # region us: three members, electing through ETCDS
NODES = (*MEMBERS, "eu", "ap")  # every node's service
ETCDS = ("etcd-0", "etcd-1", "etcd-2")


def port_variable(node: str, what: str = "") -> str:
    """The setting naming ``node``'s host port: FENCEMARK_US_A_PORT, _METRICS_PORT..."""
    return f"FENCEMARK_{node.upper().replace('-', '_')}_{what + '_' if what else ''}PORT"


def region_of(node: str) -> str:
    return node.partition("-")[0]


def clean_env(**settings: str) -> dict[str, str]:
    """This environment without deployment settings, plus ``settings``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FENCEMARK_", "COMPOSE_")) and k != DATA_VARIABLE
    }
    return {**env, **settings}


class Stack:
    """One compose project of deploy/docker-compose.yml, isolated from the host's .env."""

    def __init__(
        self,
        compose: list[str],
        tmp_path: Path,
        settings: dict[str, str],
        files: tuple[Path, ...] = (COMPOSE_FILE,),
    ) -> None:
        self.project = f"fencemarktest{uuid.uuid4().hex[:10]}"
        # An empty env file, so that a developer's deploy/.env changes nothing here.
        env_file = tmp_path / "empty.env"
        env_file.touch()
        self.command = [*compose, "--env-file", str(env_file)]
        for file in files:
            self.command += ["--file", str(file)]
        self.command += ["--project-name", self.project]
        self.env = clean_env(FENCEMARK_IMAGE=IMAGE, FENCEMARK_ETCD_IMAGE=ETCD_IMAGE, **settings)

    def __call__(
        self, *args: str, limit_s: float = 120.0, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        return run([*self.command, *args], limit_s=limit_s, env=self.env, check=check)

    def containers(self) -> list[str]:
        """Every container of this project, whatever its state."""
        label = f"label=com.docker.compose.project={self.project}"
        return run(["docker", "ps", "--all", "--quiet", "--filter", label]).stdout.split()

    def container(self, service: str) -> str:
        return self("ps", "-q", service).stdout.strip()

    def health(self, service: str) -> str:
        container = self.container(service)
        if not container:
            return "missing"
        state = inspect("container", container)["State"]
        assert isinstance(state, dict)
        if state["Status"] != "running":
            return str(state["Status"])
        return str(state["Health"]["Status"])

    def volumes(self) -> list[str]:
        """Every volume of this project."""
        label = f"label=com.docker.compose.project={self.project}"
        return run(["docker", "volume", "ls", "--quiet", "--filter", label]).stdout.split()

    def down(self) -> None:
        """Remove the project's containers, network and volumes; assert nothing is left."""
        down = self("down", "--volumes", "--remove-orphans", "--timeout", "20", check=False)
        assert down.returncode == 0, down.stderr
        assert not self.containers()
        assert not self.volumes()


def published_ports() -> tuple[dict[str, int], dict[str, int], dict[str, str]]:
    """Free host ports for each node's API and metrics, and the settings naming them
    (and free ones for the dashboards: :func:`dashboard_ports` reads them)."""
    ports = {node: free_port() for node in NODES}
    metrics = {node: free_port() for node in NODES}
    settings = {
        **{port_variable(n): str(p) for n, p in ports.items()},
        **{port_variable(n, "METRICS"): str(p) for n, p in metrics.items()},
        **{port_variable(n, "DASHBOARD"): str(free_port()) for n in NODES},
    }
    return ports, metrics, settings


def dashboard_ports(settings: dict[str, str]) -> dict[str, int]:
    """Each node's dashboard host port in ``settings`` (from :func:`published_ports`)."""
    return {node: int(settings[port_variable(node, "DASHBOARD")]) for node in NODES}


def data_root(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """One data directory per node and per etcd, writable by the nodes' user, and that
    user."""
    root = tmp_path / "archive"
    names = (*NODES, *ETCDS, "certs")  # certs/: the stack's CA and certificates
    for name in names:
        (root / name).mkdir(parents=True, mode=0o750)
    if os.geteuid() == 0:
        for path in (root, *(root / name for name in names)):
            os.chown(path, IMAGE_UID, IMAGE_UID)
        return root, {}
    return root, {"FENCEMARK_UID": str(os.getuid()), "FENCEMARK_GID": str(os.getgid())}


async def us_decider(
    ports: dict[str, int], root: Path, *, every_member: bool = False
) -> tuple[str, int]:
    """The member of us that its members name as decider, and its term, asked as the
    stack's ``operator`` (its certificates under ``root``); ("", 0) while they name
    none, or differ, or (``every_member``) one does not answer."""
    named = set()
    for member in MEMBERS:
        try:
            async with AsyncClient(f"127.0.0.1:{ports[member]}", timeout=3.0, retries=0,
                                   credentials=tls_credentials(root / "certs", "operator")
                                   ) as client:  # fmt: skip
                info = await client.info()
        except FencemarkError:
            if every_member:
                return "", 0
            continue
        named.add((info.decider.member, info.decider.term) if info.decider else ("", 0))
    return named.pop() if len(named) == 1 else ("", 0)

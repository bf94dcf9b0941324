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

from tests.dockerenv import DEPLOY, IMAGE, IMAGE_UID, inspect, run
from tests.ports import free_port

COMPOSE_FILE = DEPLOY / "docker-compose.yml"
PROMETHEUS_FILE = DEPLOY / "docker-compose.prometheus.yml"  # the opt-in Prometheus
DATA_VARIABLE = "REPOCONTEXT_MEMORY_ARCHIVE_PATH"
REGIONS = ("us", "eu", "ap")


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
        self.env = clean_env(FENCEMARK_IMAGE=IMAGE, **settings)

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
    """Free host ports for each region's API and metrics, and the settings naming them
    (and free ones for the dashboards: :func:`dashboard_ports` reads them)."""
    ports = {region: free_port() for region in REGIONS}
    metrics = {region: free_port() for region in REGIONS}
    settings = {
        **{f"FENCEMARK_{r.upper()}_PORT": str(p) for r, p in ports.items()},
        **{f"FENCEMARK_{r.upper()}_METRICS_PORT": str(p) for r, p in metrics.items()},
        **{_dashboard_variable(r): str(free_port()) for r in REGIONS},
    }
    return ports, metrics, settings


def _dashboard_variable(region: str) -> str:
    return f"FENCEMARK_{region.upper()}_DASHBOARD_PORT"


def dashboard_ports(settings: dict[str, str]) -> dict[str, int]:
    """Each region's dashboard host port in ``settings`` (from :func:`published_ports`)."""
    return {region: int(settings[_dashboard_variable(region)]) for region in REGIONS}


def data_root(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """One data directory per region, writable by the nodes' user, and that user."""
    root = tmp_path / "archive"
    for name in (*REGIONS, "certs"):  # certs/: the stack's CA and certificates
        (root / name).mkdir(parents=True, mode=0o750)
    if os.geteuid() == 0:
        for path in (root, *(root / r for r in (*REGIONS, "certs"))):
            os.chown(path, IMAGE_UID, IMAGE_UID)
        return root, {}
    return root, {"FENCEMARK_UID": str(os.getuid()), "FENCEMARK_GID": str(os.getgid())}

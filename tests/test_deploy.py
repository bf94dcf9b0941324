"""SPEC §7 ``deploy/``: the image and the three-region compose stack, on a real engine.

Tests marked ``docker`` drive the real ``docker`` and ``docker-compose`` CLIs,
through the ``docker_engine`` and ``image`` fixtures (tests/dockerenv.py: skipped
without an engine, failed under CI). Traffic goes only to ports published on
127.0.0.1 and to containers these tests created; everything created is removed.

``fencemark health``, the image's HEALTHCHECK, is tested against in-process
nodes without Docker.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fencemark.client import AsyncClient, tls_credentials
from tests.compose import (
    COMPOSE_FILE,
    DATA_VARIABLE,
    PROMETHEUS_FILE,
    REGIONS,
    Stack,
    clean_env,
    data_root,
    published_ports,
)
from tests.conftest import StartNode
from tests.dockerenv import (
    BASE_IMAGE,
    BUILD_LIMIT_S,
    DEPLOY,
    IMAGE_UID,
    inspect,
    run,
    wait_until,
)
from tests.ports import free_port

CLAIMS_SERVICE = "fencemark.v1.Claims"
HEALTHY_LIMIT_S = 90.0
CONVERGE_LIMIT_S = 30.0


# -- running commands ----------------------------------------------------------------


def fencemark(*args: str, limit_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    """The host's ``fencemark`` command (this interpreter), exit code unchecked."""
    return run([sys.executable, "-m", "fencemark.node", *args], limit_s=limit_s, check=False)


# -- fencemark health, without docker ------------------------------------------------


@pytest.mark.slow
async def test_health_exits_0_when_the_node_serves(start_node: StartNode) -> None:
    node = await start_node()
    done = await asyncio.to_thread(fencemark, "health", "--target", node.address)
    assert done.returncode == 0, done.stderr
    assert "SERVING" in done.stdout


@pytest.mark.slow
async def test_health_of_a_service_exits_1_while_it_does_not_serve(
    start_node: StartNode,
) -> None:
    """A fresh node whose only peer never answers does not decide claims yet."""
    node = await start_node(peers={"eu": f"127.0.0.1:{free_port()}"})
    done = await asyncio.to_thread(
        fencemark, "health", "--target", node.address, "--service", CLAIMS_SERVICE
    )
    assert done.returncode == 1
    assert f"{CLAIMS_SERVICE}: NOT_SERVING" in done.stdout
    overall = await asyncio.to_thread(fencemark, "health", "--target", node.address)
    assert overall.returncode == 0, overall.stderr


@pytest.mark.slow
async def test_health_exits_1_for_an_unknown_service(start_node: StartNode) -> None:
    node = await start_node()
    done = await asyncio.to_thread(
        fencemark, "health", "--target", node.address, "--service", "no.such.Service"
    )
    assert done.returncode == 1
    assert "no.such.Service" in done.stderr


@pytest.mark.slow
def test_health_exits_1_when_nothing_listens() -> None:
    target = f"127.0.0.1:{free_port()}"
    done = fencemark("health", "--target", target, "--timeout", "1")
    assert done.returncode == 1
    assert target in done.stderr and "UNAVAILABLE" in done.stderr


# -- the compose file, read ----------------------------------------------------------


def test_every_compose_variable_is_documented_in_env_example() -> None:
    text = COMPOSE_FILE.read_text() + PROMETHEUS_FILE.read_text()
    used = set(re.findall(r"\$\{([A-Z0-9_]+)", text))
    example = (DEPLOY / ".env.example").read_text()
    documented = set(re.findall(r"^([A-Z0-9_]+)=", example, flags=re.MULTILINE))
    assert DATA_VARIABLE in used
    assert used == documented


def test_compose_publishes_ports_on_loopback_only() -> None:
    text = COMPOSE_FILE.read_text() + PROMETHEUS_FILE.read_text()
    published = re.findall(r'^\s*- "([^"]*:\d+)"', text, flags=re.MULTILINE)
    # The API and the metrics of each region, and Prometheus' UI and API.
    assert len(published) == 2 * len(REGIONS) + 1
    assert all(mapping.startswith("127.0.0.1:") for mapping in published)


# -- the image -----------------------------------------------------------------------


@pytest.mark.docker
@pytest.mark.timeout(2 * BUILD_LIMIT_S)
def test_image_is_built_air_gapped_and_runs_as_non_root(image: str) -> None:
    config = inspect("image", image)["Config"]
    assert isinstance(config, dict)
    labels = config["Labels"] or {}
    assert labels.get("org.opencontainers.image.base.name") == BASE_IMAGE, (
        f"{image} was not built on the air-gapped base (make image builds it so)"
    )
    # Imported from a debootstrap tree, never pulled: a pulled image has a digest.
    assert inspect("image", BASE_IMAGE)["RepoDigests"] in (None, [])
    assert config["User"] == f"{IMAGE_UID}:{IMAGE_UID}"
    assert "7400/tcp" in config["ExposedPorts"]
    assert "/var/lib/fencemark" in config["Volumes"]
    assert config["Cmd"] == ["node"]
    assert "health" in config["Healthcheck"]["Test"]


@pytest.fixture
def container_name() -> Iterator[str]:
    """A unique name; the container is removed afterwards, whatever happened."""
    name = f"fencemark-test-{uuid.uuid4().hex[:10]}"
    yield name
    run(["docker", "rm", "--force", "--volumes", name], check=False)


@pytest.mark.docker
@pytest.mark.timeout(2 * BUILD_LIMIT_S)
def test_container_is_healthy_and_stops_gracefully_on_sigterm(
    image: str, container_name: str
) -> None:
    run(["docker", "run", "--detach", "--name", container_name,
         "--label", "fencemark.test=deploy", "--publish", "127.0.0.1::7400",
         "--env", "FENCEMARK_REGION=us", "--env", "FENCEMARK_ENABLE_WRITES=1",
         "--env", "FENCEMARK_INSECURE=1", image])  # fmt: skip
    host_port = run(["docker", "port", container_name, "7400/tcp"]).stdout.split()[0]
    assert host_port.startswith("127.0.0.1:")

    wait_until(
        "fencemark health through the published port",
        HEALTHY_LIMIT_S,
        lambda: fencemark("health", "--target", host_port, "--timeout", "1").returncode == 0,
    )
    # The image's own HEALTHCHECK (its first run is one interval, 10 s, after the start).
    wait_until(
        "docker health status healthy",
        HEALTHY_LIMIT_S,
        lambda: inspect("container", container_name)["State"]["Health"]["Status"] == "healthy",  # type: ignore[index]
    )
    pid1 = run(["docker", "exec", container_name, "cat", "/proc/1/cmdline"]).stdout
    assert pid1.split("\0")[1:3] == ["/opt/fencemark/bin/fencemark", "node"]

    started = time.monotonic()
    run(["docker", "stop", "--time", "20", container_name], limit_s=30)
    stopped_in = time.monotonic() - started
    state = inspect("container", container_name)["State"]
    assert isinstance(state, dict)
    logs = run(["docker", "logs", container_name]).stderr
    assert state["ExitCode"] == 0, logs
    assert stopped_in < 10, f"docker stop took {stopped_in:.1f} s: SIGTERM was not handled"
    assert "Traceback" not in logs


@pytest.mark.docker
@pytest.mark.timeout(2 * BUILD_LIMIT_S)
def test_a_data_directory_it_cannot_write_is_refused_in_words(
    image: str, container_name: str, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    data.mkdir(mode=0o755)
    if data.stat().st_uid == IMAGE_UID:
        pytest.skip("the test directory already belongs to the image's user")
    done = run(
        ["docker", "run", "--name", container_name, "--volume", f"{data}:/var/lib/fencemark",
         image],
        check=False,
    )  # fmt: skip
    assert done.returncode == 78, done.stderr
    assert "cannot write the data directory /var/lib/fencemark" in done.stderr
    assert "Traceback" not in done.stderr


# -- the compose stack ---------------------------------------------------------------


def scrape(url: str) -> dict[str, float]:
    """A Prometheus endpoint's samples: 'name{label="value",...}' -> value."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return {
        sample.name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                       + "}" if sample.labels else ""): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }  # fmt: skip


def operator(root: Path) -> grpc.ChannelCredentials:
    """The stack's client certificate ``operator``, made by its ``certs`` service."""
    return tls_credentials(root / "certs", "operator")


def tls_flags(root: Path) -> list[str]:
    return ["--tls-dir", str(root / "certs"), "--tls-name", "operator"]


async def record_digests(target: str, root: Path) -> dict[str, bytes]:
    """Every record (tombstones too) of the repos written here: key -> digest."""
    async with AsyncClient(target, timeout=5.0, retries=0, credentials=operator(root)) as client:
        return {
            record.key: record.digest
            for repo in ("lattice", "deploy-test")
            async for record in client.iter_records(repo, include_deleted=True)
        }


async def write_one_record_per_region(ports: dict[str, int], root: Path) -> None:
    for region, port in ports.items():
        async with AsyncClient(
            f"127.0.0.1:{port}", timeout=5.0, credentials=operator(root)
        ) as client:
            await client.remember(
                "deploy-test", "regions", region, title=f"written in {region}",
                tags=[f"homeRegion:{region}"],
            )  # fmt: skip


@pytest.mark.docker
@pytest.mark.timeout(2 * BUILD_LIMIT_S)
def test_compose_stack_runs_the_walkthrough_and_converges(
    image: str, compose: list[str], tmp_path: Path
) -> None:
    root, user = data_root(tmp_path)
    ports, metrics_ports, port_settings = published_ports()
    stack = Stack(compose, tmp_path, {DATA_VARIABLE: str(root), **port_settings, **user})
    try:
        stack("up", "--detach")
        for region, port in ports.items():
            published = stack("port", region, "7400").stdout.strip()
            assert published == f"127.0.0.1:{port}", f"{region} is published on {published}"
        wait_until(
            "every region healthy (serving)",
            HEALTHY_LIMIT_S,
            lambda: all(stack.health(r) == "healthy" for r in REGIONS),
        )
        # Healthy is not yet deciding: new disks, so each catches up with its peers first.
        wait_until(
            "every region deciding claims",
            HEALTHY_LIMIT_S,
            lambda: all(
                fencemark("health", "--target", f"127.0.0.1:{port}", "--service",
                          CLAIMS_SERVICE, *tls_flags(root)).returncode == 0
                for port in ports.values()
            ),
        )  # fmt: skip

        walkthrough = fencemark(
            "walkthrough", "--target", f"127.0.0.1:{ports['us']}", *tls_flags(root)
        )
        assert walkthrough.returncode == 0, walkthrough.stdout + walkthrough.stderr
        asyncio.run(write_one_record_per_region(ports, root))

        seen: dict[str, dict[str, bytes]] = {}

        def converged() -> bool:
            for region, port in ports.items():
                seen[region] = asyncio.run(record_digests(f"127.0.0.1:{port}", root))
            first = seen[REGIONS[0]]
            return len(first) == 1 + len(REGIONS) and all(s == first for s in seen.values())

        try:
            wait_until("all regions holding the same records", CONVERGE_LIMIT_S, converged)
        except AssertionError as exc:
            shown = {r: {k: d.hex()[:12] for k, d in s.items()} for r, s in seen.items()}
            raise AssertionError(f"{exc}; last seen: {shown}") from None
        for region, port in metrics_ports.items():
            metrics = scrape(f"http://127.0.0.1:{port}/metrics")
            assert metrics["fencemark_records"] == 1 + len(REGIONS), region
            for peer in REGIONS:
                if peer != region:
                    assert metrics[f'fencemark_replication_reachable{{peer="{peer}"}}'] == 1
        for region, port in ports.items():
            status = fencemark("status", "--targets", f"127.0.0.1:{port}", *tls_flags(root))
            assert f" {region} " in status.stdout and "UNREACHABLE" not in status.stdout, (
                status.stdout
            )
    except BaseException:
        print(stack("logs", "--no-color", "--tail", "40", check=False).stdout)
        raise
    finally:
        stack.down()


@pytest.mark.docker
def test_compose_refuses_to_start_without_the_data_path(compose: list[str], tmp_path: Path) -> None:
    stack = Stack(compose, tmp_path, {})
    done = stack("up", "--detach", check=False)
    assert done.returncode != 0
    assert DATA_VARIABLE in done.stderr + done.stdout
    assert not stack.containers()


@pytest.mark.docker
def test_env_example_is_a_working_configuration(compose: list[str], tmp_path: Path) -> None:
    """``cp .env.example .env`` gives a file compose accepts, with every region's data under it."""
    done = run(
        [*compose, "--env-file", str(DEPLOY / ".env.example"), "--file", str(COMPOSE_FILE),
         "config"],
        env=clean_env(),
    )  # fmt: skip
    for region in REGIONS:
        assert f"/srv/fencemark/{region}" in done.stdout

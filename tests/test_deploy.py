"""SPEC §7 ``deploy/``: the image and the three-region compose stack, on a real engine.

Tests marked ``docker`` drive the real ``docker`` and ``docker-compose`` CLIs,
through the ``docker_engine`` and ``image`` fixtures (tests/dockerenv.py: skipped
without an engine, failed under CI). Traffic goes only to ports published on
127.0.0.1 and to containers these tests created; everything created is removed.

The compose stack is brought up by docs/deploy.md's own steps, run as written in one
shell (tests/docrun.py) with their outputs compared to the page; between the steps,
the test checks what the page claims: a refused ``up`` leaves nothing behind, every
region converges to the same records, Prometheus scrapes every node and evaluates the
rules, and turning it on and off recreates no region.

``fencemark health``, the image's HEALTHCHECK, is tested against in-process
nodes without Docker.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fencemark.client import AsyncClient, tls_credentials
from tests.compose import (
    COMPOSE_FILE,
    DATA_VARIABLE,
    ETCDS,
    MEMBERS,
    NODES,
    PROMETHEUS_FILE,
    REGIONS,
    clean_env,
    port_variable,
    us_decider,
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
from tests.docrun import (
    DEPLOY_DOCS,
    Hook,
    OperatorSite,
    Shell,
    Substitutions,
    matches,
    run_steps,
    steps_of,
    unmarked_shell_blocks,
)
from tests.ports import free_port
from tests.test_deploy_prometheus import (
    READY_LIMIT_S,
    Prometheus,
    check_rules,
    check_targets,
    check_what_the_nodes_report,
    peers_of,
)

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
    # The API, the metrics and the dashboard of each node, and Prometheus' UI and API.
    assert len(published) == 3 * len(NODES) + 1
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
    """One record homed in each region, written at ``ports``: region -> a node's port."""
    for region, port in ports.items():
        async with AsyncClient(
            f"127.0.0.1:{port}", timeout=5.0, credentials=operator(root)
        ) as client:
            await client.remember(
                "deploy-test", "regions", region, title=f"written in {region}",
                tags=[f"homeRegion:{region}"],
            )  # fmt: skip


# -- docs/deploy.md's compose steps, as written ---------------------------------------

COMPOSE_STEPS = (
    "settings", "refused", "no-directories", "directories", "start", "check", "inside",
    "walkthrough", "list", "failover", "failover-status", "rejoin", "prometheus-on",
    "prometheus-api", "prometheus-reload", "prometheus-off", "upgrade",
    "status-with-a-region-down", "down",
)  # fmt: skip
# The Prometheus UI pages docs/deploy.md names, on its documented port.
PROMETHEUS_PAGE = re.compile(r"http://127\.0\.0\.1:9090/classic/\w+")


def test_every_shell_block_of_deploy_md_runs_or_says_why() -> None:
    """A command shown to an operator is run by a test, or the page says why not."""
    assert not unmarked_shell_blocks(DEPLOY_DOCS[0])
    steps = steps_of(DEPLOY_DOCS)
    assert [s.name for s in steps.values() if s.scenario == "compose"] == [
        *COMPOSE_STEPS[:COMPOSE_STEPS.index("prometheus-on")], "down",
        *COMPOSE_STEPS[COMPOSE_STEPS.index("prometheus-on"):-1],
    ]  # fmt: skip


def test_the_doc_runner_holds_commands_to_what_the_page_shows(tmp_path: Path) -> None:
    """Loose on columns, numbers and node ids; strict on words, lines and exit codes."""
    assert matches("3 of 3 nodes   serving\n...\n", "2 of 3 nodes serving\nmore\n")
    assert matches("node 5f0c2a9e41b7 lag 41.2 s\n", "node 9d630b9f04a4 lag 0.3 s\n")
    assert not matches("peer eu reachable\n", "peer eu UNREACHABLE\n")
    assert not matches("one\ntwo\n", "one\n")
    # Which member of us decides varies; what it says does not.
    assert matches("member us-a: decider us-b (term 12)\n", "member us-c: decider us-a (term 3)\n")
    assert not matches("member us-a: decider us-b\n", "member us-a: decides for region us\n")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "<!-- executed: demo/right -->\n```console\n$ printf 'a   b 12\\nc\\n'\na b 7\n"
        "...\n$ false   # exits 1\n```\n\n<!-- executed: demo/wrong -->\n```sh\nfalse\n```\n"
        "\n<!-- executed: demo/shown -->\n```console\n$ echo x\ny\n```\n"
    )
    steps = steps_of([doc])
    shell = Shell(tmp_path, os.environ, tmp_path / "transcript")
    try:
        run_steps(shell, [steps["demo/right"]], Substitutions())
        with pytest.raises(AssertionError, match="exited 1, not 0"):
            run_steps(shell, [steps["demo/wrong"]], Substitutions())
        with pytest.raises(AssertionError, match="does not show"):
            run_steps(shell, [steps["demo/shown"]], Substitutions())
        run_steps(shell, [steps["demo/shown"]], Substitutions({"x": "y"}))
    finally:
        shell.close()


def region_containers(project: str) -> dict[str, str]:
    """Each node's and each etcd's running container, by the compose project's labels."""
    return {
        name: run(["docker", "ps", "--quiet", "--no-trunc",
                   "--filter", f"label=com.docker.compose.project={project}",
                   "--filter", f"label=com.docker.compose.service={name}"]).stdout.strip()
        for name in (*NODES, *ETCDS)
    }  # fmt: skip


@dataclass
class Failover:
    """What the failover steps of docs/deploy.md are checked against: the decider they
    kill, and a claim held across the kill."""

    decider: str = ""
    term: int = 0
    key: str = "repo/deploy-test/mem/failover/held"
    token: int = 0


async def hold_a_claim(ports: dict[str, int], root: Path, held: Failover) -> None:
    """An item of us claimed at a member that may not decide (the client follows)."""
    async with AsyncClient(f"127.0.0.1:{ports['us-a']}", timeout=5.0,
                           credentials=operator(root)) as client:  # fmt: skip
        await client.remember("deploy-test", "failover", "held", title="held across",
                              tags=["homeRegion:us"])  # fmt: skip
        grant = await client.claim(held.key, "holder", lease_seconds=600)
        assert grant.granted, grant
        held.token = grant.fencing_token


async def claim_survived(ports: dict[str, int], root: Path, held: Failover) -> None:
    """After the decider's kill: the claim is the live one with its token at the new
    decider, the token still writes and renews, a rival is refused."""
    survivor = next(m for m in MEMBERS if m != held.decider)
    async with AsyncClient(f"127.0.0.1:{ports[survivor]}", timeout=5.0,
                           credentials=operator(root)) as client:  # fmt: skip
        status = await client.claim_status(held.key)
        assert status.claim is not None and status.claim.fencing_token == held.token, status
        renewed = await client.renew_claim(held.key, held.token, lease_seconds=600)
        assert renewed.renewed, renewed
        await client.update(held.key, fields={"body": "after the failover"},
                            fencing_token=held.token)  # fmt: skip
        rival = await client.claim(held.key, "rival", lease_seconds=60)
        assert not rival.granted and rival.reason == "contended", rival


@pytest.mark.docker
@pytest.mark.timeout(2 * BUILD_LIMIT_S)
def test_deploy_md_compose_steps_run_as_written(
    compose: list[str], operator_site: OperatorSite
) -> None:
    """docs/deploy.md's three regions on one host, step by step, and what they print;
    between steps, what the page says holds."""
    site = operator_site
    project = f"fmdoc{uuid.uuid4().hex[:10]}"
    site.env["COMPOSE_PROJECT_NAME"] = project  # the stack's name: deploy_ in the page
    site.substitute.text["deploy_"] = f"{project}_"
    site.substitute.text["fencemark:0.2.0"] = site.images["FENCEMARK_IMAGE"]  # the "new" image
    ports = {n: site.ports[port_variable(n)] for n in NODES}
    metrics_ports = {n: site.ports[port_variable(n, "METRICS")] for n in NODES}
    # One node of each region to write at: us's first member (it may not decide).
    writers = {"us": ports["us-a"], "eu": ports["eu"], "ap": ports["ap"]}
    prometheus = Prometheus(f"http://127.0.0.1:{site.ports['FENCEMARK_PROMETHEUS_PORT']}")
    label = f"label=com.docker.compose.project={project}"
    steps = steps_of(DEPLOY_DOCS)
    shell = Shell(site.root, site.env, site.root.parent / "transcript")
    before: dict[str, Hook] = {}
    after: dict[str, Hook] = {}
    regions: dict[str, str] = {}

    def nothing_made() -> None:
        assert not run(["docker", "ps", "--all", "--quiet", "--filter", label]).stdout.strip()
        assert not run(["docker", "network", "ls", "--quiet", "--filter", label]).stdout.strip()

    def converged_everywhere() -> None:
        asyncio.run(write_one_record_per_region(writers, site.data))
        seen: dict[str, dict[str, bytes]] = {}

        def converged() -> bool:
            for node, port in ports.items():
                seen[node] = asyncio.run(record_digests(f"127.0.0.1:{port}", site.data))
            first = seen[NODES[0]]
            return len(first) == 1 + len(REGIONS) and all(s == first for s in seen.values())

        try:
            wait_until("all regions holding the same records", CONVERGE_LIMIT_S, converged)
        except AssertionError as exc:
            shown = {r: {k: d.hex()[:12] for k, d in s.items()} for r, s in seen.items()}
            raise AssertionError(f"{exc}; last seen: {shown}") from None
        for node, port in metrics_ports.items():
            metrics = scrape(f"http://127.0.0.1:{port}/metrics")
            assert metrics["fencemark_records"] == 1 + len(REGIONS), node
            for peer in peers_of(node):
                assert metrics[f'fencemark_replication_reachable{{peer="{peer}"}}'] == 1, node

    def remember_regions() -> None:
        regions.update(region_containers(project))
        assert all(regions.values()), regions

    def regions_unchanged() -> None:
        assert region_containers(project) == regions, "a region's container was recreated"

    def prometheus_works() -> None:
        wait_until("Prometheus answering", READY_LIMIT_S, prometheus.answers)
        check_targets(prometheus)
        check_what_the_nodes_report(prometheus)
        check_rules(prometheus)
        doc = DEPLOY_DOCS[0].read_text()
        for page in sorted(set(PROMETHEUS_PAGE.findall(doc))):
            with urllib.request.urlopen(site.substitute(page), timeout=5) as response:
                assert response.status == 200, page

    def prometheus_gone() -> None:
        regions_unchanged()
        assert not run(["docker", "ps", "--all", "--quiet", "--filter", label, "--filter",
                        "label=com.docker.compose.service=prometheus"]).stdout.strip()  # fmt: skip

    def ap_stopped() -> None:
        code, output = shell.run("docker-compose stop ap")  # what the sample shows
        assert code == 0, output

        async def unreachable_everywhere() -> bool:
            for node in ("us-a", "eu"):
                async with AsyncClient(f"127.0.0.1:{ports[node]}", timeout=5.0,
                                       credentials=operator(site.data)) as client:  # fmt: skip
                    peers = {p.region: p for p in (await client.info()).peers}
                    if peers["ap"].reachable or not peers["ap"].last_error:
                        return False
            return True

        wait_until("us and eu seeing ap unreachable", CONVERGE_LIMIT_S,
                   lambda: asyncio.run(unreachable_everywhere()))  # fmt: skip

    held = Failover()

    def before_the_kill() -> None:
        held.decider, held.term = asyncio.run(us_decider(ports, site.data))
        assert held.decider in MEMBERS, "us's members name no one decider"
        asyncio.run(hold_a_claim(ports, site.data, held))

    def after_the_kill() -> None:
        service = f"label=com.docker.compose.service={held.decider}"
        killed = run(["docker", "ps", "--all", "--quiet", "--filter", label,
                      "--filter", service]).stdout.strip()  # fmt: skip
        state = inspect("container", killed)["State"]
        assert isinstance(state, dict) and state["ExitCode"] == 137, state  # kill -9
        decider, term = asyncio.run(us_decider(ports, site.data))
        assert decider in MEMBERS and decider != held.decider and term > held.term
        asyncio.run(claim_survived(ports, site.data, held))

    def rejoined() -> None:
        def names_the_decider() -> bool:
            decider, _ = asyncio.run(us_decider(ports, site.data))
            return decider not in ("", held.decider)

        wait_until("the killed member back, naming the new decider", CONVERGE_LIMIT_S,
                   names_the_decider)  # fmt: skip

    after.update({"refused": nothing_made, "no-directories": nothing_made,
                  "walkthrough": converged_everywhere, "failover": after_the_kill,
                  "rejoin": rejoined})  # fmt: skip
    before["failover"] = before_the_kill
    before.update({"prometheus-on": remember_regions, "prometheus-api": prometheus_works,
                   "status-with-a-region-down": ap_stopped})  # fmt: skip
    after.update({"prometheus-on": regions_unchanged, "prometheus-off": prometheus_gone,
                  "upgrade": regions_unchanged})  # fmt: skip
    try:
        run_steps(shell, [steps[f"compose/{s}"] for s in COMPOSE_STEPS], site.substitute,
                  before, after)  # fmt: skip
        nothing_made()
    except BaseException:
        print(run(["docker", "ps", "--all", "--filter", label], check=False).stdout)
        print(f"every command's output: {shell.transcript}")
        raise
    finally:
        shell.close()
        left = clean_env(COMPOSE_PROJECT_NAME=project)
        files = [arg for f in (COMPOSE_FILE.name, PROMETHEUS_FILE.name)
                 for arg in ("--file", str(site.root / "deploy" / f))]  # fmt: skip
        run([*compose, *files, "down", "--volumes", "--remove-orphans", "--timeout", "20"],
            env=left, check=False, limit_s=120)  # fmt: skip
        assert not run(["docker", "ps", "--all", "--quiet", "--filter", label]).stdout.strip()
        assert not run(["docker", "volume", "ls", "--quiet", "--filter", label]).stdout.strip()


@pytest.mark.docker
def test_env_example_is_a_working_configuration(compose: list[str], tmp_path: Path) -> None:
    """``cp .env.example .env`` gives a file compose accepts, with every region's data under it."""
    done = run(
        [*compose, "--env-file", str(DEPLOY / ".env.example"), "--file", str(COMPOSE_FILE),
         "config"],
        env=clean_env(),
    )  # fmt: skip
    for name in (*NODES, *ETCDS, "certs"):
        assert f"/srv/fencemark/{name}" in done.stdout

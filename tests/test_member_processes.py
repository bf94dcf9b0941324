"""A region of three members as an operator runs it (SPEC §10): ``fencemark node
--member`` processes over mutual TLS, electing their decider through a real etcd with
authentication on (tests/etcd_server.py), and the faults a machine has: the decider
killed (``SIGKILL``: no goodbye, its lease runs out at etcd), and the decider paused
(``SIGSTOP``) past its lease while another member takes over, then woken.

Pinned here: a claim granted before the failover is its holder's after it (renewed
and released at the new decider); the next grant is above every token granted
before; a paused decider that wakes decides nothing on its old term — it refuses,
and grants no token a newer term has granted.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest

from fencemark.client import AsyncClient, NotDecider, Unavailable, tls_credentials
from fencemark.client.errors import from_rpc_error
from fencemark.node.tools.ports import Ports
from fencemark.node.tools.process import NodeProcess
from fencemark.v1 import claims_pb2, claims_pb2_grpc
from tests import components
from tests.cluster import eventually, paused
from tests.docrun import Shell, Substitutions, run_steps, steps_of
from tests.etcd_server import EtcdServer, restricted
from tests.test_docs import ROOT

SECURITY = ROOT / "docs" / "security.md"
OPERATIONS = ROOT / "docs" / "operations.md"

pytestmark = pytest.mark.slow  # processes, elections and lease times: seconds each

TTL_S = 2
MEMBERS = ("us-a", "us-b", "us-c")
REPO, TOPIC = "lattice", "backlog"


@pytest.fixture
async def region(tmp_path: Path) -> AsyncIterator[tuple[dict[str, NodeProcess], Path]]:
    """us-a, us-b and us-c as processes, and the certificates' directory."""
    async with restricted(tmp_path) as (server, certs):
        nodes: dict[str, NodeProcess] = {}
        try:
            for name in MEMBERS:
                nodes[name] = await start_member(tmp_path, server, certs, name)
            yield nodes, certs
        finally:
            for node in nodes.values():
                with contextlib.suppress(ProcessLookupError):
                    await node.kill()


async def start_member(tmp_path: Path, server: EtcdServer, certs: Path, name: str) -> NodeProcess:
    return await NodeProcess.start(
        tmp_path / name,
        region="us",
        tls_dir=certs,
        extra_args=(
            "--member", name, "--etcd", server.endpoint, "--decider-ttl", str(TTL_S),
            "--initial-members", ",".join(MEMBERS),
        ),
    )  # fmt: skip


def client(node: NodeProcess, certs: Path, *, retries: int = 3, timeout: float = 10) -> AsyncClient:
    credentials = tls_credentials(certs, "alice")
    return AsyncClient(node.address, credentials=credentials, retries=retries, timeout=timeout)


async def decider_of(
    nodes: dict[str, NodeProcess], certs: Path, within: float, *, other_than: str = ""
) -> str:
    """The member every one of ``nodes`` names as decider, other than ``other_than``
    (within ``within`` seconds)."""
    named: set[str] = set()

    async def agreed() -> bool:
        named.clear()
        for node in nodes.values():
            try:
                async with client(node, certs, retries=0, timeout=2) as c:
                    info = await c.info()
            except Unavailable:
                return False
            named.add(info.decider.member if info.decider is not None else "")
        return len(named) == 1 and not named & {"", other_than}

    await eventually(agreed, "every member naming one decider", within=within, every=0.1)
    return named.pop()


async def elected(
    nodes: dict[str, NodeProcess], certs: Path
) -> tuple[str, dict[str, NodeProcess], NodeProcess]:
    """The first decider, the other members, and one of them to send calls to."""
    first = await decider_of(nodes, certs, within=15)
    others = {n: p for n, p in nodes.items() if n != first}
    return first, others, next(iter(others.values()))


async def item(c: AsyncClient) -> str:
    return (await c.remember(REPO, TOPIC, "item-1", tags=["homeRegion:us"])).record.key


async def test_a_decider_killed_mid_claim_leaves_the_claim_with_its_holder(
    region: tuple[dict[str, NodeProcess], Path],
) -> None:
    nodes, certs = region
    first, others, entry = await elected(nodes, certs)
    async with client(entry, certs, timeout=30) as c:
        key = await item(c)
        held = await c.claim(key, "worker-a", lease_seconds=60)  # at the decider, redirected
        assert held.granted
        await nodes[first].kill()  # no goodbye: its key stays until its lease runs out
        second = await decider_of(others, certs, within=4 * TTL_S + 5, other_than=first)
        assert second != first
        renewed = await c.renew_claim(key, held.fencing_token, lease_seconds=60)
        assert renewed.renewed, "a failover is invisible to the holder"
        assert (await c.release_claim(key, held.fencing_token)).released
        again = await c.claim(key, "worker-b", lease_seconds=60)
        assert again.granted and again.fencing_token > held.fencing_token


async def test_a_decider_killed_with_its_disk_lost_catches_up_before_it_counts(
    region: tuple[dict[str, NodeProcess], Path],
) -> None:
    """kill -9 of the decider, and its data directory destroyed: another member
    decides, and the claim stays its holder's. Started again on an empty directory,
    the member owes a catch-up until it holds what the two others hold; then it
    counts — once the second decider is killed too, the third decider, elected
    with it, still holds the claim as renewed at the second."""
    nodes, certs = region
    first, others, entry = await elected(nodes, certs)
    async with client(entry, certs, timeout=30) as c:
        key = await item(c)
        held = await c.claim(key, "worker-a", lease_seconds=60)
        assert held.granted
    lost = nodes[first]
    await lost.kill()
    second = await decider_of(others, certs, within=4 * TTL_S + 5, other_than=first)
    await asyncio.to_thread(shutil.rmtree, lost.data_dir)  # its disk, gone with it
    nodes[first] = back = await NodeProcess.start(
        lost.data_dir, region="us", tls_dir=certs, extra_args=lost.extra_args
    )
    async with client(back, certs, timeout=30) as c:
        renewed = await c.renew_claim(key, held.fencing_token, lease_seconds=60)
        assert renewed.renewed, "a failover is invisible to the holder"

        async def caught_up() -> bool:
            info = await c.info()
            return not info.owes_catch_up and info.decider is not None

        await eventually(caught_up, f"{first} catching up on its empty disk", within=30)
        await nodes[second].kill()
        rest = {n: p for n, p in nodes.items() if n != second}
        await decider_of(rest, certs, within=4 * TTL_S + 5, other_than=second)
        again = await c.renew_claim(key, held.fencing_token, lease_seconds=60)
        assert again.renewed, "the renewal acknowledged before is in the third term's hands"
        refused = await c.claim(key, "worker-b", lease_seconds=60)
        assert not refused.granted


async def test_a_paused_decider_that_wakes_decides_nothing_on_its_old_term(
    region: tuple[dict[str, NodeProcess], Path],
) -> None:
    nodes, certs = region
    first, others, entry = await elected(nodes, certs)
    credentials = tls_credentials(certs, "alice")
    async with (
        client(entry, certs, timeout=30) as c,
        grpc.aio.secure_channel(nodes[first].address, credentials) as to_first,
    ):
        key = await item(c)
        stub = claims_pb2_grpc.ClaimsStub(to_first)
        request = claims_pb2.ClaimRequest(key=key, owner="worker-c", lease_seconds=60)
        with paused(nodes[first]):
            second = await decider_of(others, certs, within=4 * TTL_S + 5, other_than=first)
            newer = await c.claim(key, "worker-b", lease_seconds=60)
            assert newer.granted
            # A claim sent to it while it sleeps: on its socket when it wakes, before
            # it can look at its lease clock.
            waiting = stub.Claim(request, timeout=30)  # sent now: a call starts at once
            await asyncio.sleep(0.5)
        # Awake: it grants nothing, on any term, and refuses as a member that does not
        # decide (or whose lease is in doubt).
        with pytest.raises(grpc.RpcError) as refused:
            await waiting
        said = from_rpc_error(refused.value)
        assert isinstance(said, NotDecider | Unavailable), said
        if isinstance(said, NotDecider):
            assert said.decider == second
        status = await c.claim_status(key)
        assert status.claim is not None
        assert (status.claim.owner, status.claim.fencing_token) == ("worker-b", newer.fencing_token)
        assert await decider_of(nodes, certs, within=4 * TTL_S + 5) == second


def test_operations_md_runs_a_region_of_three_and_changes_its_members_as_written(
    tmp_path: Path,
) -> None:
    """docs/operations.md, *A region of several members*, typed in a shell as written
    after docs/security.md's etcd set-up (on held ports): three members started, the
    status naming the set, a fourth joining as a learner and added once it has caught
    up, one removed and stopped; the region's set in etcd is then us-b, us-c, us-d."""
    components.require("etcd")
    ports = Ports()
    etcd_client, etcd_peer = ports.take(), ports.take()
    members = {f"740{i}": str(ports.take()) for i in range(1, 5)}
    bin_dir = str(Path(sys.executable).parent)  # where `fencemark` is installed
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}"}
    shell = Shell(tmp_path, env, tmp_path / "transcript")
    steps = [
        s for s in steps_of([SECURITY, OPERATIONS]).values() if s.scenario in ("etcd", "members")
    ]
    assert [s.id for s in steps] == [
        "etcd/certificates", "etcd/serve", "etcd/restrict",
        "members/start", "members/status", "members/join", "members/add", "members/remove",
    ]  # fmt: skip
    certs = tmp_path / "certs"
    endpoint = f"127.0.0.1:{etcd_client}"

    def ask(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "fencemark.node", *args],
            capture_output=True, text=True, timeout=30, env=env, cwd=tmp_path,
        )  # fmt: skip
        return done.stdout + done.stderr

    def until(what: str, holds: Callable[[], bool], within: float = 60) -> None:
        deadline = time.monotonic() + within
        while not holds():
            if time.monotonic() > deadline:
                logs = {p.name: p.read_text()[-1500:] for p in tmp_path.glob("*.log")}
                raise AssertionError(f"{what} did not happen within {within} s: {logs}")
            time.sleep(0.2)

    def region_up() -> None:
        def settled() -> bool:
            said = ask("status", "--targets", f"127.0.0.1:{members['7401']}",
                       "--tls-dir", str(certs), "--tls-name", "alice")  # fmt: skip
            return (
                "members of region us: us-a, us-b, us-c" in said
                and said.count(" reachable ") == 2
                and "no decider known" not in said
            )

        until("three members with a decider", settled)

    def caught_up() -> None:
        def registered() -> bool:
            said = ask("status", "--targets", f"127.0.0.1:{members['7404']}",
                       "--tls-dir", str(certs), "--tls-name", "alice")  # fmt: skip
            return said.count(" reachable ") == 3 and "(a learner: not in it)" in said

        until("us-d caught up as a learner", registered)

    try:
        subs = Substitutions({"2379": str(etcd_client), "2380": str(etcd_peer), **members})
        run_steps(
            shell, steps, subs,
            before={"members/status": region_up,
                    "members/add": caught_up},
        )  # fmt: skip
        said = ask("etcd", "members", "--etcd", endpoint, "--tls-dir", str(certs),
                   "--region", "us")  # fmt: skip
        assert "region us: members us-b, us-c, us-d" in said
    finally:
        shell.close()
        ports.close()

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
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from fencemark.client import AsyncClient, NotDecider, Unavailable, tls_credentials
from fencemark.client.errors import from_rpc_error
from fencemark.node.tools.process import NodeProcess
from fencemark.v1 import claims_pb2, claims_pb2_grpc
from tests.cluster import eventually, paused
from tests.etcd_server import EtcdServer, restricted

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


async def test_a_decider_killed_mid_claim_leaves_the_claim_with_its_holder(
    region: tuple[dict[str, NodeProcess], Path],
) -> None:
    nodes, certs = region
    first = await decider_of(nodes, certs, within=15)
    others = {n: p for n, p in nodes.items() if n != first}
    entry = next(iter(others.values()))
    async with client(entry, certs, timeout=10) as c:
        key = (await c.remember(REPO, TOPIC, "item-1", tags=["homeRegion:us"])).record.key
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


async def test_a_paused_decider_that_wakes_decides_nothing_on_its_old_term(
    region: tuple[dict[str, NodeProcess], Path],
) -> None:
    nodes, certs = region
    first = await decider_of(nodes, certs, within=15)
    others = {n: p for n, p in nodes.items() if n != first}
    entry = next(iter(others.values()))
    async with client(entry, certs, timeout=10) as c:
        key = (await c.remember(REPO, TOPIC, "item-1", tags=["homeRegion:us"])).record.key
        with paused(nodes[first]):
            second = await decider_of(others, certs, within=4 * TTL_S + 5, other_than=first)
            newer = await c.claim(key, "worker-b", lease_seconds=60)
            assert newer.granted
        # Awake, with the claim request already on its socket before it can look at
        # its lease clock: it grants nothing, on any term, and refuses as a member
        # that does not decide.
        credentials = tls_credentials(certs, "alice")
        async with grpc.aio.secure_channel(nodes[first].address, credentials) as channel:
            stub = claims_pb2_grpc.ClaimsStub(channel)
            request = claims_pb2.ClaimRequest(key=key, owner="worker-c", lease_seconds=60)
            with pytest.raises(grpc.RpcError) as refused:
                await stub.Claim(request, timeout=10)
        said = from_rpc_error(refused.value)
        assert isinstance(said, NotDecider | Unavailable), said
        if isinstance(said, NotDecider):
            assert said.decider == second
        status = await c.claim_status(key)
        assert status.claim is not None
        assert (status.claim.owner, status.claim.fencing_token) == ("worker-b", newer.fencing_token)
        assert await decider_of(nodes, certs, within=4 * TTL_S + 5) == second
        await asyncio.sleep(0)

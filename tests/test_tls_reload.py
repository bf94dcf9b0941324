"""Certificates renewed and revoked while nodes run (issue 7).

Real certificates (``fencemark certs``), real nodes on loopback, the published
client: a node takes a renewed certificate and CA bundle from its ``--tls-dir``
without a restart (port and outgoing peer channels), and refuses on every call a
certificate that ``fencemark certs revoke`` put on the CRL.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fencemark.client import AsyncClient, PermissionDenied, Unavailable, tls_credentials
from fencemark.node.api.server import NodeServer
from fencemark.node.security.tls import TlsFiles, init_dir
from fencemark.node.tools.cli import main
from fencemark.node.tools.process import NodeProcess
from tests.cluster import Cluster, eventually, wait_converged
from tests.conftest import StartNode
from tests.metrics import refused_once
from tests.ports import free_ports
from tests.test_tls import a_state, error_info, push

FAST = 0.1  # --tls-reload-interval in these tests


def install(source: Path, target: Path, name: str) -> None:
    """Give a node's TLS directory ``source``'s CA and ``name``'s pair, file by file,
    each replaced atomically (as a deployment tool would)."""
    target.mkdir(parents=True, exist_ok=True)
    for file in ("ca.pem", f"{name}.pem", f"{name}-key.pem"):
        staged = target / f".{file}.new"
        shutil.copyfile(source / file, staged)
        os.replace(staged, target / file)


def installed(source: Path, tmp_path: Path, regions: list[str]) -> dict[str, Path]:
    """A TLS directory per region under ``tmp_path``, each given ``source``'s CA and
    that region's pair (``install``)."""
    dirs = {region: tmp_path / f"{region}-tls" for region in regions}
    for region, directory in dirs.items():
        install(source, directory, region)
    return dirs


def client(address: str, certs: Path, name: str) -> AsyncClient:
    return AsyncClient(address, credentials=tls_credentials(certs, name), retries=0, timeout=5)


async def connects(address: str, certs: Path, name: str) -> bool:
    """Whether a new connection with ``name``'s certificate of ``certs`` gets an answer."""
    try:
        async with client(address, certs, name) as c:
            await c.info()
    except Unavailable:
        return False
    return True


async def handshakes(address: str, certs: Path, name: str) -> bool:
    """Whether a new connection with ``name``'s certificate gets a health answer (the
    one call the peer listener answers a client too)."""
    credentials = tls_credentials(certs, name)
    async with grpc.aio.secure_channel(address, credentials) as channel:
        try:
            await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
        except grpc.aio.AioRpcError as refused:
            if refused.code() == grpc.StatusCode.UNAVAILABLE:
                return False
            raise
    return True


def metric(node: NodeServer, name: str) -> float:
    (value,) = [
        s.value for m in node.metrics.registry.collect() for s in m.samples if s.name == name
    ]
    return value


# -- renewal -------------------------------------------------------------------------------------


@pytest.mark.slow
async def test_a_renewed_certificate_and_ca_are_used_without_a_restart(tmp_path: Path) -> None:
    old, new = tmp_path / "old-ca", tmp_path / "new-ca"
    init_dir(old, regions=["us", "eu"], clients=["alice"])
    init_dir(new, regions=["us", "eu"], clients=["alice"])
    dirs = installed(old, tmp_path, ["us", "eu"])
    (peer_port,) = free_ports(1)  # us has a peer listener: both its ports renew
    async with Cluster(tmp_path / "cluster", ["us", "eu"], tls_reload_interval=FAST) as cluster:
        us = await cluster.start(
            "us", tls=TlsFiles.in_dir(dirs["us"], "us"), peer_listen=f"127.0.0.1:{peer_port}"
        )
        eu = await cluster.start(
            "eu", tls=TlsFiles.in_dir(dirs["eu"], "eu"), peers={"us": us.peer_address}
        )
        async with client(us.address, old, "alice") as alice:
            await alice.remember("lattice", "backlog", "renew-1", title="before")
        await wait_converged([us, eu])
        # A client that trusts only the new CA, with a certificate of it: not yet.
        assert not await connects(us.address, new, "alice")

        # us gets a certificate of the new CA, and only the new CA in its bundle.
        install(new, dirs["us"], "us")

        async def new_ca_gets_in() -> bool:
            return await connects(us.address, new, "alice")

        await eventually(new_ca_gets_in, "us serving its renewed certificate")
        assert us.tls is not None and us.tls.reloads >= 1
        assert not await connects(us.address, old, "alice")  # the old CA is out
        assert await handshakes(us.peer_address, new, "alice")  # on the peer listener too
        assert not await handshakes(us.peer_address, old, "alice")

        # eu moves to the new CA too, with a restart (its old connections end). us's
        # calls to eu now get through only if us presents its *new* certificate.
        await cluster.stop("eu")
        install(new, dirs["eu"], "eu")
        eu = await cluster.start(
            "eu", tls=TlsFiles.in_dir(dirs["eu"], "eu"), peers={"us": us.peer_address}
        )

        async def us_reaches_eu() -> bool:
            # us's channel may have tried the old eu with its new certificate and be
            # in reconnect backoff (at most tuning.RECONNECT_BACKOFF_MS).
            try:
                return (await us.replicator.sync_with("eu")).complete
            except grpc.aio.AioRpcError:
                return False

        await eventually(us_reaches_eu, "us calling eu with its renewed certificate")
        async with client(us.address, new, "alice") as alice:
            await alice.remember("lattice", "backlog", "renew-2", title="after")
        await wait_converged([us, eu])
        async with client(eu.address, new, "alice") as alice:
            assert (await alice.get("repo/lattice/mem/backlog/renew-2")).fields["title"] == "after"
            peers = {p.region: p for p in (await alice.info()).peers}
        assert peers["us"].reachable
        assert us.replicator.peer_stats("eu").reachable


async def test_unusable_files_are_ignored_and_the_node_keeps_serving(
    start_node: StartNode, tmp_path: Path
) -> None:
    certs = tmp_path / "certs"
    init_dir(certs, regions=["us"], clients=["alice"])
    node_dir = tmp_path / "us-tls"
    install(certs, node_dir, "us")
    node = await start_node("us", tls=TlsFiles.in_dir(node_dir, "us"), tls_reload_interval=0)
    # A key that is not the certificate's (e.g. caught between two copies).
    shutil.copyfile(certs / "alice-key.pem", node_dir / "us-key.pem")
    assert not node.reload_tls()
    # A certificate of another identity.
    shutil.copyfile(certs / "us-key.pem", node_dir / "us-key.pem")
    shutil.copyfile(certs / "alice.pem", node_dir / "us.pem")
    assert not node.reload_tls()
    # A CRL that no CA of the bundle signed.
    shutil.copyfile(certs / "us.pem", node_dir / "us.pem")
    other = tmp_path / "other-ca"
    init_dir(other, regions=["us"], clients=["alice"])
    assert main(["certs", "revoke", "--dir", str(other), "--client", "alice"]) == 0
    shutil.copyfile(other / "crl.pem", node_dir / "crl.pem")
    assert not node.reload_tls()
    assert await connects(node.address, certs, "alice")
    assert node.tls is not None and node.tls.reloads == 0
    assert metric(node, "fencemark_tls_reload_failures_total") == 3
    assert metric(node, "fencemark_tls_revoked_certificates") == 0
    # A node does not start on such a list.
    with pytest.raises(ValueError, match="not signed by a CA"):
        await start_node("us", tls=TlsFiles.in_dir(node_dir, "us"))


# -- revocation ----------------------------------------------------------------------------------


Pair = tuple[NodeServer, Path, AsyncClient, AsyncClient]


@pytest.fixture
async def pair(start_node: StartNode, tmp_path: Path) -> AsyncIterator[Pair]:
    """A node of region us serving TLS (reloading its files every FAST s), its
    certificates, and the clients alice and bob on it."""
    certs = tmp_path / "certs"
    init_dir(certs, regions=["us"], clients=["alice", "bob"])
    node = await start_node("us", tls=TlsFiles.in_dir(certs, "us"), tls_reload_interval=FAST)
    async with (
        client(node.address, certs, "alice") as alice,
        client(node.address, certs, "bob") as bob,
    ):
        yield node, certs, alice, bob


@pytest.mark.slow
async def test_a_revoked_client_is_refused_on_every_call(
    pair: Pair, capsys: pytest.CaptureFixture[str]
) -> None:
    node, certs, alice, bob = pair
    record = (await alice.remember("lattice", "backlog", "revoke-1", title="t")).record
    assert main(["certs", "revoke", "--dir", str(certs), "--client", "alice"]) == 0
    assert "lists 1 revoked certificates" in capsys.readouterr().out

    async def alice_refused() -> bool:
        try:
            await alice.get(record.key)
        except PermissionDenied as denied:
            return denied.reason == "revoked_certificate"
        return False

    # Refused on the connection alice already has open, within the reload interval.
    await eventually(alice_refused, "alice's revoked certificate refused")
    with pytest.raises(PermissionDenied) as denied:
        await alice.update(record.key, fields={"body": "after revocation"})
    assert denied.value.reason == "revoked_certificate"
    assert denied.value.identity == "client/alice"
    assert (await bob.get(record.key)).fields["title"] == "t"  # others are unaffected
    stored = await node.storage.get(record.key)
    assert stored is not None and "body" not in stored.record.field_values()
    await refused_once(node, "Update", "revoked_certificate")
    assert metric(node, "fencemark_tls_revoked_certificates") == 1
    assert metric(node, "fencemark_tls_reloads_total") == 1
    # Revocation names the certificate: alice's new one works.
    for file in ("alice.pem", "alice-key.pem"):
        (certs / file).rename(certs / f"old-{file}")
    assert main(["certs", "issue", "--dir", str(certs), "--client", "alice"]) == 0
    async with client(node.address, certs, "alice") as alice:
        assert (await alice.get(record.key)).key == record.key
    # Bad input to the command names the flag.
    assert main(["certs", "revoke", "--dir", str(certs), "--serial", "xyz"]) == 2
    assert "--serial" in capsys.readouterr().err


async def test_a_revoked_peers_pushes_are_refused_and_nothing_merges(
    tmp_path: Path, start_node: StartNode
) -> None:
    certs = tmp_path / "certs"
    init_dir(certs, regions=["us", "eu"], clients=["alice"])
    key, state = await a_state(start_node, "from-revoked-eu")
    async with Cluster(tmp_path / "cluster", ["us", "eu"], tls_reload_interval=0) as cluster:
        us = await cluster.start("us", tls=TlsFiles.in_dir(certs, "us"))
        assert main(["certs", "revoke", "--dir", str(certs), "--region", "eu"]) == 0
        assert us.reload_tls()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await push(us, TlsFiles.in_dir(certs, "eu").channel_credentials(), "eu", [state])
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        info = error_info(refused.value)
        assert info.metadata["denial"] == "revoked_certificate"
        assert info.metadata["identity"] == "region/eu"
        assert await us.storage.get(key) is None
        assert us.storage.record_count == 0
        await refused_once(us, "Push", "revoked_certificate")


@pytest.mark.slow
async def test_sighup_reloads_the_revocation_list_of_a_node_process(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    init_dir(certs, regions=["us"], clients=["alice"])
    node = await NodeProcess.start(
        tmp_path / "data", region="us", tls_dir=certs, extra_args=("--tls-reload-interval", "0")
    )
    try:
        async with client(node.address, certs, "alice") as alice:
            assert (await alice.info()).region == "us"
            assert main(["certs", "revoke", "--dir", str(certs), "--client", "alice"]) == 0
            await asyncio.sleep(0.3)
            assert (await alice.info()).region == "us"  # no polling: not yet
            node.proc.send_signal(signal.SIGHUP)

            async def refused() -> bool:
                try:
                    await alice.info()
                except PermissionDenied as denied:
                    return denied.reason == "revoked_certificate"
                return False

            await eventually(refused, "the revocation taken in on SIGHUP")
    finally:
        assert await node.stop() == 0


# -- long-lived calls re-checked at each hand-over (issue 33, finding 4) -------------------------


async def revoked(node: NodeServer, certs: Path, name: str) -> None:
    """``name``'s certificate on the CRL, and the node using that CRL."""
    reloads = metric(node, "fencemark_tls_reloads_total")
    assert main(["certs", "revoke", "--dir", str(certs), "--client", name]) == 0

    async def reloaded() -> bool:
        return metric(node, "fencemark_tls_reloads_total") > reloads

    await eventually(reloaded, "the node took the new CRL")


@pytest.mark.slow
async def test_a_waiter_revoked_while_it_waits_is_refused_and_the_next_in_line_is_served(
    pair: Pair,
) -> None:
    """A ClaimNext waiting when its certificate was revoked was handed an item 9 s
    later, and the rightful next waiter got ``empty``. A grant to a waiter re-checks
    the caller first: alice is refused ``revoked_certificate``, bob gets the item;
    the same for a Claim waiting in a record's line."""
    node, certs, alice, bob = pair
    held = (await bob.remember("lattice", "held", "r1", title="t")).record.key
    first = await bob.claim(held, "bob-1", lease_seconds=60)
    alice_next = asyncio.create_task(
        alice.claim_next("lattice", "backlog", "alice", wait_seconds=30)
    )
    bob_next = asyncio.create_task(bob.claim_next("lattice", "backlog", "bob", wait_seconds=30))
    alice_claim = asyncio.create_task(alice.claim(held, "alice", wait_seconds=30))
    bob_claim = asyncio.create_task(bob.claim(held, "bob-2", wait_seconds=30))

    async def all_waiting() -> bool:
        return node.claims.waiting == 4

    await eventually(all_waiting, "four callers waiting")
    await revoked(node, certs, "alice")
    item = (await bob.remember("lattice", "backlog", "i1", title="i")).record
    assert (await bob.release_claim(held, first.fencing_token)).released
    for refused in (alice_next, alice_claim):
        with pytest.raises(PermissionDenied) as denied:
            await asyncio.wait_for(refused, 20)
        assert denied.value.reason == "revoked_certificate"
    picked = await asyncio.wait_for(bob_next, 20)
    assert picked.granted and picked.record is not None and picked.record.key == item.key
    claimed = await asyncio.wait_for(bob_claim, 20)
    assert claimed.granted and claimed.fencing_token == first.fencing_token + 1


@pytest.mark.slow
async def test_a_watch_ends_at_its_first_event_after_its_certificate_is_revoked(pair: Pair) -> None:
    """An open Records.Watch kept streaming changes after its certificate was revoked:
    each event re-checks the caller, so the stream ends ``revoked_certificate``
    instead of handing the change over."""
    node, certs, alice, bob = pair
    seen: list[str] = []
    opened = asyncio.Event()

    async def follow() -> None:
        async for event in alice.watch("lattice", on_start=lambda _: opened.set()):
            seen.append(event.key)

    watching = asyncio.create_task(follow())
    await asyncio.wait_for(opened.wait(), 10)
    await bob.remember("lattice", "backlog", "before", title="t")
    await eventually(lambda: _has(seen, 1), "the change before the revocation seen")
    await revoked(node, certs, "alice")
    await bob.remember("lattice", "backlog", "after", title="t")
    with pytest.raises(PermissionDenied) as denied:
        await asyncio.wait_for(watching, 10)
    assert denied.value.reason == "revoked_certificate"
    assert seen == ["repo/lattice/mem/backlog/before"]


async def _has(seen: list[str], count: int) -> bool:
    return len(seen) >= count

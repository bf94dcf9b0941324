"""A node does not replicate with a peer whose certificate it refuses (peer_check).

Real certificates (``fencemark certs``), a real CRL (``fencemark certs revoke``),
real nodes on loopback: the calling side learns the certificate a peer's address
presents with a handshake of its own and checks it against its CRL and the
peer's region before any round or push.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from fencemark.client import AsyncClient, tls_credentials
from fencemark.node.api.server import NodeServer
from fencemark.node.replication.peer_check import PeerRefused, presented_certificate
from fencemark.node.security.tls import TlsFiles, init_dir
from fencemark.node.tools.cli import main
from tests.cluster import Cluster, eventually, wait_converged
from tests.metrics import counters, refusals
from tests.test_tls_reload import FAST, install, installed

QUIET = 1.5  # seconds of rounds (every 0.2 s) and pushes in which nothing may cross


def client(address: str, certs: Path) -> AsyncClient:
    return AsyncClient(address, credentials=tls_credentials(certs, "alice"), retries=0, timeout=5)


def peer_refusals(node: NodeServer) -> dict[tuple[str, ...], float]:
    return counters(node, "fencemark_replication_peer_refusals", "peer", "reason")


async def write(node: NodeServer, certs: Path, key_id: str) -> str:
    async with client(node.address, certs) as alice:
        return (await alice.remember("lattice", "backlog", key_id, title=key_id)).record.key


def refused_with(node: NodeServer, peer: str, denial: str) -> bool:
    stats = node.replicator.peer_stats(peer)
    return not stats.reachable and denial in stats.last_error


@pytest.mark.slow
async def test_a_revoked_peer_is_neither_pulled_from_nor_pushed_to_until_reissued(
    tmp_path: Path,
) -> None:
    certs = tmp_path / "certs"
    init_dir(certs, regions=["us", "eu"], clients=["alice"])
    dirs = installed(certs, tmp_path, ["us", "eu"])
    async with Cluster(tmp_path / "cluster", ["us", "eu"], tls_reload_interval=FAST) as cluster:
        us = await cluster.start("us", tls=TlsFiles.in_dir(dirs["us"], "us"))
        eu = await cluster.start("eu", tls=TlsFiles.in_dir(dirs["eu"], "eu"))
        await write(us, certs, "before")
        await wait_converged([us, eu])

        async def us_reaches_eu() -> bool:
            return us.replicator.peer_stats("eu").reachable

        await eventually(us_reaches_eu, "us calling eu")  # eu started after us

        # eu's node certificate is revoked, and only us gets the new CRL.
        assert main(["certs", "revoke", "--dir", str(certs), "--region", "eu"]) == 0
        staged = dirs["us"] / ".crl.pem.new"
        shutil.copyfile(certs / "crl.pem", staged)
        os.replace(staged, dirs["us"] / "crl.pem")

        async def us_refuses_eu() -> bool:
            return refused_with(us, "eu", "revoked_certificate")

        await eventually(us_refuses_eu, "us refusing revoked eu as a peer")
        stats = us.replicator.peer_stats("eu")
        sent, received = stats.bytes_sent, stats.records_received

        # A write at eu: its pushes (and its rounds) are refused by us's interceptor,
        # and us's rounds do not pull it. A write at us is not pushed to eu.
        from_eu = await write(eu, certs, "from-revoked-eu")
        from_us = await write(us, certs, "from-us")
        await asyncio.sleep(QUIET)
        assert await us.storage.get(from_eu) is None
        assert await eu.storage.get(from_us) is None
        assert refusals(us).get(("Push", "revoked_certificate"), 0) >= 1
        # Nothing at all went to eu: every call is refused before it is sent.
        assert (stats.bytes_sent, stats.records_received) == (sent, received)
        assert us.replicator.backlog("eu") == 0
        assert refused_with(us, "eu", "revoked_certificate")
        with pytest.raises(PeerRefused) as refused:
            await us.replicator.sync_with("eu")
        assert refused.value.denial == "revoked_certificate"
        async with client(us.address, certs) as alice:
            peers = {p.region: p for p in (await alice.info()).peers}
        assert not peers["eu"].reachable
        assert "revoked_certificate" in peers["eu"].last_error
        assert "region/eu" in peers["eu"].last_error
        assert peer_refusals(us)[("eu", "revoked_certificate")] >= 1
        assert peer_refusals(eu) == {}

        # eu gets a new certificate (a new serial): us takes it back, no restart.
        for file in ("eu.pem", "eu-key.pem"):
            (certs / file).rename(certs / f"revoked-{file}")
        assert main(["certs", "issue", "--dir", str(certs), "--region", "eu"]) == 0
        install(certs, dirs["eu"], "eu")

        async def eu_has_its_new_certificate() -> bool:
            return eu.tls is not None and eu.tls.pems[1] == (certs / "eu.pem").read_bytes()

        await eventually(eu_has_its_new_certificate, "eu reloading its new certificate")
        await wait_converged([us, eu], within=20)
        assert await us.storage.get(from_eu) is not None
        assert await eu.storage.get(from_us) is not None
        await eventually(us_reaches_eu, "us calling eu again")
        # Pushes resume too: a write at us reaches eu (eu's rounds would as well).
        after = await write(us, certs, "after")

        async def eu_has_it() -> bool:
            return await eu.storage.get(after) is not None

        await eventually(eu_has_it, "us's write reaching eu")
        # An admitted peer is checked again after RECHECK_S, not on every call.
        check = us.replicator.peer_check("eu")
        assert check is not None
        probes = check.probes
        await asyncio.sleep(QUIET)
        assert check.probes == probes


async def test_without_tls_there_is_no_check(tmp_path: Path) -> None:
    async with Cluster(tmp_path / "cluster", ["us", "eu"]) as cluster:
        us, eu = await cluster.start_all()
        assert us.tls is None
        assert us.replicator.peer_check("eu") is None
        async with AsyncClient(us.address) as plain:
            key = (await plain.remember("lattice", "backlog", "plain", title="t")).record.key

        async def eu_has_it() -> bool:
            return await eu.storage.get(key) is not None

        await eventually(eu_has_it, "a plaintext write replicating")


async def test_a_peer_address_presenting_another_regions_certificate_is_refused(
    tmp_path: Path,
) -> None:
    certs = tmp_path / "certs"
    init_dir(certs, regions=["us", "eu", "ap"], clients=["alice"])
    async with Cluster(tmp_path / "cluster", ["us", "eu", "ap"], tls_reload_interval=0) as cluster:
        # us's "eu" peer address is where ap's node serves.
        wrong = {"eu": cluster.addresses["ap"]}
        us = await cluster.start("us", tls=TlsFiles.in_dir(certs, "us"), peers=wrong)

        async def unreachable_while_down() -> bool:
            return refused_with(us, "eu", "no TLS handshake")

        await eventually(unreachable_while_down, "a peer that is down shown as unreachable")
        assert "UNAVAILABLE" in us.replicator.peer_stats("eu").last_error
        ap = await cluster.start("ap", tls=TlsFiles.in_dir(certs, "ap"))

        async def mismatch() -> bool:
            return refused_with(us, "eu", "region_mismatch")

        await eventually(mismatch, "us refusing ap's certificate at eu's address")
        assert "region/ap" in us.replicator.peer_stats("eu").last_error
        key = await write(ap, certs, "from-ap")
        await asyncio.sleep(QUIET)
        assert await us.storage.get(key) is None
        assert us.replicator.peer_stats("eu").bytes_sent == 0
        assert peer_refusals(us)[("eu", "region_mismatch")] >= 1

        # What the probe sees is the certificate the address presents.
        assert us.tls is not None
        der = await asyncio.to_thread(presented_certificate, ap.address, us.tls.pems)
        assert der  # a verified handshake

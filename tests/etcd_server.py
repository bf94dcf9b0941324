"""A real etcd for the tests of a region's members (Debian's ``etcd-server``).

``EtcdServer.start(folder, certs)`` runs one etcd process on held loopback ports
(``fencemark.node.tools.ports``) with its data under ``folder``: with ``certs`` (a
``fencemark certs`` directory), it serves mutual TLS with a certificate of that CA
and takes the client certificate's common name as the etcd user
(``--client-cert-auth``); ``restrict`` then turns etcd's authentication on with one
role per region, as an operator does (``fencemark.node.coordination.access``). The
test needs the component ``etcd`` (tests/components.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, Self

from aetcd import rpc

from fencemark.node.api.config import NodeConfig
from fencemark.node.coordination import access
from fencemark.node.coordination.etcd import Etcd, EtcdError
from fencemark.node.coordination.member import MemberConfig
from fencemark.node.security.tls import TlsFiles, init_dir
from fencemark.node.tools.cli import main
from fencemark.node.tools.ports import Ports
from tests import components
from tests.cluster import eventually, shared_loop

STARTUP_S = 30.0


class EtcdServer:
    def __init__(self, folder: Path, certs: Path | None, *, name: str = "test") -> None:
        self.folder = folder
        self.certs = certs
        self.name = name
        self.ports = Ports()
        self.client_port = self.ports.take()
        self.peer_port = self.ports.take()
        self.initial_cluster = f"{name}={self.peer_url}"  # this one alone, unless a cluster's
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def endpoints(self) -> list[str]:
        return [self.endpoint]

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @classmethod
    async def start(cls, folder: Path, certs: Path | None = None) -> Self:
        server = cls(folder, certs)
        await server.run()
        return server

    async def run(self) -> None:
        """Start (or start again, on the same data and ports) and wait until it answers."""
        binary = shutil.which("etcd")
        assert binary is not None, "the test should have required the etcd component"
        await asyncio.to_thread(self.folder.mkdir, parents=True, exist_ok=True)
        scheme = "https" if self.certs is not None else "http"
        client_url = f"{scheme}://{self.endpoint}"
        peer_url = self.peer_url
        args = [
            binary, f"--name={self.name}", f"--data-dir={self.folder / 'data'}",
            f"--listen-client-urls={client_url}", f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster={self.initial_cluster}", "--log-level=error",
        ]  # fmt: skip
        if self.certs is not None:
            if not (self.certs / "etcd-0.pem").exists():  # as an operator makes it
                made = main(["certs", "etcd", "--dir", str(self.certs), "--server", "etcd-0",
                             "--hosts", "127.0.0.1"])  # fmt: skip
                assert made == 0
            args += [
                f"--cert-file={self.certs / 'etcd-0.pem'}",
                f"--key-file={self.certs / 'etcd-0-key.pem'}",
                f"--trusted-ca-file={self.certs / 'ca.pem'}",
                "--client-cert-auth",
            ]
            if (self.certs / "crl.pem").exists():  # fencemark certs revoke writes it
                args.append(f"--client-crl-file={self.certs / 'crl.pem'}")
        log = (self.folder / "etcd.log").open("ab")
        self.proc = await asyncio.create_subprocess_exec(*args, stdout=log, stderr=log)
        log.close()
        async with asyncio.timeout(STARTUP_S):
            while True:
                if self.proc.returncode is not None:
                    raise RuntimeError(f"etcd exited with {self.proc.returncode}")
                try:
                    _, writer = await asyncio.open_connection("127.0.0.1", self.client_port)
                except OSError:
                    await asyncio.sleep(0.05)
                    continue
                writer.close()
                return

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()

    async def stop(self) -> None:
        await self.kill()
        self.ports.close()


class EtcdCluster:
    """Three etcd processes forming one cluster (``etcd-0`` .. ``etcd-2``), each on
    held loopback ports with its data under ``folder``, over mutual TLS with the
    certificates of ``certs``: for the faults of etcd itself (its leader killed, its
    quorum lost)."""

    def __init__(self, folder: Path, certs: Path, size: int = 3) -> None:
        self.servers = [
            EtcdServer(folder / f"etcd-{i}", certs, name=f"etcd-{i}") for i in range(size)
        ]
        cluster = ",".join(f"{s.name}={s.peer_url}" for s in self.servers)
        for server in self.servers:
            server.initial_cluster = cluster
        self.certs = certs

    @property
    def endpoints(self) -> list[str]:
        return [s.endpoint for s in self.servers]

    async def start(self) -> None:
        """Start every member (each waits for its peers' to form the cluster)."""
        await asyncio.gather(*(s.run() for s in self.servers))

    async def leader(self) -> EtcdServer:
        """The member etcd says leads now, asked as its root."""
        root = Etcd(self.endpoints, TlsFiles.in_dir(self.certs, access.ROOT), timeout_s=1.0)
        try:

            async def status() -> Any:
                return await root.call(rpc.MaintenanceStub, "Status", rpc.StatusRequest())

            leaders: list[int] = []

            async def known() -> bool:
                try:
                    leaders.append(int((await status()).leader))
                except EtcdError:
                    return False
                return leaders[-1] != 0

            await eventually(known, "etcd naming its leader", within=30, every=0.2)
            members = await root.call(rpc.ClusterStub, "MemberList", rpc.MemberListRequest())
            name = next(m.name for m in members.members if leaders[-1] == m.ID)
        finally:
            await root.close()
        return next(s for s in self.servers if s.name == name)

    async def stop(self) -> None:
        for server in self.servers:
            await server.stop()


@contextlib.asynccontextmanager
async def restricted(
    folder: Path, regions: Sequence[str] = ("us", "eu"), clients: Sequence[str] = ("alice",)
) -> AsyncIterator[tuple[EtcdServer, Path]]:
    """An etcd over mutual TLS with authentication on as an operator sets it, one role
    per region of ``regions``, and the ``fencemark certs`` directory of its CA (with
    node certificates of ``regions`` and client ones of ``clients``)."""
    components.require("etcd")
    certs = folder / "certs"
    init_dir(certs, regions=list(regions), clients=list(clients))
    assert main(["certs", "etcd", "--dir", str(certs), "--root"]) == 0
    server = await EtcdServer.start(folder / "etcd", certs)
    try:
        restrict = ["etcd", "restrict", "--etcd", f"https://{server.endpoint}",
                    "--tls-dir", str(certs), "--regions", ",".join(regions)]  # fmt: skip
        assert await asyncio.to_thread(main, restrict) == 0
        yield server, certs
    finally:
        await server.stop()


@contextlib.asynccontextmanager
async def restricted_cluster(
    folder: Path, regions: Sequence[str] = ("us",)
) -> AsyncIterator[tuple[EtcdCluster, Path]]:
    """As ``restricted``, on an ``EtcdCluster`` of three."""
    components.require("etcd")
    certs = folder / "certs"
    init_dir(certs, regions=list(regions), clients=["alice"])
    assert main(["certs", "etcd", "--dir", str(certs), "--root"]) == 0
    cluster = EtcdCluster(folder / "etcd", certs)
    try:
        await cluster.start()
        restrict = ["etcd", "restrict", "--etcd", ",".join(cluster.endpoints),
                    "--tls-dir", str(certs), "--regions", ",".join(regions)]  # fmt: skip
        assert await asyncio.to_thread(main, restrict) == 0
        yield cluster, certs
    finally:
        await cluster.stop()


async def serving(server: EtcdServer, certs: Path) -> None:
    """Until etcd answers a read (a leader elected), as its root."""
    root = Etcd([server.endpoint], TlsFiles.in_dir(certs, access.ROOT), timeout_s=1.0)

    async def answers() -> bool:
        try:
            await root.get(b"/probe")
        except EtcdError:
            return False
        return True

    try:
        await eventually(answers, "etcd answering", within=30, every=0.1)
    finally:
        await root.close()


def member_config(
    folder: Path,
    server: EtcdServer | EtcdCluster,
    certs: Path,
    name: str,
    *,
    region: str = "us",
    etcd_as: str = "",
    ttl_s: int = 2,
    initial: Sequence[str] | None = None,
    etcd_endpoints: Sequence[str] = (),
    **overrides: Any,
) -> NodeConfig:
    """A node of ``region`` that is its member ``name``, on a data file of its own under
    ``folder``, reaching etcd with the certificate of ``etcd_as`` (its region's by
    default); the region's member set is made ``initial`` (by default, this member
    alone) unless etcd has one. ``etcd_endpoints`` (fault proxies in front of
    ``server``'s, say) replace the ones it is reached at."""
    settings: dict[str, Any] = {
        "region": region,
        "listen": "127.0.0.1:0",
        "data_dir": folder / name,
        "enable_writes": True,
        "grace_seconds": 0.2,
        # In-process members share the test's event loop, whose stalls are not naps.
        "replication": shared_loop(),
        "member": MemberConfig(
            name,
            list(etcd_endpoints) or server.endpoints,
            TlsFiles.in_dir(certs, etcd_as or region),
            ttl_s,
            tuple(initial) if initial is not None else (name,),
        ),
        **overrides,
    }
    return NodeConfig(**settings)

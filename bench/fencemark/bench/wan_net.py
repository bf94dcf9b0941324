"""The network of the ``wan`` scenario: three regions on one machine, a round trip
of R between any two, and a region that can be cut off — for each system.

Every link between regions passes through a fault proxy
(``fencemark.node.tools.proxy``) delaying each direction by R/2, so one request
and its answer cost R; a region's own clients reach their own region's server
directly.

- **Fencemark**: a ``LocalCluster`` with its ``ProxyMesh`` (one proxy per ordered
  pair of regions); an agent reaches another region the way its node does
  (``LocalCluster.routes_from``), so a cut cuts both.
- **etcd**: a real three-member cluster, one member per region. A member
  advertises one peer URL that every other member dials, so the proxy in front of
  each member's peer port (:class:`SourceProxy`) tells which member a connection
  comes from — the process that owns its other end (``/proc``) — and a cut refuses
  a region's connections in both directions. Clients talk to their own member.
- **Redis**: one durable primary in the first region; the other regions' clients
  reach it through a proxy each.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fencemark.bench.servers import (
    ETCD_PACKAGE,
    etcd_ready,
    find,
    start_redis,
)
from fencemark.node.tools.cluster import LocalCluster
from fencemark.node.tools.etcd_process import etcd_args
from fencemark.node.tools.ports import Ports
from fencemark.node.tools.process import ServerProcess
from fencemark.node.tools.proxy import FaultProxy

ETCD_HEARTBEAT_MS = 150  # etcd's tuning guide: about the round trip between members
ETCD_ELECTION_MS = 1_500  # ... and ten heartbeats


def socket_owner(local_port: int, remote_port: int, pids: Mapping[int, str]) -> str | None:
    """Which of ``pids`` (pid -> label) owns the IPv4 loopback socket from
    ``local_port`` to ``remote_port``: its inode in ``/proc/net/tcp``, then the
    process holding that inode among its file descriptors. None if none does."""
    inode = ""
    with contextlib.suppress(OSError), open("/proc/net/tcp") as table:
        for line in table.readlines()[1:]:
            fields = line.split()
            local, remote = fields[1], fields[2]
            if int(local.rsplit(":", 1)[1], 16) == local_port and (
                int(remote.rsplit(":", 1)[1], 16) == remote_port
            ):
                inode = fields[9]
                break
    if not inode or inode == "0":
        return None
    target = f"socket:[{inode}]"
    for pid, label in pids.items():
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                        return label
    return None


class SourceProxy(FaultProxy):
    """A fault proxy that knows which process each connection comes from
    (``sources``: pid -> region) and can cut one source region's connections alone."""

    sources: dict[int, str]
    cut_sources: set[str]
    _source_of_task: dict[asyncio.Task[None], str | None]

    def __init__(self, upstream: str, *, name: str = "") -> None:
        super().__init__(upstream, name=name)
        self.sources = {}
        self.cut_sources = set()
        self._source_of_task = {}

    def cut_from(self, region: str) -> None:
        """Refuse ``region``'s connections, and close those it has open."""
        self.cut_sources.add(region)
        for connection in list(self._connections):
            if self._source_of_task.get(connection.task) == region:
                self._connections.discard(connection)
                connection.abort()

    def heal_from(self, region: str) -> None:
        self.cut_sources.discard(region)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        peer = writer.get_extra_info("peername")
        port = int(self.address.rsplit(":", 1)[1])
        source = await asyncio.to_thread(socket_owner, peer[1], port, dict(self.sources))
        if source in self.cut_sources or task is None:
            writer.transport.abort()
            return
        self._source_of_task[task] = source
        try:
            await super()._serve(reader, writer)
        finally:
            self._source_of_task.pop(task, None)


@dataclass
class EtcdCluster:
    """Three members, one per region, their peer traffic through :class:`SourceProxy`."""

    members: dict[str, ServerProcess]
    proxies: dict[str, SourceProxy]
    client_ports: dict[str, int] = field(default_factory=dict)
    ports: Ports | None = None  # held until the cluster stops

    def set_rtt(self, seconds: float) -> None:
        for proxy in self.proxies.values():
            proxy.set_latency(seconds / 2)

    def isolate(self, region: str) -> None:
        self.proxies[region].cut()
        for other, proxy in self.proxies.items():
            if other != region:
                proxy.cut_from(region)

    def heal(self) -> None:
        for proxy in self.proxies.values():
            proxy.heal()
            proxy.cut_sources.clear()

    async def stop(self) -> None:
        await asyncio.gather(*(m.stop() for m in self.members.values()), return_exceptions=True)
        await asyncio.gather(*(p.close() for p in self.proxies.values()), return_exceptions=True)
        if self.ports is not None:
            self.ports.close()


async def start_etcd_cluster(regions: Sequence[str], data_dir: Path) -> EtcdCluster:
    """A three-member etcd cluster (WAL fsynced as shipped), tuned for a wide-area
    round trip as etcd's documentation advises (heartbeat, election timeout)."""
    binary = find("etcd", ETCD_PACKAGE)
    held = Ports()  # etcd's ports, held until the cluster stops (fencemark.node.tools.ports)
    peer_ports = {r: held.take() for r in regions}
    client_ports = {r: held.take() for r in regions}
    proxies = {
        r: await SourceProxy.start(f"127.0.0.1:{peer_ports[r]}", name=f"etcd-peer-{r}")
        for r in regions
    }
    cluster = ",".join(f"{r}=http://{proxies[r].address}" for r in regions)
    members: dict[str, ServerProcess] = {}

    async def member(region: str) -> ServerProcess:
        own = data_dir / f"etcd-{region}"
        await asyncio.to_thread(own.mkdir, parents=True, exist_ok=True)
        args = etcd_args(
            binary, name=region, data_dir=own, client_port=client_ports[region],
            peer_port=peer_ports[region], advertise_peer=proxies[region].address,
            initial_cluster=cluster, token="fencemark-wan",
            extra=(f"--heartbeat-interval={ETCD_HEARTBEAT_MS}",
                   f"--election-timeout={ETCD_ELECTION_MS}"),
        )  # fmt: skip
        return await ServerProcess.spawn(f"etcd-{region}", args, client_ports[region], own)

    started = await asyncio.gather(*(member(r) for r in regions), return_exceptions=True)
    for region, result in zip(regions, started, strict=True):
        if isinstance(result, ServerProcess):
            members[region] = result
    etcd = EtcdCluster(members, proxies, client_ports, held)
    failures = [r for r in started if isinstance(r, BaseException)]
    if failures:
        await etcd.stop()
        raise failures[0]
    pids = {m.pid: region for region, m in members.items()}
    for proxy in proxies.values():
        proxy.sources.update(pids)
    await etcd_ready(client_ports.values())
    return etcd


@dataclass
class RedisPrimary:
    """One durable Redis in ``home``; the other regions reach it through a proxy each."""

    server: ServerProcess
    home: str
    proxies: dict[str, FaultProxy]

    def address(self, region: str) -> tuple[str, int]:
        if region == self.home:
            return "127.0.0.1", self.server.port
        host, port = self.proxies[region].address.rsplit(":", 1)
        return host, int(port)

    def set_rtt(self, seconds: float) -> None:
        for proxy in self.proxies.values():
            proxy.set_latency(seconds / 2)

    def isolate(self, region: str) -> None:
        if region in self.proxies:
            self.proxies[region].cut()

    def heal(self) -> None:
        for proxy in self.proxies.values():
            proxy.heal()

    async def stop(self) -> None:
        await asyncio.gather(*(p.close() for p in self.proxies.values()), return_exceptions=True)
        await self.server.stop()


async def start_redis_primary(regions: Sequence[str], data_dir: Path) -> RedisPrimary:
    server = await start_redis(data_dir / "redis")
    upstream = f"127.0.0.1:{server.port}"
    proxies = {r: await FaultProxy.start(upstream, name=f"redis-from-{r}") for r in regions[1:]}
    return RedisPrimary(server, regions[0], proxies)


async def start_fencemark(regions: Sequence[str], data_dir: Path) -> LocalCluster:
    """One node per region, its replication through a ``ProxyMesh``."""
    return await LocalCluster.start(regions, data_dir / "fencemark", faults=True)


def set_fencemark_rtt(cluster: LocalCluster, seconds: float) -> None:
    assert cluster.mesh is not None
    for src in cluster.mesh.regions:
        for dst in cluster.mesh.regions:
            if src != dst:
                cluster.mesh.slow(src, dst, seconds / 2)

"""The servers of the ``failover`` scenario: each system as it survives the loss of a machine.

All on loopback, on held ports (``fencemark.node.tools.ports``), data in the run's
temporary directory, started from Debian's packages as the other scenarios' are:

- **etcd**: a three-member cluster (``EtcdTrio``), fsyncing its WAL as shipped, with
  etcd's default heartbeat (100 ms) and election timeout (1 s).
- **Redis**: a durable primary (``appendfsync always``), one replica of it (durable
  too, for when it is promoted) and three Sentinels (``redis-server --sentinel``),
  a quorum of two, the primary called down after ``SENTINEL_DOWN_AFTER_MS``
  (``RedisGroup``).
- **Fencemark**: a region of three members (``fencemark node --member``) electing its
  decider through an ``EtcdTrio`` of its own, plaintext (``--insecure``), the
  decider's lease ``--decider-ttl`` seconds (``MemberRegion``).

Each can say who leads now (etcd's leader, Redis's primary, the region's decider)
and kill it with ``SIGKILL``: no goodbye, its lease or its heartbeats just stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fencemark.bench.servers import (
    ETCD_PACKAGE,
    REDIS_PACKAGE,
    STARTUP_TIMEOUT_S,
    durable_redis_args,
    etcd_ready,
    find,
)
from fencemark.node.tools.cluster import named_decider
from fencemark.node.tools.etcd_process import etcd_args
from fencemark.node.tools.ports import Ports
from fencemark.node.tools.process import NodeProcess, ServerProcess

SENTINEL_SERVICE = "bench"
SENTINEL_DOWN_AFTER_MS = 2_000  # as long as the decider's lease, for a like comparison
SENTINEL_FAILOVER_TIMEOUT_MS = 10_000
ELECTED_WITHIN_S = 30.0  # for a first leader, primary or decider to be known


async def _killed(server: ServerProcess) -> float:
    """SIGKILL ``server``; the moment it was sent (``time.monotonic``)."""
    at = time.monotonic()
    if server.proc.returncode is None:
        server.proc.kill()
        await server.proc.wait()
    return at


# -- etcd -------------------------------------------------------------------------------


@dataclass
class EtcdTrio:
    """Three etcd members (``etcd-0`` .. ``etcd-2``) forming one cluster."""

    members: list[ServerProcess]
    ports: Ports

    @property
    def endpoints(self) -> list[str]:
        return [f"127.0.0.1:{m.port}" for m in self.members]

    def alive(self) -> list[int]:
        return [i for i, m in enumerate(self.members) if m.proc.returncode is None]

    async def leader(self) -> int:
        """The index of the member etcd's own status names as leader (waiting for one)."""
        import aetcd
        from aetcd import rpc

        async with asyncio.timeout(ELECTED_WITHIN_S):
            while True:
                for index in self.alive():
                    client = aetcd.Client(host="127.0.0.1", port=self.members[index].port,
                                          timeout=2)  # fmt: skip
                    try:
                        await client.connect()
                        status = await client.maintenancestub.Status(rpc.StatusRequest(), timeout=2)
                        if status.leader and status.header.member_id == status.leader:
                            return index
                    except Exception:  # a member that does not answer yet: the next one
                        pass
                    finally:
                        with contextlib.suppress(Exception):
                            await client.close()
                await asyncio.sleep(0.1)

    async def kill(self, index: int) -> float:
        return await _killed(self.members[index])

    async def stop(self) -> None:
        await asyncio.gather(*(m.stop() for m in self.members), return_exceptions=True)
        self.ports.close()


async def start_etcd_trio(data_dir: Path, name: str = "etcd") -> EtcdTrio:
    """Three members on loopback; returns once a write through each of them commits."""
    binary = find("etcd", ETCD_PACKAGE)
    ports = Ports()
    peers = [ports.take() for _ in range(3)]
    clients = [ports.take() for _ in range(3)]
    cluster = ",".join(f"{name}-{i}=http://127.0.0.1:{p}" for i, p in enumerate(peers))

    async def member(index: int) -> ServerProcess:
        own = data_dir / f"{name}-{index}"
        await asyncio.to_thread(own.mkdir, parents=True, exist_ok=True)
        args = etcd_args(binary, name=f"{name}-{index}", data_dir=own, client_port=clients[index],
                         peer_port=peers[index], initial_cluster=cluster,
                         token=f"fencemark-{name}")  # fmt: skip
        return await ServerProcess.spawn(f"{name}-{index}", args, clients[index], own)

    started = await asyncio.gather(*(member(i) for i in range(3)), return_exceptions=True)
    members = [s for s in started if isinstance(s, ServerProcess)]
    trio = EtcdTrio(members, ports)
    failed = [s for s in started if isinstance(s, BaseException)]
    try:
        if failed:
            raise failed[0]
        await etcd_ready(m.port for m in trio.members)
    except BaseException:
        await trio.stop()
        raise
    return trio


# -- Redis --------------------------------------------------------------------------------


@dataclass
class RedisGroup:
    """A durable primary, one replica and three Sentinels watching them."""

    primary: ServerProcess
    replica: ServerProcess
    sentinels: list[ServerProcess]
    ports: Ports

    @property
    def sentinel_addresses(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", s.port) for s in self.sentinels]

    async def kill_primary(self) -> float:
        return await _killed(self.primary)

    async def stop(self) -> None:
        servers = [*self.sentinels, self.replica, self.primary]
        await asyncio.gather(*(s.stop() for s in servers), return_exceptions=True)
        self.ports.close()


async def start_redis_group(data_dir: Path) -> RedisGroup:
    """Primary, replica and Sentinels; returns once every Sentinel sees the replica and
    the two other Sentinels (until then a failover could not be agreed)."""
    binary = find("redis-server", REDIS_PACKAGE)
    ports = Ports()
    primary_port, replica_port = ports.take(), ports.take()
    sentinel_ports = [ports.take() for _ in range(3)]
    dirs = {n: data_dir / n for n in ("primary", "replica", "s0", "s1", "s2")}
    for folder in dirs.values():
        await asyncio.to_thread(folder.mkdir, parents=True, exist_ok=True)
    started: list[ServerProcess] = []
    try:
        primary = await ServerProcess.spawn(
            "redis-primary", durable_redis_args(binary, primary_port, dirs["primary"]),
            primary_port, dirs["primary"],
        )  # fmt: skip
        started.append(primary)
        replica_args = durable_redis_args(binary, replica_port, dirs["replica"])
        replica_args += ["--replicaof", "127.0.0.1", str(primary_port)]
        replica = await ServerProcess.spawn(
            "redis-replica", replica_args, replica_port, dirs["replica"]
        )
        started.append(replica)
        sentinels = []
        for index, port in enumerate(sentinel_ports):
            folder = dirs[f"s{index}"]
            conf = folder / "sentinel.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndaemonize no\ndir {folder}\nloglevel warning\n"
                f"sentinel monitor {SENTINEL_SERVICE} 127.0.0.1 {primary_port} 2\n"
                f"sentinel down-after-milliseconds {SENTINEL_SERVICE} {SENTINEL_DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {SENTINEL_SERVICE} {SENTINEL_FAILOVER_TIMEOUT_MS}\n"
                f"sentinel parallel-syncs {SENTINEL_SERVICE} 1\n"
            )
            sentinel = await ServerProcess.spawn(
                f"redis-sentinel-{index}", [binary, str(conf), "--sentinel"], port, folder
            )
            started.append(sentinel)
            sentinels.append(sentinel)
        group = RedisGroup(primary, replica, sentinels, ports)
        await _sentinels_ready(group)
    except BaseException:
        await asyncio.gather(*(s.stop() for s in started), return_exceptions=True)
        ports.close()
        raise
    return group


async def _sentinels_ready(group: RedisGroup) -> None:
    from redis.asyncio import Redis

    async def ready(port: int) -> bool:
        client = Redis(host="127.0.0.1", port=port, socket_timeout=2, decode_responses=True)
        try:
            state: Any = await client.sentinel_master(SENTINEL_SERVICE)
            replicas = int(state.get("num-slaves", 0))
            others = int(state.get("num-other-sentinels", 0))
            return replicas >= 1 and others >= 2
        except Exception:
            return False
        finally:
            await client.aclose()

    async with asyncio.timeout(STARTUP_TIMEOUT_S):
        for sentinel in group.sentinels:
            while True:
                if await ready(sentinel.port):
                    break
                await asyncio.sleep(0.2)


# -- Fencemark ------------------------------------------------------------------------------


@dataclass
class MemberRegion:
    """A region of three members and the etcd cluster they elect their decider through."""

    region: str
    members: dict[str, NodeProcess]
    etcd: EtcdTrio

    def alive(self) -> dict[str, NodeProcess]:
        return {n: p for n, p in self.members.items() if p.proc.returncode is None}

    async def decider(self, *, other_than: str = "", within: float = ELECTED_WITHIN_S) -> str:
        """The member every live member names as decider (other than ``other_than``)."""
        return await named_decider(self.members.values(), other_than=other_than, within=within)

    async def kill(self, name: str) -> float:
        at = time.monotonic()
        await self.members[name].kill()
        return at

    async def stop(self) -> None:
        await asyncio.gather(*(m.stop() for m in self.members.values()), return_exceptions=True)
        await self.etcd.stop()


async def start_member_region(
    data_dir: Path, names: tuple[str, ...], ttl_s: int, region: str
) -> MemberRegion:
    """``names`` as member processes of ``region`` (plaintext), electing through an
    ``EtcdTrio`` of their own; returns once they agree on a decider."""
    etcd = await start_etcd_trio(data_dir / "etcd", name="region-etcd")
    extra = ("--etcd", ",".join(etcd.endpoints), "--decider-ttl", str(ttl_s),
             "--initial-members", ",".join(names))  # fmt: skip

    async def member(name: str) -> NodeProcess:
        return await NodeProcess.start(
            data_dir / name, region=region, extra_args=("--member", name, *extra)
        )

    started = await asyncio.gather(*(member(n) for n in names), return_exceptions=True)
    members = {n: s for n, s in zip(names, started, strict=True) if isinstance(s, NodeProcess)}
    region_ = MemberRegion(region, members, etcd)
    failed = [s for s in started if isinstance(s, BaseException)]
    try:
        if failed:
            raise failed[0]
        await region_.decider()
    except BaseException:
        await region_.stop()
        raise
    return region_

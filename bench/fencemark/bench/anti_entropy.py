"""Scenario 4: what anti-entropy costs, in sync and after a partition.

- **In-sync rounds**: two in-process nodes holding the same N records (1k, 10k,
  100k), each the other's peer through a ``FaultProxy`` that counts the bytes on
  the wire (HTTP/2 framing included). Rounds are run one at a time
  (``Replicator.sync_with``); each must find the replicas in sync.
- **Repair after a partition**: three node processes (``us``, ``eu``, ``ap``)
  whose node-to-node traffic goes through the fault-proxy mesh, with the same
  base records. ``ap`` is cut off, K records are updated at ``us`` through the
  API (``eu`` gets them by eager push), the mesh heals, and the clock runs until
  every region's digest-tree root is the same: byte-identical replicas. The
  mesh counts every byte the repair moved (pushes, rounds, fetches), shown
  against the canonical bytes of the K differing states.
- **Naive reference**: one full-state transfer — every state of a replica
  fetched through a counting proxy — measured beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc

from fencemark.bench import anti_entropy_report as report
from fencemark.bench.anti_entropy_report import Repair
from fencemark.bench.drivers import region_clients
from fencemark.bench.progress import Progress
from fencemark.bench.records import BODY
from fencemark.bench.results import (
    ScenarioResult,
    Settings,
)
from fencemark.bench.seed import copy_replica, seed, seed_key
from fencemark.bench.stats import median
from fencemark.client import AsyncClient
from fencemark.node.api.server import NodeConfig, NodeServer
from fencemark.node.replication.tuning import Tuning
from fencemark.node.store.digest_tree import CHECK_BYTES
from fencemark.node.tools.cluster import LocalCluster
from fencemark.node.tools.ports import Ports
from fencemark.node.tools.proxy import FaultProxy, ProxyMesh
from fencemark.v1 import replication_pb2, replication_pb2_grpc

REGIONS = ("us", "eu", "ap")
CONVERGE_TIMEOUT_S = 180.0
WRITERS = 64
FETCH_BATCH = 512
ORIGIN = replication_pb2.Origin(region="bench", node_id="bench")  # not a peer: not counted


class Seeds:
    """Seeded data dirs by record count, made once per run and copied per use."""

    def __init__(self, root: Path, home: str = "us") -> None:
        self.root = root
        self.home = home
        self._made: dict[int, Path] = {}

    async def get(self, count: int, progress: Progress) -> Path:
        if count not in self._made:
            progress.status(f"seeding {count:,} records")
            began = time.monotonic()
            self._made[count] = await seed(self.root / f"seed-{count}", count, home=self.home)
            progress.line(f"seeded {count:,} records in {time.monotonic() - began:.1f} s")
        return self._made[count]


def _wire_bytes(*proxies: FaultProxy) -> int:
    return sum(p.stats.bytes_to_upstream + p.stats.bytes_to_client for p in proxies)


# -- in-sync rounds ---------------------------------------------------------------------


async def in_sync_round_bytes(
    seeds: Seeds, count: int, rounds: int, work: Path, progress: Progress
) -> dict[str, Any]:
    source = await seeds.get(count, progress)
    dirs = {r: await copy_replica(source, work / f"insync-{count}" / r) for r in ("us", "eu")}
    held = Ports()  # the nodes' ports, held until they listen (fencemark.node.tools.ports)
    ports = {r: held.take() for r in dirs}
    to_eu = await FaultProxy.start(f"127.0.0.1:{ports['eu']}", name="us->eu")
    to_us = await FaultProxy.start(f"127.0.0.1:{ports['us']}", name="eu->us")
    nodes: list[NodeServer] = []
    try:
        for region, peer, proxy in (("us", "eu", to_eu), ("eu", "us", to_us)):
            config = NodeConfig(
                region=region,
                listen=f"127.0.0.1:{ports[region]}",
                data_dir=dirs[region],
                enable_writes=True,
                peers={peer: proxy.address},
                anti_entropy_interval=3600.0,  # only the rounds run here ...
                replication=Tuning(heartbeat_s=3600.0),  # ... and no heartbeat
                grace_seconds=0.5,
            )
            nodes.append(await NodeServer.start(config))
        us = nodes[0]
        stats = us.replicator.peer_stats("eu")

        # The first round opens the connection (and may find eu still starting):
        # not a steady round, not counted.
        async def connected() -> bool:
            try:
                await us.replicator.sync_with("eu")
            except grpc.aio.AioRpcError:
                return False
            return True

        await until("us reaches eu", connected, 30, 0.2)
        wire, messages, in_sync = [], [], []
        for _ in range(rounds):
            before_wire = _wire_bytes(to_eu)
            before_messages = stats.bytes_sent + stats.bytes_received
            result = await us.replicator.sync_with("eu")
            wire.append(_wire_bytes(to_eu) - before_wire)
            messages.append(stats.bytes_sent + stats.bytes_received - before_messages)
            in_sync.append(result.in_sync)
        return {
            "records": count,
            "wire_bytes": median(wire),
            "message_bytes": median(messages),
            "all_in_sync": all(in_sync),
            "rounds": rounds,
        }
    finally:
        for node in nodes:
            await node.stop(0.5)
        await to_eu.close()
        await to_us.close()
        held.close()


# -- repair after a partition -----------------------------------------------------------


@contextlib.asynccontextmanager
async def _replication_stub(
    address: str,
) -> AsyncIterator[replication_pb2_grpc.ReplicationAsyncStub]:
    channel = grpc.aio.insecure_channel(
        address, options=[("grpc.max_receive_message_length", 64 << 20)]
    )
    try:
        yield replication_pb2_grpc.ReplicationStub(channel)
    finally:
        await channel.close(None)


COMPARE_SALT = b"fencemark-bench"  # the timeline compares two nodes' check values


async def _tree(
    stub: replication_pb2_grpc.ReplicationAsyncStub, level: int, parents: list[int]
) -> list[bytes]:
    """The root's hash (level 0), or the check values of the nodes at ``level``
    below ``parents``, with one salt for every call (comparable across nodes)."""
    request = replication_pb2.TreeRequest(origin=ORIGIN, level=level, parents=parents)
    if level:
        request.salt = COMPARE_SALT
    response = await stub.Tree(request, timeout=10)
    width = CHECK_BYTES if level else len(response.hashes)
    return [response.hashes[i : i + width] for i in range(0, len(response.hashes), width)]


async def _fetch_sizes(stub: replication_pb2_grpc.ReplicationAsyncStub, keys: Sequence[str]) -> int:
    """Canonical bytes of the states of ``keys``, as the node holds them."""
    total = 0
    for start in range(0, len(keys), FETCH_BATCH):
        pending = list(keys[start : start + FETCH_BATCH])
        while pending:
            request = replication_pb2.FetchRequest(origin=ORIGIN, keys=pending)
            response = await stub.Fetch(request, timeout=30)
            total += sum(len(state) for state in response.states)
            pending = list(response.truncated)
    return total


async def _write_divergence(address: str, keys: Sequence[str], tag: str) -> None:
    """Update every key once through the API, ``WRITERS`` clients at a time."""
    queue = list(keys)

    async def writer() -> None:
        async with AsyncClient(address, retries=0) as client:
            while queue:
                key = queue.pop()
                await client.update(key, fields={"body": f"{BODY} ({tag})"})

    await asyncio.gather(*(writer() for _ in range(WRITERS)))


async def _same_roots(stubs: Sequence[replication_pb2_grpc.ReplicationAsyncStub]) -> bool:
    roots = [(await _tree(stub, 0, []))[0] for stub in stubs]
    return len(set(roots)) == 1


async def until(what: str, check: Any, limit_s: float, poll: float = 0.05) -> float:
    """Seconds until ``await check()`` is true, polling every ``poll`` s (at most ``limit_s``)."""
    began = time.monotonic()
    while not await check():
        if time.monotonic() - began > limit_s:
            raise TimeoutError(f"{what}: not reached within {limit_s:.0f} s")
        await asyncio.sleep(poll)
    return time.monotonic() - began


async def repair_after_partition(
    seeds: Seeds, base: int, k: int, work: Path, progress: Progress
) -> Repair:
    source = await seeds.get(base, progress)
    root = work / f"repair-{k}"
    for region in REGIONS:
        await copy_replica(source, root / region)
    cluster = await LocalCluster.start(REGIONS, root, faults=True)
    mesh = cluster.mesh
    assert mesh is not None
    try:
        async with contextlib.AsyncExitStack() as stack:
            stubs = {
                r: await stack.enter_async_context(_replication_stub(a))
                for r, a in cluster.addresses.items()
            }
            keys = [seed_key(i) for i in range(k)]
            # A partition of a running cluster: every node past its start-up round with
            # each peer first (a node still starting pulls every differing state,
            # older or not, and the repair would measure the restart too).
            clients = await stack.enter_async_context(region_clients(cluster.addresses))

            async def all_deciding() -> bool:
                return all([(await c.info()).claims_serving for c in clients.values()])

            await until("every node deciding", all_deciding, 60, 0.1)
            mesh.isolate("ap")
            progress.status(f"K={k:,}: ap cut off, writing {k:,} updates at us")
            await _write_divergence(cluster.addresses["us"], keys, f"k{k}")
            await until("us and eu in sync", lambda: _same_roots([stubs["us"], stubs["eu"]]), 120)
            canonical = await _fetch_sizes(stubs["us"], keys)
            links = _mesh_links(mesh)
            before = {name: _wire_bytes(link) for name, link in links.items()}
            mesh.heal()
            healed = time.monotonic()
            progress.status(f"K={k:,}: healed, waiting for byte-identical replicas")
            timeline: list[tuple[float, int]] = []
            level1 = list(range(16))  # the parents of level 2's 256 nodes

            async def identical() -> bool:
                ours = await _tree(stubs["us"], 2, level1)
                theirs = await _tree(stubs["ap"], 2, level1)
                differing = sum(a != b for a, b in zip(ours, theirs, strict=True))
                timeline.append((time.monotonic() - healed, differing))
                return differing == 0 and await _same_roots(list(stubs.values()))

            seconds = await until("byte-identical replicas", identical, CONVERGE_TIMEOUT_S, 0.1)
            moved = {name: _wire_bytes(link) - before[name] for name, link in links.items()}
        return Repair(k, canonical, sum(moved.values()), seconds, timeline, moved)
    finally:
        await cluster.stop()


def _mesh_links(mesh: ProxyMesh) -> dict[str, FaultProxy]:
    return {
        f"{src}->{dst}": mesh.link(src, dst) for src in REGIONS for dst in REGIONS if src != dst
    }


async def naive_full_state(
    seeds: Seeds, base: int, work: Path, progress: Progress
) -> dict[str, Any]:
    """Every state of one replica fetched through a counting proxy: bytes and seconds."""
    source = await seeds.get(base, progress)
    data = await copy_replica(source, work / "naive" / "us")
    node = await NodeServer.start(
        NodeConfig(region="us", listen="127.0.0.1:0", data_dir=data, grace_seconds=0.5)
    )
    proxy = await FaultProxy.start(node.address, name="naive")
    try:
        keys = [seed_key(i) for i in range(base)]
        began = time.monotonic()
        async with _replication_stub(proxy.address) as stub:
            state_bytes = await _fetch_sizes(stub, keys)
        seconds = time.monotonic() - began
        return {
            "records": base,
            "state_bytes": state_bytes,
            "wire_bytes": _wire_bytes(proxy),
            "seconds": seconds,
        }
    finally:
        await proxy.close()
        await node.stop(0.5)


# -- the scenario -------------------------------------------------------------------------


async def run_anti_entropy(
    settings: Settings, progress: Progress, work: Path, out: Path, seeds: Seeds
) -> ScenarioResult:
    in_sync = await _in_sync_rounds(settings, progress, work, seeds)
    naive = await naive_full_state(seeds, settings.divergence_base, work, progress)
    repairs = await _repairs(settings, progress, work, seeds)
    return ScenarioResult(
        "anti-entropy",
        "Anti-entropy cost in sync and after a partition",
        {
            "in_sync": in_sync,
            "repair": [r.to_json() for r in repairs],
            "naive_full_state": naive,
            "divergence_base": settings.divergence_base,
        },
        report.tables(settings, in_sync, repairs, naive),
        report.targets(in_sync, repairs),
        report.plots(settings, out, in_sync, repairs, naive),
    )


async def _in_sync_rounds(
    settings: Settings, progress: Progress, work: Path, seeds: Seeds
) -> list[dict[str, Any]]:
    in_sync = []
    for count in settings.in_sync_records:
        progress.status(f"in-sync rounds at {count:,} records")
        row = await in_sync_round_bytes(seeds, count, settings.in_sync_rounds, work, progress)
        progress.line(
            f"in-sync round at {count:,} records: {row['wire_bytes']:.0f} bytes on the wire"
        )
        in_sync.append(row)
    return in_sync


async def _repairs(
    settings: Settings, progress: Progress, work: Path, seeds: Seeds
) -> list[Repair]:
    repairs = []
    for k in settings.divergence:
        repair = await repair_after_partition(seeds, settings.divergence_base, k, work, progress)
        progress.line(
            f"K={k:,}: {repair.repair_bytes:,} bytes repaired vs {repair.canonical_bytes:,}"
            f" canonical, byte-identical {repair.seconds:.2f} s after the heal"
        )
        repairs.append(repair)
    return repairs

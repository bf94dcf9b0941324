"""Multi-region clusters on loopback for the replication tests.

Every node's port is picked before any node starts, so each one is wired to its
peers (``--peer REGION=127.0.0.1:PORT``) from the start and keeps its address
across restarts. Two flavours of the same shape:

- ``Cluster``: in-process ``NodeServer`` nodes (fast; tests may look inside);
- ``ProcessCluster``: ``fencemark node`` child processes (``NodeProcess``), for
  what only a real process shows: SIGKILL, SIGTERM.

Both are async context managers that stop every node they started, whatever
the test did. Nothing here mocks a Fencemark component.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import signal
import sqlite3
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from fencemark.node.api.server import NodeConfig, NodeServer
from fencemark.node.replication.tuning import Tuning
from fencemark.node.tools.process import NodeProcess
from tests.ports import free_ports

LOOPBACK = "127.0.0.1"
FAST_ANTI_ENTROPY = 0.2  # seconds between rounds (jittered): converge quickly in tests
SHARED_LOOP_NAP_S = 3.0  # in-process nodes: the test's loop stalls are not naps (Cluster)


def shared_loop(tuning: Tuning | None = None, nap_s: float = SHARED_LOOP_NAP_S) -> Tuning:
    """``tuning`` for an in-process node, whose event loop is the test's: the test's own
    stalls, or a busy machine running tests side by side, are not naps (``Cluster``)."""
    return dataclasses.replace(tuning or Tuning(), nap_s=nap_s)


async def eventually(
    check: Callable[[], Awaitable[bool]],
    what: str,
    *,
    within: float = 15.0,
    every: float = 0.05,
    explain: Callable[[], Awaitable[str]] | None = None,
) -> None:
    """Poll ``check`` until it holds; fail with ``what`` (and ``explain()``) after ``within`` s."""
    deadline = time.monotonic() + within
    while True:
        if await check():
            return
        if time.monotonic() > deadline:
            detail = f": {await explain()}" if explain is not None else ""
            raise AssertionError(f"{what} did not happen within {within:.0f} s{detail}")
        await asyncio.sleep(every)


async def all_deciding(*nodes: NodeServer, within: float = 15.0) -> None:
    """Wait until every one of ``nodes`` decides claims: a new cluster's nodes first
    catch up with every peer (docs/replication.md, catch-up)."""

    async def deciding() -> bool:
        return all(node.replica.deciding for node in nodes)

    await eventually(deciding, "every node deciding claims", within=within)


async def synced_since(node: NodeServer, peer: str, since: float) -> bool:
    """``node`` completed an anti-entropy round with ``peer`` after ``since``
    (wall-clock seconds, as ``PeerStats.last_sync``)."""
    stats = node.replicator.peer_stats(peer)
    return stats.last_sync is not None and stats.last_sync > since and stats.reachable


def backup(node: NodeServer, target: Path) -> None:
    """``sqlite3 fencemark.sqlite3 ".backup TARGET"`` on the running node's file: a
    consistent copy of a live data file, node id and all."""
    copy_file(node.config.db_path, target)


def copy_file(source_path: Path, target: Path) -> None:
    """``sqlite3 SOURCE ".backup TARGET"``: a consistent copy of a data file that a
    live process (in this one or another) is writing."""
    source = sqlite3.connect(source_path)
    dest = sqlite3.connect(target)
    try:
        source.backup(dest)
    finally:
        dest.close()
        source.close()


@contextlib.contextmanager
def paused(*nodes: NodeProcess) -> Iterator[None]:
    """``SIGSTOP`` the nodes (a paused process: connections open, nothing answers)."""
    for node in nodes:
        os.kill(node.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for node in nodes:
            os.kill(node.proc.pid, signal.SIGCONT)


class _Topology:
    """Regions, their fixed addresses and data directories."""

    def __init__(self, base: Path, regions: Sequence[str]) -> None:
        if len(set(regions)) != len(regions):
            raise ValueError(f"regions must be distinct: {regions}")
        self.regions = list(regions)
        ports = free_ports(len(regions))
        self.addresses = {r: f"{LOOPBACK}:{port}" for r, port in zip(regions, ports, strict=True)}
        self.data_dirs = {r: base / r for r in regions}

    def peers_of(self, region: str) -> dict[str, str]:
        return {r: a for r, a in self.addresses.items() if r != region}

    def wipe(self, region: str) -> None:
        """Lose ``region``'s disk: delete its data directory (the node must be stopped)."""
        shutil.rmtree(self.data_dirs[region], ignore_errors=True)


class Cluster(_Topology):
    """In-process nodes, one per region: ``async with Cluster(tmp_path, ["us", "eu"]) as c``.

    ``overrides`` are ``NodeConfig`` fields applied to every node (e.g.
    ``anti_entropy_interval``); ``start`` takes per-start overrides on top.

    The nodes share one event loop with each other and with the test: a node's
    start (TLS files, a data file opened) or the test's own blocking work stands
    the loop still for every node, which each would take for a nap — a paused
    process — and settle again before deciding (``grant_gate``). So the cluster's
    nodes allow ``nap_s`` (``SHARED_LOOP_NAP_S``) whatever ``replication`` tuning
    a test gives; the tests of naps pass the default.
    """

    def __init__(
        self,
        base: Path,
        regions: Sequence[str],
        *,
        nap_s: float = SHARED_LOOP_NAP_S,
        **overrides: Any,
    ) -> None:
        super().__init__(base, regions)
        self.nap_s = nap_s
        self.overrides: dict[str, Any] = {
            "anti_entropy_interval": FAST_ANTI_ENTROPY,
            **overrides,
        }
        self.nodes: dict[str, NodeServer] = {}
        self._started: list[NodeServer] = []

    def __getitem__(self, region: str) -> NodeServer:
        return self.nodes[region]

    def running(self) -> list[NodeServer]:
        return [node for node in self.nodes.values() if not node.stopped]

    def config(self, region: str, **overrides: Any) -> NodeConfig:
        settings: dict[str, Any] = {
            "region": region,
            "listen": self.addresses[region],
            "data_dir": self.data_dirs[region],
            "enable_writes": True,
            "grace_seconds": 0.2,
            "peers": self.peers_of(region),
            **self.overrides,
            **overrides,
        }
        settings["replication"] = shared_loop(settings.get("replication"), self.nap_s)
        return NodeConfig(**settings)

    async def start(self, region: str, **overrides: Any) -> NodeServer:
        """Start (or restart, on the same data directory and address) ``region``'s node."""
        current = self.nodes.get(region)
        if current is not None and not current.stopped:
            raise RuntimeError(f"region {region} is already running")
        node = await NodeServer.start(self.config(region, **overrides))
        self.nodes[region] = node
        self._started.append(node)
        return node

    async def start_isolated(self, region: str, **overrides: Any) -> NodeServer:
        """Start ``region``'s node on its data but cut off: a fresh port and no peers.

        Its peers cannot reach it (its usual address is closed) and it reaches no
        one: a network partition, without touching the network.
        """
        overrides = {"listen": f"{LOOPBACK}:0", "peers": {}, **overrides}
        return await self.start(region, **overrides)

    async def start_all(self, regions: Iterable[str] | None = None) -> list[NodeServer]:
        """Start nodes together (their first anti-entropy rounds find each other up)."""
        return list(await asyncio.gather(*(self.start(r) for r in regions or self.regions)))

    async def stop(self, region: str) -> None:
        await self.nodes[region].stop(0)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        for node in reversed(self._started):
            if not node.stopped:
                await node.stop(0)


class ProcessCluster(_Topology):
    """``fencemark node`` child processes, one per region, peers wired with ``--peer``."""

    def __init__(
        self,
        base: Path,
        regions: Sequence[str],
        *,
        anti_entropy_interval: float = FAST_ANTI_ENTROPY,
    ) -> None:
        super().__init__(base, regions)
        self.anti_entropy_interval = anti_entropy_interval
        self.nodes: dict[str, NodeProcess] = {}
        self._started: list[NodeProcess] = []

    def __getitem__(self, region: str) -> NodeProcess:
        return self.nodes[region]

    def args_of(self, region: str) -> tuple[str, ...]:
        peers = [arg for r, a in self.peers_of(region).items() for arg in ("--peer", f"{r}={a}")]
        return (*peers, "--anti-entropy-interval", str(self.anti_entropy_interval))

    async def start(self, region: str) -> NodeProcess:
        """Start (or restart, on the same data directory and address) ``region``'s node."""
        current = self.nodes.get(region)
        if current is not None and current.proc.returncode is None:
            raise RuntimeError(f"region {region} is already running")
        process = await NodeProcess.start(
            self.data_dirs[region],
            region=region,
            listen=self.addresses[region],
            extra_args=self.args_of(region),
        )
        self._started.append(process)
        self.nodes[region] = process
        if process.address != self.addresses[region]:
            raise AssertionError(f"{region} listens on {process.address}, not its own address")
        return process

    async def start_all(self) -> list[NodeProcess]:
        return list(await asyncio.gather(*(self.start(r) for r in self.regions)))

    async def kill(self, region: str) -> int:
        """SIGKILL: the crash a durable node must survive."""
        return await self.nodes[region].kill()

    async def stop(self, region: str) -> int:
        """SIGTERM: a graceful shutdown."""
        return await self.nodes[region].stop()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        for process in reversed(self._started):
            if process.proc.returncode is None:
                await process.kill()


# -- convergence of in-process nodes ------------------------------------------------------


async def digests_of(node: NodeServer) -> dict[str, bytes]:
    """``key -> digest`` of every record the node holds, tombstones included."""
    # Every key starts with "repo/", and "0" is the character after "/".
    stored = await node.storage.scan("repo/", "repo0", limit=10_000_000, include_deleted=True)
    return {s.record.key: s.digest for s in stored}


async def stop_within(node: NodeServer, within: float = 30.0) -> None:
    """``node.stop(0)``, failing after ``within`` s with every pending task's stack: a
    stop that never ends says where it waits."""
    try:
        async with asyncio.timeout(within):
            await node.stop(0)
    except TimeoutError:
        stacks = []
        for task in asyncio.all_tasks():
            frames = task.get_stack(limit=8)
            where = " <- ".join(f"{f.f_code.co_name}:{f.f_lineno}" for f in reversed(frames))
            stacks.append(f"{task.get_name()}: {where}")
        raise AssertionError(
            f"node {node.config.region} did not stop within {within:g} s; its tasks:\n"
            + "\n".join(sorted(stacks))
        ) from None


def name_of(node: NodeServer) -> str:
    """``REGION`` or ``REGION/MEMBER``: a node as a failure names it."""
    member = node.config.member
    return f"{node.config.region}/{member.name}" if member is not None else node.config.region


async def wait_converged(nodes: Sequence[NodeServer], *, within: float = 15.0) -> None:
    """Wait until every node has the same digest tree, then prove the states byte-identical."""

    async def same_roots() -> bool:
        return len({node.storage.tree.root for node in nodes}) == 1

    async def roots() -> str:
        said = ", ".join(
            f"{name_of(n)}: {n.storage.tree.root.hex()[:8]} ({n.storage.record_count} records)"
            for n in nodes
        )
        # Which keys each node lacks or holds otherwise than the node with the most.
        held = {name_of(n): await digests_of(n) for n in nodes}
        fullest = max(held.values(), key=len)
        for name, digests in held.items():
            apart = sorted(k for k, d in fullest.items() if digests.get(k) != d)
            if apart:
                said += f"; {name} apart on {len(apart)}: {', '.join(apart[:3])}"
        return said

    await eventually(same_roots, "convergence of the digest trees", within=within, explain=roots)
    await assert_identical(nodes)


async def assert_identical(nodes: Sequence[NodeServer]) -> None:
    """Same keys, same digest per key, same canonical bytes per key, same root, everywhere."""
    first, *others = nodes
    expected = await digests_of(first)
    keys = sorted(expected)
    states = await first.storage.states(keys)
    assert len(states) == len(keys) == first.storage.record_count
    for node in others:
        region = node.config.region
        digests = await digests_of(node)
        differing = sorted(
            k for k in set(digests) | set(expected) if digests.get(k) != expected.get(k)
        )
        assert not differing, f"{region} differs from {first.config.region} on {differing[:5]}"
        assert await node.storage.states(keys) == states, f"{region}: states differ in bytes"
        assert node.storage.tree.root == first.storage.tree.root
        assert node.storage.record_count == first.storage.record_count

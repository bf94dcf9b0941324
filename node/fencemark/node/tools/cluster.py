"""A local multi-region cluster: one node process per region, on loopback.

Node-to-node traffic can go through a ``ProxyMesh`` (``faults=True``) so that a
region can be cut off or a link slowed (the kernel here has no ``tc netem``).
Used by ``fencemark cluster``, ``fencemark demo`` and the cluster tests.

One region may run as a group of members instead (``members=3``: ``us-a``,
``us-b``, ``us-c``) electing their decider through an etcd process of their own
(``etcd_process.start_etcd``): the other regions' nodes are given every member's address
(``--peer us=A,B,C``), each through its own link of the mesh, so cutting a region
off cuts it from every member. Its clients talk to a member that did not decide
when the cluster started (``nodes[region]``): killing the decider leaves them a
member to ask, which redirects them to the next decider.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Sequence
from pathlib import Path

from fencemark.client import AsyncClient, FencemarkError
from fencemark.node.tools.etcd_process import start_etcd
from fencemark.node.tools.ports import Ports
from fencemark.node.tools.process import NodeProcess, ServerProcess
from fencemark.node.tools.proxy import ProxyMesh

DECIDER_TTL_S = 2
ELECTED_WITHIN_S = 60.0


async def named_decider(
    members: Iterable[NodeProcess], *, other_than: str = "", within: float = ELECTED_WITHIN_S
) -> str:
    """The member every live one of ``members`` names as its region's decider, once they
    agree on one (other than ``other_than``); bounded by ``within`` seconds."""
    async with asyncio.timeout(within):
        while True:
            named: set[str] = set()
            for member in members:
                if member.proc.returncode is not None:
                    continue
                try:
                    async with AsyncClient(member.address, retries=0, timeout=2) as client:
                        info = await client.info()
                except FencemarkError:
                    named.add("")
                    continue
                named.add(info.decider.member if info.decider is not None else "")
            if len(named) == 1 and not named & {"", other_than}:
                return named.pop()
            await asyncio.sleep(0.1)


class LocalCluster:
    def __init__(
        self,
        nodes: dict[str, NodeProcess],
        mesh: ProxyMesh | None,
        peers: dict[str, dict[str, str]],
        ports: Ports | None = None,
        *,
        members: dict[str, dict[str, NodeProcess]] | None = None,
        etcd: ServerProcess | None = None,
    ) -> None:
        self.nodes = nodes  # region -> the node its clients talk to
        self.mesh = mesh
        self.peers = peers  # node (a region, or a member's name) -> the peer addresses it was given
        self.members = members or {}  # a region of several: member name -> its process
        self.etcd = etcd
        self._ports = ports  # the nodes' ports, held while the cluster may restart them

    @property
    def addresses(self) -> dict[str, str]:
        """Where each region's clients reach it."""
        return {region: node.address for region, node in self.nodes.items()}

    def name_of(self, region: str) -> str:
        """The mesh name of the node ``region``'s clients talk to."""
        for name, member in self.members.get(region, {}).items():
            if member is self.nodes[region]:
                return name
        return region

    def routes_from(self, region: str) -> dict[str, str]:
        """How a client in ``region`` reaches every region: its own node directly,
        the others the way its node does (through the mesh, so a cut cuts both)."""
        mesh, src = self.mesh, self.name_of(region)
        return {
            other: node.address
            if other == region or mesh is None
            else mesh.peer_address(src, self.name_of(other))
            for other, node in self.nodes.items()
        }

    async def decider(self, region: str, *, other_than: str = "") -> str:
        """The member every live member of ``region`` names as its decider (``named_decider``)."""
        return await named_decider(self.members[region].values(), other_than=other_than)

    @classmethod
    async def start(
        cls,
        regions: Sequence[str],
        data_root: Path,
        *,
        base_port: int = 0,
        faults: bool = False,
        anti_entropy_interval: float = 1.0,
        enable_writes: bool = True,
        node_args: Sequence[str] = (),
        members: int = 1,
    ) -> LocalCluster:
        """``members`` > 1: the first region runs as that many members (module
        docstring), with an etcd process of its own; needs held ports (no
        ``base_port``) and ``etcd`` on this machine (``EtcdMissing`` if not)."""
        if members > 1 and base_port:
            raise ValueError("a region of several members needs held ports: no --base-port")
        # Every node is told its peers' addresses before any listens: without a
        # --base-port, the ports are held from the moment they are picked until the
        # cluster stops (fencemark.node.tools.ports), so nothing else takes one in
        # between, nor while a node restarts.
        held = Ports() if not base_port else None
        grouped = {region: [region] for region in regions}
        if members > 1:
            first = regions[0]
            grouped[first] = [f"{first}-{chr(ord('a') + i)}" for i in range(members)]
        names = [name for group in grouped.values() for name in group]
        ports = {
            name: base_port + index if held is None else held.take()
            for index, name in enumerate(names)
        }
        direct = {name: f"127.0.0.1:{port}" for name, port in ports.items()}
        etcd: ServerProcess | None = None
        mesh: ProxyMesh | None = None
        try:
            if members > 1:
                assert held is not None
                etcd = await start_etcd(data_root / "etcd", ports=held)
            mesh = await ProxyMesh.start(direct) if faults else None
        except BaseException:
            if etcd is not None:
                await etcd.stop()
            if held is not None:
                held.close()
            raise
        region_of = {name: region for region, group in grouped.items() for name in group}
        peers = {
            name: {
                other: ",".join(mesh.peer_address(name, n) if mesh else direct[n] for n in group)
                for other, group in grouped.items()
                if other != region_of[name]
            }
            for name in names
        }

        def args_of(name: str) -> tuple[str, ...]:
            if len(grouped[region_of[name]]) == 1:
                return ()
            assert etcd is not None
            return ("--member", name, "--etcd", f"127.0.0.1:{etcd.port}",
                    "--decider-ttl", str(DECIDER_TTL_S),
                    "--initial-members", ",".join(grouped[region_of[name]]))  # fmt: skip

        started = await asyncio.gather(
            *(
                NodeProcess.start(
                    data_root / name,
                    region=region_of[name],
                    listen=direct[name],
                    enable_writes=enable_writes,
                    extra_args=(
                        *(f"--peer={r}={a}" for r, a in peers[name].items()),
                        f"--anti-entropy-interval={anti_entropy_interval}",
                        *args_of(name),
                        *node_args,
                    ),
                )
                for name in names
            ),
            return_exceptions=True,
        )
        failures = [result for result in started if isinstance(result, BaseException)]
        processes = {
            name: result
            for name, result in zip(names, started, strict=True)
            if isinstance(result, NodeProcess)
        }
        # Every process started is the cluster's, so that ``stop`` ends them all.
        groups = {
            region: {name: processes[name] for name in group if name in processes}
            for region, group in grouped.items()
            if len(group) > 1
        }
        nodes = {region: processes[group[0]] for region, group in grouped.items()
                 if group[0] in processes}  # fmt: skip
        cluster = cls(nodes, mesh, peers, held, members=groups, etcd=etcd)
        try:
            if failures:
                raise failures[0]
            for region, group in groups.items():
                # Clients talk to a member that does not decide now: a decider killed
                # leaves them a member that redirects them to the next one.
                decider = await cluster.decider(region)
                cluster.nodes[region] = next(p for n, p in group.items() if n != decider)
        except BaseException:
            await cluster.stop()
            raise
        return cluster

    async def restart(self, region: str) -> NodeProcess:
        """Start ``region``'s node again on its data directory, address and peers."""
        old = self.nodes[region]
        node = await NodeProcess.start(
            old.data_dir,
            region=region,
            listen=old.address,
            extra_args=old.extra_args,
        )
        self.nodes[region] = node
        return node

    async def restart_member(self, region: str, name: str) -> NodeProcess:
        """Start member ``name`` of ``region`` again on its data, address and flags."""
        old = self.members[region][name]
        member = await NodeProcess.start(
            old.data_dir, region=region, listen=old.address, extra_args=old.extra_args
        )
        self.members[region][name] = member
        if self.nodes[region] is old:
            self.nodes[region] = member
        return member

    async def stop(self) -> None:
        running = {id(node): node for node in self.nodes.values()}
        for group in self.members.values():
            running.update({id(member): member for member in group.values()})
        await asyncio.gather(*(node.stop() for node in running.values()))
        if self.etcd is not None:
            await self.etcd.stop()
        if self.mesh is not None:
            with contextlib.suppress(Exception):
                await self.mesh.close()
        if self._ports is not None:
            self._ports.close()

"""A local multi-region cluster: one node process per region, on loopback.

Node-to-node traffic can go through a ``ProxyMesh`` (``faults=True``) so that a
region can be cut off or a link slowed (the kernel here has no ``tc netem``).
Used by ``fencemark cluster``, ``fencemark demo`` and the cluster tests.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from pathlib import Path

from fencemark.node.tools.ports import Ports
from fencemark.node.tools.process import NodeProcess
from fencemark.node.tools.proxy import ProxyMesh


class LocalCluster:
    def __init__(
        self,
        nodes: dict[str, NodeProcess],
        mesh: ProxyMesh | None,
        peers: dict[str, dict[str, str]],
        ports: Ports | None = None,
    ) -> None:
        self.nodes = nodes
        self.mesh = mesh
        self.peers = peers  # region -> the peer addresses its node was given
        self._ports = ports  # the nodes' ports, held while the cluster may restart them

    @property
    def addresses(self) -> dict[str, str]:
        """Where each region's node serves its clients."""
        return {region: node.address for region, node in self.nodes.items()}

    def routes_from(self, region: str) -> dict[str, str]:
        """How a client in ``region`` reaches every region: its own node directly,
        the others the way its node does (through the mesh, so a cut cuts both)."""
        return {region: self.nodes[region].address, **self.peers[region]}

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
    ) -> LocalCluster:
        # Every node is told its peers' addresses before any listens: without a
        # --base-port, the ports are held from the moment they are picked until the
        # cluster stops (fencemark.node.tools.ports), so nothing else takes one in
        # between, nor while a node restarts.
        held = Ports() if not base_port else None
        ports = {
            region: base_port + index if held is None else held.take()
            for index, region in enumerate(regions)
        }
        direct = {region: f"127.0.0.1:{port}" for region, port in ports.items()}
        try:
            mesh = await ProxyMesh.start(direct) if faults else None
        except BaseException:
            if held is not None:
                held.close()
            raise
        peers = {
            region: mesh.peers(region)
            if mesh is not None
            else {other: direct[other] for other in regions if other != region}
            for region in regions
        }
        started = await asyncio.gather(
            *(
                NodeProcess.start(
                    data_root / region,
                    region=region,
                    listen=direct[region],
                    enable_writes=enable_writes,
                    extra_args=(
                        *(f"--peer={r}={a}" for r, a in peers[region].items()),
                        f"--anti-entropy-interval={anti_entropy_interval}",
                        *node_args,
                    ),
                )
                for region in regions
            ),
            return_exceptions=True,
        )
        failures = [result for result in started if isinstance(result, BaseException)]
        nodes = {
            region: result
            for region, result in zip(regions, started, strict=True)
            if isinstance(result, NodeProcess)
        }
        if failures:
            await asyncio.gather(*(node.stop() for node in nodes.values()))
            if mesh is not None:
                await mesh.close()
            if held is not None:
                held.close()
            raise failures[0]
        return cls(nodes, mesh, peers, held)

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

    async def stop(self) -> None:
        await asyncio.gather(*(node.stop() for node in self.nodes.values()))
        if self.mesh is not None:
            with contextlib.suppress(Exception):
                await self.mesh.close()
        if self._ports is not None:
            self._ports.close()

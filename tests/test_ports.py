"""Ports picked before their servers start, held with no window (``fencemark.node.tools.ports``).

Regression for a first ``make test`` that failed with ``node exited with 2 before
serving``: ``LocalCluster`` (``fencemark cluster``, ``fencemark demo``) picked each
node's port by binding port 0 and closing it again, and while four test workers
opened connections, one of them took the port before the node bound it; the error
did not say why the node had exited.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from pathlib import Path

import pytest

from fencemark.client import AsyncClient
from fencemark.node.api.server import NodeConfig, NodeServer
from fencemark.node.tools.cluster import LocalCluster
from fencemark.node.tools.ports import Ports
from fencemark.node.tools.process import NodeProcess, NodeStartError
from tests.cluster import eventually

LOOPBACK = "127.0.0.1"
HELD = 64
TRIES = 2000  # binds of port 0, and outgoing connections, that must miss every held port
REGIONS = ("us", "eu", "ap")
ROOT = Path(__file__).resolve().parents[1]
# Under port churn: clusters started at once, times in a row (docs/testing.md records
# a larger run: CHURN_CLUSTERS=6 CHURN_ROUNDS=10).
CHURN_CLUSTERS = int(os.environ.get("CHURN_CLUSTERS", "3"))
CHURN_ROUNDS = int(os.environ.get("CHURN_ROUNDS", "2"))
CHURN_HELD = 4000  # of the 28,232 ephemeral ports: a port picked and let go is taken ~1 in 7


def test_a_held_port_is_never_handed_out_by_the_kernel() -> None:
    with Ports() as ports:
        held = {ports.take() for _ in range(HELD)}
        assert len(held) == HELD
        for port in held:
            with socket.socket() as plain, pytest.raises(OSError):
                plain.bind((LOOPBACK, port))
        picked = set()
        for _ in range(TRIES):
            with socket.socket() as any_port:
                any_port.bind((LOOPBACK, 0))
                picked.add(any_port.getsockname()[1])
        assert not picked & held
        with socket.create_server((LOOPBACK, 0)) as listener:
            target = listener.getsockname()
            connected = set()
            for _ in range(TRIES):
                with socket.create_connection(target) as out:
                    connected.add(out.getsockname()[1])
                    accepted, _ = listener.accept()
                    accepted.close()
        assert not connected & held


async def test_a_node_listens_on_a_held_port_and_a_second_node_there_is_refused(
    tmp_path: Path,
) -> None:
    with Ports() as ports:
        address = ports.address()
        first = await NodeServer.start(
            NodeConfig(listen=address, data_dir=tmp_path / "first", grace_seconds=0.2)
        )
        try:
            assert first.address == address
            async with AsyncClient(address) as client:
                assert (await client.info()).region == "local"
            with pytest.raises(OSError, match="cannot listen"):
                await NodeServer.start(
                    NodeConfig(listen=address, data_dir=tmp_path / "second", grace_seconds=0.2)
                )
        finally:
            await first.stop()
        again = await NodeServer.start(  # a restart on the same address, still held
            NodeConfig(listen=address, data_dir=tmp_path / "first", grace_seconds=0.2)
        )
        await again.stop()


@pytest.mark.slow
async def test_a_node_that_exits_before_serving_raises_with_its_last_lines(
    tmp_path: Path,
) -> None:
    with socket.create_server((LOOPBACK, 0)) as taken:
        address = f"{LOOPBACK}:{taken.getsockname()[1]}"
        with pytest.raises(NodeStartError) as refused:
            await NodeProcess.start(tmp_path / "node", listen=address)
    message = str(refused.value)
    assert "exited with 2 before serving" in message
    assert f"cannot listen on {address}" in message  # the node's own reason
    assert any(address in line for line in refused.value.output)


@pytest.mark.slow
async def test_three_region_clusters_start_at_once_under_port_churn(tmp_path: Path) -> None:
    churn = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.churn", "--hold", str(CHURN_HELD), "--seconds", "600",
        stdout=asyncio.subprocess.PIPE, cwd=ROOT,
    )  # fmt: skip
    assert churn.stdout is not None
    try:
        async with asyncio.timeout(60):
            assert (await churn.stdout.readline()).strip() == b"churning"
        for round_ in range(CHURN_ROUNDS):
            started = await asyncio.gather(
                *(
                    LocalCluster.start(REGIONS, tmp_path / f"r{round_}-c{n}")
                    for n in range(CHURN_CLUSTERS)
                ),
                return_exceptions=True,
            )
            clusters = [c for c in started if isinstance(c, LocalCluster)]
            try:
                failed = [repr(c) for c in started if not isinstance(c, LocalCluster)]
                assert not failed, f"round {round_}: {len(failed)} starts failed: {failed}"
                await asyncio.gather(*(_every_region_deciding(c) for c in clusters))
            finally:
                await asyncio.gather(*(c.stop() for c in clusters))
        assert churn.returncode is None, "the churn ended before the clusters were done"
    finally:
        if churn.returncode is None:
            churn.kill()
        await churn.wait()


async def _every_region_deciding(cluster: LocalCluster) -> None:
    """Each node reached both peers at the addresses it was given before they listened
    (a node decides claims once it has had a round with every peer)."""
    for address in cluster.addresses.values():
        async with AsyncClient(address) as client:

            async def deciding(client: AsyncClient = client) -> bool:
                return (await client.info()).claims_serving

            await eventually(deciding, f"{address} deciding claims", within=60)

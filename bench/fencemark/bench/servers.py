"""The baselines' servers, started for one run: etcd and a durable Redis, from Debian packages.

Each listens on loopback on a port held for it from the moment it is picked
(``fencemark.node.tools.ports``), keeps its data in a temporary directory and is
stopped (SIGTERM, then SIGKILL) when the run ends. A missing binary is a
``MissingServer`` naming the package to install.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import Iterable
from pathlib import Path

from fencemark.node.tools import etcd_process
from fencemark.node.tools.ports import Ports
from fencemark.node.tools.process import ServerProcess

STARTUP_TIMEOUT_S = 30.0
ETCD_PACKAGE, REDIS_PACKAGE = "etcd-server", "redis-server"


class MissingServer(RuntimeError):
    def __init__(self, binary: str, package: str) -> None:
        super().__init__(f"{binary} not found: install it with 'apt-get install -y {package}'")
        self.binary = binary


def find(binary: str, package: str) -> str:
    path = shutil.which(binary)
    if path is None:
        raise MissingServer(binary, package)
    return path


def missing_servers() -> list[str]:
    """The Debian packages whose servers the benchmarks need and this machine lacks."""
    needed = {"etcd": ETCD_PACKAGE, "redis-server": REDIS_PACKAGE}
    return [package for binary, package in needed.items() if shutil.which(binary) is None]


async def start_etcd(data_dir: Path) -> ServerProcess:
    """A single-member etcd, fsyncing its WAL as shipped (no unsafe flags)."""
    find("etcd", ETCD_PACKAGE)
    return await etcd_process.start_etcd(data_dir, name="bench")


async def start_redis(data_dir: Path) -> ServerProcess:
    """Redis made durable: append-only file, fsync before every reply."""
    binary = find("redis-server", REDIS_PACKAGE)
    ports = Ports()
    port = ports.take()
    await asyncio.to_thread(data_dir.mkdir, parents=True, exist_ok=True)
    args = durable_redis_args(binary, port, data_dir)
    return await ServerProcess.spawn("redis", args, port, data_dir, ports)


def durable_redis_args(binary: str, port: int, data_dir: Path) -> list[str]:
    """A Redis server on loopback made durable: append-only file, fsync before every
    reply, no snapshots."""
    return [
        binary,
        "--bind", "127.0.0.1",
        "--port", str(port),
        "--dir", str(data_dir),
        "--appendonly", "yes",
        "--appendfsync", "always",
        "--save", "",
        "--daemonize", "no",
        "--protected-mode", "yes",
        "--loglevel", "warning",
    ]  # fmt: skip


async def etcd_ready(ports: Iterable[int]) -> None:
    """Until a write through every etcd member on ``ports`` commits (the cluster has
    elected a leader); bounded by ``STARTUP_TIMEOUT_S``."""
    import aetcd

    async with asyncio.timeout(STARTUP_TIMEOUT_S):
        for port in ports:
            client = aetcd.Client(host="127.0.0.1", port=port, timeout=5)
            try:
                while True:
                    try:
                        await client.put(b"/ready", b"1")
                        break
                    except Exception:
                        await asyncio.sleep(0.1)
            finally:
                with contextlib.suppress(Exception):
                    await client.close()

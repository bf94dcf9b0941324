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
import signal
from collections.abc import Iterable
from pathlib import Path

from fencemark.node.tools.ports import Ports

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


class ServerProcess:
    """A child server process whose output goes to a log file in its data directory."""

    def __init__(
        self,
        name: str,
        proc: asyncio.subprocess.Process,
        port: int,
        log: Path,
        ports: Ports | None = None,
    ) -> None:
        self.name = name
        self.proc = proc
        self.port = port
        self.log = log
        self._ports = ports  # its ports, held until it stops

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    async def spawn(
        cls, name: str, args: list[str], port: int, data_dir: Path, ports: Ports | None = None
    ) -> ServerProcess:
        """Start ``args``, serving on ``port``; ``ports`` (closed when it stops) hold its
        ports until then."""
        log = data_dir / f"{name}.log"
        try:
            with log.open("wb") as out:
                proc = await asyncio.create_subprocess_exec(
                    *args, stdout=out, stderr=asyncio.subprocess.STDOUT, cwd=data_dir
                )
        except BaseException:
            if ports is not None:
                ports.close()
            raise
        server = cls(name, proc, port, log, ports)
        try:
            await server._wait_listening()
        except BaseException:
            await server.stop()
            raise
        return server

    async def _wait_listening(self) -> None:
        async with asyncio.timeout(STARTUP_TIMEOUT_S):
            while True:
                if self.proc.returncode is not None:
                    tail = self.log.read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{tail}")
                try:
                    _, writer = await asyncio.open_connection("127.0.0.1", self.port)
                except OSError:
                    await asyncio.sleep(0.05)
                    continue
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
                return

    async def stop(self, grace: float = 10.0) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(grace):
                    await self.proc.wait()
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        if self._ports is not None:
            self._ports.close()


async def start_etcd(data_dir: Path) -> ServerProcess:
    """A single-member etcd, fsyncing its WAL as shipped (no unsafe flags)."""
    binary = find("etcd", ETCD_PACKAGE)
    ports = Ports()
    client_port, peer_port = ports.take(), ports.take()
    client_url = f"http://127.0.0.1:{client_port}"
    peer_url = f"http://127.0.0.1:{peer_port}"
    await asyncio.to_thread(data_dir.mkdir, parents=True, exist_ok=True)
    args = [
        binary,
        "--name=bench",
        f"--data-dir={data_dir / 'etcd'}",
        f"--listen-client-urls={client_url}",
        f"--advertise-client-urls={client_url}",
        f"--listen-peer-urls={peer_url}",
        f"--initial-advertise-peer-urls={peer_url}",
        f"--initial-cluster=bench={peer_url}",
        "--initial-cluster-state=new",
        "--log-level=error",
    ]
    return await ServerProcess.spawn("etcd", args, client_port, data_dir, ports)


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

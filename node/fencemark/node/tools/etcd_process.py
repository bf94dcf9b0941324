"""One etcd process on loopback, from this machine's ``etcd`` (Debian's ``etcd-server``).

The coordination a local region of several members elects its decider through
(``fencemark demo --members``, ``LocalCluster``): plaintext, on held ports
(``fencemark.node.tools.ports``), its data in the cluster's directory. A deployment
runs etcd of its own, over mutual TLS (docs/operations.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from pathlib import Path

from fencemark.node.tools.ports import Ports

INSTALL = "apt-get install -y etcd-server"
STARTUP_TIMEOUT_S = 30.0


class EtcdMissing(RuntimeError):
    """No ``etcd`` on this machine: the message says how to install it."""


class EtcdProcess:
    def __init__(self, proc: asyncio.subprocess.Process, endpoint: str, data_dir: Path) -> None:
        self.proc = proc
        self.endpoint = endpoint  # HOST:PORT, as ``--etcd`` takes it
        self.data_dir = data_dir

    @classmethod
    async def start(cls, data_dir: Path, ports: Ports, *, name: str = "local") -> EtcdProcess:
        """Start a single-member etcd on two ports of ``ports``; return once it accepts
        connections (bounded by ``STARTUP_TIMEOUT_S``)."""
        binary = shutil.which("etcd")
        if binary is None:
            raise EtcdMissing(
                f"a region of several members elects its decider through etcd, and this"
                f" machine has none: install it with `{INSTALL}`"
            )
        client, peer = ports.take(), ports.take()
        client_url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
        await asyncio.to_thread(data_dir.mkdir, parents=True, exist_ok=True)
        log = data_dir / "etcd.log"  # a file: a pipe nobody reads could stall it
        with log.open("ab") as errors:
            proc = await asyncio.create_subprocess_exec(
                binary,
                f"--name={name}",
                f"--data-dir={data_dir / 'data'}",
                f"--listen-client-urls={client_url}",
                f"--advertise-client-urls={client_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster={name}={peer_url}",
                "--log-level=error",
                stdout=asyncio.subprocess.DEVNULL,
                stderr=errors,
            )
        etcd = cls(proc, f"127.0.0.1:{client}", data_dir)
        try:
            await etcd._accepting(client)
        except BaseException:
            await etcd.stop()
            raise
        return etcd

    async def _accepting(self, port: int) -> None:
        async with asyncio.timeout(STARTUP_TIMEOUT_S):
            while True:
                if self.proc.returncode is not None:
                    said = await asyncio.to_thread((self.data_dir / "etcd.log").read_text)
                    raise RuntimeError(
                        f"etcd exited with {self.proc.returncode} before serving:"
                        f" {said.strip()[-400:]}"
                    )
                try:
                    _, writer = await asyncio.open_connection("127.0.0.1", port)
                except OSError:
                    await asyncio.sleep(0.05)
                    continue
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
                return

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.terminate()
            try:
                async with asyncio.timeout(5):
                    await self.proc.wait()
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()

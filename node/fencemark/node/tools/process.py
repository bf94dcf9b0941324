"""Run a node as a child process (the demo, the cluster, durability tests), or
another server (``ServerProcess``: etcd for a region's members, the benchmarks'
baselines).

A node is started with ``--listen HOST:0`` and tells where it listens on its
first line of output, so no port is ever guessed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import re
import resource
import signal
import sys
from pathlib import Path

from fencemark.node.tools.ports import Ports

LISTENING = re.compile(r"listening on (\S+)")
TAIL_LINES = 20  # of a node's output, in the error when it does not come up
KEPT_LINES = 200  # of a running node's output, kept for a post-mortem (``output``)
SERVER_STARTUP_S = 30.0  # for a ``ServerProcess`` to accept connections


class NodeStartError(RuntimeError):
    """A node exited, or did not say where it listens, before serving; ``output`` is
    the last lines it printed (its reason is among them)."""

    def __init__(self, what: str, output: list[str]) -> None:
        shown = "".join(f"\n  | {line}" for line in output) or "\n  (it printed nothing)"
        super().__init__(f"{what}; its last lines:{shown}")
        self.output = output


class NodeProcess:
    def __init__(
        self,
        proc: asyncio.subprocess.Process,
        address: str,
        data_dir: Path,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.proc = proc
        self.address = address
        self.data_dir = data_dir
        self.extra_args = extra_args
        # Its latest lines: what a test shows when the node did not do as it should.
        self.output: collections.deque[str] = collections.deque(maxlen=KEPT_LINES)
        # Keep reading so a chatty child never blocks on a full pipe.
        self._drain = asyncio.create_task(self._drain_output())

    @classmethod
    async def start(
        cls,
        data_dir: Path,
        *,
        region: str = "local",
        enable_writes: bool = True,
        listen: str = "127.0.0.1:0",
        extra_args: tuple[str, ...] = (),
        startup_timeout: float = 30.0,
        tls_dir: Path | None = None,
        open_files: int | None = None,
    ) -> NodeProcess:
        """Start a node; plaintext (``--insecure``) unless ``tls_dir`` holds its certificates.

        ``extra_args`` that choose the transport themselves (``--tls-dir``) win.
        ``open_files`` sets the child's open-file limit (soft and hard), as a
        container's ``--ulimit nofile=`` would.
        """
        security = ["--tls-dir", str(tls_dir)] if tls_dir is not None else ["--insecure"]
        if any(a.startswith("--tls-dir") or a == "--insecure" for a in extra_args):
            security = []
        args = [
            sys.executable, "-m", "fencemark.node", "node",
            "--region", region, "--listen", listen, "--data", str(data_dir),
            *security, *extra_args,
        ]  # fmt: skip
        if enable_writes:
            args.append("--enable-writes")
        proc = await asyncio.create_subprocess_exec(
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            preexec_fn=None if open_files is None else functools.partial(_limit_files, open_files),
        )
        assert proc.stdout is not None
        tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        try:
            async with asyncio.timeout(startup_timeout):
                while True:
                    line = (await proc.stdout.readline()).decode(errors="replace")
                    if not line:
                        code = await proc.wait()
                        raise NodeStartError(f"node exited with {code} before serving", [*tail])
                    tail.append(line.rstrip("\n"))
                    match = LISTENING.search(line)
                    if match:
                        break
        except TimeoutError as exc:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            raise NodeStartError(
                f"node did not say where it listens within {startup_timeout:.0f} s", [*tail]
            ) from exc
        except BaseException:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            raise
        return cls(proc, match.group(1), data_dir, extra_args)

    async def _drain_output(self) -> None:
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            self.output.append(line.decode(errors="replace").rstrip("\n"))

    async def stop(self, grace: float = 15.0) -> int:
        """SIGTERM (graceful shutdown), SIGKILL if it does not end within ``grace`` s."""
        return await self._end(signal.SIGTERM, grace)

    async def kill(self) -> int:
        """SIGKILL: the crash a durable store must survive."""
        return await self._end(signal.SIGKILL, 15.0)

    async def _end(self, sig: signal.Signals, grace: float) -> int:
        await _signal_and_wait(self.proc, sig, grace)
        await self._drain
        assert self.proc.returncode is not None
        return self.proc.returncode


async def _signal_and_wait(
    proc: asyncio.subprocess.Process, sig: signal.Signals, grace: float
) -> None:
    """``sig`` to ``proc`` if it runs, then its end: SIGKILL after ``grace`` seconds."""
    if proc.returncode is None:
        proc.send_signal(sig)
        try:
            async with asyncio.timeout(grace):
                await proc.wait()
        except TimeoutError:
            proc.kill()
            await proc.wait()


def _limit_files(limit: int) -> None:
    """In the child, before it runs: at most ``limit`` open files."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))


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
        async with asyncio.timeout(SERVER_STARTUP_S):
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
        await _signal_and_wait(self.proc, signal.SIGTERM, grace)
        if self._ports is not None:
            self._ports.close()

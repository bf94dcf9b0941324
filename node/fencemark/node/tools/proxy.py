"""A fault-injecting TCP proxy between nodes: partitions, hung peers, slow links.

Our kernels have no ``tc netem``, so the network between regions is simulated:
node A reaches node B at a :class:`FaultProxy` address that forwards to B.
Fault controls are synchronous, callable at any time, and apply at once to
open connections as well as new ones. Plain asyncio; no gRPC, no rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Self

__all__ = ["FaultProxy", "ProxyMesh", "ProxyStats"]

log = logging.getLogger(__name__)

_CHUNK_BYTES = 64 * 1024
_QUEUE_CHUNKS = 64  # per direction, so at most ~4 MiB buffered inside the proxy
_CONNECT_TIMEOUT_SECONDS = 5.0
_BANDWIDTH_TICK_SECONDS = 0.05  # a slow link sends this much time's worth at once


class _Closeable:
    """``async with`` support for anything with an async ``close()``."""

    async def close(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


class _Mode(enum.Enum):
    FORWARD = "forward"
    CUT = "cut"  # refuse: close every connection at once
    BLACKHOLE = "blackhole"  # accept and hold, forward nothing


@dataclass
class ProxyStats:
    """What a proxy has done so far (a snapshot; see :attr:`FaultProxy.stats`)."""

    connections_accepted: int = 0  # accepted for forwarding (held ones included)
    connections_refused: int = 0  # closed at once because the link was cut
    upstream_failures: int = 0  # accepted, but the upstream could not be reached
    bytes_to_upstream: int = 0
    bytes_to_client: int = 0


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected a host:port address, got {address!r}")
    return host.strip("[]"), int(port)


class _Connection:
    """One accepted client connection and, once opened, its upstream connection."""

    def __init__(self, task: asyncio.Task[None], client: asyncio.StreamWriter) -> None:
        self.task = task
        self.writers = [client]
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True  # drop both sides without flushing, then stop
        for writer in self.writers:
            writer.transport.abort()
        self.task.cancel()


class FaultProxy(_Closeable):
    """Forwards every connection accepted at :attr:`address` to ``upstream``.

    Faults: :meth:`cut` (partition), :meth:`blackhole` (hung peer),
    :meth:`set_latency` and :meth:`set_bandwidth` (slow link); :meth:`heal`
    ends a cut or a blackhole. Latency and bandwidth apply to both directions
    and stay until set back.
    """

    def __init__(self, upstream: str, *, name: str = "") -> None:
        self.upstream = upstream
        self.name = name or upstream
        self._upstream_host, self._upstream_port = _split_address(upstream)
        self._server: asyncio.Server | None = None
        self._address = ""
        self._mode = _Mode.FORWARD
        self._flowing = asyncio.Event()  # cleared while blackholed
        self._flowing.set()
        self._latency_changed = asyncio.Event()  # set and replaced on every change
        self._latency = 0.0
        self._bandwidth: float | None = None
        self._connections: set[_Connection] = set()
        self._stats = ProxyStats()
        self._closed = False

    @classmethod
    async def start(cls, upstream: str, listen: str = "127.0.0.1:0", name: str = "") -> Self:
        """Listen on ``listen`` ("host:port", port 0 picks one) and forward to ``upstream``."""
        proxy = cls(upstream, name=name)
        host, port = _split_address(listen)
        proxy._server = await asyncio.start_server(proxy._serve, host, port)
        bound_host, bound_port = proxy._server.sockets[0].getsockname()[:2]
        bound = f"{bound_host}:{bound_port}"
        proxy._address = f"[{bound_host}]:{bound_port}" if ":" in bound_host else bound
        return proxy

    @property
    def address(self) -> str:
        """The "host:port" to connect to instead of ``upstream``."""
        assert self._address, "use FaultProxy.start()"
        return self._address

    @property
    def stats(self) -> ProxyStats:
        return replace(self._stats)

    @property
    def open_connections(self) -> int:
        return len(self._connections)

    # --- faults ---------------------------------------------------------------

    def cut(self) -> None:
        """Partition: close every open connection (both sides) and refuse new ones.

        Refused connections are accepted and closed at once, so a gRPC caller
        sees UNAVAILABLE immediately instead of waiting out its deadline.
        """
        self._set_mode(_Mode.CUT)
        self._abort_all()
        self._flowing.set()  # nothing is held while cut

    def blackhole(self) -> None:
        """Hung peer: keep connections open but forward nothing, either way.

        New connections are accepted and held. Bytes already sent are held in
        order, not lost: like TCP across a link that drops packets, the stream
        resumes on :meth:`heal` if the caller has not given up (only its
        deadline saves it meanwhile).
        """
        self._set_mode(_Mode.BLACKHOLE)
        self._flowing.clear()

    def heal(self) -> None:
        """End a cut or a blackhole: forward normally, held connections included."""
        self._set_mode(_Mode.FORWARD)
        self._flowing.set()

    def set_latency(self, seconds: float) -> None:
        """Delay every chunk by ``seconds`` in each direction (0 removes the delay).

        Chunks keep their order and are timed independently, so a delay does
        not cap throughput. Chunks already waiting are re-timed at once.
        """
        if not seconds >= 0:
            raise ValueError(f"latency must be >= 0 seconds, got {seconds}")
        self._latency = float(seconds)
        self._latency_changed.set()
        self._latency_changed = asyncio.Event()
        log.info("proxy %s: latency %.3f s", self.name, seconds)

    def set_bandwidth(self, bytes_per_second: float | None) -> None:
        """Cap each direction at ``bytes_per_second``; None removes the cap."""
        if bytes_per_second is not None and not bytes_per_second > 0:
            raise ValueError(f"bandwidth must be > 0 bytes/s or None, got {bytes_per_second}")
        self._bandwidth = bytes_per_second
        log.info("proxy %s: bandwidth %s bytes/s", self.name, bytes_per_second)

    def _abort_all(self) -> list[_Connection]:
        connections = list(self._connections)
        self._connections.clear()
        for connection in connections:
            connection.abort()
        return connections

    def _set_mode(self, mode: _Mode) -> None:
        if mode is not self._mode:
            log.info("proxy %s: %s -> %s", self.name, self._mode.value, mode.value)
        self._mode = mode

    # --- lifecycle ------------------------------------------------------------

    async def close(self) -> None:
        """Stop listening and close every connection; idempotent."""
        self._closed = True
        if self._server is not None:
            self._server.close()
        connections = self._abort_all()
        await asyncio.gather(*(c.task for c in connections), return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    # --- forwarding -----------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if self._closed or self._mode is _Mode.CUT or task is None:
            self._stats.connections_refused += 1
            writer.transport.abort()
            return
        connection = _Connection(task, writer)
        self._connections.add(connection)
        self._stats.connections_accepted += 1
        finished = False
        try:
            await self._flowing.wait()  # a blackholed connection is held here
            finished = await self._forward(connection, reader)
        except asyncio.CancelledError:
            # Ours (cut or close) ends quietly: asyncio would report a
            # cancelled connection callback as an unhandled error.
            if not connection.aborted:
                raise
        finally:
            self._connections.discard(connection)
            for side in connection.writers:
                if finished:
                    side.close()  # let what is left flush
                else:
                    side.transport.abort()

    async def _forward(self, connection: _Connection, reader: asyncio.StreamReader) -> bool:
        """Connect upstream and copy both ways; whether both sides ended cleanly."""
        try:
            async with asyncio.timeout(_CONNECT_TIMEOUT_SECONDS):
                upstream_reader, upstream_writer = await asyncio.open_connection(
                    self._upstream_host, self._upstream_port
                )
        except (OSError, TimeoutError):
            self._stats.upstream_failures += 1
            return False
        client_writer = connection.writers[0]
        connection.writers.append(upstream_writer)
        if connection.aborted:  # cut while connecting
            upstream_writer.transport.abort()
            return False
        clean = True
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._pipe(reader, upstream_writer, to_upstream=True))
                group.create_task(self._pipe(upstream_reader, client_writer, to_upstream=False))
        except* OSError:
            clean = False  # a reset on either side ends the connection
        return clean

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, to_upstream: bool
    ) -> None:
        """Copy one direction, passing a half-close (EOF) on after the data."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(_QUEUE_CHUNKS)
        loop = asyncio.get_running_loop()

        async def receive() -> None:
            data = b"."
            while data:
                await self._flowing.wait()
                data = await reader.read(_CHUNK_BYTES)
                await queue.put((loop.time(), data))

        async def deliver() -> None:
            while True:
                received_at, data = await queue.get()
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                await self._wait_until_due(received_at)
                await self._send(writer, data, to_upstream=to_upstream)

        async with asyncio.TaskGroup() as group:
            group.create_task(receive())
            group.create_task(deliver())

    async def _wait_until_due(self, received_at: float) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._flowing.wait()
            delay = received_at + self._latency - loop.time()
            if delay <= 0:
                return
            changed = self._latency_changed
            with contextlib.suppress(TimeoutError):  # not wait_for (see the replicator)
                async with asyncio.timeout(delay):
                    await changed.wait()

    async def _send(self, writer: asyncio.StreamWriter, data: bytes, *, to_upstream: bool) -> None:
        view = memoryview(data)
        while view:
            await self._flowing.wait()  # a blackhole also stops a chunk midway
            rate = self._bandwidth
            size = len(view) if rate is None else max(1, int(rate * _BANDWIDTH_TICK_SECONDS))
            piece, view = view[:size], view[size:]
            writer.write(piece)
            await writer.drain()
            if to_upstream:
                self._stats.bytes_to_upstream += len(piece)
            else:
                self._stats.bytes_to_client += len(piece)
            if rate is not None:
                await asyncio.sleep(len(piece) / rate)


class ProxyMesh(_Closeable):
    """The network between regions: one :class:`FaultProxy` per ordered pair.

    Node ``src`` is configured to reach node ``dst`` at
    ``peer_address(src, dst)``. Only node-to-node traffic goes through the
    mesh: a node's own clients connect to it directly, so a region cut off by
    :meth:`isolate` keeps serving its local clients. A link carries whole
    connections that ``src`` opens, so it affects requests to ``dst`` and
    their replies alike.
    """

    def __init__(self, links: Mapping[tuple[str, str], FaultProxy], regions: Iterable[str]) -> None:
        self._links = dict(links)
        self.regions = tuple(regions)

    @classmethod
    async def start(cls, nodes: Mapping[str, str]) -> Self:
        """Start a proxy for every ordered pair of regions in ``nodes`` (region -> address)."""
        links: dict[tuple[str, str], FaultProxy] = {}
        try:
            for src, dst in itertools.permutations(nodes, 2):
                links[src, dst] = await FaultProxy.start(nodes[dst], name=f"{src}->{dst}")
        except BaseException:
            await asyncio.gather(*(link.close() for link in links.values()))
            raise
        return cls(links, nodes)

    def link(self, src: str, dst: str) -> FaultProxy:
        """The proxy ``src`` goes through to reach ``dst``, for finer faults."""
        try:
            return self._links[src, dst]
        except KeyError:
            raise ValueError(f"no link {src}->{dst}; regions are {self.regions}") from None

    def peer_address(self, src: str, dst: str) -> str:
        """The address ``src`` must use to reach ``dst``."""
        return self.link(src, dst).address

    def peers(self, src: str) -> dict[str, str]:
        """Every other region's address as ``src`` must use it (a node's peer list)."""
        return {dst: self.peer_address(src, dst) for dst in self.regions if dst != src}

    def isolate(self, region: str) -> None:
        """Cut every link into and out of ``region``."""
        self._check(region)
        for (src, dst), link in self._links.items():
            if region in (src, dst):
                link.cut()

    def partition(self, groups: list[set[str]]) -> None:
        """Cut every link between different groups; groups must cover each region once."""
        group_of: dict[str, int] = {}
        for index, group in enumerate(groups):
            for region in group:
                self._check(region)
                if region in group_of:
                    raise ValueError(f"region {region!r} is in more than one group")
                group_of[region] = index
        if missing := set(self.regions) - group_of.keys():
            raise ValueError(f"regions {sorted(missing)} are in no group")
        for (src, dst), link in self._links.items():
            if group_of[src] != group_of[dst]:
                link.cut()

    def heal(self) -> None:
        """End every cut and blackhole (latency stays until ``slow(..., 0)``)."""
        for link in self._links.values():
            link.heal()

    def slow(self, src: str, dst: str, latency: float) -> None:
        """Delay the ``src``->``dst`` link by ``latency`` seconds each way (0 removes it)."""
        self.link(src, dst).set_latency(latency)

    async def close(self) -> None:
        await asyncio.gather(*(link.close() for link in self._links.values()))

    def _check(self, region: str) -> None:
        if region not in self.regions:
            raise ValueError(f"unknown region {region!r}; regions are {self.regions}")

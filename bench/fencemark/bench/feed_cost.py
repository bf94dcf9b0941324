"""The ``feed`` scenario's second part: what watchers cost the write path of their node.

At the writer's region, ``feed_writers`` closed-loop clients update records of one
topic (each its own records) while 0, 1 or 100 ``Records.Watch`` streams of that
topic, all at the same node, take every change (``feed_watchers``: one process of
its own, ``fencemark.bench.feed_watchers``). Measured per run: writes per second in
the window, write latency, and the node's CPU seconds per acknowledged write
(psutil, over the whole run). Each run ends with every watcher having received
every acknowledged write, or the count of those it did not; within a repeat the
watcher counts run back to back, so the ratios against no watchers compare moments
apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psutil

from fencemark.bench import drivers, feed_watchers
from fencemark.bench.load import LoadResult, Operation, closed_loop
from fencemark.bench.progress import Progress
from fencemark.bench.records import REPO, typical_tags
from fencemark.bench.results import Settings
from fencemark.bench.stats import median
from fencemark.client import AsyncClient

RECORDS_PER_WRITER = 8
READY_LIMIT_S = 60.0  # for every stream to open and see the ready write
END_LIMIT_S = 120.0  # for every stream to take what was written and see the end


@dataclass
class CostRun:
    """One window of writes with ``watchers`` streams attached."""

    watchers: int
    load: LoadResult
    writes: int  # acknowledged over the whole run, warm-up and stop included
    node_cpu_s: float
    received: list[int]  # events per watcher, of those writes
    watcher_cpu_s: float = 0.0

    @property
    def cpu_ms_per_write(self) -> float:
        return self.node_cpu_s * 1000 / self.writes if self.writes else float("nan")

    @property
    def missed(self) -> int:
        """Events not received, over every watcher."""
        return sum(self.writes - got for got in self.received)


class Watchers:
    """The watcher process of one run, driven through its marker record."""

    def __init__(self, proc: asyncio.subprocess.Process, count: int) -> None:
        self.proc = proc
        self.count = count

    @classmethod
    async def start(
        cls, address: str, topic: str, marker: str, count: int, writer: AsyncClient
    ) -> Watchers:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fencemark.bench.feed_watchers",
            address, REPO, topic, marker, str(count),
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        watchers = cls(proc, count)
        try:
            await watchers._until_ready(marker, writer)
        except BaseException:
            await watchers.stop()
            raise
        return watchers

    async def _until_ready(self, marker: str, writer: AsyncClient) -> None:
        """Write the marker's ``ready`` until every stream has seen one: then each is open."""
        assert self.proc.stdout is not None
        line = asyncio.ensure_future(self.proc.stdout.readline())
        try:
            async with asyncio.timeout(READY_LIMIT_S):
                n = 0
                while not line.done():
                    n += 1
                    fields = {"phase": feed_watchers.READY, "n": str(n)}
                    await writer.update(marker, fields=fields)
                    await asyncio.wait({line}, timeout=0.1)
        finally:
            line.cancel()
        if line.result().strip() != feed_watchers.READY.encode():
            raise RuntimeError(f"the watchers did not start: {line.result()!r}")

    async def finish(self, marker: str, writer: AsyncClient) -> tuple[list[int], float]:
        """Write the marker's ``end``; the events each stream received before it, and
        the watcher process's CPU seconds."""
        assert self.proc.stdout is not None
        await writer.update(marker, fields={"phase": feed_watchers.END})
        async with asyncio.timeout(END_LIMIT_S):
            report = json.loads(await self.proc.stdout.readline())
            await self.proc.wait()
        return [int(n) for n in report["events"]], float(report["cpu_s"])

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


def _counted(operation: Operation, acknowledged: list[int]) -> Operation:
    async def counted(i: int) -> dict[str, float]:
        calls = await operation(i)
        acknowledged[0] += 1
        return calls

    return counted


async def _seed(clients: Sequence[AsyncClient], topic: str, home: str) -> list[list[str]]:
    async def records(index: int, client: AsyncClient) -> list[str]:
        return [
            (await client.remember(REPO, topic, f"w{index}-{j}", title="feed write",
                                   tags=typical_tags(home))).record.key
            for j in range(RECORDS_PER_WRITER)
        ]  # fmt: skip

    return list(await asyncio.gather(*(records(i, c) for i, c in enumerate(clients))))


async def cost_run(
    address: str, pid: int, home: str, watchers: int, tag: str, settings: Settings,
    progress: Progress,
) -> CostRun:  # fmt: skip
    topic = f"cost-{tag}"
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(AsyncClient(address, retries=0))
            for _ in range(settings.feed_writers)
        ]
        keys = await _seed(clients, topic, home)
        marker = (await clients[0].remember(REPO, topic, "marker", title="marker")).record.key
        attached = None
        if watchers:
            progress.status(f"{tag}: starting {watchers} watchers")
            attached = await Watchers.start(address, topic, marker, watchers, clients[0])
            stack.push_async_callback(attached.stop)
        acknowledged = [0]
        operations = [
            _counted(drivers.fencemark_update(client, mine), acknowledged)
            for client, mine in zip(clients, keys, strict=True)
        ]
        node = psutil.Process(pid)
        before = node.cpu_times()
        load = await closed_loop(
            operations, warmup=settings.warmup, duration=settings.duration,
            progress=progress, label=f"{tag}: {watchers} watchers",
        )  # fmt: skip
        after = node.cpu_times()
        received: list[int] = []
        watcher_cpu = 0.0
        if attached is not None:
            progress.status(f"{tag}: waiting for the watchers to take every write")
            received, watcher_cpu = await attached.finish(marker, clients[0])
    cpu = (after.user - before.user) + (after.system - before.system)
    return CostRun(watchers, load, acknowledged[0], cpu, received, watcher_cpu)


async def measure_cost(
    address: str, pid: int, home: str, settings: Settings, progress: Progress
) -> dict[int, list[CostRun]]:
    """Every count of ``feed_watchers`` in each repeat, back to back, starting each
    repeat one count further on (no count always runs first, on a node just warmed up)."""
    counts = list(settings.feed_watchers)
    runs: dict[int, list[CostRun]] = {count: [] for count in counts}
    for repeat in range(settings.repeats):
        shift = repeat % len(counts)
        for count in counts[shift:] + counts[:shift]:
            tag = f"r{repeat}w{count}"
            run = await cost_run(address, pid, home, count, tag, settings, progress)
            runs[count].append(run)
            line = (
                f"{count} watchers (run {repeat + 1}/{settings.repeats}): {run.load.rate:,.0f}"
                f" writes/s, p99 {run.load.p(99):.1f} ms, node {run.cpu_ms_per_write:.2f} ms"
                f" CPU per write"
            )
            if watchers_missed := run.missed:
                line += f", {watchers_missed} events NOT received"
            if run.load.errors:
                line += f", {run.load.errors} ERRORS (first: {run.load.first_error})"
            progress.line(line)
    return runs


def summary(runs: list[CostRun]) -> dict[str, Any]:
    """Medians over the repeats of one watcher count."""
    return {
        "writes_per_s": median([r.load.rate for r in runs]),
        "p50_ms": median([r.load.p(50) for r in runs]),
        "p99_ms": median([r.load.p(99) for r in runs]),
        "node_cpu_ms_per_write": median([r.cpu_ms_per_write for r in runs]),
        "writes": sum(r.writes for r in runs),
        "events_missed": sum(r.missed for r in runs),
        "errors": sum(r.load.errors for r in runs),
        "watcher_cpu_s": sum(r.watcher_cpu_s for r in runs),
        "runs": [round(r.load.rate, 1) for r in runs],
    }

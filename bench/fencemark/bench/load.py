"""A closed-loop load driver: N clients, each issuing its next operation when the last ended.

Throughput is counted as operations that *completed* inside the measured window
(after a warm-up), which is unbiased in steady state; latencies are those of the
same operations. Every loop is bounded by the window: when it ends the clients
finish the operation in hand (or are cancelled after a grace period).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from fencemark.bench.progress import Progress
from fencemark.bench.stats import percentile

# One operation of one client, given its iteration number; it returns how long
# each of the calls it made took, by call name (a claim cycle makes three).
Operation = Callable[[int], Awaitable[dict[str, float]]]
STOP_GRACE_S = 10.0
T = TypeVar("T")


@dataclass
class LoadResult:
    clients: int
    seconds: float
    latencies: list[float] = field(default_factory=list)  # per operation, seconds
    calls: dict[str, list[float]] = field(default_factory=dict)  # per call name, seconds
    errors: int = 0
    first_error: str = ""
    # CPU seconds (user + system, every thread) used during the measured window by
    # the server process measured, and by this process, the load generator; NaN:
    # not measured. Rates move with the machine's load; CPU per call much less.
    server_cpu_s: float = math.nan
    loader_cpu_s: float = math.nan

    @property
    def ops(self) -> int:
        return len(self.latencies)

    @property
    def rate(self) -> float:
        """Operations per second."""
        return self.ops / self.seconds if self.seconds else 0.0

    def call_rate(self) -> float:
        """RPCs per second (every call of every operation)."""
        return self.calls_made() / self.seconds if self.seconds else 0.0

    def calls_made(self) -> int:
        return sum(len(v) for v in self.calls.values())

    def server_ms_per_call(self) -> float:
        """The server's CPU per call in the window, in milliseconds."""
        return 1000 * self.server_cpu_s / self.calls_made() if self.calls else math.nan

    def loader_ms_per_call(self) -> float:
        """The load generator's CPU per call in the window, in milliseconds."""
        return 1000 * self.loader_cpu_s / self.calls_made() if self.calls else math.nan

    def server_ms_per_op(self) -> float:
        """The server's CPU per operation (a claim cycle, a drained item), in ms."""
        return 1000 * self.server_cpu_s / self.ops if self.ops else math.nan

    def loader_ms_per_op(self) -> float:
        return 1000 * self.loader_cpu_s / self.ops if self.ops else math.nan

    def p(self, q: float, call: str | None = None) -> float:
        """The ``q``-th percentile latency in milliseconds (of one call, or of the operation)."""
        samples = self.latencies if call is None else self.calls.get(call, [])
        return percentile(samples, q) * 1000


async def closed_loop(
    operations: Sequence[Operation],
    *,
    warmup: float,
    duration: float,
    progress: Progress | None = None,
    label: str = "",
    server_pid: int | None = None,
) -> LoadResult:
    """Run one client per operation for ``warmup + duration`` seconds; with
    ``server_pid``, measure that process's CPU and this one's over the window."""
    result = LoadResult(clients=len(operations), seconds=duration)
    loop = asyncio.get_running_loop()
    start = loop.time() + warmup
    end = start + duration
    stopping = asyncio.Event()
    if server_pid is not None:
        meter = CpuMeter(server_pid)
        loop.call_at(start, meter.start)
        loop.call_at(end, lambda: meter.stop(result))

    async def client(operation: Operation) -> None:
        iteration = 0
        while not stopping.is_set():
            began = time.perf_counter()
            try:
                calls = await operation(iteration)
            except Exception as exc:  # counted and reported, never silently dropped
                result.errors += 1
                result.first_error = result.first_error or f"{type(exc).__name__}: {exc}"
                await asyncio.sleep(0.01)
                continue
            finally:
                iteration += 1
            now = loop.time()
            if start <= now <= end:
                result.latencies.append(time.perf_counter() - began)
                for name, seconds in calls.items():
                    result.calls.setdefault(name, []).append(seconds)

    tasks = [asyncio.create_task(client(op)) for op in operations]
    try:
        while loop.time() < end:
            await asyncio.sleep(min(0.25, max(0.0, end - loop.time())))
            if progress is not None:
                phase = "warm-up" if loop.time() < start else f"{result.ops} ops"
                progress.status(f"{label}: {phase}")
            if all(task.done() for task in tasks):
                break
    finally:
        stopping.set()
        _, pending = await asyncio.wait(tasks, timeout=STOP_GRACE_S)
        for task in pending:
            task.cancel()
        for task in pending:
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return result


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far, every thread (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """The CPU a server process and this one (the load generator) use between
    :meth:`start` and :meth:`stop`, put into a :class:`LoadResult`."""

    def __init__(self, server_pid: int) -> None:
        self.server_pid = server_pid
        self._began = (math.nan, math.nan)

    def start(self) -> None:
        self._began = (cpu_seconds(self.server_pid), cpu_seconds(os.getpid()))

    def stop(self, result: LoadResult) -> None:
        result.server_cpu_s = cpu_seconds(self.server_pid) - self._began[0]
        result.loader_cpu_s = cpu_seconds(os.getpid()) - self._began[1]


class Calls(dict[str, float]):
    """The calls one operation made and how long each took (seconds, by name)."""

    async def time(self, name: str, awaitable: Awaitable[T]) -> T:
        began = time.perf_counter()
        try:
            return await awaitable
        finally:
            self[name] = time.perf_counter() - began

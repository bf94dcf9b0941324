"""A closed-loop load driver: N clients, each issuing its next operation when the last ended.

Throughput is counted as operations that *completed* inside the measured window
(after a warm-up), which is unbiased in steady state; latencies are those of the
same operations. Every loop is bounded by the window: when it ends the clients
finish the operation in hand (or are cancelled after a grace period).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
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

    @property
    def ops(self) -> int:
        return len(self.latencies)

    @property
    def rate(self) -> float:
        """Operations per second."""
        return self.ops / self.seconds if self.seconds else 0.0

    def call_rate(self) -> float:
        """RPCs per second (every call of every operation)."""
        return sum(len(v) for v in self.calls.values()) / self.seconds if self.seconds else 0.0

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
) -> LoadResult:
    """Run one client per operation for ``warmup + duration`` seconds."""
    result = LoadResult(clients=len(operations), seconds=duration)
    loop = asyncio.get_running_loop()
    start = loop.time() + warmup
    end = start + duration
    stopping = asyncio.Event()

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


class Calls(dict[str, float]):
    """The calls one operation made and how long each took (seconds, by name)."""

    async def time(self, name: str, awaitable: Awaitable[T]) -> T:
        began = time.perf_counter()
        try:
            return await awaitable
        finally:
            self[name] = time.perf_counter() - began

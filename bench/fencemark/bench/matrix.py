"""Run several systems at several concurrencies, interleaved, and summarise the repeats.

Within a repeat the systems run back to back at one concurrency, so a ratio
between two of them compares measurements taken moments apart; each figure is
then the median over the repeats.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any

from fencemark.bench.load import LoadResult, Operation, closed_loop
from fencemark.bench.progress import Progress
from fencemark.bench.results import Settings
from fencemark.bench.stats import median, paired_ratio

# (clients, tag) -> the clients' operations, ready to run (set up outside the window).
Factory = Callable[[int, str], AbstractAsyncContextManager[list[Operation]]]
Runs = dict[str, dict[int, list[LoadResult]]]  # system -> clients -> one result per repeat


async def run_matrix(
    systems: Mapping[str, Factory],
    settings: Settings,
    progress: Progress,
    servers: Mapping[str, int] | None = None,
) -> Runs:
    """Every system at every concurrency, ``settings.repeats`` times; ``servers`` maps
    a system to the pid of its server process, whose CPU per call is then measured."""
    runs: Runs = {name: {c: [] for c in settings.concurrency} for name in systems}
    for repeat in range(settings.repeats):
        for clients in settings.concurrency:
            for name, factory in systems.items():
                label = f"{name} x{clients} (run {repeat + 1}/{settings.repeats})"
                async with factory(clients, f"r{repeat}c{clients}") as operations:
                    result = await closed_loop(
                        operations,
                        warmup=settings.warmup,
                        duration=settings.duration,
                        progress=progress,
                        label=label,
                        server_pid=(servers or {}).get(name),
                    )
                runs[name][clients].append(result)
                line = f"{label}: {result.rate:,.0f} ops/s, p99 {result.p(99):.1f} ms"
                if result.errors:
                    line += f", {result.errors} ERRORS (first: {result.first_error})"
                progress.line(line)
    return runs


def summary(results: list[LoadResult], calls: tuple[str, ...] = ()) -> dict[str, Any]:
    """Medians over repeats: ops/s, RPCs/s, p50/p99 ms of the operation and of each call."""
    out: dict[str, Any] = {
        "ops_per_s": median([r.rate for r in results]),
        "rpcs_per_s": median([r.call_rate() for r in results]),
        "p50_ms": median([r.p(50) for r in results]),
        "p99_ms": median([r.p(99) for r in results]),
        "samples": sum(r.ops for r in results),
        "errors": sum(r.errors for r in results),
        "runs": [round(r.rate, 1) for r in results],
        "server_ms_per_call": median([r.server_ms_per_call() for r in results]),
        "loader_ms_per_call": median([r.loader_ms_per_call() for r in results]),
        "server_ms_per_op": median([r.server_ms_per_op() for r in results]),
        "loader_ms_per_op": median([r.loader_ms_per_op() for r in results]),
    }
    for call in calls:
        out[f"{call}_p50_ms"] = median([r.p(50, call) for r in results])
        out[f"{call}_p99_ms"] = median([r.p(99, call) for r in results])
    return out


def rpc_ratio(runs: Runs, system: str, baseline: str, clients: int) -> float:
    """RPCs/s of ``system`` over ``baseline``'s, paired per repeat."""
    return paired_ratio(
        [r.call_rate() for r in runs[system][clients]],
        [r.call_rate() for r in runs[baseline][clients]],
    )


def ops_ratio(runs: Runs, system: str, baseline: str, clients: int) -> float:
    """Operations/s of ``system`` over ``baseline``'s, paired per repeat."""
    return paired_ratio(
        [r.rate for r in runs[system][clients]], [r.rate for r in runs[baseline][clients]]
    )


def latencies(runs: Runs, system: str, clients: int) -> list[float]:
    """Every operation latency of every repeat, in milliseconds (for plots)."""
    return [s * 1000 for r in runs[system][clients] for s in r.latencies]

"""One region's claim cycles on one node process and on two (docs/scaling.md).

There is no shard router yet: this measures what one would make possible, the
claim-cycle load split over S independent node processes — each client's records on
one of them, as ``H(key) mod S`` would place them — against the same load on one.
Runs alternate one and S processes, so that a noisy machine shifts both alike;
each line reports cycles/s, the nodes' CPU (from /proc) and CPU per cycle.

    .venv/bin/python -m fencemark.bench.shards --clients 16 --seconds 12 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from fencemark.bench import drivers
from fencemark.bench.load import Operation, closed_loop, cpu_seconds
from fencemark.node.tools.process import NodeProcess

RECORDS_PER_CLIENT = 20


@dataclass(frozen=True)
class ShardRun:
    processes: int
    clients: int
    cycles_per_s: float
    node_cores: float  # the node processes' CPU over the run, in cores
    errors: int

    @property
    def cpu_ms_per_cycle(self) -> float:
        return 1000 * self.node_cores / self.cycles_per_s if self.cycles_per_s else 0.0

    def line(self) -> str:
        return (
            f"{self.processes} process(es), {self.clients} clients: {self.cycles_per_s:.0f}"
            f" cycles/s, nodes {self.node_cores:.2f} cores, {self.cpu_ms_per_cycle:.2f} ms"
            f" node CPU per cycle, {self.errors} errors"
        )


@contextlib.asynccontextmanager
async def _cycles(nodes: Sequence[NodeProcess], clients: int) -> AsyncIterator[list[Operation]]:
    """``clients`` claim-cycle loops, spread evenly over ``nodes``."""
    per = clients // len(nodes)
    async with contextlib.AsyncExitStack() as stack:
        operations: list[Operation] = []
        for index, node in enumerate(nodes):
            pairs = await stack.enter_async_context(
                drivers.fencemark_clients(node.address, per, f"shard{index}", RECORDS_PER_CLIENT)
            )
            operations += [
                drivers.fencemark_claim_cycle(client, keys, f"worker-{index}-{n}")
                for n, (client, keys) in enumerate(pairs)
            ]
        yield operations


async def run_once(processes: int, clients: int, seconds: float, root: Path) -> ShardRun:
    nodes = [await NodeProcess.start(root / f"shard{i}") for i in range(processes)]
    try:
        async with _cycles(nodes, clients) as operations:
            await asyncio.sleep(1.0)  # settle after seeding
            before = sum(cpu_seconds(node.proc.pid) for node in nodes)
            result = await closed_loop(operations, warmup=0.0, duration=seconds)
            used = sum(cpu_seconds(node.proc.pid) for node in nodes) - before
        return ShardRun(processes, clients, result.ops / seconds, used / seconds, result.errors)
    finally:
        for node in nodes:
            await node.stop()


async def compare(
    clients: int, seconds: float, repeats: int, processes: int = 2
) -> list[tuple[ShardRun, ShardRun]]:
    """``repeats`` pairs of runs, one process then ``processes``, printed as they end."""
    pairs = []
    for repeat in range(repeats):
        with tempfile.TemporaryDirectory(prefix="fencemark-shards-") as scratch:
            one = await run_once(1, clients, seconds, Path(scratch) / "one")
            print(f"[{repeat + 1}/{repeats}] {one.line()}", flush=True)
            many = await run_once(processes, clients, seconds, Path(scratch) / "many")
            print(f"[{repeat + 1}/{repeats}] {many.line()}", flush=True)
        ratio = many.cycles_per_s / one.cycles_per_s if one.cycles_per_s else 0.0
        print(f"[{repeat + 1}/{repeats}] {processes} processes / 1: {ratio:.2f}x", flush=True)
        pairs.append((one, many))
    return pairs


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--processes", type=int, default=2)
    args = parser.parse_args(argv)
    asyncio.run(compare(args.clients, args.seconds, args.repeats, args.processes))


if __name__ == "__main__":
    main()

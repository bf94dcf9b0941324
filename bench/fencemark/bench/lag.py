"""Scenario 3: replication lag in a three-region loopback cluster under a steady write load.

Three node processes (``us``, ``eu``, ``ap``) peer directly on loopback. At
``us`` a background load updates records at a fixed rate (open loop), and a
probe updates one record with a sequence number every ``lag_probe_interval``.
A watcher per other region reads that record every two milliseconds, and the
first read that shows a probe's sequence number (or a later one) ends that
probe's lag there, measured from the moment ``us`` acknowledged it (so it
includes up to one read's round trip and one poll interval); "everywhere" is
the larger of the two. One watcher per region serves every outstanding probe:
a watcher per probe multiplied the reads by the probes in flight, and the
measurement's own load showed up in the lag it measured (docs/performance.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from pathlib import Path
from typing import Any

from fencemark.bench import plots
from fencemark.bench.progress import Progress
from fencemark.bench.records import REPO, typical_tags
from fencemark.bench.results import ScenarioResult, Settings, Table, at_most, fmt
from fencemark.bench.stats import median, percentile
from fencemark.client import AsyncClient, FencemarkError
from fencemark.node.tools.cluster import LocalCluster

REGIONS = ("us", "eu", "ap")
BACKGROUND_RECORDS = 64
MAX_IN_FLIGHT = 64  # background writes outstanding at once
WATCH_POLL_S = 0.002
WATCH_LIMIT_S = 10.0
WARM_UP_LIMIT_S = 30.0


async def run_lag(settings: Settings, progress: Progress, work: Path, out: Path) -> ScenarioResult:
    cluster = await LocalCluster.start(REGIONS, work / "lag")
    try:
        async with contextlib.AsyncExitStack() as stack:
            clients = {
                r: await stack.enter_async_context(AsyncClient(a, retries=0))
                for r, a in cluster.addresses.items()
            }
            samples = await _measure(clients, settings, progress)
    finally:
        await cluster.stop()
    return _report(samples, settings, out)


async def _measure(
    clients: dict[str, AsyncClient], settings: Settings, progress: Progress
) -> list[tuple[float, dict[str, float]]]:
    writer = clients["us"]
    tags = typical_tags("us")
    background = []
    for i in range(BACKGROUND_RECORDS):
        made = await writer.remember(REPO, "lag", f"load-{i}", title="background", tags=tags)
        background.append(made.record.key)
    probe = (await writer.remember(REPO, "lag", "probe", title="probe", tags=tags)).record.key
    await _warm_up(clients, probe, progress)
    stop = asyncio.Event()
    in_flight = asyncio.Semaphore(MAX_IN_FLIGHT)
    samples: list[tuple[float, dict[str, float]]] = []  # (when, region -> lag seconds)
    skipped = 0

    async def one_write(key: str, n: int) -> None:
        try:
            await writer.update(key, fields={"body": f"load {n}"})
        finally:
            in_flight.release()

    async def load() -> None:
        nonlocal skipped
        n = 0
        began = time.monotonic()
        tasks: set[asyncio.Task[None]] = set()
        while not stop.is_set():
            n += 1
            due = began + n / settings.lag_write_rate
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            if in_flight.locked():
                skipped += 1  # the node is behind; an open loop does not queue up
                continue
            await in_flight.acquire()
            task = asyncio.create_task(one_write(random.choice(background), n))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks, return_exceptions=True)

    outstanding: dict[str, dict[int, tuple[float, dict[str, float]]]] = {
        region: {} for region in REGIONS[1:]
    }  # region -> seq -> (acknowledged, lags) of probes not yet seen there
    probing = True

    async def watch(region: str) -> None:
        client, waiting = clients[region], outstanding[region]
        while probing or waiting:
            if waiting:
                with contextlib.suppress(FencemarkError):
                    record = await client.get(probe)
                    seen, now = int(record.fields.get("seq", "0")), time.monotonic()
                    for seq in [s for s in waiting if s <= seen]:
                        acknowledged, lags = waiting.pop(seq)
                        lags[region] = now - acknowledged
                now = time.monotonic()
                for seq in [s for s, (a, _) in waiting.items() if now - a > WATCH_LIMIT_S]:
                    del waiting[seq]  # never seen in time: reported as unseen
            await asyncio.sleep(WATCH_POLL_S)

    async def probes() -> None:
        seq = 0
        deadline = time.monotonic() + settings.lag_seconds
        while time.monotonic() < deadline:
            seq += 1
            await writer.update(probe, fields={"seq": str(seq)})
            acknowledged = time.monotonic()
            lags: dict[str, float] = {}
            samples.append((acknowledged, lags))
            for region in REGIONS[1:]:
                outstanding[region][seq] = (acknowledged, lags)
            progress.status(f"{seq} probes, {len(samples)} with lags")
            await asyncio.sleep(settings.lag_probe_interval)

    load_task = asyncio.create_task(load())
    watchers = [asyncio.create_task(watch(region)) for region in REGIONS[1:]]
    try:
        await probes()
        probing = False
        await asyncio.gather(*watchers)
    finally:
        probing = False
        stop.set()
        await load_task
        for task in watchers:
            task.cancel()
    if skipped:
        progress.line(f"background load fell behind: {skipped} writes skipped")
    return samples


async def _warm_up(clients: dict[str, AsyncClient], probe: str, progress: Progress) -> None:
    """Wait until pushes flow: nodes that started together may have failed their first
    pushes (a peer not listening yet) and be backing off; that is start-up, not lag."""
    progress.status("warming up: waiting for pushes to reach every region")
    deadline = time.monotonic() + WARM_UP_LIMIT_S
    fast = 0
    seq = 0
    while fast < 3 and time.monotonic() < deadline:
        seq += 1
        await clients["us"].update(probe, fields={"seq": str(-seq)})
        written = time.monotonic()
        pending = set(REGIONS[1:])
        while pending and time.monotonic() - written < WATCH_LIMIT_S:
            for region in list(pending):
                with contextlib.suppress(FencemarkError):
                    record = await clients[region].get(probe)
                    if record.fields.get("seq") == str(-seq):
                        pending.discard(region)
            await asyncio.sleep(WATCH_POLL_S)
        fast = fast + 1 if time.monotonic() - written < 0.1 else 0
    await clients["us"].update(probe, fields={"seq": "0"})


def _report(
    samples: list[tuple[float, dict[str, float]]], settings: Settings, out: Path
) -> ScenarioResult:
    complete = [lags for _, lags in samples if len(lags) == len(REGIONS) - 1]
    missing = len(samples) - len(complete)
    per_region = {r: [lags[r] * 1000 for lags in complete] for r in REGIONS[1:]}
    everywhere = [max(lags.values()) * 1000 for lags in complete]
    # One figure per window, then the median over windows (a run is one window here).
    windows = max(1, settings.repeats)
    size = max(1, len(everywhere) // windows)
    chunks = [everywhere[i : i + size] for i in range(0, len(everywhere), size)][:windows]
    p50 = median([percentile(c, 50) for c in chunks])
    p99 = median([percentile(c, 99) for c in chunks])
    table = Table(
        f"Replication lag, three regions on loopback, {settings.lag_write_rate:.0f} writes/s"
        f" of background load at us, {len(complete)} probes",
        ["seen at", "p50 ms", "p99 ms", "max ms"],
    )
    data: dict[str, Any] = {"probes": len(samples), "unseen_probes": missing}
    for region, lags in per_region.items():
        table.rows.append(
            [region, fmt(percentile(lags, 50), 1), fmt(percentile(lags, 99), 1),
             fmt(max(lags, default=float("nan")), 1)]
        )  # fmt: skip
        data[region] = {"p50_ms": percentile(lags, 50), "p99_ms": percentile(lags, 99)}
    table.rows.append(
        ["every region", fmt(p50, 1), fmt(p99, 1), fmt(max(everywhere, default=float("nan")), 1)]
    )
    data["everywhere"] = {"p50_ms": p50, "p99_ms": p99}
    plot = plots.latency_cdfs(
        out / "replication_lag.png",
        "Replication lag: write acknowledged at us until visible",
        {"three regions": {**{f"at {r}": v for r, v in per_region.items()},
                           "everywhere": everywhere}},
        "lag (ms, log scale)",
    )  # fmt: skip
    return ScenarioResult(
        "lag",
        "Replication lag",
        data,
        [table],
        [at_most("replication lag p99 (visible in every region)", p99, 50, " ms")],
        [plot],
        [f"{missing} probes were not seen everywhere within {WATCH_LIMIT_S:.0f} s"]
        if missing
        else [],
    )

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

from fencemark.bench import drivers, plots
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
        async with drivers.region_clients(cluster.addresses) as clients:
            samples = await _measure(clients, settings, progress)
    finally:
        await cluster.stop()
    return _report(samples, settings, out)


Sample = tuple[float, dict[str, float]]  # (acknowledged at, region -> lag seconds)


async def _measure(
    clients: dict[str, AsyncClient], settings: Settings, progress: Progress
) -> list[Sample]:
    writer = clients["us"]
    tags = typical_tags("us")
    background = []
    for i in range(BACKGROUND_RECORDS):
        made = await writer.remember(REPO, "lag", f"load-{i}", title="background", tags=tags)
        background.append(made.record.key)
    probe = (await writer.remember(REPO, "lag", "probe", title="probe", tags=tags)).record.key
    await _warm_up(clients, probe, progress)
    run = _LagRun(clients, settings, progress, probe)
    load_task = asyncio.create_task(run.load(background))
    watchers = [asyncio.create_task(run.watch(region)) for region in REGIONS[1:]]
    try:
        await run.probes()
        run.probing = False
        await asyncio.gather(*watchers)
    finally:
        run.probing = False
        run.stop.set()
        await load_task
        for task in watchers:
            task.cancel()
    if run.skipped:
        progress.line(f"background load fell behind: {run.skipped} writes skipped")
    return run.samples


class _LagRun:
    """One measurement: the background load, the probes at ``us`` and a watcher per
    other region, sharing what is outstanding."""

    def __init__(
        self,
        clients: dict[str, AsyncClient],
        settings: Settings,
        progress: Progress,
        probe: str,
    ) -> None:
        self.clients = clients
        self.writer = clients["us"]
        self.settings = settings
        self.progress = progress
        self.probe = probe
        self.stop = asyncio.Event()
        self.in_flight = asyncio.Semaphore(MAX_IN_FLIGHT)
        self.samples: list[Sample] = []
        self.skipped = 0
        self.probing = True
        # region -> seq -> (acknowledged, lags) of probes not yet seen there
        self.outstanding: dict[str, dict[int, Sample]] = {region: {} for region in REGIONS[1:]}

    async def _one_write(self, key: str, n: int) -> None:
        try:
            await self.writer.update(key, fields={"body": f"load {n}"})
        finally:
            self.in_flight.release()

    async def load(self, background: list[str]) -> None:
        """Open-loop writes at ``lag_write_rate`` until ``stop``."""
        n = 0
        began = time.monotonic()
        tasks: set[asyncio.Task[None]] = set()
        while not self.stop.is_set():
            n += 1
            due = began + n / self.settings.lag_write_rate
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            if self.in_flight.locked():
                self.skipped += 1  # the node is behind; an open loop does not queue up
                continue
            await self.in_flight.acquire()
            task = asyncio.create_task(self._one_write(random.choice(background), n))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks, return_exceptions=True)

    async def watch(self, region: str) -> None:
        """Read the probe at ``region`` until every outstanding probe was seen there
        (or given up on after ``WATCH_LIMIT_S``)."""
        client, waiting = self.clients[region], self.outstanding[region]
        while self.probing or waiting:
            if waiting:
                with contextlib.suppress(FencemarkError):
                    record = await client.get(self.probe)
                    seen, now = int(record.fields.get("seq", "0")), time.monotonic()
                    for seq in [s for s in waiting if s <= seen]:
                        acknowledged, lags = waiting.pop(seq)
                        lags[region] = now - acknowledged
                now = time.monotonic()
                for seq in [s for s, (a, _) in waiting.items() if now - a > WATCH_LIMIT_S]:
                    del waiting[seq]  # never seen in time: reported as unseen
            await asyncio.sleep(WATCH_POLL_S)

    async def probes(self) -> None:
        """A numbered probe write every ``lag_probe_interval`` for ``lag_seconds``."""
        seq = 0
        deadline = time.monotonic() + self.settings.lag_seconds
        while time.monotonic() < deadline:
            seq += 1
            await self.writer.update(self.probe, fields={"seq": str(seq)})
            acknowledged = time.monotonic()
            lags: dict[str, float] = {}
            self.samples.append((acknowledged, lags))
            for region in REGIONS[1:]:
                self.outstanding[region][seq] = (acknowledged, lags)
            self.progress.status(f"{seq} probes, {len(self.samples)} with lags")
            await asyncio.sleep(self.settings.lag_probe_interval)


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


def _report(samples: list[Sample], settings: Settings, out: Path) -> ScenarioResult:
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
        [at_most("replication lag p99 (visible in every region)", p99, 30, " ms")],
        [plot],
        [f"{missing} probes were not seen everywhere within {WATCH_LIMIT_S:.0f} s"]
        if missing
        else [],
    )

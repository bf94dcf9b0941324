"""Scenario 7: the change feed (``Records.Watch``, SPEC §9) in a three-region loopback cluster.

- **Delivery**: at ``us`` a writer updates 64 records of one topic in turn at
  ``feed_write_rate`` (open loop), each write carrying its sequence number in a
  field; one watcher per region (``us`` itself, ``eu``, ``ap``) watches that topic
  through the Python client's ``watch()``. A write's delivery latency at a region is
  from the moment ``us`` acknowledged it to the moment the watcher received the
  first event of that record showing its number or a later one (a region that
  merged two writes of a record at once shows one event: both are delivered by it,
  and counted as merged). One process, one monotonic clock. At ``us`` the event
  can be received before the writer hears the acknowledgement: the latency is then
  negative, and counted.
- **Write-path cost**: ``feed_cost.py``.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import time
from collections.abc import Callable
from pathlib import Path

from fencemark.bench import drivers
from fencemark.bench.feed_cost import measure_cost
from fencemark.bench.feed_report import Delivered, report
from fencemark.bench.progress import Progress
from fencemark.bench.records import REPO, typical_tags
from fencemark.bench.results import ScenarioResult, Settings
from fencemark.client import AsyncClient, FencemarkError
from fencemark.node.api.budgets import Limits
from fencemark.node.tools.cluster import LocalCluster

REGIONS = ("us", "eu", "ap")
WRITER = REGIONS[0]
TOPIC = "feed"
POOL = 64  # records the writer updates in turn
MAX_IN_FLIGHT = 32  # writes outstanding at once
DELIVERY_LIMIT_S = 10.0  # after the last write, for every region to receive it
WARM_UP_LIMIT_S = 30.0
WARM_UP_TRY_S = 1.0  # for one warm-up write to reach every watcher


async def run_feed(settings: Settings, progress: Progress, work: Path, out: Path) -> ScenarioResult:
    # Every watcher of the cost runs comes from this one machine: one client to the
    # node, whose cap on open streams per client (64) they would pass; the read budget
    # goes up with it, as the node asks (streams per client below reads).
    streams = max(settings.feed_watchers, default=0) + 16
    reads = max(Limits.read, streams + Limits.read)
    node_args = (f"--max-streams-per-client={streams}", f"--max-concurrent-reads={reads}")
    cluster = await LocalCluster.start(REGIONS, work / "feed", node_args=node_args)
    try:
        async with drivers.region_clients(cluster.addresses) as clients:
            delivered = await measure_delivery(clients, settings, progress)
        node = cluster.nodes[WRITER]
        costs = await measure_cost(node.address, node.proc.pid, WRITER, settings, progress)
    finally:
        await cluster.stop()
    return report(delivered, costs, settings, out)


async def measure_delivery(
    clients: dict[str, AsyncClient], settings: Settings, progress: Progress
) -> Delivered:
    writer = clients[WRITER]
    tags = typical_tags(WRITER)
    keys = [
        (await writer.remember(REPO, TOPIC, f"item-{i}", title="feed", tags=tags)).record.key
        for i in range(POOL)
    ]
    marker = (await writer.remember(REPO, TOPIC, "marker", title="marker", tags=tags)).record.key
    run = _DeliveryRun(clients, settings, progress, marker)
    watchers = [asyncio.create_task(run.watch(region)) for region in REGIONS]
    try:
        await run.warm_up()
        await run.write(keys)
        await run.until_delivered()
    finally:
        for task in watchers:
            task.cancel()
        ended = await asyncio.gather(*watchers, return_exceptions=True)
    failed = [e for e in ended if isinstance(e, Exception)]  # not their cancellation
    if failed:
        raise failed[0]
    if run.skipped:
        progress.line(f"the writer fell behind: {run.skipped} writes skipped")
    return run.delivered()


class _DeliveryRun:
    """The writer at ``us`` and a watcher per region, sharing what was written and seen."""

    def __init__(
        self, clients: dict[str, AsyncClient], settings: Settings, progress: Progress, marker: str
    ) -> None:
        self.clients = clients
        self.settings = settings
        self.progress = progress
        self.marker = marker
        self.acked: dict[tuple[str, int], float] = {}  # (key, seq) -> acknowledged at
        self.last: dict[str, int] = {}  # key -> its latest acknowledged seq
        self.seen: dict[str, dict[str, list[tuple[int, float]]]] = {r: {} for r in REGIONS}
        self.latest: dict[str, dict[str, int]] = {r: {} for r in REGIONS}
        self.skipped = 0
        self.errors = 0
        self.arrived = asyncio.Event()  # set by every event a watcher notes

    async def watch(self, region: str) -> None:
        """Note when each event of the topic arrives (until cancelled)."""
        async for event in self.clients[region].watch(REPO, topic=TOPIC):
            now = time.monotonic()
            text = event.record.fields.get("seq")
            if text is None:
                continue  # a record's creation
            seq = int(text)
            self.latest[region][event.key] = max(seq, self.latest[region].get(event.key, seq))
            if event.key != self.marker:
                self.seen[region].setdefault(event.key, []).append((seq, now))
            self.arrived.set()

    async def _until(self, done: Callable[[], bool], deadline: float) -> bool:
        """Wait for events until ``done()`` or the (monotonic) ``deadline``."""
        while not done():
            self.arrived.clear()
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    await self.arrived.wait()
            except TimeoutError:
                return done()
        return True

    def _everywhere(self, key: str, seq: int) -> bool:
        return all(self.latest[r].get(key, -1) >= seq for r in REGIONS)

    async def warm_up(self) -> None:
        """Until three marker writes in a row reach every watcher within 100 ms: every
        stream is open, and pushes flow (nodes started together may be backing off
        from peers that were not listening yet; that is start-up, not delivery)."""
        self.progress.status("warming up: waiting for a write to reach every watcher")
        writer = self.clients[WRITER]
        deadline = time.monotonic() + WARM_UP_LIMIT_S
        fast, seq = 0, 0
        while fast < 3 and time.monotonic() < deadline:
            seq += 1
            await writer.update(self.marker, fields={"seq": str(seq)})
            written = time.monotonic()
            # A stream not open yet misses this write for good: try the next one soon.
            within = min(deadline, written + WARM_UP_TRY_S)
            await self._until(functools.partial(self._everywhere, self.marker, seq), within)
            fast = fast + 1 if time.monotonic() - written < 0.1 else 0
        if fast < 3:
            raise RuntimeError(f"writes did not reach every watcher within {WARM_UP_LIMIT_S} s")

    async def _one(self, key: str, seq: int, busy: set[str], slots: asyncio.Semaphore) -> None:
        try:
            await self.clients[WRITER].update(key, fields={"seq": str(seq)})
            self.acked[(key, seq)] = time.monotonic()
            self.last[key] = seq
        except FencemarkError:
            self.errors += 1
        finally:
            busy.discard(key)
            slots.release()

    async def write(self, keys: list[str]) -> None:
        """Open-loop updates at ``feed_write_rate`` for ``feed_seconds``. A record is never
        written twice at once (its writes would commit in either order), so a write due
        on a record still being written, or beyond ``MAX_IN_FLIGHT``, is skipped."""
        rate, seconds = self.settings.feed_write_rate, self.settings.feed_seconds
        slots = asyncio.Semaphore(MAX_IN_FLIGHT)
        busy: set[str] = set()
        tasks: set[asyncio.Task[None]] = set()
        began = time.monotonic()
        for seq in range(1, round(rate * seconds) + 1):
            await asyncio.sleep(max(0.0, began + seq / rate - time.monotonic()))
            key = keys[seq % len(keys)]
            if key in busy or slots.locked():
                self.skipped += 1  # an open loop does not queue up
                continue
            await slots.acquire()
            busy.add(key)
            task = asyncio.create_task(self._one(key, seq, busy, slots))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            self.progress.status(f"delivery: {len(self.acked):,} writes acknowledged")
        await asyncio.gather(*tasks)

    async def until_delivered(self) -> None:
        """Until every region has received every acknowledged write (or the limit)."""
        await self._until(
            lambda: all(self._everywhere(key, seq) for key, seq in self.last.items()),
            time.monotonic() + DELIVERY_LIMIT_S,
        )

    def delivered(self) -> Delivered:
        """Each region's latency per acknowledged write (None: never received)."""
        result = Delivered(writes=len(self.acked), skipped=self.skipped, errors=self.errors)
        for region in REGIONS:
            latencies: list[float | None] = []
            merged = 0
            seen = {key: sorted(events) for key, events in self.seen[region].items()}
            for (key, seq), acknowledged in self.acked.items():
                events = seen.get(key, [])
                at = bisect.bisect_left(events, (seq, -1.0))
                if at == len(events):
                    latencies.append(None)
                    continue
                shown, received = events[at]
                merged += shown > seq
                latencies.append(received - acknowledged)
            result.latencies[region] = latencies
            result.merged[region] = merged
            result.events[region] = sum(len(e) for e in self.seen[region].values())
        return result

"""Watchers of the run's repository: one per region, at its own node, for the whole
run, through every fault (invariant 13, ``watch_invariants.py``). Every topic: the
backlog, the probes' notes, split births, forgeries, and the work queue, whose
records' fields each event keeps (invariant 13 finds its writes in them).

Each follows ``Records.Watch`` with the published client's ``watch()``, which resumes
by itself from the last event it gave across disconnects, restarts, ``kill -9``,
pauses and cut-offs. When the node refuses its cursor ``CURSOR_EXPIRED`` (its disk was
lost: a new feed, under a new node id) the watcher says so (the segment ends
``expired``) and starts a new segment at the first change of the node's new feed
(``<node id>.0``, the node id from ``Info``): a new feed starts with an empty store,
so from there it shows everything the node holds, and the whole of it is judged.

A watcher takes its events as they come: the node's send to one that stops taking
them stalls only once the stream's buffers (several MB) are full, which a run's
records never fill; that path (cut off as too slow, the event
in flight still arriving) is test_watch_slow.py's. What a node reads for its
watchers while it is restarted, killed, paused and catching up, with most reads
going to its file (``cluster.CACHE_SIZE``), is this module's.

At the end (after the final heal and convergence) ``finish`` writes two marks (in the
work queue's topic), lists each node's records once its watcher has seen the first,
waits for every watcher to see the second, stops them, and reads each node's current
feed afresh from where its watcher began it, through the second mark.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from fencemark.client import AsyncClient, CursorExpired, FencemarkError, WatchEvent
from fencemark.node.store.feed import cursor as feed_cursor
from fencemark.node.tools.workload import REPO
from tests.chaos.queue_work import QUEUE_TOPIC, is_queued, queue_key
from tests.chaos.watch_invariants import Seen, Segment, WatchLog, reread_from
from tests.chaos.workload import Workload

MARKS = (queue_key("watch-mark-1"), queue_key("watch-mark-2"))
RECONNECT_S = 0.2  # between the client's tries while its node is away
END_LIMIT_S = 60.0  # for a mark to reach every watcher, and for a re-read
TRIES = 10_000  # asking a node that is away for its node id (RECONNECT_S apart)


def seen_of(event: WatchEvent) -> Seen:
    """``event`` as kept: its commit time moved to this process's monotonic clock."""
    committed = event.committed_at.timestamp() if event.committed_at else 0.0
    now, record = time.monotonic(), event.record
    fields = dict(record.fields) if is_queued(event.key) else {}  # a note record's are many
    return Seen(event.cursor, event.kind, event.key, record.digest, record.fence, fields,
                committed - (time.time() - now), now)  # fmt: skip


class Watchers:
    """A watcher per region, and the end of the run that judges them."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.logs = {region: WatchLog(region) for region in workload.regions}
        self._clients = {region: workload.client(region) for region in workload.regions}
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._follow(r)) for r in self.workload.regions]

    async def _follow(self, region: str) -> None:
        log, client = self.logs[region], self._clients[region]
        cursor = await self._beginning(client)
        while True:
            segment = Segment(cursor)
            log.segments.append(segment)
            try:
                await self._take(client, segment)
            except CursorExpired as exc:  # the node's feed is not the one it followed
                segment.ended = f"expired: {exc}"[:300]
                cursor = await self._beginning(client)
            except FencemarkError as exc:  # not an end the client resumes from by itself
                segment.ended = f"refused: {type(exc).__name__}: {exc}"[:300]
                cursor = segment.events[-1].cursor if segment.events else segment.start
                await asyncio.sleep(RECONNECT_S)

    async def _take(self, client: AsyncClient, segment: Segment) -> None:
        events = client.watch(REPO, cursor=segment.start, reconnect_seconds=RECONNECT_S)
        async with contextlib.aclosing(events):
            async for event in events:
                segment.events.append(seen_of(event))

    @staticmethod
    async def _beginning(client: AsyncClient) -> str:
        """The cursor before the first change of the node's feed as it is now."""
        for _ in range(TRIES):
            try:
                return feed_cursor((await client.info()).node_id, 0)
            except FencemarkError:
                await asyncio.sleep(RECONNECT_S)
        raise AssertionError(f"a node did not answer Info in {TRIES} tries")

    # -- the end of the run ------------------------------------------------------------

    async def finish(self) -> None:
        """The marks, every node's records between them, then the re-reads."""
        try:
            await self._mark(MARKS[0])
            for region, log in self.logs.items():
                await self._list(region, log)
            await self._mark(MARKS[1])
        finally:
            await self.stop()
        for region, log in self.logs.items():
            await self._reread(region, log)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _mark(self, key: str) -> None:
        """Create ``key`` in the topic; wait (bounded) until every watcher has it."""
        region = self.workload.regions[0]
        writer = self.workload.client(region, retries=4)
        name = key.rpartition("/")[2]
        try:
            await writer.remember(REPO, QUEUE_TOPIC, name, title="the end of a chaos run")
        except FencemarkError as exc:
            for log in self.logs.values():
                log.problems.append(f"the end mark {name} could not be written at {region}: {exc}")
            return
        deadline = time.monotonic() + END_LIMIT_S
        for log in self.logs.values():
            while not any(e.key == key for e in log.segments[-1].events):
                if time.monotonic() > deadline:
                    log.problems.append(f"the end mark {name} did not reach its watcher")
                    break
                await asyncio.sleep(0.1)

    async def _list(self, region: str, log: WatchLog) -> None:
        try:
            listing = self._clients[region].iter_records(REPO, include_deleted=True)
            log.ends = {record.key: record.digest async for record in listing}
        except FencemarkError as exc:
            log.problems.append(f"its node's records could not be listed: {exc}")

    async def _reread(self, region: str, log: WatchLog) -> None:
        """The node's current feed afresh, from where its watcher began it, to the end."""
        start = reread_from(log)
        if not start:
            return
        events = self._clients[region].watch(REPO, cursor=start)
        try:
            async with asyncio.timeout(END_LIMIT_S), contextlib.aclosing(events):
                async for event in events:
                    log.reread.append(seen_of(event))
                    if event.key == MARKS[1]:
                        return
        except (TimeoutError, FencemarkError) as exc:
            log.problems.append(f"the final re-read of its node's feed failed: {exc!r}")

"""The home records each lease's lapse soon after it runs out (SPEC §4).

Only the home decides that a lease has lapsed: elsewhere a renewal may not have
arrived yet, so other nodes refuse unfenced writes while a record has an
unreleased grant in their view. The home turns "the lease ran out" into state —
the token joins the record's ``lapsed`` set, durably, and replicates like any
write — which readmits unfenced writes on every node.

The watcher keeps the latest known expiry of every unreleased grant of a record
homed here, fed by every commit that leaves one (grants, renewals, merges:
``Replica.on_lease``) and, at start, by one scan of the file, and a heap of
``(expiry, key)`` with about one entry per key: a renewal only moves the known
expiry, and the entry due first looks it up when it comes round.
``Replica.record_lapse`` re-checks the state under the record's lock, so an entry
gone stale (renewed or released meanwhile) changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging

from fencemark.node.core.replica import Replica

log = logging.getLogger(__name__)

SCAN_PAGE = 500
SLACK_MS = 5  # look a little after the expiry, never before it


class LapseWatcher:
    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self._heap: list[tuple[int, str]] = []
        self._due: dict[str, int] = {}  # key -> the latest expiry committed
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.recorded = 0  # lapses this node recorded (metrics)
        replica.on_lease(self.watch)

    def watch(self, key: str, expiry_ms: int) -> None:
        known = self._due.get(key)
        self._due[key] = expiry_ms
        if known is not None and known <= expiry_ms:
            return  # the entry already in the heap comes round first
        heapq.heappush(self._heap, (expiry_ms, key))
        if self._heap[0] == (expiry_ms, key):
            self._wake.set()  # earlier than what the loop sleeps towards

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _scan(self) -> None:
        """Every unreleased grant already in the file, once at start."""
        replica, after = self.replica, ""
        while True:
            page = await replica.scan_all(after, SCAN_PAGE)
            for stored in page:
                record = stored.record
                if record.home_region == replica.region and record.fence.unreleased():
                    self.watch(record.key, record.fence.expiry(record.fence.fence))
            if len(page) < SCAN_PAGE:
                return
            after = page[-1].record.key

    async def _run(self) -> None:
        await self._scan()
        replica = self.replica
        while True:
            self._wake.clear()
            if not self._heap:
                await self._wake.wait()
                continue
            expiry, key = self._heap[0]
            pause = (expiry + SLACK_MS - replica.wall_ms()) / 1000
            if pause > 0:
                # Not wait_for: on Python 3.11 it can swallow a cancellation that
                # arrives with the wake-up, and the watcher would outlive its node.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(pause):
                        await self._wake.wait()
                continue
            heapq.heappop(self._heap)
            due = self._due.get(key)
            if due is None or due > expiry:
                if due is not None:  # renewed since: look again then
                    heapq.heappush(self._heap, (due, key))
                continue
            del self._due[key]
            if not self.replica.deciding:
                # Catching up: only a deciding home records a lapse; look again later.
                self.watch(key, replica.wall_ms() + 1000)
                continue
            try:
                recorded = await self.replica.record_lapse(key)
                self.recorded += recorded
            except Exception:  # a storage fault: never let the watcher die
                log.exception("recording the lapse of %s failed", key)
                self.watch(key, replica.wall_ms() + 1000)

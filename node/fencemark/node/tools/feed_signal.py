"""What a region's agents wait on when there is no work: their node's change feed.

``fencemark demo``'s agents do not poll for work. When ``ClaimNext`` finds nothing
in any region, an agent waits until its own region's node reports a change to the
topic — a new item, a release, a lapse, an item done elsewhere and replicated here,
a reopen: anything that can make an item eligible — and then asks again. One
:class:`FeedSignal` per region follows ``Records.Watch`` (SPEC §9) for all of that
region's agents and counts what it saw, by kind, for the progress line.

Two things make work available without a change the feed could report: a deferral
running out (``not_before`` passes; nothing is written) and, while a region is cut
off, a change at a region its node cannot hear from. So a wait also ends after a
fallback of a few seconds; :attr:`FeedSignal.woken` and :attr:`FeedSignal.lapsed`
count how each wait ended.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter

from fencemark.client import AsyncClient, CursorExpired, FencemarkError


class FeedSignal:
    """One node's feed of ``repo``/``topic``, as a signal agents can wait for."""

    def __init__(self, client: AsyncClient, repo: str, topic: str) -> None:
        self.client = client
        self.repo = repo
        self.topic = topic
        self.generation = 0  # events seen so far; an agent notes it before it asks for work
        self.kinds: Counter[str] = Counter()
        self.woken = 0  # waits ended by an event
        self.lapsed = 0  # waits ended by the fallback
        self._changed = asyncio.Condition()

    async def follow(self, stop: asyncio.Event) -> None:
        """Follow the feed until ``stop``; across a node that goes away the client
        resumes by itself, and a cursor the node no longer covers starts again from now."""
        while not stop.is_set():
            try:
                async for event in self.client.watch(self.repo, topic=self.topic):
                    self.kinds[event.kind] += 1
                    async with self._changed:
                        self.generation += 1
                        self._changed.notify_all()
                    if stop.is_set():
                        return
            except CursorExpired:
                continue  # missed changes only delay a wait: watch from now
            except FencemarkError:
                await asyncio.sleep(0.5)

    async def wait_after(self, generation: int, fallback_seconds: float) -> None:
        """Until an event after the ``generation`` the caller noted (before it asked
        for work, so an event in between is not missed), or ``fallback_seconds``."""
        async with self._changed:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(fallback_seconds):
                    while self.generation <= generation:
                        await self._changed.wait()
            if self.generation > generation:
                self.woken += 1
            else:
                self.lapsed += 1

    @property
    def events(self) -> int:
        return sum(self.kinds.values())
